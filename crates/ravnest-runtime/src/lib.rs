//! ravnest-runtime: the actors, as thin shells over the pure cores of `ravnest-core`.
//!
//! A [`node::NodeActor`] trains its share and takes part in ring all-reduces
//! ([`ravnest_core::ring::RingMember`]); the [`coordinator::CoordinatorActor`] runs the planner,
//! watches heartbeats ([`ravnest_core::detector::FailureDetector`]), hands out work, aborts and
//! re-plans when a node is lost, and lets restarted nodes back in. Both are generic over two
//! seams: [`seams::Transport`] (how envelopes travel: the simulated network in `ravnest-sim`,
//! TCP in `ravnest run`) and [`seams::Compute`] (how a training step is computed: virtual time
//! in the simulator, candle for real). There is no simulation-only branch in the actors.
//!
//! Time comes from tokio's clock (paused and virtual in the simulator); randomness never comes
//! from here: it lives in the seams' implementations, seeded.

pub mod chaos;
pub mod checkpoint;
pub mod collective;
pub mod conformance;
pub mod coordinator;
pub mod counters;
pub mod launch;
pub mod measure;
pub mod netns;
pub mod node;
pub mod p2p;
pub mod seams;
pub mod succession;
pub mod supervisor;
pub mod tcp;
pub mod trace;
pub mod wire;

pub use launch::{Launch, LaunchError, Nodes};
pub use seams::{Compute, Inbox, Transport, TransportError};
pub use trace::Trace;

//! The node actor: runs its standing assignment step after step, hands each gradient bucket to
//! its collective actor as backward produces it, applies what comes back, reports each step
//! asynchronously, and keeps model versions for peers that need them.
//!
//! A shell around the node's decisions ([`ravnest_protocol::node`]: the `NodeCore` with the
//! epoch being run and the next one, grants, halts, the versions kept and fetched, peers'
//! requests, the checkpoint duty; a step's collectives counted; local SGD's rounds; a pipeline
//! stage's order): gradients come from the [`Compute`](crate::seams::Compute) seam, and
//! synchronization runs in the node's [`crate::collective::CollectiveActor`]. [`actor`] hands
//! the messages to the decisions and carries out their effects, [`step`] runs one step (data
//! parallel or a pipeline stage). What the node measures of itself (its step time, its links)
//! is [`crate::measure`]'s.

pub mod actor;
pub mod state;
pub mod step;

use std::sync::Arc;
use std::time::Duration;

use ravnest_core::NodeId;
use tokio::time::Instant;

use crate::counters::Counters;
use crate::seams::Transport;
use ravnest_protocol::msg::Addr;

pub use state::{NodeMsg, NodeState};

/// A node actor (read-only configuration; mutable state lives in [`NodeState`]).
#[derive(Debug)]
pub struct NodeActor<T, C> {
    /// This node.
    pub id: NodeId,
    /// The network.
    pub transport: T,
    /// The compute backend.
    pub compute: Arc<C>,
    /// Bytes one full gradient stands for (buckets are charged their share).
    pub grad_bytes: u64,
    /// Bytes one model copy stands for.
    pub model_bytes: u64,
    /// Bytes a local-SGD round stands for per byte of gradient, where the backend's flat form
    /// does not say it (the simulator's toy has no optimizer state: the plan's figure); 1: the
    /// values exchanged, as many f32s as the gradient's bytes say per parameter.
    pub round_factor: f64,
    /// Counters.
    pub counters: Counters,
    /// Start of the run (spans are measured from it).
    pub t0: Instant,
    /// Fail-over: how the node watches the coordinator, and whom it tells what it decides.
    pub succession: Option<crate::succession::Succession>,
    /// Export the model into the counters after every step ([`crate::counters::NodeCounters::observed`]).
    pub observe: bool,
}

/// Whether the node starts with the initial model or must fetch state (it restarted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// First start: the seeded initial model is version 0.
    Fresh,
    /// Restart after a crash: no state; ask the coordinator to join.
    Rejoin,
    /// Start without state and wait for work naming a peer to fetch it from (a resumed run,
    /// where only the coordinator's host read the checkpoint).
    Empty,
}

/// A node process's heartbeat: a task beside the actor (so a long compute does not silence
/// it), sending to the coordinator every `period` ([`crate::seams::spawn_beats`]).
pub fn spawn_heartbeat<T: Transport>(
    transport: T,
    id: NodeId,
    period: Duration,
) -> tokio::task::JoinHandle<()> {
    crate::seams::spawn_beats(
        transport,
        Addr::Node(id),
        vec![Addr::Coordinator],
        period,
        ravnest_protocol::msg::Envelope::Heartbeat,
    )
}

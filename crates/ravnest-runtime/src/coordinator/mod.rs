//! The coordinator: a pure state machine ([`core::Coordinator`]) that plans epochs, watches
//! heartbeats, agrees steps, halts and re-plans on a loss, and lets nodes join; a thin actor
//! ([`actor::CoordinatorActor`]) that carries its messages; and the pure helpers that turn a
//! plan into assignments ([`assign`]).

pub mod actor;
pub mod assign;
pub mod core;
pub mod measure;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use ravnest_core::NodeId;

pub use actor::{CoordMsg, CoordinatorActor};
pub use core::{Config, Coordinator, Effect, Input, Tuning};

/// Something the coordinator did or saw, for reports.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A plan with a different split than the previous one (node, batch), from step `step`.
    Planned {
        /// Step it starts at.
        step: u64,
        /// Workers and their batches.
        workers: Vec<(NodeId, u64)>,
    },
    /// A node was declared dead.
    Detected {
        /// Node.
        node: NodeId,
        /// Silence when declared, ms.
        silent_ms: u64,
    },
    /// The running epoch was halted; steps from `step` on are redone by the survivors.
    Aborted {
        /// The first step not yet agreed.
        step: u64,
    },
    /// No step was agreed for `silent_ms` though every node is alive (a message was lost on a
    /// live link): the running epoch is halted and resumed from what every node holds.
    Resync {
        /// The first step not yet agreed.
        step: u64,
        /// How long nothing moved, ms.
        silent_ms: u64,
    },
    /// Measured speeds differ enough from the plan's that a re-plan is predicted to be
    /// faster: re-planned with measured figures.
    Rebalanced {
        /// The last agreed step when decided.
        step: u64,
        /// Predicted shortening of the slowest node's compute (0.25: 25%).
        predicted_gain: f64,
        /// Per worker: (node, seconds per sample assumed, seconds per sample measured).
        speeds: Vec<(NodeId, f64, f64)>,
    },
    /// A node (re)joined.
    Joined {
        /// Node.
        node: NodeId,
    },
    /// A checkpoint of model version `step` was committed; `digest` of its (first) shard.
    CheckpointComplete {
        /// Model version.
        step: u64,
        /// Digest.
        digest: u64,
    },
    /// A checkpoint shard was refused (its digest is not the agreed one, or no round expects
    /// it); the previous checkpoint stays the latest.
    Refused(String),
    /// Replicas disagreed after a step (a checker failure): the run stops.
    Violation(String),
    /// Training cannot go on.
    Stalled(String),
    /// All steps done.
    Finished,
}

impl Event {
    /// Short name for traces.
    pub fn kind(&self) -> &'static str {
        match self {
            Event::Planned { .. } => "planned",
            Event::Detected { .. } => "detected-dead",
            Event::Aborted { .. } => "aborted",
            Event::Resync { .. } => "resync",
            Event::Joined { .. } => "joined",
            Event::Rebalanced { .. } => "rebalanced",
            Event::CheckpointComplete { .. } => "checkpoint",
            Event::Refused(_) => "shard-refused",
            Event::Violation(_) => "violation",
            Event::Stalled(_) => "stalled",
            Event::Finished => "finished",
        }
    }

    /// The node it is about, if one.
    pub fn node(&self) -> Option<NodeId> {
        match self {
            Event::Detected { node, .. } | Event::Joined { node } => Some(*node),
            _ => None,
        }
    }
}

/// The coordinator's log: events with their times, and each step's agreement time.
#[derive(Debug, Clone, Default)]
pub struct RunLog {
    /// (ns since start, event).
    pub events: Vec<(u64, Event)>,
    /// Agreement time of each step, ns since start.
    pub step_done_ns: Vec<u64>,
    /// Whether the run used local SGD (replicas agree only after averaging rounds).
    pub local_sgd: bool,
    /// The model digest every replica reported, per synchronized version.
    pub synced_digest: BTreeMap<u64, u64>,
}

/// Shared handle on the log.
pub type SharedLog = Arc<Mutex<RunLog>>;

#[cfg(test)]
mod tests;

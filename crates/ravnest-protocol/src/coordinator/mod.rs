//! The coordinator's pure side: the state machine ([`core::Coordinator`]) that plans epochs,
//! watches heartbeats, agrees steps, halts and re-plans on a loss and lets nodes join; the
//! helpers that turn a plan into assignments ([`assign`]); measured speeds ([`measure`]);
//! fail-over's replica and watch ([`succession`]); and what it reports ([`Event`]). The actor
//! that carries its messages is ravnest-runtime's.

use ravnest_core::NodeId;

pub mod assign;
pub mod core;
pub mod measure;
pub mod succession;

/// Something the coordinator did or saw, for reports.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A plan with a different split than the previous one (node, batch), from step `step`.
    Planned {
        /// Step it starts at.
        step: u64,
        /// Workers and their batches.
        workers: Vec<(NodeId, u64)>,
        /// Pipeline stages: each stage's node and layers, in stage order per replica (empty
        /// for data parallel).
        stages: Vec<(NodeId, ravnest_core::LayerRange)>,
        /// The samples each node brings in, within every step's global batch: a
        /// data-parallel or sharded worker's, a pipeline replica's first stage's. Step s trains
        /// global samples `s·B + range` there ([`crate::digest::sample_range`]).
        samples: Vec<(NodeId, std::ops::Range<u64>)>,
    },
    /// Layers of the version to resume from were held only by lost nodes: the latest checkpoint
    /// is restored on `node`, and training goes back to it.
    Restoring {
        /// Where the checkpoint is restored.
        node: NodeId,
        /// Why (which layers were lost).
        why: String,
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
    /// Nodes left out for their measured speed are tried again at their configured speed
    /// (probation: a straggler that recovered comes back; each try waits twice as long), and
    /// that changes the plan.
    Probation {
        /// The last agreed step when decided.
        step: u64,
        /// The nodes tried again.
        nodes: Vec<NodeId>,
    },
    /// The data-parallel ring measured slower (or faster) than the links the plan assumed:
    /// every link's bandwidth is scaled by `scale` for planning, and the live nodes were
    /// re-planned when that changed the plan.
    LinksScaled {
        /// The last agreed step when decided.
        step: u64,
        /// The ring's measured time per step, s.
        ring_s: f64,
        /// Nodes in that ring.
        ring_nodes: usize,
        /// The factor on every link's bandwidth from now on.
        scale: f64,
        /// Whether the plan changed (a new epoch).
        replanned: bool,
    },
    /// This coordinator took over from a lost one (fail-over): `node` hosts term `term`, the
    /// predecessor was hosted by `from`, and training goes on from model version `step`.
    TookOver {
        /// The successor's node.
        node: NodeId,
        /// The lost coordinator's node.
        from: NodeId,
        /// The version training resumes from.
        step: u64,
        /// The new term.
        term: u32,
    },
    /// A node asked to leave (Ctrl-C): it is planned out at the next epoch.
    Leaving {
        /// Node.
        node: NodeId,
    },
    /// A node that asked to leave is no longer needed by any running epoch: it was told to stop.
    Left {
        /// Node.
        node: NodeId,
    },
    /// A node not in the cluster file was admitted as `node` (it joins at the next epoch).
    Admitted {
        /// Its new id.
        node: NodeId,
        /// Its name.
        name: String,
        /// What it measured (device, speed), as it said.
        device: String,
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
    /// No plan fits the live nodes after a loss (e.g. the side of a partition that kept the
    /// coordinator cannot hold the global batch): training waits at model version `step` for
    /// lost nodes to come back (for at most `Config::wait_for_nodes_ms`, then `Stalled`).
    Waiting {
        /// The version training goes on from.
        step: u64,
        /// Why the live nodes cannot train.
        why: String,
    },
    /// The checkpoint of `step` was complete but could not be written (a full disk, a write
    /// error): the previous checkpoint stays the latest, and training goes on (the next one is
    /// due at the next interval; a run whose last checkpoint fails ends with an error).
    CheckpointFailed {
        /// The checkpoint.
        step: u64,
        /// Why, naming the file.
        why: String,
    },
    /// A successor that took over while cut off from most of the members could not reach them
    /// for three silences: it gives its term up (its process leaves the run, which goes on
    /// under the coordinator it replaced, if that one lives).
    CutOff {
        /// The step it waited at.
        step: u64,
        /// Why it waited.
        why: String,
    },
    /// The checkpoint of `step` (0: a restore from the folder) was refused: a coordinator of the
    /// newer term `newer` writes to the folder (this one is stale: cut off or frozen while
    /// another node took over).
    Superseded {
        /// The checkpoint refused (0: the restore).
        step: u64,
        /// The newer term.
        newer: u32,
    },
    /// The user stopped the run (Ctrl-C, SIGTERM): it ends at version `at` (the steps in
    /// flight finish), with a checkpoint there when `checkpoint`; `at` is the last agreed
    /// version when no epoch ran (the latest checkpoint resumes).
    Stopping {
        /// The run's last version.
        at: u64,
        /// Whether that version is checkpointed.
        checkpoint: bool,
    },
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
            Event::Restoring { .. } => "restoring",
            Event::Aborted { .. } => "aborted",
            Event::Resync { .. } => "resync",
            Event::Joined { .. } => "joined",
            Event::TookOver { .. } => "took-over",
            Event::Leaving { .. } => "leaving",
            Event::Admitted { .. } => "admitted",
            Event::Left { .. } => "left",
            Event::Rebalanced { .. } => "rebalanced",
            Event::LinksScaled { .. } => "links-scaled",
            Event::Probation { .. } => "probation",
            Event::CheckpointComplete { .. } => "checkpoint",
            Event::Refused(_) => "shard-refused",
            Event::Violation(_) => "violation",
            Event::Waiting { .. } => "waiting",
            Event::Superseded { .. } => "superseded",
            Event::CutOff { .. } => "cut-off",
            Event::CheckpointFailed { .. } => "checkpoint-failed",
            Event::Stopping { .. } => "stopping",
            Event::Stalled(_) => "stalled",
            Event::Finished => "finished",
        }
    }

    /// The node it is about, if one.
    pub fn node(&self) -> Option<NodeId> {
        match self {
            Event::Detected { node, .. }
            | Event::Joined { node }
            | Event::TookOver { node, .. }
            | Event::Leaving { node }
            | Event::Admitted { node, .. }
            | Event::Left { node } => Some(*node),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests;

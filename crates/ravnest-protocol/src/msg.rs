//! What travels between nodes: addresses and typed envelopes.

use ravnest_core::collective::{CollId, CollMsg};
use ravnest_core::planner::sync::{Collective, Outer};
use ravnest_core::{ClusterSpec, LayerRange, NodeId};

use ravnest_core::pack::Packing;

use crate::digest::Fnv;

mod trace_digest;

/// Where an envelope goes. The coordinator lives in one node's process (its host).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum Addr {
    /// The coordinator.
    Coordinator,
    /// The checkpoint aggregator (in the coordinator's process).
    Checkpoint,
    /// A node.
    Node(NodeId),
}

/// How a step's result is synchronized.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum StepMode {
    /// Exact synchronous data parallel: average the gradients over the ring, then apply.
    Sync,
    /// Local SGD: apply this node's own mean gradient, no communication.
    Local,
    /// Local step, then average the models (weighted by batch share) over the ring.
    Average,
    /// Local step, then start an overlapped round's exchange and go on without it (the
    /// version made is this replica's own).
    Launch,
    /// Local step, then merge the overlapped round launched `delay` steps before: the version
    /// made is the round's outer step, which every replica agrees on; this replica goes on
    /// from it with its inner progress since the round carried over.
    Merge,
}

impl StepMode {
    /// Whether the version a step of this mode makes is one every replica of its group agrees
    /// on (checkpoints and restarts take only these).
    pub fn synchronized(self) -> bool {
        matches!(self, StepMode::Sync | StepMode::Average | StepMode::Merge)
    }
}

/// How the steps of an epoch are synchronized.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum SyncPolicy {
    /// Every step is [`StepMode::Sync`].
    EveryStep,
    /// Local SGD: [`StepMode::Local`] steps, and every `local_steps` steps from the epoch's
    /// first (and at the run's last step) an [`StepMode::Average`] step.
    LocalSgd {
        /// Steps per averaging period.
        local_steps: u32,
        /// What an averaging step does with the replicas' models, and how they travel.
        outer: Outer,
    },
}

/// A node's standing assignment for an epoch: it runs step after step on its own, from
/// `step` until the coordinator's grant (`until`) or the run's end, whichever comes first. The
/// collective of each step is the only synchronization; the coordinator is not on the path.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Work {
    /// Assignment epoch: bumped whenever the plan changes; older epochs are void.
    pub epoch: u64,
    /// The epoch's first step; the node starts it from model version `step` (the model after
    /// `step` steps). A node still running an older epoch finishes its steps below `step` first.
    pub step: u64,
    /// Steps below this may be started (the coordinator extends it with [`Envelope::Grant`]).
    pub until: u64,
    /// The run's last step + 1.
    pub end: u64,
    /// Global sample indices this node processes: `offset .. offset + batch` within each step.
    pub offset: u64,
    /// Samples this node processes per step.
    pub batch: u64,
    /// The global batch (gradient weight = batch / global_batch).
    pub global_batch: u64,
    /// Data parallel: samples computed at once, the batch's gradients accumulated over its
    /// micro-batches when the node's memory does not hold them all (0: the whole batch).
    pub chunk: u64,
    /// The group this node synchronizes with, in ring order.
    pub ring: Vec<NodeId>,
    /// A peer that holds (or will hold) model version `step`, when this node does not: it
    /// fetches the version from there before computing.
    pub state_from: Option<NodeId>,
    /// How steps are synchronized.
    pub sync: SyncPolicy,
    /// The collective: a ring in `ring` order, a two-level ring, or a parameter server
    /// (`ring[0]` is the server).
    pub collective: Collective,
    /// For a two-level ring: nodes per group (groups are consecutive in `ring`).
    pub group_size: u32,
    /// Pipeline stage work (`None`: data parallel, the whole model). With a stage, `offset` and
    /// `batch` are the replica's samples, and `ring` is the group of nodes that hold this
    /// stage's layers in every replica.
    pub stage: Option<StageWork>,
    /// This node writes a checkpoint shard of these layers at each checkpoint version.
    pub checkpoint: Option<CheckpointDuty>,
    /// Sharded data parallel: the part of the optimizer state this node holds and updates
    /// (`None`: it holds the state of every layer it computes).
    pub shard: Option<ShardWork>,
    /// Local SGD's outer momentum goes on from epoch `outer_from`'s round that made version
    /// `step` (every replica of the group holds the same one: the coordinator switched between
    /// epochs of the same sync groups at that round); `None`: it starts again at zero.
    pub outer_from: Option<u64>,
}

/// A sharded data-parallel worker's part: it holds every weight, and the optimizer state of
/// `parts[rank]` only, where `rank` is its place in [`Work::ring`]. The parts tile the model's
/// layers in the order of the ring's chunks: rank r's part comes right after rank r - 1's,
/// and rank n - 1 owns the first layers (a reduce-scatter leaves rank r owning chunk r + 1).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardWork {
    /// This node's part.
    pub owned: LayerRange,
    /// Each rank's part, in ring order.
    pub parts: Vec<LayerRange>,
    /// Layers of model version `step` (weights and optimizer state) this node lacks for its
    /// part and its weights, and the peer to fetch each range from before computing (a part
    /// moved by a re-plan, a node that joined).
    pub fetch: Vec<(NodeId, LayerRange)>,
}

/// Which versions a writer checkpoints: the first synchronized version at or past each
/// multiple of `every` (so 50, 100, 150 when every step is synchronized), the first one at or
/// past `catch_up` (a round whose writer was lost), and the last (`v == end`) when `at_end`.
/// The rule depends only on the versions, and the coordinator keeps the same one, so both sides
/// agree without a message per checkpoint, across re-plans and resumptions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CheckpointDuty {
    /// Layers of the shard.
    pub layers: LayerRange,
    /// Steps between checkpoints (0: only the last, if `at_end`).
    pub every: u64,
    /// A version from which the next synchronized one is due (`u64::MAX`: none).
    pub catch_up: u64,
    /// Also checkpoint the run's last version.
    pub at_end: bool,
    /// The previous synchronized version (the epoch's first, until it makes one).
    pub last: u64,
}

impl CheckpointDuty {
    /// Whether synchronized version `v` of a run ending at `end` is due.
    pub fn due(&self, v: u64, end: u64) -> bool {
        (self.every > 0 && (v / self.every > self.last / self.every || v >= self.catch_up))
            || (self.at_end && v == end)
    }

    /// Synchronized version `v` was made (and checkpointed if `due`).
    pub fn advance(&mut self, v: u64, end: u64) {
        if self.due(v, end) && v >= self.catch_up {
            self.catch_up = u64::MAX;
        }
        self.last = v;
    }
}

impl SyncPolicy {
    /// How many steps past the last agreed one a node may run, `base` for synchronous steps.
    /// A local-SGD epoch's nodes wait for each other at its rounds only: a step's noise then
    /// averages out over the round instead of stalling the faster node every few steps (on
    /// two processes sharing two cores, a window of 4 cost 8 points of compute utilisation).
    /// A switch to a new epoch still lands on a synchronized step, a round later at most.
    pub fn window(&self, base: u64) -> u64 {
        match self {
            SyncPolicy::EveryStep => base,
            SyncPolicy::LocalSgd { local_steps, .. } => base.max(u64::from(*local_steps)),
        }
        .max(1)
    }

    /// How step `s` of an epoch that starts at step `from`, in a run of `end` steps, is
    /// synchronized: the one schedule nodes and the coordinator both follow.
    ///
    /// Under local SGD a round ends every `local_steps` steps from `from`, and the run's last
    /// step is a round waited for. Overlapped, a round is launched there and merged `delay`
    /// steps later (see [`crate::msg::StepMode::Merge`]); a round whose merge would not come
    /// before the run's last step is left to that last step's round.
    pub fn mode(&self, from: u64, end: u64, s: u64) -> StepMode {
        let SyncPolicy::LocalSgd { local_steps, outer } = self else {
            return StepMode::Sync;
        };
        if s + 1 >= end {
            return StepMode::Average;
        }
        let h = u64::from((*local_steps).max(1));
        let delay = u64::from(outer.delay_within(*local_steps));
        let i = s + 1 - from.min(s + 1);
        if delay == 0 {
            return if i.is_multiple_of(h) {
                StepMode::Average
            } else {
                StepMode::Local
            };
        }
        if i.is_multiple_of(h) && s + delay + 1 < end {
            StepMode::Launch
        } else if i > delay && (i - delay).is_multiple_of(h) {
            StepMode::Merge
        } else {
            StepMode::Local
        }
    }

    /// The first version at or after `v` that a step of this schedule synchronizes (or
    /// `end`): where an epoch may hand over to the next.
    pub fn next_synchronized(&self, from: u64, end: u64, v: u64) -> u64 {
        (v.max(from)..end)
            .find(|&v| v == from || self.mode(from, end, v - 1).synchronized())
            .unwrap_or(end)
    }

    /// The newest version at or before `v` (and not before `from`) that the schedule
    /// synchronizes: the anchor of a round that ends at step `v`.
    pub fn last_synchronized(&self, from: u64, end: u64, v: u64) -> u64 {
        (from..=v.max(from))
            .rev()
            .find(|&v| v == from || self.mode(from, end, v - 1).synchronized())
            .unwrap_or(from)
    }
}

impl Work {
    /// For tests: epoch `epoch` of data-parallel steps every one synchronized, from `step` and
    /// granted below `until`, the run ending at 100, over `ring`; 8 samples of 16.
    #[cfg(test)]
    pub(crate) fn for_test(epoch: u64, step: u64, until: u64, ring: Vec<NodeId>) -> Work {
        Work {
            epoch,
            step,
            until,
            end: 100,
            offset: 0,
            batch: 8,
            global_batch: 16,
            chunk: 0,
            ring,
            state_from: None,
            sync: SyncPolicy::EveryStep,
            collective: Collective::Ring,
            group_size: 0,
            stage: None,
            checkpoint: None,
            shard: None,
            outer_from: None,
        }
    }

    /// How step `s` of this epoch is synchronized.
    pub fn mode(&self, s: u64) -> StepMode {
        self.sync.mode(self.step, self.end, s)
    }

    /// The layers this node computes (`None`: the whole model).
    pub fn layers(&self) -> Option<LayerRange> {
        self.stage.as_ref().map(|s| s.layers)
    }
}

/// A node's part in a pipeline step.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StageWork {
    /// This stage.
    pub stage: u32,
    /// Stages per replica.
    pub stages: u32,
    /// Layers this stage holds.
    pub layers: LayerRange,
    /// The previous stage's node in this replica (none on the first stage).
    pub prev: Option<NodeId>,
    /// The next stage's node in this replica (none on the last stage).
    pub next: Option<NodeId>,
    /// Samples per micro-batch.
    pub micro_batch: u64,
    /// Bytes per sample of the activations this stage sends forward (and of the gradient it
    /// receives back).
    pub out_bytes_per_sample: u64,
    /// Bytes per sample of the input gradient this stage sends back.
    pub in_bytes_per_sample: u64,
    /// Bytes of this stage's gradient (what its sync group all-reduces).
    pub sync_bytes: u64,
    /// Layers of model version `step` this node does not hold, and the peer to fetch each
    /// range from before computing (a pipeline re-planned after a loss or a rejoin).
    pub fetch: Vec<(NodeId, LayerRange)>,
}

/// A model version a node holds, as it tells the coordinator after a halt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HeldVersion {
    /// The version (the model after this many steps).
    pub version: u64,
    /// Whether every replica agreed on it (a synchronous or averaging step made it).
    pub synced: bool,
    /// The layers it is current for (`None`: the whole model).
    pub layers: Option<LayerRange>,
}

/// What a node measured about itself, reported when it registers (`ravnest run`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Capabilities {
    /// Measured dense matmul throughput, FLOP/s (after any emulated slowdown).
    pub flops: f64,
    /// Memory available for training, bytes.
    pub memory_bytes: u64,
    /// What was measured (device, threads), for the printed plan.
    pub device: String,
    /// The node's name (a node not in the cluster file joins by it).
    #[serde(default)]
    pub name: String,
    /// Where peers reach it (`host:port`), for a node not in the cluster file.
    #[serde(default)]
    pub address: Option<String>,
}

/// Typed envelopes. `virtual_bytes` is what the network charges for bandwidth: the simulated
/// gradient vectors are small, the bytes they stand for are the model's.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Envelope {
    /// I am alive.
    Heartbeat,
    /// A (re)started node asks to take part.
    Join,
    /// (Node → coordinator, `ravnest run`) a node starts and reports what it measured.
    Register(Capabilities),
    /// (Coordinator → nodes, `ravnest run`) training is over: the process may exit.
    Finish,
    /// A link probe: the receiver sends the same data back with `echo = false`.
    Probe {
        /// Probe id.
        id: u64,
        /// Payload (its size is what is measured).
        data: Vec<f32>,
        /// Whether the receiver should echo it.
        echo: bool,
    },
    /// (Coordinator → node, `ravnest run`) measure your links to these peers with probes and
    /// send a [`Envelope::LinkReport`].
    ProbePeers {
        /// Peers to probe.
        peers: Vec<NodeId>,
    },
    /// (Node → coordinator) measured links: (peer, latency ms, bandwidth Gbit/s).
    LinkReport {
        /// One entry per peer that answered.
        links: Vec<(NodeId, f64, f64)>,
    },
    /// (Coordinator → node, `ravnest run`) measure your training throughput now, all nodes at
    /// once (so the figure includes the contention a real step sees): steps of `batch`
    /// samples, optimizer included, for about `duration_ms`; answer with
    /// [`Envelope::Measured`].
    Measure {
        /// Samples per measured step.
        batch: u64,
        /// How long to measure.
        duration_ms: u64,
    },
    /// (Node → coordinator) what [`Envelope::Measure`] found: a step of b samples takes
    /// `overhead_s + b · per_sample_s` (fitted on two batch sizes).
    Measured {
        /// Samples per second at the batch asked for, optimizer step included.
        samples_per_s: f64,
        /// Seconds per sample.
        per_sample_s: f64,
        /// Fixed seconds per step.
        overhead_s: f64,
    },
    /// (Coordinator → node) a standing assignment from a step on.
    Work(Box<Work>),
    /// (Coordinator → node) steps of `epoch` below `until` may be started.
    Grant {
        /// The assignment's epoch.
        epoch: u64,
        /// The new horizon.
        until: u64,
    },
    /// (Coordinator → node) the user stopped the run (Ctrl-C, SIGTERM): it now ends at
    /// version `at` (at most the assignment's `end`; no node has started a step at or past it),
    /// and with `checkpoint` the writers checkpoint that last version.
    StopAt {
        /// The run's new last version.
        at: u64,
        /// Checkpoint version `at`.
        checkpoint: bool,
    },
    /// (Coordinator → node) a node of the group was lost: stop every step of `epoch` and
    /// earlier (collectives abort), and answer with [`Envelope::Halted`].
    Halt {
        /// The newest epoch to stop.
        epoch: u64,
    },
    /// (Node → coordinator) stopped for a [`Envelope::Halt`]; these versions are held.
    Halted {
        /// The halt's epoch.
        epoch: u64,
        /// Versions held.
        held: Vec<HeldVersion>,
    },
    /// (Pipeline) a stage's output activations for micro-batch `micro`, to the next stage.
    Activation {
        /// Epoch of the work.
        epoch: u64,
        /// Step.
        step: u64,
        /// Micro-batch.
        micro: u32,
        /// Activations.
        data: Vec<f32>,
        /// Bytes they stand for.
        virtual_bytes: u64,
    },
    /// (Pipeline) the gradient of a stage's input for micro-batch `micro`, to the previous
    /// stage.
    ActivationGrad {
        /// Epoch of the work.
        epoch: u64,
        /// Step.
        step: u64,
        /// Micro-batch.
        micro: u32,
        /// Gradient.
        data: Vec<f32>,
        /// Bytes it stands for.
        virtual_bytes: u64,
    },
    /// (Node → coordinator) the node cannot compute its work: training cannot go on as
    /// planned.
    StepFailed {
        /// Epoch of the work.
        epoch: u64,
        /// Why.
        reason: String,
    },
    /// A message of a collective (ring piece, parameter-server push or pull).
    Coll {
        /// The message (it names its collective).
        msg: CollMsg,
        /// Bytes it stands for.
        virtual_bytes: u64,
        /// What its values travel as on a real wire (they are already rounded to it).
        packing: Packing,
    },
    /// (Coordinator → checkpoint) a checkpoint of model version `step`, which every replica
    /// agreed on, begins: one shard per layer range, with the digest each must have.
    CheckpointBegin {
        /// Model version.
        step: u64,
        /// (layers, expected digest), one per shard.
        shards: Vec<(LayerRange, u64)>,
    },
    /// (Coordinator → checkpoint) layers were held only by lost nodes: send the latest complete
    /// checkpoint to node `to` ([`Envelope::Restored`]), for the halt of `epoch`.
    Restore {
        /// The node that will hold it and serve it to the others.
        to: NodeId,
        /// The halt's epoch.
        epoch: u64,
    },
    /// (Checkpoint → node) the latest complete checkpoint (`None`: there is none); the node
    /// keeps it as a synchronized whole version and answers the halt again.
    Restored {
        /// The halt's epoch.
        epoch: u64,
        /// The checkpoint's version and its whole model (parameters and optimizer state).
        checkpoint: Option<(u64, Vec<f32>)>,
    },
    /// (Coordinator → checkpoint) the checkpoint of `step` will not complete.
    CheckpointAbandon {
        /// Model version.
        step: u64,
    },
    /// (Node → checkpoint) a shard of a checkpoint version, sent by its writer when it reaches
    /// the version, in parts of at most [`SHARD_PART`] values in order (so that neither side
    /// holds a large shard at once: the checkpoint actor hands each part to its store); the
    /// checkpoint actor keeps it until the coordinator opens the round with the digest every
    /// replica agreed on.
    Shard {
        /// Model version.
        step: u64,
        /// Layers covered.
        layers: LayerRange,
        /// Digest of the whole shard.
        digest: u64,
        /// This part's values.
        model: Vec<f32>,
        /// Where they start in the shard.
        offset: u64,
        /// Values in the whole shard.
        total: u64,
        /// Bytes they stand for (the network charges them: a checkpoint takes time).
        virtual_bytes: u64,
    },
    /// Step finished on this node: digest of its new model.
    StepDone {
        /// Epoch of the work.
        epoch: u64,
        /// Step finished.
        step: u64,
        /// Digest of the model after the step.
        digest: u64,
        /// Nanoseconds this node spent computing its share (the coordinator's drift measure).
        compute_ns: u64,
        /// Nanoseconds from the end of its compute until its collectives came back (the
        /// coordinator's measure of the ring; 0 for a step without one).
        comm_ns: u64,
    },
    /// Send model version `version` to `to` (only the parameters of `layers`, when given).
    StateRequest {
        /// Version wanted.
        version: u64,
        /// Who wants it.
        to: NodeId,
        /// Layers wanted (`None`: the whole model).
        layers: Option<LayerRange>,
    },
    /// A model version (or the parameters of some of its layers).
    State {
        /// Version.
        version: u64,
        /// Parameters.
        model: Vec<f32>,
        /// Bytes it stands for.
        virtual_bytes: u64,
        /// The layers `model` holds (`None`: the whole model).
        layers: Option<LayerRange>,
    },
    /// (`ravnest run`, handled by the TCP transport) peers reach `node` at `addr` (a node
    /// started with `--advertise` says so to the coordinator's host, which passes it on).
    Address {
        /// The node.
        node: NodeId,
        /// host:port.
        addr: String,
    },
    /// (Worker → coordinator, `ravnest run`, after `Finish`) this node's report, as JSON.
    Report(String),
    /// (Coordinator → workers, `ravnest run`) the run's final report, as JSON: every node
    /// prints the same table.
    Summary(String),
    /// (Coordinator → nodes, with fail-over) what a successor needs to go on
    /// (the coordinator's `succession` module).
    Succession(Box<Replica>),
    /// (Node → coordinator) this node is stopping (Ctrl-C): plan it out at the next epoch, and
    /// answer with [`Envelope::Finish`] once no running epoch needs it.
    Leave,
    /// (Coordinator → nodes) a node not in the cluster file joined as `id`: every process hands
    /// later joiners the file and these members (so they number the nodes alike).
    Member {
        /// Its id (the next after the file's nodes and earlier members).
        id: NodeId,
        /// Its name.
        name: String,
        /// Where peers reach it.
        address: String,
    },
    /// (Coordinator → nodes, with fail-over) the coordinator's lease, every heartbeat period:
    /// it is there, of `term`, hosted by `host`. A node that knows a newer term answers the
    /// host with its replica ([`Envelope::Succession`]), and that coordinator steps down.
    Lease {
        /// The coordinator's term.
        term: u32,
        /// Its host.
        host: NodeId,
    },
    /// (The coordinator's host → its coordinator, `ravnest run --join` with a new name) the
    /// host gave a joiner the next id, `id`, and put its section in the cluster file it hands
    /// out: the coordinator admits it there (and tells every node, [`Envelope::Member`]). The
    /// joiner's own `Register` follows with what it measured. Ids are given in one place, in
    /// order, so two joiners never share one.
    Reserve {
        /// The id given.
        id: NodeId,
        /// The joiner's name.
        name: String,
        /// Where peers reach it.
        address: String,
    },
    /// (Node → node, with fail-over) a pre-vote: the sender is the coordinator's successor
    /// and would take over as term `term`; has this node lost the coordinator too? A node
    /// takes over only once a majority of its replica's members (the host left out) say yes,
    /// so that one node cut off alone cannot unseat a coordinator the others still hear.
    PreVote {
        /// The term the sender would start.
        term: u32,
    },
    /// (Node → node) the answer to a [`Envelope::PreVote`] of `term`.
    PreVoted {
        /// The term asked about.
        term: u32,
        /// Whether this node lost the coordinator too (and knows no newer term).
        granted: bool,
    },
    /// (Node → node) one part's piece of a step's global gradient norm, under `[run]
    /// max_grad_norm` when no node holds the whole gradient: a pipeline stage's (sent to its
    /// neighbours in the replica, who pass it on away from where it came) or a sharded
    /// worker's owned part (sent to the rest of its group). Every node sums the pieces in part
    /// order, so all of them clip by the same factor.
    GradNorm {
        /// Epoch of the work.
        epoch: u64,
        /// Step.
        step: u64,
        /// The part: a stage's index, or a sharded worker's rank in its ring.
        part: u32,
        /// Σ x² over the part's averaged gradient.
        sq: f64,
    },
}

/// What a successor needs to go on: sent by the coordinator to the nodes.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Replica {
    /// The coordinator's term (0 for the first coordinator; a successor's is one more).
    pub term: u32,
    /// The node whose process hosts the coordinator of this term.
    pub host: NodeId,
    /// The current epoch.
    pub epoch: u64,
    /// The first step of the oldest epoch still running: a node that holds only older
    /// versions was still fetching, and must not drag the others back.
    pub floor: u64,
    /// Every step below this is agreed.
    pub agreed: u64,
    /// The nodes the coordinator watches and believes alive (its host included).
    pub members: Vec<NodeId>,
    /// The nodes the running epochs count on (workers, and peers they fetch from): a
    /// successor resumes from what they hold; a node left idle holds an older version.
    pub involved: Vec<NodeId>,
    /// Nodes given their place by the coordinator's host (`run --join` with a new name) that
    /// have not registered yet: a successor admits them when they do, and leases them so that
    /// they follow it.
    pub reserved: Vec<NodeId>,
    /// The cluster with the figures the coordinator plans with (measured speeds and links).
    pub cluster: ClusterSpec,
}

/// Values per part of a checkpoint shard ([`Envelope::Shard`]): 1 MiB.
pub const SHARD_PART: usize = 1 << 18;

/// Bytes of a control message on the wire (header, ids, small fields).
pub const CONTROL_BYTES: u64 = 256;

impl Envelope {
    /// Bytes the network charges for this envelope.
    pub fn wire_bytes(&self) -> u64 {
        match self {
            Envelope::Coll { virtual_bytes, .. }
            | Envelope::State { virtual_bytes, .. }
            | Envelope::Shard { virtual_bytes, .. }
            | Envelope::Activation { virtual_bytes, .. }
            | Envelope::ActivationGrad { virtual_bytes, .. } => *virtual_bytes + CONTROL_BYTES,
            Envelope::Work(w) => CONTROL_BYTES + 4 * w.ring.len() as u64,
            _ => CONTROL_BYTES,
        }
    }

    /// Whether this is bulk data (chunks, model state) rather than control. Transports keep
    /// order within each class between two addresses; control may overtake bulk data (it
    /// travels on its own connection, so a heartbeat never waits behind a gradient).
    pub fn is_bulk(&self) -> bool {
        matches!(
            self,
            Envelope::Coll { .. }
                | Envelope::State { .. }
                | Envelope::Shard { .. }
                | Envelope::Probe { .. }
                | Envelope::Activation { .. }
                | Envelope::ActivationGrad { .. }
        )
    }

    /// Short name for traces and reports.
    pub fn kind(&self) -> &'static str {
        match self {
            Envelope::Heartbeat => "heartbeat",
            Envelope::Join => "join",
            Envelope::Register(_) => "register",
            Envelope::Finish => "finish",
            Envelope::Probe { .. } => "probe",
            Envelope::ProbePeers { .. } => "probe-peers",
            Envelope::LinkReport { .. } => "link-report",
            Envelope::Measure { .. } => "measure",
            Envelope::Measured { .. } => "measured",
            Envelope::Work(_) => "work",
            Envelope::Grant { .. } => "grant",
            Envelope::StopAt { .. } => "stop-at",
            Envelope::Halt { .. } => "halt",
            Envelope::Halted { .. } => "halted",
            Envelope::Restore { .. } => "restore",
            Envelope::Restored { .. } => "restored",
            Envelope::Activation { .. } => "activation",
            Envelope::ActivationGrad { .. } => "activation-grad",
            Envelope::StepFailed { .. } => "step-failed",
            Envelope::Coll {
                msg: CollMsg::Chunk(_),
                ..
            } => "chunk",
            Envelope::Coll {
                msg: CollMsg::Push { .. },
                ..
            } => "push",
            Envelope::Coll {
                msg: CollMsg::Pull { .. },
                ..
            } => "pull",
            Envelope::StepDone { .. } => "step-done",
            Envelope::CheckpointBegin { .. } => "checkpoint-begin",
            Envelope::CheckpointAbandon { .. } => "checkpoint-abandon",
            Envelope::Shard { .. } => "shard",
            Envelope::StateRequest { .. } => "state-request",
            Envelope::State { .. } => "state",
            Envelope::Address { .. } => "address",
            Envelope::Report(_) => "report",
            Envelope::Summary(_) => "summary",
            Envelope::Succession(_) => "succession",
            Envelope::Leave => "leave",
            Envelope::Member { .. } => "member",
            Envelope::Lease { .. } => "lease",
            Envelope::Reserve { .. } => "reserve",
            Envelope::PreVote { .. } => "pre-vote",
            Envelope::PreVoted { .. } => "pre-voted",
            Envelope::GradNorm { .. } => "grad-norm",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use ravnest_core::planner::sync::Outer;

    fn local_sgd(h: u32, delay: u32) -> SyncPolicy {
        let mut outer = Outer {
            lr: 0.7,
            momentum: 0.9,
            ..Outer::AVERAGE
        };
        outer.overlap = delay > 0;
        outer.delay = delay;
        SyncPolicy::LocalSgd {
            local_steps: h,
            outer,
        }
    }

    proptest! {
        /// The schedule against a simple oracle: rounds every `h` steps from the epoch's first;
        /// overlapped, each launch merged `delay` steps later (before the next launch), and a
        /// launch whose merge would not come before the last step left to the last step's
        /// waited round; the last step always a waited round. The versions the schedule
        /// synchronizes are what `next_synchronized` and `last_synchronized` find.
        #[test]
        fn schedule_matches_its_oracle(
            h in 1u32..12,
            delay in 0u32..14,
            from in 0u64..30,
            len in 1u64..80,
        ) {
            let p = local_sgd(h, delay);
            let end = from + len;
            let d = u64::from(delay.min(h.saturating_sub(1)));
            let hh = u64::from(h);
            let mut launched: Option<u64> = None;
            for s in from..end {
                let i = s + 1 - from;
                let want = if s + 1 == end {
                    StepMode::Average
                } else if d == 0 {
                    if i % hh == 0 { StepMode::Average } else { StepMode::Local }
                } else if i % hh == 0 && s + d < end - 1 {
                    StepMode::Launch
                } else if i > d && (i - d) % hh == 0 {
                    StepMode::Merge
                } else {
                    StepMode::Local
                };
                let got = p.mode(from, end, s);
                prop_assert_eq!(got, want, "step {}", s);
                match got {
                    StepMode::Launch => {
                        prop_assert!(launched.is_none(), "step {}: a round still open", s);
                        launched = Some(s);
                    }
                    StepMode::Merge => {
                        prop_assert_eq!(launched.take(), Some(s - d), "step {}", s);
                    }
                    StepMode::Average => prop_assert!(launched.is_none(), "step {}", s),
                    _ => {}
                }
            }
            prop_assert!(launched.is_none());
            let synced = |v: u64| v == from || p.mode(from, end, v - 1).synchronized();
            for v in from..=end {
                let next = p.next_synchronized(from, end, v);
                prop_assert!(next >= v && (next == end || synced(next)));
                prop_assert!((v..next).all(|u| !synced(u)));
                let last = p.last_synchronized(from, end, v.min(end - 1));
                prop_assert!(last <= v && synced(last));
                prop_assert!((last + 1..=v.min(end - 1)).all(|u| !synced(u)));
            }
        }
    }

    #[test]
    fn every_step_is_synchronous() {
        assert_eq!(SyncPolicy::EveryStep.mode(3, 10, 5), StepMode::Sync);
        assert!(StepMode::Sync.synchronized() && !StepMode::Launch.synchronized());
        assert_eq!(SyncPolicy::EveryStep.next_synchronized(3, 10, 5), 5);
        assert_eq!(SyncPolicy::EveryStep.window(4), 4);
    }

    #[test]
    fn a_local_sgd_epoch_runs_a_round_ahead() {
        // Its nodes meet at rounds, not every few steps; a short round keeps the base window.
        assert_eq!(local_sgd(75, 21).window(4), 75);
        assert_eq!(local_sgd(2, 0).window(4), 4);
        assert_eq!(SyncPolicy::EveryStep.window(0), 1);
    }
}

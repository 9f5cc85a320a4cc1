//! A node actor's state and messages: what `actor` (message handling) and `step` (the steps)
//! share, so that neither imports the other.

use std::ops::Range;
use std::sync::Arc;

use ractor::ActorRef;
use tokio::time::Instant;

use crate::collective::{CollectiveMsg, Group, Outcome};
use crate::measure::links::ProbeRound;
use ravnest_protocol::msg::{Addr, Envelope};
use ravnest_protocol::node::core::NodeCore;
use ravnest_protocol::node::outer::{Anchor, Rounds};
use ravnest_protocol::node::stage::{Early, Stage};
use ravnest_protocol::node::step::Collect;

/// Messages a node actor handles.
#[derive(Debug)]
pub enum NodeMsg {
    /// An envelope from the network.
    Net(Addr, Envelope),
    /// The node's collective actor finished (or abandoned) a collective.
    Collective(Outcome),
    /// Go on with the next step (sent to itself after each step, so that messages that came
    /// in meanwhile, a halt or a new epoch, are seen first).
    Advance,
    /// Fail-over: consult the watch over the coordinator.
    Watch,
}

/// A node's mutable state (`M`: the backend's model, `G`: its stage gradient).
#[derive(Debug)]
pub struct NodeState<M, G> {
    pub(super) me: Option<ActorRef<NodeMsg>>,
    /// The node's decisions: epochs, halts, the versions kept and fetched, peers' requests.
    pub(super) core: NodeCore<M>,
    /// Local SGD's rounds: overlapped ones in flight, the carry after a merge, the outer
    /// momentum (DiLoCo).
    pub(super) rounds: Rounds,
    /// The data-parallel step in progress.
    pub(super) running: Option<Running<M>>,
    /// The pipeline stage step in progress.
    pub(super) pipe: Option<Pipe<M, G>>,
    /// Activations and gradients that came before their stage step started here.
    pub(super) early_pipe: Early,
    pub(super) collective: Option<ActorRef<CollectiveMsg>>,
    /// The sync group of the current epoch.
    pub(super) group: Option<(u64, Arc<Group>)>,
    /// The rounds of link probes under way.
    pub(super) probes: Vec<ProbeRound>,
    pub(super) probe_seq: u64,
    /// Fail-over: the watch over the coordinator's tick, and its ticker.
    pub(super) watcher: Option<super::watcher::Tick>,
    pub(super) watch_ticker: Option<tokio::task::JoinHandle<()>>,
    /// Pieces of steps' gradient norms from the other parts of the model (clipping).
    pub(super) norms: ravnest_protocol::node::clip::Norms,
}

impl<M, G> NodeState<M, G> {
    /// A node's state around its decisions.
    pub(super) fn new(core: NodeCore<M>) -> Self {
        NodeState {
            me: None,
            core,
            rounds: Rounds::default(),
            running: None,
            pipe: None,
            early_pipe: Early::default(),
            collective: None,
            group: None,
            probes: Vec::new(),
            probe_seq: 0,
            watcher: None,
            watch_ticker: None,
            norms: Default::default(),
        }
    }
}

/// A step whose collectives are running: their bookkeeping (the protocol's [`Collect`]), and
/// the version being made.
#[derive(Debug)]
pub(crate) struct Running<M> {
    /// Which results are still to come, where each goes, the ones held for the norm.
    pub(super) c: Collect,
    /// The version being made: version `step` (shared, not copied) with the results applied
    /// to it as they come back.
    pub(super) next: M,
    /// When the compute ended (the collectives may still run).
    pub(super) computed: Option<Instant>,
    pub(super) compute_ns: u64,
    /// A sharded data-parallel step: its chunks (each bucket runs a reduce-scatter, then an
    /// all-gather).
    pub(super) shard: Option<std::sync::Arc<ravnest_protocol::node::shard::ShardLayout>>,
    /// An outer round that exchanges deltas: the anchor it started from.
    pub(super) anchor: Option<Anchor>,
    /// A merge step: the step that launched the round it merges.
    pub(super) merge: Option<u64>,
    /// A data-parallel step: when backward handed its first bucket to the all-reduce (set on
    /// the compute thread), for the time its collectives took.
    pub(super) first_bucket: Option<std::sync::Arc<std::sync::OnceLock<Instant>>>,
}

impl<M> Running<M> {
    /// The collectives `c` of a step whose compute just ended (`compute_ns` of it), making
    /// `next`.
    pub(super) fn computed(c: Collect, next: M, compute_ns: u64) -> Self {
        Running {
            c,
            next,
            computed: Some(Instant::now()),
            compute_ns,
            shard: None,
            anchor: None,
            merge: None,
            first_bucket: None,
        }
    }
}

/// A pipeline stage's step in progress: the protocol's [`Stage`] (its order, its
/// activations), and what the compute holds for it.
#[derive(Debug)]
pub(crate) struct Pipe<M, G> {
    pub(super) stage: Stage,
    /// Model version `step`.
    pub(super) model: M,
    /// Where this stage's layers' parameters sit in the flat model.
    pub(super) range: Range<usize>,
    /// Σ of the layers' parameter gradients so far (kept by the backend).
    pub(super) grad: Option<G>,
    pub(super) compute_ns: u64,
    /// Clipped: the stage's mean gradient, done, waiting for the other stages' pieces of the
    /// norm before it is applied.
    pub(super) clip: Option<Vec<f32>>,
}

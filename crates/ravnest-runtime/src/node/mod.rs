//! The node actor: runs its standing assignment step after step, hands each gradient bucket to
//! its collective actor as backward produces it, applies what comes back, reports each step
//! asynchronously, and keeps model versions for peers that need them.
//!
//! A shell around the node's decisions ([`ravnest_protocol::node::core::NodeCore`]: the epoch
//! being run and the next one, grants, halts, the versions kept and fetched, peers' requests,
//! the checkpoint duty): gradients come from the [`Compute`](crate::seams::Compute) seam, and
//! synchronization runs in the node's [`crate::collective::CollectiveActor`]. [`actor`] hands
//! the messages to the decisions and carries out their effects, [`step`] runs one step (data
//! parallel or a pipeline stage).

pub mod actor;
pub mod calibrate;
mod clip;
mod rounds;
mod sharded;
pub mod state;
pub mod step;
mod watcher;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ravnest_core::NodeId;
use tokio::time::Instant;

use crate::seams::Transport;
use ravnest_protocol::coordinator::succession::Verdict;
use ravnest_protocol::msg::{Addr, Envelope};

pub use state::{NodeMsg, NodeState};

/// What a node was doing during a [`Span`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    /// Computing a step.
    Compute,
    /// Waiting for a step's collectives after its compute (communication not hidden).
    Comm,
}

/// An interval of activity, ns since the start of the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Start.
    pub start_ns: u64,
    /// End.
    pub end_ns: u64,
    /// Activity.
    pub kind: SpanKind,
}

/// Per-node counters, shared with whoever reports.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NodeCounters {
    /// Ns spent computing.
    pub compute_ns: u64,
    /// Ns between the end of a step's compute and the end of its collectives: communication
    /// that backward did not hide.
    pub comm_ns: u64,
    /// Ns from a data-parallel step's first gradient bucket handed to the all-reduce to its
    /// last reduced bucket applied, summed over steps (what of it `comm_ns` does not count
    /// ran hidden behind the backward pass).
    pub allreduce_ns: u64,
    /// Steps this node applied.
    pub steps: u64,
    /// Samples per step of its current assignment.
    pub batch: u64,
    /// Steps abandoned under it (a halt).
    pub aborted: u64,
    /// The latest model version this node made.
    pub version: u64,
    /// The layers it holds of that version (`None`: the whole model).
    pub layers: Option<ravnest_core::LayerRange>,
    /// What the node holds of that version, exported after each step when the nodes were
    /// launched to be observed ([`crate::Nodes::observe`]: tests and the simulator's
    /// checkers); `None` otherwise (a real run never copies its model to report it).
    pub observed: Option<Observed>,
    /// The whole model at the run's last version, exported once there by a node that holds
    /// it whole (what a report evaluates when no final checkpoint could be read).
    pub final_model: Option<Vec<f32>>,
    /// Under clipping (`[run] max_grad_norm`), each step's global gradient norm before
    /// clipping, as this node computed it: (step, norm). Whoever reports takes them.
    pub grad_norms: Vec<(u64, f64)>,
    /// Activity intervals, in order (for timelines).
    pub spans: Vec<Span>,
    /// A mark after each step, so a report can leave out the first steps (warm-up) of a run,
    /// and a profile can tell each step's figures (differences of consecutive marks) at its
    /// batch.
    pub history: Vec<StepMark>,
}

/// Where a node's counters stood after one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepMark {
    /// The model version the step made.
    pub version: u64,
    /// [`NodeCounters::compute_ns`] so far.
    pub compute_ns: u64,
    /// [`NodeCounters::comm_ns`] so far.
    pub comm_ns: u64,
    /// Nanoseconds since the node started.
    pub at_ns: u64,
    /// The step's batch on this node.
    pub batch: u64,
    /// [`NodeCounters::allreduce_ns`] so far.
    pub allreduce_ns: u64,
    /// The backend's phases so far ([`crate::Compute::phase_ns`]).
    pub phases: crate::seams::PhaseNs,
}

impl NodeCounters {
    /// (busy, comm) fractions of the wall time between making version `from` and the last
    /// step, or `None` when that span is not in the history.
    pub fn steady_fractions(&self, from: u64) -> Option<(f64, f64)> {
        let start = self.history.iter().find(|h| h.version == from)?;
        let end = self.history.last()?;
        let wall = end.at_ns.checked_sub(start.at_ns).filter(|w| *w > 0)? as f64;
        Some((
            (end.compute_ns - start.compute_ns) as f64 / wall,
            (end.comm_ns - start.comm_ns) as f64 / wall,
        ))
    }
}

/// A node's model as an observer sees it: version `version`'s values at `slots` of the flat
/// model (parameters, then optimizer state), in order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observed {
    /// The version.
    pub version: u64,
    /// Where the values sit in the flat model.
    pub slots: Vec<Range<usize>>,
    /// The values.
    pub values: Vec<f32>,
}

impl Observed {
    /// The values of flat-model range `r`, if the node holds all of it.
    pub fn range(&self, r: Range<usize>) -> Option<&[f32]> {
        let mut at = 0;
        for s in &self.slots {
            if s.start <= r.start && r.end <= s.end {
                let off = at + r.start - s.start;
                return self.values.get(off..off + r.len());
            }
            at += s.len();
        }
        None
    }
}

/// Counters of every node.
pub type Counters = Arc<Mutex<BTreeMap<NodeId, NodeCounters>>>;

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
    pub succession: Option<Succession>,
    /// Export the model into the counters after every step ([`NodeCounters::observed`]).
    pub observe: bool,
}

/// Fail-over on a node: it watches the coordinator (hosted by `host` at the start) and
/// suspects it after `silence` without a word; [`ravnest_protocol::coordinator::succession::Watch`]
/// decides. The node redirects its transport itself; `on_verdict` is told every verdict (the
/// process starts a coordinator on [`Verdict::TakeOver`]). It must not block.
#[derive(Clone)]
pub struct Succession {
    /// The coordinator's host at the start.
    pub host: NodeId,
    /// Silence after which the coordinator is suspected.
    pub silence: Duration,
    /// Told each verdict.
    pub on_verdict: Arc<dyn Fn(NodeId, Verdict) + Send + Sync>,
}

impl std::fmt::Debug for Succession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Succession")
            .field("host", &self.host)
            .field("silence", &self.silence)
            .finish()
    }
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

/// Where the echoes of a round of link probes go: the ids it uses, and its task's inbox.
pub(crate) type ProbeRound = (Range<u64>, tokio::sync::mpsc::UnboundedSender<u64>);

/// Elements of the small probe (latency) and of the large one (bandwidth: 1 MiB).
pub const PROBE_SMALL: usize = 16;
/// See [`PROBE_SMALL`].
pub const PROBE_LARGE: usize = 1 << 18;

/// A link's (latency ms, bandwidth Gbit/s) from the best round trips of a small and a large
/// echo probe ([`PROBE_SMALL`], [`PROBE_LARGE`] elements): latency is half the small round
/// trip; the large one carries 2 x 1 MiB more than the small one in its extra time.
pub fn link_from_round_trips(small_s: f64, large_s: f64) -> (f64, f64) {
    let extra_bits = 2.0 * 4.0 * (PROBE_LARGE - PROBE_SMALL) as f64 * 8.0;
    let gbps = (extra_bits / (large_s - small_s).max(1e-6) / 1e9).min(400.0);
    (small_s / 2.0 * 1e3, gbps)
}

/// Measure the links from `me` to `peers` (best of three round trips each, with the ids from
/// `first` on) and report them to the coordinator. Runs beside the actor, which hands it the
/// echoes by the round it returns.
pub(crate) fn spawn_link_probes<T: Transport>(
    transport: T,
    me: NodeId,
    peers: Vec<NodeId>,
    first: u64,
) -> ProbeRound {
    let ids = first..first + 6 * peers.len() as u64 + 1;
    let (tx, mut echoes) = tokio::sync::mpsc::unbounded_channel::<u64>();
    tokio::spawn(async move {
        let mut id = first;
        let mut links = Vec::new();
        for peer in peers {
            let mut best = [f64::INFINITY; 2];
            for (k, len) in [(0, PROBE_SMALL), (1, PROBE_LARGE)] {
                for _ in 0..3 {
                    id += 1;
                    let t = Instant::now();
                    let sent = transport.send(
                        Addr::Node(me),
                        Addr::Node(peer),
                        Envelope::Probe {
                            id,
                            data: vec![0.0; len],
                            echo: true,
                        },
                    );
                    // An echo of an earlier probe that timed out is passed over.
                    let echoed = async {
                        while let Some(got) = echoes.recv().await {
                            if got == id {
                                return true;
                            }
                        }
                        false
                    };
                    if sent.is_ok()
                        && matches!(
                            tokio::time::timeout(Duration::from_secs(5), echoed).await,
                            Ok(true)
                        )
                    {
                        best[k] = best[k].min(t.elapsed().as_secs_f64());
                    }
                }
            }
            if best.iter().all(|b| b.is_finite()) {
                let (lat, gbps) = link_from_round_trips(best[0], best[1]);
                links.push((peer, lat, gbps));
            }
        }
        let _ = transport.send(
            Addr::Node(me),
            Addr::Coordinator,
            Envelope::LinkReport { links },
        );
    });
    (ids, tx)
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

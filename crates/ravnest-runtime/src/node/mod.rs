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

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use ravnest_core::NodeId;
use tokio::time::Instant;

use crate::counters::Counters;
use crate::seams::{BucketSink, Transport};
use ravnest_protocol::coordinator::succession::Verdict;
use ravnest_protocol::msg::{Addr, Envelope};

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
    pub succession: Option<Succession>,
    /// Export the model into the counters after every step ([`crate::counters::NodeCounters::observed`]).
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

/// Run the compute `pass` with a bucket sink whose buckets are handed to `on` here, on the
/// caller's task, as the compute thread makes them (and those still on their way when the pass
/// ends): the compute thread and the caller share nothing. The pass's result.
async fn with_buckets<R, F>(
    pass: impl FnOnce(BucketSink) -> F,
    mut on: impl FnMut(usize, Vec<f32>),
) -> R
where
    F: std::future::Future<Output = R>,
{
    let (tx, mut made) = tokio::sync::mpsc::unbounded_channel::<(usize, Vec<f32>)>();
    let sink: BucketSink = Arc::new(move |k: usize, data: Vec<f32>| {
        let _ = tx.send((k, data));
    });
    let pass = pass(sink);
    tokio::pin!(pass);
    let result = loop {
        tokio::select! {
            r = &mut pass => break r,
            Some((k, data)) = made.recv() => on(k, data),
        }
    };
    while let Ok((k, data)) = made.try_recv() {
        on(k, data);
    }
    result
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

//! ravnest-sim: run the real actors (`ravnest-runtime`) on a simulated cluster.
//!
//! [`run`] builds a single-threaded tokio runtime with paused time, a [`net::SimNet`], a
//! [`compute::SimCompute`], one node actor per node and the coordinator, then plays the
//! scenario's faults at their virtual times. Everything random comes from the seed; every
//! delivery and event goes into a trace whose hash is the run's fingerprint. Checkers run as it
//! goes (replicas agree after every step) and at the end (the model equals single-node training
//! on the same data, the run ended within its bound).

pub mod compute;
pub mod net;
pub mod rng;
pub mod sweep;
pub mod timeline;
pub mod toy;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ravnest_core::config::{Fault, Scenario};
use ravnest_core::cost::Costs;
use ravnest_core::{LayerRange, NodeId, PlannerKind};
use ravnest_protocol::coordinator::Event;
use ravnest_protocol::coordinator::core::Config;
use ravnest_protocol::coordinator::succession::Verdict;
use ravnest_protocol::msg::Addr;
use ravnest_runtime::checkpoint::{Store, StoreError};
use ravnest_runtime::coordinator::{Note, RunLog, SharedLog, spawn_leases};
use ravnest_runtime::counters::Counters;
use ravnest_runtime::succession::Succession;
use ravnest_runtime::supervisor::SupMsg;
use ravnest_runtime::{Launch, Nodes, Trace, Transport};
use serde::Serialize;
use tokio::time::Instant;

use compute::SimCompute;
use net::SimNet;

mod report;
mod store;
use report::*;
pub use store::{MemStore, TermStore};

/// Knobs of one simulated run.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// Seed (overrides the scenario's).
    pub seed: u64,
    /// Planner.
    pub planner: PlannerKind,
    /// Steps (overrides the scenario's).
    pub steps: u64,
    /// Heartbeat period.
    pub heartbeat: Duration,
    /// Silence after which a node is declared dead.
    pub timeout: Duration,
    /// Checkpoint every this many steps (0: never).
    pub checkpoint_every: u64,
    /// Print progress to stderr (every 5% of the steps). Reads the log only: the trace is the
    /// same with or without it.
    pub progress: bool,
    /// Crash the coordinator's host this long after the first checkpoint round at or past
    /// this version opens (fail-over during a checkpoint; the seed sweep uses it).
    pub host_crash_in_round: Option<(u64, Duration)>,
    /// Crash the coordinator's host this long after it declares a node dead (fail-over during
    /// the halt and re-plan that follow; the seed sweep uses it).
    pub host_crash_on_loss: Option<Duration>,
    /// Each node's relative spread of step compute, by node index (a measured profile's; empty
    /// or 0: the simulator's default jitter).
    pub compute_spread: Vec<f64>,
}

impl SimOptions {
    /// Defaults for a scenario: its seed and steps, the ravnest planner, 100 ms heartbeats and a
    /// 1 s timeout.
    pub fn for_scenario(s: &Scenario) -> Self {
        let sim = s.sim.clone().unwrap_or(ravnest_core::config::SimSettings {
            seed: 0,
            steps: 100,
            checkpoint_every_steps: ravnest_core::config::DEFAULT_CHECKPOINT_EVERY_STEPS,
        });
        SimOptions {
            seed: sim.seed,
            planner: PlannerKind::Ravnest,
            steps: sim.steps,
            heartbeat: Duration::from_millis(100),
            timeout: Duration::from_millis(1000),
            checkpoint_every: sim.checkpoint_every_steps,
            progress: false,
            host_crash_in_round: None,
            host_crash_on_loss: None,
            compute_spread: Vec::new(),
        }
    }
}

/// Why a simulation could not start.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SimError {
    /// The scenario asks for something the simulator cannot do yet.
    #[error("{0}")]
    Unsupported(String),
}

/// One node's figures.
#[derive(Debug, Clone, Serialize)]
pub struct NodeReport {
    /// Name.
    pub name: String,
    /// Device.
    pub device: String,
    /// Share of the run spent computing.
    pub busy: f64,
    /// Share spent in collectives.
    pub comm: f64,
    /// Share spent waiting (or down).
    pub idle: f64,
    /// Bytes sent.
    pub bytes_sent: u64,
    /// Steps applied.
    pub steps: u64,
    /// Collectives aborted under it.
    pub aborted: u64,
    /// Its role in the first plan: `worker`, `rK/sJ` (pipeline replica K, stage J) or `idle`.
    pub role: String,
    /// Peak memory the first plan predicts for it, bytes (0 when idle).
    pub memory_bytes: u64,
    /// Its usable memory, bytes.
    pub memory_limit_bytes: u64,
}

/// How one fault was handled.
#[derive(Debug, Clone, Serialize)]
pub struct FaultReport {
    /// What.
    pub fault: String,
    /// When, virtual seconds.
    pub at_s: f64,
    /// For a crash: seconds until the coordinator declared the node dead.
    pub detected_after_s: Option<f64>,
    /// Seconds until the next step completed after the fault (training resumed).
    pub resumed_after_s: Option<f64>,
    /// For a restart: seconds until the coordinator took the node back.
    pub rejoined_after_s: Option<f64>,
    /// For a slowdown: steps agreed between the fault and the re-plan that measurements
    /// asked for.
    pub replanned_after_steps: Option<u64>,
    /// For a crash of the coordinator's host: who took over, when, and from which step.
    pub taken_over: Option<TakeOverReport>,
    /// For a partition: the nodes declared dead while it lasted.
    pub lost: Vec<String>,
    /// For a partition: no plan fitted the nodes left, and training waited this many seconds
    /// for lost nodes to come back (until the next completed step, or the run's last event
    /// when they never did).
    pub waited_s: Option<f64>,
}

/// How a crash of the coordinator's host was answered (fail-over).
#[derive(Debug, Clone, Serialize)]
pub struct TakeOverReport {
    /// The node whose process took over as coordinator.
    pub by: String,
    /// Seconds from the crash until its coordinator started.
    pub after_s: f64,
    /// The model version training went on from.
    pub from_step: u64,
    /// What the coordinator was doing when its host crashed: `steady`, `re-plan` (halting
    /// or re-planning after a loss) or `checkpoint` (a checkpoint round open).
    pub during: String,
}

/// The result of a run.
#[derive(Debug, Clone, Serialize)]
pub struct SimReport {
    /// Scenario.
    pub scenario: String,
    /// Planner.
    pub planner: String,
    /// Seed.
    pub seed: u64,
    /// Steps asked for.
    pub steps_requested: u64,
    /// Steps completed.
    pub steps_completed: u64,
    /// Virtual seconds simulated.
    pub sim_time_s: f64,
    /// Samples per virtual second.
    pub samples_per_s: f64,
    /// The mean interval between consecutive steps after the first two, virtual seconds: the
    /// steady state a plan predicts when the run has no faults.
    pub steady_step_s: f64,
    /// The global batch ÷ [`SimReport::steady_step_s`].
    pub steady_samples_per_s: f64,
    /// The split the coordinator planned first, as [`ravnest_core::planner::split_line`]
    /// writes it (`ravnest plan` prints the same line for the same file).
    pub planned: String,
    /// Achieved samples/s ÷ the sum of every node's solo samples/s.
    pub capacity_efficiency: f64,
    /// Per node, in id order.
    pub nodes: Vec<NodeReport>,
    /// Faults in order.
    pub faults: Vec<FaultReport>,
    /// Distinct plans used (the first included): a new one after each membership change.
    pub plans: usize,
    /// Messages dropped by the network.
    pub dropped: u64,
    /// Checker failures (empty when all held).
    pub violations: Vec<String>,
    /// Largest |w − w_reference| at the end (toy model vs single-node training).
    pub max_model_error: f64,
    /// Local steps per averaging round when the first plan trains with local SGD (`None`:
    /// gradients are reduced every step). Local SGD is another algorithm than single-node
    /// training, so the final model is then not required to equal it (`max_model_error` is
    /// kept for information).
    pub local_sgd_steps: Option<u32>,
    /// Model versions checkpointed, in order.
    pub checkpoints: Vec<u64>,
    /// Per complete checkpoint: when its round opened (the version was agreed) and when it
    /// completed, virtual seconds.
    pub checkpoint_rounds_s: Vec<(f64, f64)>,
    /// Trace entries.
    pub trace_len: u64,
    /// Trace hash.
    pub trace_hash: u64,
    /// The picture's data (not in JSON: it can be large).
    #[serde(skip)]
    pub timeline: timeline::Timeline,
    /// Bucket updates applied while every node's data-parallel compute still ran
    /// ([`SimCompute::updates_in_backward`]).
    pub updates_in_backward: u64,
}

/// One timed action of the fault schedule.
#[derive(Debug, Clone)]
enum Action {
    Crash(NodeId),
    Restart(NodeId),
    Slow(NodeId, f64),
    Degrade(NodeId, NodeId, ravnest_core::Link),
    Restore(NodeId, NodeId),
    Partition(Vec<Vec<NodeId>>),
    Heal(Vec<Vec<NodeId>>),
    Reset(NodeId, NodeId),
}

fn schedule(faults: &[Fault]) -> Vec<(f64, usize, Action)> {
    let mut v = Vec::new();
    for (i, f) in faults.iter().enumerate() {
        match f {
            Fault::Crash { node, at_s } => v.push((*at_s, i, Action::Crash(*node))),
            Fault::Restart { node, at_s } => v.push((*at_s, i, Action::Restart(*node))),
            Fault::Slowdown {
                node,
                factor,
                from_s,
                to_s,
            } => {
                v.push((*from_s, i, Action::Slow(*node, *factor)));
                v.push((*to_s, i, Action::Slow(*node, 1.0)));
            }
            Fault::LinkDegraded {
                a,
                b,
                link,
                from_s,
                to_s,
            } => {
                v.push((*from_s, i, Action::Degrade(*a, *b, *link)));
                v.push((*to_s, i, Action::Restore(*a, *b)));
            }
            Fault::Reset { a, b, at_s } => v.push((*at_s, i, Action::Reset(*a, *b))),
            Fault::Partition {
                groups,
                from_s,
                to_s,
            } => {
                v.push((*from_s, i, Action::Partition(groups.clone())));
                v.push((*to_s, i, Action::Heal(groups.clone())));
            }
        }
    }
    // Stable by time, then file order.
    v.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    v
}

fn describe(s: &Scenario, f: &Fault) -> String {
    let name = |n: &NodeId| s.cluster.node(*n).name.clone();
    match f {
        Fault::Crash { node, .. } => format!("crash {}", name(node)),
        Fault::Restart { node, .. } => format!("restart {}", name(node)),
        Fault::Slowdown {
            node, factor, to_s, ..
        } => format!("{} {factor}x slower until {to_s} s", name(node)),
        Fault::LinkDegraded {
            a, b, link, to_s, ..
        } => {
            format!(
                "link {}-{} at {} Gbit/s until {to_s} s",
                name(a),
                name(b),
                link.bandwidth_gbps
            )
        }
        Fault::Partition { groups, to_s, .. } => {
            format!("partition into {} groups until {to_s} s", groups.len())
        }
        Fault::Reset { a, b, .. } => format!("reset {}-{}", name(a), name(b)),
    }
}

fn fault_at(f: &Fault) -> f64 {
    match f {
        Fault::Crash { at_s, .. } | Fault::Restart { at_s, .. } | Fault::Reset { at_s, .. } => {
            *at_s
        }
        Fault::Slowdown { from_s, .. }
        | Fault::LinkDegraded { from_s, .. }
        | Fault::Partition { from_s, .. } => *from_s,
    }
}

/// Run a scenario. Deterministic: the same scenario and options give the same report and hash.
pub fn run(s: &Scenario, opts: &SimOptions) -> Result<SimReport, SimError> {
    let host = s.run.coordinator.unwrap_or(NodeId(0));
    // The plan `ravnest plan` shows (one policy: the least step time plus priced recovery).
    // The toy model gets the model's layers when that plan is a pipeline, so that stages
    // compute their part of it (the toy model of a data-parallel run is one vector, and its
    // coordinator keeps to data parallel after losses).
    let first_plan = ravnest_core::plan_scenario(opts.planner, s)
        .map_err(|e| SimError::Unsupported(format!("no plan fits this cluster: {e}")))?;
    let layered = matches!(
        first_plan.layout,
        ravnest_core::planner::Layout::Pipeline { .. }
            | ravnest_core::planner::Layout::Sharded { .. }
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| SimError::Unsupported(format!("cannot build the runtime: {e}")))?;
    rt.block_on(simulate(s, opts, host, layered, &first_plan))
}

/// The simulated compute: each node's seconds per sample, per layer when the plan may be a
/// pipeline.
fn sim_compute(
    costs: &Costs,
    (secs_per_sample, fixed_s): (&[f64], &[f64]),
    seed: u64,
    layered: bool,
) -> SimCompute {
    let compute = SimCompute::new(secs_per_sample.to_vec(), seed)
        .with_fixed(fixed_s.to_vec())
        .with_buckets(ravnest_core::cost::grad_buckets(costs.model));
    if !layered {
        return compute;
    }
    let layer_flops: Vec<f64> = costs
        .all()
        .iter()
        .map(|l| costs.train_flops(LayerRange::new(l, l + 1)))
        .collect();
    compute.layered(&layer_flops)
}

/// The coordinator's configuration for a simulated run.
fn config(s: &Scenario, opts: &SimOptions, train_flops: f64, layered: bool) -> Config {
    Config {
        planner: opts.planner,
        heartbeat_timeout_ms: opts.timeout.as_millis() as u64,
        train_flops,
        checkpoint_every: opts.checkpoint_every,
        allow_pipeline: layered,
        ..Config::new(
            s.cluster.clone(),
            s.model.clone(),
            s.training.clone(),
            opts.steps,
        )
    }
}

/// The run's bound, virtual seconds: every step at the slowest node's full-batch time, plus
/// sync over the slowest link, twenty times over, plus the fault schedule, plus twenty times
/// the largest fixed cost per step. A run that needs longer is a bug.
fn bound_s(
    s: &Scenario,
    opts: &SimOptions,
    (secs_per_sample, fixed_s): (&[f64], &[f64]),
    grad_bytes: u64,
    last_fault: f64,
) -> f64 {
    let worst_step = secs_per_sample.iter().copied().fold(0.0, f64::max)
        * f64::from(s.training.global_batch)
        + s.cluster
            .nodes
            .iter()
            .map(|n| n.link.transfer_s(2.0 * grad_bytes as f64))
            .fold(0.0, f64::max);
    let worst_fixed_s = fixed_s.iter().copied().fold(0.0, f64::max);
    20.0 * worst_step * opts.steps as f64
        + last_fault
        + 60.0
        + 20.0 * worst_fixed_s * opts.steps as f64
}

/// What the fault schedule acts on.
struct World<'a> {
    trace: &'a Trace,
    net: &'a SimNet,
    sup: &'a ractor::ActorRef<SupMsg>,
    compute: &'a SimCompute,
    t0: Instant,
    /// The coordinator's process: its actors die with their host.
    host: &'a Hosted,
}

/// The actors of the coordinators' processes (the coordinator, the checkpoint aggregator and the
/// leases), per host, with their term: a crash of a host stops its own; a successor starts its
/// own (fail-over); a stale one (its host cut off while another took over) runs until a node
/// tells its host of the newer term, and then steps down.
#[derive(Default)]
struct Hosted {
    by_host: Mutex<BTreeMap<NodeId, HostedActors>>,
}

/// One host's coordinator actors.
struct HostedActors {
    term: u32,
    actors: Vec<ractor::ActorCell>,
    leases: Option<tokio::task::JoinHandle<()>>,
}

impl Hosted {
    /// Stop the actors hosted by `host` (its process crashed or stepped down); their term.
    fn stop(&self, host: NodeId) -> Option<u32> {
        let h = self.by_host.lock().unwrap().remove(&host)?;
        for a in h.actors {
            a.stop(None);
        }
        if let Some(l) = h.leases {
            l.abort();
        }
        Some(h.term)
    }

    /// Stop every host's actors (the run is over).
    fn stop_all(&self) {
        let hosts: Vec<NodeId> = self.by_host.lock().unwrap().keys().copied().collect();
        for h in hosts {
            self.stop(h);
        }
    }

    /// The newest term running, and the term `host` runs (if it hosts a coordinator).
    fn terms(&self, host: NodeId) -> (u32, Option<u32>) {
        let by = self.by_host.lock().unwrap();
        let newest = by.values().map(|h| h.term).max().unwrap_or(0);
        (newest, by.get(&host).map(|h| h.term))
    }
}

/// Downtime per node: closed (start, end) intervals, and the start of an open one.
type Downtime = (Vec<Vec<(u64, u64)>>, Vec<Option<u64>>);

/// Play the fault schedule at its virtual times, until it ends or the run finishes first
/// (then true). Returns that, and each node's downtime.
async fn play(
    w: &World<'_>,
    n: usize,
    actions: Vec<(f64, usize, Action)>,
    done_rx: &mut tokio::sync::mpsc::UnboundedReceiver<()>,
    mut trigger: Option<tokio::sync::mpsc::UnboundedReceiver<()>>,
) -> (bool, Vec<Vec<(u64, u64)>>, Vec<Option<u64>>, Option<Fault>) {
    let mut down: Downtime = (vec![Vec::new(); n], vec![None; n]);
    let mut triggered = None;
    let mut actions = actions.into_iter().peekable();
    loop {
        let when = actions.peek().map(|a| w.t0 + Duration::from_secs_f64(a.0));
        if when.is_none() && trigger.is_none() {
            return (false, down.0, down.1, triggered);
        }
        let far = w.t0 + Duration::from_secs(u64::from(u32::MAX));
        tokio::select! {
            biased;
            _ = done_rx.recv() => return (true, down.0, down.1, triggered),
            fired = async { trigger.as_mut()?.recv().await }, if trigger.is_some() => {
                trigger = None;
                if fired.is_some() {
                    // The coordinator's host crashes now (a checkpoint round is open).
                    let node = w.net.host();
                    triggered = Some(Fault::Crash { node, at_s: w.t0.elapsed().as_secs_f64() });
                    apply(w, Action::Crash(node), &mut down);
                }
            }
            _ = tokio::time::sleep_until(when.unwrap_or(far)), if when.is_some() => {
                if let Some((_, _, action)) = actions.next() {
                    apply(w, action, &mut down);
                }
            }
        }
    }
}

/// When the options crash the coordinator's host at a moment of the run (in a checkpoint
/// round, or on a detected loss): told then.
fn host_crash_trigger(
    opts: &SimOptions,
    log: &SharedLog,
) -> Option<tokio::sync::mpsc::UnboundedReceiver<()>> {
    let in_round = opts.host_crash_in_round.map(|(v, after)| {
        spawn_trigger(
            log,
            move |n| matches!(n, Note::CheckpointOpened { step } if *step >= v),
            after,
        )
    });
    let on_loss = opts.host_crash_on_loss.map(|after| {
        spawn_trigger(
            log,
            |n| matches!(n, Note::Event(_, Event::Detected { .. })),
            after,
        )
    });
    in_round.or(on_loss)
}

/// The crash of the coordinator's host at a moment of the run (`SimOptions::host_crash_in_round`
/// and `host_crash_on_loss`): told `after` the first note `when` picks.
fn spawn_trigger(
    log: &SharedLog,
    when: impl Fn(&Note) -> bool + Send + 'static,
    after: Duration,
) -> tokio::sync::mpsc::UnboundedReceiver<()> {
    let mut notes = log.subscribe();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some(note) = notes.recv().await {
            if when(&note) {
                tokio::time::sleep(after).await;
                let _ = tx.send(());
                return;
            }
        }
    });
    rx
}

/// One fault, now: recorded in the trace, then done to the network, a node or its compute.
fn apply(w: &World<'_>, action: Action, (down, down_since): &mut Downtime) {
    let t_ns = w.t0.elapsed().as_nanos() as u64;
    match action {
        Action::Crash(n) => {
            w.trace.record(t_ns, "crash", Some(Addr::Node(n)), None, 0);
            w.net.crash(n);
            w.host.stop(n);
            down_since[n.index()].get_or_insert(t_ns);
            let _ = w.sup.cast(SupMsg::Crash(n));
        }
        Action::Restart(n) => {
            w.trace
                .record(t_ns, "restart", Some(Addr::Node(n)), None, 0);
            if let Some(since) = down_since[n.index()].take() {
                down[n.index()].push((since, t_ns));
                w.net.restart(n);
                let _ = w.sup.cast(SupMsg::Restart(n));
            }
        }
        Action::Slow(n, k) => {
            w.trace
                .record(t_ns, "slowdown", Some(Addr::Node(n)), None, k.to_bits());
            w.compute.set_slowdown(n, k);
        }
        Action::Degrade(a, b, l) => {
            w.trace.record(
                t_ns,
                "link-degraded",
                Some(Addr::Node(a)),
                Some(Addr::Node(b)),
                l.bandwidth_gbps.to_bits(),
            );
            w.net.degrade(a, b, l);
        }
        Action::Restore(a, b) => {
            w.trace.record(
                t_ns,
                "link-restored",
                Some(Addr::Node(a)),
                Some(Addr::Node(b)),
                0,
            );
            w.net.restore(a, b);
        }
        Action::Partition(g) => {
            w.trace
                .record(t_ns, "partition", None, None, g.len() as u64);
            w.net.partition(g);
        }
        Action::Heal(g) => {
            w.trace.record(t_ns, "heal", None, None, g.len() as u64);
            w.net.heal(&g);
        }
        Action::Reset(a, b) => {
            w.trace
                .record(t_ns, "reset", Some(Addr::Node(a)), Some(Addr::Node(b)), 0);
            w.net.reset(a, b);
        }
    }
}

/// Whether a run needs coordinator fail-over: a fault crashes the coordinator's host. (Only
/// then, so that the other scenarios' traces stay what they were: fail-over adds leases and
/// replicas to the traffic.)
fn failover(s: &Scenario, host: NodeId) -> bool {
    s.faults.iter().any(|f| match f {
        Fault::Crash { node, .. } => *node == host,
        Fault::Partition { .. } => isolates(f, host).is_some(),
        _ => false,
    })
}

/// For a partition that cuts the coordinator's host off from some other node: when it heals
/// (virtual seconds). The host's coordinator goes on, stale, while the others take over.
fn isolates(f: &Fault, host: NodeId) -> Option<f64> {
    let Fault::Partition { groups, to_s, .. } = f else {
        return None;
    };
    // A minority with the host: the others may take over (an even split does not: neither
    // side outnumbers the other, and the host's side goes on as before fail-over existed).
    let mine = groups.iter().find(|g| g.contains(&host))?.len();
    let all: usize = groups.iter().map(Vec::len).sum();
    (mine * 2 < all).then_some(*to_s)
}

/// With fail-over, the nodes watch the coordinator (as `run`'s do, three heartbeat timeouts of
/// silence) and their verdicts come on the receiver.
fn watching(
    nodes: Nodes<SimCompute>,
    failover: bool,
    host: NodeId,
    opts: &SimOptions,
) -> (
    Nodes<SimCompute>,
    tokio::sync::mpsc::UnboundedReceiver<(NodeId, Verdict)>,
) {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    if !failover {
        return (nodes, rx);
    }
    let nodes = nodes.succession(Succession {
        host,
        silence: 3 * opts.timeout,
        on_verdict: Arc::new(move |n, v| {
            let _ = tx.send((n, v));
        }),
    });
    (nodes, rx)
}

/// Starts the coordinator's process actors: the first at the start, a successor's on a
/// take-over; and steps a stale one down when its host's node learns of the newer term.
struct Coordinating {
    launch: Launch<SimNet>,
    /// The first coordinator's host.
    first_host: NodeId,
    store: Arc<MemStore>,
    element_bytes: u64,
    config: Config,
    tick: Duration,
    leases: Option<(Vec<NodeId>, Duration)>,
    hosted: Arc<Hosted>,
    done: tokio::sync::mpsc::UnboundedSender<()>,
    /// What a step-down does to the stale host's process (it exits, as `ravnest run`'s does).
    sup: ractor::ActorRef<SupMsg>,
    trace: Trace,
    t0: Instant,
}

impl Coordinating {
    /// Start the coordinator (a successor when `succeeds` says whom it succeeds), its
    /// checkpoint actor and its leases, in its host's process; its end is told on `done`
    /// (unless a newer term started meanwhile: a stale coordinator's end is not the run's).
    async fn start(
        &self,
        succeeds: Option<(ravnest_protocol::msg::Replica, NodeId)>,
    ) -> Result<(), ravnest_runtime::LaunchError> {
        let (term, host) = succeeds
            .as_ref()
            .map_or((0, self.first_host), |(r, _)| (r.term, r.host));
        let launch = self.launch.hosted(host, term);
        let store = Arc::new(TermStore {
            store: self.store.clone(),
            term,
        });
        let ck = launch.checkpoints(store, self.element_bytes).await?;
        let (coord, done_rx) = match succeeds {
            None => launch.coordinator(self.config.clone(), self.tick).await?,
            Some((r, from)) => {
                launch
                    .successor(self.config.clone(), r, from, self.tick)
                    .await?
            }
        };
        let leases = self.leases.as_ref().map(|(nodes, period)| {
            spawn_leases(
                launch.transport().clone(),
                nodes.clone(),
                *period,
                (term, host),
            )
        });
        self.hosted.by_host.lock().unwrap().insert(
            host,
            HostedActors {
                term,
                actors: vec![ck.get_cell(), coord.get_cell()],
                leases,
            },
        );
        let (done, journal) = (self.done.clone(), launch.journal());
        tokio::spawn(async move {
            if done_rx.await.is_ok() && !journal.fenced(term) {
                let _ = done.send(());
            }
        });
        Ok(())
    }

    /// Carry out the nodes' verdicts: the successor's process starts a coordinator of the new
    /// term (the predecessor's actors died with their host, or run on, stale, on a host that
    /// was cut off); a stale host whose node follows the newer term steps down: its actors
    /// stop and its process exits.
    async fn succeed(
        self,
        mut verdicts: tokio::sync::mpsc::UnboundedReceiver<(NodeId, Verdict)>,
        net: SimNet,
    ) {
        let mut host = self.first_host;
        while let Some((n, v)) = verdicts.recv().await {
            match v {
                Verdict::TakeOver(r) => {
                    if r.host == host {
                        continue;
                    }
                    let from = std::mem::replace(&mut host, r.host);
                    net.set_coordinator(r.host);
                    let _ = self.start(Some((r, from))).await;
                }
                Verdict::Follow(_) => {
                    let (newest, here) = self.hosted.terms(n);
                    if here.is_some_and(|t| t < newest) {
                        self.hosted.stop(n);
                        let t_ns = self.t0.elapsed().as_nanos() as u64;
                        self.trace
                            .record(t_ns, "stepped-down", Some(Addr::Node(n)), None, 0);
                        net.crash(n);
                        let _ = self.sup.cast(SupMsg::Crash(n));
                    }
                }
                Verdict::Canvass { .. }
                | Verdict::Awaits(_)
                | Verdict::Resumed(_)
                | Verdict::CutOff(_)
                | Verdict::Lost(_) => {}
            }
        }
    }
}

/// The progress line on stderr, every 5% of the steps (it reads the journal only: the trace is
/// the same with or without it).
fn spawn_progress(log: &SharedLog, total: u64, t0: Instant) -> tokio::task::JoinHandle<()> {
    let mut notes = log.subscribe();
    let started = std::time::Instant::now();
    tokio::spawn(async move {
        let mut shown = 0;
        while let Some(note) = notes.recv().await {
            let Note::Agreed { steps } = note else {
                continue;
            };
            let done = steps as u64;
            if total > 0 && done * 20 / total > shown {
                shown = done * 20 / total;
                eprint!(
                    "\r[sim] step {done}/{total}, {:.0} virtual s, {:.1} wall s   ",
                    t0.elapsed().as_secs_f64(),
                    started.elapsed().as_secs_f64()
                );
            }
        }
    })
}

async fn simulate(
    s: &Scenario,
    opts: &SimOptions,
    host: NodeId,
    layered: bool,
    first_plan: &ravnest_core::Plan,
) -> Result<SimReport, SimError> {
    let t0 = Instant::now();
    let trace = new_trace();
    let cluster = s.cluster.clone();
    let net = SimNet::new(cluster.clone(), host, opts.seed, t0, trace.clone());
    let net_task = tokio::spawn(net.clone().run());
    let costs = Costs::new(&s.cluster, &s.model, &s.training);
    let all = costs.all();
    // Seconds per sample, and fixed seconds per step (0 unless a measured profile says).
    let ids: Vec<NodeId> = cluster.ids().collect();
    let (secs_per_sample, fixed_s) = costs.step_costs(&ids);
    let per_step = (&secs_per_sample[..], &fixed_s[..]);
    let compute =
        sim_compute(&costs, per_step, opts.seed, layered).with_spread(&opts.compute_spread);
    let toy = compute.toy();
    let compute = Arc::new(compute);
    let grad_bytes = costs.grad_bytes(all);
    let counters = Counters::default();
    let launch = Launch::new(net.clone()).at(t0).traced(trace.clone());
    let log = launch.journal();
    let spawned = |e: ravnest_runtime::LaunchError| SimError::Unsupported(e.to_string());
    let failover = failover(s, host)
        || opts.host_crash_in_round.is_some()
        || opts.host_crash_on_loss.is_some();
    let nodes = Nodes::new(compute.clone(), cluster.ids().collect(), grad_bytes)
        .round_factor(ravnest_core::planner::sync::round_bytes_per_gradient_byte(
            &costs,
        ))
        .heartbeat(opts.heartbeat)
        .observe()
        .counters(counters.clone());
    let (nodes, verdicts) = watching(nodes, failover, host, opts);
    let sup = launch.nodes(nodes).await.map_err(spawned)?;
    let config = Config {
        host: failover.then_some(host),
        ..config(s, opts, costs.train_flops(all), layered)
    };
    let store = Arc::new(MemStore::default());
    let hosted = Arc::new(Hosted::default());
    let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
    let coordinator = Coordinating {
        launch: launch.clone(),
        store: store.clone(),
        element_bytes: s.training.precision.element_bytes(),
        config,
        tick: opts.heartbeat / 2,
        leases: failover.then(|| (cluster.ids().collect(), opts.heartbeat)),
        hosted: hosted.clone(),
        done: done_tx,
        first_host: host,
        sup: sup.clone(),
        trace: trace.clone(),
        t0,
    };
    coordinator.start(None).await.map_err(spawned)?;
    let successions = tokio::spawn(coordinator.succeed(verdicts, net.clone()));

    let actions = schedule(&s.faults);
    let last_fault = actions.last().map_or(0.0, |a| a.0);
    let bound_s = bound_s(s, opts, per_step, grad_bytes, last_fault);
    let deadline = t0 + Duration::from_secs_f64(bound_s);

    let progress = opts.progress.then(|| spawn_progress(&log, opts.steps, t0));
    let world = World {
        trace: &trace,
        net: &net,
        sup: &sup,
        compute: &compute,
        t0,
        host: &hosted,
    };
    let trigger = host_crash_trigger(opts, &log);
    let (finished, mut down, down_since, triggered) =
        play(&world, cluster.nodes.len(), actions, &mut done_rx, trigger).await;
    let mut violations = Vec::new();
    if !finished {
        tokio::select! {
            biased;
            _ = done_rx.recv() => {}
            _ = tokio::time::sleep_until(deadline) => {
                violations.push(format!("the run did not end within its bound of {bound_s:.0} virtual seconds"));
            }
        }
    }
    let end_ns = t0.elapsed().as_nanos() as u64;
    violations.extend(stale_violations(s, opts, &hosted, &store, end_ns));
    // Nodes still down at the end: their interval closes there.
    for (d, a) in down.iter_mut().zip(&down_since) {
        d.extend(a.map(|a| (a, end_ns)));
    }
    successions.abort();
    hosted.stop_all();
    sup.stop(None);
    net_task.abort();
    if let Some(p) = progress {
        p.abort();
        eprintln!();
    }

    let log = log.snapshot();
    let counters = counters.snapshot();
    let mut r = report(
        s, opts, toy, first_plan, &log, &counters, &net, &trace, end_ns, per_step, violations,
    );
    if let Some(f) = triggered {
        r.faults.push(fault_report(s, &log, &f));
    }
    r.timeline = picture(s, &log, &counters, down, end_ns);
    r.updates_in_backward = compute.updates_in_backward();
    Ok(r)
}

/// A run's trace: every entry kept only where it is to be dumped (`RAVNEST_DUMP_TRACE`).
fn new_trace() -> Trace {
    match std::env::var_os("RAVNEST_DUMP_TRACE") {
        Some(_) => Trace::keeping(),
        None => Trace::default(),
    }
}

/// The trace's hash; with `RAVNEST_DUMP_TRACE=PATH`, every entry written to PATH first.
fn dumped_hash(trace: &Trace) -> u64 {
    if let Some(p) = std::env::var_os("RAVNEST_DUMP_TRACE") {
        let t: Vec<String> = trace
            .entries()
            .iter()
            .map(|e| {
                format!(
                    "{} {} {:?} {:?} {:x}",
                    e.t_ns, e.what, e.from, e.to, e.digest
                )
            })
            .collect();
        std::fs::write(p, t.join("\n")).unwrap();
    }
    trace.hash()
}

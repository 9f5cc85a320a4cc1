//! The coordinator as a pure state machine: inputs in, effects out, time as a parameter.
//!
//! [`Coordinator::handle`] takes an [`Input`] (an envelope from a node, a transport's word that
//! a peer is down, a timer tick) with the current time in ms, and returns the [`Effect`]s to
//! carry out (envelopes to send, events to log, steps that became agreed). It does no I/O,
//! reads no clock and holds no randomness, so it is tested without actors and the same code
//! runs in the simulator and over TCP (the actor in ravnest-runtime's `coordinator::actor` is a thin shell).
//!
//! **Epochs, not steps.** The coordinator is off the per-step path. A plan becomes an *epoch*:
//! each node gets a standing [`Work`] (its samples of every step, its ring, its checkpoint
//! duty) and runs step after step on its own; the collective of each step is the only
//! synchronization. Nodes report each finished step asynchronously ([`Envelope::StepDone`]:
//! digest and compute time). A step is *agreed* once every worker of its epoch reported it; the
//! replicas' digests are compared there.
//!
//! **The grant.** Nodes may start steps below a horizon (`until`), which the coordinator moves
//! `window` steps past the last agreed step as reports come in ([`Envelope::Grant`]). It bounds
//! how far the cluster runs ahead of what the coordinator knows, so a change (a re-plan for
//! drift, a joining node) takes effect at an agreed future step, the current horizon, which no
//! node can have passed: nodes finish the old epoch's steps below it and start the new epoch
//! there, without a stop.
//!
//! **A lost node.** When a worker dies, every worker is halted ([`Envelope::Halt`]); each
//! answers with the versions it holds ([`Envelope::Halted`]). The new epoch starts from the
//! newest synchronized version that every survivor holds (nodes keep the last two), so no step
//! is applied twice and no replica diverges; a node that lacks it fetches it from a holder.
//!
//! **Rebalancing** uses smoothed step times (per node, the median of its last few measured ÷
//! predicted ratios) and hysteresis: a re-plan happens only when some node is off by a margin,
//! the plan with measured speeds is predicted to be faster than the current one by a margin,
//! for several agreed steps in a row, and some steps into the epoch. Noise is not drift.

use std::collections::{BTreeMap, BTreeSet};

use ravnest_core::detector::{DetectorEvent, FailureDetector};
use ravnest_core::planner::sync::{Collective, SyncMethod};
use ravnest_core::{ClusterSpec, LayerRange, ModelSpec, NodeId, Plan, PlannerKind, TrainingSpec};

use super::Event;
use super::assign::{
    Assign, Holders, StepCost, SyncGroup, assignments, balanced_bound, compute_bound,
};
use super::measure::{RingTime, SpeedEstimate, median};
use crate::msg::{CheckpointDuty, Envelope, HeldVersion, Replica, SyncPolicy, Work};

mod epochs;
mod membership;
mod rebalance;
mod recovery;
mod stop;

/// What the coordinator is given.
#[derive(Debug, Clone)]
pub struct Config {
    /// The whole cluster as configured (speeds: catalog or measured at registration).
    pub cluster: ClusterSpec,
    /// The model.
    pub model: ModelSpec,
    /// Training settings.
    pub training: TrainingSpec,
    /// Planner to use.
    pub planner: PlannerKind,
    /// The run ends after this step (model version `steps`).
    pub steps: u64,
    /// Heartbeat silence after which a node is dead.
    pub heartbeat_timeout_ms: u64,
    /// Training FLOPs per sample of the model (to turn measured seconds into throughput).
    pub train_flops: f64,
    /// Checkpoint every this many steps (0: never).
    pub checkpoint_every: u64,
    /// Also checkpoint the final model.
    pub checkpoint_at_end: bool,
    /// The model version training starts from (a resumed run: the checkpoint's step).
    pub start_step: u64,
    /// Nodes that hold version `start_step` at the start (`None`: every node).
    pub initial_holders: Option<Vec<NodeId>>,
    /// Nodes that are not there at the start (they never registered): not planned until they
    /// join.
    pub absent: Vec<NodeId>,
    /// Whether the nodes' compute backend runs pipeline stages. When it does, a cluster where
    /// no data-parallel plan fits is planned as a pipeline; data parallel is preferred
    /// otherwise (every replica then holds the whole model, which recovery relies on).
    pub allow_pipeline: bool,
    /// How the coordinator reacts to measurements.
    pub tuning: Tuning,
    /// Fail-over: the node whose process hosts this coordinator. When set, the coordinator
    /// replicates what a successor needs to the nodes ([`super::succession`]).
    pub host: Option<NodeId>,
    /// How long training may wait for nodes when the live ones cannot train (no plan fits
    /// them, e.g. the side of a partition that kept the coordinator cannot hold the global
    /// batch): nodes that come back (the partition heals) are planned in; past this, the run
    /// stops with the planner's reason.
    pub wait_for_nodes_ms: u64,
}

impl Config {
    /// A run of `steps` steps of `model` on `cluster` with the ravnest planner, from step 0 on
    /// every node: a 1 s heartbeat timeout, no checkpoints, data parallel only, default tuning.
    /// Change what differs with struct update syntax.
    pub fn new(
        cluster: ClusterSpec,
        model: ModelSpec,
        training: TrainingSpec,
        steps: u64,
    ) -> Config {
        Config {
            train_flops: model.train_flops_per_sample(),
            cluster,
            model,
            training,
            planner: PlannerKind::Ravnest,
            steps,
            heartbeat_timeout_ms: 1000,
            checkpoint_every: 0,
            checkpoint_at_end: false,
            start_step: 0,
            initial_holders: None,
            absent: Vec::new(),
            allow_pipeline: false,
            tuning: Tuning::default(),
            host: None,
            wait_for_nodes_ms: DEFAULT_WAIT_FOR_NODES_MS,
        }
    }
}

/// How long training waits by default for nodes when the live ones cannot train.
pub const DEFAULT_WAIT_FOR_NODES_MS: u64 = 120_000;

/// Knobs of the grant and of rebalancing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tuning {
    /// Steps nodes may run past the last agreed step (a local-SGD epoch's: at least a round,
    /// [`SyncPolicy::window`]).
    pub window: u64,
    /// Each node's speed is the median of its last this many per-step figures.
    pub speed_window: usize,
    /// A node has drifted when its step times differ from what the plan assumed by this
    /// fraction (up or down)...
    pub drift: f64,
    /// ...and a re-plan must be predicted to shorten the slowest node's compute by this
    /// fraction...
    pub min_gain: f64,
    /// ...for this many agreed steps in a row...
    pub patience: u32,
    /// ...at least this many steps after the current epoch started.
    pub settle_steps: u64,
    /// The first fit (once per coordinator): when every worker of the plan has been measured
    /// for this many steps at its own share, under the run's own contention...
    pub fit_steps: u64,
    /// ...the measured figures re-plan if that is predicted to shorten the slowest node's
    /// compute by this fraction (and by more than the noise of the figures). The calibration
    /// measures every node at an equal share for a second or so; a share off by one sample is
    /// several percent of every step for the rest of the run.
    pub fit_gain: f64,
    /// Shares smaller than this many samples are not measured (fixed per-step costs would
    /// dominate the figure).
    pub measure_min_batch: u64,
    /// Steps after which a node left out for its measured speed is planned with its catalog
    /// figure again (and re-measured), so a straggler that recovered comes back.
    pub probation_steps: u64,
    /// Each re-plan within this many agreed steps makes the next one wait longer (chasing the
    /// error of the last figures is what oscillates).
    pub replan_memory_steps: u64,
    /// A measured drift counts only when it is this many times the node's own step-to-step
    /// spread (noise is not a change).
    pub noise_margin: f64,
    /// Links are re-planned for when the ring measures this many times slower than planned...
    pub links_slower: f64,
    /// ...or this many times faster (on a ring at least as large as the one measured before).
    pub links_faster: f64,
    /// The watchdog redoes the step in flight after this many times the longest recent
    /// interval between agreed steps without progress (at least twice the heartbeat timeout).
    pub watchdog_steps: f64,
    /// Resyncs in a row without an agreed step after which the run stops, saying why (every
    /// node is alive but some cannot exchange data: a firewall between two workers, a one-way
    /// partition), instead of redoing the same step for ever.
    pub max_resyncs: u32,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            window: 4,
            speed_window: 9,
            drift: 0.5,
            min_gain: 0.25,
            patience: 2,
            settle_steps: 8,
            fit_steps: 4,
            fit_gain: 0.04,
            measure_min_batch: 0,
            probation_steps: 20,
            replan_memory_steps: 100,
            noise_margin: 2.5,
            links_slower: 1.25,
            links_faster: 1.5,
            watchdog_steps: 10.0,
            max_resyncs: 5,
        }
    }
}

/// What comes in.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    /// Time passed: consult the failure detector.
    Tick,
    /// The transport lost its connection to a node (evidence for the detector).
    PeerDown(NodeId),
    /// An envelope from a node.
    Net(NodeId, Envelope),
    /// The user stopped the run (Ctrl-C, SIGTERM): end it early, cleanly (see
    /// [`Coordinator::stop_early`]).
    Stop,
}

/// What the driver must do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    /// Send an envelope to a node.
    Send(NodeId, Envelope),
    /// Send an envelope to the checkpoint aggregator.
    Checkpoint(Envelope),
    /// Something worth logging happened.
    Event(Event),
    /// Step `step` is agreed (every worker finished it); `digest`: the model every replica
    /// holds after it, when the step was synchronized.
    Agreed {
        /// The step.
        step: u64,
        /// The agreed digest of a synchronized step (of the first sync group).
        digest: Option<u64>,
    },
    /// Agreed steps from `to` on were undone (a loss inside a local-SGD period rolls the
    /// cluster back to the last averaged model).
    RolledBack {
        /// The first step to be redone.
        to: u64,
    },
    /// The run is over (finished, stalled, or stopped by a violation).
    Finished,
}

/// What a plan gives each worker (batches, and layers in a pipeline): a new one is logged.
type PlanShape = (Vec<(NodeId, u64)>, Vec<Option<LayerRange>>);

/// A node's configured (or registered) compute cost.
fn configured(cfg: &Config, n: NodeId) -> StepCost {
    let node = cfg.cluster.node(n);
    (cfg.train_flops / node.flops, node.step_overhead_s.max(0.0))
}

/// Who does what in an epoch about to begin (see `Coordinator::staff`).
struct Staffing {
    live: Vec<NodeId>,
    plan: Plan,
    assigns: Vec<Assign>,
    groups: Vec<SyncGroup>,
    holders: Holders,
    whole_holder: Option<NodeId>,
}

impl Staffing {
    /// A data-parallel node without the version: it fetches the whole model. (A stage or a
    /// sharded worker fetches the layers it lacks: `StageWork::fetch`, `ShardWork::fetch`.)
    fn lacks_model(&self, a: &Assign) -> bool {
        a.stage.is_none() && a.shard.is_none() && !self.holders.contains_key(&a.node)
    }

    /// The nodes that serve state in this epoch without working in it.
    fn sources(&self) -> BTreeSet<NodeId> {
        let mut sources: BTreeSet<NodeId> = self
            .assigns
            .iter()
            .filter_map(|a| a.stage.as_ref())
            .flat_map(|sw| sw.fetch.iter().map(|f| f.0))
            .chain(
                self.assigns
                    .iter()
                    .filter_map(|a| a.shard.as_ref())
                    .flat_map(|sw| sw.fetch.iter().map(|f| f.0)),
            )
            .collect();
        if self.assigns.iter().any(|a| self.lacks_model(a)) {
            sources.extend(self.whole_holder);
        }
        sources.retain(|n| !self.assigns.iter().any(|a| a.node == *n));
        sources
    }
}

/// Why no epoch can begin.
#[derive(Debug, Clone)]
enum Unstaffed {
    /// The version to resume from is (partly) held only by lost nodes: a checkpoint restore
    /// may help.
    Lost(String),
    /// The live nodes hold it but cannot train (no plan fits them): nodes that come back may
    /// help; a restore cannot.
    Short(String),
    /// Fewer than half of the members are reachable (fail-over): wait for them.
    CutOff(String),
}

/// Training waits for nodes: the live ones hold version `from` (`holders`) but no plan fits
/// them (`why`), since `since_ms`.
#[derive(Debug, Clone)]
struct Waiting {
    from: u64,
    holders: Holders,
    why: String,
    since_ms: u64,
    /// Waiting because fewer than half of the members are reachable (see `quorum`).
    cut_off: bool,
}

/// One epoch's assignment, as the coordinator keeps it.
#[derive(Debug, Clone)]
struct Era {
    epoch: u64,
    from: u64,
    assigns: Vec<Assign>,
    groups: Vec<SyncGroup>,
    policy: SyncPolicy,
    collective: Collective,
    /// Nodes outside the epoch that some of its workers fetch state from: their loss stalls
    /// it as a worker's would.
    sources: BTreeSet<NodeId>,
}

impl Era {
    fn workers(&self) -> impl Iterator<Item = NodeId> + '_ {
        self.assigns.iter().map(|a| a.node)
    }

    fn has(&self, n: NodeId) -> bool {
        self.assigns.iter().any(|a| a.node == n)
    }

    /// Whether step `s` of this epoch is synchronized (every replica agrees after it).
    fn synchronized(&self, s: u64, end: u64) -> bool {
        self.policy.mode(self.from, end, s).synchronized()
    }

    /// Who holds the version after this epoch's steps, with their layers (a sharded
    /// worker: its part's, beside every weight).
    fn holders(&self) -> Holders {
        self.assigns
            .iter()
            .map(|a| {
                let layers = a.stage.as_ref().map(|s| s.layers);
                (a.node, layers.or(a.shard.as_ref().map(|s| s.owned)))
            })
            .collect()
    }
}

#[derive(Debug, Clone, Copy)]
struct Report {
    digest: u64,
    compute_ns: u64,
    comm_ns: u64,
}

#[derive(Debug, Clone)]
struct Halting {
    epoch: u64,
    waiting: BTreeSet<NodeId>,
    held: BTreeMap<NodeId, Vec<HeldVersion>>,
}

/// The coordinator's state machine.
#[derive(Debug)]
pub struct Coordinator {
    cfg: Config,
    detector: FailureDetector,
    epoch: u64,
    /// Epochs whose steps are not all agreed, oldest first; the last is the current one.
    eras: Vec<Era>,
    /// The current epoch's grant: steps below it may be started.
    until: u64,
    /// Every step below this is agreed.
    agreed: u64,
    /// The last version every replica agreed on.
    last_sync: u64,
    reports: BTreeMap<u64, BTreeMap<NodeId, Report>>,
    halting: Option<Halting>,
    /// Who holds version `start_step` before the first epoch.
    initial: Holders,
    /// The checkpoint rule's state (see [`CheckpointDuty`]): a version from which the next
    /// synchronized one is due after a lost writer, and the last synchronized version.
    catch_up: u64,
    last_synced: u64,
    pending_checkpoint: Option<(u64, Vec<NodeId>)>,
    /// Per node: its measured step times ÷ what the plan's figures predict, smoothed.
    measured: BTreeMap<NodeId, SpeedEstimate>,
    /// Per node: the (seconds per sample of the whole model, fixed seconds per step) the
    /// planner is given (configured figures until a rebalance).
    assumed: BTreeMap<NodeId, StepCost>,
    /// Per node: the spread of its measured step times (relative, robust to outliers), which
    /// the planner charges as the wait for the slowest of noisy workers.
    noise: BTreeMap<NodeId, f64>,
    /// The current data-parallel ring's measured time per step.
    ring: RingTime,
    /// The factor on every link's bandwidth the planner is given: 1 until a measured ring
    /// says the links move less than configured (or probed).
    link_scale: f64,
    /// The ring size `link_scale` was measured on: a smaller ring's (a node left out, fewer
    /// processes competing for the cores) does not raise it again.
    link_scale_ring: usize,
    /// Per node left out for its measured speed: steps until it is tried again, doubled at
    /// each try (a node that is still slow is not brought back every few steps).
    probation_wait: BTreeMap<NodeId, u64>,
    /// Nodes brought back on probation: their drift is judged by the margin alone, not widened
    /// by their noise (one that is still as slow goes out again).
    on_probation: BTreeSet<NodeId>,
    /// Live nodes the current plan leaves out, and since which step.
    left_out: BTreeMap<NodeId, u64>,
    /// Nodes that joined and wait for the next epoch.
    joiners: BTreeSet<NodeId>,
    /// Nodes not in the cluster file given an id that have not registered yet.
    reserved: BTreeSet<NodeId>,
    /// Fail-over: the live members when the running epoch began (a successor: its replica's,
    /// its lost predecessor included). A loss that leaves fewer than half of them is more
    /// likely this host cut off than most nodes dead: training waits for them instead of going
    /// on alone (the others take over; a stale coordinator must not train a branch of its own).
    quorum: usize,
    /// The part each worker of the latest sharded epoch owns (empty after any other epoch).
    shard_parts: BTreeMap<NodeId, LayerRange>,
    /// Nodes that asked to leave: planned out at the next epoch, told to stop when no running
    /// epoch needs them.
    leaving: BTreeSet<NodeId>,
    /// Agreed steps in a row whose measurements predicted a worthwhile re-plan.
    over: u32,
    /// The steps at which measurements re-planned.
    rebalanced_at: Vec<u64>,
    /// Whether the first fit is over: it re-planned, or its figures filled their window
    /// without asking to (a successor's starts over: its plan's figures are its
    /// predecessor's, measured already).
    fitted: bool,
    last_planned: Option<PlanShape>,
    plan_cache: Option<(Vec<u64>, Vec<NodeId>, Plan)>,
    local_sgd: bool,
    finished: bool,
    /// When something last moved (a step agreed, an epoch begun, a halted node answered).
    last_progress_ms: u64,
    /// Agreement intervals, ms (median of the last few): what "too long" means.
    step_ms: SpeedEstimate,
    /// The time of the last agreement.
    last_agreed_ms: u64,
    /// The current plan's predicted time between synchronizations, ms.
    predicted_step_ms: f64,
    /// Resyncs since the last agreed step: each one doubles the patience of the next.
    resyncs: u32,
    /// The time `handle` was last called with.
    now_ms: u64,
    /// The coordinator's term (fail-over: a successor's is its predecessor's + 1).
    term: u32,
    /// The oldest version a resumption may start from when no epoch runs (a successor's
    /// floor: nodes that hold only older versions were still fetching).
    floor: u64,
    /// A successor that has not resumed yet: (the predecessor's host, its term).
    taking_over: Option<(NodeId, u32)>,
    /// A successor resumes from what these nodes hold (the predecessor's running epochs
    /// counted on them; the others' versions are older).
    resume_from: Option<BTreeSet<NodeId>>,
    /// Layers were held only by lost nodes: the node the latest checkpoint is restored on.
    restoring: Option<(NodeId, String)>,
    /// No epoch runs: the live nodes cannot train, and training waits for nodes to come back.
    waiting: Option<Waiting>,
    /// The version the last checkpoint restore went back to: a loss found again at that very
    /// version is not restored again (it would restore and fail forever).
    restored_at: Option<u64>,
    /// Nodes that left cleanly: only a `Join` brings one back (a heartbeat or report of its
    /// still in flight is not a rejoin).
    departed: BTreeSet<NodeId>,
    /// The user asked the run to stop: `Some(None)` until its last version is chosen (an
    /// epoch switch in flight), then `Some(Some(at))`.
    stop: Option<Option<u64>>,
    out: Vec<Effect>,
}

impl Coordinator {
    /// A coordinator watching every node of the cluster from `now_ms`.
    pub fn new(cfg: Config, now_ms: u64) -> Coordinator {
        // Ticks come many times per timeout; a gap of a third of it between two is this
        // process's own stall (frozen, swapped out), not the silence of every node.
        let mut detector = FailureDetector::new(cfg.heartbeat_timeout_ms.max(1))
            .with_stall_limit((cfg.heartbeat_timeout_ms / 3).max(1));
        for id in cfg.cluster.ids() {
            if !cfg.absent.contains(&id) {
                detector.watch(id, now_ms);
            }
        }
        let holding: Vec<NodeId> = match &cfg.initial_holders {
            Some(h) => h.clone(),
            None => cfg.cluster.ids().collect(),
        };
        let initial: Holders = holding
            .into_iter()
            .filter(|n| !cfg.absent.contains(n))
            .map(|n| (n, None))
            .collect();
        let assumed = cfg
            .cluster
            .ids()
            .map(|i| (i, configured(&cfg, i)))
            .collect();
        Coordinator {
            detector,
            epoch: 0,
            eras: Vec::new(),
            until: cfg.start_step,
            agreed: cfg.start_step,
            last_sync: cfg.start_step,
            reports: BTreeMap::new(),
            halting: None,
            initial,
            catch_up: u64::MAX,
            last_synced: cfg.start_step,
            pending_checkpoint: None,
            measured: BTreeMap::new(),
            noise: BTreeMap::new(),
            ring: RingTime::default(),
            link_scale: 1.0,
            link_scale_ring: 0,
            probation_wait: BTreeMap::new(),
            on_probation: BTreeSet::new(),
            assumed,
            left_out: BTreeMap::new(),
            joiners: BTreeSet::new(),
            reserved: BTreeSet::new(),
            quorum: 0,
            shard_parts: BTreeMap::new(),
            leaving: BTreeSet::new(),
            over: 0,
            rebalanced_at: Vec::new(),
            fitted: false,
            last_planned: None,
            plan_cache: None,
            local_sgd: false,
            finished: false,
            last_progress_ms: now_ms,
            step_ms: SpeedEstimate::new(0.0, 9),
            last_agreed_ms: now_ms,
            predicted_step_ms: 0.0,
            resyncs: 0,
            now_ms,
            term: 0,
            floor: cfg.start_step,
            taking_over: None,
            resume_from: None,
            restoring: None,
            waiting: None,
            restored_at: None,
            departed: BTreeSet::new(),
            stop: None,
            out: Vec::new(),
            cfg,
        }
    }

    /// A successor's coordinator (fail-over), from its predecessor's replica: `r` is already
    /// of the new term, hosted here. It watches the replica's members, halts all of them (every
    /// epoch of earlier terms), and resumes from the newest synchronized version they all hold,
    /// as after a worker's loss; the first synchronized version after that is checkpointed
    /// (the predecessor's round in flight, if any, died with it). Call [`Coordinator::start`]
    /// to send the halts.
    pub fn take_over(mut cfg: Config, r: &Replica, predecessor: NodeId, now_ms: u64) -> Self {
        cfg.cluster = r.cluster.clone();
        cfg.absent = cfg
            .cluster
            .ids()
            .filter(|n| !r.members.contains(n))
            .collect();
        cfg.initial_holders = Some(Vec::new());
        cfg.host = Some(r.host);
        let mut c = Coordinator::new(cfg, now_ms);
        c.term = r.term;
        c.epoch = super::succession::term_epoch(r.term);
        c.agreed = r.agreed.max(c.agreed);
        c.until = c.agreed;
        c.last_sync = r.floor;
        c.last_synced = r.floor;
        c.floor = r.floor;
        c.catch_up = r.floor;
        c.taking_over = Some((predecessor, r.term));
        c.fitted = true;
        c.quorum = r.members.len() + 1;
        c.resume_from = Some(r.involved.iter().copied().collect());
        // Given their place by the predecessor: admitted here when they register.
        c.reserved = r.reserved.iter().copied().collect();
        c
    }

    /// Plan the first epoch and hand it out.
    pub fn start(&mut self) -> Vec<Effect> {
        if self.taking_over.is_some() {
            // Halt every epoch of the earlier terms; the answers say what each node holds.
            self.replicate(true);
            self.halt(None);
        } else if self.cfg.steps <= self.cfg.start_step {
            self.finish(Event::Finished);
        } else {
            let holders = self.initial.clone();
            self.begin_epoch(self.cfg.start_step, &holders, None);
        }
        std::mem::take(&mut self.out)
    }

    /// Feed one input at `now_ms`; returns the effects to carry out, in order.
    pub fn handle(&mut self, now_ms: u64, input: Input) -> Vec<Effect> {
        if self.finished {
            return Vec::new();
        }
        self.now_ms = self.now_ms.max(now_ms);
        match input {
            Input::Tick => {
                for DetectorEvent::Dead { node, silent_ms } in self.detector.tick(now_ms) {
                    self.on_dead(node, silent_ms);
                }
                self.watchdog();
                self.give_up_waiting();
            }
            Input::PeerDown(node) => {
                if let Some(DetectorEvent::Dead { node, silent_ms }) =
                    self.detector.peer_down(node, now_ms)
                {
                    self.on_dead(node, silent_ms);
                }
            }
            Input::Net(from, env) => self.on_net(now_ms, from, env),
            Input::Stop => self.stop_early(),
        }
        std::mem::take(&mut self.out)
    }

    /// Every step below this is agreed.
    pub fn agreed(&self) -> u64 {
        self.agreed
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Whether any epoch ran local SGD.
    pub fn used_local_sgd(&self) -> bool {
        self.local_sgd
    }

    /// Whether the run is over.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    fn emit(&mut self, e: Event) {
        self.out.push(Effect::Event(e));
    }

    fn send(&mut self, to: NodeId, env: Envelope) {
        self.out.push(Effect::Send(to, env));
    }

    fn finish(&mut self, e: Event) {
        self.emit(e);
        self.finished = true;
        self.out.push(Effect::Finished);
    }

    fn on_net(&mut self, now_ms: u64, from: NodeId, env: Envelope) {
        match &env {
            Envelope::Reserve { id, name, address } => {
                if self.cfg.host.is_none_or(|h| h == from) {
                    self.reserve(*id, name, address);
                }
                return;
            }
            Envelope::Register(caps) if self.reserved.contains(&from) => {
                return self.admit(now_ms, from, caps);
            }
            _ => {}
        }
        if from.index() >= self.cfg.cluster.nodes.len() {
            return;
        }
        // A node heard from after it was declared dead (a healed partition) rejoins as a new
        // incarnation: its model may be stale.
        if matches!(env, Envelope::Join) {
            self.departed.remove(&from);
        } else if self.departed.contains(&from) {
            return;
        }
        let rejoin = matches!(env, Envelope::Join) || !self.detector.is_alive(from);
        self.detector.heard(from, now_ms);
        if rejoin {
            self.detector.watch(from, now_ms);
            // Whatever epoch it still runs is over: stop it before it gets a new one (control
            // envelopes arrive in order, so the halt comes first).
            let epoch = self.epoch;
            self.send(from, Envelope::Halt { epoch });
            return self.on_join(from);
        }
        match env {
            Envelope::StepDone {
                epoch,
                step,
                digest,
                compute_ns,
                comm_ns,
            } => self.on_report(
                from,
                epoch,
                step,
                Report {
                    digest,
                    compute_ns,
                    comm_ns,
                },
            ),
            Envelope::Halted { epoch, held } => self.on_halted(from, epoch, held),
            Envelope::Leave => self.on_leave(from),
            Envelope::StepFailed { epoch, reason }
                if epoch >= self.eras.first().map_or(u64::MAX, |e| e.epoch) =>
            {
                let name = self.cfg.cluster.node(from).name.clone();
                self.finish(Event::Stalled(format!(
                    "`{name}` cannot compute its work: {reason}"
                )));
            }
            _ => {}
        }
    }

    // ---- the steady state ------------------------------------------------------------------

    fn era_of(&self, step: u64) -> Option<&Era> {
        self.eras.iter().rev().find(|e| e.from <= step)
    }

    fn on_report(&mut self, from: NodeId, epoch: u64, step: u64, r: Report) {
        // Reports that come during a halt are kept (the steps every survivor finished are
        // agreed with them when the halt completes); settling waits for the halt to end.
        if step < self.agreed {
            return;
        }
        // The report must come from a worker of the epoch that covers the step.
        let Some(era) = self.era_of(step) else { return };
        if era.epoch != epoch || !era.has(from) {
            return;
        }
        self.reports.entry(step).or_default().insert(from, r);
        self.settle();
    }

    /// Agree every step whose reports are complete, in order; then move the grant and see
    /// whether a re-plan is due.
    fn settle(&mut self) {
        let before = self.agreed;
        while !self.finished && self.halting.is_none() {
            let s = self.agreed;
            let Some(era) = self.era_of(s) else { break };
            let complete = self
                .reports
                .get(&s)
                .is_some_and(|r| era.workers().all(|w| r.contains_key(&w)));
            if !complete {
                break;
            }
            self.agree(s);
        }
        if self.agreed > before && !self.finished {
            self.extend_grant();
            self.retire_leavers();
            self.admit_joiners();
            self.release_leavers();
            self.consider_replan();
        }
    }

    /// Step `s` is finished on every worker that reported it.
    fn agree(&mut self, s: u64) {
        let Some(era) = self.era_of(s).cloned() else {
            return;
        };
        let reports = self.reports.remove(&s).unwrap_or_default();
        let synchronized = era.synchronized(s, self.cfg.steps);
        // Every member of a sync group must hold the same parameters after a synchronized step
        // (data parallel: one group; a pipeline: one per stage). A disagreement stops the run
        // here, not hundreds of steps later.
        let mut group_digests: Vec<Option<u64>> = Vec::new();
        for (layers, members) in &era.groups {
            let distinct: BTreeSet<u64> = members
                .iter()
                .filter_map(|m| reports.get(m).map(|r| r.digest))
                .collect();
            if synchronized && distinct.len() > 1 {
                let what = if era.groups.len() > 1 {
                    format!("the replicas of layers {layers}")
                } else {
                    "replicas".into()
                };
                return self.finish(Event::Violation(format!(
                    "{what} disagree after step {s}: {} distinct models",
                    distinct.len()
                )));
            }
            group_digests.push(distinct.first().copied());
        }
        self.measure(&era, &reports);
        self.measure_ring(&era, s, &reports);
        let version = s + 1;
        if synchronized {
            self.last_sync = version;
            self.open_checkpoint(version, &era, &group_digests);
        }
        let since = self.now_ms.saturating_sub(self.last_agreed_ms);
        self.step_ms.add(since as f64);
        self.last_agreed_ms = self.now_ms;
        self.last_progress_ms = self.now_ms;
        self.resyncs = 0;
        self.out.push(Effect::Agreed {
            step: s,
            digest: group_digests
                .first()
                .copied()
                .flatten()
                .filter(|_| synchronized),
        });
        self.agreed = version;
        let before = self.eras.len();
        while self.eras.len() > 1 && self.eras[1].from <= self.agreed {
            self.eras.remove(0);
        }
        if self.stop == Some(None) {
            self.stop_early();
        }
        // Every step moves `agreed` (the successor needs it); an epoch that ended moves the
        // floor and who is involved (every node needs that).
        self.replicate(self.eras.len() != before);
        if self.agreed >= self.cfg.steps {
            self.finish(Event::Finished);
        }
    }

    fn measure(&mut self, era: &Era, reports: &BTreeMap<NodeId, Report>) {
        for a in &era.assigns {
            let Some(r) = reports.get(&a.node) else {
                continue;
            };
            if a.batch == 0
                || a.batch < self.cfg.tuning.measure_min_batch
                || r.compute_ns == 0
                || a.flop_share <= 0.0
            {
                continue;
            }
            // How much longer (or shorter) than the plan's figures predict: a factor on both
            // the node's fixed and per-sample costs (their ratio is what was measured when
            // it registered), so small shares, whose time is mostly fixed cost, do not look
            // faster or slower per sample than they are.
            let (per_sample, fixed) = self.assumed.get(&a.node).copied().unwrap_or((0.0, 0.0));
            let predicted = (fixed + a.batch as f64 * per_sample) * a.flop_share;
            if predicted <= 0.0 {
                continue;
            }
            let ratio = r.compute_ns as f64 / 1e9 / predicted;
            let window = self.cfg.tuning.speed_window;
            let m = self
                .measured
                .entry(a.node)
                .or_insert_with(|| SpeedEstimate::new(1.0, window));
            m.add(ratio);
            // Once the first figure (the plan's own 1.0) is out of the window.
            if m.len() >= window {
                self.noise.insert(a.node, m.log_spread());
            }
        }
    }

    /// The ring's time in step `s` of `era`, when its workers form one every-step ring of the
    /// whole model (a data-parallel epoch), past its first steps (which fetch and warm up).
    fn measure_ring(&mut self, era: &Era, s: u64, reports: &BTreeMap<NodeId, Report>) {
        let ring = era.groups.len() == 1
            && era.policy == SyncPolicy::EveryStep
            && era.collective == Collective::Ring
            && era.assigns.iter().all(|a| a.stage.is_none() && a.batch > 0);
        if !ring || s < era.from + 2 {
            return;
        }
        let waits: Vec<f64> = era
            .workers()
            .filter_map(|n| reports.get(&n))
            .map(|r| r.comm_ns as f64 / 1e9)
            .collect();
        self.ring.add(&waits);
    }

    /// Move the current epoch's horizon `window` steps past the last agreed step, in hops of
    /// half a window (fewer messages; nodes never wait while reports keep coming).
    fn extend_grant(&mut self) {
        let Some(cur) = self.eras.last() else { return };
        let window = cur.policy.window(self.cfg.tuning.window);
        let until = (self.agreed + window).min(self.cfg.steps);
        if until <= self.until
            || (until < self.cfg.steps && until < self.until + window.div_ceil(2))
        {
            return;
        }
        self.until = until;
        let (epoch, workers): (u64, Vec<NodeId>) = (cur.epoch, cur.workers().collect());
        for w in workers {
            self.send(w, Envelope::Grant { epoch, until });
        }
    }

    /// Open a checkpoint round for synchronized version `version` when one is due: one shard
    /// per sync group, written by its first member (its [`CheckpointDuty`] follows the same
    /// rule), with the digest every replica agreed on.
    fn open_checkpoint(&mut self, version: u64, era: &Era, digests: &[Option<u64>]) {
        let mut rule = CheckpointDuty {
            layers: LayerRange::new(0, 0),
            every: self.cfg.checkpoint_every,
            catch_up: self.catch_up,
            at_end: self.cfg.checkpoint_at_end,
            last: self.last_synced,
        };
        let due = rule.due(version, self.cfg.steps);
        rule.advance(version, self.cfg.steps);
        (self.catch_up, self.last_synced) = (rule.catch_up, rule.last);
        if !due {
            return;
        }
        let shards: Option<Vec<(LayerRange, u64, NodeId)>> = era
            .groups
            .iter()
            .zip(digests)
            .map(|((layers, members), d)| Some((*layers, (*d)?, *members.first()?)))
            .collect();
        let Some(shards) = shards else { return };
        self.out.push(Effect::Checkpoint(Envelope::CheckpointBegin {
            step: version,
            shards: shards.iter().map(|&(layers, d, _)| (layers, d)).collect(),
        }));
        self.pending_checkpoint = Some((version, shards.iter().map(|s| s.2).collect()));
    }

    // ---- planning --------------------------------------------------------------------------

    // ---- membership ------------------------------------------------------------------------

    /// Nodes whose loss stalls a running epoch: its workers and the nodes they fetch from.
    fn involved(&self) -> BTreeSet<NodeId> {
        self.eras
            .iter()
            .flat_map(|e| e.workers().chain(e.sources.iter().copied()))
            .collect()
    }

    /// Fail-over: what a successor needs, to every live node (`all`: each epoch, loss, join
    /// and take-over), or to the designated successor only (after an agreed step: one message
    /// per step, not one per node; a later successor's `agreed` may lag, and the steps every
    /// member finished are agreed again on resumption, counted once).
    fn replicate(&mut self, all: bool) {
        let Some(host) = self.cfg.host else { return };
        let r = Replica {
            term: self.term,
            host,
            epoch: self.epoch,
            floor: self.eras.first().map_or(self.floor, |e| e.from),
            agreed: self.agreed,
            members: self.detector.alive(),
            involved: self.involved().into_iter().collect(),
            reserved: self.reserved.iter().copied().collect(),
            cluster: self.cfg.cluster.clone(),
        };
        let to: Vec<NodeId> = if all {
            r.members.iter().copied().filter(|&m| m != host).collect()
        } else {
            super::succession::successor(&r, &BTreeSet::new())
                .into_iter()
                .collect()
        };
        for n in to {
            self.send(n, Envelope::Succession(Box::new(r.clone())));
        }
    }
}

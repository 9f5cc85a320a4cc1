//! The coordinator actor: plans, hands out work, watches heartbeats, re-plans.
//!
//! A thin shell over `ravnest-core`: the planner decides the split, the failure detector decides
//! who is dead. Its own logic is bookkeeping: which step, which epoch, who still owes a result,
//! who holds the latest model.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use ravnest_core::cost::Costs;
use ravnest_core::detector::{DetectorEvent, FailureDetector};
use ravnest_core::planner::sync::{Collective, SyncMethod};
use ravnest_core::planner::{Layout, Plan, Role};
use ravnest_core::{
    ClusterSpec, ModelSpec, NodeId, PlanOptions, PlannerKind, TrainingSpec, plan_with,
};
use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::msg::{Addr, Envelope, StageWork, StepMode, Work};
use crate::seams::Transport;
use crate::trace::Trace;

/// Something the coordinator did or saw, for reports.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A plan with a different split than the previous one (node, batch).
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
    /// The running step was aborted.
    Aborted {
        /// Step.
        step: u64,
    },
    /// A node's measured speed drifted from the plan: re-planned with measured figures.
    Rebalanced {
        /// Node.
        node: NodeId,
        /// Seconds per sample the plan assumed.
        assumed_s_per_sample: f64,
        /// Seconds per sample measured.
        measured_s_per_sample: f64,
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
    /// Replicas disagreed after a step (a checker failure).
    Violation(String),
    /// Training cannot go on.
    Stalled(String),
    /// All steps done.
    Finished,
}

/// The coordinator's log: events with virtual times, and each step's completion time.
#[derive(Debug, Clone, Default)]
pub struct RunLog {
    /// (ns since start, event).
    pub events: Vec<(u64, Event)>,
    /// Completion time of each step, ns since start.
    pub step_done_ns: Vec<u64>,
    /// Whether the run used local SGD (replicas agree only after averaging rounds).
    pub local_sgd: bool,
    /// The model digest every replica reported, per synchronized version.
    pub synced_digest: BTreeMap<u64, u64>,
}

/// Relative drift of a node's measured seconds per sample from the plan's figure that triggers
/// a re-plan with measured figures.
pub const DRIFT: f64 = 0.25;

/// Steps after which a node left out for its measured speed is given another chance (planned
/// with its catalog figure again, and re-measured).
pub const PROBATION_STEPS: u64 = 20;

/// Shared handle on the log.
pub type SharedLog = Arc<Mutex<RunLog>>;

/// Read-only configuration of a coordinator.
#[derive(Debug)]
pub struct CoordinatorActor<T> {
    /// The network.
    pub transport: T,
    /// The whole cluster as configured.
    pub cluster: ClusterSpec,
    /// The model.
    pub model: ModelSpec,
    /// Training settings.
    pub training: TrainingSpec,
    /// Planner to use.
    pub planner: PlannerKind,
    /// Steps to train.
    pub steps: u64,
    /// Heartbeat silence after which a node is dead.
    pub heartbeat_timeout: Duration,
    /// How often the detector is consulted.
    pub tick: Duration,
    /// Start of time.
    pub t0: Instant,
    /// Trace.
    pub trace: Trace,
    /// Log.
    pub log: SharedLog,
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
    /// Shares smaller than this many samples are not measured (fixed per-step costs would
    /// dominate the figure).
    pub measure_min_batch: u64,
    /// Steps after a rebalance for a node before its drift can trigger another one (measured
    /// speeds on shared machines jitter; 0 in the simulator, whose jitter is modelled).
    pub rebalance_cooldown: u64,
    /// Whether the nodes' compute backend runs pipeline stages. When it does, a cluster where
    /// no data-parallel plan fits is planned as a pipeline; data parallel is preferred
    /// otherwise (every replica then holds the whole model, which recovery relies on).
    pub allow_pipeline: bool,
}

/// Messages.
#[derive(Debug)]
pub enum CoordMsg {
    /// An envelope from the network.
    Net(Addr, Envelope),
    /// Consult the failure detector.
    Tick,
    /// The transport lost its connection to a node (TCP): evidence for the detector.
    PeerDown(NodeId),
}

/// The step in flight.
#[derive(Debug)]
struct Current {
    epoch: u64,
    mode: StepMode,
    workers: Vec<NodeId>,
    /// Per worker: samples, and the share of the model's training FLOPs it computes per
    /// sample (1 in data parallel; a stage's layers' share in a pipeline). Its compute time ÷
    /// both is its measured seconds per sample of the whole model.
    batches: BTreeMap<NodeId, (u64, f64)>,
    pending: BTreeSet<NodeId>,
    digests: BTreeMap<NodeId, u64>,
    /// The sync groups: the layers each holds (a data-parallel step has one group holding
    /// every layer; a pipeline one per stage) and its members.
    groups: Vec<((u32, u32), Vec<NodeId>)>,
}

/// One node's assignment in a step, before it becomes a [`Work`].
#[derive(Debug, Clone)]
struct Assign {
    node: NodeId,
    offset: u64,
    batch: u64,
    ring: Vec<NodeId>,
    stage: Option<StageWork>,
}

/// Layer ranges a node fetches, and from whom.
type Fetches = Vec<(NodeId, (u32, u32))>;

/// A plan turned into assignments: (assignments, sync groups as in [`Current::groups`]).
type Assignments = (Vec<Assign>, Vec<((u32, u32), Vec<NodeId>)>);

/// Mutable state.
#[derive(Debug)]
pub struct CoordState {
    detector: FailureDetector,
    epoch: u64,
    step: u64,
    current: Option<Current>,
    /// Nodes known to hold model version `step`.
    holders: BTreeSet<NodeId>,
    done: Option<oneshot::Sender<()>>,
    finished: bool,
    ticker: Option<tokio::task::JoinHandle<()>>,
    /// Workers and batches of the last plan, to log only changes.
    last_plan: Option<Vec<(NodeId, u64)>>,
    /// The layers of each stage in the last plan (empty for data parallel): a pipeline
    /// re-split over the same nodes is a new plan too.
    last_layers: Vec<Option<(u32, u32)>>,
    /// Measured seconds per sample (smoothed), per node.
    measured: BTreeMap<NodeId, f64>,
    /// Seconds per sample the planner is given, per node (catalog figures until drift).
    assumed: BTreeMap<NodeId, f64>,
    /// The last version every replica agreed on (after a synchronous or averaging step).
    last_sync: u64,
    /// Whether any step ran under local SGD.
    local_sgd: bool,
    /// The model version from which the next checkpoint is due.
    next_checkpoint: u64,
    /// The checkpoint in progress: (version, writers).
    pending_checkpoint: Option<(u64, Vec<NodeId>)>,
    /// Layers each node holds current at version `step` when it is a pipeline stage (absent:
    /// the whole model).
    layers_held: BTreeMap<NodeId, (u32, u32)>,
    /// Live nodes the last plan left out, and since which step.
    left_out: BTreeMap<NodeId, u64>,
    /// The step of each node's last rebalance.
    rebalanced_at: BTreeMap<NodeId, u64>,
    /// The last plan and what it was made from: (live nodes, their FLOP/s bits).
    plan_cache: Option<PlanCache>,
}

type PlanCache = ((Vec<NodeId>, Vec<u64>), ravnest_core::Plan);

impl<T: Transport> CoordinatorActor<T> {
    fn now_ns(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }

    fn now_ms(&self) -> u64 {
        self.t0.elapsed().as_millis() as u64
    }

    fn event(&self, e: Event) {
        let t = self.now_ns();
        let (what, node) = match &e {
            Event::Planned { .. } => ("planned", None),
            Event::Detected { node, .. } => ("detected-dead", Some(*node)),
            Event::Aborted { .. } => ("aborted", None),
            Event::Joined { node } => ("joined", Some(*node)),
            Event::Rebalanced { node, .. } => ("rebalanced", Some(*node)),
            Event::CheckpointComplete { .. } => ("checkpoint", None),
            Event::Violation(_) => ("violation", None),
            Event::Stalled(_) => ("stalled", None),
            Event::Finished => ("finished", None),
        };
        self.trace
            .record(t, what, node.map(Addr::Node), Some(Addr::Coordinator), 0);
        self.log.lock().unwrap().events.push((t, e));
    }

    fn send(&self, to: NodeId, env: Envelope) {
        let _ = self.transport.send(Addr::Coordinator, Addr::Node(to), env);
    }

    fn finish(&self, st: &mut CoordState, e: Event) {
        self.event(e);
        st.finished = true;
        st.current = None;
        if let Some(tx) = st.done.take() {
            let _ = tx.send(());
        }
    }

    /// Plan the live nodes and hand out the current step.
    fn issue_step(&self, st: &mut CoordState) {
        let mut live = st.detector.alive();
        // Inside a local-SGD period only the nodes that hold a local model take part; joiners
        // wait for the next averaging round.
        if st.step > st.last_sync
            && let Some(prev) = &st.last_plan
        {
            live.retain(|n| prev.iter().any(|(w, _)| w == n));
        }
        if live.is_empty() {
            return self.finish(st, Event::Stalled("no live nodes".into()));
        }
        if st.holders.is_empty() {
            return self.finish(
                st,
                Event::Stalled("no live node holds the latest model".into()),
            );
        }
        // A node left out long enough for its measured speed is planned with its catalog figure
        // again: if it is still slow, the next measurement leaves it out again.
        for (&n, &since) in &st.left_out {
            if st.step >= since + PROBATION_STEPS {
                st.assumed
                    .insert(n, self.train_flops / self.cluster.node(n).flops);
                st.measured.remove(&n);
            }
        }
        let mut sub = self.cluster.subset(&live);
        for (k, id) in live.iter().enumerate() {
            if let Some(&a) = st.assumed.get(id) {
                sub.nodes[k].flops = self.train_flops / a;
            }
        }
        // Data parallel first; a pipeline when no data-parallel plan fits (and the backend runs
        // stages).
        let opts = PlanOptions {
            allow_pipeline: false,
        };
        // Planning is a pure function of the live set and the speeds it is given: reuse the
        // last plan while neither changed (most steps), instead of planning every step.
        let key: (Vec<NodeId>, Vec<u64>) = (
            live.clone(),
            sub.nodes.iter().map(|n| n.flops.to_bits()).collect(),
        );
        let p = match &st.plan_cache {
            Some((k, p)) if *k == key => p.clone(),
            _ => match plan_with(self.planner, &sub, &self.model, &self.training, opts).or_else(
                |e| {
                    if !self.allow_pipeline {
                        return Err(e);
                    }
                    let pipe = PlanOptions {
                        allow_pipeline: true,
                    };
                    plan_with(self.planner, &sub, &self.model, &self.training, pipe)
                },
            ) {
                Ok(p) => {
                    st.plan_cache = Some((key, p.clone()));
                    p
                }
                Err(e) => {
                    return self.finish(
                        st,
                        Event::Stalled(format!("no plan for the live nodes: {e}")),
                    );
                }
            },
        };
        let (assigns, groups) = match self.assignments(&p, &live, &sub) {
            Ok(a) => a,
            Err(why) => return self.finish(st, Event::Stalled(why)),
        };
        // A stage given layers it does not hold (a re-planned pipeline, a rejoined node)
        // fetches them from nodes that do.
        let mut assigns = assigns;
        for a in &mut assigns {
            if let Some(sw) = &mut a.stage {
                match self.fetch_plan(st, a.node, sw.layers) {
                    Ok(f) => sw.fetch = f,
                    Err(why) => return self.finish(st, Event::Stalled(why)),
                }
            }
        }
        let workers: Vec<(NodeId, u64)> = assigns.iter().map(|a| (a.node, a.batch)).collect();
        let collective = match p.sync.method {
            SyncMethod::EveryStep { collective } | SyncMethod::LocalSgd { collective, .. } => {
                collective
            }
            SyncMethod::None => Collective::Ring,
        };
        let group_size = p.sync.groups.first().map_or(0, |g| g.group_size);
        let mode = match p.sync.method {
            SyncMethod::LocalSgd { local_steps, .. } => {
                st.local_sgd = true;
                if st.step + 1 - st.last_sync >= u64::from(local_steps) || st.step + 1 == self.steps
                {
                    StepMode::Average
                } else {
                    StepMode::Local
                }
            }
            _ => StepMode::Sync,
        };
        if mode == StepMode::Local
            && st.step > st.last_sync
            && workers.iter().any(|(w, _)| {
                !st.last_plan
                    .as_ref()
                    .is_some_and(|p| p.iter().any(|(x, _)| x == w))
            })
        {
            // Cannot happen (candidates are restricted above); keep the invariant explicit.
            return self.finish(
                st,
                Event::Stalled("a new worker inside a local-SGD period".into()),
            );
        }
        for &n in &live {
            if workers.iter().any(|w| w.0 == n) {
                st.left_out.remove(&n);
            } else {
                let since = st.left_out.entry(n).or_insert(st.step);
                if st.step >= *since + PROBATION_STEPS {
                    *since = st.step;
                }
            }
        }
        st.epoch += 1;
        let layers: Vec<Option<(u32, u32)>> = assigns
            .iter()
            .map(|a| a.stage.as_ref().map(|s| s.layers))
            .collect();
        if st.last_plan.as_ref() != Some(&workers) || st.last_layers != layers {
            self.event(Event::Planned {
                step: st.step,
                workers: workers.clone(),
            });
            st.last_plan = Some(workers.clone());
            st.last_layers = layers;
        }
        let source = *st.holders.first().expect("checked non-empty");
        for a in &assigns {
            let work = Work {
                epoch: st.epoch,
                step: st.step,
                offset: a.offset,
                batch: a.batch,
                global_batch: u64::from(self.training.global_batch),
                ring: a.ring.clone(),
                // Holders hold the last synchronized version; inside a local period every
                // worker continues from its own model.
                state_from: (a.stage.is_none()
                    && st.step == st.last_sync
                    && !st.holders.contains(&a.node))
                .then_some(source),
                mode,
                collective,
                group_size,
                stage: a.stage.clone(),
            };
            self.send(a.node, Envelope::Work(Box::new(work)));
        }
        st.current = Some(Current {
            epoch: st.epoch,
            workers: workers.iter().map(|w| w.0).collect(),
            batches: {
                let costs = Costs::new(&self.cluster, &self.model, &self.training);
                let whole = costs.train_flops(&costs.all()).max(f64::MIN_POSITIVE);
                assigns
                    .iter()
                    .map(|a| {
                        let share = a.stage.as_ref().map_or(1.0, |s| {
                            costs.train_flops(&(s.layers.0 as usize..s.layers.1 as usize)) / whole
                        });
                        (a.node, (a.batch, share))
                    })
                    .collect()
            },
            pending: workers.iter().map(|w| w.0).collect(),
            digests: BTreeMap::new(),
            groups,
            mode,
        });
    }

    /// Where `node` fetches the layers of `layers` it does not hold at version `st.step`:
    /// (peer, layer range) pieces, each from a holder of the whole piece.
    fn fetch_plan(
        &self,
        st: &CoordState,
        node: NodeId,
        layers: (u32, u32),
    ) -> Result<Fetches, String> {
        let holds = |n: NodeId, l: u32| {
            st.holders.contains(&n) && st.layers_held.get(&n).is_none_or(|h| h.0 <= l && l < h.1)
        };
        let mut out: Fetches = Vec::new();
        for l in layers.0..layers.1 {
            if holds(node, l) {
                continue;
            }
            let source = match out.last() {
                Some(&(s, (_, end))) if end == l && holds(s, l) => Some(s),
                _ => st
                    .holders
                    .iter()
                    .copied()
                    .find(|&h| h != node && holds(h, l)),
            };
            let Some(s) = source else {
                return Err(format!(
                    "layer {l} of model version {} was held only by nodes that are gone, so the pipeline cannot go on; restart from the last checkpoint",
                    st.step
                ));
            };
            match out.last_mut() {
                Some((p, (_, end))) if *p == s && *end == l => *end = l + 1,
                _ => out.push((s, (l, l + 1))),
            }
        }
        Ok(out)
    }

    /// Each node's assignment under plan `p` of the live nodes `live` (`sub`: their cluster).
    fn assignments(
        &self,
        p: &Plan,
        live: &[NodeId],
        sub: &ClusterSpec,
    ) -> Result<Assignments, String> {
        let all_layers = (0, self.model.layers.len() as u32);
        match &p.layout {
            Layout::DataParallel { .. } => {
                let workers: Vec<(NodeId, u64)> = p
                    .nodes
                    .iter()
                    .filter(|n| n.batch > 0)
                    .map(|n| (live[n.id.index()], n.batch))
                    .collect();
                let ring: Vec<NodeId> = match p.sync.groups.first() {
                    Some(g) if g.order.len() == workers.len() => {
                        g.order.iter().map(|i| live[i.index()]).collect()
                    }
                    _ => workers.iter().map(|w| w.0).collect(),
                };
                let mut offset = 0;
                let assigns = workers
                    .iter()
                    .map(|&(node, batch)| {
                        offset += batch;
                        Assign {
                            node,
                            offset: offset - batch,
                            batch,
                            ring: ring.clone(),
                            stage: None,
                        }
                    })
                    .collect();
                Ok((assigns, vec![(all_layers, ring)]))
            }
            Layout::Pipeline {
                stages,
                replicas,
                bounds,
                micro_batch,
            } => {
                let (s, r) = (*stages, *replicas);
                let mut grid: Vec<Vec<Option<NodeId>>> = vec![vec![None; s]; r];
                let mut samples = vec![0u64; r];
                for n in &p.nodes {
                    if let Role::Stage { replica, stage } = n.role
                        && n.batch > 0
                        && replica < r
                        && stage < s
                    {
                        grid[replica][stage] = Some(live[n.id.index()]);
                        samples[replica] = n.batch;
                    }
                }
                let costs = Costs::new(sub, &self.model, &self.training);
                let mut assigns = Vec::new();
                let mut groups = Vec::new();
                let used: Vec<usize> = (0..r).filter(|&k| samples[k] > 0).collect();
                for k in 0..s {
                    let column: Vec<NodeId> = used.iter().filter_map(|&rep| grid[rep][k]).collect();
                    if column.len() != used.len() {
                        return Err(format!(
                            "the pipeline plan leaves stage {k} of a replica without a node"
                        ));
                    }
                    // The plan's ring order for this stage's group, else replica order.
                    let ring: Vec<NodeId> = p
                        .sync
                        .groups
                        .iter()
                        .map(|g| g.order.iter().map(|i| live[i.index()]).collect::<Vec<_>>())
                        .find(|o| o.len() == column.len() && column.iter().all(|c| o.contains(c)))
                        .unwrap_or_else(|| column.clone());
                    let layers = (bounds[k] as u32, bounds[k + 1] as u32);
                    groups.push((layers, ring.clone()));
                    let mut offset = 0;
                    for rep in 0..r {
                        offset += samples[rep];
                        let Some(node) = grid[rep][k].filter(|_| samples[rep] > 0) else {
                            continue;
                        };
                        let at = |j: usize| grid[rep][j];
                        assigns.push(Assign {
                            node,
                            offset: offset - samples[rep],
                            batch: samples[rep],
                            ring: ring.clone(),
                            stage: Some(StageWork {
                                stage: k as u32,
                                stages: s as u32,
                                layers,
                                prev: k.checked_sub(1).and_then(at),
                                next: (k + 1 < s).then(|| at(k + 1)).flatten(),
                                micro_batch: u64::from(*micro_batch),
                                out_bytes_per_sample: if k + 1 < s {
                                    costs.boundary_bytes_per_sample(bounds[k + 1])
                                } else {
                                    0
                                },
                                in_bytes_per_sample: if k > 0 {
                                    costs.boundary_bytes_per_sample(bounds[k])
                                } else {
                                    0
                                },
                                sync_bytes: costs.grad_bytes(&(bounds[k]..bounds[k + 1])),
                                fetch: Vec::new(),
                            }),
                        });
                    }
                }
                Ok((assigns, groups))
            }
        }
    }

    /// Go back to the last synchronized model (a loss inside a local-SGD period loses the
    /// local progress of everyone: the replicas must agree again).
    fn roll_back(&self, st: &mut CoordState) {
        if st.step > st.last_sync {
            st.step = st.last_sync;
            self.log
                .lock()
                .unwrap()
                .step_done_ns
                .truncate((st.last_sync - self.start_step) as usize);
        }
    }

    fn on_dead(&self, st: &mut CoordState, node: NodeId, silent_ms: u64) {
        self.event(Event::Detected { node, silent_ms });
        // A writer lost before its shard arrived: that round cannot complete; the next
        // checkpoint is due at the next synchronized step.
        if let Some((version, writers)) = &st.pending_checkpoint
            && writers.contains(&node)
        {
            let version = *version;
            let _ = self.transport.send(
                Addr::Coordinator,
                Addr::Checkpoint,
                Envelope::CheckpointAbandon { step: version },
            );
            st.pending_checkpoint = None;
            st.next_checkpoint = version;
        }
        st.holders.remove(&node);
        let involved = st
            .current
            .as_ref()
            .is_some_and(|c| c.workers.contains(&node));
        if involved && !st.finished {
            let c = st.current.take().expect("involved implies current");
            self.event(Event::Aborted { step: st.step });
            for w in c.workers.iter().filter(|&&w| w != node) {
                self.send(*w, Envelope::Abort { epoch: c.epoch });
            }
            // Continue from the last synchronized step, re-planned without the lost node.
            self.roll_back(st);
            self.issue_step(st);
        }
    }

    fn on_step_done(
        &self,
        st: &mut CoordState,
        node: NodeId,
        epoch: u64,
        step: u64,
        digest: u64,
        compute_ns: u64,
    ) {
        let Some(c) = &mut st.current else { return };
        if c.epoch != epoch || step != st.step || !c.pending.remove(&node) {
            return;
        }
        c.digests.insert(node, digest);
        if let Some(&(batch, share)) = c.batches.get(&node)
            && batch > 0
            && batch >= self.measure_min_batch
            && compute_ns > 0
            && share > 0.0
        {
            // Seconds per sample, smoothed: one slow step is jitter, three are drift.
            let s = compute_ns as f64 / 1e9 / batch as f64 / share;
            let m = st.measured.entry(node).or_insert(s);
            *m = 0.5 * *m + 0.5 * s;
        }
        if !c.pending.is_empty() {
            return;
        }
        let synchronized = c.mode != StepMode::Local;
        // Every member of a sync group must hold the same parameters after a synchronized
        // step (data parallel: one group; a pipeline: one per stage).
        let mut group_digests: Vec<Option<u64>> = Vec::new();
        for (layers, members) in &c.groups {
            let distinct: BTreeSet<u64> = members
                .iter()
                .filter_map(|m| c.digests.get(m).copied())
                .collect();
            if synchronized && distinct.len() > 1 {
                let what = if c.groups.len() > 1 {
                    format!("the replicas of layers {}..{}", layers.0, layers.1)
                } else {
                    "replicas".into()
                };
                self.event(Event::Violation(format!(
                    "{what} disagree after step {}: {} distinct models",
                    st.step,
                    distinct.len()
                )));
            }
            group_digests.push(distinct.first().copied());
        }
        let workers = c.workers.clone();
        let groups = std::mem::take(&mut c.groups);
        let pipelined = groups.len() > 1;
        st.current = None;
        if synchronized {
            st.holders = workers.iter().copied().collect();
            st.last_sync = st.step + 1;
            for (layers, members) in &groups {
                for &m in members {
                    if pipelined {
                        st.layers_held.insert(m, *layers);
                    } else {
                        st.layers_held.remove(&m);
                    }
                }
            }
            if let Some(Some(d)) = group_digests.first() {
                self.log
                    .lock()
                    .unwrap()
                    .synced_digest
                    .insert(st.step + 1, *d);
            }
            // Checkpoint a version every replica agreed on, once one is due (under local SGD:
            // the first averaging round from then on): one shard per group, written by its
            // first member.
            let version = st.step + 1;
            let due = (self.checkpoint_every > 0 && version >= st.next_checkpoint)
                || (self.checkpoint_at_end && version == self.steps);
            let shards: Option<Vec<(u32, u32, u64, NodeId)>> = groups
                .iter()
                .zip(&group_digests)
                .map(|((layers, members), d)| Some((layers.0, layers.1, (*d)?, *members.first()?)))
                .collect();
            if due && let Some(shards) = shards {
                st.next_checkpoint = version + self.checkpoint_every;
                let _ = self.transport.send(
                    Addr::Coordinator,
                    Addr::Checkpoint,
                    Envelope::CheckpointBegin {
                        step: version,
                        shards: shards.iter().map(|&(a, b, d, _)| (a, b, d)).collect(),
                    },
                );
                for &(a, b, _, writer) in &shards {
                    let _ = self.transport.send(
                        Addr::Coordinator,
                        Addr::Node(writer),
                        Envelope::WriteShard {
                            step: version,
                            layers: (a, b),
                        },
                    );
                }
                st.pending_checkpoint = Some((version, shards.iter().map(|s| s.3).collect()));
            }
        }
        // Rebalance when a worker's measured speed drifts from what the plan assumed (a lone
        // worker takes the whole batch whatever its speed: nothing to rebalance).
        let alone = workers.len() < 2;
        for w in workers.into_iter().filter(|_| !alone) {
            let cooling = st
                .rebalanced_at
                .get(&w)
                .is_some_and(|&at| st.step < at + self.rebalance_cooldown);
            if let (Some(&m), Some(&a)) = (st.measured.get(&w), st.assumed.get(&w))
                && (m / a - 1.0).abs() > DRIFT
                && !cooling
            {
                st.rebalanced_at.insert(w, st.step);
                self.event(Event::Rebalanced {
                    node: w,
                    assumed_s_per_sample: a,
                    measured_s_per_sample: m,
                });
                st.assumed.insert(w, m);
            }
        }
        st.step += 1;
        self.log.lock().unwrap().step_done_ns.push(self.now_ns());
        if st.step >= self.steps {
            self.log.lock().unwrap().local_sgd = st.local_sgd;
            self.finish(st, Event::Finished);
        } else {
            self.issue_step(st);
        }
    }
}

impl<T: Transport> Actor for CoordinatorActor<T> {
    type Msg = CoordMsg;
    type State = CoordState;
    type Arguments = oneshot::Sender<()>;

    async fn pre_start(
        &self,
        myself: ActorRef<CoordMsg>,
        done: oneshot::Sender<()>,
    ) -> Result<CoordState, ActorProcessingErr> {
        self.transport.register(
            Addr::Coordinator,
            crate::seams::mailbox(myself.clone(), CoordMsg::Net),
        );
        let mut detector = FailureDetector::new(self.heartbeat_timeout.as_millis().max(1) as u64);
        let now = self.now_ms();
        for id in self.cluster.ids() {
            detector.watch(id, now);
        }
        let ticker = myself.send_interval(self.tick, || CoordMsg::Tick);
        let mut st = CoordState {
            detector,
            epoch: 0,
            step: self.start_step,
            current: None,
            holders: match &self.initial_holders {
                Some(h) => h.iter().copied().collect(),
                None => self.cluster.ids().collect(),
            },
            done: Some(done),
            finished: false,
            ticker: Some(ticker),
            last_plan: None,
            last_layers: Vec::new(),
            last_sync: self.start_step,
            local_sgd: false,
            next_checkpoint: self.start_step + self.checkpoint_every,
            pending_checkpoint: None,
            layers_held: BTreeMap::new(),
            left_out: BTreeMap::new(),
            rebalanced_at: BTreeMap::new(),
            plan_cache: None,
            measured: BTreeMap::new(),
            assumed: self
                .cluster
                .ids()
                .map(|i| (i, self.train_flops / self.cluster.node(i).flops))
                .collect(),
        };
        if self.steps <= self.start_step {
            self.finish(&mut st, Event::Finished);
        } else {
            self.issue_step(&mut st);
        }
        Ok(st)
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<CoordMsg>,
        st: &mut CoordState,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(t) = st.ticker.take() {
            t.abort();
        }
        Ok(())
    }

    async fn handle(
        &self,
        _myself: ActorRef<CoordMsg>,
        msg: CoordMsg,
        st: &mut CoordState,
    ) -> Result<(), ActorProcessingErr> {
        if st.finished {
            return Ok(());
        }
        match msg {
            CoordMsg::Tick => {
                for DetectorEvent::Dead { node, silent_ms } in st.detector.tick(self.now_ms()) {
                    self.on_dead(st, node, silent_ms);
                }
            }
            CoordMsg::PeerDown(node) => {
                if let Some(DetectorEvent::Dead { node, silent_ms }) =
                    st.detector.peer_down(node, self.now_ms())
                {
                    self.on_dead(st, node, silent_ms);
                }
            }
            CoordMsg::Net(Addr::Node(from), env) => {
                // A node heard from after it was declared dead (a healed partition) rejoins as a
                // new incarnation: its model may be stale, so it is no longer a holder.
                let rejoin = matches!(env, Envelope::Join) || !st.detector.is_alive(from);
                st.detector.heard(from, self.now_ms());
                match env {
                    _ if rejoin => {
                        st.detector.watch(from, self.now_ms());
                        st.holders.remove(&from);
                        self.event(Event::Joined { node: from });
                        // It takes part from the next step boundary on (or now, if idle).
                        if st.current.is_none() {
                            self.issue_step(st);
                        }
                    }
                    Envelope::StepDone {
                        epoch,
                        step,
                        digest,
                        compute_ns,
                    } => self.on_step_done(st, from, epoch, step, digest, compute_ns),
                    Envelope::StepFailed { epoch, reason }
                        if st.current.as_ref().is_some_and(|c| c.epoch == epoch) =>
                    {
                        let name = self.cluster.node(from).name.clone();
                        self.finish(
                            st,
                            Event::Stalled(format!("`{name}` cannot compute its work: {reason}")),
                        );
                    }
                    _ => {}
                }
            }
            CoordMsg::Net(Addr::Coordinator | Addr::Checkpoint, _) => {}
        }
        Ok(())
    }
}

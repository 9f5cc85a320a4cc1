//! The node actor: computes its share of each step, hands the result to its collective actor
//! (ring all-reduce or parameter server), and applies what comes back.
//!
//! A thin shell: work arrives as [`Work`], the gradient comes from the [`Compute`] seam, the
//! synchronization runs in the node's [`CollectiveActor`] (spawned linked to it), and model
//! versions are kept for peers that need them.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use ravnest_core::NodeId;
use ravnest_core::pipeline::{Ready, StageRun, micro_batches};
use tokio::time::Instant;

use crate::collective::{CollectiveActor, CollectiveMsg, Outcome, is_collective};
use crate::msg::{Addr, Envelope, StageWork, StepMode, Work};
use crate::seams::{Compute, Transport};
use crate::toy;

/// What a node was doing during a [`Span`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    /// Computing a step.
    Compute,
    /// Inside a collective (sending, receiving, or waiting for a peer).
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
    /// Virtual ns spent computing.
    pub compute_ns: u64,
    /// Virtual ns between starting a collective and finishing (or aborting) it.
    pub comm_ns: u64,
    /// Steps this node applied.
    pub steps: u64,
    /// Collectives aborted.
    pub aborted: u64,
    /// The latest model version this node holds, and the version number.
    pub model: (u64, Arc<Vec<f32>>),
    /// The part of `model` that version applies to (a pipeline stage keeps only its layers
    /// current; the rest is stale).
    pub model_range: Range<usize>,
    /// Activity intervals, in order (for timelines).
    pub spans: Vec<Span>,
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
    /// Bytes one full gradient stands for (chunks are charged their share).
    pub grad_bytes: u64,
    /// Bytes one model copy stands for.
    pub model_bytes: u64,
    /// Counters.
    pub counters: Counters,
    /// Start of the run (spans are measured from it).
    pub t0: Instant,
}

/// Messages a node actor handles.
#[derive(Debug)]
pub enum NodeMsg {
    /// An envelope from the network.
    Net(Addr, Envelope),
    /// The node's collective actor finished (or abandoned) a step's synchronization.
    Collective(Outcome),
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

/// A node's mutable state.
#[derive(Debug, Default)]
pub struct NodeState {
    epoch: u64,
    /// Model versions held (the last two): version k = the model after k steps.
    versions: BTreeMap<u64, Arc<Vec<f32>>>,
    /// The latest synchronized version (identical on every replica), kept through local-SGD
    /// periods so the cluster can fall back to it.
    synced: Option<(u64, Arc<Vec<f32>>)>,
    /// Work waiting for a model version to arrive from a peer.
    waiting: Option<Work>,
    /// The step whose collective is running, and when it started.
    in_flight: Option<(Work, Instant)>,
    /// Compute time of the step in flight, ns.
    compute_ns: u64,
    /// The node's collective actor.
    collective: Option<ActorRef<CollectiveMsg>>,
    /// Link probes this node sent and awaits the echo of, by id.
    probes: ProbeWaiters,
    /// Probe ids issued so far.
    probe_seq: u64,
    /// The pipeline stage step being computed.
    pipe: Option<Pipe>,
    /// Activations and gradients that arrived before their work: (epoch, is gradient,
    /// micro-batch, data).
    early_pipe: Vec<(u64, bool, u32, Vec<f32>)>,
    /// Layers being fetched from peers before a stage can start.
    assembling: Option<Assembly>,
    /// The epoch whose fetches are complete.
    fetched: Option<u64>,
}

/// A model version being put together from this node's own layers and peers' ranges.
#[derive(Debug)]
struct Assembly {
    epoch: u64,
    version: u64,
    model: Vec<f32>,
    missing: std::collections::BTreeSet<(u32, u32)>,
}

/// A pipeline stage's step in progress.
#[derive(Debug)]
struct Pipe {
    work: Work,
    sw: StageWork,
    run: StageRun,
    /// Global sample ranges of the micro-batches.
    micros: Vec<Range<u64>>,
    /// Model version `work.step`.
    model: Arc<Vec<f32>>,
    /// This stage's layers, and where their parameters sit in `model`.
    layers: Range<usize>,
    range: Range<usize>,
    /// Forward input and output per micro-batch awaiting its backward.
    saved: BTreeMap<u32, (Option<Vec<f32>>, Vec<f32>)>,
    /// Σ of the layers' parameter gradients so far.
    grad: Vec<f32>,
    compute_ns: u64,
}

fn feed(run: &mut StageRun, is_grad: bool, micro: u32, data: Vec<f32>) -> Result<(), String> {
    let r = if is_grad {
        run.gradient(micro, data)
    } else {
        run.activation(micro, data)
    };
    r.map_err(|e| e.to_string())
}

type ProbeWaiters = Arc<Mutex<BTreeMap<u64, tokio::sync::oneshot::Sender<()>>>>;

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

/// Measure the links from `me` to `peers` (best of three round trips each) and report them
/// to the coordinator. Runs beside the actor, which routes the echoes back by id.
fn spawn_link_probes<T: Transport>(
    transport: T,
    me: NodeId,
    peers: Vec<NodeId>,
    waiters: ProbeWaiters,
    first_id: u64,
) {
    tokio::spawn(async move {
        let mut id = first_id;
        let mut links = Vec::new();
        for peer in peers {
            let mut best = [f64::INFINITY; 2];
            for (k, len) in [(0, PROBE_SMALL), (1, PROBE_LARGE)] {
                for _ in 0..3 {
                    id += 1;
                    let (tx, rx) = tokio::sync::oneshot::channel();
                    waiters.lock().unwrap().insert(id, tx);
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
                    if sent.is_ok()
                        && matches!(
                            tokio::time::timeout(Duration::from_secs(5), rx).await,
                            Ok(Ok(()))
                        )
                    {
                        best[k] = best[k].min(t.elapsed().as_secs_f64());
                    }
                    waiters.lock().unwrap().remove(&id);
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
}

impl<T: Transport, C: Compute> NodeActor<T, C> {
    fn me(&self) -> Addr {
        Addr::Node(self.id)
    }

    fn send(&self, to: Addr, env: Envelope) {
        // A send can only fail for an unknown address or a downed sender; both mean this node
        // is being torn down or the cluster changed under it, and the detector handles it.
        let _ = self.transport.send(self.me(), to, env);
    }

    /// Record model version `work.step + 1` and report it.
    fn finish_step(&self, st: &mut NodeState, work: &Work, model: Vec<f32>, synchronized: bool) {
        let range = self.range_of(work, model.len());
        let digest = toy::digest(&model[range.clone()]);
        // Versions are shared, not copied: the counters, the synchronized slot and the
        // version map hold the same buffer.
        let model = Arc::new(model);
        let snapshot = model.clone();
        self.count(|c| {
            c.model = (work.step + 1, snapshot);
            c.model_range = range;
            c.steps += 1;
        });
        if synchronized {
            st.synced = Some((work.step + 1, model.clone()));
        }
        st.versions.insert(work.step + 1, model);
        while st.versions.len() > 2 {
            st.versions.pop_first();
        }
        self.send(
            Addr::Coordinator,
            Envelope::StepDone {
                epoch: work.epoch,
                step: work.step,
                digest,
                compute_ns: st.compute_ns,
            },
        );
    }

    fn span(&self, since: Instant, kind: SpanKind) -> Span {
        Span {
            start_ns: since.duration_since(self.t0).as_nanos() as u64,
            end_ns: self.t0.elapsed().as_nanos() as u64,
            kind,
        }
    }

    fn count(&self, f: impl FnOnce(&mut NodeCounters)) {
        f(self.counters.lock().unwrap().entry(self.id).or_default());
    }

    /// Record `ns` of compute since `since` (adjacent compute spans merge: a pipeline stage
    /// computes many short micro-batches).
    fn computed(&self, since: Instant) -> u64 {
        let span = self.span(since, SpanKind::Compute);
        let ns = since.elapsed().as_nanos() as u64;
        self.count(|c| {
            c.compute_ns += ns;
            match c.spans.last_mut() {
                Some(last) if last.kind == span.kind && last.end_ns == span.start_ns => {
                    last.end_ns = span.end_ns;
                }
                _ => c.spans.push(span),
            }
        });
        ns
    }

    /// The part of a `len`-value model that `work` computes and synchronizes.
    fn range_of(&self, work: &Work, len: usize) -> Range<usize> {
        match &work.stage {
            Some(s) => self
                .compute
                .param_range(s.layers.0 as usize..s.layers.1 as usize, len),
            None => 0..len,
        }
    }

    fn fail(&self, epoch: u64, reason: String) {
        self.send(Addr::Coordinator, Envelope::StepFailed { epoch, reason });
    }

    async fn start_work(&self, st: &mut NodeState, work: Work) {
        // A stage given layers it does not hold fetches them first (each range from a peer
        // that holds it), on top of its own copy of the version, or of the initial model.
        if let Some(sw) = &work.stage
            && !sw.fetch.is_empty()
            && st.fetched != Some(work.epoch)
        {
            let base = st
                .version(work.step)
                .map_or_else(|| self.compute.initial_model(), |m| (*m).clone());
            for &(peer, layers) in &sw.fetch {
                self.send(
                    Addr::Node(peer),
                    Envelope::StateRequest {
                        version: work.step,
                        to: self.id,
                        layers: Some(layers),
                    },
                );
            }
            st.assembling = Some(Assembly {
                epoch: work.epoch,
                version: work.step,
                model: base,
                missing: sw.fetch.iter().map(|f| f.1).collect(),
            });
            st.waiting = Some(work);
            return;
        }
        let Some(model) = st.version(work.step) else {
            match work.state_from {
                Some(peer) => {
                    self.send(
                        Addr::Node(peer),
                        Envelope::StateRequest {
                            version: work.step,
                            to: self.id,
                            layers: None,
                        },
                    );
                    st.waiting = Some(work);
                }
                None => st.waiting = Some(work),
            }
            return;
        };
        if let Some(sw) = work.stage.clone() {
            return self.start_stage(st, work, sw, model).await;
        }
        let samples = toy::step_samples(work.step, work.global_batch, work.offset, work.batch);
        let t = Instant::now();
        let sum = self
            .compute
            .gradient_sum(self.id, work.step, samples, &model)
            .await;
        st.compute_ns = self.computed(t);
        let range = 0..model.len();
        self.contribute(st, work, &model, range, sum);
    }

    /// The step's gradient sum over `range` of `model` is computed: apply it (local SGD) or
    /// hand this node's contribution to its collective actor.
    fn contribute(
        &self,
        st: &mut NodeState,
        work: Work,
        model: &Arc<Vec<f32>>,
        range: Range<usize>,
        sum: Vec<f32>,
    ) {
        let contribution: Vec<f32> = match work.mode {
            // Weight b_i / B: the sum over my samples divided by the global batch, so the
            // ring's sum is the mean gradient of the whole batch.
            StepMode::Sync => sum.iter().map(|x| x / work.global_batch as f32).collect(),
            StepMode::Local | StepMode::Average => {
                let mean: Vec<f32> = sum.iter().map(|x| x / work.batch.max(1) as f32).collect();
                let mut local = model[range.clone()].to_vec();
                self.compute.apply_update(&mut local, &mean);
                if work.mode == StepMode::Local {
                    let full = if range.len() == model.len() {
                        local
                    } else {
                        let mut full = (**model).clone();
                        full[range].copy_from_slice(&local);
                        full
                    };
                    self.finish_step(st, &work, full, false);
                    return;
                }
                // The model weighted by its batch share: the ring's sum is the weighted average.
                let share = work.batch as f32 / work.global_batch as f32;
                local.iter().map(|w| w * share).collect()
            }
        };
        if !work.ring.contains(&self.id) {
            return;
        }
        st.in_flight = Some((work.clone(), Instant::now()));
        if let Some(c) = &st.collective {
            let _ = c.cast(CollectiveMsg::Start(work, contribution));
        }
    }

    /// Begin a pipeline stage's step: its micro-batches run in 1F1B order as their inputs
    /// arrive ([`NodeActor::pump`]).
    async fn start_stage(
        &self,
        st: &mut NodeState,
        work: Work,
        sw: StageWork,
        model: Arc<Vec<f32>>,
    ) {
        let layers = sw.layers.0 as usize..sw.layers.1 as usize;
        let range = self.compute.param_range(layers.clone(), model.len());
        if sw.stage >= sw.stages || layers.is_empty() || range.end > model.len() {
            return self.fail(
                work.epoch,
                format!(
                    "malformed stage work: stage {} of {}, layers {}..{}, parameters {}..{} of a {}-value model",
                    sw.stage,
                    sw.stages,
                    layers.start,
                    layers.end,
                    range.start,
                    range.end,
                    model.len()
                ),
            );
        }
        let first = toy::step_samples(work.step, work.global_batch, work.offset, work.batch).start;
        let micros: Vec<Range<u64>> = micro_batches(work.batch, sw.micro_batch)
            .into_iter()
            .map(|r| first + r.start..first + r.end)
            .collect();
        let mut run = StageRun::new(sw.stages as usize, sw.stage as usize, micros.len() as u32);
        for (epoch, is_grad, micro, data) in std::mem::take(&mut st.early_pipe) {
            // An input the schedule refuses (duplicate, out of range) is dropped: the step then
            // waits, and the coordinator's abort or the next work ends it.
            if epoch == work.epoch {
                let _ = feed(&mut run, is_grad, micro, data);
            } else if epoch > work.epoch {
                st.early_pipe.push((epoch, is_grad, micro, data));
            }
        }
        st.pipe = Some(Pipe {
            grad: vec![0.0; range.len()],
            work,
            sw,
            run,
            micros,
            model,
            layers,
            range,
            saved: BTreeMap::new(),
            compute_ns: 0,
        });
        self.pump(st).await;
    }

    /// Run every operation of the stage's schedule whose input is here, in order; when the
    /// schedule is done, hand the layers' gradient to the stage's sync group.
    async fn pump(&self, st: &mut NodeState) {
        while let Some(p) = st.pipe.as_mut() {
            let Some(ready) = p.run.next_ready() else {
                break;
            };
            let t = Instant::now();
            let (epoch, step) = (p.work.epoch, p.work.step);
            let params = &p.model[p.range.clone()];
            let failed = match ready {
                Ready::Forward { micro, input } => {
                    let samples = p.micros[micro as usize].clone();
                    let n = samples.end - samples.start;
                    let out = self
                        .compute
                        .stage_forward(
                            self.id,
                            step,
                            samples,
                            p.layers.clone(),
                            params,
                            input.as_deref(),
                        )
                        .await;
                    match out {
                        Ok(out) => {
                            if let Some(next) = p.sw.next {
                                self.send(
                                    Addr::Node(next),
                                    Envelope::Activation {
                                        epoch,
                                        micro,
                                        data: out.clone(),
                                        virtual_bytes: p.sw.out_bytes_per_sample * n,
                                    },
                                );
                            }
                            p.saved.insert(micro, (input, out));
                            None
                        }
                        Err(e) => Some(e),
                    }
                }
                Ready::Backward { micro, grad } => {
                    let samples = p.micros[micro as usize].clone();
                    let n = samples.end - samples.start;
                    let (input, output) = p.saved.remove(&micro).unwrap_or_default();
                    let back = self
                        .compute
                        .stage_backward(
                            self.id,
                            step,
                            samples,
                            p.layers.clone(),
                            params,
                            input.as_deref(),
                            &output,
                            grad.as_deref(),
                        )
                        .await;
                    match back {
                        Ok((g, grad_in)) if g.len() == p.grad.len() => {
                            for (a, b) in p.grad.iter_mut().zip(&g) {
                                *a += b;
                            }
                            if let Some(prev) = p.sw.prev {
                                self.send(
                                    Addr::Node(prev),
                                    Envelope::ActivationGrad {
                                        epoch,
                                        micro,
                                        data: grad_in,
                                        virtual_bytes: p.sw.in_bytes_per_sample * n,
                                    },
                                );
                            }
                            None
                        }
                        Ok((g, _)) => Some(format!(
                            "the backward of layers {}..{} gave {} gradient values for {} parameters",
                            p.layers.start,
                            p.layers.end,
                            g.len(),
                            p.grad.len()
                        )),
                        Err(e) => Some(e),
                    }
                }
            };
            p.compute_ns += self.computed(t);
            if let Some(reason) = failed {
                st.pipe = None;
                return self.fail(epoch, reason);
            }
        }
        if st.pipe.as_ref().is_some_and(|p| p.run.done())
            && let Some(p) = st.pipe.take()
        {
            st.compute_ns = p.compute_ns;
            self.contribute(st, p.work, &p.model, p.range, p.grad);
        }
    }

    /// An activation or gradient from a neighbouring stage.
    async fn on_stage_input(
        &self,
        st: &mut NodeState,
        epoch: u64,
        is_grad: bool,
        micro: u32,
        data: Vec<f32>,
    ) {
        let current = st.pipe.as_ref().map(|p| p.work.epoch);
        if current == Some(epoch) {
            if let Some(p) = st.pipe.as_mut()
                && feed(&mut p.run, is_grad, micro, data).is_ok()
            {
                self.pump(st).await;
            }
        } else if epoch > st.epoch || (epoch == st.epoch && current.is_none()) {
            // Its work has not arrived yet (it comes from the coordinator, the data from a
            // peer): keep it. Older epochs are void.
            if st.early_pipe.len() < 1 << 16 {
                st.early_pipe.push((epoch, is_grad, micro, data));
            }
        }
    }

    /// The collective of the step in flight ended.
    fn on_outcome(&self, st: &mut NodeState, outcome: Outcome) {
        let epoch = match &outcome {
            Outcome::Done { epoch, .. } | Outcome::Aborted { epoch } => *epoch,
        };
        let Some((work, started)) = st.in_flight.take_if(|(w, _)| w.epoch == epoch) else {
            return;
        };
        let span = self.span(started, SpanKind::Comm);
        let aborted = matches!(outcome, Outcome::Aborted { .. });
        self.count(|c| {
            c.comm_ns += started.elapsed().as_nanos() as u64;
            c.aborted += u64::from(aborted);
            c.spans.push(span);
        });
        if let Outcome::Done { sum, .. } = outcome {
            let Some(prev) = st.version(work.step) else {
                return;
            };
            let range = self.range_of(&work, prev.len());
            let model = match work.mode {
                StepMode::Average if range.len() == prev.len() => sum,
                _ => {
                    let mut model = (*prev).clone();
                    if work.mode == StepMode::Average {
                        model[range].copy_from_slice(&sum);
                    } else {
                        self.compute.apply_update(&mut model[range], &sum);
                    }
                    model
                }
            };
            self.finish_step(st, &work, model, true);
        }
    }
}

impl NodeState {
    /// Model version `v`, if held (a recent version, or the last synchronized one).
    fn version(&self, v: u64) -> Option<Arc<Vec<f32>>> {
        match (self.versions.get(&v), &self.synced) {
            (_, Some((sv, m))) if *sv == v => Some(m.clone()),
            (Some(m), _) => Some(m.clone()),
            _ => None,
        }
    }
}

impl<T: Transport, C: Compute> Actor for NodeActor<T, C> {
    type Msg = NodeMsg;
    type State = NodeState;
    type Arguments = Start;

    async fn pre_start(
        &self,
        myself: ActorRef<NodeMsg>,
        start: Start,
    ) -> Result<NodeState, ActorProcessingErr> {
        let (collective, _) = Actor::spawn_linked(
            None,
            CollectiveActor {
                id: self.id,
                transport: self.transport.clone(),
                grad_bytes: self.grad_bytes,
                node: myself.clone(),
            },
            (),
            myself.get_cell(),
        )
        .await?;
        // Collective traffic goes straight to the collective actor; the rest to the node.
        {
            let (node, coll) = (myself.clone(), collective.clone());
            self.transport.register(
                self.me(),
                Arc::new(move |from, env| {
                    if is_collective(&env) {
                        let _ = coll.cast(CollectiveMsg::Net(env));
                    } else {
                        let _ = node.cast(NodeMsg::Net(from, env));
                    }
                }),
            );
        }
        let mut st = NodeState {
            collective: Some(collective),
            ..NodeState::default()
        };
        match start {
            Start::Fresh => {
                let m = self.compute.initial_model();
                let v = self.compute.initial_version();
                let m = Arc::new(m);
                st.synced = Some((v, m.clone()));
                st.versions.insert(v, m);
            }
            Start::Rejoin => self.send(Addr::Coordinator, Envelope::Join),
            Start::Empty => {}
        }
        Ok(st)
    }

    async fn handle(
        &self,
        _myself: ActorRef<NodeMsg>,
        msg: NodeMsg,
        st: &mut NodeState,
    ) -> Result<(), ActorProcessingErr> {
        let (from, env) = match msg {
            NodeMsg::Net(from, env) => (from, env),
            NodeMsg::Collective(outcome) => {
                self.on_outcome(st, outcome);
                return Ok(());
            }
        };
        match env {
            Envelope::Work(w) => {
                if w.epoch < st.epoch {
                    return Ok(());
                }
                if w.epoch > st.epoch {
                    st.epoch = w.epoch;
                    // A newer assignment supersedes a collective still running.
                    if let Some((_, started)) = st.in_flight.take() {
                        let span = self.span(started, SpanKind::Comm);
                        self.count(|c| {
                            c.comm_ns += started.elapsed().as_nanos() as u64;
                            c.aborted += 1;
                            c.spans.push(span);
                        });
                    }
                    if let Some(c) = &st.collective {
                        let _ = c.cast(CollectiveMsg::Supersede(w.epoch));
                    }
                    if st.pipe.take().is_some() {
                        self.count(|c| c.aborted += 1);
                    }
                    st.early_pipe.retain(|e| e.0 >= w.epoch);
                    st.assembling = None;
                }
                self.start_work(st, *w).await;
            }
            Envelope::Chunk { .. }
            | Envelope::Push { .. }
            | Envelope::Pull { .. }
            | Envelope::Abort { .. } => {
                if let Some(c) = &st.collective {
                    let _ = c.cast(CollectiveMsg::Net(env));
                }
            }
            Envelope::Activation {
                epoch, micro, data, ..
            } => self.on_stage_input(st, epoch, false, micro, data).await,
            Envelope::ActivationGrad {
                epoch, micro, data, ..
            } => self.on_stage_input(st, epoch, true, micro, data).await,
            Envelope::StateRequest {
                version,
                to,
                layers,
            } => {
                if let Some(model) = st.version(version) {
                    let range = match layers {
                        Some((a, b)) => self
                            .compute
                            .param_range(a as usize..b as usize, model.len()),
                        None => 0..model.len(),
                    };
                    if let Some(part) = model.get(range) {
                        self.send(
                            Addr::Node(to),
                            Envelope::State {
                                version,
                                model: part.to_vec(),
                                virtual_bytes: self.model_bytes * part.len() as u64
                                    / model.len().max(1) as u64,
                                layers,
                            },
                        );
                    }
                }
            }
            Envelope::State {
                version,
                model,
                layers: Some(layers),
                ..
            } => {
                let Some(a) = st.assembling.as_mut() else {
                    return Ok(());
                };
                let range = self
                    .compute
                    .param_range(layers.0 as usize..layers.1 as usize, a.model.len());
                if a.version != version
                    || range.len() != model.len()
                    || range.end > a.model.len()
                    || !a.missing.remove(&layers)
                {
                    return Ok(());
                }
                a.model[range].copy_from_slice(&model);
                if a.missing.is_empty()
                    && let Some(a) = st.assembling.take()
                {
                    // The assembled version replaces this node's copy of it.
                    let merged = Arc::new(a.model);
                    if st.synced.as_ref().is_some_and(|s| s.0 == version) {
                        st.synced = Some((version, merged.clone()));
                    }
                    st.versions.insert(version, merged);
                    st.fetched = Some(a.epoch);
                    if let Some(w) = st.waiting.take() {
                        if w.epoch == a.epoch {
                            self.start_work(st, w).await;
                        } else {
                            st.waiting = Some(w);
                        }
                    }
                }
            }
            Envelope::State {
                version,
                model,
                layers: None,
                ..
            } => {
                st.versions.insert(version, Arc::new(model));
                if let Some(w) = st.waiting.take() {
                    if w.step == version && w.epoch >= st.epoch {
                        self.start_work(st, w).await;
                    } else {
                        st.waiting = Some(w);
                    }
                }
            }
            Envelope::WriteShard { step, layers } => {
                // The writer stores the shard where it runs (files in `run`) and reports it;
                // a version it no longer holds cannot be written (the round stays incomplete).
                if let Some(model) = st.version(step)
                    && let Some(shard) = model.get(
                        self.compute
                            .param_range(layers.0 as usize..layers.1 as usize, model.len()),
                    )
                {
                    let shard = shard.to_vec();
                    self.send(
                        Addr::Checkpoint,
                        Envelope::Shard {
                            step,
                            layers,
                            digest: toy::digest(&shard),
                            model: shard,
                        },
                    );
                }
            }
            // Addressed to the coordinator or the checkpoint actor, not to a node: ignore.
            Envelope::ProbePeers { peers } => {
                // Ids unique to this node: its id in the high bits.
                let first = (u64::from(self.id.0) << 40) + st.probe_seq;
                st.probe_seq += 6 * peers.len() as u64 + 1;
                spawn_link_probes(
                    self.transport.clone(),
                    self.id,
                    peers,
                    st.probes.clone(),
                    first,
                );
            }
            Envelope::Probe {
                id, echo: false, ..
            } => {
                if let Some(tx) = st.probes.lock().unwrap().remove(&id) {
                    let _ = tx.send(());
                }
            }
            Envelope::Probe { id, data, echo } => {
                if echo {
                    self.send(
                        from,
                        Envelope::Probe {
                            id,
                            data,
                            echo: false,
                        },
                    );
                }
            }
            Envelope::Heartbeat
            | Envelope::LinkReport { .. }
            | Envelope::Join
            | Envelope::Register(_)
            | Envelope::Finish
            | Envelope::StepDone { .. }
            | Envelope::StepFailed { .. }
            | Envelope::CheckpointBegin { .. }
            | Envelope::CheckpointAbandon { .. }
            | Envelope::Shard { .. } => {
                let _ = from;
            }
        }
        Ok(())
    }
}

/// A node process's heartbeat: a task beside the actor (so a long compute does not silence
/// it), sending to the coordinator every `period`.
pub fn spawn_heartbeat<T: Transport>(
    transport: T,
    id: NodeId,
    period: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            if transport
                .send(Addr::Node(id), Addr::Coordinator, Envelope::Heartbeat)
                .is_err()
            {
                return;
            }
        }
    })
}

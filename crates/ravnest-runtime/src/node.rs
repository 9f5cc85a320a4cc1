//! The node actor: computes its share of each step, hands the result to its collective actor
//! (ring all-reduce or parameter server), and applies what comes back.
//!
//! A thin shell: work arrives as [`Work`], the gradient comes from the [`Compute`] seam, the
//! synchronization runs in the node's [`CollectiveActor`] (spawned linked to it), and model
//! versions are kept for peers that need them.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use ravnest_core::NodeId;
use tokio::time::Instant;

use crate::collective::{CollectiveActor, CollectiveMsg, Outcome, is_collective};
use crate::msg::{Addr, Envelope, StepMode, Work};
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
        let digest = toy::digest(&model);
        // Versions are shared, not copied: the counters, the synchronized slot and the
        // version map hold the same buffer.
        let model = Arc::new(model);
        let snapshot = model.clone();
        self.count(|c| {
            c.model = (work.step + 1, snapshot);
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

    async fn start_work(&self, st: &mut NodeState, work: Work) {
        let Some(model) = st.version(work.step) else {
            match work.state_from {
                Some(peer) => {
                    self.send(
                        Addr::Node(peer),
                        Envelope::StateRequest {
                            version: work.step,
                            to: self.id,
                        },
                    );
                    st.waiting = Some(work);
                }
                None => st.waiting = Some(work),
            }
            return;
        };
        let samples = toy::step_samples(work.step, work.global_batch, work.offset, work.batch);
        let t = Instant::now();
        let sum = self
            .compute
            .gradient_sum(self.id, work.step, samples, &model)
            .await;
        let span = self.span(t, SpanKind::Compute);
        st.compute_ns = t.elapsed().as_nanos() as u64;
        self.count(|c| {
            c.compute_ns += t.elapsed().as_nanos() as u64;
            c.spans.push(span);
        });
        let contribution: Vec<f32> = match work.mode {
            // Weight b_i / B: the sum over my samples divided by the global batch, so the
            // ring's sum is the mean gradient of the whole batch.
            StepMode::Sync => sum.iter().map(|x| x / work.global_batch as f32).collect(),
            StepMode::Local | StepMode::Average => {
                let mean: Vec<f32> = sum.iter().map(|x| x / work.batch.max(1) as f32).collect();
                let mut local = (*model).clone();
                self.compute.apply_update(&mut local, &mean);
                if work.mode == StepMode::Local {
                    self.finish_step(st, &work, local, false);
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
            let model = match work.mode {
                StepMode::Average => sum,
                _ => {
                    let mut model = st
                        .version(work.step)
                        .map(|m| (*m).clone())
                        .unwrap_or_default();
                    self.compute.apply_update(&mut model, &sum);
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
                }
                self.start_work(st, w).await;
            }
            Envelope::Chunk { .. }
            | Envelope::Push { .. }
            | Envelope::Pull { .. }
            | Envelope::Abort { .. } => {
                if let Some(c) = &st.collective {
                    let _ = c.cast(CollectiveMsg::Net(env));
                }
            }
            Envelope::StateRequest { version, to } => {
                if let Some(model) = st.version(version) {
                    self.send(
                        Addr::Node(to),
                        Envelope::State {
                            version,
                            model: (*model).clone(),
                            virtual_bytes: self.model_bytes,
                        },
                    );
                }
            }
            Envelope::State { version, model, .. } => {
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
                if let Some(model) = st.version(step) {
                    let shard: Vec<f32> = (*model).clone();
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

//! The node actor: computes its share of each step and takes part in the ring all-reduce.
//!
//! A thin shell: work arrives as [`Work`], the gradient comes from the [`Compute`] seam, the
//! collective is a [`RingMember`] whose effects become [`Transport`] sends.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use ravnest_core::NodeId;
use ravnest_core::planner::sync::Collective;
use ravnest_core::ps::{PsEffect, PsInput, PsMember};
use ravnest_core::ring::{RingChunk, RingEffect, RingInput, RingMember};
use ravnest_core::ring2d::{Ring2dEffect, Ring2dInput, Ring2dMember};
use tokio::time::Instant;

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
    /// The running collective and its work.
    ring: Option<(Member, Work, Instant)>,
    /// Chunks that arrived before the collective started, by epoch.
    early: Vec<RingChunk>,
    /// (Server) pushes that arrived before the collective started: (epoch, rank, data).
    early_push: Vec<(u64, usize, Vec<f32>)>,
    /// Compute time of the step in flight, ns.
    compute_ns: u64,
    /// This node's rank in the running collective's ring.
    rank: usize,
}

/// The collective a node takes part in.
#[derive(Debug)]
enum Member {
    Ring(RingMember),
    Ring2d(Box<Ring2dMember>),
    Ps(PsMember),
}

/// What a collective asks the node to do, whichever collective it is.
#[derive(Debug)]
enum Out {
    Chunk(RingChunk),
    ChunkTo(usize, RingChunk),
    Push(Vec<f32>),
    Broadcast(Vec<f32>),
    Done(Vec<f32>),
    Aborted,
}

fn from_ring(e: Vec<RingEffect>) -> Vec<Out> {
    e.into_iter()
        .map(|e| match e {
            RingEffect::Send(c) => Out::Chunk(c),
            RingEffect::Done(v) => Out::Done(v),
            RingEffect::Aborted => Out::Aborted,
        })
        .collect()
}

fn from_ring2d(e: Vec<Ring2dEffect>) -> Vec<Out> {
    e.into_iter()
        .map(|e| match e {
            Ring2dEffect::Send { to, chunk } => Out::ChunkTo(to, chunk),
            Ring2dEffect::Done(v) => Out::Done(v),
            Ring2dEffect::Aborted => Out::Aborted,
        })
        .collect()
}

fn from_ps(e: Vec<PsEffect>) -> Vec<Out> {
    e.into_iter()
        .map(|e| match e {
            PsEffect::Push(v) => Out::Push(v),
            PsEffect::Broadcast(v) => Out::Broadcast(v),
            PsEffect::Done(v) => Out::Done(v),
            PsEffect::Aborted => Out::Aborted,
        })
        .collect()
}

impl Member {
    fn lost(&mut self) -> Vec<Out> {
        match self {
            Member::Ring(m) => from_ring(m.handle(RingInput::PeerLost)),
            Member::Ring2d(m) => from_ring2d(m.handle(Ring2dInput::PeerLost)),
            Member::Ps(m) => from_ps(m.handle(PsInput::PeerLost)),
        }
    }
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
        let weighted = contribution;
        let Some(rank) = work.ring.iter().position(|&n| n == self.id) else {
            return;
        };
        st.rank = rank;
        let n = work.ring.len();
        let (member, effects) = match work.collective {
            Collective::Ring => {
                let mut m = RingMember::new(work.epoch, rank, n, weighted.len());
                let mut e = from_ring(m.handle(RingInput::Start(weighted)));
                for c in std::mem::take(&mut st.early) {
                    if c.epoch == work.epoch {
                        e.extend(from_ring(m.handle(RingInput::Chunk(c))));
                    }
                }
                (Member::Ring(m), e)
            }
            Collective::Ring2d => {
                let k = (work.group_size as usize).max(1);
                let mut m = Ring2dMember::new(work.epoch, rank, n / k, k, weighted.len());
                let mut e = from_ring2d(m.handle(Ring2dInput::Start(weighted)));
                for c in std::mem::take(&mut st.early) {
                    if c.epoch == work.epoch {
                        e.extend(from_ring2d(m.handle(Ring2dInput::Chunk(c))));
                    }
                }
                (Member::Ring2d(Box::new(m)), e)
            }
            Collective::ParamServer => {
                let mut m = PsMember::new(rank, n, weighted.len());
                let mut e = from_ps(m.handle(PsInput::Start(weighted)));
                for (epoch, r, data) in std::mem::take(&mut st.early_push) {
                    if epoch == work.epoch {
                        e.extend(from_ps(m.handle(PsInput::FromWorker { rank: r, data })));
                    }
                }
                (Member::Ps(m), e)
            }
        };
        st.ring = Some((member, work, Instant::now()));
        self.apply_effects(st, effects);
    }

    fn apply_effects(&self, st: &mut NodeState, effects: Vec<Out>) {
        for e in effects {
            let Some((_, work, started)) = &st.ring else {
                return;
            };
            match e {
                Out::Push(data) => {
                    self.send(
                        Addr::Node(work.ring[0]),
                        Envelope::Push {
                            epoch: work.epoch,
                            rank: st.rank as u32,
                            data,
                            virtual_bytes: self.grad_bytes,
                        },
                    );
                }
                Out::Broadcast(data) => {
                    for &w in &work.ring[1..] {
                        self.send(
                            Addr::Node(w),
                            Envelope::Pull {
                                epoch: work.epoch,
                                data: data.clone(),
                                virtual_bytes: self.grad_bytes,
                            },
                        );
                    }
                }
                Out::ChunkTo(to, chunk) => {
                    // Each level of a two-level ring moves about a full gradient's worth in
                    // k or g chunks; charge each chunk its share of the bytes it stands for.
                    let parts = match chunk.level {
                        2 => (work.ring.len() as u64).max(1),
                        _ => u64::from(work.group_size.max(1)),
                    };
                    let virtual_bytes = self.grad_bytes / parts;
                    self.send(
                        Addr::Node(work.ring[to]),
                        Envelope::Chunk {
                            chunk,
                            virtual_bytes,
                        },
                    );
                }
                Out::Chunk(chunk) => {
                    let n = work.ring.len();
                    let next = work.ring[(st.rank + 1) % n];
                    let pieces = match &st.ring {
                        Some((Member::Ring(m), ..)) => m.segments() as u64,
                        _ => 1,
                    };
                    let virtual_bytes = self.grad_bytes / n as u64 / pieces;
                    self.send(
                        Addr::Node(next),
                        Envelope::Chunk {
                            chunk,
                            virtual_bytes,
                        },
                    );
                }
                Out::Done(sum) => {
                    let (work, started) = (work.clone(), *started);
                    let span = self.span(started, SpanKind::Comm);
                    self.count(|c| {
                        c.comm_ns += started.elapsed().as_nanos() as u64;
                        c.spans.push(span);
                    });
                    st.ring = None;
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
                Out::Aborted => {
                    let started = *started;
                    let span = self.span(started, SpanKind::Comm);
                    self.count(|c| {
                        c.comm_ns += started.elapsed().as_nanos() as u64;
                        c.aborted += 1;
                        c.spans.push(span);
                    });
                    st.ring = None;
                }
            }
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
        self.transport.register(
            self.me(),
            crate::seams::mailbox(myself.clone(), NodeMsg::Net),
        );
        let mut st = NodeState::default();
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
        let NodeMsg::Net(from, env) = msg;
        match env {
            Envelope::Work(w) => {
                if w.epoch < st.epoch {
                    return Ok(());
                }
                if w.epoch > st.epoch {
                    st.epoch = w.epoch;
                    // A newer assignment supersedes a collective still running.
                    if let Some((_, _, started)) = st.ring.take() {
                        let span = self.span(started, SpanKind::Comm);
                        self.count(|c| {
                            c.comm_ns += started.elapsed().as_nanos() as u64;
                            c.aborted += 1;
                            c.spans.push(span);
                        });
                    }
                    st.early.retain(|c| c.epoch >= w.epoch);
                    st.early_push.retain(|p| p.0 >= w.epoch);
                }
                self.start_work(st, w).await;
            }
            Envelope::Chunk { chunk, .. } => {
                if chunk.epoch < st.epoch {
                    return Ok(());
                }
                match &mut st.ring {
                    Some((Member::Ring(m), w, _)) if w.epoch == chunk.epoch => {
                        let eff = from_ring(m.handle(RingInput::Chunk(chunk)));
                        self.apply_effects(st, eff);
                    }
                    Some((Member::Ring2d(m), w, _)) if w.epoch == chunk.epoch => {
                        let eff = from_ring2d(m.handle(Ring2dInput::Chunk(chunk)));
                        self.apply_effects(st, eff);
                    }
                    _ => st.early.push(chunk),
                }
            }
            Envelope::Push {
                epoch, rank, data, ..
            } => {
                if epoch < st.epoch {
                    return Ok(());
                }
                match &mut st.ring {
                    Some((Member::Ps(m), w, _)) if w.epoch == epoch => {
                        let eff = from_ps(m.handle(PsInput::FromWorker {
                            rank: rank as usize,
                            data,
                        }));
                        self.apply_effects(st, eff);
                    }
                    _ => st.early_push.push((epoch, rank as usize, data)),
                }
            }
            Envelope::Pull { epoch, data, .. } => {
                if let Some((Member::Ps(m), w, _)) = &mut st.ring
                    && w.epoch == epoch
                {
                    let eff = from_ps(m.handle(PsInput::FromServer(data)));
                    self.apply_effects(st, eff);
                }
            }
            Envelope::Abort { epoch } => {
                if let Some((m, w, _)) = &mut st.ring
                    && w.epoch <= epoch
                {
                    let eff = m.lost();
                    self.apply_effects(st, eff);
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

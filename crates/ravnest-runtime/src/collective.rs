//! The collective actor: one per node, it runs that node's side of each step's gradient
//! synchronization (flat ring, two-level ring, or parameter server) and hands the result back
//! to its node.
//!
//! A thin shell over the pure state machines ([`RingMember`], [`Ring2dMember`], [`PsMember`]):
//! a message becomes an input, the member's effects become [`Transport`] sends. The node's
//! inbox sends collective traffic (chunks, pushes, pulls, aborts) straight here, so the node
//! actor is free while a collective runs and the pieces of a gradient do not queue behind it.
//! It is spawned linked to its node: it dies with it.

use ractor::{Actor, ActorProcessingErr, ActorRef};
use ravnest_core::NodeId;
use ravnest_core::planner::sync::Collective;
use ravnest_core::ps::{PsEffect, PsInput, PsMember};
use ravnest_core::ring::{RingChunk, RingEffect, RingInput, RingMember};
use ravnest_core::ring2d::{Ring2dEffect, Ring2dInput, Ring2dMember};

use crate::msg::{Addr, Envelope, Work};
use crate::node::NodeMsg;
use crate::seams::Transport;

/// How a collective ended, for the node.
#[derive(Debug)]
pub enum Outcome {
    /// Every member holds `sum` (the weighted gradient sum, or the averaged model).
    Done {
        /// The collective's epoch.
        epoch: u64,
        /// The result.
        sum: Vec<f32>,
    },
    /// Abandoned (a peer was lost, or a newer assignment superseded it).
    Aborted {
        /// The collective's epoch.
        epoch: u64,
    },
}

/// Messages a collective actor handles.
#[derive(Debug)]
pub enum CollectiveMsg {
    /// Start `work`'s collective with this node's (already weighted) contribution.
    Start(Work, Vec<f32>),
    /// Collective traffic from the network: chunks, pushes, pulls, aborts.
    Net(Envelope),
    /// The node took on work of this epoch: anything older is void.
    Supersede(u64),
}

/// A node's collective actor (read-only configuration).
#[derive(Debug)]
pub struct CollectiveActor<T> {
    /// The node it serves.
    pub id: NodeId,
    /// The network.
    pub transport: T,
    /// Bytes one full gradient stands for (pieces are charged their share, for the simulator).
    pub grad_bytes: u64,
    /// The node it serves (outcomes go there).
    pub node: ActorRef<NodeMsg>,
}

/// The member of the running collective.
#[derive(Debug)]
enum Member {
    Ring(RingMember),
    Ring2d(Box<Ring2dMember>),
    Ps(PsMember),
}

/// A collective actor's mutable state.
#[derive(Debug, Default)]
pub struct CollectiveState {
    /// The newest epoch seen.
    epoch: u64,
    /// Aborts received for epochs whose collective had not started yet: up to this epoch.
    aborted_upto: u64,
    /// The running collective, its work and this node's rank in it.
    running: Option<(Member, Work, usize)>,
    /// Chunks that arrived before their collective started.
    early: Vec<RingChunk>,
    /// (Server) pushes that arrived before the collective started: (epoch, rank, data).
    early_push: Vec<(u64, usize, Vec<f32>)>,
}

/// What a member asks for, whichever collective it is.
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

impl<T: Transport> CollectiveActor<T> {
    fn send(&self, to: Addr, env: Envelope) {
        // A failed send means this node is being torn down or the cluster changed under it;
        // the failure detector handles both.
        let _ = self.transport.send(Addr::Node(self.id), to, env);
    }

    fn start(&self, st: &mut CollectiveState, work: Work, contribution: Vec<f32>) {
        if work.epoch < st.epoch || work.epoch <= st.aborted_upto {
            // Superseded or aborted while the node was still computing.
            let _ = self
                .node
                .cast(NodeMsg::Collective(Outcome::Aborted { epoch: work.epoch }));
            return;
        }
        st.epoch = work.epoch;
        let Some(rank) = work.ring.iter().position(|&n| n == self.id) else {
            return;
        };
        let n = work.ring.len();
        let len = contribution.len();
        let (member, effects) = match work.collective {
            Collective::Ring => {
                let mut m = RingMember::new(work.epoch, rank, n, len);
                let mut e = from_ring(m.handle(RingInput::Start(contribution)));
                for c in std::mem::take(&mut st.early) {
                    if c.epoch == work.epoch {
                        e.extend(from_ring(m.handle(RingInput::Chunk(c))));
                    }
                }
                (Member::Ring(m), e)
            }
            Collective::Ring2d => {
                let k = (work.group_size as usize).max(1);
                let mut m = Ring2dMember::new(work.epoch, rank, n / k, k, len);
                let mut e = from_ring2d(m.handle(Ring2dInput::Start(contribution)));
                for c in std::mem::take(&mut st.early) {
                    if c.epoch == work.epoch {
                        e.extend(from_ring2d(m.handle(Ring2dInput::Chunk(c))));
                    }
                }
                (Member::Ring2d(Box::new(m)), e)
            }
            Collective::ParamServer => {
                let mut m = PsMember::new(rank, n, len);
                let mut e = from_ps(m.handle(PsInput::Start(contribution)));
                for (epoch, r, data) in std::mem::take(&mut st.early_push) {
                    if epoch == work.epoch {
                        e.extend(from_ps(m.handle(PsInput::FromWorker { rank: r, data })));
                    }
                }
                (Member::Ps(m), e)
            }
        };
        st.running = Some((member, work, rank));
        self.apply(st, effects);
    }

    fn apply(&self, st: &mut CollectiveState, effects: Vec<Out>) {
        for e in effects {
            let Some((member, work, rank)) = &st.running else {
                return;
            };
            // A pipeline stage synchronizes its layers' gradient only.
            let grad_bytes = work
                .stage
                .as_ref()
                .map_or(self.grad_bytes, |s| s.sync_bytes);
            match e {
                Out::Push(data) => self.send(
                    Addr::Node(work.ring[0]),
                    Envelope::Push {
                        epoch: work.epoch,
                        rank: *rank as u32,
                        data,
                        virtual_bytes: grad_bytes,
                    },
                ),
                Out::Broadcast(data) => {
                    for &w in &work.ring[1..] {
                        self.send(
                            Addr::Node(w),
                            Envelope::Pull {
                                epoch: work.epoch,
                                data: data.clone(),
                                virtual_bytes: grad_bytes,
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
                    let virtual_bytes = grad_bytes / parts;
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
                    let next = work.ring[(rank + 1) % n];
                    let pieces = match member {
                        Member::Ring(m) => m.segments() as u64,
                        _ => 1,
                    };
                    let virtual_bytes = grad_bytes / n as u64 / pieces;
                    self.send(
                        Addr::Node(next),
                        Envelope::Chunk {
                            chunk,
                            virtual_bytes,
                        },
                    );
                }
                Out::Done(sum) => {
                    let epoch = work.epoch;
                    st.running = None;
                    let _ = self
                        .node
                        .cast(NodeMsg::Collective(Outcome::Done { epoch, sum }));
                }
                Out::Aborted => {
                    let epoch = work.epoch;
                    st.running = None;
                    let _ = self
                        .node
                        .cast(NodeMsg::Collective(Outcome::Aborted { epoch }));
                }
            }
        }
    }
}

impl<T: Transport> Actor for CollectiveActor<T> {
    type Msg = CollectiveMsg;
    type State = CollectiveState;
    type Arguments = ();

    async fn pre_start(
        &self,
        _myself: ActorRef<CollectiveMsg>,
        _: (),
    ) -> Result<CollectiveState, ActorProcessingErr> {
        Ok(CollectiveState::default())
    }

    async fn handle(
        &self,
        _myself: ActorRef<CollectiveMsg>,
        msg: CollectiveMsg,
        st: &mut CollectiveState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            CollectiveMsg::Start(work, contribution) => self.start(st, work, contribution),
            CollectiveMsg::Supersede(epoch) => {
                if epoch > st.epoch {
                    st.epoch = epoch;
                    if let Some((_, w, _)) = &st.running
                        && w.epoch < epoch
                    {
                        // The node already counted it as abandoned.
                        st.running = None;
                    }
                    st.early.retain(|c| c.epoch >= epoch);
                    st.early_push.retain(|p| p.0 >= epoch);
                }
            }
            CollectiveMsg::Net(env) => match env {
                Envelope::Chunk { chunk, .. } => {
                    if chunk.epoch < st.epoch {
                        return Ok(());
                    }
                    match &mut st.running {
                        Some((Member::Ring(m), w, _)) if w.epoch == chunk.epoch => {
                            let eff = from_ring(m.handle(RingInput::Chunk(chunk)));
                            self.apply(st, eff);
                        }
                        Some((Member::Ring2d(m), w, _)) if w.epoch == chunk.epoch => {
                            let eff = from_ring2d(m.handle(Ring2dInput::Chunk(chunk)));
                            self.apply(st, eff);
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
                    match &mut st.running {
                        Some((Member::Ps(m), w, _)) if w.epoch == epoch => {
                            let eff = from_ps(m.handle(PsInput::FromWorker {
                                rank: rank as usize,
                                data,
                            }));
                            self.apply(st, eff);
                        }
                        _ => st.early_push.push((epoch, rank as usize, data)),
                    }
                }
                Envelope::Pull { epoch, data, .. } => {
                    if let Some((Member::Ps(m), w, _)) = &mut st.running
                        && w.epoch == epoch
                    {
                        let eff = from_ps(m.handle(PsInput::FromServer(data)));
                        self.apply(st, eff);
                    }
                }
                Envelope::Abort { epoch } => {
                    match &mut st.running {
                        Some((m, w, _)) if w.epoch <= epoch => {
                            let eff = m.lost();
                            self.apply(st, eff);
                        }
                        _ => {}
                    }
                    st.aborted_upto = st.aborted_upto.max(epoch);
                }
                _ => {}
            },
        }
        Ok(())
    }
}

/// Whether an envelope is collective traffic (the node's inbox sends it to the collective
/// actor).
pub fn is_collective(env: &Envelope) -> bool {
    matches!(
        env,
        Envelope::Chunk { .. }
            | Envelope::Push { .. }
            | Envelope::Pull { .. }
            | Envelope::Abort { .. }
    )
}

//! The collective actor: one per node, it runs that node's side of every gradient (or model)
//! synchronization: the buckets of a step, flat ring, two-level ring or parameter server alike,
//! and hands each result back to its node.
//!
//! A thin shell over [`ravnest_core::collective::Member`]: a message becomes an input, the
//! member's effects become [`Transport`] sends. Many members run at once, told apart by their
//! [`CollId`] (epoch, step, bucket): the buckets of a step reduce while backward still produces
//! the next ones, and a fast node's first buckets of the next step wait here, early, for this
//! node to start that step. The node's inbox sends collective traffic straight here, so it
//! never queues behind compute. It is spawned linked to its node: it dies with it.

use std::collections::BTreeMap;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use ravnest_core::NodeId;
use ravnest_core::collective::{CollEffect, CollId, CollInput, CollMsg, Member, RingPart};
use ravnest_core::pack::Packing;
use ravnest_core::planner::sync::Collective;

use crate::seams::Transport;
use ravnest_protocol::msg::{Addr, Envelope};

/// How a collective ended, for the node.
#[derive(Debug)]
pub enum Outcome {
    /// Every member holds `sum` (the weighted gradient sum, or the averaged model).
    Done {
        /// The collective.
        id: CollId,
        /// The result.
        sum: Vec<f32>,
    },
    /// Abandoned (a peer was lost, or a halt stopped its epoch).
    Aborted {
        /// The collective.
        id: CollId,
    },
}

/// The group a node synchronizes with in an epoch (shared by all its collectives).
#[derive(Debug, Clone, PartialEq)]
pub struct Group {
    /// Members in ring order.
    pub ring: Vec<NodeId>,
    /// Algorithm.
    pub collective: Collective,
    /// Nodes per group of a two-level ring.
    pub group_size: u32,
    /// What its collectives' values travel as (an outer exchange may be packed; gradients
    /// travel as `fp32`).
    pub packing: Packing,
}

impl Group {
    /// The group of an epoch's work `w`: its ring, and its outer rounds' packing (a gradient
    /// travels as `fp32`).
    pub fn of(w: &ravnest_protocol::msg::Work) -> Self {
        let packing = match w.sync {
            ravnest_protocol::msg::SyncPolicy::LocalSgd { outer, .. } => outer.packing,
            ravnest_protocol::msg::SyncPolicy::EveryStep => Packing::Fp32,
        };
        Group {
            ring: w.ring.clone(),
            collective: w.collective,
            group_size: w.group_size,
            packing,
        }
    }
}

/// Messages a collective actor handles.
#[derive(Debug)]
pub enum CollectiveMsg {
    /// Start collective `id` over `group` with this node's (already weighted) contribution;
    /// the whole vector stands for `virtual_bytes` on a simulated network.
    Start {
        /// The collective.
        id: CollId,
        /// Its group.
        group: Arc<Group>,
        /// This node's contribution.
        data: Vec<f32>,
        /// Bytes the whole vector stands for.
        virtual_bytes: u64,
        /// Half of a flat-ring all-reduce over uneven chunks (sharded data parallel), in
        /// place of the group's collective; `None`: the group's whole all-reduce.
        part: Option<RingPart>,
    },
    /// A message from the network.
    Net(CollMsg),
    /// Stop every collective of `epoch` and earlier (a halt, or a newer assignment).
    Halt(u64),
}

/// Where a collective actor hands its outcomes (its node's mailbox).
pub type OutcomeSink = Arc<dyn Fn(Outcome) + Send + Sync>;

/// A node's collective actor (read-only configuration).
pub struct CollectiveActor<T> {
    /// The node it serves.
    pub id: NodeId,
    /// The network.
    pub transport: T,
    /// Where outcomes go.
    pub outcomes: OutcomeSink,
}

impl<T> std::fmt::Debug for CollectiveActor<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CollectiveActor")
            .field("id", &self.id)
            .finish()
    }
}

/// Messages kept for collectives that have not started here yet, at most.
pub const EARLY_MAX: usize = 1 << 16;

/// A running collective.
#[derive(Debug)]
struct Running {
    member: Member,
    group: Arc<Group>,
    virtual_bytes: u64,
}

/// A collective actor's mutable state.
#[derive(Debug, Default)]
pub struct CollectiveState {
    /// Collectives of epochs up to this one are void.
    halted_upto: Option<u64>,
    running: BTreeMap<CollId, Running>,
    /// Messages that arrived before their collective started here.
    early: BTreeMap<CollId, Vec<CollMsg>>,
    early_count: usize,
}

impl CollectiveState {
    fn void(&self, id: CollId) -> bool {
        self.halted_upto.is_some_and(|e| id.epoch <= e)
    }
}

impl<T: Transport> CollectiveActor<T> {
    fn start(
        &self,
        st: &mut CollectiveState,
        id: CollId,
        group: Arc<Group>,
        data: Vec<f32>,
        virtual_bytes: u64,
        part: Option<RingPart>,
    ) {
        if st.void(id) || st.running.contains_key(&id) {
            (self.outcomes)(Outcome::Aborted { id });
            return;
        }
        let Some(rank) = group.ring.iter().position(|&n| n == self.id) else {
            (self.outcomes)(Outcome::Aborted { id });
            return;
        };
        let (n, len) = (group.ring.len(), data.len());
        let member = match &part {
            Some(p) => Member::part(id, rank, n, len, p),
            None => Some(Member::new(
                group.collective,
                group.group_size as usize,
                id,
                rank,
                n,
                len,
            )),
        };
        let Some(member) = member else {
            (self.outcomes)(Outcome::Aborted { id });
            return;
        };
        let mut member = member.with_packing(group.packing);
        let mut effects = member.handle(CollInput::Start(data));
        if let Some(early) = st.early.remove(&id) {
            st.early_count -= early.len();
            for m in early {
                effects.extend(member.handle(CollInput::Msg(m)));
            }
        }
        st.running.insert(
            id,
            Running {
                member,
                group,
                virtual_bytes,
            },
        );
        self.apply(st, id, effects);
    }

    fn apply(&self, st: &mut CollectiveState, id: CollId, effects: Vec<CollEffect>) {
        for e in effects {
            match e {
                CollEffect::Send { to, msg } => {
                    let Some(r) = st.running.get(&id) else { return };
                    let Some(&peer) = r.group.ring.get(to) else {
                        continue;
                    };
                    // Each message is charged its share of the bytes the vector stands for.
                    let virtual_bytes = r.member.charge(&msg, r.virtual_bytes);
                    let packing = r.member.packing();
                    // A failed send means this node is being torn down or the cluster changed
                    // under it; the failure detector handles both.
                    let _ = self.transport.send(
                        Addr::Node(self.id),
                        Addr::Node(peer),
                        Envelope::Coll {
                            msg,
                            virtual_bytes,
                            packing,
                        },
                    );
                }
                CollEffect::Done(sum) => {
                    st.running.remove(&id);
                    (self.outcomes)(Outcome::Done { id, sum });
                }
                CollEffect::Aborted => {
                    st.running.remove(&id);
                    (self.outcomes)(Outcome::Aborted { id });
                }
            }
        }
    }

    fn on_msg(&self, st: &mut CollectiveState, msg: CollMsg) {
        let id = msg.id();
        if st.void(id) {
            return;
        }
        match st.running.get_mut(&id) {
            Some(r) => {
                let effects = r.member.handle(CollInput::Msg(msg));
                self.apply(st, id, effects);
            }
            None if st.early_count < EARLY_MAX => {
                st.early_count += 1;
                st.early.entry(id).or_default().push(msg);
            }
            // A flood of messages for collectives that never start: dropped, as on a network.
            None => {}
        }
    }

    fn halt(&self, st: &mut CollectiveState, epoch: u64) {
        st.halted_upto = Some(st.halted_upto.map_or(epoch, |e| e.max(epoch)));
        let stopped: Vec<CollId> = st
            .running
            .keys()
            .copied()
            .filter(|id| id.epoch <= epoch)
            .collect();
        for id in stopped {
            if let Some(mut r) = st.running.remove(&id) {
                let _ = r.member.handle(CollInput::PeerLost);
                (self.outcomes)(Outcome::Aborted { id });
            }
        }
        st.early.retain(|id, _| id.epoch > epoch);
        st.early_count = st.early.values().map(Vec::len).sum();
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
            CollectiveMsg::Start {
                id,
                group,
                data,
                virtual_bytes,
                part,
            } => self.start(st, id, group, data, virtual_bytes, part),
            CollectiveMsg::Net(m) => self.on_msg(st, m),
            CollectiveMsg::Halt(epoch) => self.halt(st, epoch),
        }
        Ok(())
    }
}

//! The types every collective shares: its id, the messages between members, the inputs a
//! member takes and the effects it returns. A leaf module: it imports none of the algorithms,
//! so [`crate::ring`], [`crate::ring2d`], [`crate::ps`] and [`crate::collective`] all import it
//! without a cycle (the public paths are their re-exports).

use serde::{Deserialize, Serialize};

/// Names one collective: which plan epoch, which training step, which gradient bucket.
/// Messages of one collective never feed another.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct CollId {
    /// Plan epoch (bumped whenever the cluster's assignment changes).
    pub epoch: u64,
    /// Training step.
    pub step: u64,
    /// Gradient bucket within the step (0 for a single-bucket collective).
    pub bucket: u32,
}

impl CollId {
    /// The single collective of an epoch (step 0, bucket 0): for tests and one-shot rounds.
    pub fn epoch(epoch: u64) -> CollId {
        CollId {
            epoch,
            step: 0,
            bucket: 0,
        }
    }
}

/// Phase of a ring all-reduce.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Phase {
    /// Each rank accumulates one chunk's sum.
    ReduceScatter,
    /// Each rank forwards the finished chunks.
    AllGather,
}

/// A piece of a chunk travelling to the next rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RingChunk {
    /// Collective this chunk belongs to.
    pub id: CollId,
    /// Which ring of a composed collective it belongs to (0 for a flat ring).
    pub level: u8,
    /// Phase.
    pub phase: Phase,
    /// Step within the phase.
    pub step: usize,
    /// Chunk index.
    pub chunk: usize,
    /// Segment of the chunk.
    pub seg: u32,
    /// The values.
    pub data: Vec<f32>,
}

/// What travels between members.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CollMsg {
    /// A ring piece (flat or two-level); it carries its collective's id.
    Chunk(RingChunk),
    /// (Parameter server) a worker's contribution, to the server.
    Push {
        /// Collective.
        id: CollId,
        /// The worker's rank.
        rank: u32,
        /// Contribution.
        data: Vec<f32>,
    },
    /// (Parameter server) the sum, from the server.
    Pull {
        /// Collective.
        id: CollId,
        /// The sum.
        data: Vec<f32>,
    },
}

impl CollMsg {
    /// The collective this message belongs to.
    pub fn id(&self) -> CollId {
        match self {
            CollMsg::Chunk(c) => c.id,
            CollMsg::Push { id, .. } | CollMsg::Pull { id, .. } => *id,
        }
    }

    /// The values it carries.
    pub fn data(&self) -> &[f32] {
        match self {
            CollMsg::Chunk(c) => &c.data,
            CollMsg::Push { data, .. } | CollMsg::Pull { data, .. } => data,
        }
    }

    /// Where its values live (the wire moves them out instead of copying).
    pub fn data_mut(&mut self) -> &mut Vec<f32> {
        match self {
            CollMsg::Chunk(c) => &mut c.data,
            CollMsg::Push { data, .. } | CollMsg::Pull { data, .. } => data,
        }
    }
}

/// Inputs to a member.
#[derive(Debug, Clone, PartialEq)]
pub enum CollInput {
    /// Start with this node's (already weighted) contribution.
    Start(Vec<f32>),
    /// A message from another member.
    Msg(CollMsg),
    /// A member of the group is gone: the collective cannot complete.
    PeerLost,
}

/// What a member asks its driver to do.
#[derive(Debug, Clone, PartialEq)]
pub enum CollEffect {
    /// Send `msg` to the member at rank `to` of the group.
    Send {
        /// Destination rank (position in the group's order).
        to: usize,
        /// The message.
        msg: CollMsg,
    },
    /// Finished: every member ends with the same sum.
    Done(Vec<f32>),
    /// Abandoned (a peer was lost).
    Aborted,
}

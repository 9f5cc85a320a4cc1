//! Two-level (2D) ring all-reduce, composed of three [`RingMember`]s: the n = g × k nodes form
//! g groups of k in ring order. (1) Reduce-scatter inside each group: position p ends owning the
//! group's sum of chunk (p + 1) mod k. (2) All-reduce of that chunk across the g groups, among
//! the nodes at the same position. (3) All-gather inside each group. Every node sends about
//! 2·S·(1 − 1/n) bytes, as in a flat ring, but waits through 2(k − 1) + 2(g − 1) hops instead of
//! 2(n − 1): for 1,000 nodes, 122 instead of 1,998 (NCCL's hierarchical algorithms use the same
//! idea). Pure, like the flat ring, and driven the same way: [`CollInput`]s in, [`CollEffect`]s
//! out, each send addressed to a global index of the ring order.

use crate::coll_types::{CollEffect, CollId, CollInput, CollMsg};
use crate::ring::{RingMember, RingMode, chunk_range};

/// One node's side of one 2D all-reduce.
#[derive(Debug, Clone)]
pub struct Ring2dMember {
    group: usize,
    pos: usize,
    groups: usize,
    size: usize,
    len: usize,
    buf: Vec<f32>,
    a: RingMember,
    b: RingMember,
    c: RingMember,
    finished: bool,
}

impl Ring2dMember {
    /// The member at global `index` (group = index / size) of `groups` groups of `size` nodes.
    pub fn new(id: CollId, index: usize, groups: usize, size: usize, len: usize) -> Self {
        assert!(
            groups > 0 && size > 0 && index < groups * size,
            "index {index} outside {groups}x{size}"
        );
        let (group, pos) = (index / size, index % size);
        let owned = chunk_range(len, size, (pos + 1) % size);
        Ring2dMember {
            group,
            pos,
            groups,
            size,
            len,
            buf: Vec::new(),
            a: RingMember::with_mode(id, 1, RingMode::ReduceScatter, pos, size, len),
            b: RingMember::with_mode(id, 2, RingMode::Full, group, groups, owned.len()),
            c: RingMember::with_mode(id, 3, RingMode::AllGather, pos, size, len),
            finished: false,
        }
    }

    /// The same member with every level's pieces rounded to `packing` (see
    /// [`RingMember::with_packing`]).
    pub fn with_packing(mut self, packing: crate::pack::Packing) -> Self {
        self.a = self.a.with_packing(packing);
        self.b = self.b.with_packing(packing);
        self.c = self.c.with_packing(packing);
        self
    }

    /// Groups.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// Nodes per group.
    pub fn size(&self) -> usize {
        self.size
    }

    /// What fraction (1 / the returned number) of the whole vector a message of `level`
    /// stands for: a segment of one of `size` chunks inside a group (levels 1 and 3), or a
    /// segment of one of `groups` pieces of the one chunk a node owns, itself 1/`size` of the
    /// vector (level 2): each level-2 message is about 1/n of the vector, so a member sends
    /// 2(n − 1)/n of it in all, as in a flat ring.
    pub fn pieces_of_level(&self, level: u8) -> usize {
        match level {
            2 => self.b.segments() * self.groups * self.size,
            3 => self.c.segments() * self.size,
            _ => self.a.segments() * self.size,
        }
    }

    /// Global index of a group-mate at position `p`.
    fn in_group(&self, p: usize) -> usize {
        self.group * self.size + p
    }

    /// Feed one input; returns the effects in order, each send addressed to the node at a
    /// global index (position in the ring order). Messages of another collective, messages
    /// that are not chunks, and malformed ones change nothing and return nothing.
    pub fn handle(&mut self, input: CollInput) -> Vec<CollEffect> {
        if self.finished {
            return vec![];
        }
        match input {
            CollInput::PeerLost => {
                self.finished = true;
                vec![CollEffect::Aborted]
            }
            CollInput::Start(v) => {
                if v.len() != self.len {
                    return vec![];
                }
                let e = self.a.handle(CollInput::Start(v));
                self.pump(1, e)
            }
            CollInput::Msg(CollMsg::Chunk(c)) => {
                let level = c.level;
                let ring = match level {
                    1 => &mut self.a,
                    2 => &mut self.b,
                    3 => &mut self.c,
                    _ => return vec![],
                };
                let e = ring.handle(CollInput::Msg(CollMsg::Chunk(c)));
                self.pump(level, e)
            }
            CollInput::Msg(_) => vec![],
        }
    }

    /// Global index of the node that rank `to` of ring `level` names: a group-mate for the
    /// rings inside a group (levels 1 and 3), the same position in another group for level 2.
    fn global(&self, level: u8, to: usize) -> usize {
        match level {
            2 => to * self.size + self.pos,
            _ => self.in_group(to),
        }
    }

    /// Address a level's sends to global indices, and move to the next level when one
    /// finishes.
    fn pump(&mut self, level: u8, effects: Vec<CollEffect>) -> Vec<CollEffect> {
        let mut out = Vec::new();
        let mut queue = vec![(level, effects)];
        while let Some((level, effects)) = queue.pop() {
            for e in effects {
                match e {
                    CollEffect::Send { to, msg } => out.push(CollEffect::Send {
                        to: self.global(level, to),
                        msg,
                    }),
                    CollEffect::Done(v) => match level {
                        1 => {
                            // I own the group sum of chunk (pos + 1) mod size: reduce it across groups.
                            let owned =
                                chunk_range(self.len, self.size, (self.pos + 1) % self.size);
                            let slice = v[owned].to_vec();
                            self.buf = v;
                            let e = self.b.handle(CollInput::Start(slice));
                            queue.push((2, e));
                        }
                        2 => {
                            let owned =
                                chunk_range(self.len, self.size, (self.pos + 1) % self.size);
                            self.buf[owned].copy_from_slice(&v);
                            let e = self
                                .c
                                .handle(CollInput::Start(std::mem::take(&mut self.buf)));
                            queue.push((3, e));
                        }
                        _ => {
                            self.finished = true;
                            out.push(CollEffect::Done(v));
                        }
                    },
                    CollEffect::Aborted => {
                        self.finished = true;
                        out.push(CollEffect::Aborted);
                    }
                }
            }
        }
        out
    }
}

/// Below this many nodes a flat ring is used: the hops saved are few and one ring is simpler.
pub const MIN_NODES: usize = 16;

/// The group size for a 2D ring over `n` nodes: the divisor of n nearest √n, or `None` when n
/// is below [`MIN_NODES`] or has no divisor between 2 and n/2 (a prime).
pub fn group_size(n: usize) -> Option<usize> {
    if n < MIN_NODES {
        return None;
    }
    let root = (n as f64).sqrt();
    (2..=n / 2).filter(|k| n.is_multiple_of(*k)).min_by(|a, b| {
        ((*a as f64) - root)
            .abs()
            .total_cmp(&((*b as f64) - root).abs())
            .then(a.cmp(b))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, VecDeque};

    proptest! {
        /// Every member ends with the plain sum under any interleaving that keeps each directed
        /// link FIFO.
        #[test]
        fn ring2d_equals_the_sum(
            groups in 1usize..4,
            size in 1usize..4,
            len in 0usize..13,
            vals in prop::collection::vec(-50i32..50, 9 * 13),
            choices in prop::collection::vec(0usize..1000, 0..400),
        ) {
            let n = groups * size;
            let vs: Vec<Vec<f32>> = (0..n).map(|r| (0..len).map(|j| vals[r * 13 + j] as f32 / 8.0).collect()).collect();
            let mut m: Vec<Ring2dMember> = (0..n).map(|i| Ring2dMember::new(CollId::epoch(5), i, groups, size, len)).collect();
            let mut links: BTreeMap<(usize, usize), VecDeque<CollMsg>> = BTreeMap::new();
            let mut started = vec![false; n];
            let mut done: Vec<Option<Vec<f32>>> = vec![None; n];
            let mut k = 0;
            loop {
                let mut ready: Vec<(usize, usize)> = (0..n).filter(|&i| !started[i]).map(|i| (usize::MAX, i)).collect();
                ready.extend(links.iter().filter(|(_, q)| !q.is_empty()).map(|(&l, _)| l));
                if ready.is_empty() { break; }
                let pick = ready[choices.get(k).copied().unwrap_or(0) % ready.len()];
                k += 1;
                let (at, effects) = if pick.0 == usize::MAX {
                    started[pick.1] = true;
                    (pick.1, m[pick.1].handle(CollInput::Start(vs[pick.1].clone())))
                } else {
                    let c = links.get_mut(&pick).unwrap().pop_front().unwrap();
                    (pick.1, m[pick.1].handle(CollInput::Msg(c)))
                };
                for e in effects {
                    match e {
                        CollEffect::Send { to, msg } => links.entry((at, to)).or_default().push_back(msg),
                        CollEffect::Done(v) => done[at] = Some(v),
                        CollEffect::Aborted => {}
                    }
                }
            }
            let oracle: Vec<f32> = (0..len).map(|j| vs.iter().map(|v| v[j]).sum()).collect();
            for (i, d) in done.iter().enumerate() {
                let d = d.as_ref().unwrap_or_else(|| panic!("node {i} did not finish ({groups}x{size})"));
                prop_assert_eq!(d.len(), len);
                for j in 0..len { prop_assert!((d[j] - oracle[j]).abs() <= 1e-4 * oracle[j].abs().max(1.0)); }
                prop_assert_eq!(d, done[0].as_ref().unwrap(), "nodes disagree bit for bit");
            }
        }
    }

    #[test]
    fn group_sizes() {
        assert_eq!(group_size(1000), Some(25)); // 25 x 40 (√1000 ≈ 31.6: 25 is nearer than 40)
        assert_eq!(group_size(16), Some(4));
        assert_eq!(group_size(17), None);
        assert_eq!(group_size(6), None);
        assert_eq!(group_size(18), Some(3)); // √18 ≈ 4.24: 3 and 6 divide, 3 is nearer
    }
}

//! One interface over the three ways a group sums a vector: the flat ring
//! ([`crate::ring::RingMember`]), the two-level ring ([`crate::ring2d::Ring2dMember`]) and the
//! parameter server ([`crate::ps::PsMember`]).
//!
//! A [`Member`] is one node's side of one collective, named by a [`CollId`]: the plan epoch,
//! the training step and the gradient bucket. Its driver feeds it [`CollInput`]s and carries out
//! the [`CollEffect`]s it returns: send a [`CollMsg`] to the member at some rank of the group,
//! or report the sum (or the abort). The driver never needs to know which algorithm runs, so one
//! actor serves all three, and many members (the buckets of a step, the next step's first
//! buckets) can run side by side, told apart by their ids.
//!
//! The three algorithms take these same inputs and return these same effects themselves (each
//! works out its destination ranks), so a [`Member`] only chooses which one runs and passes
//! inputs through.

pub use crate::coll_types::{CollEffect, CollId, CollInput, CollMsg};
use crate::pack::Packing;
use crate::planner::sync::Collective;
use crate::ps::PsMember;
use crate::ring::{RingMember, RingMode, valid_bounds};
use crate::ring2d::Ring2dMember;

/// The algorithm a [`Member`] runs.
#[derive(Debug, Clone)]
enum Algo {
    Ring(RingMember),
    Ring2d(Box<Ring2dMember>),
    Ps(PsMember),
}

/// One node's side of one collective, whichever algorithm runs it.
#[derive(Debug, Clone)]
pub struct Member {
    id: CollId,
    n: usize,
    len: usize,
    /// A part of a ring all-reduce over uneven chunks ([`Member::part`]): each message is
    /// charged by its length, not as one of n equal pieces.
    uneven: bool,
    /// What its messages are rounded to, and travel as ([`Member::with_packing`]).
    packing: Packing,
    algo: Algo,
}

/// Half of a ring all-reduce over uneven chunks: what sharded data parallel runs (a
/// reduce-scatter of the gradient to each part's owner, an all-gather of the parameters
/// from them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingPart {
    /// Which half (or both).
    pub mode: RingMode,
    /// Chunk c is `bounds[c]..bounds[c + 1]`; rank r owns chunk r + 1 (mod n) (see
    /// [`RingMember::with_bounds`]).
    pub bounds: Vec<usize>,
}

impl Member {
    /// The member at `rank` of a group of `n` summing vectors of `len` elements with
    /// `collective` (`group_size` nodes per group for a two-level ring; a two-level ring whose
    /// group size does not divide `n` runs as a flat ring).
    pub fn new(
        collective: Collective,
        group_size: usize,
        id: CollId,
        rank: usize,
        n: usize,
        len: usize,
    ) -> Member {
        assert!(rank < n, "rank {rank} outside a group of {n}");
        let algo = match collective {
            Collective::Ring2d if group_size > 0 && n.is_multiple_of(group_size) => Algo::Ring2d(
                Box::new(Ring2dMember::new(id, rank, n / group_size, group_size, len)),
            ),
            Collective::ParamServer => Algo::Ps(PsMember::new(id, rank, n, len)),
            _ => Algo::Ring(RingMember::new(id, rank, n, len)),
        };
        Member {
            id,
            n,
            len,
            uneven: false,
            packing: Packing::Fp32,
            algo,
        }
    }

    /// The same member rounding every value it sends to `packing` ([`crate::pack`]): each
    /// message then travels packed without further loss, and every member ends with the same
    /// sum. Every member of a group must use the same packing. Call before `Start`.
    pub fn with_packing(mut self, packing: Packing) -> Member {
        self.packing = packing;
        self.algo = match self.algo {
            Algo::Ring(m) => Algo::Ring(m.with_packing(packing)),
            Algo::Ring2d(m) => Algo::Ring2d(Box::new(m.with_packing(packing))),
            Algo::Ps(m) => Algo::Ps(m.with_packing(packing)),
        };
        self
    }

    /// What its messages travel as.
    pub fn packing(&self) -> Packing {
        self.packing
    }

    /// The member at `rank` of a flat ring of `n` running `part` over vectors of `len`
    /// elements; `None` when the part's bounds do not tile them in n chunks.
    pub fn part(id: CollId, rank: usize, n: usize, len: usize, part: &RingPart) -> Option<Member> {
        if rank >= n || !valid_bounds(&part.bounds, n, len) {
            return None;
        }
        let ring = RingMember::with_mode(id, 0, part.mode, rank, n, len);
        Some(Member {
            id,
            n,
            len,
            uneven: true,
            packing: Packing::Fp32,
            algo: Algo::Ring(ring.with_bounds(part.bounds.clone())),
        })
    }

    /// The bytes `msg` is charged on a simulated network when the whole vector stands for
    /// `virtual_bytes`: its share by [`Member::pieces_of`], or by its length for uneven chunks.
    pub fn charge(&self, msg: &CollMsg, virtual_bytes: u64) -> u64 {
        if self.packing != Packing::Fp32 {
            // Its values' share of the vector, packed (at the rate a large vector packs: the
            // simulator's small vectors stand for a model's).
            let share = msg.data().len() as f64 / self.len.max(1) as f64;
            return (virtual_bytes as f64 * share * self.packing.ratio()) as u64;
        }
        if self.uneven {
            let len = msg.data().len() as u128;
            return (u128::from(virtual_bytes) * len / self.len.max(1) as u128) as u64;
        }
        virtual_bytes / self.pieces_of(msg) as u64
    }

    /// Its collective.
    pub fn id(&self) -> CollId {
        self.id
    }

    /// Feed one input; returns the effects in order. Messages of another collective, and
    /// malformed ones, change nothing and return nothing.
    pub fn handle(&mut self, input: CollInput) -> Vec<CollEffect> {
        match &mut self.algo {
            Algo::Ring(m) => m.handle(input),
            Algo::Ring2d(m) => m.handle(input),
            Algo::Ps(m) => m.handle(input),
        }
    }

    /// What fraction (1 / the returned number) of the whole vector `msg` stands for, so a
    /// simulated network can charge each message its share of the bytes the vector stands for:
    /// a ring piece is one segment of one of n chunks; a two-level ring's group levels move
    /// segments of one of `size` chunks, its level across groups segments of 1/n of the vector
    /// (see [`Ring2dMember::pieces_of_level`]); a parameter-server message is the whole vector.
    /// Either ring thus charges each member 2(n − 1)/n of the vector, as the cost model does.
    pub fn pieces_of(&self, msg: &CollMsg) -> usize {
        match (&self.algo, msg) {
            (Algo::Ring(m), _) => m.segments() * self.n,
            (Algo::Ring2d(m), CollMsg::Chunk(c)) => m.pieces_of_level(c.level),
            (Algo::Ring2d(m), _) => m.pieces_of_level(1),
            (Algo::Ps(_), _) => 1,
        }
        .max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, VecDeque};

    /// Drive n members of one collective (and, interleaved, a second collective over the same
    /// links, to check that ids keep them apart) under an interleaving chosen by `choices`.
    fn drive(
        kind: Collective,
        group: usize,
        vectors: &[Vec<f32>],
        choices: &[usize],
    ) -> Vec<[Option<Vec<f32>>; 2]> {
        let n = vectors.len();
        let len = vectors[0].len();
        let ids = [
            CollId::epoch(4),
            CollId {
                step: 1,
                ..CollId::epoch(4)
            },
        ];
        let mut m: Vec<[Member; 2]> = (0..n)
            .map(|r| ids.map(|id| Member::new(kind, group, id, r, n, len)))
            .collect();
        let mut links: BTreeMap<(usize, usize), VecDeque<CollMsg>> = BTreeMap::new();
        let mut started = vec![[false; 2]; n];
        let mut done: Vec<[Option<Vec<f32>>; 2]> = vec![[None, None]; n];
        let mut k = 0;
        loop {
            let mut ready: Vec<(usize, usize, usize)> = (0..n)
                .flat_map(|r| (0..2).map(move |c| (usize::MAX, r, c)))
                .filter(|&(_, r, c)| !started[r][c])
                .collect();
            ready.extend(
                links
                    .iter()
                    .filter(|(_, q)| !q.is_empty())
                    .map(|(&(a, b), _)| (a, b, 0)),
            );
            if ready.is_empty() {
                break;
            }
            let pick = ready[choices.get(k).copied().unwrap_or(0) % ready.len()];
            k += 1;
            let (at, which, effects) = if pick.0 == usize::MAX {
                let (r, c) = (pick.1, pick.2);
                started[r][c] = true;
                let v: Vec<f32> = vectors[r].iter().map(|x| x * (c as f32 + 1.0)).collect();
                (r, c, m[r][c].handle(CollInput::Start(v)))
            } else {
                let msg = links
                    .get_mut(&(pick.0, pick.1))
                    .unwrap()
                    .pop_front()
                    .unwrap();
                let c = usize::from(msg.id() != ids[0]);
                // Fed to both members: the other one must ignore it.
                let other = m[pick.1][1 - c].handle(CollInput::Msg(msg.clone()));
                assert!(other.is_empty(), "a message fed the wrong collective");
                (pick.1, c, m[pick.1][c].handle(CollInput::Msg(msg)))
            };
            for e in effects {
                match e {
                    CollEffect::Send { to, msg } => {
                        links.entry((at, to)).or_default().push_back(msg)
                    }
                    CollEffect::Done(v) => done[at][which] = Some(v),
                    CollEffect::Aborted => {}
                }
            }
        }
        done
    }

    proptest! {
        /// Every algorithm, driven through the one interface, ends with the plain sum on every
        /// member, bit-identical across members; two collectives over the same links do not mix.
        #[test]
        fn every_algorithm_sums_through_one_interface(
            kind in 0usize..3,
            n in 1usize..7,
            len in 0usize..11,
            vals in prop::collection::vec(-50i32..50, 7 * 11),
            choices in prop::collection::vec(0usize..1000, 0..600),
        ) {
            let (kind, group) = match kind {
                0 => (Collective::Ring, 0),
                1 => (Collective::Ring2d, if n % 2 == 0 { 2 } else { 1 }),
                _ => (Collective::ParamServer, 0),
            };
            let vs: Vec<Vec<f32>> = (0..n).map(|r| (0..len).map(|j| vals[r * 11 + j] as f32 / 8.0).collect()).collect();
            let done = drive(kind, group, &vs, &choices);
            for c in 0..2 {
                let oracle: Vec<f32> = (0..len).map(|j| vs.iter().map(|v| v[j] * (c as f32 + 1.0)).sum()).collect();
                for (r, d) in done.iter().enumerate() {
                    let d = d[c].as_ref().unwrap_or_else(|| panic!("{kind:?}: rank {r} collective {c} unfinished"));
                    for j in 0..len { prop_assert!((d[j] - oracle[j]).abs() <= 1e-4 * oracle[j].abs().max(1.0)); }
                    prop_assert_eq!(d, done[0][c].as_ref().unwrap());
                }
            }
        }
    }

    /// The shares a simulated network charges add up to what the cost model charges: every
    /// member of a flat or two-level ring sends 2(n − 1)/n of the vector (a two-level ring's
    /// level across groups once charged each message 1/g of the vector instead of 1/n, which
    /// made the simulated 600-node ring of `large-1000` send 3.8 vectors per step, not 2).
    #[test]
    fn each_ring_member_is_charged_2_n_minus_1_over_n_of_the_vector() {
        for (kind, n, group) in [
            (Collective::Ring, 5, 0),
            (Collective::Ring2d, 6, 2),
            (Collective::Ring2d, 12, 3),
            (Collective::Ring2d, 12, 4),
        ] {
            let len = 1000;
            let id = CollId::epoch(1);
            let mut m: Vec<Member> = (0..n)
                .map(|r| Member::new(kind, group, id, r, n, len))
                .collect();
            let mut sent = vec![0.0f64; n];
            let mut queue: VecDeque<(usize, CollMsg)> = VecDeque::new();
            let mut effects: Vec<(usize, CollEffect)> = Vec::new();
            for (r, member) in m.iter_mut().enumerate() {
                let v = vec![1.0; len];
                effects.extend(
                    member
                        .handle(CollInput::Start(v))
                        .into_iter()
                        .map(|e| (r, e)),
                );
            }
            loop {
                for (r, e) in effects.drain(..) {
                    if let CollEffect::Send { to, msg } = e {
                        sent[r] += 1.0 / m[r].pieces_of(&msg) as f64;
                        queue.push_back((to, msg));
                    }
                }
                let Some((to, msg)) = queue.pop_front() else {
                    break;
                };
                effects.extend(
                    m[to]
                        .handle(CollInput::Msg(msg))
                        .into_iter()
                        .map(|e| (to, e)),
                );
            }
            let want = 2.0 * (n as f64 - 1.0) / n as f64;
            for (r, s) in sent.iter().enumerate() {
                assert!(
                    (s - want).abs() < 1e-9,
                    "{kind:?} n={n} group={group}: rank {r} charged {s}, want {want}"
                );
            }
        }
    }

    #[test]
    fn a_lost_peer_aborts_and_a_message_of_another_collective_is_ignored() {
        for kind in [
            Collective::Ring,
            Collective::Ring2d,
            Collective::ParamServer,
        ] {
            let mut m = Member::new(kind, 2, CollId::epoch(1), 1, 4, 8);
            let stale = CollMsg::Push {
                id: CollId::epoch(0),
                rank: 2,
                data: vec![0.0; 8],
            };
            assert!(m.handle(CollInput::Msg(stale)).is_empty(), "{kind:?}");
            assert_eq!(m.handle(CollInput::PeerLost), vec![CollEffect::Aborted]);
        }
    }
}

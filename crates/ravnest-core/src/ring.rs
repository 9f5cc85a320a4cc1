//! Ring all-reduce as a pure state machine: reduce-scatter, then all-gather, pipelined.
//!
//! [`schedule`] is index arithmetic only (which chunk goes where at which step). [`RingMember`]
//! is one node's side of one collective: feed it [`CollInput`]s, carry out the
//! [`CollEffect::Send`]s it returns (each to the next rank in the ring), and it ends with
//! [`CollEffect::Done`] holding the sum. It does no I/O and keeps no clock, so the simulator
//! and the TCP runtime drive the same code, and the property test below drives it under
//! arbitrary (per-link FIFO) interleavings against a plain sum.
//!
//! Each of the n chunks is cut into `segments` equal pieces that travel as separate messages,
//! and each piece moves on through the 2(n − 1) steps as soon as it has arrived: the chunk a
//! rank sends at step s + 1 is the one it received (and reduced) at step s, so segment j of
//! step s + 1 only waits for segment j of step s, never for the whole chunk. Sending,
//! receiving and adding then overlap along the ring, and no message is larger than a segment
//! (1 MiB by default, see [`segments_for`]), which keeps buffers small and cache-warm.
//!
//! Messages carry the collective's [`CollId`] (plan epoch, training step, gradient bucket); a
//! member ignores messages of other collectives, so after an abort (a peer was lost, the ring
//! re-forms) stale chunks cannot leak into the next round, and the buckets of one step, or two
//! consecutive steps, can be reduced at the same time over the same links.

use std::collections::BTreeMap;
use std::ops::Range;

use crate::coll_types::{CollEffect, CollInput, CollMsg};
pub use crate::coll_types::{CollId, Phase, RingChunk};
use crate::pack::{Packing, canon};

/// The element range of chunk `c` when `len` elements are split into `n` chunks.
pub fn chunk_range(len: usize, n: usize, c: usize) -> Range<usize> {
    (c * len / n)..((c + 1) * len / n)
}

/// The element range of segment `j` of chunk `c` (of `n` chunks over `len` elements, each cut
/// into `segments` pieces).
pub fn segment_range(len: usize, n: usize, c: usize, segments: usize, j: usize) -> Range<usize> {
    let chunk = chunk_range(len, n, c);
    let inner = chunk_range(chunk.len(), segments, j);
    chunk.start + inner.start..chunk.start + inner.end
}

/// Elements per segment that [`segments_for`] aims at: 256 Ki f32s, 1 MiB on the wire.
pub const SEGMENT_ELEMS: usize = 256 * 1024;

/// How many segments each chunk is cut into when `len` elements are reduced over `n` ranks:
/// enough that no segment exceeds [`SEGMENT_ELEMS`] (one segment for small vectors, such as
/// the simulator's).
pub fn segments_for(len: usize, n: usize) -> usize {
    let chunk = len.div_ceil(n.max(1));
    chunk.div_ceil(SEGMENT_ELEMS).max(1)
}

/// Whether `bounds` cuts `len` values into `n` chunks: n + 1 entries rising from 0 to `len`.
pub fn valid_bounds(bounds: &[usize], n: usize, len: usize) -> bool {
    bounds.len() == n + 1
        && bounds.first() == Some(&0)
        && bounds.last() == Some(&len)
        && bounds.windows(2).all(|w| w[0] <= w[1])
}

/// Which chunk rank `rank` sends to `rank + 1` at `step` (0..n-1) of `phase`, and which chunk
/// it receives from `rank - 1` at the same step.
pub fn schedule(phase: Phase, step: usize, rank: usize, n: usize) -> (usize, usize) {
    let m = |x: isize| x.rem_euclid(n as isize) as usize;
    let (r, s) = (rank as isize, step as isize);
    match phase {
        // Step s: send chunk r - s, receive chunk r - s - 1 and add it in. After n-1 steps rank
        // r holds the full sum of chunk r + 1.
        Phase::ReduceScatter => (m(r - s), m(r - s - 1)),
        // Step s: send chunk r + 1 - s (complete), receive chunk r - s and keep it.
        Phase::AllGather => (m(r + 1 - s), m(r - s)),
    }
}

/// Which part of an all-reduce a member runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingMode {
    /// Reduce-scatter then all-gather: every rank ends with the whole sum.
    Full,
    /// Reduce-scatter only: rank r ends owning the sum of chunk (r + 1) mod n.
    ReduceScatter,
    /// All-gather only: rank r starts owning chunk (r + 1) mod n and ends with every chunk.
    AllGather,
}

/// Where a member is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    Waiting,
    Running,
    Finished,
}

/// One node's side of one ring all-reduce.
#[derive(Debug, Clone)]
pub struct RingMember {
    id: CollId,
    level: u8,
    rank: usize,
    n: usize,
    len: usize,
    /// Chunk c is `bounds[c]..bounds[c + 1]` (n + 1 entries): equal chunks unless
    /// [`RingMember::with_bounds`] set others.
    bounds: Vec<usize>,
    segments: usize,
    buf: Vec<f32>,
    state: State,
    /// Steps are numbered 0..2(n−1) across both phases (reduce-scatter first); this member
    /// runs `first..end` of them.
    first: usize,
    end: usize,
    /// Per segment: the next step it expects to receive.
    next: Vec<usize>,
    /// Segments that have received every step.
    finished_segments: usize,
    /// Pieces that arrived before this member was ready for them, by (segment, step).
    early: BTreeMap<(usize, usize), RingChunk>,
    /// What each piece is rounded to before it is sent ([`RingMember::with_packing`]).
    packing: Packing,
}

impl RingMember {
    /// A member at `rank` of a ring of `n` over vectors of `len` elements.
    pub fn new(id: CollId, rank: usize, n: usize, len: usize) -> Self {
        Self::with_mode(id, 0, RingMode::Full, rank, n, len)
    }

    /// A member running part of an all-reduce, as ring `level` of a composed collective.
    pub fn with_mode(
        id: CollId,
        level: u8,
        mode: RingMode,
        rank: usize,
        n: usize,
        len: usize,
    ) -> Self {
        assert!(rank < n && n > 0, "rank {rank} outside a ring of {n}");
        let half = n - 1;
        let (first, end) = match mode {
            RingMode::Full => (0, 2 * half),
            RingMode::ReduceScatter => (0, half),
            RingMode::AllGather => (half, 2 * half),
        };
        let segments = segments_for(len, n);
        RingMember {
            id,
            level,
            rank,
            n,
            len,
            bounds: (0..=n).map(|c| c * len / n).collect(),
            segments,
            buf: Vec::new(),
            state: State::Waiting,
            first,
            end,
            next: vec![first; segments],
            finished_segments: 0,
            early: BTreeMap::new(),
            packing: Packing::Fp32,
        }
    }

    /// The same member sending pieces rounded to `packing` ([`crate::pack`]): a partial sum is
    /// rounded at each hop, and the owner of a reduced chunk rounds it once and keeps the
    /// rounded values, so every rank ends with the same bits and the packed wire carries each
    /// piece without further loss. Every rank of a ring must use the same packing.
    pub fn with_packing(mut self, packing: Packing) -> Self {
        self.packing = packing;
        self
    }

    /// The same member with each chunk cut into `segments` pieces instead of the default
    /// (every rank of a ring must use the same count). Call before `Start`.
    pub fn with_segments(mut self, segments: usize) -> Self {
        let segments = segments.max(1);
        self.segments = segments;
        self.next = vec![self.first; segments];
        self
    }

    /// The same member with chunks of the given sizes: chunk c is `bounds[c]..bounds[c + 1]`,
    /// so that rank r ends a reduce-scatter owning `bounds[r + 1]..bounds[r + 2]` (mod n) and
    /// starts an all-gather owning it. Uneven shards: each rank owns the part of the vector
    /// it was given, of any size, empty ones included. Every rank of a ring must pass the same
    /// bounds; the segment count is chosen again for the largest chunk. Call before `Start`.
    ///
    /// # Panics
    /// When `bounds` does not have n + 1 entries, rising from 0 to the vector's length.
    pub fn with_bounds(mut self, bounds: Vec<usize>) -> Self {
        assert!(
            valid_bounds(&bounds, self.n, self.len),
            "chunk bounds {bounds:?} do not tile {} values in {} chunks",
            self.len,
            self.n
        );
        let largest = bounds.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
        self.bounds = bounds;
        self.with_segments(largest.div_ceil(SEGMENT_ELEMS).max(1))
    }

    /// The element range of segment `j` of chunk `c`.
    fn segment(&self, c: usize, j: usize) -> Range<usize> {
        let (a, b) = (self.bounds[c], self.bounds[c + 1]);
        let inner = chunk_range(b - a, self.segments, j);
        a + inner.start..a + inner.end
    }

    /// Whether the collective has finished or aborted.
    pub fn is_finished(&self) -> bool {
        self.state == State::Finished
    }

    /// How many pieces each chunk travels in.
    pub fn segments(&self) -> usize {
        self.segments
    }

    /// Phase and step within it of overall step `u`.
    fn phase_step(&self, u: usize) -> (Phase, usize) {
        let half = self.n - 1;
        if u < half {
            (Phase::ReduceScatter, u)
        } else {
            (Phase::AllGather, u - half)
        }
    }

    /// Send segment `seg` of overall step `u` to the next rank.
    fn send(&mut self, u: usize, seg: usize) -> CollEffect {
        let (phase, step) = self.phase_step(u);
        let (c, _) = schedule(phase, step, self.rank, self.n);
        let range = self.segment(c, seg);
        if self.packing != Packing::Fp32 {
            // Rounded where it is: the owner of a finished chunk keeps what the others get,
            // and a partial sum is sent rounded (what it keeps of it is not used again).
            canon(self.packing, &mut self.buf[range.clone()]);
        }
        CollEffect::Send {
            to: (self.rank + 1) % self.n,
            msg: CollMsg::Chunk(RingChunk {
                id: self.id,
                level: self.level,
                phase,
                step,
                chunk: c,
                seg: seg as u32,
                data: self.buf[range].to_vec(),
            }),
        }
    }

    /// Feed one input; returns the effects in order, each send addressed to the next rank
    /// (`to` is a rank of this ring). A malformed input (wrong length, chunk index not the
    /// scheduled one, a chunk of another collective or ring level) and a message that is not
    /// a chunk leave the member unchanged and return nothing.
    pub fn handle(&mut self, input: CollInput) -> Vec<CollEffect> {
        match input {
            CollInput::PeerLost => {
                if self.state == State::Finished {
                    return vec![];
                }
                self.state = State::Finished;
                self.early.clear();
                vec![CollEffect::Aborted]
            }
            CollInput::Start(v) => {
                if self.state != State::Waiting || v.len() != self.len {
                    return vec![];
                }
                self.buf = v;
                if self.first == self.end {
                    self.state = State::Finished;
                    return vec![CollEffect::Done(std::mem::take(&mut self.buf))];
                }
                self.state = State::Running;
                let mut out: Vec<CollEffect> = (0..self.segments)
                    .map(|j| self.send(self.first, j))
                    .collect();
                for j in 0..self.segments {
                    self.drain(j, &mut out);
                }
                out
            }
            CollInput::Msg(CollMsg::Chunk(c)) => {
                let seg = c.seg as usize;
                if c.id != self.id
                    || c.level != self.level
                    || self.state == State::Finished
                    || c.step >= self.n - 1
                    || seg >= self.segments
                {
                    return vec![];
                }
                let u = match c.phase {
                    Phase::ReduceScatter => c.step,
                    Phase::AllGather => self.n - 1 + c.step,
                };
                let (_, want) = schedule(c.phase, c.step, self.rank, self.n);
                let range = self.segment(want, seg);
                if u < self.next[seg]
                    || u >= self.end
                    || c.chunk != want
                    || c.data.len() != range.len()
                {
                    return vec![];
                }
                self.early.insert((seg, u), c);
                let mut out = Vec::new();
                if self.state == State::Running {
                    self.drain(seg, &mut out);
                }
                out
            }
            CollInput::Msg(_) => vec![],
        }
    }

    /// Apply every piece of segment `seg` that is now due, in step order.
    fn drain(&mut self, seg: usize, out: &mut Vec<CollEffect>) {
        while self.state == State::Running {
            let u = self.next[seg];
            let Some(c) = self.early.remove(&(seg, u)) else {
                return;
            };
            let range = self.segment(c.chunk, seg);
            match c.phase {
                Phase::ReduceScatter => {
                    for (x, y) in self.buf[range].iter_mut().zip(&c.data) {
                        *x += *y;
                    }
                }
                Phase::AllGather => self.buf[range].copy_from_slice(&c.data),
            }
            self.next[seg] = u + 1;
            if u + 1 < self.end {
                out.push(self.send(u + 1, seg));
            } else {
                self.finished_segments += 1;
                if self.finished_segments == self.segments {
                    self.state = State::Finished;
                    out.push(CollEffect::Done(std::mem::take(&mut self.buf)));
                }
            }
        }
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    /// Drive n members; `choices` picks which non-empty link (or which not-yet-started member)
    /// acts next, so every interleaving that keeps per-link FIFO order is reachable.
    fn run(
        vectors: &[Vec<f32>],
        segments: usize,
        choices: &[usize],
        lose_at: Option<usize>,
    ) -> Vec<Option<Vec<f32>>> {
        let n = vectors.len();
        let len = vectors[0].len();
        let members: Vec<RingMember> = (0..n)
            .map(|r| RingMember::new(CollId::epoch(7), r, n, len).with_segments(segments))
            .collect();
        drive(members, vectors, choices, lose_at)
    }

    /// Drive `members` (rank order), each started with its vector, under the interleaving
    /// `choices` picks.
    fn drive(
        mut members: Vec<RingMember>,
        vectors: &[Vec<f32>],
        choices: &[usize],
        lose_at: Option<usize>,
    ) -> Vec<Option<Vec<f32>>> {
        let n = vectors.len();
        let mut links: Vec<VecDeque<RingChunk>> = vec![VecDeque::new(); n]; // links[r]: r -> r+1
        let mut started = vec![false; n];
        let mut result: Vec<Option<Vec<f32>>> = vec![None; n];
        let mut i = 0;
        let mut events = 0;
        loop {
            if lose_at == Some(events) {
                for (r, m) in members.iter_mut().enumerate() {
                    for e in m.handle(CollInput::PeerLost) {
                        assert_eq!(e, CollEffect::Aborted, "rank {r}");
                    }
                }
            }
            let mut ready: Vec<usize> = (0..n).filter(|&r| !started[r]).map(|r| r + n).collect();
            ready.extend((0..n).filter(|&r| !links[r].is_empty()));
            if ready.is_empty() {
                break;
            }
            let pick = ready[choices.get(i).copied().unwrap_or(0) % ready.len()];
            i += 1;
            events += 1;
            let (rank, effects) = if pick >= n {
                let r = pick - n;
                started[r] = true;
                (r, members[r].handle(CollInput::Start(vectors[r].clone())))
            } else {
                let c = links[pick].pop_front().unwrap();
                let to = (pick + 1) % n;
                (to, members[to].handle(CollInput::Msg(CollMsg::Chunk(c))))
            };
            for e in effects {
                match e {
                    CollEffect::Send { to, msg } => {
                        assert_eq!(to, (rank + 1) % n, "a ring sends to the next rank");
                        let CollMsg::Chunk(c) = msg else {
                            panic!("a ring sends chunks")
                        };
                        links[rank].push_back(c)
                    }
                    CollEffect::Done(v) => result[rank] = Some(v),
                    CollEffect::Aborted => {}
                }
            }
        }
        result
    }

    proptest! {
        /// Packed, every rank ends with the same bits, within the rounding of n − 1 hops of the
        /// true sum, under any interleaving.
        #[test]
        fn packed_rings_agree_bit_for_bit(
            n in 1usize..5,
            len in 1usize..600,
            segments in 1usize..4,
            which in 1usize..3,
            seed in any::<u64>(),
            choices in proptest::collection::vec(any::<usize>(), 0..400),
        ) {
            let packing = crate::pack::Packing::ALL[which];
            let vectors: Vec<Vec<f32>> = (0..n)
                .map(|r| (0..len).map(|i| {
                    let h = (seed ^ (r as u64 * 7919 + i as u64)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    (h >> 40) as f32 / (1u64 << 24) as f32 - 0.5
                }).collect())
                .collect();
            let members: Vec<RingMember> = (0..n)
                .map(|r| RingMember::new(CollId::epoch(7), r, n, len)
                    .with_segments(segments)
                    .with_packing(packing))
                .collect();
            let out = drive(members, &vectors, &choices, None);
            let first = out[0].clone().unwrap();
            for (r, o) in out.iter().enumerate() {
                let o = o.as_ref().unwrap();
                prop_assert!(o.iter().zip(&first).all(|(a, b)| a.to_bits() == b.to_bits()), "rank {r} differs");
            }
            for (i, v) in first.iter().enumerate() {
                let sum: f32 = vectors.iter().map(|x| x[i]).sum();
                // Each hop rounds within 1/127 of a block's largest |value| (at most n / 2).
                prop_assert!((v - sum).abs() <= 0.02 * n as f32 * n as f32, "{v} vs {sum}");
            }
        }
    }

    proptest! {
        /// Every rank ends with the same vector, equal to the plain sum, under any interleaving.
        #[test]
        fn ring_allreduce_equals_the_sum(
            n in 1usize..7,
            len in 0usize..23,
            segments in 1usize..5,
            seed_vals in prop::collection::vec(-100i32..100, 7 * 23),
            choices in prop::collection::vec(0usize..1000, 0..300),
        ) {
            let vectors: Vec<Vec<f32>> = (0..n)
                .map(|r| (0..len).map(|j| seed_vals[r * 23 + j] as f32 / 8.0).collect())
                .collect();
            let out = run(&vectors, segments, &choices, None);
            let oracle: Vec<f32> = (0..len).map(|j| vectors.iter().map(|v| v[j]).sum()).collect();
            for (r, o) in out.iter().enumerate() {
                let o = o.as_ref().unwrap_or_else(|| panic!("rank {r} did not finish"));
                prop_assert_eq!(o.len(), len);
                for j in 0..len { prop_assert!((o[j] - oracle[j]).abs() <= 1e-4 * oracle[j].abs().max(1.0), "rank {r} elem {j}"); }
                prop_assert_eq!(o, out[0].as_ref().unwrap(), "ranks disagree bit for bit");
            }
        }

        /// Uneven chunks (empty ones too): a reduce-scatter leaves rank r owning the sum of
        /// chunk r + 1, and an all-gather started from those owned sums gives every rank the
        /// whole sum, under any interleaving; a full all-reduce over the same bounds agrees.
        #[test]
        fn uneven_reduce_scatter_then_all_gather_equals_the_sum(
            n in 1usize..6,
            len in 0usize..40,
            cuts in prop::collection::vec(0usize..40, 5),
            elems in 1usize..4,
            seed_vals in prop::collection::vec(-100i32..100, 6 * 40),
            choices in prop::collection::vec(0usize..1000, 0..300),
        ) {
            let mut inner: Vec<usize> = cuts[..n - 1].iter().map(|c| c % (len + 1)).collect();
            inner.sort_unstable();
            let bounds: Vec<usize> = std::iter::once(0).chain(inner).chain([len]).collect();
            let vectors: Vec<Vec<f32>> = (0..n)
                .map(|r| (0..len).map(|j| seed_vals[r * 40 + j] as f32 / 8.0).collect())
                .collect();
            let oracle: Vec<f32> = (0..len).map(|j| vectors.iter().map(|v| v[j]).sum()).collect();
            let id = CollId::epoch(9);
            let member = |mode, r| {
                let m = RingMember::with_mode(id, 0, mode, r, n, len).with_bounds(bounds.clone());
                // Small segments, so that pieces of one chunk interleave too.
                let most = bounds.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
                m.with_segments(most.div_ceil(elems).max(1))
            };
            let scattered = drive((0..n).map(|r| member(RingMode::ReduceScatter, r)).collect(), &vectors, &choices, None);
            let close = |a: f32, b: f32| (a - b).abs() <= 1e-4 * b.abs().max(1.0);
            let mut owned = Vec::new();
            for (r, o) in scattered.iter().enumerate() {
                let o = o.as_ref().unwrap_or_else(|| panic!("rank {r} did not finish"));
                let c = (r + 1) % n;
                for j in bounds[c]..bounds[c + 1] {
                    prop_assert!(close(o[j], oracle[j]), "rank {r} elem {j}: {} vs {}", o[j], oracle[j]);
                }
                owned.push(o.clone());
            }
            let gathered = drive((0..n).map(|r| member(RingMode::AllGather, r)).collect(), &owned, &choices, None);
            let full = drive((0..n).map(|r| member(RingMode::Full, r)).collect(), &vectors, &choices, None);
            for (r, (g, f)) in gathered.iter().zip(&full).enumerate() {
                let (g, f) = (g.as_ref().expect("gathered"), f.as_ref().expect("reduced"));
                for j in 0..len {
                    prop_assert!(close(g[j], oracle[j]), "rank {r} elem {j}");
                    prop_assert!(close(f[j], oracle[j]), "rank {r} elem {j}");
                }
                prop_assert_eq!(g, gathered[0].as_ref().unwrap(), "ranks disagree bit for bit");
            }
        }

        /// A lost peer aborts every member that has not finished; nobody finishes afterwards.
        #[test]
        fn abort_stops_the_collective(n in 2usize..6, segments in 1usize..4, at in 0usize..20, choices in prop::collection::vec(0usize..100, 0..50)) {
            let vectors: Vec<Vec<f32>> = (0..n).map(|r| vec![r as f32; 10]).collect();
            let out = run(&vectors, segments, &choices, Some(at));
            // Either everyone finished before the loss, or the finished ones hold the true sum.
            let sum: f32 = (0..n).map(|r| r as f32).sum();
            for o in out.iter().flatten() { prop_assert!(o.iter().all(|&x| x == sum)); }
        }
    }

    #[test]
    fn schedule_covers_every_chunk_once_per_phase() {
        for n in 1usize..9 {
            for r in 0..n {
                let mut sent: Vec<usize> = (0..n.saturating_sub(1))
                    .map(|s| schedule(Phase::ReduceScatter, s, r, n).0)
                    .collect();
                sent.sort_unstable();
                sent.dedup();
                assert_eq!(sent.len(), n.saturating_sub(1));
                // what r receives at step s is what r-1 sends at step s
                for s in 0..n.saturating_sub(1) {
                    for p in [Phase::ReduceScatter, Phase::AllGather] {
                        assert_eq!(schedule(p, s, r, n).1, schedule(p, s, (r + n - 1) % n, n).0);
                    }
                }
            }
        }
    }

    #[test]
    fn stale_and_malformed_chunks_are_ignored() {
        let chunk = |epoch, level, phase, step, c, len| RingChunk {
            id: CollId::epoch(epoch),
            level,
            phase,
            step,
            chunk: c,
            seg: 0,
            data: vec![1.0; len],
        };
        let mut m = RingMember::new(CollId::epoch(3), 0, 3, 6);
        let stale = chunk(2, 0, Phase::ReduceScatter, 0, 2, 2);
        assert!(m.handle(CollInput::Msg(CollMsg::Chunk(stale))).is_empty());
        let wrong_len = chunk(3, 0, Phase::ReduceScatter, 0, 2, 5);
        assert!(
            m.handle(CollInput::Msg(CollMsg::Chunk(wrong_len)))
                .is_empty()
        );
        let wrong_step = chunk(3, 0, Phase::AllGather, 9, 0, 0);
        assert!(
            m.handle(CollInput::Msg(CollMsg::Chunk(wrong_step)))
                .is_empty()
        );
        let wrong_level = chunk(3, 2, Phase::ReduceScatter, 0, 2, 2);
        assert!(
            m.handle(CollInput::Msg(CollMsg::Chunk(wrong_level)))
                .is_empty()
        );
        let not_a_chunk = CollMsg::Pull {
            id: CollId::epoch(3),
            data: vec![1.0; 6],
        };
        assert!(m.handle(CollInput::Msg(not_a_chunk)).is_empty());
        assert!(
            m.handle(CollInput::Start(vec![0.0; 5])).is_empty(),
            "wrong length start"
        );
        assert_eq!(m.handle(CollInput::Start(vec![0.0; 6])).len(), 1);
        let wrong_seg = RingChunk {
            seg: 1,
            ..chunk(3, 0, Phase::ReduceScatter, 0, 2, 2)
        };
        assert!(
            m.handle(CollInput::Msg(CollMsg::Chunk(wrong_seg)))
                .is_empty()
        );
    }

    #[test]
    fn segment_counts() {
        assert_eq!(segments_for(10, 3), 1);
        assert_eq!(segments_for(0, 3), 1);
        // 64 MiB of f32 over 2 ranks: 32 MiB chunks of 1 MiB segments.
        assert_eq!(segments_for(16 << 20, 2), 32);
        assert_eq!(segments_for(16 << 20, 3), 22); // ceil(5,592,406 / 262,144)
        // Segments tile each chunk exactly.
        for (len, n, s) in [(10, 3, 4), (7, 2, 3), (1000, 7, 9)] {
            for c in 0..n {
                let mut at = chunk_range(len, n, c).start;
                for j in 0..s {
                    let r = segment_range(len, n, c, s, j);
                    assert_eq!(r.start, at);
                    at = r.end;
                }
                assert_eq!(at, chunk_range(len, n, c).end);
            }
        }
    }

    /// A member sends no piece larger than a segment, and pieces move on as they arrive:
    /// with 4 segments, the first received piece is forwarded before the others arrive.
    #[test]
    fn pieces_move_on_one_at_a_time() {
        let mut a = RingMember::new(CollId::epoch(1), 0, 2, 16).with_segments(4);
        let mut b = RingMember::new(CollId::epoch(1), 1, 2, 16).with_segments(4);
        let sent_a = a.handle(CollInput::Start(vec![1.0; 16]));
        assert_eq!(sent_a.len(), 4);
        b.handle(CollInput::Start(vec![2.0; 16]));
        let CollEffect::Send {
            msg: CollMsg::Chunk(first),
            ..
        } = sent_a[0].clone()
        else {
            panic!("expected a send")
        };
        assert_eq!(first.data.len(), 2);
        let out = b.handle(CollInput::Msg(CollMsg::Chunk(first)));
        assert_eq!(out.len(), 1, "one piece in, one piece on: {out:?}");
        match &out[0] {
            CollEffect::Send {
                to: 0,
                msg: CollMsg::Chunk(c),
            } => {
                assert_eq!((c.phase, c.seg), (Phase::AllGather, 0));
                assert_eq!(c.data, vec![3.0; 2]);
            }
            e => panic!("unexpected {e:?}"),
        }
    }
}

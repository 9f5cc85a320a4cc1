//! Ring all-reduce as a pure state machine: reduce-scatter, then all-gather.
//!
//! [`schedule`] is index arithmetic only (which chunk goes where at which step). [`RingMember`]
//! is one node's side of one collective: feed it [`RingInput`]s, send the [`RingEffect::Send`]s
//! it returns to the next node in the ring, and it ends with [`RingEffect::Done`] holding the
//! sum. It does no I/O and keeps no clock, so the simulator and the TCP runtime drive the same
//! code, and the property test below drives it under arbitrary (per-link FIFO) interleavings
//! against a plain sum.
//!
//! Messages carry the collective's `epoch`; a member ignores messages of other epochs, so after
//! an abort (a peer was lost, the ring re-forms) stale chunks cannot leak into the next round.

use std::collections::BTreeMap;
use std::ops::Range;

/// Phase of the algorithm.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
pub enum Phase {
    /// Each rank accumulates one chunk's sum.
    ReduceScatter,
    /// Each rank forwards the finished chunks.
    AllGather,
}

/// The element range of chunk `c` when `len` elements are split into `n` chunks.
pub fn chunk_range(len: usize, n: usize, c: usize) -> Range<usize> {
    (c * len / n)..((c + 1) * len / n)
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

/// A chunk travelling to the next rank.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RingChunk {
    /// Collective this chunk belongs to.
    pub epoch: u64,
    /// Which ring of a composed collective it belongs to (0 for a flat ring).
    pub level: u8,
    /// Phase.
    pub phase: Phase,
    /// Step within the phase.
    pub step: usize,
    /// Chunk index.
    pub chunk: usize,
    /// The values.
    pub data: Vec<f32>,
}

/// Inputs to a ring member.
#[derive(Debug, Clone, PartialEq)]
pub enum RingInput {
    /// Start with this node's (already weighted) contribution.
    Start(Vec<f32>),
    /// A chunk from the previous rank.
    Chunk(RingChunk),
    /// A member of the ring is gone: the collective cannot complete.
    PeerLost,
}

/// What a member asks its driver to do.
#[derive(Debug, Clone, PartialEq)]
pub enum RingEffect {
    /// Send this chunk to the next rank.
    Send(RingChunk),
    /// The collective finished: every rank ends with the same sum.
    Done(Vec<f32>),
    /// The collective was abandoned; the caller keeps its own contribution.
    Aborted,
}

/// Where a member is.
#[derive(Debug, Clone, PartialEq)]
enum State {
    Waiting,
    Running { phase: Phase, step: usize },
    Finished,
}

/// One node's side of one ring all-reduce.
#[derive(Debug, Clone)]
pub struct RingMember {
    epoch: u64,
    level: u8,
    mode: RingMode,
    rank: usize,
    n: usize,
    len: usize,
    buf: Vec<f32>,
    state: State,
    /// Chunks that arrived before this member was ready for them, by (phase, step).
    early: BTreeMap<(Phase, usize), RingChunk>,
}

impl RingMember {
    /// A member at `rank` of a ring of `n` over vectors of `len` elements.
    pub fn new(epoch: u64, rank: usize, n: usize, len: usize) -> Self {
        Self::with_mode(epoch, 0, RingMode::Full, rank, n, len)
    }

    /// A member running part of an all-reduce, as ring `level` of a composed collective.
    pub fn with_mode(
        epoch: u64,
        level: u8,
        mode: RingMode,
        rank: usize,
        n: usize,
        len: usize,
    ) -> Self {
        assert!(rank < n && n > 0, "rank {rank} outside a ring of {n}");
        RingMember {
            epoch,
            level,
            mode,
            rank,
            n,
            len,
            buf: Vec::new(),
            state: State::Waiting,
            early: BTreeMap::new(),
        }
    }

    /// Whether the collective has finished or aborted.
    pub fn is_finished(&self) -> bool {
        self.state == State::Finished
    }

    fn send(&self, phase: Phase, step: usize) -> RingEffect {
        let (c, _) = schedule(phase, step, self.rank, self.n);
        RingEffect::Send(RingChunk {
            epoch: self.epoch,
            level: self.level,
            phase,
            step,
            chunk: c,
            data: self.buf[chunk_range(self.len, self.n, c)].to_vec(),
        })
    }

    /// Feed one input; returns the effects in order. A malformed input (wrong length, chunk
    /// index not the scheduled one) leaves the member unchanged and returns nothing.
    pub fn handle(&mut self, input: RingInput) -> Vec<RingEffect> {
        match input {
            RingInput::PeerLost => {
                if self.state == State::Finished {
                    return vec![];
                }
                self.state = State::Finished;
                self.early.clear();
                vec![RingEffect::Aborted]
            }
            RingInput::Start(v) => {
                if self.state != State::Waiting || v.len() != self.len {
                    return vec![];
                }
                self.buf = v;
                if self.n == 1 {
                    self.state = State::Finished;
                    return vec![RingEffect::Done(std::mem::take(&mut self.buf))];
                }
                let phase = match self.mode {
                    RingMode::Full | RingMode::ReduceScatter => Phase::ReduceScatter,
                    RingMode::AllGather => Phase::AllGather,
                };
                self.state = State::Running { phase, step: 0 };
                let mut out = vec![self.send(phase, 0)];
                out.extend(self.drain());
                out
            }
            RingInput::Chunk(c) => {
                if c.epoch != self.epoch
                    || c.level != self.level
                    || self.state == State::Finished
                    || c.step >= self.n - 1
                {
                    return vec![];
                }
                let (_, want) = schedule(c.phase, c.step, self.rank, self.n);
                if c.chunk != want || c.data.len() != chunk_range(self.len, self.n, want).len() {
                    return vec![];
                }
                self.early.insert((c.phase, c.step), c);
                if matches!(self.state, State::Running { .. }) {
                    self.drain()
                } else {
                    vec![]
                }
            }
        }
    }

    /// Apply every chunk that is now due, in schedule order.
    fn drain(&mut self) -> Vec<RingEffect> {
        let mut out = Vec::new();
        while let State::Running { phase, step } = self.state {
            let Some(c) = self.early.remove(&(phase, step)) else {
                break;
            };
            let range = chunk_range(self.len, self.n, c.chunk);
            match phase {
                Phase::ReduceScatter => {
                    for (x, y) in self.buf[range].iter_mut().zip(&c.data) {
                        *x += *y;
                    }
                }
                Phase::AllGather => self.buf[range].copy_from_slice(&c.data),
            }
            let last = self.n - 2;
            let next = match (phase, step) {
                (Phase::ReduceScatter, s) if s == last && self.mode == RingMode::ReduceScatter => {
                    None
                }
                (Phase::ReduceScatter, s) if s == last => Some((Phase::AllGather, 0)),
                (Phase::AllGather, s) if s == last => None,
                (p, s) => Some((p, s + 1)),
            };
            match next {
                Some((p, s)) => {
                    self.state = State::Running { phase: p, step: s };
                    out.push(self.send(p, s));
                }
                None => {
                    self.state = State::Finished;
                    out.push(RingEffect::Done(std::mem::take(&mut self.buf)));
                }
            }
        }
        out
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
        choices: &[usize],
        lose_at: Option<usize>,
    ) -> Vec<Option<Vec<f32>>> {
        let n = vectors.len();
        let len = vectors[0].len();
        let mut members: Vec<RingMember> = (0..n).map(|r| RingMember::new(7, r, n, len)).collect();
        let mut links: Vec<VecDeque<RingChunk>> = vec![VecDeque::new(); n]; // links[r]: r -> r+1
        let mut started = vec![false; n];
        let mut result: Vec<Option<Vec<f32>>> = vec![None; n];
        let mut i = 0;
        let mut events = 0;
        loop {
            if lose_at == Some(events) {
                for (r, m) in members.iter_mut().enumerate() {
                    for e in m.handle(RingInput::PeerLost) {
                        assert_eq!(e, RingEffect::Aborted, "rank {r}");
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
                (r, members[r].handle(RingInput::Start(vectors[r].clone())))
            } else {
                let c = links[pick].pop_front().unwrap();
                let to = (pick + 1) % n;
                (to, members[to].handle(RingInput::Chunk(c)))
            };
            for e in effects {
                match e {
                    RingEffect::Send(c) => links[rank].push_back(c),
                    RingEffect::Done(v) => result[rank] = Some(v),
                    RingEffect::Aborted => {}
                }
            }
        }
        result
    }

    proptest! {
        /// Every rank ends with the same vector, equal to the plain sum, under any interleaving.
        #[test]
        fn ring_allreduce_equals_the_sum(
            n in 1usize..7,
            len in 0usize..23,
            seed_vals in prop::collection::vec(-100i32..100, 7 * 23),
            choices in prop::collection::vec(0usize..1000, 0..300),
        ) {
            let vectors: Vec<Vec<f32>> = (0..n)
                .map(|r| (0..len).map(|j| seed_vals[r * 23 + j] as f32 / 8.0).collect())
                .collect();
            let out = run(&vectors, &choices, None);
            let oracle: Vec<f32> = (0..len).map(|j| vectors.iter().map(|v| v[j]).sum()).collect();
            for (r, o) in out.iter().enumerate() {
                let o = o.as_ref().unwrap_or_else(|| panic!("rank {r} did not finish"));
                prop_assert_eq!(o.len(), len);
                for j in 0..len { prop_assert!((o[j] - oracle[j]).abs() <= 1e-4 * oracle[j].abs().max(1.0), "rank {r} elem {j}"); }
                prop_assert_eq!(o, out[0].as_ref().unwrap(), "ranks disagree bit for bit");
            }
        }

        /// A lost peer aborts every member that has not finished; nobody finishes afterwards.
        #[test]
        fn abort_stops_the_collective(n in 2usize..6, at in 0usize..20, choices in prop::collection::vec(0usize..100, 0..50)) {
            let vectors: Vec<Vec<f32>> = (0..n).map(|r| vec![r as f32; 10]).collect();
            let out = run(&vectors, &choices, Some(at));
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
            epoch,
            level,
            phase,
            step,
            chunk: c,
            data: vec![1.0; len],
        };
        let mut m = RingMember::new(3, 0, 3, 6);
        let stale = chunk(2, 0, Phase::ReduceScatter, 0, 2, 2);
        assert!(m.handle(RingInput::Chunk(stale)).is_empty());
        let wrong_len = chunk(3, 0, Phase::ReduceScatter, 0, 2, 5);
        assert!(m.handle(RingInput::Chunk(wrong_len)).is_empty());
        let wrong_step = chunk(3, 0, Phase::AllGather, 9, 0, 0);
        assert!(m.handle(RingInput::Chunk(wrong_step)).is_empty());
        let wrong_level = chunk(3, 2, Phase::ReduceScatter, 0, 2, 2);
        assert!(m.handle(RingInput::Chunk(wrong_level)).is_empty());
        assert!(
            m.handle(RingInput::Start(vec![0.0; 5])).is_empty(),
            "wrong length start"
        );
        assert_eq!(m.handle(RingInput::Start(vec![0.0; 6])).len(), 1);
    }
}

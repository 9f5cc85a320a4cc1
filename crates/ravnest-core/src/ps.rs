//! Parameter-server averaging as a pure state machine: rank 0 is the server; every other rank
//! pushes its (weighted) contribution to it, the server sums all of them in rank order and
//! sends the sum back. Same shape as [`crate::ring::RingMember`]: inputs in, effects out.

use std::collections::BTreeMap;

/// Inputs to a parameter-server member.
#[derive(Debug, Clone, PartialEq)]
pub enum PsInput {
    /// Start with this node's contribution.
    Start(Vec<f32>),
    /// (Server only) a worker's contribution.
    FromWorker {
        /// The worker's rank (1..n).
        rank: usize,
        /// Its contribution.
        data: Vec<f32>,
    },
    /// (Workers only) the sum from the server.
    FromServer(Vec<f32>),
    /// A member is gone.
    PeerLost,
}

/// Effects a member asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum PsEffect {
    /// (Worker) send my contribution to the server.
    Push(Vec<f32>),
    /// (Server) send the sum to every worker.
    Broadcast(Vec<f32>),
    /// Finished with the sum.
    Done(Vec<f32>),
    /// Abandoned.
    Aborted,
}

/// One node's side of one parameter-server round.
#[derive(Debug, Clone)]
pub struct PsMember {
    rank: usize,
    n: usize,
    len: usize,
    started: bool,
    finished: bool,
    /// Contributions by rank (server), including its own at rank 0.
    got: BTreeMap<usize, Vec<f32>>,
}

impl PsMember {
    /// Member `rank` of `n` (rank 0 is the server) over vectors of `len` elements.
    pub fn new(rank: usize, n: usize, len: usize) -> Self {
        assert!(rank < n, "rank {rank} outside a group of {n}");
        PsMember {
            rank,
            n,
            len,
            started: false,
            finished: false,
            got: BTreeMap::new(),
        }
    }

    /// Feed one input. Malformed inputs (wrong length, wrong role, duplicates) change nothing.
    pub fn handle(&mut self, input: PsInput) -> Vec<PsEffect> {
        if self.finished {
            return vec![];
        }
        match input {
            PsInput::PeerLost => {
                self.finished = true;
                vec![PsEffect::Aborted]
            }
            PsInput::Start(v) if !self.started && v.len() == self.len => {
                self.started = true;
                if self.rank == 0 {
                    self.got.insert(0, v);
                    self.try_finish()
                } else {
                    vec![PsEffect::Push(v)]
                }
            }
            PsInput::FromWorker { rank, data }
                if self.rank == 0
                    && rank > 0
                    && rank < self.n
                    && data.len() == self.len
                    && !self.got.contains_key(&rank) =>
            {
                self.got.insert(rank, data);
                if self.started {
                    self.try_finish()
                } else {
                    vec![]
                }
            }
            PsInput::FromServer(data)
                if self.rank > 0 && self.started && data.len() == self.len =>
            {
                self.finished = true;
                vec![PsEffect::Done(data)]
            }
            _ => vec![],
        }
    }

    fn try_finish(&mut self) -> Vec<PsEffect> {
        if self.got.len() < self.n {
            return vec![];
        }
        let mut sum = vec![0.0f32; self.len];
        for v in self.got.values() {
            for (s, x) in sum.iter_mut().zip(v) {
                *s += *x;
            }
        }
        self.finished = true;
        self.got.clear();
        if self.n > 1 {
            vec![PsEffect::Broadcast(sum.clone()), PsEffect::Done(sum)]
        } else {
            vec![PsEffect::Done(sum)]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Every member ends with the plain sum, whatever order the pushes and starts arrive in.
        #[test]
        fn ps_round_equals_the_sum(n in 1usize..7, vals in prop::collection::vec(-50i32..50, 7 * 5), order in prop::collection::vec(0usize..100, 0..40)) {
            let len = 5;
            let vs: Vec<Vec<f32>> = (0..n).map(|r| (0..len).map(|j| vals[r * len + j] as f32 / 4.0).collect()).collect();
            let mut m: Vec<PsMember> = (0..n).map(|r| PsMember::new(r, n, len)).collect();
            let mut to_server: Vec<(usize, Vec<f32>)> = vec![];
            let mut starts: Vec<usize> = (0..n).collect();
            let mut done: Vec<Option<Vec<f32>>> = vec![None; n];
            let mut k = 0;
            loop {
                let mut choices: Vec<usize> = vec![];
                if !starts.is_empty() { choices.push(0); }
                if !to_server.is_empty() { choices.push(1); }
                if choices.is_empty() { break; }
                let c = choices[order.get(k).copied().unwrap_or(0) % choices.len()];
                k += 1;
                let (rank, effects) = if c == 0 {
                    let r = starts.remove(order.get(k).copied().unwrap_or(0) % starts.len());
                    (r, m[r].handle(PsInput::Start(vs[r].clone())))
                } else {
                    let (r, d) = to_server.remove(0);
                    (0, m[0].handle(PsInput::FromWorker { rank: r, data: d }))
                };
                for e in effects {
                    match e {
                        PsEffect::Push(d) => to_server.push((rank, d)),
                        PsEffect::Broadcast(d) => {
                            for (w, mw) in m.iter_mut().enumerate().skip(1) {
                                for e in mw.handle(PsInput::FromServer(d.clone())) {
                                    if let PsEffect::Done(x) = e { done[w] = Some(x); }
                                }
                            }
                        }
                        PsEffect::Done(d) => done[rank] = Some(d),
                        PsEffect::Aborted => {}
                    }
                }
            }
            let oracle: Vec<f32> = (0..len).map(|j| vs.iter().map(|v| v[j]).sum()).collect();
            for (r, d) in done.iter().enumerate() {
                let d = d.as_ref().unwrap_or_else(|| panic!("rank {r} unfinished"));
                for j in 0..len { prop_assert!((d[j] - oracle[j]).abs() < 1e-4); }
            }
        }
    }

    #[test]
    fn malformed_inputs_change_nothing() {
        let mut s = PsMember::new(0, 3, 2);
        assert!(
            s.handle(PsInput::FromWorker {
                rank: 0,
                data: vec![1.0; 2]
            })
            .is_empty()
        );
        assert!(
            s.handle(PsInput::FromWorker {
                rank: 5,
                data: vec![1.0; 2]
            })
            .is_empty()
        );
        assert!(
            s.handle(PsInput::FromWorker {
                rank: 1,
                data: vec![1.0; 3]
            })
            .is_empty()
        );
        assert!(s.handle(PsInput::FromServer(vec![0.0; 2])).is_empty());
        let mut w = PsMember::new(1, 3, 2);
        assert!(
            w.handle(PsInput::FromServer(vec![0.0; 2])).is_empty(),
            "not started"
        );
    }
}

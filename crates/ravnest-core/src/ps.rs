//! Parameter-server averaging as a pure state machine: rank 0 is the server; every other rank
//! pushes its (weighted) contribution to it, the server sums all of them in rank order and
//! sends the sum back. Same shape as [`crate::ring::RingMember`]: [`CollInput`]s in,
//! [`CollEffect`]s out.

use std::collections::BTreeMap;

use crate::coll_types::{CollEffect, CollId, CollInput, CollMsg};
use crate::pack::{Packing, canon};

/// One node's side of one parameter-server round.
#[derive(Debug, Clone)]
pub struct PsMember {
    id: CollId,
    rank: usize,
    n: usize,
    len: usize,
    started: bool,
    finished: bool,
    /// Contributions by rank (server), including its own at rank 0.
    got: BTreeMap<usize, Vec<f32>>,
    /// What pushes and the sum are rounded to before they travel.
    packing: Packing,
}

impl PsMember {
    /// Member `rank` of `n` (rank 0 is the server) of collective `id`, over vectors of `len`
    /// elements.
    pub fn new(id: CollId, rank: usize, n: usize, len: usize) -> Self {
        assert!(rank < n, "rank {rank} outside a group of {n}");
        PsMember {
            id,
            rank,
            n,
            len,
            started: false,
            finished: false,
            got: BTreeMap::new(),
            packing: Packing::Fp32,
        }
    }

    /// The same member rounding what it sends to `packing` ([`crate::pack`]); the server
    /// keeps the rounded sum it sends, so every rank ends with the same bits.
    pub fn with_packing(mut self, packing: Packing) -> Self {
        self.packing = packing;
        self
    }

    /// Feed one input; returns the effects in order: a worker pushes its contribution to rank
    /// 0, the server sends the sum to ranks 1..n in rank order, then finishes. Messages of
    /// another collective, ring chunks, and malformed inputs (wrong length, wrong role,
    /// duplicates) change nothing and return nothing.
    pub fn handle(&mut self, input: CollInput) -> Vec<CollEffect> {
        if self.finished {
            return vec![];
        }
        match input {
            CollInput::PeerLost => {
                self.finished = true;
                vec![CollEffect::Aborted]
            }
            CollInput::Start(mut v) if !self.started && v.len() == self.len => {
                self.started = true;
                if self.rank == 0 {
                    self.got.insert(0, v);
                    self.try_finish()
                } else {
                    canon(self.packing, &mut v);
                    vec![CollEffect::Send {
                        to: 0,
                        msg: CollMsg::Push {
                            id: self.id,
                            rank: self.rank as u32,
                            data: v,
                        },
                    }]
                }
            }
            CollInput::Msg(CollMsg::Push { id, rank, data })
                if id == self.id
                    && self.rank == 0
                    && rank > 0
                    && (rank as usize) < self.n
                    && data.len() == self.len
                    && !self.got.contains_key(&(rank as usize)) =>
            {
                self.got.insert(rank as usize, data);
                if self.started {
                    self.try_finish()
                } else {
                    vec![]
                }
            }
            CollInput::Msg(CollMsg::Pull { id, data })
                if id == self.id && self.rank > 0 && self.started && data.len() == self.len =>
            {
                self.finished = true;
                vec![CollEffect::Done(data)]
            }
            _ => vec![],
        }
    }

    /// (Server) once every contribution is in: the sum to each worker, then done.
    fn try_finish(&mut self) -> Vec<CollEffect> {
        if self.got.len() < self.n {
            return vec![];
        }
        let mut sum = vec![0.0f32; self.len];
        for v in self.got.values() {
            for (s, x) in sum.iter_mut().zip(v) {
                *s += *x;
            }
        }
        canon(self.packing, &mut sum);
        self.finished = true;
        self.got.clear();
        let mut out: Vec<CollEffect> = (1..self.n)
            .map(|to| CollEffect::Send {
                to,
                msg: CollMsg::Pull {
                    id: self.id,
                    data: sum.clone(),
                },
            })
            .collect();
        out.push(CollEffect::Done(sum));
        out
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
            let id = CollId::epoch(2);
            let mut m: Vec<PsMember> = (0..n).map(|r| PsMember::new(id, r, n, len)).collect();
            let mut to_server: Vec<CollMsg> = vec![];
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
                    (r, m[r].handle(CollInput::Start(vs[r].clone())))
                } else {
                    let msg = to_server.remove(0);
                    (0, m[0].handle(CollInput::Msg(msg)))
                };
                for e in effects {
                    match e {
                        CollEffect::Send { to: 0, msg } => to_server.push(msg),
                        CollEffect::Send { to, msg } => {
                            for e in m[to].handle(CollInput::Msg(msg)) {
                                if let CollEffect::Done(x) = e { done[to] = Some(x); }
                            }
                        }
                        CollEffect::Done(d) => done[rank] = Some(d),
                        CollEffect::Aborted => {}
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
        let id = CollId::epoch(1);
        let mut s = PsMember::new(id, 0, 3, 2);
        assert!(
            s.handle(CollInput::Msg(CollMsg::Push {
                id,
                rank: 0,
                data: vec![1.0; 2]
            }))
            .is_empty()
        );
        assert!(
            s.handle(CollInput::Msg(CollMsg::Push {
                id,
                rank: 5,
                data: vec![1.0; 2]
            }))
            .is_empty()
        );
        assert!(
            s.handle(CollInput::Msg(CollMsg::Push {
                id,
                rank: 1,
                data: vec![1.0; 3]
            }))
            .is_empty()
        );
        assert!(
            s.handle(CollInput::Msg(CollMsg::Pull {
                id,
                data: vec![0.0; 2]
            }))
            .is_empty()
        );
        let mut w = PsMember::new(id, 1, 3, 2);
        assert!(
            w.handle(CollInput::Msg(CollMsg::Pull {
                id,
                data: vec![0.0; 2]
            }))
            .is_empty(),
            "not started"
        );
    }

    #[test]
    fn messages_of_another_collective_are_ignored() {
        let mut s = PsMember::new(CollId::epoch(1), 0, 2, 2);
        let stale = CollMsg::Push {
            id: CollId::epoch(0),
            rank: 1,
            data: vec![1.0; 2],
        };
        assert!(s.handle(CollInput::Msg(stale)).is_empty());
        assert!(
            s.handle(CollInput::Start(vec![1.0; 2])).is_empty(),
            "the stale push must not count"
        );
        let mut w = PsMember::new(CollId::epoch(1), 1, 2, 2);
        assert_eq!(w.handle(CollInput::Start(vec![1.0; 2])).len(), 1);
        let stale = CollMsg::Pull {
            id: CollId::epoch(0),
            data: vec![2.0; 2],
        };
        assert!(w.handle(CollInput::Msg(stale)).is_empty());
    }
}

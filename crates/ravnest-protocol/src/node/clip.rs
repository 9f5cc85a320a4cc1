//! Where the pieces of a step's global gradient norm go under clipping, when no node holds the
//! whole gradient: a sharded owner tells the rest of its ring; a pipeline stage tells its
//! neighbours in its replica, who pass each piece on away from where it came, so that every
//! stage gets every piece once. [`Norms`] keeps the pieces a node has, says what it sends on,
//! and when a step's norm is whole; the runtime's node clips and applies
//! ([`super::machine`], whose `clip` module is the driver of clipping).

use ravnest_core::NodeId;
use ravnest_core::recipe::NormPieces;

use crate::msg::{Envelope, Work};

/// Where this node's piece of a step's norm goes.
#[derive(Debug, PartialEq, Eq)]
pub struct Route {
    /// Its part: a stage's index, or a sharded owner's rank.
    pub part: u32,
    /// Parts that make the norm.
    pub parts: u32,
    /// Whom it tells: its neighbouring stages, or the rest of its ring.
    pub to: Vec<NodeId>,
}

/// The route of node `me` under work `w`; `None` when it holds the whole gradient.
pub fn route(w: &Work, me: NodeId) -> Option<Route> {
    if let Some(sw) = &w.stage {
        return (sw.stages > 1).then(|| Route {
            part: sw.stage,
            parts: sw.stages,
            to: [sw.prev, sw.next].into_iter().flatten().collect(),
        });
    }
    w.shard.as_ref()?;
    let rank = w.ring.iter().position(|&n| n == me)?;
    (w.ring.len() > 1).then(|| Route {
        part: rank as u32,
        parts: w.ring.len() as u32,
        to: w.ring.iter().copied().filter(|&n| n != me).collect(),
    })
}

/// Where a stage passes on a piece of part `part` that came to it: on, away from its origin
/// (a piece from an earlier stage goes to the next one, a later stage's to the previous one).
pub fn pass_on(w: &Work, part: u32) -> Option<NodeId> {
    let sw = w.stage.as_ref()?;
    match part.cmp(&sw.stage) {
        std::cmp::Ordering::Less => sw.next,
        std::cmp::Ordering::Greater => sw.prev,
        std::cmp::Ordering::Equal => None,
    }
}

/// The pieces of steps' norms a node has (its own and its peers'), under clipping.
#[derive(Debug, Default)]
pub struct Norms {
    pieces: NormPieces,
}

/// A piece of step `step`'s norm of `epoch`, to node `to`.
fn piece(to: NodeId, epoch: u64, step: u64, part: u32, sq: f64) -> (NodeId, Envelope) {
    let env = Envelope::GradNorm {
        epoch,
        step,
        part,
        sq,
    };
    (to, env)
}

impl Norms {
    /// This node's piece `sq` of step `step`'s norm under `w` (`None`: no work, one part):
    /// kept, and the pieces it sends along its route.
    pub fn mine(
        &mut self,
        w: Option<&Work>,
        me: NodeId,
        (epoch, step): (u64, u64),
        sq: f64,
    ) -> Vec<(NodeId, Envelope)> {
        match w.and_then(|w| route(w, me)) {
            None => {
                self.pieces.add(epoch, step, 0, sq);
                Vec::new()
            }
            Some(r) => {
                self.pieces.add(epoch, step, r.part, sq);
                let to = r.to.into_iter();
                to.map(|n| piece(n, epoch, step, r.part, sq)).collect()
            }
        }
    }

    /// A peer's piece `sq` of part `part` of step `step`'s norm, this node running `w` and
    /// holding versions up to `latest`: `None` when it is refused (a step or an epoch this node
    /// is past, a value that is not finite, a part already in); else where it is passed on (a
    /// stage passes pieces away from their origin).
    pub fn theirs(
        &mut self,
        (w, latest): (Option<&Work>, Option<u64>),
        (epoch, step): (u64, u64),
        part: u32,
        sq: f64,
    ) -> Option<Option<(NodeId, Envelope)>> {
        let stale = w.is_some_and(|w| epoch < w.epoch) || latest.is_some_and(|l| step < l);
        if stale || !sq.is_finite() || !self.pieces.add(epoch, step, part, sq) {
            return None;
        }
        let on = w
            .filter(|w| w.epoch == epoch)
            .and_then(|w| pass_on(w, part));
        Some(on.map(|to| piece(to, epoch, step, part, sq)))
    }

    /// The square of step `step`'s norm, once the piece of every part of node `me`'s layout
    /// under `w` is in.
    pub fn total(&self, w: Option<&Work>, me: NodeId, (epoch, step): (u64, u64)) -> Option<f64> {
        let parts = w.and_then(|w| route(w, me)).map_or(1, |r| r.parts);
        self.pieces.total(epoch, step, parts)
    }

    /// Step `step` of `epoch` is applied: the pieces of it and of earlier steps go.
    pub fn forget_through(&mut self, epoch: u64, step: u64) {
        self.pieces.forget_before(epoch, step + 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::msg::{ShardWork, StageWork};
    use ravnest_core::LayerRange;

    /// Epoch 1's work from step 0, over `ring`.
    fn work(ring: Vec<NodeId>) -> Work {
        Work::for_test(1, 0, 4, ring)
    }

    fn stage(stage: u32, stages: u32) -> StageWork {
        let id = |k: u32| (k < stages).then_some(NodeId(10 + k));
        StageWork {
            stage,
            stages,
            layers: LayerRange::new(stage, stage + 1),
            prev: stage.checked_sub(1).and_then(id),
            next: id(stage + 1),
            micro_batch: 1,
            out_bytes_per_sample: 4,
            in_bytes_per_sample: 4,
            sync_bytes: 4,
            fetch: Vec::new(),
        }
    }

    /// Each stage's work in a pipeline of `stages` on nodes 10, 11, ...
    fn pipeline(stages: u32) -> Vec<Work> {
        (0..stages)
            .map(|s| Work {
                stage: Some(stage(s, stages)),
                ..work(vec![NodeId(10 + s)])
            })
            .collect()
    }

    /// Pieces passed along a pipeline reach every stage exactly once: from each stage, a piece
    /// travels both ways to the ends and stops there.
    #[test]
    fn every_stage_gets_every_piece_once() {
        for stages in 1..7u32 {
            let works = pipeline(stages);
            let at = |n: NodeId| (n.0 - 10) as usize;
            let mut got = vec![vec![0u32; stages as usize]; stages as usize];
            for origin in 0..stages {
                let me = NodeId(10 + origin);
                got[origin as usize][origin as usize] += 1;
                let mut queue: Vec<NodeId> = route(&works[origin as usize], me)
                    .map(|r| r.to)
                    .unwrap_or_default();
                while let Some(n) = queue.pop() {
                    got[at(n)][origin as usize] += 1;
                    queue.extend(pass_on(&works[at(n)], origin));
                }
            }
            assert!(got.iter().flatten().all(|&c| c == 1), "{stages}: {got:?}");
        }
    }

    /// A sharded owner tells the rest of its ring; a data-parallel node or a ring of one tells
    /// no one (it holds the whole gradient).
    #[test]
    fn sharded_owners_tell_their_ring() {
        let ring = vec![NodeId(3), NodeId(1), NodeId(2)];
        let parts = vec![LayerRange::new(0, 1); 3];
        let shard = ShardWork {
            owned: LayerRange::new(0, 1),
            parts,
            fetch: Vec::new(),
        };
        let w = Work {
            shard: Some(shard.clone()),
            ..work(ring.clone())
        };
        let r = route(&w, NodeId(1)).unwrap();
        assert_eq!((r.part, r.parts), (1, 3));
        assert_eq!(r.to, vec![NodeId(3), NodeId(2)]);
        assert_eq!(route(&work(ring), NodeId(1)), None);
        let alone = Work {
            shard: Some(shard),
            ..work(vec![NodeId(1)])
        };
        assert_eq!(route(&alone, NodeId(1)), None);
    }

    /// Through `Norms`, every stage of a pipeline ends with the same total: each stage's own
    /// piece and every other stage's, once; a piece of a step this node is past, one that is
    /// not finite, or one already in is refused.
    #[test]
    fn every_stage_sums_every_piece_through_norms() {
        let stages = 4u32;
        let works = pipeline(stages);
        let at = |n: NodeId| (n.0 - 10) as usize;
        let mut norms: Vec<Norms> = (0..stages).map(|_| Norms::default()).collect();
        let mut net = Vec::new();
        for k in 0..stages as usize {
            let sq = (k + 1) as f64;
            net.extend(norms[k].mine(Some(&works[k]), NodeId(10 + k as u32), (1, 5), sq));
        }
        while let Some((to, env)) = net.pop() {
            let Envelope::GradNorm {
                epoch,
                step,
                part,
                sq,
            } = env
            else {
                panic!("{env:?}")
            };
            let k = at(to);
            let on = norms[k].theirs((Some(&works[k]), Some(5)), (epoch, step), part, sq);
            net.extend(on.expect("taken once"));
        }
        for (k, n) in norms.iter_mut().enumerate() {
            let me = NodeId(10 + k as u32);
            assert_eq!(
                n.total(Some(&works[k]), me, (1, 5)),
                Some(10.0),
                "stage {k}"
            );
            let w = (Some(&works[k]), Some(5));
            assert!(n.theirs(w, (1, 5), 0, 1.0).is_none(), "a part already in");
            assert!(
                n.theirs(w, (1, 4), 0, 1.0).is_none(),
                "a step this node is past"
            );
            assert!(n.theirs(w, (0, 6), 0, 1.0).is_none(), "an older epoch");
            assert!(n.theirs(w, (1, 6), 0, f64::NAN).is_none(), "not finite");
            n.forget_through(1, 5);
            assert_eq!(n.total(Some(&works[k]), me, (1, 5)), None, "forgotten");
        }
        // Holding the whole gradient, a node's own piece is the norm.
        let mut alone = Norms::default();
        assert!(alone.mine(None, NodeId(1), (1, 5), 2.5).is_empty());
        assert_eq!(alone.total(None, NodeId(1), (1, 5)), Some(2.5));
    }
}

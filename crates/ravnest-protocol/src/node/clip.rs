//! Where the pieces of a step's global gradient norm go under clipping, when no node holds the
//! whole gradient: a sharded owner tells the rest of its ring; a pipeline stage tells its
//! neighbours in its replica, who pass each piece on away from where it came, so that every
//! stage gets every piece once. The runtime's node sends and sums them
//! (`ravnest_runtime::node::clip`).

use ravnest_core::NodeId;

use crate::msg::Work;

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

    /// Pieces passed along a pipeline reach every stage exactly once: from each stage, a piece
    /// travels both ways to the ends and stops there.
    #[test]
    fn every_stage_gets_every_piece_once() {
        for stages in 1..7u32 {
            let works: Vec<Work> = (0..stages)
                .map(|s| Work {
                    stage: Some(stage(s, stages)),
                    ..work(vec![NodeId(10 + s)])
                })
                .collect();
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
}

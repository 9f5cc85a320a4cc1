//! A sharded data-parallel step's ring layout, and what each of its collectives returns.
//!
//! Every worker computes its batch through the whole model and hands its gradient over bucket
//! by bucket, as in data parallel. Each bucket is reduce-scattered over the ring with uneven
//! chunks: chunk c is the bucket's parameters that rank c - 1 owns (its part of the layers), so
//! the reduce-scatter leaves every owner the summed gradient of its own parameters. The owner
//! applies the optimizer to them (it alone holds their optimizer state), and an all-gather over
//! the same chunks brings every worker the updated parameters. Each link carries what a ring
//! all-reduce would.

use std::ops::Range;

use ravnest_core::NodeId;
use ravnest_core::collective::RingPart;
use ravnest_core::ring::RingMode;

use crate::msg::ShardWork;

/// The bucket id bit of a sharded step's all-gather (its reduce-scatter has the bucket's own
/// index).
pub const GATHER: u32 = 1 << 31;

/// A sharded step's chunks over the whole parameter vector.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardLayout {
    /// Chunk c is parameters `bounds[c]..bounds[c + 1]`.
    pub bounds: Vec<usize>,
    /// This node's parameters (its chunk).
    pub owned: Range<usize>,
}

impl ShardLayout {
    /// The chunks of `sw` for node `me` of `ring`, each part's parameters given by
    /// `param_range`; an error says why the parts do not make a ring's chunks.
    pub fn new(
        sw: &ShardWork,
        ring: &[NodeId],
        me: NodeId,
        params: usize,
        param_range: impl Fn(ravnest_core::LayerRange) -> Range<usize>,
    ) -> Result<ShardLayout, String> {
        let n = ring.len();
        let rank = ring
            .iter()
            .position(|&r| r == me)
            .ok_or("this node is not in its sharded ring")?;
        if sw.parts.len() != n || sw.parts[rank] != sw.owned {
            return Err(format!(
                "malformed sharded work: {} parts for a ring of {n}, this node's part {} at rank {rank}",
                sw.parts.len(),
                sw.owned
            ));
        }
        let mut bounds = vec![0];
        for c in 0..n {
            let r = param_range(sw.parts[(c + n - 1) % n]);
            if r.start != *bounds.last().expect("one bound") || r.end < r.start {
                return Err(format!(
                    "the sharded parts do not tile the parameters in ring order at part {} \
                     (parameters {r:?})",
                    sw.parts[(c + n - 1) % n]
                ));
            }
            bounds.push(r.end);
        }
        if bounds[n] != params {
            return Err(format!(
                "the sharded parts cover {} of {params} parameters",
                bounds[n]
            ));
        }
        let owned = bounds[(rank + 1) % n]..bounds[(rank + 1) % n + 1];
        Ok(ShardLayout { bounds, owned })
    }

    /// The ring part that runs `mode` over `bucket`'s parameters: the chunks cut at the
    /// bucket's own bounds.
    pub fn part(&self, bucket: &Range<usize>, mode: RingMode) -> RingPart {
        RingPart {
            mode,
            bounds: self
                .bounds
                .iter()
                .map(|&b| b.clamp(bucket.start, bucket.end) - bucket.start)
                .collect(),
        }
    }

    /// [`ShardLayout::mine`] counted from the bucket's start: where this node's part sits in
    /// the bucket's values.
    pub fn mine_in(&self, bucket: &Range<usize>) -> Range<usize> {
        let mine = self.mine(bucket);
        mine.start - bucket.start..mine.end - bucket.start
    }

    /// The parameters of `bucket` this node owns (an empty range at the bucket's end when
    /// none).
    pub fn mine(&self, bucket: &Range<usize>) -> Range<usize> {
        let (lo, hi) = (
            self.owned.start.max(bucket.start),
            self.owned.end.min(bucket.end),
        );
        if lo < hi {
            lo..hi
        } else {
            bucket.end..bucket.end
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ravnest_core::LayerRange;

    /// Layers of 10, 20, 30 and 40 parameters.
    fn params_of(l: LayerRange) -> Range<usize> {
        let before = |k: u32| (0..k).map(|i| 10 * (i as usize + 1)).sum::<usize>();
        before(l.range().start as u32)..before(l.range().end as u32)
    }

    #[test]
    fn chunks_follow_the_ring_order_of_the_parts() {
        // Parts in layer order: a = 0..1, b = 1..3, c = 3..4; the ring is [b, c, a].
        let (a, b, c) = (NodeId(0), NodeId(1), NodeId(2));
        let parts = vec![
            LayerRange::new(1, 3),
            LayerRange::new(3, 4),
            LayerRange::new(0, 1),
        ];
        let ring = [b, c, a];
        let sw = |owned| ShardWork {
            owned,
            parts: parts.clone(),
            fetch: Vec::new(),
        };
        let lb = ShardLayout::new(&sw(parts[0]), &ring, b, 100, params_of).unwrap();
        assert_eq!(lb.bounds, vec![0, 10, 60, 100]);
        assert_eq!(lb.owned, 10..60);
        let la = ShardLayout::new(&sw(parts[2]), &ring, a, 100, params_of).unwrap();
        assert_eq!(la.owned, 0..10);
        // A bucket of parameters 50..100 (layers 2 and 3): b owns 50..60, c 60..100, a none.
        let bucket = 50..100;
        assert_eq!(
            lb.part(&bucket, RingMode::ReduceScatter).bounds,
            vec![0, 0, 10, 50]
        );
        assert_eq!(lb.mine(&bucket), 50..60);
        assert_eq!(la.mine(&bucket), 100..100);
        // A ring whose order does not follow the parts is refused, as is a foreign node.
        let wrong = [a, b, c];
        assert!(ShardLayout::new(&sw(parts[2]), &wrong, a, 100, params_of).is_err());
        assert!(ShardLayout::new(&sw(parts[0]), &ring, NodeId(9), 100, params_of).is_err());
        assert!(ShardLayout::new(&sw(parts[0]), &ring, b, 99, params_of).is_err());
    }
}

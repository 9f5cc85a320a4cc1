//! Layer ranges: the contiguous layers a pipeline stage holds, a shard covers or a message
//! carries. One type from the planner to the checkpoint file. On the wire it is two `u32`s,
//! `start` then `end` (the same bytes as a `(u32, u32)` tuple).

use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

/// A contiguous range of a model's layers, `start..end` (end exclusive).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct LayerRange {
    /// The first layer.
    pub start: u32,
    /// One past the last layer.
    pub end: u32,
}

impl LayerRange {
    /// Layers `start..end`.
    pub const fn new(start: u32, end: u32) -> Self {
        LayerRange { start, end }
    }

    /// The layers of stage `k` of a split with boundaries `bounds`: `bounds[k]..bounds[k + 1]`.
    pub fn of_stage(bounds: &[usize], k: usize) -> Self {
        LayerRange::from(bounds[k]..bounds[k + 1])
    }

    /// The layers as indices.
    pub fn range(self) -> Range<usize> {
        self.start as usize..self.end as usize
    }

    /// The layers, in order.
    pub fn iter(self) -> Range<u32> {
        self.start..self.end
    }

    /// Number of layers.
    pub fn len(self) -> usize {
        self.range().len()
    }

    /// Whether it holds no layer.
    pub fn is_empty(self) -> bool {
        self.start >= self.end
    }

    /// Whether layer `layer` is in the range.
    pub fn contains(self, layer: u32) -> bool {
        self.start <= layer && layer < self.end
    }
}

impl From<Range<usize>> for LayerRange {
    /// Layer indices (a model has far fewer than 2³² layers).
    fn from(r: Range<usize>) -> Self {
        LayerRange::new(r.start as u32, r.end as u32)
    }
}

/// `start..end`, as a `Range` prints.
impl fmt::Display for LayerRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prints_and_orders_like_a_range_and_a_tuple() {
        let r = LayerRange::new(3, 7);
        assert_eq!(r.to_string(), "3..7");
        assert_eq!(r.to_string(), format!("{:?}", 3..7));
        assert_eq!(r.range(), 3..7);
        assert_eq!((r.len(), r.is_empty()), (4, false));
        assert!(r.contains(3) && r.contains(6) && !r.contains(7) && !r.contains(2));
        assert!(LayerRange::new(5, 5).is_empty());
        assert_eq!(LayerRange::from(3..7), r);
        assert_eq!(LayerRange::of_stage(&[0, 3, 7, 9], 1), r);
        // A plan's JSON shows it as it showed the `Range` it replaced.
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(json, serde_json::to_string(&(3usize..7)).unwrap());
        // Ordered as the (start, end) pair it replaced.
        let mut v = [(2, 9), (1, 4), (2, 3)].map(|(a, b)| LayerRange::new(a, b));
        v.sort();
        assert_eq!(v.map(|r| (r.start, r.end)), [(1, 4), (2, 3), (2, 9)]);
    }
}

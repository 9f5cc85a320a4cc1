//! A sharded step's results as they come back ([`crate::node::shard`] says how the ring's
//! chunks fall): each owner updates its part from its reduce-scatter and starts the
//! all-gather that brings the others its updated values; an all-gather's values go around the
//! owner's part.

use std::ops::Range;

use ravnest_core::collective::CollId;
use ravnest_core::ring::RingMode;

use super::{Machine, Running};
use crate::node::shard::ShardLayout;
use crate::node::values::Values;

/// A sharded step's all-gather of bucket `target` came back: the other owners' updated
/// parameters, around this node's part, go into the version being made.
pub(super) fn gathered<V: Values>(
    values: &V,
    r: &mut Running<V::Model>,
    target: &Range<usize>,
    sum: Vec<f32>,
) -> Result<(), String> {
    let Some(layout) = r.shard.clone() else {
        return Err("an all-gather of a step that is not sharded".into());
    };
    let mine = layout.mine(target);
    let local = |x: &Range<usize>| x.start - target.start..x.end - target.start;
    let (before, after) = (target.start..mine.start, mine.end..target.end);
    let set = |m: &mut V::Model, x: &Range<usize>| match x.is_empty() {
        true => Ok(()),
        false => values.set_params(m, x.clone(), &sum[local(x)]),
    };
    let result = set(&mut r.next, &before).and_then(|()| set(&mut r.next, &after));
    values.recycle(sum);
    result.map_err(|e| e.to_string())
}

/// Apply the optimizer to this node's part of bucket `target` from the reduced `sum`, and
/// write the updated values where the sum of that part was: what the all-gather carries.
pub(super) fn update_owned<V: Values>(
    values: &V,
    next: &mut V::Model,
    target: &Range<usize>,
    mut sum: Vec<f32>,
    layout: &ShardLayout,
) -> Result<Vec<f32>, String> {
    let mine = layout.mine(target);
    if mine.is_empty() {
        return Ok(sum);
    }
    let local = layout.mine_in(target);
    values
        .apply_update(next, mine.clone(), &sum[local.clone()])
        .map_err(|e| e.to_string())?;
    let w = values
        .export_range(next, None, mine.clone())
        .ok_or_else(|| format!("parameters {mine:?} could not be read back"))?;
    sum[local].copy_from_slice(&w);
    Ok(sum)
}

impl<V: Values> Machine<V> {
    /// Start the all-gather of bucket `id` (its reduce-scatter's id): `values` hold this
    /// node's updated part.
    pub(super) fn start_gather(
        &mut self,
        id: CollId,
        target: &Range<usize>,
        values: Vec<f32>,
        layout: &ShardLayout,
    ) {
        let gather_id = CollId {
            bucket: id.bucket | crate::node::shard::GATHER,
            ..id
        };
        let part = layout.part(target, RingMode::AllGather);
        let virtual_bytes =
            self.sizes.grad_bytes * target.len() as u64 / self.values.params().max(1) as u64;
        self.collective(gather_id, values, virtual_bytes, Some(part));
    }
}

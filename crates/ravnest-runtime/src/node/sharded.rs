//! A sharded step's collectives as they come back ([`ravnest_protocol::node::shard`] says how the ring's
//! chunks fall): each owner updates its part from its reduce-scatter and starts the
//! all-gather that brings the others its updated values.

use std::ops::Range;

use ravnest_core::collective::CollId;
use ravnest_core::ring::RingMode;

use super::NodeActor;
use super::state::NodeState;
use crate::seams::{Compute, Transport};
use ravnest_protocol::node::shard::{GATHER, ShardLayout};

/// A node's state, as this backend's node holds it.
type State<C> = NodeState<<C as Compute>::Model, <C as Compute>::StageGrad>;

impl<T: Transport, C: Compute> NodeActor<T, C> {
    /// A sharded step's collective of bucket `id` came back: a reduce-scatter gave this node
    /// the summed gradient of the bucket's parameters it owns, which it updates (it alone holds
    /// their optimizer state) and starts the all-gather of the updated values; an all-gather
    /// brought the other owners' updated parameters. Clipped, the reduce-scatters' results wait
    /// for each other and for the other owners' pieces of the norm ([`super::clip`]).
    pub(super) async fn on_shard_outcome(
        &self,
        st: &mut State<C>,
        id: CollId,
        sum: Vec<f32>,
        layout: &ShardLayout,
    ) {
        let gather = id.bucket & GATHER != 0;
        let k = id.bucket & !GATHER;
        let Some(r) = st.running.as_mut() else { return };
        let Some(target) = r.targets.get(k as usize).cloned() else {
            return;
        };
        if sum.len() != target.len() {
            st.running = None;
            let reason = format!(
                "the collective of step {} bucket {k} gave {} values for {}",
                id.step,
                sum.len(),
                target.len()
            );
            return self.fail(id.epoch, reason);
        }
        let done = if gather {
            let mine = layout.mine(&target);
            let local = |x: &Range<usize>| x.start - target.start..x.end - target.start;
            let (before, after) = (target.start..mine.start, mine.end..target.end);
            let set = |m: &mut C::Model, x: &Range<usize>| match x.is_empty() {
                true => Ok(()),
                false => self.compute.set_params(m, x.clone(), &sum[local(x)]),
            };
            let result = set(&mut r.next, &before).and_then(|()| set(&mut r.next, &after));
            self.compute.recycle(sum);
            result.map_err(|e| e.to_string())
        } else {
            if r.pending == 2 * r.targets.len() {
                // The only holder of its part makes the next version from this one in place of
                // it (a lost peer's part comes back from the checkpoint, not from a version
                // here): what only version `step` held is updated where it is.
                if st.core.versions().keeps_one() {
                    drop(st.core.take(r.step));
                }
                for old in st.core.doomed_by(r.step + 1, true) {
                    self.compute.retire(old);
                }
            }
            let Some(r) = st.running.as_mut() else { return };
            if self.compute.max_grad_norm().is_some() {
                r.held.push((k, sum));
                r.pending = r.pending.saturating_sub(1);
                return self.clip_held(st).await;
            }
            self.update_owned(&mut r.next, &target, sum, layout)
                .map(|values| self.start_gather(st, id, &target, values, layout))
        };
        if let Err(reason) = done {
            st.running = None;
            return self.fail(id.epoch, reason);
        }
        if let Some(r) = st.running.as_mut() {
            r.pending = r.pending.saturating_sub(1);
        }
        self.try_finish(st).await;
    }

    /// Apply the optimizer to this node's part of bucket `target` from the reduced `sum`, and
    /// write the updated values where the sum of that part was: what the all-gather carries.
    pub(super) fn update_owned(
        &self,
        next: &mut C::Model,
        target: &Range<usize>,
        mut sum: Vec<f32>,
        layout: &ShardLayout,
    ) -> Result<Vec<f32>, String> {
        let mine = layout.mine(target);
        if mine.is_empty() {
            return Ok(sum);
        }
        let local = layout.mine_in(target);
        self.compute
            .apply_update(next, mine.clone(), &sum[local.clone()])
            .map_err(|e| e.to_string())?;
        let w = self
            .compute
            .export_range(next, None, mine.clone())
            .ok_or_else(|| format!("parameters {mine:?} could not be read back"))?;
        sum[local].copy_from_slice(&w);
        Ok(sum)
    }

    /// Start the all-gather of bucket `id` (its reduce-scatter's id): `values` hold this
    /// node's updated part.
    pub(super) fn start_gather(
        &self,
        st: &State<C>,
        id: CollId,
        target: &Range<usize>,
        values: Vec<f32>,
        layout: &ShardLayout,
    ) {
        let gather_id = CollId {
            bucket: id.bucket | GATHER,
            ..id
        };
        let part = layout.part(target, RingMode::AllGather);
        let virtual_bytes =
            self.grad_bytes * target.len() as u64 / self.compute.params().max(1) as u64;
        if let Some((_, group)) = st.group.clone() {
            self.start_collective(st, gather_id, group, values, virtual_bytes, Some(part));
        }
    }
}

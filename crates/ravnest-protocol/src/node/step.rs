//! A step's collectives as a node counts them while they run: which bucket's result goes to
//! which parameters, how many results are still to come (one per bucket; two sharded, the
//! reduce-scatter and then the all-gather), whether a result is the step's first (nothing of it
//! applied yet: the versions that the step's version makes void may be let go), and, under
//! gradient clipping, the reduced buckets held until the norm over all of them is known.
//!
//! The driver (the runtime's node) applies each result to the version being made and tells
//! [`Collect`] so; the step is done when [`Collect::settled`] and its compute ended. No clock,
//! no I/O, no model: the values held are plain gradients.

use std::ops::Range;

use ravnest_core::LayerRange;
use ravnest_core::collective::CollId;

use super::shard::GATHER;
use crate::msg::StepMode;

/// What a collective's result is, for the step it came back to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Arrival {
    /// Bucket `bucket`'s reduced values (a gradient's sum, a sharded reduce-scatter's, or an
    /// averaging round's), for the parameters `target`; `first`: nothing of this step came
    /// back before it.
    Reduced {
        /// The bucket.
        bucket: u32,
        /// Its parameters in the flat model.
        target: Range<usize>,
        /// The step's first result.
        first: bool,
    },
    /// A sharded step's all-gather of bucket `bucket`: the other owners' updated values.
    Gathered {
        /// The bucket.
        bucket: u32,
        /// Its parameters in the flat model.
        target: Range<usize>,
    },
}

/// The collectives of step `step` of `epoch` in flight.
#[derive(Debug)]
pub struct Collect {
    /// The epoch.
    pub epoch: u64,
    /// The step.
    pub step: u64,
    /// How the step is synchronized.
    pub mode: StepMode,
    /// The layers its version holds (`None`: the whole model).
    pub layers: Option<LayerRange>,
    /// Where bucket `k`'s result goes: `targets[k]`, a parameter range (an averaged model's
    /// exported values: the whole export).
    targets: Vec<Range<usize>>,
    /// Results per bucket: 1, or 2 sharded.
    per_bucket: usize,
    /// Results still to come.
    pending: usize,
    /// Clipped: reduced buckets held until the norm is known: (bucket, values).
    held: Vec<(u32, Vec<f32>)>,
}

impl Collect {
    /// Step `step`'s collectives, one per target (two, `sharded`: a reduce-scatter, then an
    /// all-gather).
    pub fn new(
        (epoch, step): (u64, u64),
        mode: StepMode,
        layers: Option<LayerRange>,
        targets: Vec<Range<usize>>,
        sharded: bool,
    ) -> Self {
        let per_bucket = if sharded { 2 } else { 1 };
        Collect {
            epoch,
            step,
            mode,
            layers,
            pending: targets.len() * per_bucket,
            targets,
            per_bucket,
            held: Vec::new(),
        }
    }

    /// Step `step` waits for `n` results that are not its buckets' (a merge step waits for its
    /// overlapped round's sum, which comes to the round, not to the step).
    pub fn waiting(
        (epoch, step): (u64, u64),
        mode: StepMode,
        layers: Option<LayerRange>,
        n: usize,
    ) -> Self {
        Collect {
            pending: n,
            ..Collect::new((epoch, step), mode, layers, Vec::new(), false)
        }
    }

    /// Whether collective `id` belongs to this step.
    pub fn owns(&self, id: CollId) -> bool {
        id.epoch == self.epoch && id.step == self.step
    }

    /// `len` values came back for collective `id` of this step: what they are. `None`: not one
    /// of its buckets (ignored); `Err`: they do not fit their bucket.
    pub fn arrived(&self, id: CollId, len: usize) -> Result<Option<Arrival>, String> {
        let gather = self.per_bucket == 2 && id.bucket & GATHER != 0;
        let bucket = if self.per_bucket == 2 {
            id.bucket & !GATHER
        } else {
            id.bucket
        };
        let Some(target) = self.targets.get(bucket as usize).cloned() else {
            return Ok(None);
        };
        if len != target.len() {
            return Err(format!(
                "the collective of step {} bucket {bucket} gave {len} values for {}",
                id.step,
                target.len()
            ));
        }
        Ok(Some(if gather {
            Arrival::Gathered { bucket, target }
        } else {
            let first = self.pending == self.targets.len() * self.per_bucket;
            Arrival::Reduced {
                bucket,
                target,
                first,
            }
        }))
    }

    /// One result was applied.
    pub fn landed(&mut self) {
        self.pending = self.pending.saturating_sub(1);
    }

    /// A reduced bucket waits for the norm.
    pub fn hold(&mut self, bucket: u32, values: Vec<f32>) {
        self.held.push((bucket, values));
        self.landed();
    }

    /// The buckets held, with their targets.
    pub fn held(&self) -> impl Iterator<Item = (&Range<usize>, &[f32])> {
        self.held
            .iter()
            .filter_map(|(k, v)| Some((self.targets.get(*k as usize)?, v.as_slice())))
    }

    /// Whether every bucket is held: the norm over all of them can be taken.
    pub fn all_held(&self) -> bool {
        !self.held.is_empty() && self.held.len() >= self.targets.len()
    }

    /// The held buckets, to clip and apply: (bucket, target, values).
    pub fn take_held(&mut self) -> Vec<(u32, Range<usize>, Vec<f32>)> {
        std::mem::take(&mut self.held)
            .into_iter()
            .filter_map(|(k, v)| Some((k, self.targets.get(k as usize)?.clone(), v)))
            .collect()
    }

    /// Whether nothing is left to come or to apply (the step is done once its compute ended
    /// too).
    pub fn settled(&self) -> bool {
        self.pending == 0 && self.held.is_empty()
    }
}

#[cfg(test)]
mod tests;

//! What a backend does with the values of a model version, without waiting for anything: read
//! them out and in, apply an optimizer update, narrow a version to some layers, digest it. The
//! node's step ([`super::machine`]) drives a backend through this trait; the runtime's `Compute`
//! seam adds what takes time (a step's forward and backward, a stage's passes, a calibration).
//!
//! A [`Values::Model`] is one version of what a node holds (the layers of its stage, or the whole
//! model), parameters and optimizer state in the backend's own form (candle tensors on the
//! node's device; the simulator's host vector), an opaque handle here. An update makes new values
//! in the version it is applied to, and leaves every other version as it was.

use std::ops::Range;

use ravnest_core::LayerRange;

/// What a backend without pipeline support cannot do.
pub const NO_STAGES: &str = "run pipeline stages";

/// Why a compute backend could not do what it was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ComputeError {
    /// The backend cannot do this at all.
    #[error("this compute backend does not {0}")]
    Unsupported(&'static str),
    /// The inputs do not fit the model (a malformed assignment or message).
    #[error("{0}")]
    Shape(String),
    /// The backend failed (candle's own error, in words).
    #[error("{0}")]
    Backend(String),
}

/// How a backend reads, writes and updates the values of a model version ([`Values::Model`]).
pub trait Values {
    /// One version of what a node holds. Cloning it is cheap (it shares the values).
    type Model: Clone + Send + Sync + std::fmt::Debug + 'static;
    /// A pipeline stage's parameter gradient, summed over the micro-batches of a step, kept
    /// where the backend computes until the step's synchronization asks for it.
    type StageGrad: Send + Sync + std::fmt::Debug + 'static;

    /// Values of the whole model in its flat form (parameters, then optimizer state): the
    /// order of the wire and of checkpoints.
    fn model_len(&self) -> usize;

    /// Parameters of the whole model (a gradient has this many; they come first in the flat
    /// form).
    fn params(&self) -> usize;

    /// The model a run starts from (the same on every node: seeded, or the checkpoint a
    /// resumed run starts from), holding `layers` (`None`: all of them). A backend may make
    /// the values where they are first used, so that a stage never builds the layers it does
    /// not run.
    fn initial(&self, layers: Option<LayerRange>) -> Self::Model;

    /// The version [`Values::initial`] is (a resumed run starts from a checkpoint).
    fn initial_version(&self) -> u64 {
        0
    }

    /// `model` keeping only `layers` (a stage drops what it no longer runs). A backend that
    /// holds its model whole may return it as it is.
    fn retain(&self, model: &Self::Model, _layers: LayerRange) -> Self::Model {
        model.clone()
    }

    /// The values of `layers` (`None`: the whole model) in the flat order of
    /// [`Values::layer_slots`], for what must travel; `None` when `model` does not hold them.
    fn export(&self, model: &Self::Model, layers: Option<LayerRange>) -> Option<Vec<f32>>;

    /// Values `range` of what [`Values::export`] gives for `layers` (one part of a shard that
    /// travels in parts): only that part is made in host memory. `None` when `model` does not
    /// hold `layers` or `range` is outside them.
    fn export_range(
        &self,
        model: &Self::Model,
        layers: Option<LayerRange>,
        range: Range<usize>,
    ) -> Option<Vec<f32>> {
        self.export(model, layers)?.get(range).map(<[f32]>::to_vec)
    }

    /// `base` (or nothing) with `layers` (`None`: the whole model) set from `values`, as
    /// [`Values::export`] made them.
    fn import(
        &self,
        base: Option<&Self::Model>,
        layers: Option<LayerRange>,
        values: Vec<f32>,
    ) -> Result<Self::Model, ComputeError>;

    /// The digest ([`crate::digest::digest`]) of what [`Values::export`] gives for `layers`,
    /// computed where the values are (0 when `model` does not hold them). Replicas compare it
    /// after every synchronized step.
    fn digest(&self, model: &Self::Model, layers: Option<LayerRange>) -> u64 {
        self.export(model, layers)
            .map_or(0, |v| crate::digest::digest(&v))
    }

    /// The buckets a gradient is produced in: disjoint ranges of the parameters covering them,
    /// in the order the runtime's `Compute::gradient_sum` finishes them (the last layers first, as
    /// backward runs), so each can be reduced while the rest is still being computed.
    fn buckets(&self) -> Vec<Range<usize>> {
        std::iter::once(0..self.params()).collect()
    }

    /// Sharded data parallel: `model` keeping the optimizer state of `owned` only, every
    /// parameter still held. A backend that holds its model whole may return it as it is.
    fn shard(&self, model: &Self::Model, _owned: LayerRange) -> Self::Model {
        model.clone()
    }

    /// Set parameters `range` (whole tensors) of `model` from `values`: what an all-gather
    /// of a sharded step brought from the part's owner.
    fn set_params(
        &self,
        _model: &mut Self::Model,
        _range: Range<usize>,
        _values: &[f32],
    ) -> Result<(), ComputeError> {
        Err(ComputeError::Unsupported(
            "set parameters (sharded data parallel)",
        ))
    }

    /// Apply the optimizer to parameters `range` of `model` (and their optimizer state) with
    /// the averaged gradient of those parameters. A step's update is applied bucket by bucket,
    /// then [`Values::end_update`] once.
    fn apply_update(
        &self,
        model: &mut Self::Model,
        range: Range<usize>,
        mean_gradient: &[f32],
    ) -> Result<(), ComputeError>;

    /// Called once after every part of a step's update was applied (an optimizer's step
    /// counter advances here).
    fn end_update(&self, _model: &mut Self::Model) {}

    /// A version no one will roll back to any more, handed back at the first update of the
    /// step that makes the next: a backend may write that step's update into its buffers.
    fn retire(&self, _old: Self::Model) {}

    /// A gradient bucket's buffer, done with: a backend may reuse it for the next step's
    /// buckets (memory it already has mapped, allocated and freed on its own thread).
    fn recycle(&self, _buffer: Vec<f32>) {}

    /// Where `layers`' parameters sit in the flat model. A backend that does not split its
    /// model by layer holds it as one range.
    fn param_range(&self, _layers: LayerRange) -> Range<usize> {
        0..self.params()
    }

    /// Every part of the flat model that belongs to `layers`: their parameters
    /// ([`Values::param_range`]) first, then their optimizer state where it sits apart. What
    /// a stage holds, fetches, hands over and writes into a checkpoint shard.
    fn layer_slots(&self, layers: LayerRange) -> Vec<Range<usize>> {
        std::iter::once(self.param_range(layers)).collect()
    }

    /// Clip the global norm of each step's averaged gradient to this (`[run] max_grad_norm`):
    /// a data-parallel node then holds a step's reduced buckets until all are in, and scales
    /// them by `min(1, max / (norm + 1e-6))` before applying any, as
    /// `torch.nn.utils.clip_grad_norm_` does after DDP's averaging; under local SGD, each
    /// node's own gradient. `None`: no clipping.
    fn max_grad_norm(&self) -> Option<f32> {
        None
    }

    /// A stage's gradient times `scale`, as host values in the order of the stage's
    /// parameters ([`Values::param_range`]): what its sync group all-reduces.
    fn stage_grad_values(&self, _grad: Self::StageGrad, _scale: f32) -> Vec<f32> {
        Vec::new()
    }

    /// Apply a stage's own gradient times `scale` to `layers` of `model` (a sync group of one,
    /// or a local step: nothing travels), then end the update.
    fn apply_stage_grad(
        &self,
        _model: &mut Self::Model,
        _layers: LayerRange,
        _grad: Self::StageGrad,
        _scale: f32,
    ) -> Result<(), ComputeError> {
        Err(ComputeError::Unsupported(NO_STAGES))
    }
}

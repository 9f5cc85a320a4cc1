//! The two seams: how envelopes travel ([`Transport`]) and how a training step is computed
//! ([`Compute`]). The simulator and the real runtime each implement both.

use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;

use ravnest_core::{LayerRange, NodeId};

use ravnest_protocol::msg::{Addr, Envelope};
use ravnest_protocol::node::stage::Pass;

/// Where a transport hands an arriving envelope: (sender, envelope).
pub type Inbox = Arc<dyn Fn(Addr, Envelope) + Send + Sync>;

/// An inbox that casts every arriving envelope into `actor`'s mailbox as `wrap(from, env)`.
/// If the actor is gone (crashed), the envelope is lost, as on a network.
pub fn mailbox<M: ractor::Message>(
    actor: ractor::ActorRef<M>,
    wrap: fn(Addr, Envelope) -> M,
) -> Inbox {
    Arc::new(move |from, env| {
        let _ = actor.cast(wrap(from, env));
    })
}

/// Errors a sender sees at once. Loss in flight is silent (as on a real network); the failure
/// detector notices it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// No such address in this cluster.
    #[error("unknown address {0:?}")]
    Unknown(Addr),
    /// The sending node is down (crashed) and cannot send.
    #[error("{0:?} is down")]
    SenderDown(Addr),
}

/// What [`Transport::progress`] gives: a wait, armed, that a sender awaits with its own
/// deadline.
pub type Progress<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

/// Message-level transport: per-link FIFO delivery of typed envelopes.
pub trait Transport: Clone + Send + Sync + 'static {
    /// Deliver envelopes for `addr` to `inbox` from now on (a restarted node registers again).
    fn register(&self, addr: Addr, inbox: Inbox);
    /// Send `env` from `from` to `to`. Ordered per (from, to); may be lost if `to` is down or
    /// unreachable.
    fn send(&self, from: Addr, to: Addr, env: Envelope) -> Result<(), TransportError>;
    /// Fail-over: the coordinator (and the checkpoint aggregator) are hosted by `host` from now
    /// on; envelopes to [`Addr::Coordinator`] go there. A transport that hosts it in one fixed
    /// place (a test's) may ignore this.
    fn set_coordinator(&self, _host: ravnest_core::NodeId) {}
    /// This transport as the process of `node` uses it (its node actor, or the coordinator it
    /// hosts): where that process believes the coordinator is, and where its coordinator's
    /// envelopes leave from. A transport that is one process's already (TCP) is itself.
    fn at(&self, _node: ravnest_core::NodeId) -> Self
    where
        Self: Sized,
    {
        self.clone()
    }
    /// Envelopes from `from` to `to`'s host not yet delivered there (queued, or written and
    /// not acknowledged): what a sender of many large parts paces itself on. A transport that
    /// delivers at once says 0.
    fn in_flight(&self, _from: Addr, _to: Addr) -> usize {
        0
    }
    /// The checkpoint actor here has stored (or refused) a shard part it was handed: the
    /// transport's count of parts waiting ([`Transport::in_flight`]) goes down.
    fn stored(&self) {}
    /// A wait that ends when [`Transport::in_flight`] from `from` to `to` may have gone down
    /// (a peer acknowledged frames, a part was stored here), armed when made: take it, then
    /// read `in_flight`, then await it, and no change between the two is missed. `None`: this
    /// transport has no such signal (its `in_flight` is 0, so no sender waits on it).
    fn progress(&self, _from: Addr, _to: Addr) -> Option<Progress<'_>> {
        None
    }
}

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

/// What a node's calibration measures ([`Compute::probe`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Probe {
    /// A whole training step of the model.
    Whole,
    /// The model does not fit this node whole: the forward and backward of `layers` (`share`
    /// of the model's training work), in micro-batches of `micro` samples, stand for a step.
    Layers {
        /// The layers run.
        layers: LayerRange,
        /// Their share of the model's training FLOPs.
        share: f64,
        /// Samples per micro-batch.
        micro: u64,
        /// Values per sample of their input (0: the samples themselves).
        input: usize,
    },
}

/// Model state a backend holds and copies, counted as it happens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateStats {
    /// Bytes of parameters, gradients and optimizer state alive now (values shared by several
    /// versions counted once).
    pub held_bytes: u64,
    /// The most bytes alive at once.
    pub peak_bytes: u64,
    /// Bytes of model state copied by step work (computing, applying updates, digests); what
    /// travels (exports, imports) is not counted here.
    pub copied_bytes: u64,
}

/// Where a backend's training steps spent their time, in ns counted since training started on
/// the node (calibration left out): what the report's per-phase profile is made of.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PhaseNs {
    /// The forward passes.
    pub forward_ns: u64,
    /// The backward passes (the rest of the compute).
    pub backward_ns: u64,
    /// The emulated slowdown's waits (`emulate_slowdown`).
    pub slowdown_ns: u64,
    /// The optimizer: applying the reduced gradients to the parameters.
    pub optimizer_ns: u64,
}

/// Where a backend hands each finished bucket of a step's gradient sum: (bucket index, values).
/// Owned, so that a backend may run its compute on a thread of its own.
pub type BucketSink = Arc<dyn Fn(usize, Vec<f32>) + Send + Sync>;

/// One micro-batch's pass through a pipeline stage's layers, as the node hands it to the
/// compute ([`Compute::stage_forward`], [`Compute::stage_backward`]).
#[derive(Debug, Clone)]
pub struct StagePass<'a> {
    /// The node computing it.
    pub node: NodeId,
    /// The step.
    pub step: u64,
    /// The micro-batch's global samples.
    pub samples: Range<u64>,
    /// The stage's layers.
    pub layers: LayerRange,
    /// The previous stage's output (`None` on the first stage, which reads the samples).
    pub input: Option<&'a [f32]>,
    /// A backward's: the forward's output (empty for a forward).
    pub output: &'a [f32],
    /// A backward's: the gradient of the output from the next stage (`None` on the last
    /// stage, from the loss; and for a forward).
    pub grad_out: Option<&'a [f32]>,
}

impl<'a> StagePass<'a> {
    /// `pass` of step `step`'s schedule on `layers` of node `node`.
    pub fn of(node: NodeId, step: u64, layers: LayerRange, pass: &'a Pass) -> Self {
        let (input, output, grad_out) = match pass {
            Pass::Forward { input, .. } => (input, &[][..], None),
            Pass::Backward {
                input,
                output,
                grad,
                ..
            } => (input, &output[..], grad.as_deref()),
        };
        StagePass {
            node,
            step,
            samples: pass.samples(),
            layers,
            input: input.as_deref(),
            output,
            grad_out,
        }
    }
}

/// How a node computes one training step and applies an update, and what it holds.
///
/// The backend owns the model state: a [`Compute::Model`] is one version of what a node holds
/// (the layers of its stage, or the whole model), parameters and optimizer state in the
/// backend's own form (candle tensors on the node's device; the simulator's host vector). The
/// runtime keeps versions as opaque handles and never copies one: an update makes new values
/// in the version it is applied to, and leaves every other version as it was. What crosses to
/// host memory is only what travels: gradient buckets for the all-reduce, and layers that
/// move ([`Compute::export`] / [`Compute::import`]: a fetch, a checkpoint shard, an average).
pub trait Compute: Send + Sync + 'static {
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

    /// The version [`Compute::initial`] is (a resumed run starts from a checkpoint).
    fn initial_version(&self) -> u64 {
        0
    }

    /// `model` keeping only `layers` (a stage drops what it no longer runs). A backend that
    /// holds its model whole may return it as it is.
    fn retain(&self, model: &Self::Model, _layers: LayerRange) -> Self::Model {
        model.clone()
    }

    /// The values of `layers` (`None`: the whole model) in the flat order of
    /// [`Compute::layer_slots`], for what must travel; `None` when `model` does not hold them.
    fn export(&self, model: &Self::Model, layers: Option<LayerRange>) -> Option<Vec<f32>>;

    /// Values `range` of what [`Compute::export`] gives for `layers` (one part of a shard that
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
    /// [`Compute::export`] made them.
    fn import(
        &self,
        base: Option<&Self::Model>,
        layers: Option<LayerRange>,
        values: Vec<f32>,
    ) -> Result<Self::Model, ComputeError>;

    /// The digest ([`ravnest_protocol::digest::digest`]) of what [`Compute::export`] gives for `layers`,
    /// computed where the values are (0 when `model` does not hold them). Replicas compare it
    /// after every synchronized step.
    fn digest(&self, model: &Self::Model, layers: Option<LayerRange>) -> u64 {
        self.export(model, layers)
            .map_or(0, |v| ravnest_protocol::digest::digest(&v))
    }

    /// The buckets a gradient is produced in: disjoint ranges of the parameters covering them,
    /// in the order [`Compute::gradient_sum`] finishes them (the last layers first, as
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
    /// then [`Compute::end_update`] once.
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

    /// Forward and backward over the global sample indices `samples` of `step` with `model`.
    /// Hands the *sum* over those samples of the per-sample gradient to `ready`, bucket by
    /// bucket, in the order of [`Compute::buckets`], each as soon as it is known.
    fn gradient_sum(
        &self,
        node: NodeId,
        step: u64,
        samples: Range<u64>,
        model: Self::Model,
        ready: BucketSink,
    ) -> impl Future<Output = Result<(), ComputeError>> + Send;

    /// Where `layers`' parameters sit in the flat model. A backend that does not split its
    /// model by layer holds it as one range.
    fn param_range(&self, _layers: LayerRange) -> Range<usize> {
        0..self.params()
    }

    /// Every part of the flat model that belongs to `layers`: their parameters
    /// ([`Compute::param_range`]) first, then their optimizer state where it sits apart. What
    /// a stage holds, fetches, hands over and writes into a checkpoint shard.
    fn layer_slots(&self, layers: LayerRange) -> Vec<Range<usize>> {
        std::iter::once(self.param_range(layers)).collect()
    }

    /// What this backend's model state costs the nodes it serves, counted.
    fn state_stats(&self) -> StateStats {
        StateStats::default()
    }

    /// Where its training steps spent their time so far (zeros: not counted).
    fn phase_ns(&self) -> PhaseNs {
        PhaseNs::default()
    }

    /// What a calibration step is on this node ([`Probe`]): the whole model's step, or for a
    /// model too big for it, a few layers standing for it.
    fn probe(&self) -> Probe {
        Probe::Whole
    }

    /// Clip the global norm of each step's averaged gradient to this (`[run] max_grad_norm`):
    /// a data-parallel node then holds a step's reduced buckets until all are in, and scales
    /// them by `min(1, max / (norm + 1e-6))` before applying any, as
    /// `torch.nn.utils.clip_grad_norm_` does after DDP's averaging; under local SGD, each
    /// node's own gradient. `None`: no clipping.
    fn max_grad_norm(&self) -> Option<f32> {
        None
    }

    /// Whether this backend runs pipeline stages ([`Compute::stage_forward`] and
    /// [`Compute::stage_backward`]). The coordinator plans pipelines only for backends that do.
    fn runs_stages(&self) -> bool {
        false
    }

    /// Forward of one micro-batch through `pass.layers` of `model`: from `pass.input`, the
    /// previous stage's output, or from the samples on the first stage. Returns the output
    /// activations.
    fn stage_forward(
        &self,
        _pass: StagePass<'_>,
        _model: &Self::Model,
    ) -> impl Future<Output = Result<Vec<f32>, ComputeError>> + Send {
        std::future::ready(Err(ComputeError::Unsupported(NO_STAGES)))
    }

    /// Backward of one micro-batch through `pass.layers`, given the forward's input and
    /// output and the gradient of the output (`None` on the last stage: from the loss). Adds
    /// the *sum* over the samples of the gradient of the layers' parameters to `acc` (`None`:
    /// the first micro-batch of the step) and returns it with the gradient of the input.
    fn stage_backward(
        &self,
        _pass: StagePass<'_>,
        _model: &Self::Model,
        _acc: Option<Self::StageGrad>,
    ) -> impl Future<Output = Result<(Self::StageGrad, Vec<f32>), ComputeError>> + Send {
        std::future::ready(Err(ComputeError::Unsupported(NO_STAGES)))
    }

    /// A stage's gradient times `scale`, as host values in the order of the stage's
    /// parameters ([`Compute::param_range`]): what its sync group all-reduces.
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

/// The values of `model` at `slots`, in order (`None` when a slot lies outside it).
pub fn gather(model: &[f32], slots: &[Range<usize>]) -> Option<Vec<f32>> {
    let mut out = Vec::with_capacity(slots.iter().map(|r| r.len()).sum());
    for r in slots {
        out.extend_from_slice(model.get(r.clone())?);
    }
    Some(out)
}

/// Write `values` (as [`gather`] made them) back into `model` at `slots`; false, and nothing
/// written, when they do not fit.
pub fn scatter(model: &mut [f32], slots: &[Range<usize>], values: &[f32]) -> bool {
    let fits = slots.iter().all(|r| r.end <= model.len())
        && slots.iter().map(|r| r.len()).sum::<usize>() == values.len();
    if fits {
        let mut at = 0;
        for r in slots {
            model[r.clone()].copy_from_slice(&values[at..at + r.len()]);
            at += r.len();
        }
    }
    fits
}

/// What a backend without pipeline support cannot do.
pub const NO_STAGES: &str = "run pipeline stages";

/// Liveness beats: a task that sends `beat` from `from` to each of `to` every `period` (a
/// node's heartbeat to its coordinator; the coordinator's lease to the nodes). It ends when
/// `from` can no longer send here: its process is down, or no longer hosts it.
pub fn spawn_beats<T: Transport>(
    transport: T,
    from: Addr,
    to: Vec<Addr>,
    period: std::time::Duration,
    beat: Envelope,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for &a in &to {
                match transport.send(from, a, beat.clone()) {
                    Err(TransportError::SenderDown(_)) => return,
                    Err(TransportError::Unknown(x)) if x == from => return,
                    _ => {}
                }
            }
        }
    })
}

/// Run the compute `pass` with a bucket sink whose buckets are handed to `on` here, on the
/// caller's task, as the compute thread makes them (and those still on their way when the pass
/// ends): the compute thread and the caller share nothing. The pass's result.
pub(crate) async fn with_buckets<R, F>(
    pass: impl FnOnce(BucketSink) -> F,
    mut on: impl FnMut(usize, Vec<f32>),
) -> R
where
    F: std::future::Future<Output = R>,
{
    let (tx, mut made) = tokio::sync::mpsc::unbounded_channel::<(usize, Vec<f32>)>();
    let sink: BucketSink = Arc::new(move |k: usize, data: Vec<f32>| {
        let _ = tx.send((k, data));
    });
    let pass = pass(sink);
    tokio::pin!(pass);
    let result = loop {
        tokio::select! {
            r = &mut pass => break r,
            Some((k, data)) = made.recv() => on(k, data),
        }
    };
    while let Ok((k, data)) = made.try_recv() {
        on(k, data);
    }
    result
}

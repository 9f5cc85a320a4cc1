//! The two seams: how envelopes travel ([`Transport`]) and how a training step is computed
//! ([`Compute`]). The simulator and the real runtime each implement both.

use std::future::Future;
use std::ops::Range;
use std::sync::Arc;

use ravnest_core::{LayerRange, NodeId};

use crate::msg::{Addr, Envelope};

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

/// Where a backend hands each finished bucket of a step's gradient sum: (bucket index, values).
/// Owned, so that a backend may run its compute on a thread of its own.
pub type BucketSink = Arc<dyn Fn(usize, Vec<f32>) + Send + Sync>;

/// How a node computes one training step and applies an update.
pub trait Compute: Send + Sync + 'static {
    /// The model every node starts from (the same on every node: seeded).
    fn initial_model(&self) -> Vec<f32>;

    /// The version [`Compute::initial_model`] is (a resumed run starts from a checkpoint).
    fn initial_version(&self) -> u64 {
        0
    }

    /// How many values at the front of a `model_len`-value model are parameters (a gradient
    /// has this many); the rest is optimizer state.
    fn params(&self, model_len: usize) -> usize {
        model_len
    }

    /// The buckets a gradient of `params` values is produced in: disjoint ranges covering it,
    /// in the order [`Compute::gradient_sum`] finishes them (the last layers first, as
    /// backward runs), so each can be reduced while the rest is still being computed.
    fn buckets(&self, params: usize) -> Vec<Range<usize>> {
        std::iter::once(0..params).collect()
    }

    /// Apply the optimizer to parameters `range` of `model` (and their optimizer state) with
    /// the averaged gradient of those parameters. A step's update is applied bucket by bucket,
    /// then [`Compute::end_update`] once.
    fn apply_update(&self, model: &mut [f32], range: Range<usize>, mean_gradient: &[f32]);

    /// Called once after every part of a step's update was applied (an optimizer's step
    /// counter advances here).
    fn end_update(&self, _model: &mut [f32]) {}

    /// A gradient bucket's buffer, done with: a backend may reuse it for the next step's
    /// buckets (memory it already has mapped, allocated and freed on its own thread).
    fn recycle(&self, _buffer: Vec<f32>) {}

    /// Forward and backward over the global sample indices `samples` of `step` with model
    /// `model`. Hands the *sum* over those samples of the per-sample gradient to `ready`, bucket
    /// by bucket, in the order of [`Compute::buckets`], each as soon as it is known.
    fn gradient_sum(
        &self,
        node: NodeId,
        step: u64,
        samples: Range<u64>,
        model: Arc<Vec<f32>>,
        ready: BucketSink,
    ) -> impl Future<Output = Result<(), ComputeError>> + Send;

    /// Where `layers`' parameters sit in a model vector of `model_len` values. A backend that
    /// does not split its model by layer holds it as one slice.
    fn param_range(&self, _layers: LayerRange, model_len: usize) -> Range<usize> {
        0..model_len
    }

    /// Every part of a `model_len`-value model that belongs to `layers`: their parameters
    /// ([`Compute::param_range`]) first, then their optimizer state where it sits apart. What a
    /// stage holds, fetches, hands over and writes into a checkpoint shard.
    fn layer_slots(&self, layers: LayerRange, model_len: usize) -> Vec<Range<usize>> {
        std::iter::once(self.param_range(layers, model_len)).collect()
    }

    /// Whether this backend runs pipeline stages ([`Compute::stage_forward`] and
    /// [`Compute::stage_backward`]). The coordinator plans pipelines only for backends that do.
    fn runs_stages(&self) -> bool {
        false
    }

    /// Forward of one micro-batch through `layers` (parameters `params`, the model's slice at
    /// [`Compute::param_range`]): from `input`, the previous stage's output, or from the
    /// samples on the first stage. Returns the output activations.
    fn stage_forward(
        &self,
        _node: NodeId,
        _step: u64,
        _samples: Range<u64>,
        _layers: LayerRange,
        _params: &[f32],
        _input: Option<&[f32]>,
    ) -> impl Future<Output = Result<Vec<f32>, ComputeError>> + Send {
        std::future::ready(Err(ComputeError::Unsupported(NO_STAGES)))
    }

    /// Backward of one micro-batch through `layers`, given the forward's `input` and `output`
    /// and the gradient of the output (`None` on the last stage: from the loss). Returns (the
    /// *sum* over the samples of the gradient of the layers' parameters, the gradient of the
    /// input).
    #[allow(clippy::too_many_arguments)]
    fn stage_backward(
        &self,
        _node: NodeId,
        _step: u64,
        _samples: Range<u64>,
        _layers: LayerRange,
        _params: &[f32],
        _input: Option<&[f32]>,
        _output: &[f32],
        _grad_out: Option<&[f32]>,
    ) -> impl Future<Output = Result<(Vec<f32>, Vec<f32>), ComputeError>> + Send {
        std::future::ready(Err(ComputeError::Unsupported(NO_STAGES)))
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

/// Liveness beats: a task that sends a heartbeat from `from` to each of `to` every `period`
/// (a node's to its coordinator; the coordinator's leases to the nodes). It ends when `from`
/// can no longer send here: its process is down, or no longer hosts it.
pub fn spawn_beats<T: Transport>(
    transport: T,
    from: Addr,
    to: Vec<Addr>,
    period: std::time::Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for &a in &to {
                match transport.send(from, a, Envelope::Heartbeat) {
                    Err(TransportError::SenderDown(_)) => return,
                    Err(TransportError::Unknown(x)) if x == from => return,
                    _ => {}
                }
            }
        }
    })
}

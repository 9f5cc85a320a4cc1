//! The two seams: how envelopes travel ([`Transport`]) and how a training step is computed
//! ([`Compute`]). The simulator and the real runtime each implement both.

use std::collections::BTreeMap;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::sync::Arc;

use ravnest_core::{LayerRange, NodeId};

use ravnest_protocol::msg::{Addr, Envelope};
use ravnest_protocol::node::stage::Pass;
use ravnest_protocol::node::values::{ComputeError, NO_STAGES, Values};

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
/// The backend owns the model state: a [`Values::Model`] is one version of what a node holds
/// (the layers of its stage, or the whole model), parameters and optimizer state in the
/// backend's own form (candle tensors on the node's device; the simulator's host vector). The
/// runtime keeps versions as opaque handles and never copies one: an update makes new values
/// in the version it is applied to, and leaves every other version as it was. What crosses to
/// host memory is only what travels: gradient buckets for the all-reduce, and layers that
/// move ([`Values::export`] / [`Values::import`]: a fetch, a checkpoint shard, an average).
pub trait Compute: Values + Send + Sync + 'static {
    /// Forward and backward over the global sample indices `samples` of `step` with `model`.
    /// Hands the *sum* over those samples of the per-sample gradient to `ready`, bucket by
    /// bucket, in the order of [`Values::buckets`], each as soon as it is known.
    fn gradient_sum(
        &self,
        node: NodeId,
        step: u64,
        samples: Range<u64>,
        model: Self::Model,
        ready: BucketSink,
    ) -> impl Future<Output = Result<(), ComputeError>> + Send;

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

/// `compute`'s forward and backward on node `node` over `samples` of step `s` in micro-batches of `chunk` samples (0:
/// all at once), their gradients accumulated: `ready` gets each bucket's sum over all of
/// `samples` when the last micro-batch has made it (a worker whose memory does not hold its
/// share at once).
pub(crate) async fn gradient_sum<C: Compute>(
    compute: &C,
    node: NodeId,
    s: u64,
    samples: Range<u64>,
    chunk: u64,
    model: C::Model,
    ready: BucketSink,
) -> Result<(), ComputeError> {
    if chunk == 0 || chunk >= samples.end - samples.start {
        return compute.gradient_sum(node, s, samples, model, ready).await;
    }
    // The sums of the micro-batches so far, by bucket. Each micro-batch's buckets come from
    // the compute thread and are added in here as they come (this node's memory does not
    // hold two gradients); the last one's sink adds the sums into its buckets and hands
    // them on.
    let mut acc: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
    let mut start = samples.start;
    while start < samples.end {
        let end = (start + chunk).min(samples.end);
        if end == samples.end {
            let acc = Arc::new(acc);
            let sink: BucketSink = Arc::new(move |k: usize, mut data: Vec<f32>| {
                if let Some(prev) = acc.get(&k) {
                    for (d, p) in data.iter_mut().zip(prev) {
                        *d += p;
                    }
                }
                ready(k, data);
            });
            return compute.gradient_sum(node, s, start..end, model, sink).await;
        }
        let pass = |sink| compute.gradient_sum(node, s, start..end, model.clone(), sink);
        with_buckets(pass, |k, data| match acc.get_mut(&k) {
            Some(sum) => sum.iter_mut().zip(&data).for_each(|(s, d)| *s += d),
            None => {
                acc.insert(k, data);
            }
        })
        .await?;
        start = end;
    }
    Ok(())
}

//! The real side of the [`Compute`] seam: candle forward/backward on this node's samples.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use ravnest_core::{LayerRange, NodeId};
use ravnest_protocol::node::values::{ComputeError, Values};
use ravnest_runtime::Compute;
use ravnest_runtime::seams::{BucketSink, PhaseNs, StagePass};

use crate::data::Dataset;
use crate::gpt::StageInput;
use crate::net::Network;
use crate::optim::Optim;
use crate::state::{CandleModel, Grad, Held, ModelState, Source};

/// Candle training for one node.
#[derive(Debug)]
pub struct CandleCompute {
    /// The network.
    pub net: Network,
    /// Training data.
    pub data: Arc<Dataset>,
    /// Optimizer.
    pub optim: Optim,
    /// Seed (initial weights and data order).
    pub seed: u64,
    /// Emulated slowdown: after computing, sleep `(slowdown − 1)` times as long.
    pub slowdown: f64,
    /// Start from this checkpoint instead of the seeded initial weights.
    pub resume: Option<Resume>,
    /// Extra slowdowns over time (a cluster file's `slowdown` faults for this node):
    /// (from s, to s, factor), seconds since training started here ([`CandleCompute::started`]).
    pub schedule: Vec<(f64, f64, f64)>,
    /// When training started on this node (set when its first work arrives).
    pub started: Arc<std::sync::OnceLock<Instant>>,
    perm: Arc<Mutex<(u64, Vec<u32>)>>,
    stats: Arc<Mutex<Stats>>,
    worker: crate::worker::ComputeThread,
    /// Gradient buffers handed back after use, for the next step's buckets.
    spare: Arc<Mutex<Vec<Vec<f32>>>>,
    /// The memory ledger of a pipeline stage (see [`Ledger`]).
    pub ledger: Arc<Mutex<Ledger>>,
    /// Samples per micro-batch of a pipeline stage (the file's `micro_batch`): what a
    /// calibration of layers runs ([`Compute::probe`]).
    pub micro_batch: u64,
    /// The model state this backend makes and updates (per tensor, on the device).
    state: Arc<ModelState>,
    /// Clip each step's global gradient norm to this ([`Values::max_grad_norm`]).
    pub max_grad_norm: Option<f32>,
}

/// The checkpoint a resumed run starts from: its version, and where its values are read from.
#[derive(Debug, Clone)]
pub struct Resume {
    /// The version (steps done).
    pub version: u64,
    /// The values (a checkpoint read tensor by tensor, or a flat model).
    pub source: Source,
    /// AdamW's step count in it.
    pub step_count: f32,
}

/// A pipeline stage's gradient, summed over its micro-batches, where the stage computes:
/// per tensor (index, its gradient), counted while it lives. On the CPU the hand-written
/// backward adds each micro-batch's gradient into host buffers in place; elsewhere candle's
/// autograd gives tensors, summed as they come.
#[derive(Debug)]
pub struct CandleGrad {
    sum: GradSum,
    _held: Held,
}

#[derive(Debug)]
enum GradSum {
    Host(Vec<(usize, Vec<f32>)>),
    Device(Vec<(usize, Tensor)>),
}

/// What a pipeline stage holds, counted: its layers' weights, gradients and optimizer state,
/// the inputs and outputs it keeps between a micro-batch's forward and backward, and one
/// micro-batch's activations while its backward runs. A stage op that would take it over the
/// node's memory budget is refused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ledger {
    /// The node's budget in bytes (its measured memory, capped by the file's `memory_gib`);
    /// 0: not set, nothing is refused.
    pub budget: u64,
    /// Bytes of inputs and outputs kept for backward now.
    pub held: u64,
    /// The most bytes counted at once.
    pub peak: u64,
    /// Activation and activation-gradient bytes this node sent to other stages.
    pub sent: u64,
}

/// The loss of the samples one computation trained on (a node's share of a step, or a last
/// stage's micro-batch).
#[derive(Debug, Clone, PartialEq)]
pub struct StepLoss {
    /// The step.
    pub step: u64,
    /// The global sample indices.
    pub samples: Range<u64>,
    /// Σ over those samples of each one's mean loss per token (or per sample).
    pub loss_sum: f64,
}

/// What the node's computations saw (for progress lines).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stats {
    /// Mean loss of the last batch.
    pub last_loss: f64,
    /// Samples computed.
    pub samples: u64,
    /// Seconds of real (not emulated) compute.
    pub real_compute_s: f64,
    /// The emulated slowdown of the last step, and the step it changed at last.
    pub slowdown: (f64, u64),
    /// The losses computed since [`CandleCompute::take_losses`] last took them.
    pub losses: Vec<StepLoss>,
    /// Where the training steps' time went (data-parallel steps; calibration left out).
    pub phases: PhaseNs,
}

impl CandleCompute {
    /// A compute backend.
    pub fn new(net: Network, data: Arc<Dataset>, optim: Optim, seed: u64, slowdown: f64) -> Self {
        let state = Arc::new(ModelState::new(net.clone(), optim, seed));
        CandleCompute {
            net,
            data,
            optim,
            seed,
            slowdown,
            resume: None,
            schedule: Vec::new(),
            started: Arc::default(),
            perm: Arc::new(Mutex::new((u64::MAX, Vec::new()))),
            stats: Arc::default(),
            worker: crate::worker::ComputeThread::default(),
            spare: Arc::default(),
            ledger: Arc::default(),
            micro_batch: 4,
            state,
            max_grad_norm: None,
        }
    }

    /// Start from the weights of a Hugging Face folder instead of seeded ones (`[model] from`
    /// with `init = "pretrained"`): each tensor is read from its file when this node first
    /// makes it, so a stage reads its own layers only.
    pub fn with_pretrained(mut self, folder: Arc<crate::folder::HfFolder>) -> Self {
        let mut state = ModelState::new(self.net.clone(), self.optim, self.seed);
        state.pretrained = Some(folder);
        self.state = Arc::new(state);
        self
    }

    /// Count what a stage op of `layers` on `rows` samples needs on top of what the stage
    /// holds (`extra_held` more bytes kept after it), and refuse it when that exceeds the
    /// budget.
    fn count(&self, layers: LayerRange, rows: u64, extra_held: u64) -> Result<(), ComputeError> {
        let spec = self.net.model_spec();
        let part = &spec.layers[layers.range()];
        let per_param = ravnest_core::model::state_bytes_per_param(
            ravnest_core::Precision::Fp32,
            self.optim.kind,
        );
        let state: u64 = part.iter().map(|l| l.params * per_param).sum();
        let graph: u64 = part
            .iter()
            .map(|l| l.activation_elems_per_sample * rows * 4)
            .sum();
        let mut l = self.ledger.lock().unwrap();
        let need = state + l.held + extra_held + graph;
        l.peak = l.peak.max(need);
        if l.budget > 0 && need > l.budget / 2 {
            crate::measure::memory_is_tight();
        }
        if l.budget > 0 && need > l.budget {
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            return Err(ComputeError::Backend(format!(
                "memory budget exceeded: layers {layers} need {:.1} MiB (weights, gradients and optimizer state {:.1} MiB + activations kept for backward {:.1} MiB + one micro-batch's activations {:.1} MiB of {rows} samples) but this node's budget is {:.1} MiB (its measured memory, capped by memory_gib in the cluster file)",
                mib(need),
                mib(state),
                mib(l.held + extra_held),
                mib(graph),
                mib(l.budget)
            )));
        }
        Ok(())
    }

    /// Parameters (the flat model is parameters then optimizer state).
    pub fn params(&self) -> usize {
        self.state.layout.params
    }

    /// Length of the flat model (parameters and optimizer state).
    pub fn model_len(&self) -> usize {
        self.state.layout.model_len()
    }

    /// The seeded initial model (or the resumed checkpoint), whole and flat: the single-node
    /// reference of tests and benchmarks.
    pub fn initial_model(&self) -> Vec<f32> {
        let m = ravnest_protocol::node::values::Values::initial(self, None);
        self.state.export(&m, None).unwrap_or_default()
    }

    /// The model state (layout, counts).
    pub fn model_state(&self) -> &ModelState {
        &self.state
    }

    /// Count the optimizer's time since `t` (in training only).
    fn optimizer_took(&self, t: Instant) {
        if self.started.get().is_some() {
            self.stats.lock().unwrap().phases.optimizer_ns += t.elapsed().as_nanos() as u64;
        }
    }

    /// Counters so far (the losses not taken yet left out).
    pub fn stats(&self) -> Stats {
        let s = self.stats.lock().unwrap();
        Stats {
            losses: Vec::new(),
            ..*s
        }
    }

    /// The losses computed since the last call, in the order they were.
    pub fn take_losses(&self) -> Vec<StepLoss> {
        std::mem::take(&mut self.stats.lock().unwrap().losses)
    }

    /// What computing a gradient needs, detached from `self` (shared, cheap to clone) so that it
    /// can run on the compute thread.
    fn job(&self) -> Job {
        Job {
            net: self.net.clone(),
            data: self.data.clone(),
            seed: self.seed,
            perm: self.perm.clone(),
            stats: self.stats.clone(),
            spare: self.spare.clone(),
            state: self.state.clone(),
        }
    }

    /// Row of the training set that global sample index `s` reads: each pass over the data
    /// ("epoch") is a seeded permutation.
    pub fn row(&self, s: u64) -> usize {
        self.job().row(s)
    }

    /// The batch for global sample indices `samples`: (features, labels).
    pub fn batch(&self, samples: Range<u64>) -> Result<(Vec<f32>, Vec<u32>), ComputeError> {
        self.job().batch(samples)
    }

    /// The whole gradient sum over `samples` of the flat model `model`, synchronously (for
    /// tests and the single-node baseline).
    pub fn gradient_sum_now(&self, samples: Range<u64>, model: &[f32]) -> Vec<f32> {
        let buckets = self.net.grad_buckets();
        let mut g = vec![0.0f32; self.params()];
        let m = self
            .state
            .import(None, None, model.to_vec(), &crate::device::current())
            .unwrap_or_else(|e| panic!("{e}"));
        self.job()
            .gradient_buckets(samples, &m, &mut |k, v| {
                g[buckets[k].clone()].copy_from_slice(&v)
            })
            .unwrap_or_else(|e| panic!("{e}"));
        g
    }

    /// One whole training step of `model` on `samples`, here and now: the gradient sum,
    /// weighted by 1 / samples in the optimizer's pass, each bucket applied as backward hands
    /// it over, then the step ended. What a node does in a step, without the runtime (a bare
    /// loop to compare the framework with).
    pub fn train_step(
        &self,
        model: &mut CandleModel,
        samples: Range<u64>,
    ) -> Result<(), ComputeError> {
        let buckets = self.net.grad_buckets();
        let inv = 1.0 / (samples.end - samples.start).max(1) as f32;
        let dev = crate::device::current();
        let mut parts = Vec::with_capacity(buckets.len());
        self.job()
            .gradient_buckets(samples, model, &mut |k, g| parts.push((k, g)))
            .map(drop)?;
        // The sum's mean is taken by the optimizer's pass (its `scale`), not a pass of its own.
        for (k, g) in parts {
            self.state
                .update_range(model, buckets[k].clone(), &g, inv, &dev)?;
        }
        self.state.end_update(model);
        Ok(())
    }

    /// The emulated slowdown now: the node's own, times any scheduled one that is active.
    pub fn slowdown_now(&self) -> f64 {
        let Some(t) = self.started.get() else {
            return self.slowdown;
        };
        let s = t.elapsed().as_secs_f64();
        self.schedule
            .iter()
            .filter(|(from, to, _)| (*from..*to).contains(&s))
            .fold(self.slowdown, |k, (_, _, f)| k * f)
    }

    /// One whole optimizer step with the mean gradient (tests and the single-node baseline),
    /// tensor by tensor as the node's update applies it: the step's rate, and weight decay
    /// where it applies.
    pub fn step_now(&self, model: &mut [f32], mean_gradient: &[f32]) {
        let p = mean_gradient.len();
        let t = self
            .optim
            .step_count_at(p)
            .and_then(|k| model.get(k))
            .copied()
            .unwrap_or(0.0);
        for m in &self.state.layout.tensors {
            let r = m.offset..m.offset + m.len;
            self.optim
                .at(t, &m.shape)
                .step_range(model, p, r.clone(), &mean_gradient[r]);
        }
        self.optim.end_step(model, p);
    }
}

impl CandleCompute {
    /// The GPT, when this backend trains one (the network that runs pipeline stages).
    fn gpt(&self) -> Option<crate::gpt::Gpt> {
        match &self.net {
            Network::Gpt(g) => Some(*g),
            _ => None,
        }
    }

    /// One stage operation on the compute thread, with the node's emulated slowdown: `op`
    /// gets the GPT, the samples' tokens, the compute device and the model state.
    async fn stage_op<R: Send + 'static>(
        &self,
        step: u64,
        samples: Range<u64>,
        op: impl FnOnce(
            &crate::gpt::Gpt,
            &[f32],
            &candle_core::Device,
            &ModelState,
        ) -> Result<R, ComputeError>
        + Send
        + 'static,
    ) -> Result<R, ComputeError> {
        let g = self.gpt().ok_or(ComputeError::Unsupported(
            ravnest_protocol::node::values::NO_STAGES,
        ))?;
        let job = self.job();
        let slowdown = self.slowdown_now();
        {
            let mut st = self.stats.lock().unwrap();
            if st.slowdown.0 != slowdown {
                st.slowdown = (slowdown, step);
            }
        }
        let (result, real) = self
            .worker
            .run(move || {
                let (t, cpu) = (Instant::now(), job::thread_cpu());
                let r = job
                    .batch(samples)
                    .and_then(|(tokens, _)| op(&g, &tokens, &crate::device::current(), &job.state));
                let took = t.elapsed();
                if slowdown > 1.0 {
                    std::thread::sleep(job::work_time(took, cpu).mul_f64(slowdown - 1.0));
                }
                (r, took)
            })
            .await
            .ok_or_else(|| ComputeError::Backend("the compute thread is gone".into()))?;
        self.stats.lock().unwrap().real_compute_s += real.as_secs_f64();
        result
    }

    /// The parameter variables of `layers` of `model`, grouped by layer, made on `dev`.
    fn stage_vars(
        state: &ModelState,
        model: &CandleModel,
        layers: LayerRange,
        dev: &candle_core::Device,
    ) -> Result<Vec<Vec<candle_core::Var>>, ComputeError> {
        let idx = state
            .layout
            .indices(Some(layers))
            .ok_or_else(|| ComputeError::Shape(format!("no layers {layers} in this network")))?;
        let vars = state.vars(model, idx.clone(), dev)?;
        let mut out: Vec<Vec<candle_core::Var>> = Vec::new();
        let mut last = None;
        for (i, v) in idx.zip(vars) {
            let l = state.layout.tensors[i].layer;
            if l != last || out.is_empty() {
                out.push(Vec::new());
                last = l;
            }
            out.last_mut().expect("pushed").push(v);
        }
        Ok(out)
    }
}

fn stage_failed(e: candle_core::Error) -> ComputeError {
    ComputeError::Backend(format!("candle stage: {e}"))
}

impl Values for CandleCompute {
    type Model = CandleModel;
    type StageGrad = CandleGrad;

    fn model_len(&self) -> usize {
        self.state.layout.model_len()
    }

    fn params(&self) -> usize {
        self.state.layout.params
    }

    fn initial(&self, layers: Option<LayerRange>) -> CandleModel {
        match &self.resume {
            Some(r) => self.state.at_source(layers, &r.source, r.step_count),
            None => self.state.at_source(layers, &Source::Seeded, 0.0),
        }
    }

    fn initial_version(&self) -> u64 {
        self.resume.as_ref().map_or(0, |r| r.version)
    }

    fn retain(&self, model: &CandleModel, layers: LayerRange) -> CandleModel {
        self.state.retain(model, layers)
    }

    fn export(&self, model: &CandleModel, layers: Option<LayerRange>) -> Option<Vec<f32>> {
        self.state.export(model, layers)
    }

    fn import(
        &self,
        base: Option<&CandleModel>,
        layers: Option<LayerRange>,
        values: Vec<f32>,
    ) -> Result<CandleModel, ComputeError> {
        self.state
            .import(base, layers, values, &crate::device::current())
    }

    fn digest(&self, model: &CandleModel, layers: Option<LayerRange>) -> u64 {
        self.state.digest(model, layers)
    }

    fn export_range(
        &self,
        model: &CandleModel,
        layers: Option<LayerRange>,
        range: Range<usize>,
    ) -> Option<Vec<f32>> {
        self.state.export_range(model, layers, range)
    }

    fn buckets(&self) -> Vec<Range<usize>> {
        self.net.grad_buckets()
    }

    fn apply_update(
        &self,
        model: &mut CandleModel,
        range: Range<usize>,
        mean_gradient: &[f32],
    ) -> Result<(), ComputeError> {
        let t = Instant::now();
        let r =
            self.state
                .update_range(model, range, mean_gradient, 1.0, &crate::device::current());
        self.optimizer_took(t);
        r
    }

    fn end_update(&self, model: &mut CandleModel) {
        let t = Instant::now();
        self.state.end_update(model);
        self.optimizer_took(t);
    }

    fn shard(&self, model: &CandleModel, owned: LayerRange) -> CandleModel {
        self.state.shard(model, owned)
    }

    fn set_params(
        &self,
        model: &mut CandleModel,
        range: Range<usize>,
        values: &[f32],
    ) -> Result<(), ComputeError> {
        self.state
            .set_params(model, range, values, &crate::device::current())
    }

    fn retire(&self, old: CandleModel) {
        self.state.retire(old);
    }

    fn recycle(&self, buffer: Vec<f32>) {
        let mut spare = self.spare.lock().unwrap();
        if spare.len() < SPARE_BUFFERS {
            spare.push(buffer);
        }
    }

    fn param_range(&self, layers: LayerRange) -> Range<usize> {
        let layout = &self.state.layout;
        match layout.indices(Some(layers)) {
            Some(idx) => layout.param_range(&idx),
            None => 0..0,
        }
    }

    fn layer_slots(&self, layers: LayerRange) -> Vec<Range<usize>> {
        layer_slots(&self.net, &self.optim, layers)
    }

    fn max_grad_norm(&self) -> Option<f32> {
        self.max_grad_norm
    }

    fn stage_grad_values(&self, grad: CandleGrad, scale: f32) -> Vec<f32> {
        let mut out = Vec::new();
        match &grad.sum {
            GradSum::Host(bufs) => {
                for (_, v) in bufs {
                    out.extend(v.iter().map(|x| x * scale));
                }
            }
            GradSum::Device(ts) => {
                for (_, t) in ts {
                    let _ = crate::state::read(t, |v| out.extend(v.iter().map(|x| x * scale)));
                }
            }
        }
        out
    }

    fn apply_stage_grad(
        &self,
        model: &mut CandleModel,
        _layers: LayerRange,
        grad: CandleGrad,
        scale: f32,
    ) -> Result<(), ComputeError> {
        // On the compute thread, where the stage's tensors are made: its allocator reuses what
        // the last step's update freed.
        let (state, spare) = (self.state.clone(), self.spare.clone());
        let mut m = std::mem::replace(model, state.empty());
        let (m, r) = self
            .worker
            .run_here(move || {
                let dev = crate::device::current();
                let CandleGrad { sum, _held } = grad;
                let each: Vec<(usize, Result<(), ComputeError>)> = match &sum {
                    GradSum::Host(bufs) => bufs
                        .iter()
                        .map(|(i, v)| (*i, Grad::Host(v)))
                        .map(|(i, g)| (i, state.update(&mut m, i, g, scale, &dev)))
                        .collect(),
                    GradSum::Device(ts) => ts
                        .iter()
                        .map(|(i, t)| (*i, state.update(&mut m, *i, Grad::Device(t), scale, &dev)))
                        .collect(),
                };
                if let Some((_, Err(e))) = each.into_iter().find(|r| r.1.is_err()) {
                    return (m, Err(e));
                }
                state.end_update(&mut m);
                if let GradSum::Host(bufs) = sum {
                    let mut pool = spare.lock().unwrap();
                    pool.extend(bufs.into_iter().map(|b| b.1));
                    pool.truncate(SPARE_BUFFERS.max(64));
                }
                (m, Ok(()))
            })
            .ok_or_else(|| ComputeError::Backend("the compute thread is gone".into()))?;
        *model = m;
        r
    }
}

impl Compute for CandleCompute {
    fn phase_ns(&self) -> PhaseNs {
        self.stats.lock().unwrap().phases
    }

    fn state_stats(&self) -> ravnest_runtime::seams::StateStats {
        self.state.counter.stats()
    }

    /// A GPT whose state and one micro-batch's activations exceed this node's memory budget
    /// is measured by one block (layer 1) standing for the model by its share of the work, so
    /// that a model no node holds is never built whole to be measured.
    fn probe(&self) -> ravnest_runtime::seams::Probe {
        use ravnest_runtime::seams::Probe;
        let Some(g) = self.gpt() else {
            return Probe::Whole;
        };
        let budget = self.ledger.lock().unwrap().budget;
        let spec = self.net.model_spec();
        let micro = self.micro_batch.max(1);
        let per_param = ravnest_core::model::state_bytes_per_param(
            ravnest_core::Precision::Fp32,
            self.optim.kind,
        );
        let state: u64 = spec.layers.iter().map(|l| l.params * per_param).sum();
        let acts: u64 = spec
            .layers
            .iter()
            .map(|l| l.activation_elems_per_sample * micro * 4)
            .sum();
        if budget == 0 || state + acts <= budget || g.layers == 0 {
            return Probe::Whole;
        }
        let total: f64 = spec.layers.iter().map(|l| l.fwd_flops_per_sample).sum();
        Probe::Layers {
            layers: LayerRange::new(1, 2),
            share: spec.layers[1].fwd_flops_per_sample / total.max(1.0),
            micro,
            input: g.seq * g.hidden,
        }
    }

    fn runs_stages(&self) -> bool {
        self.gpt().is_some()
    }

    async fn stage_forward(
        &self,
        pass: StagePass<'_>,
        model: &CandleModel,
    ) -> Result<Vec<f32>, ComputeError> {
        let StagePass {
            step,
            samples,
            layers,
            input,
            ..
        } = pass;
        let rows = samples.end - samples.start;
        let kept_in = input.map_or(0, |i| i.len() as u64 * 4);
        self.count(layers, rows, kept_in)?;
        let (model, input) = (model.clone(), input.map(<[f32]>::to_vec));
        let out = self
            .stage_op(step, samples, move |g, tokens, dev, state| {
                let p = Self::stage_vars(state, &model, layers, dev)?;
                let inp = match &input {
                    Some(h) => StageInput::Hidden(h),
                    None => StageInput::Tokens(tokens),
                };
                if dev.is_cpu() {
                    let ts = detached(&p);
                    let refs: Vec<&[Tensor]> = ts.iter().map(Vec::as_slice).collect();
                    return g
                        .fast_forward(layers.range(), &refs, inp, Some(tokens))
                        .map_err(stage_failed);
                }
                g.stage_forward_with(dev, layers.range(), &p, inp, Some(tokens))
                    .map_err(stage_failed)
            })
            .await?;
        let mut l = self.ledger.lock().unwrap();
        l.held += kept_in + out.len() as u64 * 4;
        let last = layers.range().end == self.net.model_spec().layers.len();
        if !last {
            l.sent += out.len() as u64 * 4;
        }
        Ok(out)
    }

    async fn stage_backward(
        &self,
        pass: StagePass<'_>,
        model: &CandleModel,
        acc: Option<CandleGrad>,
    ) -> Result<(CandleGrad, Vec<f32>), ComputeError> {
        let StagePass {
            step,
            samples,
            layers,
            input,
            output,
            grad_out,
            ..
        } = pass;
        let rows = samples.end - samples.start;
        let range = samples.clone();
        self.count(layers, rows, 0)?;
        let kept = (input.map_or(0, <[f32]>::len) + output.len()) as u64 * 4;
        let (model, input) = (model.clone(), input.map(<[f32]>::to_vec));
        let grad_out = grad_out.map(<[f32]>::to_vec);
        let counter = self.state.counter.clone();
        let spare = self.spare.clone();
        let (sum, gin, loss) = self
            .stage_op(step, samples, move |g, tokens, dev, state| {
                let p = Self::stage_vars(state, &model, layers, dev)?;
                let inp = match &input {
                    Some(h) => StageInput::Hidden(h),
                    None => StageInput::Tokens(tokens),
                };
                let r = layers.range();
                let idx = state.layout.indices(Some(layers)).unwrap_or(0..0);
                if dev.is_cpu() {
                    // Added in place into the stage's buffers (zeros at its first micro-batch).
                    let mut sum = acc.unwrap_or_else(|| host_zeros(state, idx, &counter, &spare));
                    let GradSum::Host(bufs) = &mut sum.sum else {
                        return Err(ComputeError::Backend("a device gradient on the CPU".into()));
                    };
                    let mut slices: Vec<&mut [f32]> =
                        bufs.iter_mut().map(|b| b.1.as_mut_slice()).collect();
                    let ts = detached(&p);
                    let refs: Vec<&[Tensor]> = ts.iter().map(Vec::as_slice).collect();
                    let (gin, loss) = g
                        .fast_backward(
                            r,
                            &refs,
                            inp,
                            Some(tokens),
                            grad_out.as_deref(),
                            &mut slices,
                        )
                        .map_err(stage_failed)?;
                    return Ok((sum, gin, loss));
                }
                let (grads, gin, loss) = g
                    .stage_backward_with(dev, r, &p, inp, Some(tokens), grad_out.as_deref())
                    .map_err(stage_failed)?;
                let sum = accumulate(acc, idx.start, grads, &counter).map_err(stage_failed)?;
                Ok((sum, gin, loss))
            })
            .await?;
        {
            let mut l = self.ledger.lock().unwrap();
            l.held = l.held.saturating_sub(kept);
            l.sent += gin.len() as u64 * 4;
        }
        if loss.is_finite() {
            let mut s = self.stats.lock().unwrap();
            s.last_loss = loss / rows.max(1) as f64;
            s.samples += rows;
            if self.started.get().is_some() {
                s.losses.push(StepLoss {
                    step,
                    samples: range,
                    loss_sum: loss,
                });
            }
        }
        Ok((sum, gin))
    }

    async fn gradient_sum(
        &self,
        _node: NodeId,
        step: u64,
        samples: Range<u64>,
        model: CandleModel,
        ready: BucketSink,
    ) -> Result<(), ComputeError> {
        if samples.is_empty() {
            for (k, r) in self.net.grad_buckets().into_iter().enumerate() {
                ready(k, vec![0.0; r.len()]);
            }
            return Ok(());
        }
        // Candle is blocking, CPU-bound work: it runs on this backend's compute thread, at a
        // lower CPU priority than the runtime's threads, so that communication is never
        // starved by compute (the all-reduce of one node waits for its peers' network code).
        let job = self.job();
        let slowdown = self.slowdown_now();
        {
            let mut st = self.stats.lock().unwrap();
            if st.slowdown.0 != slowdown {
                st.slowdown = (slowdown, step);
            }
        }
        // The gradient of the whole model, while backward makes it, is counted as held.
        let held = Held::new(&self.state.counter, 4 * self.params() as u64);
        let range = samples.clone();
        let (result, timed) = self
            .worker
            .run(move || job.emulated(samples, &model, slowdown, &ready))
            .await
            .unwrap_or_else(|| {
                let e = ComputeError::Backend("the compute thread is gone".into());
                (Err(e), job::Timed::default())
            });
        drop(held);
        let mut s = self.stats.lock().unwrap();
        s.real_compute_s += timed.real.as_secs_f64();
        // Training's phases only, not the measurements' before it.
        if self.started.get().is_some() {
            let ns = |d: Duration| d.as_nanos() as u64;
            let forward = ns(timed.forward).min(ns(timed.real));
            s.phases.forward_ns += forward;
            s.phases.backward_ns += ns(timed.real) - forward;
            s.phases.slowdown_ns += ns(timed.slept);
        }
        let loss_sum = result?;
        // Training's losses only, not the measurements' before it.
        if self.started.get().is_some() {
            s.losses.push(StepLoss {
                step,
                samples: range,
                loss_sum,
            });
        }
        Ok(())
    }
}

/// A stage's gradient buffers for tensors `idx`, zero, counted as held.
fn host_zeros(
    state: &ModelState,
    idx: Range<usize>,
    counter: &Arc<crate::state::StateCounter>,
    spare: &Spare,
) -> CandleGrad {
    // The last step's buffers where it left them (the allocator then sees no new ones).
    let mut pool = spare.lock().unwrap();
    let bufs: Vec<(usize, Vec<f32>)> = idx
        .map(|i| {
            let n = state.layout.tensors[i].len;
            // The smallest that holds it: a large buffer taken for a small tensor would leave
            // the large tensor to a new one, and the pool would grow by a stage's gradient.
            let fit = (0..pool.len())
                .filter(|&k| pool[k].capacity() >= n)
                .min_by_key(|&k| pool[k].capacity());
            let mut b = match fit {
                Some(k) => pool.swap_remove(k),
                None => Vec::with_capacity(n),
            };
            b.clear();
            b.resize(n, 0.0);
            (i, b)
        })
        .collect();
    let bytes = bufs.iter().map(|b| 4 * b.1.len() as u64).sum();
    CandleGrad {
        sum: GradSum::Host(bufs),
        _held: Held::new(counter, bytes),
    }
}

/// `acc` (a stage's gradient so far, `None` at its first micro-batch) plus `grads` (the
/// gradients of tensors `first..`), counted as held.
fn accumulate(
    acc: Option<CandleGrad>,
    first: usize,
    grads: Vec<Tensor>,
    counter: &Arc<crate::state::StateCounter>,
) -> candle_core::Result<CandleGrad> {
    match acc {
        None => {
            let bytes = grads.iter().map(|t| 4 * t.elem_count() as u64).sum();
            Ok(CandleGrad {
                sum: GradSum::Device(
                    grads
                        .into_iter()
                        .enumerate()
                        .map(|(k, t)| (first + k, t))
                        .collect(),
                ),
                _held: Held::new(counter, bytes),
            })
        }
        Some(mut a) => {
            let GradSum::Device(ts) = &mut a.sum else {
                candle_core::bail!("host gradient buffers off the CPU");
            };
            if ts.len() != grads.len() {
                candle_core::bail!(
                    "a micro-batch's backward gave {} gradients for {} tensors",
                    grads.len(),
                    ts.len()
                );
            }
            for ((_, s), g) in ts.iter_mut().zip(grads) {
                *s = s.add(&g)?;
            }
            Ok(a)
        }
    }
}

mod job;
#[cfg(test)]
mod tests;

pub use crate::layout::layer_slots;
use job::{Job, SPARE_BUFFERS, Spare, detached};

//! The real side of the [`Compute`] seam: candle forward/backward on this node's samples.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use ravnest_core::{LayerRange, NodeId};
use ravnest_runtime::Compute;
use ravnest_runtime::seams::{BucketSink, ComputeError};

use crate::data::Dataset;
use crate::gpt::StageInput;
use crate::net::Network;
use crate::optim::Optim;

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
    /// Start from this (version, model) instead of the seeded initial weights.
    pub resume: Option<(u64, Vec<f32>)>,
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

/// What the node's computations saw (for progress lines).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    /// Mean loss of the last batch.
    pub last_loss: f64,
    /// Samples computed.
    pub samples: u64,
    /// Seconds of real (not emulated) compute.
    pub real_compute_s: f64,
    /// The emulated slowdown of the last step, and the step it changed at last.
    pub slowdown: (f64, u64),
}

impl CandleCompute {
    /// A compute backend.
    pub fn new(net: Network, data: Arc<Dataset>, optim: Optim, seed: u64, slowdown: f64) -> Self {
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
        }
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
        self.net.params()
    }

    /// Length of the flat model (parameters and optimizer state).
    pub fn model_len(&self) -> usize {
        self.params() + self.optim.state_len(self.params())
    }

    /// Counters so far.
    pub fn stats(&self) -> Stats {
        *self.stats.lock().unwrap()
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
        }
    }

    /// Row of the training set that global sample index `s` reads: each pass over the data
    /// ("epoch") is a seeded permutation.
    pub fn row(&self, s: u64) -> usize {
        self.job().row(s)
    }

    /// The batch for global sample indices `samples`: (features, labels).
    pub fn batch(&self, samples: Range<u64>) -> (Vec<f32>, Vec<u32>) {
        self.job().batch(samples)
    }

    /// The gradient sum over `samples`, bucket by bucket to `sink` (see
    /// [`Network::grad_buckets`]); records the batch's mean loss. Synchronous, CPU-bound.
    pub fn gradient_buckets(
        &self,
        samples: Range<u64>,
        model: &[f32],
        sink: &mut dyn FnMut(usize, Vec<f32>),
    ) -> Result<(), ComputeError> {
        self.job().gradient_buckets(samples, model, sink)
    }

    /// The whole gradient sum, synchronously (for tests and the single-node baseline).
    pub fn gradient_sum_now(&self, samples: Range<u64>, model: &[f32]) -> Vec<f32> {
        let buckets = self.net.grad_buckets();
        let mut g = vec![0.0f32; self.params()];
        self.gradient_buckets(samples, model, &mut |k, v| {
            g[buckets[k].clone()].copy_from_slice(&v)
        })
        .unwrap_or_else(|e| panic!("{e}"));
        g
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

    /// One whole optimizer step with the mean gradient (tests and the single-node baseline).
    pub fn step_now(&self, model: &mut [f32], mean_gradient: &[f32]) {
        self.optim.step(model, mean_gradient);
    }
}

/// The part of a [`CandleCompute`] a gradient needs, owned.
#[derive(Debug, Clone)]
struct Job {
    net: Network,
    data: Arc<Dataset>,
    seed: u64,
    perm: Arc<Mutex<(u64, Vec<u32>)>>,
    stats: Arc<Mutex<Stats>>,
    spare: Arc<Mutex<Vec<Vec<f32>>>>,
}

/// Gradient buffers kept for reuse, at most.
const SPARE_BUFFERS: usize = 16;

impl Job {
    fn row(&self, s: u64) -> usize {
        let n = self.data.len() as u64;
        let epoch = s / n;
        let mut p = self.perm.lock().unwrap();
        if p.0 != epoch {
            let mut rows: Vec<u32> = (0..n as u32).collect();
            let mut rng = ChaCha8Rng::seed_from_u64(
                self.seed ^ epoch.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15),
            );
            rows.shuffle(&mut rng);
            *p = (epoch, rows);
        }
        p.1[(s % n) as usize] as usize
    }

    fn batch(&self, samples: Range<u64>) -> (Vec<f32>, Vec<u32>) {
        let f = self.data.features;
        let mut x = Vec::with_capacity((samples.end - samples.start) as usize * f);
        let mut y = Vec::with_capacity((samples.end - samples.start) as usize);
        for s in samples {
            let r = self.row(s);
            x.extend_from_slice(&self.data.x[r * f..(r + 1) * f]);
            y.push(self.data.y[r]);
        }
        (x, y)
    }

    fn gradient_buckets(
        &self,
        samples: Range<u64>,
        model: &[f32],
        sink: &mut dyn FnMut(usize, Vec<f32>),
    ) -> Result<(), ComputeError> {
        let (x, y) = self.batch(samples);
        let spare = &self.spare;
        let mut zeroed = |n: usize| {
            let mut buf = spare.lock().unwrap().pop().unwrap_or_default();
            buf.clear();
            buf.resize(n, 0.0);
            buf
        };
        let loss = self
            .net
            .loss_and_grad_buckets_into(&model[..self.net.params()], &x, &y, sink, &mut zeroed)
            .map_err(|e| ComputeError::Backend(format!("candle forward/backward: {e}")))?;
        let mut s = self.stats.lock().unwrap();
        s.last_loss = loss / y.len().max(1) as f64;
        s.samples += y.len() as u64;
        Ok(())
    }

    /// The gradient with an emulated slower device: each bucket is handed over (k − 1) times
    /// its compute time later, as a device k times slower would (a precise thread sleep:
    /// tokio's timer has 1 ms granularity, a large error on steps of a few ms).
    fn emulated(
        &self,
        samples: Range<u64>,
        model: &[f32],
        slowdown: f64,
        ready: &BucketSink,
    ) -> (Result<(), ComputeError>, Duration) {
        let slow = slowdown.max(1.0) - 1.0;
        let mut since = Instant::now();
        let mut real = Duration::ZERO;
        let r = self.gradient_buckets(samples, model, &mut |k, v| {
            let took = since.elapsed();
            real += took;
            if slow > 0.0 {
                std::thread::sleep(took.mul_f64(slow));
            }
            since = Instant::now();
            ready(k, v);
        });
        let took = since.elapsed();
        real += took;
        if slow > 0.0 {
            std::thread::sleep(took.mul_f64(slow));
        }
        (r, real)
    }
}

/// The parts of a `model_len`-value flat model (`[params | optimizer state]`) that belong to
/// `layers`: for the GPT, the layers' parameters and each of their state tensors (AdamW's step
/// count rides with the layers that start at 0); other networks are one slice.
pub fn layer_slots(
    net: &Network,
    optim: &Optim,
    layers: LayerRange,
    model_len: usize,
) -> Vec<Range<usize>> {
    let Network::Gpt(g) = net else {
        return std::iter::once(0..model_len).collect();
    };
    let ranges = g.layer_ranges();
    let (lo, hi) = (layers.range().start, layers.range().end);
    if lo >= hi || hi > ranges.len() {
        return std::iter::once(model_len + 1..model_len + 1).collect();
    }
    let r = ranges[lo].start..ranges[hi - 1].end;
    let p = g.params();
    let tensors = optim.state_names().len();
    let mut out: Vec<Range<usize>> = (0..=tensors)
        .map(|k| k * p + r.start..k * p + r.end)
        .collect();
    if lo == 0 && optim.state_len(p) > tensors * p {
        let t = (tensors + 1) * p;
        out.push(t..t + 1);
    }
    out
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
    /// gets the GPT, the samples' tokens and the compute device.
    async fn stage_op<R: Send + 'static>(
        &self,
        step: u64,
        samples: Range<u64>,
        op: impl FnOnce(&crate::gpt::Gpt, &[f32], &candle_core::Device) -> candle_core::Result<R>
        + Send
        + 'static,
    ) -> Result<R, ComputeError> {
        let g = self
            .gpt()
            .ok_or(ComputeError::Unsupported(ravnest_runtime::seams::NO_STAGES))?;
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
                let t = Instant::now();
                let (tokens, _) = job.batch(samples);
                let r = op(&g, &tokens, &crate::device::current());
                let took = t.elapsed();
                if slowdown > 1.0 {
                    std::thread::sleep(took.mul_f64(slowdown - 1.0));
                }
                (r, took)
            })
            .await
            .ok_or_else(|| ComputeError::Backend("the compute thread is gone".into()))?;
        self.stats.lock().unwrap().real_compute_s += real.as_secs_f64();
        result.map_err(|e| ComputeError::Backend(format!("candle stage: {e}")))
    }
}

impl Compute for CandleCompute {
    fn initial_model(&self) -> Vec<f32> {
        if let Some((_, m)) = &self.resume {
            return m.clone();
        }
        let mut m = self.net.init(self.seed);
        m.resize(self.model_len(), 0.0);
        m
    }

    fn initial_version(&self) -> u64 {
        self.resume.as_ref().map_or(0, |r| r.0)
    }

    fn params(&self, _model_len: usize) -> usize {
        self.params()
    }

    fn buckets(&self, _params: usize) -> Vec<Range<usize>> {
        self.net.grad_buckets()
    }

    fn apply_update(&self, model: &mut [f32], range: Range<usize>, mean_gradient: &[f32]) {
        self.optim
            .step_range(model, self.params(), range, mean_gradient);
    }

    fn end_update(&self, model: &mut [f32]) {
        self.optim.end_step(model, self.params());
    }

    fn recycle(&self, buffer: Vec<f32>) {
        let mut spare = self.spare.lock().unwrap();
        if spare.len() < SPARE_BUFFERS {
            spare.push(buffer);
        }
    }

    fn param_range(&self, layers: LayerRange, model_len: usize) -> Range<usize> {
        match self.gpt() {
            Some(g) => {
                let r = g.layer_ranges();
                let (lo, hi) = (layers.range().start, layers.range().end);
                if lo >= hi || hi > r.len() {
                    // Out of range: an empty slice past the end, which the node refuses.
                    return model_len + 1..model_len + 1;
                }
                r[lo].start..r[hi - 1].end
            }
            None => 0..model_len,
        }
    }

    fn layer_slots(&self, layers: LayerRange, model_len: usize) -> Vec<Range<usize>> {
        layer_slots(&self.net, &self.optim, layers, model_len)
    }

    fn runs_stages(&self) -> bool {
        self.gpt().is_some()
    }

    async fn stage_forward(
        &self,
        _node: NodeId,
        step: u64,
        samples: Range<u64>,
        layers: LayerRange,
        params: &[f32],
        input: Option<&[f32]>,
    ) -> Result<Vec<f32>, ComputeError> {
        let rows = samples.end - samples.start;
        let kept_in = input.map_or(0, |i| i.len() as u64 * 4);
        self.count(layers, rows, kept_in)?;
        let (params, input) = (params.to_vec(), input.map(<[f32]>::to_vec));
        let out = self
            .stage_op(step, samples, move |g, tokens, dev| {
                let inp = match &input {
                    Some(h) => StageInput::Hidden(h),
                    None => StageInput::Tokens(tokens),
                };
                g.stage_forward(dev, layers.range(), &params, inp, Some(tokens))
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
        _node: NodeId,
        step: u64,
        samples: Range<u64>,
        layers: LayerRange,
        params: &[f32],
        input: Option<&[f32]>,
        _output: &[f32],
        grad_out: Option<&[f32]>,
    ) -> Result<(Vec<f32>, Vec<f32>), ComputeError> {
        let rows = samples.end - samples.start;
        self.count(layers, rows, 0)?;
        let kept = (input.map_or(0, <[f32]>::len) + _output.len()) as u64 * 4;
        let (params, input) = (params.to_vec(), input.map(<[f32]>::to_vec));
        let grad_out = grad_out.map(<[f32]>::to_vec);
        let (g, gin, loss) = self
            .stage_op(step, samples, move |g, tokens, dev| {
                let inp = match &input {
                    Some(h) => StageInput::Hidden(h),
                    None => StageInput::Tokens(tokens),
                };
                g.stage_backward(
                    dev,
                    layers.range(),
                    &params,
                    inp,
                    Some(tokens),
                    grad_out.as_deref(),
                )
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
        }
        Ok((g, gin))
    }

    async fn gradient_sum(
        &self,
        _node: NodeId,
        step: u64,
        samples: Range<u64>,
        model: Arc<Vec<f32>>,
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
        let (result, real) = self
            .worker
            .run(move || job.emulated(samples, &model, slowdown, &ready))
            .await
            .unwrap_or_else(|| {
                let e = ComputeError::Backend("the compute thread is gone".into());
                (Err(e), Duration::ZERO)
            });
        self.stats.lock().unwrap().real_compute_s += real.as_secs_f64();
        result
    }
}

#[cfg(test)]
mod ledger_tests {
    use super::*;

    #[test]
    fn a_stage_over_its_memory_budget_is_refused_with_the_figures() {
        let g = crate::gpt::Gpt {
            layers: 2,
            hidden: 32,
            heads: 2,
            seq: 8,
            vocab: 256,
        };
        let data = Dataset::bytes(&[b'a'; 400], "t", 8).unwrap();
        let optim = Optim {
            kind: ravnest_core::Optimizer::Adamw,
            lr: 1e-3,
            momentum: 0.9,
            weight_decay: 0.0,
        };
        let c = CandleCompute::new(Network::Gpt(g), Arc::new(data), optim, 1, 1.0);
        let all = LayerRange::new(0, 4);
        // No budget: counted, never refused.
        c.count(all, 4, 0).unwrap();
        let peak = c.ledger.lock().unwrap().peak;
        assert!(peak > 16 * g.params() as u64, "{peak}");
        c.ledger.lock().unwrap().budget = peak;
        c.count(all, 4, 0).unwrap();
        let e = c.count(all, 4, 1).unwrap_err().to_string();
        assert!(
            e.contains("memory budget exceeded") && e.contains("memory_gib"),
            "{e}"
        );
        // One layer needs less than the whole model.
        c.count(LayerRange::new(1, 2), 4, 0).unwrap();
    }
}

//! SimCompute: the simulated side of the [`Compute`] seam. A step costs virtual time from the
//! cost model (the node's fixed seconds per step + samples × seconds per sample on its device),
//! times the node's current slowdown, times seeded jitter; the gradient itself is the toy model's, computed for real.
//! Pipeline stages cost their layers' share of the model's FLOPs (a third forward, two thirds
//! backward) and compute the layered toy ([`Toy::Chain`]) for real.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use ravnest_core::cost::GradBucket;
use ravnest_core::{LayerRange, NodeId};
use ravnest_protocol::node::values::{ComputeError, Values};
use ravnest_runtime::Compute;
use ravnest_runtime::seams::{BucketSink, StagePass};

use crate::toy::{self, Toy};

use crate::rng::Rng;

/// Relative jitter of compute time (uniform in ±JITTER/2).
pub const JITTER: f64 = 0.04;

#[derive(Debug)]
struct State {
    toy: Toy,
    /// Cumulative share of the model's training FLOPs before each layer (L + 1 entries).
    flops_before: Vec<f64>,
    secs_per_sample: Vec<f64>,
    /// Seconds each data-parallel step costs a node whatever its batch (a measured profile's
    /// dispatch, update and report; 0 for catalog devices).
    fixed_s: Vec<f64>,
    /// Width of each node's uniform jitter (relative; [`JITTER`] unless a profile says).
    jitter: Vec<f64>,
    slowdown: Vec<f64>,
    rngs: Vec<Rng>,
    /// Per node: what its compute times were put on whole milliseconds off by, so far (ns;
    /// see [`crate::net::on_tick`]).
    carry_ns: Vec<i64>,
    /// The buckets a data-parallel step hands its gradient over in, and when (the real
    /// runtime's, from the cost model: [`ravnest_core::cost::grad_buckets`]).
    buckets: Vec<GradBucket>,
    copied_bytes: u64,
    /// Data-parallel computes (forward and backward) running now, on any node.
    computing: u32,
    /// Bucket updates applied while every node's data-parallel compute ran (see
    /// [`SimCompute::updates_in_backward`]).
    updates_in_backward: u64,
}

/// A data-parallel compute running: counted while it lives (a compute dropped half-way, its
/// step halted, ends too).
struct Computing<'a>(&'a SimCompute);

impl<'a> Computing<'a> {
    fn start(c: &'a SimCompute) -> Self {
        c.0.lock().unwrap().computing += 1;
        Computing(c)
    }
}

impl Drop for Computing<'_> {
    fn drop(&mut self) {
        self.0.0.lock().unwrap().computing -= 1;
    }
}

/// Simulated compute for every node of a cluster.
#[derive(Debug, Clone)]
pub struct SimCompute(Arc<Mutex<State>>);

impl SimCompute {
    /// `secs_per_sample[i]`: node i's training seconds per sample.
    pub fn new(secs_per_sample: Vec<f64>, seed: u64) -> Self {
        let n = secs_per_sample.len();
        SimCompute(Arc::new(Mutex::new(State {
            toy: Toy::Flat,
            flops_before: vec![0.0, 1.0],
            rngs: (0..n).map(|i| Rng::derive(seed, &[2, i as u64])).collect(),
            slowdown: vec![1.0; n],
            carry_ns: vec![0; n],
            fixed_s: vec![0.0; n],
            jitter: vec![JITTER; n],
            secs_per_sample,
            buckets: Vec::new(),
            copied_bytes: 0,
            computing: 0,
            updates_in_backward: 0,
        })))
    }

    /// Bucket updates applied while every node's data-parallel compute still ran (the updating
    /// node's own included). A node applies each bucket's sum as it comes back, while its
    /// backward goes on; were updates applied only once the node's compute had ended, there
    /// would be none.
    pub fn updates_in_backward(&self) -> u64 {
        self.0.lock().unwrap().updates_in_backward
    }

    /// Hand a data-parallel step's gradient over in `buckets` (in order, each when its share
    /// of backward is done), as the real runtime does for the model simulated: the cost
    /// model's [`ravnest_core::cost::grad_buckets`]. Without them: one bucket at the end.
    pub fn with_buckets(self, buckets: Vec<GradBucket>) -> Self {
        self.0.lock().unwrap().buckets = buckets;
        self
    }

    /// The toy gradient's buckets for a `params`-value gradient: each model bucket's element
    /// range (a layered toy's layers exactly; the flat toy's `DIM` values cut in proportion to
    /// the buckets' bytes, from the top, as backward produces them) and its share of backward
    /// done when it is handed over. A bucket too small for a toy value rides with the next.
    fn toy_buckets(&self, params: usize) -> Vec<(Range<usize>, f64)> {
        let s = self.0.lock().unwrap();
        if s.buckets.len() <= 1 || params < 2 {
            return vec![(0..params, 1.0)];
        }
        let mut out: Vec<(Range<usize>, f64)> = Vec::new();
        let mut hi = params;
        let mut above = 0.0;
        for b in &s.buckets {
            above += b.bytes_share;
            let lo = match s.toy {
                Toy::Chain { .. } => s.toy.param_range(b.layers).start.min(hi),
                Toy::Flat => params - ((above * params as f64).round() as usize).min(params),
            };
            if lo < hi {
                out.push((lo..hi, b.ready_at));
                hi = lo;
            }
        }
        match out.last_mut() {
            // The last bucket reaches down to the first value, at the end of backward.
            Some(last) => {
                last.0.start = 0;
                last.1 = 1.0;
            }
            None => out.push((0..params, 1.0)),
        }
        out
    }

    /// Charge node i `fixed_s[i]` seconds per data-parallel step on top of its samples (a
    /// measured profile's fixed per-step cost). Pipeline stages are charged per sample only:
    /// no profile measures a stage's fixed cost yet.
    pub fn with_fixed(self, fixed_s: Vec<f64>) -> Self {
        {
            let mut s = self.0.lock().unwrap();
            assert_eq!(
                fixed_s.len(),
                s.secs_per_sample.len(),
                "one figure per node"
            );
            s.fixed_s = fixed_s;
        }
        self
    }

    /// Train the layered toy, whose layer `l` costs `layer_flops[l]` (any unit: shares are
    /// what matter), so that pipeline stages can run.
    pub fn layered(self, layer_flops: &[f64]) -> Self {
        {
            let mut s = self.0.lock().unwrap();
            let total: f64 = layer_flops.iter().sum::<f64>().max(f64::MIN_POSITIVE);
            let mut acc = 0.0;
            s.flops_before = std::iter::once(0.0)
                .chain(layer_flops.iter().map(|f| {
                    acc += f / total;
                    acc
                }))
                .collect();
            s.toy = Toy::Chain {
                layers: layer_flops.len(),
            };
        }
        self
    }

    /// Draw node i's step times with relative standard deviation `spread[i]` (a measured
    /// profile's; 0 keeps [`JITTER`]): uniform, so the width is √12 × spread, capped so that
    /// no step takes less than a twentieth of its mean. A step waits for the slowest node, so
    /// noise slows it as in the real run.
    pub fn with_spread(self, spread: &[f64]) -> Self {
        {
            let mut s = self.0.lock().unwrap();
            for (j, &sd) in s.jitter.iter_mut().zip(spread) {
                if sd > 0.0 {
                    *j = ravnest_core::cost::sim_width(sd);
                }
            }
        }
        self
    }

    /// The toy model this compute trains.
    pub fn toy(&self) -> Toy {
        self.0.lock().unwrap().toy
    }

    /// Virtual seconds for `node` to run `share` of the full training FLOPs of `samples`
    /// samples (plus `fixed` times its fixed per-step cost), with its slowdown and jitter.
    fn secs(&self, node: NodeId, samples: u64, share: f64, fixed: Fixed) -> f64 {
        let mut s = self.0.lock().unwrap();
        let i = node.index();
        let u = s.rngs[i].unit();
        let fixed_s = match fixed {
            Fixed::Charged if samples > 0 => s.fixed_s[i],
            _ => 0.0,
        };
        let exact = (fixed_s + samples as f64 * share * s.secs_per_sample[i])
            * s.slowdown[i]
            * (1.0 + s.jitter[i] * (u - 0.5));
        crate::net::on_tick((exact * 1e9) as u64, &mut s.carry_ns[i], 0) as f64 / 1e9
    }

    fn layer_share(&self, layers: LayerRange) -> Result<f64, ComputeError> {
        let s = self.0.lock().unwrap();
        let Toy::Chain { layers: total } = s.toy else {
            return Err(ComputeError::Shape(
                "the simulated model is not layered (the run was planned data-parallel)".into(),
            ));
        };
        let r = layers.range();
        if r.start >= r.end || r.end > total {
            return Err(ComputeError::Shape(format!(
                "layers {layers} of a {total}-layer model"
            )));
        }
        Ok(s.flops_before[r.end] - s.flops_before[r.start])
    }

    /// Multiply node's compute time by `factor` from now on (1.0 = normal).
    pub fn set_slowdown(&self, node: NodeId, factor: f64) {
        self.0.lock().unwrap().slowdown[node.index()] = factor;
    }
}

/// Whether a compute call pays the node's fixed per-step cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fixed {
    /// A whole data-parallel step: it does.
    Charged,
    /// A pipeline stage's micro-batch: it does not (see [`SimCompute::with_fixed`]).
    NotCharged,
}

/// Share of a layer range's training FLOPs spent in its forward pass (the cost model's).
pub const FORWARD_SHARE: f64 = ravnest_core::cost::FORWARD_SHARE;

/// The simulated model: the toy's whole vector on every node (a stage keeps only its layers
/// current). Cheap enough to copy when a version is updated while another holds it.
pub type SimModel = Arc<Vec<f32>>;

impl SimCompute {
    /// The values of `layers` (`None`: all) of `model`, in flat order.
    fn parts<'a>(&self, model: &'a [f32], layers: Option<LayerRange>) -> Option<&'a [f32]> {
        match layers {
            None => Some(model),
            Some(l) => model.get(self.toy().param_range(l)),
        }
    }

    /// `model`, to be changed: a copy when another version shares it (counted).
    fn own<'a>(&self, model: &'a mut SimModel) -> &'a mut Vec<f32> {
        if Arc::strong_count(model) > 1 {
            self.0.lock().unwrap().copied_bytes += 4 * model.len() as u64;
        }
        Arc::make_mut(model)
    }
}

impl Values for SimCompute {
    type Model = SimModel;
    type StageGrad = Vec<f32>;

    fn model_len(&self) -> usize {
        self.toy().initial_model().len()
    }

    fn params(&self) -> usize {
        self.model_len()
    }

    fn initial(&self, _layers: Option<LayerRange>) -> SimModel {
        Arc::new(self.toy().initial_model())
    }

    fn export(&self, model: &SimModel, layers: Option<LayerRange>) -> Option<Vec<f32>> {
        self.parts(model, layers).map(<[f32]>::to_vec)
    }

    fn import(
        &self,
        base: Option<&SimModel>,
        layers: Option<LayerRange>,
        values: Vec<f32>,
    ) -> Result<SimModel, ComputeError> {
        let mut m = base.map_or_else(|| self.toy().initial_model(), |b| b.to_vec());
        let r = layers.map_or(0..m.len(), |l| self.toy().param_range(l));
        let len = m.len();
        match m.get_mut(r.clone()) {
            Some(dst) if dst.len() == values.len() => dst.copy_from_slice(&values),
            _ => {
                return Err(ComputeError::Shape(format!(
                    "{} values for {r:?} of a {len}-value model",
                    values.len(),
                )));
            }
        }
        Ok(Arc::new(m))
    }

    fn digest(&self, model: &SimModel, layers: Option<LayerRange>) -> u64 {
        self.parts(model, layers)
            .map_or(0, ravnest_protocol::digest::digest)
    }

    fn param_range(&self, layers: LayerRange) -> Range<usize> {
        self.toy().param_range(layers)
    }

    fn stage_grad_values(&self, grad: Vec<f32>, scale: f32) -> Vec<f32> {
        grad.into_iter().map(|x| x * scale).collect()
    }

    fn apply_stage_grad(
        &self,
        model: &mut SimModel,
        layers: LayerRange,
        grad: Vec<f32>,
        scale: f32,
    ) -> Result<(), ComputeError> {
        let mean = self.stage_grad_values(grad, scale);
        self.apply_update(model, self.toy().param_range(layers), &mean)
    }

    /// The buckets the real runtime hands the simulated model's gradient over in
    /// ([`SimCompute::with_buckets`]), so the simulator overlaps communication with compute
    /// exactly as far as the real runtime does and the cost model says.
    fn buckets(&self) -> Vec<Range<usize>> {
        self.toy_buckets(self.params())
            .into_iter()
            .map(|b| b.0)
            .collect()
    }

    fn set_params(
        &self,
        model: &mut SimModel,
        range: Range<usize>,
        values: &[f32],
    ) -> Result<(), ComputeError> {
        let m = self.own(model);
        let len = m.len();
        match m.get_mut(range.clone()) {
            Some(w) if w.len() == values.len() => {
                w.copy_from_slice(values);
                Ok(())
            }
            _ => Err(ComputeError::Shape(format!(
                "{} values for {range:?} of a {len}-value model",
                values.len(),
            ))),
        }
    }

    fn apply_update(
        &self,
        model: &mut SimModel,
        range: Range<usize>,
        mean_gradient: &[f32],
    ) -> Result<(), ComputeError> {
        {
            let mut s = self.0.lock().unwrap();
            if s.computing as usize == s.secs_per_sample.len() {
                s.updates_in_backward += 1;
            }
        }
        let m = self.own(model);
        let len = m.len();
        match m.get_mut(range.clone()) {
            Some(w) if w.len() == mean_gradient.len() => {
                toy::apply(w, mean_gradient);
                Ok(())
            }
            _ => Err(ComputeError::Shape(format!(
                "an update of {} values for {range:?} of a {len}-value model",
                mean_gradient.len(),
            ))),
        }
    }
}

impl Compute for SimCompute {
    fn state_stats(&self) -> ravnest_runtime::seams::StateStats {
        let copied_bytes = self.0.lock().unwrap().copied_bytes;
        ravnest_runtime::seams::StateStats {
            copied_bytes,
            ..Default::default()
        }
    }

    fn runs_stages(&self) -> bool {
        matches!(self.toy(), Toy::Chain { .. })
    }

    async fn stage_forward(
        &self,
        pass: StagePass<'_>,
        model: &SimModel,
    ) -> Result<Vec<f32>, ComputeError> {
        let StagePass {
            node,
            samples,
            layers,
            input,
            ..
        } = pass;
        let share = self.layer_share(layers)?;
        let params = model
            .get(self.toy().param_range(layers))
            .unwrap_or_default();
        let n = samples.end - samples.start;
        if params.len() != layers.len() * toy::DIM
            || input.is_some_and(|x| x.len() != n as usize * toy::DIM)
        {
            return Err(ComputeError::Shape(format!(
                "stage forward of layers {layers}: {} parameters and {:?} inputs do not fit {n} samples",
                params.len(),
                input.map(<[f32]>::len)
            )));
        }
        let secs = self.secs(node, n, share * FORWARD_SHARE, Fixed::NotCharged);
        tokio::time::sleep(std::time::Duration::from_nanos((secs * 1e9) as u64)).await;
        Ok(toy::chain_forward(samples, layers, params, input))
    }

    async fn stage_backward(
        &self,
        pass: StagePass<'_>,
        _model: &SimModel,
        acc: Option<Vec<f32>>,
    ) -> Result<(Vec<f32>, Vec<f32>), ComputeError> {
        let StagePass {
            node,
            samples,
            layers,
            output,
            grad_out,
            ..
        } = pass;
        let share = self.layer_share(layers)?;
        let n = samples.end - samples.start;
        let want = n as usize * toy::DIM;
        if output.len() != want || grad_out.is_some_and(|g| g.len() != want) {
            return Err(ComputeError::Shape(format!(
                "stage backward of layers {layers}: output of {} values and gradient of {:?} do not fit {n} samples",
                output.len(),
                grad_out.map(<[f32]>::len)
            )));
        }
        let secs = self.secs(node, n, share * (1.0 - FORWARD_SHARE), Fixed::NotCharged);
        tokio::time::sleep(std::time::Duration::from_nanos((secs * 1e9) as u64)).await;
        let (g, grad_in) = toy::chain_backward(samples, layers, output, grad_out);
        // Summed as a runtime that starts from zeros would (the same bits).
        let mut sum = acc.unwrap_or_else(|| vec![0.0; g.len()]);
        if sum.len() != g.len() {
            return Err(ComputeError::Shape(format!(
                "the backward of layers {layers} gave {} gradient values for {}",
                g.len(),
                sum.len()
            )));
        }
        for (a, b) in sum.iter_mut().zip(&g) {
            *a += b;
        }
        Ok((sum, grad_in))
    }

    async fn gradient_sum(
        &self,
        node: NodeId,
        _step: u64,
        samples: Range<u64>,
        model: SimModel,
        ready: BucketSink,
    ) -> Result<(), ComputeError> {
        let _computing = Computing::start(self);
        let secs = self.secs(node, samples.end - samples.start, 1.0, Fixed::Charged);
        // Each phase ends at its time from the step's start: tokio's timer rounds every
        // sleep up to its next millisecond, and phases slept one after another would add that
        // up (a 20 ms step of three phases took 21.5 ms on average).
        let start = tokio::time::Instant::now();
        let until = |s: f64| {
            tokio::time::sleep_until(start + std::time::Duration::from_nanos((s * 1e9) as u64))
        };
        until(secs * FORWARD_SHARE).await;
        let g = self.toy().gradient_sum(samples, &model);
        // Backward produces the buckets in order, each when its share of backward is done.
        for (k, (r, done)) in self.toy_buckets(g.len()).into_iter().enumerate() {
            until(secs * (FORWARD_SHARE + ravnest_core::cost::BACKWARD_SHARE * done)).await;
            ready(k, g[r].to_vec());
        }
        Ok(())
    }
}

//! A gradient's work, owned, for the compute thread: the samples' rows in the run's order,
//! the forward and backward of the node's network over them (the hand-written CPU pass where
//! there is one), and an emulated slower device.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use ravnest_runtime::seams::{BucketSink, ComputeError};

use super::Stats;
use crate::data::Dataset;
use crate::gpt::StageInput;
use crate::net::Network;
use crate::state::{CandleModel, ModelState};

/// The part of a [`CandleCompute`](super::CandleCompute) a gradient needs, owned.
#[derive(Debug, Clone)]
pub(super) struct Job {
    pub(super) net: Network,
    pub(super) data: Arc<Dataset>,
    pub(super) seed: u64,
    pub(super) perm: Arc<Mutex<(u64, Vec<u32>)>>,
    pub(super) stats: Arc<Mutex<Stats>>,
    pub(super) spare: Arc<Mutex<Vec<Vec<f32>>>>,
    pub(super) state: Arc<ModelState>,
}

/// Buffers kept for reuse (gradient buckets, a stage's gradient sums).
pub(super) type Spare = Arc<Mutex<Vec<Vec<f32>>>>;

/// Gradient buffers kept for reuse, at most.
pub(super) const SPARE_BUFFERS: usize = 16;

impl Job {
    pub(super) fn row(&self, s: u64) -> usize {
        let n = self.data.len() as u64;
        let epoch = s / n;
        let mut p = self.perm.lock().unwrap();
        if p.0 != epoch {
            *p = (
                epoch,
                crate::data::epoch_order(self.seed, epoch, n as usize),
            );
        }
        p.1[(s % n) as usize] as usize
    }

    /// The samples' inputs and labels (a corpus's windows read from disk; their labels 0).
    pub(super) fn batch(&self, samples: Range<u64>) -> Result<(Vec<f32>, Vec<u32>), ComputeError> {
        let f = self.data.features;
        let mut x = Vec::with_capacity((samples.end - samples.start) as usize * f);
        let mut y = Vec::with_capacity((samples.end - samples.start) as usize);
        for s in samples {
            let r = self.row(s);
            self.data
                .row_into(r, &mut x)
                .map_err(|e| ComputeError::Backend(e.to_string()))?;
            y.push(self.data.y.get(r).copied().unwrap_or(0));
        }
        Ok((x, y))
    }

    pub(super) fn gradient_buckets(
        &self,
        samples: Range<u64>,
        model: &CandleModel,
        sink: &mut dyn FnMut(usize, Vec<f32>),
    ) -> Result<f64, ComputeError> {
        let (x, y) = self.batch(samples)?;
        let spare = &self.spare;
        let mut zeroed = |n: usize| {
            let mut buf = spare.lock().unwrap().pop().unwrap_or_default();
            buf.clear();
            buf.resize(n, 0.0);
            buf
        };
        let dev = crate::device::current();
        let all = 0..self.state.layout.tensors.len();
        let vars = self.state.vars(model, all, &dev)?;
        let failed =
            |e: candle_core::Error| ComputeError::Backend(format!("candle forward/backward: {e}"));
        let loss = match &self.net {
            Network::Gpt(g) => {
                // One bucket: the whole gradient, in the flat order.
                let p = by_layer(g, &vars);
                let all = 0..g.planner_layers();
                let mut buf = zeroed(self.state.layout.params);
                let loss = if dev.is_cpu() {
                    // Written in place into the bucket, tensor by tensor.
                    let mut slices: Vec<&mut [f32]> = Vec::new();
                    let mut rest = buf.as_mut_slice();
                    for t in &self.state.layout.tensors {
                        let (mine, more) = rest.split_at_mut(t.len);
                        slices.push(mine);
                        rest = more;
                    }
                    let ts = detached(&p);
                    let refs: Vec<&[Tensor]> = ts.iter().map(Vec::as_slice).collect();
                    g.fast_backward(all, &refs, StageInput::Tokens(&x), None, None, &mut slices)
                        .map_err(failed)?
                        .1
                } else {
                    let (grads, _, loss) = g
                        .stage_backward_with(&dev, all, &p, StageInput::Tokens(&x), None, None)
                        .map_err(failed)?;
                    let mut at = 0;
                    for t in &grads {
                        let n = t.elem_count();
                        crate::state::read(t, |v| buf[at..at + n].copy_from_slice(v))?;
                        at += n;
                    }
                    loss
                };
                sink(0, buf);
                loss
            }
            net => net
                .loss_and_grad_buckets_held(&dev, &vars, &x, &y, sink, &mut zeroed)
                .map_err(failed)?,
        };
        let mut s = self.stats.lock().unwrap();
        s.last_loss = loss / y.len().max(1) as f64;
        s.samples += y.len() as u64;
        Ok(loss)
    }

    /// The gradient with an emulated slower device: each bucket is handed over (k − 1) times
    /// its compute time later, as a device k times slower would (a precise thread sleep:
    /// tokio's timer has 1 ms granularity, a large error on steps of a few ms).
    pub(super) fn emulated(
        &self,
        samples: Range<u64>,
        model: &CandleModel,
        slowdown: f64,
        ready: &BucketSink,
    ) -> (Result<f64, ComputeError>, Duration) {
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

/// The tensors of variables grouped by layer, detached (what the hand-written CPU pass reads:
/// no autograd graph is built on them).
pub(super) fn detached(p: &[Vec<candle_core::Var>]) -> Vec<Vec<Tensor>> {
    p.iter()
        .map(|l| l.iter().map(|v| v.as_tensor().detach()).collect())
        .collect()
}

/// A GPT's parameter variables (the whole model's, in flat order) grouped by layer.
pub(super) fn by_layer(
    g: &crate::gpt::Gpt,
    vars: &[candle_core::Var],
) -> Vec<Vec<candle_core::Var>> {
    let mut rest = vars;
    (0..g.planner_layers())
        .map(|l| {
            let n = g.layer_params(l).len().min(rest.len());
            let (this, more) = rest.split_at(n);
            rest = more;
            this.to_vec()
        })
        .collect()
}

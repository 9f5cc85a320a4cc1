//! Calibration: how long this node's training step takes as a function of its batch, measured
//! in place before the coordinator plans (every node at once, so that contention is in the
//! figures). Steps of the batch and of a quarter of it alternate; a line through the two means
//! gives the fixed cost per step and the cost per sample ([`fit_line`], pure); then full steps
//! alone give the solo figure the line is scaled to.
//!
//! What a step is comes from the backend ([`Probe`]): the whole model's training step, or, for
//! a model too big for this node, the forward and backward of a few of its layers standing for
//! it by their share of the model's work. So a model no node can hold is never built whole to
//! be measured, here or anywhere.

use std::sync::Arc;

use ravnest_core::NodeId;
use tokio::time::Instant;

use crate::seams::{Compute, Probe, StagePass};

/// (seconds per sample, fixed seconds per step) of the line through a mean step time `t1` at
/// batch `b1` and `t2` at `b2`; all per sample when noise hid the fixed cost.
pub fn fit_line(t1: f64, b1: f64, t2: f64, b2: f64) -> (f64, f64) {
    let slope = if b1 > b2 { (t1 - t2) / (b1 - b2) } else { 0.0 };
    if slope > 0.0 && t1 - slope * b1 >= 0.0 {
        (slope, t1 - slope * b1)
    } else {
        (t1 / b1.max(1.0), 0.0)
    }
}

/// What calibrating runs a step on: the model version it starts from, a scratch version the
/// optimizer is applied to (so that the measured step includes it, and the model is left as it
/// was), and what the backend said a step is. A probe of layers is made for the bench alone:
/// it is its own scratch (`model` is `None`), so the optimizer updates it in place instead of
/// copying it.
pub struct Bench<C: Compute> {
    compute: Arc<C>,
    node: NodeId,
    probe: Probe,
    model: Option<C::Model>,
    scratch: C::Model,
}

impl<C: Compute> std::fmt::Debug for Bench<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bench")
            .field("node", &self.node)
            .field("probe", &self.probe)
            .finish()
    }
}

impl<C: Compute> Bench<C> {
    /// A bench on `model` (`None`: the initial model), or for a model too big for this node,
    /// on the layers the backend names.
    pub fn new(compute: Arc<C>, node: NodeId, model: Option<C::Model>) -> Self {
        let probe = compute.probe();
        let (model, scratch) = match (&probe, model) {
            (Probe::Layers { layers, .. }, _) => (None, compute.initial(Some(*layers))),
            (Probe::Whole, Some(m)) => (Some(m.clone()), m),
            (Probe::Whole, None) => {
                let m = compute.initial(None);
                (Some(m.clone()), m)
            }
        };
        Bench {
            scratch,
            compute,
            node,
            probe,
            model,
        }
    }

    /// Seconds of one training step of `batch` samples (step number `k`), whole-model
    /// equivalent.
    pub async fn step(&mut self, batch: u64, k: u64) -> f64 {
        let t = Instant::now();
        match self.probe {
            Probe::Whole => self.whole(batch, k).await,
            Probe::Layers {
                layers,
                share,
                micro,
                input,
            } => {
                self.layers(batch, k, layers, micro.max(1), input).await;
                return t.elapsed().as_secs_f64() / share.max(1e-9);
            }
        }
        t.elapsed().as_secs_f64()
    }

    async fn whole(&mut self, batch: u64, k: u64) {
        let Some(model) = self.model.clone() else {
            return;
        };
        // Each bucket's gradient comes from the compute thread and is applied to the scratch
        // version here as it comes, as a step applies its reduced buckets.
        let (compute, scratch) = (&self.compute, &mut self.scratch);
        let buckets = compute.buckets();
        let pass = |sink| compute.gradient_sum(self.node, k, 0..batch, model, sink);
        let _ = crate::seams::with_buckets(pass, |b, g| {
            if let Some(r) = buckets.get(b) {
                let _ = compute.apply_update(scratch, r.clone(), &g);
            }
        })
        .await;
        self.compute.end_update(&mut self.scratch);
    }

    /// Forward and backward of `layers` over `batch` samples in micro-batches, then the
    /// optimizer on the scratch version. `input`: values per sample of the layers' input
    /// (0: they start from the samples themselves); the output's gradient is made up (ones).
    async fn layers(
        &mut self,
        batch: u64,
        k: u64,
        layers: ravnest_core::LayerRange,
        micro: u64,
        input: usize,
    ) {
        let (c, node) = (&self.compute, self.node);
        // A handle for the passes, let go before the optimizer updates the probe in place.
        let model = self.scratch.clone();
        let mut acc = None;
        let mut start = 0;
        while start < batch {
            let end = (start + micro).min(batch);
            let rows = (end - start) as usize;
            let x = (input > 0).then(|| vec![0.1f32; rows * input]);
            let pass = |output, grad_out| StagePass {
                node,
                step: k,
                samples: start..end,
                layers,
                input: x.as_deref(),
                output,
                grad_out,
            };
            let Ok(out) = c.stage_forward(pass(&[], None), &model).await else {
                return;
            };
            let grad_out = (out.len() > 1).then(|| vec![1e-3f32; out.len()]);
            match c
                .stage_backward(pass(&out, grad_out.as_deref()), &model, acc.take())
                .await
            {
                Ok((g, _)) => acc = Some(g),
                Err(_) => return,
            }
            start = end;
        }
        drop(model);
        if let Some(g) = acc {
            let scale = 1.0 / batch.max(1) as f32;
            let _ = self
                .compute
                .apply_stage_grad(&mut self.scratch, layers, g, scale);
        }
    }
}

/// The calibration's figures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calibrated {
    /// Samples per second at the batch asked for, alone (every node measuring at once).
    pub samples_per_s: f64,
    /// Seconds per sample of the fitted line, scaled to the solo figure.
    pub per_sample_s: f64,
    /// Fixed seconds per step, likewise.
    pub overhead_s: f64,
}

/// Calibrate `bench` at `batch` for about `duration_ms`: the line through steps of the batch and
/// of a quarter of it (first half), scaled to full steps alone (second half).
pub async fn calibrate<C: Compute>(
    bench: &mut Bench<C>,
    batch: u64,
    duration_ms: u64,
) -> Calibrated {
    let sizes = [batch.max(1), (batch / 4).max(1)];
    bench.step(sizes[0], 0).await;
    let half = u128::from(duration_ms / 2);
    let start = Instant::now();
    let (mut spent, mut runs, mut k) = ([0.0f64; 2], [0u32; 2], 0u64);
    while k < 4 || (start.elapsed().as_millis() < half && k < 10_000) {
        let which = (k % 2) as usize;
        spent[which] += bench.step(sizes[which], k).await;
        runs[which] += 1;
        k += 1;
    }
    let mean = |i: usize| spent[i] / f64::from(runs[i].max(1));
    let (b1, b2) = (sizes[0] as f64, sizes[1] as f64);
    let (per_sample_s, overhead_s) = fit_line(mean(0), b1, mean(1), b2);
    // Full steps only, every node at once, as training loads the machine (small steps load
    // it less, so the first half runs a little fast): the solo figure, and the line's scale.
    let start = Instant::now();
    let (mut full, mut n) = (0.0f64, 0u32);
    while n < 2 || (start.elapsed().as_millis() < half && n < 10_000) {
        full += bench.step(sizes[0], k).await;
        n += 1;
        k += 1;
    }
    let full = full / f64::from(n);
    let scale = full / (overhead_s + per_sample_s * b1).max(1e-12);
    Calibrated {
        samples_per_s: b1 / full.max(1e-12),
        per_sample_s: per_sample_s * scale,
        overhead_s: overhead_s * scale,
    }
}

/// What node `node` reports of its training step time as a function of its batch
/// ([`calibrate`]), measured from `model` (its latest version; `None`: the initial model), the
/// optimizer applied to a scratch version.
pub async fn measured<C: Compute>(
    compute: Arc<C>,
    node: NodeId,
    model: Option<C::Model>,
    batch: u64,
    duration_ms: u64,
) -> ravnest_protocol::msg::Envelope {
    let mut bench = Bench::new(compute, node, model);
    let c = calibrate(&mut bench, batch, duration_ms).await;
    ravnest_protocol::msg::Envelope::Measured {
        samples_per_s: c.samples_per_s,
        per_sample_s: c.per_sample_s,
        overhead_s: c.overhead_s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_through_two_batches_splits_fixed_and_per_sample_cost() {
        let (per, fixed) = fit_line(0.012, 40.0, 0.006, 10.0);
        assert!((per - 0.0002).abs() < 1e-12 && (fixed - 0.004).abs() < 1e-12);
        // Noise that makes the small batch slower: all per sample.
        assert_eq!(fit_line(0.010, 40.0, 0.011, 10.0), (0.010 / 40.0, 0.0));
    }
}

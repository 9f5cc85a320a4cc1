//! SimCompute: the simulated side of the [`Compute`] seam. A step costs virtual time from the
//! cost model (samples × seconds per sample on the node's device), times the node's current
//! slowdown, times seeded jitter; the gradient itself is the toy model's, computed for real.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use ravnest_core::NodeId;
use ravnest_runtime::Compute;
use ravnest_runtime::toy;

use crate::rng::Rng;

/// Relative jitter of compute time (uniform in ±JITTER/2).
pub const JITTER: f64 = 0.04;

#[derive(Debug)]
struct State {
    secs_per_sample: Vec<f64>,
    slowdown: Vec<f64>,
    rngs: Vec<Rng>,
}

/// Simulated compute for every node of a cluster.
#[derive(Debug, Clone)]
pub struct SimCompute(Arc<Mutex<State>>);

impl SimCompute {
    /// `secs_per_sample[i]`: node i's training seconds per sample.
    pub fn new(secs_per_sample: Vec<f64>, seed: u64) -> Self {
        let n = secs_per_sample.len();
        SimCompute(Arc::new(Mutex::new(State {
            rngs: (0..n).map(|i| Rng::derive(seed, &[2, i as u64])).collect(),
            slowdown: vec![1.0; n],
            secs_per_sample,
        })))
    }

    /// Multiply node's compute time by `factor` from now on (1.0 = normal).
    pub fn set_slowdown(&self, node: NodeId, factor: f64) {
        self.0.lock().unwrap().slowdown[node.index()] = factor;
    }
}

impl Compute for SimCompute {
    fn initial_model(&self) -> Vec<f32> {
        toy::initial_model()
    }

    fn apply_update(&self, model: &mut [f32], mean_gradient: &[f32]) {
        toy::apply(model, mean_gradient);
    }

    async fn gradient_sum(
        &self,
        node: NodeId,
        _step: u64,
        samples: Range<u64>,
        model: &[f32],
    ) -> Vec<f32> {
        let secs = {
            let mut s = self.0.lock().unwrap();
            let i = node.index();
            let u = s.rngs[i].unit();
            (samples.end - samples.start) as f64
                * s.secs_per_sample[i]
                * s.slowdown[i]
                * (1.0 + JITTER * (u - 0.5))
        };
        tokio::time::sleep(std::time::Duration::from_nanos((secs * 1e9) as u64)).await;
        toy::gradient_sum(samples, model)
    }
}

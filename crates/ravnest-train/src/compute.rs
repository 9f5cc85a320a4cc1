//! The real side of the [`Compute`] seam: candle forward/backward on this node's samples.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;
use ravnest_core::NodeId;
use ravnest_runtime::Compute;

use crate::data::Dataset;
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
    perm: Mutex<(u64, Vec<u32>)>,
    stats: Mutex<Stats>,
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
            perm: Mutex::new((u64::MAX, Vec::new())),
            stats: Mutex::default(),
        }
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

    /// Row of the training set that global sample index `s` reads: each pass over the data
    /// ("epoch") is a seeded permutation.
    pub fn row(&self, s: u64) -> usize {
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

    /// The batch for global sample indices `samples`: (features, labels).
    pub fn batch(&self, samples: Range<u64>) -> (Vec<f32>, Vec<u32>) {
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

    /// The gradient sum, synchronously (for tests and the single-node baseline).
    pub fn gradient_sum_now(&self, samples: Range<u64>, model: &[f32]) -> Vec<f32> {
        let (x, y) = self.batch(samples);
        let (loss, g) = self
            .net
            .loss_and_grad_sum(&model[..self.params()], &x, &y)
            .unwrap_or_else(|e| panic!("candle forward/backward failed: {e}"));
        let mut s = self.stats.lock().unwrap();
        s.last_loss = loss / y.len().max(1) as f64;
        s.samples += y.len() as u64;
        g
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

    fn apply_update(&self, model: &mut [f32], mean_gradient: &[f32]) {
        self.optim.step(model, mean_gradient);
    }

    async fn gradient_sum(
        &self,
        _node: NodeId,
        _step: u64,
        samples: Range<u64>,
        model: &[f32],
    ) -> Vec<f32> {
        if samples.is_empty() {
            return vec![0.0; self.params()];
        }
        let t = Instant::now();
        // Candle is blocking, CPU-bound work: keep it off the runtime's I/O threads.
        let g = tokio::task::block_in_place(|| self.gradient_sum_now(samples, model));
        let took = t.elapsed();
        self.stats.lock().unwrap().real_compute_s += took.as_secs_f64();
        if self.slowdown > 1.0 {
            tokio::time::sleep(Duration::from_secs_f64(
                took.as_secs_f64() * (self.slowdown - 1.0),
            ))
            .await;
        }
        g
    }
}

//! The cost model: how long a node computes, how much memory it needs, how long a transfer or a
//! collective takes. Every assumption is listed in `docs/cost-model.md`; in short:
//!
//! - compute time = samples × 3 × forward FLOPs ÷ the node's effective FLOP/s (backward = 2x
//!   forward, no recomputation; the optimizer update is not charged: Sailor measures it at 1–3%
//!   of a step);
//! - memory = parameters × state bytes (weights, gradients, optimizer state, fp32 master weights
//!   under mixed precision) + activations retained for backward × samples in flight;
//! - transfer time = latency + bytes ÷ bandwidth;
//! - ring all-reduce = 2(n-1)/n · S ÷ B_slowest + 2(n-1) · latency;
//! - parameter server = 2 · max((n-1) · S ÷ B_server, slowest worker's transfer of S);
//! - data-parallel gradient rounds overlap the backward pass only as far as the runtime hands
//!   the gradient over in buckets while backward still runs ([`grad_buckets`], the same list
//!   the simulator uses): an MLP's per-layer buckets can hide behind the rest of backward, a
//!   model whose backend returns the whole gradient at once (every other model today) cannot,
//!   so its step is compute + round ([`bucketed_step_s`]); pipeline stage rounds and local-SGD
//!   averaging rounds are not overlapped; pipeline activation transfers add to the stage time.

use crate::cluster::{ClusterSpec, Link, NodeId, TrainingSpec};
use crate::layers::LayerRange;
use crate::model::{ModelSpec, state_bytes_per_param};

/// Share of a training step's compute spent in the backward pass (backward = 2x forward).
pub const BACKWARD_SHARE: f64 = 2.0 / 3.0;

/// Share of a training step's compute spent in the forward pass.
pub const FORWARD_SHARE: f64 = 1.0 / 3.0;

/// An MLP's smallest gradient bucket (parameters): smaller layers ride with the one before
/// them (the last one with the one below it), so a bucket's round is not all latency. The
/// CPU backend's hand-written backward (`ravnest-train`, `Network::grad_buckets`) cuts its
/// buckets with this figure.
pub const BUCKET_MIN_PARAMS: u64 = 1 << 16;

/// One gradient bucket, as the runtime's backward hands it to the all-reduce.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GradBucket {
    /// Its layers.
    pub layers: LayerRange,
    /// Share of the backward pass done when it is handed over (backward runs from the last
    /// layer down, so the buckets come last layers first; 1 for the last bucket).
    pub ready_at: f64,
    /// Its share of the gradient's bytes.
    pub bytes_share: f64,
}

/// Whether `model` is an MLP as [`crate::model::mlp_spec`] lays it out (layers `fc0`, `fc1`,
/// ... in order).
pub fn is_mlp(model: &ModelSpec) -> bool {
    !model.layers.is_empty()
        && model
            .layers
            .iter()
            .enumerate()
            .all(|(i, l)| l.name == format!("fc{i}"))
}

/// The buckets the runtime's data-parallel backward hands to the all-reduce, in the order it
/// hands them over. What the real backends do:
///
/// - an MLP (the CPU backend's hand-written backward, `ravnest-train`'s `mlp.rs`): one bucket
///   per layer from the last down, each merged with the layers below it until it holds
///   [`BUCKET_MIN_PARAMS`] parameters, handed over as soon as backward has its lowest layer's
///   weight gradient (before the gradient through that layer's weights);
/// - every other model (candle's autograd returns the whole gradient at once): one bucket,
///   when backward is done; nothing of its round can hide behind compute. (The CPU backend's
///   hand-written decoder backward hands a GPT's or Llama's gradient over layer by layer, as
///   an MLP's; a CUDA backend does not. The model charges the decoder's round as exposed, as
///   on a GPU: on the CPU it is an upper bound.)
///
/// The cost model charges these ([`bucketed_step_s`]) and the simulator hands its gradient
/// over in the same buckets at the same moments, so plan, simulation and run agree.
pub fn grad_buckets(model: &ModelSpec) -> Vec<GradBucket> {
    let layers = model.layers.len();
    let params =
        |r: std::ops::Range<usize>| -> u64 { model.layers[r].iter().map(|l| l.params).sum() };
    let flops = |r: std::ops::Range<usize>| -> f64 {
        model.layers[r].iter().map(|l| l.fwd_flops_per_sample).sum()
    };
    let (all_params, all_flops) = (params(0..layers).max(1), flops(0..layers));
    if !is_mlp(model) || layers == 0 {
        return vec![GradBucket {
            layers: LayerRange::from(0..layers),
            ready_at: 1.0,
            bytes_share: 1.0,
        }];
    }
    let mut out = Vec::new();
    let mut hi = layers;
    while hi > 0 {
        let mut lo = hi - 1;
        while lo > 0 && params(lo..hi) < BUCKET_MIN_PARAMS {
            lo -= 1;
        }
        // Backward costs each layer its weights' gradient and, above the first layer, the
        // gradient through its weights (each as much as its forward); a bucket goes out when its
        // lowest layer's weight gradient is done, before the gradient through that layer.
        let total = 2.0 * all_flops - flops(0..1);
        let done = if total > 0.0 {
            (2.0 * flops(lo + 1..layers) + flops(lo..lo + 1)) / total
        } else {
            (layers - lo) as f64 / layers as f64
        };
        out.push(GradBucket {
            layers: LayerRange::from(lo..hi),
            ready_at: if lo == 0 { 1.0 } else { done },
            bytes_share: params(lo..hi) as f64 / all_params as f64,
        });
        hi = lo;
    }
    out
}

/// The widest relative jitter the simulator draws (no step takes less than a twentieth of its
/// mean).
pub const SIM_MAX_WIDTH: f64 = 1.9;

/// The width of the uniform draw (relative to the mean) with which the simulator gives a node of
/// relative standard deviation `spread` its step times: √12 × the spread, at most
/// [`SIM_MAX_WIDTH`]. The planner's noise term and a profile's fit use the same draw.
pub fn sim_width(spread: f64) -> f64 {
    (12f64.sqrt() * spread.max(0.0)).min(SIM_MAX_WIDTH)
}

/// How much longer than its mean the slowest of data-parallel workers with these relative
/// compute spreads computes, as a fraction of the (balanced) mean: each worker's step drawn
/// independently and uniformly (as the simulator draws it, of width √12 × the spread), the
/// largest of n has mean `1 + w (n - 1) / (2 (n + 1))`. With the spreads' mean width; 0 when
/// every spread is 0. A noisy node costs the others more than its share's compute says.
pub fn wait_for_slowest(spreads: &[f64]) -> f64 {
    let n = spreads.len();
    if n < 2 {
        return 0.0;
    }
    let w = spreads.iter().copied().map(sim_width).sum::<f64>() / n as f64;
    w * (n - 1) as f64 / (2.0 * (n + 1) as f64)
}

/// Seconds of a data-parallel step whose slowest worker computes for `compute_s` (forward,
/// then backward handing over `buckets` of a `grad_bytes` gradient), when a round of `bytes`
/// takes `round_s(bytes)`. The buckets' rounds share the links: a bucket's bytes wait for the
/// previous bucket's to be through (its bandwidth part, `round_s(bytes) - round_s(0)`), while
/// their latencies (`round_s(0)`) overlap. Never less than `compute_s`; with one bucket
/// handed over at the end of backward it is `compute_s + round_s(grad_bytes)`.
pub fn bucketed_step_s(
    compute_s: f64,
    buckets: &[GradBucket],
    grad_bytes: f64,
    round_s: impl Fn(f64) -> f64,
) -> f64 {
    let latency_s = round_s(0.0);
    let mut link_free: f64 = 0.0;
    let mut end = compute_s;
    for b in buckets {
        let ready = compute_s * (FORWARD_SHARE + BACKWARD_SHARE * b.ready_at);
        let start = ready.max(link_free);
        link_free = start + (round_s(b.bytes_share * grad_bytes) - latency_s).max(0.0);
        end = end.max(link_free + latency_s);
    }
    end
}

/// Prefix sums over a model's layers, for O(1) range costs.
#[derive(Debug, Clone)]
pub struct Costs<'a> {
    /// The cluster.
    pub cluster: &'a ClusterSpec,
    /// The model.
    pub model: &'a ModelSpec,
    /// Training settings.
    pub training: &'a TrainingSpec,
    flops: Vec<f64>,
    params: Vec<u64>,
    acts: Vec<u64>,
    state_per_param: u64,
    elem: u64,
}

impl<'a> Costs<'a> {
    /// Build prefix sums.
    pub fn new(cluster: &'a ClusterSpec, model: &'a ModelSpec, training: &'a TrainingSpec) -> Self {
        let mut flops = vec![0.0];
        let mut params = vec![0];
        let mut acts = vec![0];
        for l in &model.layers {
            flops.push(flops.last().unwrap() + 3.0 * l.fwd_flops_per_sample);
            params.push(params.last().unwrap() + l.params);
            acts.push(acts.last().unwrap() + l.activation_elems_per_sample);
        }
        Costs {
            cluster,
            model,
            training,
            flops,
            params,
            acts,
            state_per_param: state_bytes_per_param(training.precision, training.optimizer),
            elem: training.precision.element_bytes(),
        }
    }

    /// Number of layers.
    pub fn layers(&self) -> usize {
        self.model.layers.len()
    }

    /// All layers.
    pub fn all(&self) -> LayerRange {
        LayerRange::from(0..self.layers())
    }

    /// Training FLOPs for one sample through `layers`.
    pub fn train_flops(&self, layers: LayerRange) -> f64 {
        let r = layers.range();
        self.flops[r.end] - self.flops[r.start]
    }

    /// Parameters in `layers`.
    pub fn params(&self, layers: LayerRange) -> u64 {
        let r = layers.range();
        self.params[r.end] - self.params[r.start]
    }

    /// Persistent state bytes (weights, gradients, optimizer state) for `layers`.
    pub fn state_bytes(&self, layers: LayerRange) -> u64 {
        self.params(layers) * self.state_per_param
    }

    /// Bytes per parameter of what sharded data parallel keeps only for its own part: the
    /// persistent state less the weights and the gradient every worker holds whole (the
    /// optimizer state, and the master weights of mixed precision).
    fn part_bytes_per_param(&self) -> u64 {
        self.state_per_param.saturating_sub(2 * self.elem)
    }

    /// Memory a sharded data-parallel worker owning `part` needs with `in_flight` samples of
    /// activations: every weight and gradient, `part`'s optimizer state, the activations.
    pub fn shard_memory_bytes(&self, part: LayerRange, in_flight: u64) -> u64 {
        let all = self.all();
        2 * self.grad_bytes(all)
            + self.params(part) * self.part_bytes_per_param()
            + self.activation_bytes_per_sample(all) * in_flight
    }

    /// The state a sharded data-parallel worker owning `part` keeps between steps: every
    /// weight, and `part`'s optimizer state (the gradient lives for a step only).
    pub fn shard_held_bytes(&self, part: LayerRange) -> u64 {
        self.grad_bytes(self.all()) + self.params(part) * self.part_bytes_per_param()
    }

    /// Bytes of optimizer state `node` can hold as a sharded worker beside every weight and
    /// gradient and one sample's activations; `None` when not even those fit.
    pub fn shard_room(&self, node: NodeId) -> Option<u64> {
        let base = self.shard_memory_bytes(LayerRange::from(0..0), 1);
        self.cluster.node(node).memory_bytes.checked_sub(base)
    }

    /// Activation bytes retained per sample in flight through `layers`.
    pub fn activation_bytes_per_sample(&self, layers: LayerRange) -> u64 {
        let r = layers.range();
        (self.acts[r.end] - self.acts[r.start]) * self.elem
    }

    /// Gradient bytes to synchronize for `layers`.
    pub fn grad_bytes(&self, layers: LayerRange) -> u64 {
        self.params(layers) * self.elem
    }

    /// Bytes a stage ending just before `boundary` sends forward per sample (and receives back as
    /// gradients).
    pub fn boundary_bytes_per_sample(&self, boundary: usize) -> u64 {
        self.model.layers[boundary - 1].output_elems_per_sample * self.elem
    }

    /// Seconds for `node` to run forward+backward over `layers` for `samples` samples: the
    /// samples' FLOPs at the node's speed, plus its fixed per-step cost (its share for a layer
    /// range) when it computes anything at all.
    pub fn compute_s(&self, node: NodeId, layers: LayerRange, samples: f64) -> f64 {
        let n = self.cluster.node(node);
        let flops = self.train_flops(layers);
        let fixed = if samples > 0.0 && n.step_overhead_s > 0.0 {
            n.step_overhead_s * flops / self.train_flops(self.all()).max(f64::MIN_POSITIVE)
        } else {
            0.0
        };
        samples * flops / n.flops + fixed
    }

    /// Seconds per sample (the whole model) and fixed seconds per step of each of `nodes`: what
    /// a batch split balances.
    pub fn step_costs(&self, nodes: &[NodeId]) -> (Vec<f64>, Vec<f64>) {
        let per_sample = self.train_flops(self.all());
        nodes
            .iter()
            .map(|&w| {
                let n = self.cluster.node(w);
                (per_sample / n.flops, n.step_overhead_s.max(0.0))
            })
            .unzip()
    }

    /// Memory `layers` need with `in_flight` samples of activations.
    pub fn memory_bytes(&self, layers: LayerRange, in_flight: u64) -> u64 {
        self.state_bytes(layers) + self.activation_bytes_per_sample(layers) * in_flight
    }

    /// The link between two nodes.
    pub fn link(&self, a: NodeId, b: NodeId) -> Link {
        self.cluster.link(a, b)
    }
}

/// Ring all-reduce time over a ring whose slowest link is `bottleneck` and whose worst latency
/// is `latency_ms`: 2(n-1)/n · bytes ÷ B + 2(n-1) · latency.
pub fn ring_allreduce_s(n: usize, bytes: f64, bottleneck_gbps: f64, latency_ms: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    let n_f = n as f64;
    2.0 * (n_f - 1.0) / n_f * bytes * 8.0 / (bottleneck_gbps * 1e9)
        + 2.0 * (n_f - 1.0) * latency_ms / 1e3
}

/// Parameter-server time: every worker pushes `bytes` and pulls `bytes`; the server's access link
/// carries (n-1) of each direction (the server is a worker too).
pub fn param_server_s(cluster: &ClusterSpec, server: NodeId, group: &[NodeId], bytes: f64) -> f64 {
    if group.len() <= 1 {
        return 0.0;
    }
    let server_link = cluster.node(server).link;
    let through_server = (group.len() - 1) as f64 * bytes / server_link.bytes_per_s();
    let slowest_worker = group
        .iter()
        .filter(|&&w| w != server)
        .map(|&w| cluster.link(server, w).transfer_s(bytes))
        .fold(0.0, f64::max);
    2.0 * through_server.max(slowest_worker)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_formula_matches_nccl_busbw_definition() {
        // 4 nodes, 1 GB over 8 Gbit/s (1 GB/s), no latency: 2·3/4 · 1 s = 1.5 s.
        let t = ring_allreduce_s(4, 1e9, 8.0, 0.0);
        assert!((t - 1.5).abs() < 1e-12);
        assert_eq!(ring_allreduce_s(1, 1e9, 8.0, 5.0), 0.0);
        // latency term: 2(n-1) hops.
        let t = ring_allreduce_s(3, 0.0, 8.0, 10.0);
        assert!((t - 0.04).abs() < 1e-12);
    }

    #[test]
    fn an_mlp_hands_its_gradient_over_in_per_layer_buckets_other_models_at_once() {
        // local-digits' MLP: fc1 (262,656) and fc2 (5,130) ride together, then fc0 (33,280).
        let m = crate::model::mlp_spec("m", &[64, 512, 512, 10]);
        let b = grad_buckets(&m);
        assert_eq!(b.len(), 2, "{b:?}");
        assert_eq!(b[0].layers, LayerRange::from(1..3));
        assert_eq!(b[1].layers, LayerRange::from(0..1));
        assert!((b[0].bytes_share + b[1].bytes_share - 1.0).abs() < 1e-12);
        // fc2's backward (both products) and fc1's weight gradient of all backward's work
        // (every layer's two products but fc0's one): (2·5,120 + 262,144) / (2·300,032 −
        // 32,768) of the multiply-adds.
        let want = (2.0 * 5_120.0 + 262_144.0) / (2.0 * 300_032.0 - 32_768.0);
        assert!((b[0].ready_at - want).abs() < 1e-3, "{b:?} vs {want}");
        assert_eq!(b[1].ready_at, 1.0);
        // A small MLP is one bucket; a transformer is one bucket whatever its size.
        assert_eq!(
            grad_buckets(&crate::model::mlp_spec("m", &[16, 256, 64])).len(),
            1
        );
        let gpt = crate::model::gpt_spec("g", 12, 768, 12, 1024, 50257, true);
        let b = grad_buckets(&gpt);
        assert_eq!(b.len(), 1);
        assert_eq!((b[0].ready_at, b[0].bytes_share), (1.0, 1.0));
    }

    #[test]
    fn one_bucket_exposes_its_whole_round_and_early_buckets_hide_behind_backward() {
        let round = |bytes: f64| 0.01 + bytes / 1e9;
        let one = [GradBucket {
            layers: LayerRange::from(0..2),
            ready_at: 1.0,
            bytes_share: 1.0,
        }];
        assert!((bucketed_step_s(1.0, &one, 1e8, round) - 1.11).abs() < 1e-12);
        // Half the bytes ready halfway through backward: its 50 ms hide, the second half's
        // 50 ms + 10 ms latency do not.
        let two = [
            GradBucket {
                layers: LayerRange::from(1..2),
                ready_at: 0.5,
                bytes_share: 0.5,
            },
            GradBucket {
                layers: LayerRange::from(0..1),
                ready_at: 1.0,
                bytes_share: 0.5,
            },
        ];
        assert!((bucketed_step_s(1.0, &two, 1e8, round) - 1.06).abs() < 1e-12);
        // A round longer than what is left of backward: the second bucket's bytes wait for the
        // first one's (1/3 + 1/3 + 1 s + 1 s + 10 ms).
        let t = bucketed_step_s(1.0, &two, 4e9, round);
        assert!((t - (2.0 / 3.0 + 4.01)).abs() < 1e-9, "{t}");
    }

    #[test]
    fn a_64_mib_gradient_over_100_mbit_takes_about_5_4_s() {
        let l = Link {
            bandwidth_gbps: 0.1,
            latency_ms: 0.0,
        };
        let t = l.transfer_s(64.0 * 1024.0 * 1024.0);
        assert!((t - 5.37).abs() < 0.01, "{t}");
    }
}

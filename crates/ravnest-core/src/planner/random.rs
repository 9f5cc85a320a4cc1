//! Seeded random small clusters for measuring a planner against the exhaustive oracle
//! (`ravnest bench planners --random`, and the planner's property tests): 2-8 nodes of mixed
//! catalog GPUs and CPUs, access links from 100 Mbit/s to 100 Gbit/s with some slow pairs,
//! memory sometimes capped well below the card's, transformers from 0.9M to 1.4B parameters.
//! Pure: the same seed gives the same case.

use std::collections::BTreeMap;

use crate::cluster::{ClusterSpec, Link, NodeId, NodeSpec, SyncPreference, TrainingSpec};
use crate::device::{self, GIB};
use crate::model::{self, ModelSpec, Optimizer, Precision};

/// One generated planning problem.
#[derive(Debug, Clone)]
pub struct Case {
    /// `random-<seed>`.
    pub name: String,
    /// The cluster.
    pub cluster: ClusterSpec,
    /// The model.
    pub model: ModelSpec,
    /// The training settings.
    pub training: TrainingSpec,
}

/// SplitMix64: small, seedable, and the same on every platform.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len())]
    }

    fn chance(&mut self, p: f64) -> bool {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64 <= p
    }
}

/// Devices drawn from (the CPU and the consumer cards more often, as on community clusters).
const DEVICES: &[&str] = &[
    "cpu",
    "cpu",
    "rtx2080",
    "rtx3060",
    "rtx3060",
    "rtx3070",
    "rtx3090",
    "rtx3090",
    "rtx4070",
    "rtx4090",
    "rtx4090",
    "titan-rtx",
    "v100-16",
    "a100-40",
    "l4",
    "t4",
];
/// Access links, Gbit/s.
const LINKS_GBPS: &[f64] = &[0.1, 1.0, 1.0, 10.0, 10.0, 25.0, 100.0];
/// Models: (preset, global batches to draw from).
const MODELS: &[(&str, &[u32])] = &[
    ("gpt-tiny", &[32, 64, 128]),
    ("gpt-small", &[16, 32, 64, 128]),
    ("gpt2-small", &[8, 16, 32, 64]),
    ("gpt2-medium", &[8, 16, 32]),
    ("gpt-1.3b", &[8, 16, 32]),
];

/// The case for `seed`.
pub fn random_case(seed: u64) -> Case {
    let mut rng = Rng(seed ^ 0x005E_ED0F_C1A5_7E25);
    let n = 2 + rng.below(7);
    let (preset, batches) = rng.pick(MODELS);
    let model = model::preset(preset)
        .expect("the generator's presets exist")
        .build();
    let precision = if rng.chance(0.5) {
        Precision::Fp16
    } else {
        Precision::Fp32
    };
    let training = TrainingSpec {
        global_batch: rng.pick(batches),
        micro_batch: rng.pick(&[1, 2, 4, 8]),
        optimizer: if rng.chance(0.8) {
            Optimizer::Adamw
        } else {
            Optimizer::Sgd
        },
        precision,
        sync: SyncPreference::Auto,
        local_sgd_threshold: 3.0,
        accumulate: true,
        ..TrainingSpec::default()
    };
    // Tight memory: a fraction of the cases cap some nodes, as `memory_gib` does.
    let tight = rng.chance(0.3);
    let nodes: Vec<NodeSpec> = (0..n)
        .map(|i| {
            let id = rng.pick(DEVICES);
            let dev = device::lookup(id).expect("the generator's devices exist");
            let flops = dev
                .effective_flops(precision)
                .or_else(|| dev.effective_flops(Precision::Fp32))
                .expect("every device has an fp32 figure");
            let mut mem = (dev.memory_gib - 1.0).max(0.5);
            if tight && rng.chance(0.5) {
                mem *= rng.pick(&[0.1, 0.25, 0.5]);
            }
            NodeSpec {
                name: format!("{id}-{i}"),
                device: id.into(),
                memory_bytes: (mem * GIB) as u64,
                flops,
                step_overhead_s: 0.0,
                compute_spread: 0.0,
                link: Link {
                    bandwidth_gbps: rng.pick(LINKS_GBPS),
                    latency_ms: rng.pick(&[0.05, 0.2, 1.0, 5.0]),
                },
                address: None,
                listen: None,
            }
        })
        .collect();
    // A few slow pairs (a WAN hop between two racks).
    let mut pair_links = BTreeMap::new();
    for _ in 0..rng.below(3) {
        let (a, b) = (rng.below(n) as u32, rng.below(n) as u32);
        if a != b {
            pair_links.insert(
                (NodeId(a.min(b)), NodeId(a.max(b))),
                Link {
                    bandwidth_gbps: rng.pick(&[0.1, 0.5, 1.0]),
                    latency_ms: rng.pick(&[5.0, 20.0]),
                },
            );
        }
    }
    Case {
        name: format!("random-{seed}"),
        cluster: ClusterSpec {
            name: format!("random-{seed}"),
            nodes,
            pair_links,
        },
        model,
        training,
    }
}

/// Summary of ratios (ours ÷ oracle, step times), for the bench and the tests.
#[derive(Debug, Clone, PartialEq)]
pub struct RatioSummary {
    /// Cases both planned.
    pub cases: usize,
    /// Median ratio.
    pub median: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
    /// Largest.
    pub max: f64,
    /// Fraction of cases within 1% of the oracle.
    pub within_1pct: f64,
}

/// Summarize `ratios` (infinite when ours found no plan and the oracle did).
pub fn summarize(ratios: &[f64]) -> RatioSummary {
    let mut r = ratios.to_vec();
    r.sort_by(f64::total_cmp);
    let at = |q: f64| {
        r.get(((r.len() as f64 - 1.0) * q).round() as usize)
            .copied()
            .unwrap_or(f64::NAN)
    };
    RatioSummary {
        cases: r.len(),
        median: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
        max: r.last().copied().unwrap_or(f64::NAN),
        within_1pct: r.iter().filter(|&&x| x <= 1.01).count() as f64 / r.len().max(1) as f64,
    }
}

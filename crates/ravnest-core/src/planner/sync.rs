//! Gradient synchronization: ring order, and the choice between ring all-reduce, a parameter
//! server and local SGD, from the compute / communication ratio.

use serde::Serialize;

use crate::cluster::{
    ClusterSpec, NodeId, OuterOptimizer, OuterPrecision, OuterSpec, SyncPreference,
};
use crate::cost::{Costs, GradBucket, bucketed_step_s, param_server_s, ring_allreduce_s};
use crate::pack::Packing;

/// The collective a sync round uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Collective {
    /// Chunked reduce-scatter + all-gather around a ring.
    Ring,
    /// Push to / pull from one server (the first node of each group).
    ParamServer,
    /// Two-level ring (`ring2d`): groups of `group_size` consecutive nodes of the order.
    Ring2d,
}

/// How gradients are synchronized.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "method", rename_all = "kebab-case")]
pub enum SyncMethod {
    /// One replica: nothing to synchronize.
    None,
    /// Exact synchronous data parallel: every step.
    EveryStep {
        /// The collective.
        collective: Collective,
    },
    /// Local SGD (DiLoCo-style): `local_steps` steps alone, then an averaging round.
    LocalSgd {
        /// The collective of the averaging round.
        collective: Collective,
        /// Local steps between averaging rounds (H).
        local_steps: u32,
        /// The round's outer step and what its values travel as.
        #[serde(skip_serializing_if = "Outer::is_plain_average")]
        outer: Outer,
    },
}

/// The outer step of a local-SGD round. Each replica contributes its model's change since the
/// round's start (the *anchor*, a version every replica agreed on), weighted by batch share;
/// with `Δ` the sum (the anchor minus the average model), the momentum becomes
/// `m = momentum · m + Δ`, and the parameters `anchor − lr · (Δ + momentum · m)` (Nesterov, as
/// DiLoCo). Optimizer state is averaged (`anchor − Δ`). With lr 1 and momentum 0 this is the
/// plain average; exchanged exactly (`fp32`) it is computed from the values themselves.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, serde::Deserialize)]
pub struct Outer {
    /// Outer learning rate.
    pub lr: f32,
    /// Outer (Nesterov) momentum.
    pub momentum: f32,
    /// What the round's values travel as.
    pub packing: Packing,
    /// The round's exchange runs during the following inner steps, and its outer step is
    /// merged `delay` steps after the round (the inner progress made meanwhile carried over
    /// onto it); the run's last round waits for its own.
    pub overlap: bool,
    /// Steps an overlapped round's outer step comes after its round (at least 1, below the
    /// round's length; the planner's from the link, or `outer_delay`). 0 when not overlapped.
    pub delay: u32,
}

impl Outer {
    /// The plain average of the replicas' models, exchanged as exact values.
    pub const AVERAGE: Outer = Outer {
        lr: 1.0,
        momentum: 0.0,
        packing: Packing::Fp32,
        overlap: false,
        delay: 0,
    };

    /// Whether this is [`Outer::AVERAGE`] (the models themselves travel, not their deltas).
    pub fn is_plain_average(&self) -> bool {
        *self == Outer::AVERAGE
    }

    /// The outer step `spec` asks for (the planner's packing where it says `auto`: int8 deltas
    /// under Nesterov, but fp32 with AdamW inside, whose second moments, averaged with the
    /// round, do not survive lossy rounding).
    pub fn of(spec: &OuterSpec, inner: crate::model::Optimizer) -> Outer {
        let (lr, momentum) = match spec.optimizer {
            OuterOptimizer::Average => (1.0, 0.0),
            OuterOptimizer::Nesterov => (spec.lr as f32, spec.momentum as f32),
        };
        let packing = match spec.precision {
            OuterPrecision::Auto
                if spec.optimizer == OuterOptimizer::Nesterov
                    && inner != crate::model::Optimizer::Adamw =>
            {
                Packing::Int8
            }
            OuterPrecision::Auto | OuterPrecision::Fp32 => Packing::Fp32,
            OuterPrecision::Fp16 => Packing::Fp16,
            OuterPrecision::Int8 => Packing::Int8,
        };
        Outer {
            lr,
            momentum,
            packing,
            overlap: spec.overlap,
            delay: if spec.overlap {
                spec.delay.unwrap_or(0)
            } else {
                0
            },
        }
    }

    /// Steps between a round and its merge for rounds of `h` steps (0: waited for).
    pub fn delay_within(&self, h: u32) -> u32 {
        if self.overlap {
            self.delay.max(1).min(h.saturating_sub(1))
        } else {
            0
        }
    }

    /// Its name in reports.
    pub fn describe(&self) -> String {
        let late = if self.overlap {
            format!(
                ", each round's exchange overlapped with the {} inner steps after it",
                self.delay.max(1)
            )
        } else {
            String::new()
        };
        if self.lr == 1.0 && self.momentum == 0.0 {
            format!("averaging ({}){late}", self.packing.name())
        } else {
            format!(
                "Nesterov outer step lr {} momentum {} on {} deltas{late}",
                self.lr,
                self.momentum,
                self.packing.name()
            )
        }
    }
}

/// One group of nodes that hold the same parameters and average them.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SyncGroup {
    /// Ring order (for a parameter server, the server first).
    pub order: Vec<NodeId>,
    /// Bytes each member contributes per round.
    pub bytes: u64,
    /// Seconds of one round for this group.
    pub round_s: f64,
    /// Slowest link in the ring (Gbit/s), for reports.
    pub bottleneck_gbps: f64,
    /// For a two-level ring: nodes per group (groups are consecutive in `order`); else 0.
    pub group_size: u32,
}

/// The chosen synchronization.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SyncPlan {
    /// Method.
    pub method: SyncMethod,
    /// Groups (data parallel: one; pipeline: one per stage).
    pub groups: Vec<SyncGroup>,
    /// Seconds one round takes (groups run concurrently on disjoint nodes).
    pub round_s: f64,
    /// Seconds charged per training step (round ÷ H under local SGD).
    pub per_step_s: f64,
    /// Why this method was chosen.
    pub reason: String,
}

/// How much freedom a planner has when choosing sync.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncFreedom {
    /// Choose ring order, collective and local SGD from the cost model.
    Choose,
    /// What a homogeneous framework does: ring in id order, every step (unless the user
    /// explicitly asked for something else).
    Baseline,
}

/// Target share of compute that amortized local-SGD communication may take.
const LOCAL_SGD_COMM_SHARE: f64 = 0.1;
/// Overlapped rounds hide their exchange behind compute: the share of the time the link may
/// be busy with rounds (the rest left for other traffic and for a link slower than measured).
/// More rounds for the same samples train better (Fashion-MNIST MLP on 100 Mbit/s: 134 to 163
/// local steps fell 0.4 to 1.8 points short of the ring at 300 steps; at 600 steps this rule's
/// 64 to 86 matched or beat it in every run).
const LOCAL_SGD_OVERLAP_LINK_SHARE: f64 = 0.2;
/// Cap on local steps (DiLoCo uses 500).
pub const LOCAL_SGD_MAX_STEPS: u32 = 500;

/// Figures of a ring in a given order: (bottleneck Gbit/s, worst latency ms).
pub fn ring_links(cluster: &ClusterSpec, order: &[NodeId]) -> (f64, f64) {
    let n = order.len();
    let mut bw = f64::INFINITY;
    let mut lat: f64 = 0.0;
    for i in 0..n {
        let l = cluster.link(order[i], order[(i + 1) % n]);
        bw = bw.min(l.bandwidth_gbps);
        lat = lat.max(l.latency_ms);
    }
    (bw, lat)
}

fn ring_time(cluster: &ClusterSpec, order: &[NodeId], bytes: f64) -> f64 {
    if order.len() <= 1 {
        return 0.0;
    }
    let (bw, lat) = ring_links(cluster, order);
    ring_allreduce_s(order.len(), bytes, bw, lat)
}

/// Exhaustive search is used up to this many nodes ((n-1)! orders).
pub const RING_EXACT_MAX: usize = 8;
/// Nearest-neighbour search (O(n²) link look-ups) is used up to this many nodes.
const RING_GREEDY_MAX: usize = 256;

/// A ring order over `nodes` that minimizes the all-reduce time of `bytes`, i.e. maximizes the
/// slowest link (then minimizes the worst latency). Exact up to [`RING_EXACT_MAX`] nodes; above,
/// the best of id order, access-bandwidth order and a widest-link nearest-neighbour tour.
pub fn ring_order(cluster: &ClusterSpec, nodes: &[NodeId], bytes: f64) -> Vec<NodeId> {
    let mut ids: Vec<NodeId> = nodes.to_vec();
    ids.sort_unstable();
    let n = ids.len();
    if n <= 2 {
        return ids;
    }
    let mut by_access = ids.clone();
    by_access.sort_by(|&a, &b| {
        let (la, lb) = (cluster.node(a).link, cluster.node(b).link);
        lb.bandwidth_gbps
            .total_cmp(&la.bandwidth_gbps)
            .then(la.latency_ms.total_cmp(&lb.latency_ms))
            .then(a.cmp(&b))
    });
    if !cluster.has_pair_links() {
        // Every ring has the same bottleneck (the slowest access link) and the same worst
        // latency; keep slow nodes adjacent.
        return by_access;
    }
    if n <= RING_EXACT_MAX {
        // Fix the first node; permute the rest (Heap's algorithm, deterministic).
        let mut best = ids.clone();
        let mut best_t = ring_time(cluster, &ids, bytes);
        let mut rest: Vec<NodeId> = ids[1..].to_vec();
        let mut c = vec![0usize; rest.len()];
        let mut i = 0;
        while i < rest.len() {
            if c[i] < i {
                if i % 2 == 0 {
                    rest.swap(0, i);
                } else {
                    rest.swap(c[i], i);
                }
                let mut cand = vec![ids[0]];
                cand.extend_from_slice(&rest);
                let t = ring_time(cluster, &cand, bytes);
                if t < best_t {
                    best_t = t;
                    best = cand;
                }
                c[i] += 1;
                i = 0;
            } else {
                c[i] = 0;
                i += 1;
            }
        }
        return best;
    }
    let mut candidates = vec![ids.clone(), by_access.clone()];
    if n <= RING_GREEDY_MAX {
        let mut tour = vec![by_access[0]];
        let mut left: Vec<NodeId> = by_access[1..].to_vec();
        while !left.is_empty() {
            let last = *tour.last().unwrap();
            let (pos, _) = left
                .iter()
                .enumerate()
                .map(|(p, &x)| (p, cluster.link(last, x)))
                .max_by(|(pa, a), (pb, b)| {
                    a.bandwidth_gbps
                        .total_cmp(&b.bandwidth_gbps)
                        .then(b.latency_ms.total_cmp(&a.latency_ms))
                        .then(pb.cmp(pa))
                })
                .unwrap();
            tour.push(left.remove(pos));
        }
        candidates.push(tour);
    }
    candidates
        .into_iter()
        .map(|o| (ring_time(cluster, &o, bytes), o))
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .unwrap()
        .1
}

/// The parameter server for a group: the member with the fastest access link (lowest id on ties).
pub fn server_for(cluster: &ClusterSpec, nodes: &[NodeId]) -> NodeId {
    *nodes
        .iter()
        .max_by(|&&a, &&b| {
            cluster
                .node(a)
                .link
                .bandwidth_gbps
                .total_cmp(&cluster.node(b).link.bandwidth_gbps)
                .then(b.cmp(&a))
        })
        .expect("non-empty group")
}

/// Local steps so that amortized communication is at most 10% of compute, in [2, 500];
/// `overlapped` rounds, so that the link is busy with rounds at most a fifth of the time
/// (their exchange then also fits well within the steps before its merge,
/// [`merge_delay_for`]).
pub fn local_steps_for(round_s: f64, compute_s: f64, overlapped: bool) -> u32 {
    if compute_s <= 0.0 {
        return LOCAL_SGD_MAX_STEPS;
    }
    let share = match overlapped {
        true => LOCAL_SGD_OVERLAP_LINK_SHARE,
        false => LOCAL_SGD_COMM_SHARE,
    };
    let h = (round_s / (share * compute_s)).ceil();
    h.clamp(2.0, f64::from(LOCAL_SGD_MAX_STEPS)) as u32
}

/// Steps an overlapped round's exchange gets before its outer step is merged: what the
/// round takes in steps of compute, with half again for a link that runs slower than measured,
/// and below the round's `h` steps (0 when `h` is 1: nothing to overlap with).
pub fn merge_delay_for(round_s: f64, compute_s: f64, h: u32) -> u32 {
    let wanted = if compute_s > 0.0 {
        (1.5 * round_s / compute_s).ceil().max(1.0)
    } else {
        1.0
    };
    wanted.min(f64::from(h.saturating_sub(1))) as u32
}

/// How an every-step round meets the compute of its step.
#[derive(Debug, Clone, Copy)]
pub enum Backward<'a> {
    /// The round starts when compute is done (pipeline stages reduce after the drain).
    Then,
    /// The gradient is handed over in these buckets while backward runs (data parallel, see
    /// [`crate::cost::grad_buckets`]): each bucket's round may hide behind the rest of it.
    Buckets(&'a [GradBucket]),
}

/// Choose how the given groups synchronize, given the compute time of one step; `backward`
/// says how much of an every-step round can hide behind the backward pass.
pub fn choose_sync(
    costs: &Costs<'_>,
    groups: &[(Vec<NodeId>, u64)],
    compute_s: f64,
    backward: Backward<'_>,
    freedom: SyncFreedom,
) -> SyncPlan {
    let cluster = costs.cluster;
    let pref = costs.training.sync;
    if groups.iter().all(|(g, _)| g.len() <= 1) {
        return no_sync(groups);
    }
    let smart = freedom == SyncFreedom::Choose;
    let ring_groups = ring_candidates(cluster, groups, smart);
    let ps_groups = param_server_candidates(cluster, groups, smart);
    let (ring_s, ps_s) = (worst(&ring_groups), worst(&ps_groups));

    let ring2d_groups: Option<Vec<SyncGroup>> = if smart && pref != SyncPreference::ParamServer {
        ring2d_candidates(cluster, &ring_groups)
    } else {
        None
    };
    let ring = best_ring(ring_groups, ring_s, ring2d_groups);
    let chosen = choose_collective(pref, smart, ring, ps_groups, ps_s);
    let ratio = if compute_s > 0.0 {
        chosen.round_s / compute_s
    } else {
        f64::INFINITY
    };
    let local = match pref {
        SyncPreference::LocalSgd => true,
        SyncPreference::Auto => smart && ratio > costs.training.local_sgd_threshold,
        _ => false,
    };
    if local {
        return local_sgd(costs, chosen, compute_s, ratio);
    }
    every_step(cluster, chosen, compute_s, backward)
}

/// One replica per group: nothing to synchronize.
fn no_sync(groups: &[(Vec<NodeId>, u64)]) -> SyncPlan {
    SyncPlan {
        method: SyncMethod::None,
        groups: groups
            .iter()
            .map(|(g, b)| SyncGroup {
                order: g.clone(),
                bytes: *b,
                round_s: 0.0,
                bottleneck_gbps: 0.0,
                group_size: 0,
            })
            .collect(),
        round_s: 0.0,
        per_step_s: 0.0,
        reason: "one replica: nothing to synchronize".into(),
    }
}

/// The slowest group's round, seconds.
fn worst(gs: &[SyncGroup]) -> f64 {
    gs.iter().map(|g| g.round_s).fold(0.0, f64::max)
}

/// A flat ring per group: the best order when `smart`, else rank order.
fn ring_candidates(
    cluster: &ClusterSpec,
    groups: &[(Vec<NodeId>, u64)],
    smart: bool,
) -> Vec<SyncGroup> {
    groups
        .iter()
        .map(|(g, bytes)| {
            let order = if smart {
                ring_order(cluster, g, *bytes as f64)
            } else {
                let mut o = g.clone();
                o.sort_unstable();
                o
            };
            let (bw, _) = if order.len() > 1 {
                ring_links(cluster, &order)
            } else {
                (0.0, 0.0)
            };
            SyncGroup {
                round_s: ring_time(cluster, &order, *bytes as f64),
                order,
                bytes: *bytes,
                bottleneck_gbps: bw,
                group_size: 0,
            }
        })
        .collect()
}

/// A parameter server per group: the best-connected member when `smart`, else the lowest id.
fn param_server_candidates(
    cluster: &ClusterSpec,
    groups: &[(Vec<NodeId>, u64)],
    smart: bool,
) -> Vec<SyncGroup> {
    groups
        .iter()
        .map(|(g, bytes)| {
            let server = if smart {
                server_for(cluster, g)
            } else {
                *g.iter().min().unwrap()
            };
            let mut order = vec![server];
            order.extend(g.iter().copied().filter(|&x| x != server));
            let bw = g
                .iter()
                .filter(|&&x| x != server)
                .map(|&x| cluster.link(server, x).bandwidth_gbps)
                .fold(f64::INFINITY, f64::min);
            SyncGroup {
                round_s: param_server_s(cluster, server, g, *bytes as f64),
                order,
                bytes: *bytes,
                bottleneck_gbps: if bw.is_finite() { bw } else { 0.0 },
                group_size: 0,
            }
        })
        .collect()
}

/// A two-level ring per group, or `None` when a group has no divisor near √n.
///
/// The two-level ring moves the same bytes as a flat ring but waits through 2(k-1)+2(g-1)
/// hops instead of 2(n-1). Its links are taken to be those of the flat ring's order (the
/// column rings cross the same kind of links).
fn ring2d_candidates(cluster: &ClusterSpec, ring_groups: &[SyncGroup]) -> Option<Vec<SyncGroup>> {
    ring_groups
        .iter()
        .map(|g| {
            let n = g.order.len();
            let k = crate::ring2d::group_size(n)?;
            let (bw, lat) = ring_links(cluster, &g.order);
            Some(SyncGroup {
                round_s: ring2d_s(n, k, g.bytes as f64, bw, lat),
                order: g.order.clone(),
                bytes: g.bytes,
                bottleneck_gbps: bw,
                group_size: k as u32,
            })
        })
        .collect()
}

/// A two-level ring of `n` nodes in groups of `k`: the bytes of a flat ring, 2(k-1) + 2(n/k-1)
/// hops of latency.
fn ring2d_s(n: usize, k: usize, bytes: f64, bw_gbps: f64, lat_ms: f64) -> f64 {
    if n <= 1 || k == 0 {
        return 0.0;
    }
    let hops = 2 * (k - 1) + 2 * (n / k - 1);
    2.0 * (n as f64 - 1.0) / n as f64 * bytes * 8.0 / (bw_gbps * 1e9) + hops as f64 * lat_ms / 1e3
}

/// A collective for the groups, its slowest round, and why (or, for a ring, its name).
struct Chosen {
    collective: Collective,
    groups: Vec<SyncGroup>,
    round_s: f64,
    reason: String,
}

/// The flat ring, or the two-level ring when it is faster.
fn best_ring(
    ring_groups: Vec<SyncGroup>,
    ring_s: f64,
    ring2d_groups: Option<Vec<SyncGroup>>,
) -> Chosen {
    let (collective, groups, round_s, reason) = match ring2d_groups {
        Some(r2) if worst(&r2) < ring_s => {
            let k = r2.first().map_or(0, |g| g.group_size);
            let n = r2.first().map_or(0, |g| g.order.len());
            let name = format!(
                "two-level ring ({} groups of {k}; a flat ring would take {})",
                n / k.max(1) as usize,
                secs(ring_s)
            );
            (Collective::Ring2d, r2.clone(), worst(&r2), name)
        }
        _ => (
            Collective::Ring,
            ring_groups,
            ring_s,
            "ring all-reduce".to_string(),
        ),
    };
    Chosen {
        collective,
        groups,
        round_s,
        reason,
    }
}

/// Ring or parameter server, as `sync` asks or, when free to choose, whichever is faster.
fn choose_collective(
    pref: SyncPreference,
    smart: bool,
    ring: Chosen,
    ps_groups: Vec<SyncGroup>,
    ps_s: f64,
) -> Chosen {
    let Chosen {
        collective: ring_collective,
        groups: ring_groups,
        round_s: ring_s,
        reason: ring_name,
    } = ring;
    let (collective, groups, round_s, reason) = match pref {
        SyncPreference::Ring => (
            ring_collective,
            ring_groups,
            ring_s,
            format!("{ring_name}, as `sync = \"ring\"` asks"),
        ),
        SyncPreference::ParamServer => (
            Collective::ParamServer,
            ps_groups,
            ps_s,
            "parameter server, as `sync = \"param-server\"` asks".to_string(),
        ),
        SyncPreference::Auto | SyncPreference::LocalSgd if smart && ps_s < ring_s => (
            Collective::ParamServer,
            ps_groups,
            ps_s,
            format!(
                "parameter server: a round takes {} against {} for a ring",
                secs(ps_s),
                secs(ring_s)
            ),
        ),
        SyncPreference::Auto | SyncPreference::LocalSgd if smart => (
            ring_collective,
            ring_groups,
            ring_s,
            format!(
                "{ring_name}: a round takes {} against {} through a parameter server",
                secs(ring_s),
                secs(ps_s)
            ),
        ),
        _ => (
            Collective::Ring,
            ring_groups,
            ring_s,
            "ring all-reduce in rank order, every step (what DDP does)".to_string(),
        ),
    };
    Chosen {
        collective,
        groups,
        round_s,
        reason,
    }
}

/// Local SGD over the chosen collective; `ratio` is communication / compute.
fn local_sgd(costs: &Costs<'_>, chosen: Chosen, compute_s: f64, ratio: f64) -> SyncPlan {
    let Chosen {
        collective,
        groups,
        round_s: _,
        reason,
    } = chosen;
    let mut outer = Outer::of(&costs.training.outer, costs.training.optimizer);
    // A round moves what the replicas hold, not a gradient: the parameters and their optimizer
    // state in the flat f32 form, packed. The groups' rounds again at that size.
    let round_s = groups
        .iter()
        .map(|g| {
            let bytes =
                g.bytes as f64 * round_bytes_per_gradient_byte(costs) * outer.packing.ratio();
            group_round_s(costs.cluster, collective, g, bytes)
        })
        .fold(0.0, f64::max);
    let h = costs
        .training
        .outer
        .local_steps
        .unwrap_or_else(|| local_steps_for(round_s, compute_s, outer.overlap))
        .max(1);
    if outer.overlap && costs.training.outer.delay.is_none() {
        outer.delay = merge_delay_for(round_s, compute_s, h);
    }
    let delay = outer.delay_within(h);
    let why = if costs.training.sync == SyncPreference::LocalSgd {
        "`sync = \"local-sgd\"` asks for it".to_string()
    } else {
        format!(
            "communication / compute = {} exceeds local_sgd_threshold = {}",
            crate::units::num(ratio),
            crate::units::num(costs.training.local_sgd_threshold)
        )
    };
    let outer_note = if outer.is_plain_average() {
        String::new()
    } else {
        format!("; {}", outer.describe())
    };
    let reason = format!(
        "local SGD with {h} local steps per averaging round: one round takes {} against {} of \
         compute per step ({why}); averaging by {reason}{outer_note}. Local SGD is not \
         step-for-step equal to synchronous SGD: set `sync = \"ring\"` for exact updates",
        secs(round_s),
        secs(compute_s),
    );
    SyncPlan {
        method: SyncMethod::LocalSgd {
            collective,
            local_steps: h,
            outer,
        },
        groups,
        round_s,
        // Overlapped, a round costs only what a round's compute does not hide.
        per_step_s: (round_s - f64::from(delay) * compute_s).max(0.0) / f64::from(h),
        reason,
    }
}

/// Bytes a local-SGD round moves (unpacked) per byte of gradient: the flat form's f32
/// parameters and optimizer state, against the gradient's element.
pub fn round_bytes_per_gradient_byte(costs: &Costs<'_>) -> f64 {
    let t = costs.training;
    (4 + t.optimizer.state_bytes_per_param()) as f64 / t.precision.element_bytes() as f64
}

/// Seconds one round of `collective` over `group` takes for `bytes` (a bucket's share of the
/// group's gradient, or all of it).
fn group_round_s(
    cluster: &ClusterSpec,
    collective: Collective,
    group: &SyncGroup,
    bytes: f64,
) -> f64 {
    match collective {
        Collective::Ring => ring_time(cluster, &group.order, bytes),
        Collective::Ring2d => {
            let (bw, lat) = ring_links(cluster, &group.order);
            ring2d_s(group.order.len(), group.group_size as usize, bytes, bw, lat)
        }
        Collective::ParamServer => param_server_s(cluster, group.order[0], &group.order, bytes),
    }
}

/// Every-step synchronization over the chosen collective: what of each round `backward` does
/// not hide is charged per step.
fn every_step(
    cluster: &ClusterSpec,
    chosen: Chosen,
    compute_s: f64,
    backward: Backward<'_>,
) -> SyncPlan {
    let Chosen {
        collective,
        groups,
        round_s,
        mut reason,
    } = chosen;
    let exposed = match backward {
        Backward::Then => round_s,
        Backward::Buckets(buckets) => groups
            .iter()
            .map(|g| {
                bucketed_step_s(compute_s, buckets, g.bytes as f64, |b| {
                    group_round_s(cluster, collective, g, b)
                }) - compute_s
            })
            .fold(0.0, f64::max),
    };
    let hidden = round_s - exposed;
    // (A round with nothing hidden differs from its exposed part by rounding only.)
    if hidden > 1e-9 * round_s {
        reason = format!(
            "{reason}; every step, {} of it hidden behind the backward pass",
            secs(hidden)
        );
    } else {
        reason = format!("{reason}; every step");
    }
    SyncPlan {
        method: SyncMethod::EveryStep { collective },
        groups,
        round_s,
        per_step_s: exposed,
        reason,
    }
}

/// Every-step synchronization around a ring in the given `order` (sharded data parallel,
/// whose order places each part's owner): a reduce-scatter and an all-gather of `bytes`, what
/// a ring all-reduce moves, overlapping the backward pass bucket by bucket as it does.
pub fn fixed_ring(
    costs: &Costs<'_>,
    order: Vec<NodeId>,
    bytes: u64,
    compute_s: f64,
    buckets: &[GradBucket],
) -> SyncPlan {
    let cluster = costs.cluster;
    let (bw, lat) = ring_links(cluster, &order);
    let round_s = ring_allreduce_s(order.len(), bytes as f64, bw, lat);
    let group = SyncGroup {
        order,
        bytes,
        round_s,
        bottleneck_gbps: bw,
        group_size: 0,
    };
    let chosen = Chosen {
        collective: Collective::Ring,
        groups: vec![group],
        round_s,
        reason: "gradients reduce-scattered to each part's owner, weights all-gathered from it"
            .into(),
    };
    every_step(cluster, chosen, compute_s, Backward::Buckets(buckets))
}

/// Seconds in human units: [`crate::units::secs`] (kept here for the callers of the planner).
pub fn secs(s: f64) -> String {
    crate::units::secs(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{Link, NodeSpec};
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    fn cluster(access: &[f64], pairs: &[(u32, u32, f64)]) -> ClusterSpec {
        ClusterSpec {
            name: "t".into(),
            nodes: access
                .iter()
                .enumerate()
                .map(|(i, &bw)| NodeSpec {
                    name: format!("n{i}"),
                    device: "cpu".into(),
                    memory_bytes: 1 << 30,
                    flops: 1e12,
                    link: Link {
                        bandwidth_gbps: bw,
                        latency_ms: 0.1,
                    },
                    step_overhead_s: 0.0,
                    compute_spread: 0.0,
                    address: None,
                    listen: None,
                })
                .collect(),
            pair_links: pairs
                .iter()
                .map(|&(a, b, bw)| {
                    (
                        (NodeId(a.min(b)), NodeId(a.max(b))),
                        Link {
                            bandwidth_gbps: bw,
                            latency_ms: 0.1,
                        },
                    )
                })
                .collect::<BTreeMap<_, _>>(),
        }
    }

    proptest! {
        /// The ring order reaches the best bottleneck over all orders (exact for small rings).
        #[test]
        fn ring_order_maximizes_the_slowest_link(
            access in prop::collection::vec(1u32..20, 3..7),
            pairs in prop::collection::vec((0u32..7, 0u32..7, 1u32..40), 0..10),
        ) {
            let n = access.len() as u32;
            let pairs: Vec<(u32, u32, f64)> = pairs.into_iter().filter(|(a, b, _)| a != b && *a < n && *b < n)
                .map(|(a, b, w)| (a, b, f64::from(w))).collect();
            let c = cluster(&access.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(), &pairs);
            let ids: Vec<NodeId> = c.ids().collect();
            let got = ring_order(&c, &ids, 1e9);
            let mut sorted = got.clone(); sorted.sort_unstable();
            prop_assert_eq!(&sorted, &ids);
            // oracle: all permutations
            fn perms(v: &[NodeId]) -> Vec<Vec<NodeId>> {
                if v.len() <= 1 { return vec![v.to_vec()]; }
                let mut out = vec![];
                for i in 0..v.len() { let mut r = v.to_vec(); let x = r.remove(i); for mut p in perms(&r) { p.insert(0, x); out.push(p); } }
                out
            }
            let best = perms(&ids).iter().map(|o| ring_links(&c, o).0).fold(0.0, f64::max);
            prop_assert_eq!(ring_links(&c, &got).0, best);
        }
    }

    #[test]
    fn two_zones_cross_the_slow_link_only_twice() {
        // 0,1 in zone A, 2,3 in zone B; fast inside zones, 1 Gbit/s across except 1-2 and 3-0 at 5.
        let pairs = [(0, 2, 1.0), (1, 3, 1.0), (1, 2, 5.0), (0, 3, 5.0)];
        let c = cluster(&[100.0; 4], &pairs);
        let ids: Vec<NodeId> = c.ids().collect();
        let order = ring_order(&c, &ids, 1e9);
        assert_eq!(ring_links(&c, &order).0, 5.0, "{order:?}");
        // id order 0,1,2,3 would use 1-2 (5) and 3-0 (5) too; 0,2,1,3 would use the 1 Gbit/s links.
        assert_eq!(
            ring_links(&c, &[NodeId(0), NodeId(2), NodeId(1), NodeId(3)]).0,
            1.0
        );
    }

    #[test]
    fn local_steps_amortize_to_a_tenth() {
        assert_eq!(local_steps_for(5.0, 1.0, false), 50);
        assert_eq!(local_steps_for(0.01, 1.0, false), 2);
        assert_eq!(local_steps_for(1e9, 1.0, false), LOCAL_SGD_MAX_STEPS);
        // Overlapped: the link busy a fifth of the time, the merge well inside the round.
        assert_eq!(local_steps_for(5.0, 1.0, true), 25);
        assert!(merge_delay_for(5.0, 1.0, 25) < 25 / 2);
    }
}

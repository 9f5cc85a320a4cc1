//! Evaluating one candidate layout with the cost model: memory check, per-node times, sync
//! choice, predicted step.

use crate::cluster::NodeId;
use crate::cost::Costs;
use crate::layers::LayerRange;
use crate::units::bytes_u64;

use super::choice::Best;
use super::layers::Bounds;
use super::recovery;
use super::sync::{Backward, SyncFreedom, SyncPlan, choose_sync};
use super::types::{Layout, NodePlan, Plan, PlannerKind, Role, StepPrediction};

// ---------------------------------------------------------------------------------------------
// Candidate layouts and their evaluation.

/// A concrete layout to evaluate.
#[derive(Debug, Clone)]
pub(super) enum Candidate {
    /// Workers with their batch shares (same order).
    Data {
        workers: Vec<NodeId>,
        batch: Vec<u64>,
        note: Option<String>,
    },
    /// `grid[r][k]` = node of stage k in replica r; micro-batches and samples per replica.
    Pipe {
        grid: Vec<Vec<NodeId>>,
        bounds: Bounds,
        micro: Vec<u64>,
        samples: Vec<u64>,
        note: Option<String>,
    },
    /// Sharded data parallel: workers in part order, their batch shares, the layer bounds of
    /// their parts (worker k owns `bounds[k]..bounds[k+1]`).
    Shard {
        workers: Vec<NodeId>,
        batch: Vec<u64>,
        bounds: Bounds,
        note: Option<String>,
    },
}

/// Evaluate candidates, keeping the best of `best`'s class. A pipeline candidate is skipped
/// when even perfect balance over its nodes could not beat `best` (a cheap lower bound: the
/// objective is never below the step).
pub(super) fn search_into(
    costs: &Costs<'_>,
    candidates: &[(Candidate, SyncFreedom)],
    best: &mut Best,
) {
    for (c, freedom) in candidates {
        if let Candidate::Pipe { grid, .. } = c
            && perfect_balance_s(costs, grid) >= best.bound()
        {
            continue;
        }
        if let Ok(p) = evaluate(costs, c, *freedom, best.bound()) {
            best.offer(p);
        }
    }
}

/// A lower bound on any plan over the nodes of `grid`: the global batch's work spread over
/// their combined throughput with no bubble, no transfer and no sync.
pub(super) fn perfect_balance_s(costs: &Costs<'_>, grid: &[Vec<NodeId>]) -> f64 {
    let work = f64::from(costs.training.global_batch) * costs.train_flops(costs.all());
    let flops: f64 = grid
        .iter()
        .flatten()
        .map(|&i| costs.cluster.node(i).flops)
        .sum();
    work / flops
}

/// Memory does not fit: (node, need, have).
#[derive(Debug)]
pub(super) struct NoFit(pub NodeId, pub u64, pub u64);

/// The least memory any part of the model needs: its smallest layer with one sample in
/// flight, and that layer's index.
pub(super) fn smallest_part_bytes(costs: &Costs<'_>) -> (u64, usize) {
    (0..costs.layers())
        .map(|l| (costs.memory_bytes(LayerRange::from(l..l + 1), 1), l))
        .min()
        .unwrap_or((0, 0))
}

/// Why a node has no part in a plan of `layout`.
fn idle_reason(costs: &Costs<'_>, layout: &Layout, id: NodeId) -> String {
    let node = costs.cluster.node(id);
    let (smallest, layer) = smallest_part_bytes(costs);
    if smallest > node.memory_bytes {
        return format!(
            "left out, too small for any part of the model: its smallest layer (`{}`, one \
             sample in flight) needs at least {}, the node has {} usable",
            costs.model.layers[layer].name,
            bytes_u64(smallest),
            bytes_u64(node.memory_bytes)
        );
    }
    let all = costs.all();
    match layout {
        Layout::DataParallel { .. } => {
            let need = costs.memory_bytes(all, 1);
            if need > node.memory_bytes {
                format!(
                    "left out: the whole model needs {} with one sample, the node has {} usable",
                    bytes_u64(need),
                    bytes_u64(node.memory_bytes)
                )
            } else {
                "left out: its share or its link would slow the step".into()
            }
        }
        Layout::Pipeline { stages, .. } => {
            format!("left out: no complete replica of {stages} stages left for it")
        }
        Layout::Sharded { .. } => {
            "left out: its share or its part of the ring would slow the step".into()
        }
    }
}

/// Why the nodes of a replica given no samples are idle.
const NO_SAMPLES: &str = "left out: its pipeline replica would get no samples of the global \
                          batch (faster replicas take them all)";

/// Why a candidate was not kept.
#[derive(Debug)]
pub(super) enum Rejected {
    /// A node's memory does not hold its part.
    NoFit(NoFit),
    /// Fits, but is not faster than the bound given.
    NotFaster,
}

impl From<NoFit> for Rejected {
    fn from(n: NoFit) -> Self {
        Rejected::NoFit(n)
    }
}

/// Evaluate a candidate; `beat` (seconds of the objective, [`Plan::objective_s`]) skips
/// building the plan when it would not be better.
pub(super) fn evaluate(
    costs: &Costs<'_>,
    c: &Candidate,
    freedom: SyncFreedom,
    beat: f64,
) -> Result<Plan, Rejected> {
    let cluster = costs.cluster;
    let b_total = u64::from(costs.training.global_batch);
    let mut nodes: Vec<Option<NodePlan>> = vec![None; cluster.nodes.len()];
    let (shaped, note) = match c {
        Candidate::Data {
            workers,
            batch,
            note,
        } => (
            evaluate_data(costs, workers, batch, freedom, beat, &mut nodes)?,
            note,
        ),
        Candidate::Pipe {
            grid,
            bounds,
            micro,
            samples,
            note,
        } => {
            let pipe = PipeShape {
                grid,
                bounds,
                micro,
                samples,
            };
            (
                evaluate_pipe(costs, &pipe, freedom, beat, &mut nodes)?,
                note,
            )
        }
        Candidate::Shard {
            workers,
            batch,
            bounds,
            note,
        } => (
            evaluate_shard(costs, workers, batch, bounds, beat, &mut nodes)?,
            note,
        ),
    };
    let Shaped {
        layout,
        sync,
        compute_max,
        noise_s,
        copies,
        working,
    } = shaped;
    let notes = note.iter().cloned().collect::<Vec<_>>();
    let step_s = compute_max + sync.per_step_s;
    if step_s >= beat {
        return Err(Rejected::NotFaster);
    }
    let slowest = working
        .iter()
        .map(|&w| cluster.node(w).link.bandwidth_gbps)
        .fold(f64::INFINITY, f64::min);
    let checkpoint = recovery::checkpoint_bytes(costs);
    let recovery = recovery::price(costs, copies, working.len(), slowest, checkpoint, step_s);
    if step_s + recovery.charged_s() >= beat {
        return Err(Rejected::NotFaster);
    }
    let nodes = finish_nodes(costs, nodes, &layout, sync.per_step_s, step_s);
    Ok(Plan {
        planner: PlannerKind::Ravnest,
        model: costs.model.name.clone(),
        global_batch: b_total,
        layout,
        nodes,
        step: StepPrediction {
            step_s,
            compute_s: compute_max,
            noise_s,
            sync_s: sync.per_step_s,
            samples_per_s: if step_s > 0.0 {
                b_total as f64 / step_s
            } else {
                0.0
            },
        },
        sync,
        notes,
        recovery,
        alternatives: Vec::new(),
        not_within: Vec::new(),
    })
}

/// A candidate's shape, its synchronization and its slowest compute path (seconds).
struct Shaped {
    layout: Layout,
    sync: SyncPlan,
    compute_max: f64,
    /// Of `compute_max`: the wait for the slowest of noisy workers.
    noise_s: f64,
    /// Working copies of every layer: data-parallel workers, or pipeline replicas.
    copies: usize,
    /// The nodes with work.
    working: Vec<NodeId>,
}

/// The pipeline of a [`Candidate::Pipe`].
struct PipeShape<'a> {
    /// `grid[r][k]` = node of stage k in replica r.
    grid: &'a [Vec<NodeId>],
    bounds: &'a Bounds,
    /// Micro-batches per replica.
    micro: &'a [u64],
    /// Samples per replica.
    samples: &'a [u64],
}

/// Place the workers of a data-parallel candidate in `nodes`, and choose their sync.
fn evaluate_data(
    costs: &Costs<'_>,
    workers: &[NodeId],
    batch: &[u64],
    freedom: SyncFreedom,
    beat: f64,
    nodes: &mut [Option<NodePlan>],
) -> Result<Shaped, Rejected> {
    let all = costs.all();
    let state = costs.state_bytes(all);
    let mut cmax: f64 = 0.0;
    let mut working = Vec::with_capacity(workers.len());
    for (&w, &b) in workers.iter().zip(batch) {
        if b == 0 {
            // No samples, no work: idle, and out of the sync ring (it would only slow it).
            let why = "left out: its share of the global batch rounds to 0 samples";
            nodes[w.index()] = Some(idle_node(costs, w, why.into()));
            continue;
        }
        working.push(w);
        // ravnest accumulates gradients over micro-batches when a share does not fit at once
        // (unless the file says not to); the baselines compute each batch at once.
        let at_once = freedom == SyncFreedom::Baseline || !costs.training.accumulate;
        let compute = place_worker(costs, (w, b), all, state, at_once, nodes)?;
        cmax = cmax.max(compute);
    }
    let (cmax, noise_s) = with_noise(costs, &working, cmax);
    if cmax >= beat {
        // The step is at least the compute: no sync makes it faster than `beat`.
        return Err(Rejected::NotFaster);
    }
    // Every-step rounds overlap the slowest worker's backward pass as far as the runtime
    // hands the gradient over in buckets while backward runs (an MLP's layers; other models'
    // whole gradient comes at the end of backward, and its round is all exposed).
    let buckets = crate::cost::grad_buckets(costs.model);
    let sync = choose_sync(
        costs,
        &[(working.clone(), costs.grad_bytes(all))],
        cmax,
        Backward::Buckets(&buckets),
        freedom,
    );
    Ok(Shaped {
        layout: Layout::DataParallel {
            workers: working.len(),
        },
        sync,
        compute_max: cmax,
        noise_s,
        copies: working.len(),
        working,
    })
}

/// Place the workers of a sharded candidate in `nodes` (each owning its part of the layers'
/// optimizer state), and price the reduce-scatter and all-gather around their ring.
fn evaluate_shard(
    costs: &Costs<'_>,
    workers: &[NodeId],
    batch: &[u64],
    bounds: &Bounds,
    beat: f64,
    nodes: &mut [Option<NodePlan>],
) -> Result<Shaped, Rejected> {
    let all = costs.all();
    let mut cmax: f64 = 0.0;
    for (k, (&w, &b)) in workers.iter().zip(batch).enumerate() {
        let part = LayerRange::of_stage(bounds, k);
        let state = costs.shard_memory_bytes(part, 0);
        let compute = place_worker(
            costs,
            (w, b),
            part,
            state,
            !costs.training.accumulate,
            nodes,
        )?;
        cmax = cmax.max(compute);
    }
    let (cmax, noise_s) = with_noise(costs, workers, cmax);
    if cmax >= beat {
        return Err(Rejected::NotFaster);
    }
    // The ring runs in the order that leaves each worker owning its part after the
    // reduce-scatter (rank r ends with chunk r + 1): the part order turned by one.
    let mut ring = workers.to_vec();
    ring.rotate_left(1);
    let buckets = crate::cost::grad_buckets(costs.model);
    let sync = super::sync::fixed_ring(costs, ring, costs.grad_bytes(all), cmax, &buckets);
    Ok(Shaped {
        layout: Layout::Sharded {
            workers: workers.len(),
            bounds: bounds.clone(),
        },
        sync,
        compute_max: cmax,
        noise_s,
        // Each part of the optimizer state has one copy: a lost worker's part comes back from
        // the latest checkpoint.
        copies: 1,
        working: workers.to_vec(),
    })
}

/// Place worker `w` computing `b` samples through the whole model in `nodes`, holding `layers`
/// (their state `state` bytes) beside the activations of what it computes at once (the whole
/// batch when `at_once`, else micro-batches its memory holds, gradients accumulated); its
/// compute seconds, or why it does not fit.
fn place_worker(
    costs: &Costs<'_>,
    (w, b): (NodeId, u64),
    layers: LayerRange,
    state: u64,
    at_once: bool,
    nodes: &mut [Option<NodePlan>],
) -> Result<f64, Rejected> {
    let node = costs.cluster.node(w);
    let act = costs.activation_bytes_per_sample(costs.all());
    let (micro, mem) = match at_once {
        true => (1, state + act * b),
        false => accumulation(state, act, b, node.memory_bytes).ok_or(NoFit(
            w,
            state + act,
            node.memory_bytes,
        ))?,
    };
    if mem > node.memory_bytes {
        return Err(NoFit(w, mem, node.memory_bytes).into());
    }
    let compute = costs.compute_s(w, costs.all(), b as f64);
    nodes[w.index()] = Some(NodePlan {
        id: w,
        name: String::new(),
        device: String::new(),
        role: Role::Worker,
        batch: b,
        micro_batches: micro,
        layers: Some(layers),
        grad_weight: b as f64 / f64::from(costs.training.global_batch),
        memory_bytes: mem,
        memory_limit_bytes: node.memory_bytes,
        compute_s: compute,
        comm_s: 0.0,
        idle_s: 0.0,
    });
    Ok(compute)
}

/// A step waits for the slowest of `workers`: with measured noise, the largest of their draws.
/// (The slowest compute `cmax` with that wait, the wait.)
fn with_noise(costs: &Costs<'_>, workers: &[NodeId], cmax: f64) -> (f64, f64) {
    let spreads: Vec<f64> = workers
        .iter()
        .map(|&w| costs.cluster.node(w).compute_spread)
        .collect();
    let noise_s = cmax * crate::cost::wait_for_slowest(&spreads);
    (cmax + noise_s, noise_s)
}

/// How a data-parallel worker computes `batch` samples in `memory` bytes when the model's state
/// takes `state` and each sample in flight `act`: the fewest equal micro-batches whose
/// activations fit (gradients accumulated over them), and the memory it then needs. `None`
/// when not even one sample fits.
pub(super) fn accumulation(state: u64, act: u64, batch: u64, memory: u64) -> Option<(u64, u64)> {
    let at_once = match act {
        0 => batch,
        _ => memory.checked_sub(state)? / act,
    }
    .min(batch);
    if at_once == 0 {
        return None;
    }
    let micro = batch.div_ceil(at_once);
    Some((micro, state + act * batch.div_ceil(micro)))
}

/// Place the stages of a pipeline candidate in `nodes`, and choose each stage group's sync.
fn evaluate_pipe(
    costs: &Costs<'_>,
    pipe: &PipeShape<'_>,
    freedom: SyncFreedom,
    beat: f64,
    nodes: &mut [Option<NodePlan>],
) -> Result<Shaped, Rejected> {
    let (grid, bounds) = (pipe.grid, pipe.bounds);
    let stages = bounds.len() - 1;
    let mut cmax: f64 = 0.0;
    let mut per_node_p2p = vec![0.0; costs.cluster.nodes.len()];
    // Replicas given no micro-batches do no work: their nodes stay idle (with the reason) and
    // out of the stage groups; the working replicas are numbered 0.. without gaps.
    let working: Vec<usize> = (0..grid.len()).filter(|&r| pipe.micro[r] > 0).collect();
    for (index, &r) in working.iter().enumerate() {
        let replica_s = place_replica(costs, pipe, r, index, nodes, &mut per_node_p2p)?;
        cmax = cmax.max(replica_s);
    }
    for r in (0..grid.len()).filter(|&r| pipe.micro[r] == 0) {
        for &id in &grid[r] {
            nodes[id.index()] = Some(idle_node(costs, id, NO_SAMPLES.into()));
        }
    }
    if cmax >= beat {
        // The step is at least the slowest replica's compute: not faster than `beat`.
        return Err(Rejected::NotFaster);
    }
    for (i, n) in nodes.iter_mut().enumerate() {
        if let Some(n) = n {
            n.comm_s = per_node_p2p[i];
        }
    }
    let groups: Vec<(Vec<NodeId>, u64)> = (0..stages)
        .map(|k| {
            (
                working.iter().map(|&r| grid[r][k]).collect(),
                costs.grad_bytes(LayerRange::of_stage(bounds, k)),
            )
        })
        .collect();
    // Stage gradients are reduced after the pipeline drains: no overlap is assumed.
    let sync = choose_sync(costs, &groups, cmax, Backward::Then, freedom);
    Ok(Shaped {
        layout: Layout::Pipeline {
            stages,
            replicas: working.len(),
            bounds: bounds.clone(),
            micro_batch: costs.training.micro_batch,
        },
        sync,
        compute_max: cmax,
        noise_s: 0.0,
        copies: working.len(),
        working: working
            .iter()
            .flat_map(|&r| grid[r].iter().copied())
            .collect(),
    })
}

/// Place replica `r`'s stages (numbered `index` among the working replicas) in `nodes` and
/// their transfer seconds in `per_node_p2p`; the replica's seconds per step: (micro-batches +
/// stages - 1) × its slowest stage.
fn place_replica(
    costs: &Costs<'_>,
    pipe: &PipeShape<'_>,
    r: usize,
    index: usize,
    nodes: &mut [Option<NodePlan>],
    per_node_p2p: &mut [f64],
) -> Result<f64, Rejected> {
    let cluster = costs.cluster;
    let b_total = u64::from(costs.training.global_batch);
    let (row, bounds, samples) = (&pipe.grid[r], pipe.bounds, pipe.samples);
    let stages = bounds.len() - 1;
    let m = u64::from(costs.training.micro_batch);
    let k_mb = pipe.micro[r];
    let mut bottleneck: f64 = 0.0;
    let mut stage_t = Vec::with_capacity(stages);
    for k in 0..stages {
        let id = row[k];
        let node = cluster.node(id);
        let range = LayerRange::of_stage(bounds, k);
        let in_flight = (stages - k) as u64 * m;
        let mem = costs.memory_bytes(range, in_flight);
        if mem > node.memory_bytes {
            return Err(NoFit(id, mem, node.memory_bytes).into());
        }
        let compute = costs.compute_s(id, range, m as f64);
        let p2p = if k + 1 < stages {
            let bytes = (costs.boundary_bytes_per_sample(bounds[k + 1]) * m) as f64;
            2.0 * costs.link(id, row[k + 1]).transfer_s(bytes)
        } else {
            0.0
        };
        stage_t.push((compute, p2p));
        bottleneck = bottleneck.max(compute + p2p);
        nodes[id.index()] = Some(NodePlan {
            id,
            name: String::new(),
            device: String::new(),
            role: Role::Stage {
                replica: index,
                stage: k,
            },
            batch: samples[r],
            micro_batches: k_mb,
            layers: Some(range),
            grad_weight: samples[r] as f64 / b_total as f64,
            memory_bytes: mem,
            memory_limit_bytes: node.memory_bytes,
            compute_s: compute * k_mb as f64,
            comm_s: 0.0,
            idle_s: 0.0,
        });
        per_node_p2p[id.index()] = p2p * k_mb as f64;
    }
    let replica_s = if k_mb > 0 {
        (k_mb + stages as u64 - 1) as f64 * bottleneck
    } else {
        0.0
    };
    Ok(replica_s)
}

/// Every node's plan: names, the sync charged per step and idle time for the placed ones, an
/// idle role (and why) for the rest.
fn finish_nodes(
    costs: &Costs<'_>,
    mut nodes: Vec<Option<NodePlan>>,
    layout: &Layout,
    sync_s: f64,
    step_s: f64,
) -> Vec<NodePlan> {
    let cluster = costs.cluster;
    cluster
        .ids()
        .map(|id| match nodes[id.index()].take() {
            Some(mut n) if matches!(n.role, Role::Idle { .. }) => {
                n.idle_s = step_s;
                n
            }
            Some(mut n) => {
                let node = cluster.node(id);
                n.name = node.name.clone();
                n.device = node.device.clone();
                n.comm_s += sync_s;
                n.idle_s = (step_s - n.compute_s - n.comm_s).max(0.0);
                n
            }
            None => {
                let mut n = idle_node(costs, id, idle_reason(costs, layout, id));
                n.idle_s = step_s;
                n
            }
        })
        .collect()
}

/// An idle node's plan, for `reason`.
fn idle_node(costs: &Costs<'_>, id: NodeId, reason: String) -> NodePlan {
    let node = costs.cluster.node(id);
    NodePlan {
        id,
        name: node.name.clone(),
        device: node.device.clone(),
        role: Role::Idle { reason },
        batch: 0,
        micro_batches: 0,
        layers: None,
        grad_weight: 0.0,
        memory_bytes: 0,
        memory_limit_bytes: node.memory_bytes,
        compute_s: 0.0,
        comm_s: 0.0,
        idle_s: 0.0,
    }
}

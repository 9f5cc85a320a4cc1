//! Turning a plan into per-node assignments, and finding where a node fetches the layers it
//! lacks. Pure functions of the plan, the live nodes and who holds what.

use std::collections::BTreeMap;

use ravnest_core::cost::Costs;
use ravnest_core::planner::{Layout, Plan, Role};
use ravnest_core::{ClusterSpec, LayerRange, ModelSpec, NodeId, TrainingSpec};

use crate::msg::{ShardWork, StageWork};

/// One node's assignment in an epoch, before it becomes a [`crate::msg::Work`].
#[derive(Debug, Clone, PartialEq)]
pub struct Assign {
    /// The node.
    pub node: NodeId,
    /// Its samples' offset within each step's global batch.
    pub offset: u64,
    /// Its samples per step (a stage: its replica's).
    pub batch: u64,
    /// Its sync group in ring order.
    pub ring: Vec<NodeId>,
    /// Its stage, in a pipeline.
    pub stage: Option<StageWork>,
    /// The share of the model's training FLOPs it computes per sample (1 in data parallel).
    pub flop_share: f64,
    /// Data parallel: samples it computes at once, when its memory makes it accumulate
    /// gradients over micro-batches of its batch (0: the whole batch).
    pub chunk: u64,
    /// Sharded data parallel: its part of the optimizer state.
    pub shard: Option<ShardWork>,
}

/// A sync group: the layers its members hold and the members in ring order.
pub type SyncGroup = (LayerRange, Vec<NodeId>);

/// Layer ranges a node fetches, each from a peer.
pub type Fetches = Vec<(NodeId, LayerRange)>;

/// Who holds a model version: node → the layers it holds (`None`: the whole model).
pub type Holders = BTreeMap<NodeId, Option<LayerRange>>;

/// Each node's assignment under plan `p` of the live nodes `live` (`sub`: their cluster, in
/// `live` order), and the sync groups.
pub fn assignments(
    p: &Plan,
    live: &[NodeId],
    sub: &ClusterSpec,
    model: &ModelSpec,
    training: &TrainingSpec,
) -> Result<(Vec<Assign>, Vec<SyncGroup>), String> {
    match &p.layout {
        Layout::DataParallel { .. } => Ok(data_parallel(p, live, model.layers.len() as u32)),
        Layout::Sharded { .. } => sharded(p, live),
        Layout::Pipeline {
            stages,
            replicas,
            bounds,
            micro_batch,
        } => {
            let costs = Costs::new(sub, model, training);
            let shape = Shape {
                stages: *stages,
                bounds,
                micro_batch: u64::from(*micro_batch),
            };
            pipeline(p, live, &costs, &shape, *replicas)
        }
    }
}

/// Samples a data-parallel (or sharded) worker computes at once: its batch over its
/// micro-batches when its memory makes it accumulate (0: the whole batch at once).
fn chunk_of(n: &ravnest_core::planner::NodePlan) -> u64 {
    match n.micro_batches {
        0 | 1 => 0,
        k => n.batch.div_ceil(k),
    }
}

/// Data parallel: every worker holds every layer, in one ring (the plan's order).
fn data_parallel(p: &Plan, live: &[NodeId], layers: u32) -> (Vec<Assign>, Vec<SyncGroup>) {
    let workers: Vec<(NodeId, u64, u64)> = p
        .nodes
        .iter()
        .filter(|n| n.batch > 0)
        .map(|n| {
            let chunk = chunk_of(n);
            (live[n.id.index()], n.batch, chunk)
        })
        .collect();
    let ring: Vec<NodeId> = match p.sync.groups.first() {
        Some(g) if g.order.len() == workers.len() => {
            g.order.iter().map(|i| live[i.index()]).collect()
        }
        _ => workers.iter().map(|w| w.0).collect(),
    };
    let mut offset = 0;
    let assigns = workers
        .iter()
        .map(|&(node, batch, chunk)| {
            offset += batch;
            Assign {
                node,
                offset: offset - batch,
                batch,
                ring: ring.clone(),
                stage: None,
                flop_share: 1.0,
                chunk,
                shard: None,
            }
        })
        .collect();
    (assigns, vec![(LayerRange::new(0, layers), ring)])
}

/// Sharded data parallel: every worker holds every weight, in one ring whose order leaves
/// each owning its part after a reduce-scatter (the part order turned by one, as the plan
/// orders it); each part is a sync group of its one owner, who writes its checkpoint shard.
fn sharded(p: &Plan, live: &[NodeId]) -> Result<(Vec<Assign>, Vec<SyncGroup>), String> {
    let mut workers: Vec<(NodeId, u64, u64, LayerRange)> = p
        .nodes
        .iter()
        .filter(|n| n.batch > 0)
        .map(|n| {
            let chunk = chunk_of(n);
            let part = n.layers.ok_or("a sharded worker without a part")?;
            Ok((live[n.id.index()], n.batch, chunk, part))
        })
        .collect::<Result<_, String>>()?;
    workers.sort_by_key(|w| w.3.range().start);
    let mut ring: Vec<(NodeId, LayerRange)> = workers.iter().map(|w| (w.0, w.3)).collect();
    ring.rotate_left(1);
    let mut at = 0;
    for (_, _, _, part) in &workers {
        if part.range().start != at || part.is_empty() {
            return Err(format!(
                "the sharded plan's parts do not tile the layers at {part}"
            ));
        }
        at = part.range().end;
    }
    let order: Vec<NodeId> = ring.iter().map(|r| r.0).collect();
    let parts: Vec<LayerRange> = ring.iter().map(|r| r.1).collect();
    let mut offset = 0;
    let assigns = workers
        .iter()
        .map(|&(node, batch, chunk, owned)| {
            offset += batch;
            Assign {
                node,
                offset: offset - batch,
                batch,
                ring: order.clone(),
                stage: None,
                flop_share: 1.0,
                chunk,
                shard: Some(ShardWork {
                    owned,
                    parts: parts.clone(),
                    fetch: Vec::new(),
                }),
            }
        })
        .collect();
    let groups = workers.iter().map(|w| (w.3, vec![w.0])).collect();
    Ok((assigns, groups))
}

/// A pipeline's shape: its stages, their layer bounds, the micro-batch.
struct Shape<'a> {
    stages: usize,
    bounds: &'a [usize],
    micro_batch: u64,
}

/// Pipelines: each replica's stages in a grid (replica × stage), and one sync group per stage
/// across the replicas that train.
fn pipeline(
    p: &Plan,
    live: &[NodeId],
    costs: &Costs,
    shape: &Shape<'_>,
    r: usize,
) -> Result<(Vec<Assign>, Vec<SyncGroup>), String> {
    let (s, bounds) = (shape.stages, shape.bounds);
    let mut grid: Vec<Vec<Option<NodeId>>> = vec![vec![None; s]; r];
    let mut samples = vec![0u64; r];
    for n in &p.nodes {
        if let Role::Stage { replica, stage } = n.role
            && n.batch > 0
            && replica < r
            && stage < s
        {
            grid[replica][stage] = Some(live[n.id.index()]);
            samples[replica] = n.batch;
        }
    }
    let whole = costs.train_flops(costs.all()).max(f64::MIN_POSITIVE);
    let mut assigns = Vec::new();
    let mut groups = Vec::new();
    let used: Vec<usize> = (0..r).filter(|&k| samples[k] > 0).collect();
    for k in 0..s {
        let column: Vec<NodeId> = used.iter().filter_map(|&rep| grid[rep][k]).collect();
        if column.len() != used.len() {
            return Err(format!(
                "the pipeline plan leaves stage {k} of a replica without a node"
            ));
        }
        // The plan's ring order for this stage's group, else replica order.
        let ring: Vec<NodeId> = p
            .sync
            .groups
            .iter()
            .map(|g| g.order.iter().map(|i| live[i.index()]).collect::<Vec<_>>())
            .find(|o| o.len() == column.len() && column.iter().all(|c| o.contains(c)))
            .unwrap_or_else(|| column.clone());
        let layers = LayerRange::of_stage(bounds, k);
        let flop_share = costs.train_flops(layers) / whole;
        groups.push((layers, ring.clone()));
        let mut offset = 0;
        for rep in 0..r {
            offset += samples[rep];
            let Some(node) = grid[rep][k].filter(|_| samples[rep] > 0) else {
                continue;
            };
            assigns.push(Assign {
                node,
                offset: offset - samples[rep],
                batch: samples[rep],
                ring: ring.clone(),
                flop_share,
                stage: Some(stage_work(costs, shape, k, &grid[rep])),
                chunk: 0,
                shard: None,
            });
        }
    }
    Ok((assigns, groups))
}

/// Stage `k` of a replica whose stages are held by `row`: its layers, neighbours, and the
/// bytes that cross its boundaries and its sync.
fn stage_work(costs: &Costs, shape: &Shape<'_>, k: usize, row: &[Option<NodeId>]) -> StageWork {
    let (s, bounds) = (shape.stages, shape.bounds);
    let at = |j: usize| row[j];
    StageWork {
        stage: k as u32,
        stages: s as u32,
        layers: LayerRange::of_stage(bounds, k),
        prev: k.checked_sub(1).and_then(at),
        next: (k + 1 < s).then(|| at(k + 1)).flatten(),
        micro_batch: shape.micro_batch,
        out_bytes_per_sample: if k + 1 < s {
            costs.boundary_bytes_per_sample(bounds[k + 1])
        } else {
            0
        },
        in_bytes_per_sample: if k > 0 {
            costs.boundary_bytes_per_sample(bounds[k])
        } else {
            0
        },
        sync_bytes: costs.grad_bytes(LayerRange::of_stage(bounds, k)),
        fetch: Vec::new(),
    }
}

/// Where `node` fetches the layers of `layers` it does not hold at version `version`: (peer,
/// layer range) pieces, each from a holder of the whole piece; an error names a layer nobody
/// holds.
pub fn fetch_plan(
    holders: &Holders,
    node: NodeId,
    layers: LayerRange,
    version: u64,
) -> Result<Fetches, String> {
    let holds = |n: NodeId, l: u32| {
        holders
            .get(&n)
            .is_some_and(|h| h.is_none_or(|h| h.contains(l)))
    };
    let mut out: Fetches = Vec::new();
    for l in layers.iter() {
        if holds(node, l) {
            continue;
        }
        let source = match out.last() {
            Some(&(s, last)) if last.end == l && holds(s, l) => Some(s),
            _ => holders.keys().copied().find(|&h| h != node && holds(h, l)),
        };
        let Some(s) = source else {
            return Err(format!(
                "layer {l} of model version {version} was held only by nodes that are gone"
            ));
        };
        match out.last_mut() {
            Some((p, last)) if *p == s && last.end == l => last.end = l + 1,
            _ => out.push((s, LayerRange::new(l, l + 1))),
        }
    }
    Ok(out)
}

/// What a sharded worker owning `owned` fetches of version `version` (weights and optimizer
/// state of whole layers), each range from a holder: the layers of its part whose state it
/// lacks, and, when it does not hold every weight, every layer it does not hold whole. It
/// holds every weight when it holds the whole version, or held part `prior` in the sharded
/// epoch before (and still holds it).
pub fn shard_fetch(
    holders: &Holders,
    prior: Option<LayerRange>,
    node: NodeId,
    owned: LayerRange,
    all: LayerRange,
    version: u64,
) -> Result<Fetches, String> {
    let (held, weights) = match holders.get(&node) {
        Some(None) => return Ok(Vec::new()),
        Some(Some(h)) => (Some(*h), prior == Some(*h)),
        None => (None, false),
    };
    let need = if weights { owned } else { all };
    let mut out = Vec::new();
    for piece in minus(need, held) {
        out.extend(fetch_plan(holders, node, piece, version)?);
    }
    Ok(out)
}

/// The layers of `a` outside `b`: up to two ranges.
fn minus(a: LayerRange, b: Option<LayerRange>) -> Vec<LayerRange> {
    let Some(b) = b.filter(|b| !b.is_empty()) else {
        return vec![a];
    };
    let (a0, a1) = (a.range().start as u32, a.range().end as u32);
    let (b0, b1) = (b.range().start as u32, b.range().end as u32);
    [
        LayerRange::new(a0, b0.clamp(a0, a1)),
        LayerRange::new(b1.clamp(a0, a1), a1),
    ]
    .into_iter()
    .filter(|r| !r.is_empty())
    .collect()
}

/// A node's compute cost: (seconds per sample of the whole model, fixed seconds per step).
pub type StepCost = (f64, f64);

/// The slowest node's compute seconds per step for `assigns` when node n costs `cost(n)`:
/// what a rebalance compares.
pub fn compute_bound(assigns: &[Assign], cost: impl Fn(NodeId) -> StepCost) -> f64 {
    assigns
        .iter()
        .map(|a| {
            let (per_sample, fixed) = cost(a.node);
            fixed * a.flop_share + a.batch as f64 * a.flop_share * per_sample
        })
        .fold(0.0, f64::max)
}

/// The compute seconds per step of a perfect balance of the same work over the same nodes (a
/// lower bound on any plan over them): the T at which Σ (T − fixed_i) / per_sample_i covers
/// the work.
pub fn balanced_bound(assigns: &[Assign], cost: impl Fn(NodeId) -> StepCost) -> f64 {
    let work: f64 = assigns.iter().map(|a| a.batch as f64 * a.flop_share).sum();
    let (mut speed, mut head) = (0.0, 0.0);
    for a in assigns {
        let (per_sample, fixed) = cost(a.node);
        let per_sample = per_sample.max(f64::MIN_POSITIVE);
        speed += 1.0 / per_sample;
        head += fixed * a.flop_share / per_sample;
    }
    (work + head) / speed.max(f64::MIN_POSITIVE)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fetches_come_from_holders_in_runs() {
        let mut h = Holders::new();
        h.insert(NodeId(0), Some(LayerRange::new(0, 4)));
        h.insert(NodeId(1), Some(LayerRange::new(4, 8)));
        h.insert(NodeId(2), Some(LayerRange::new(2, 6)));
        assert_eq!(
            fetch_plan(&h, NodeId(2), LayerRange::new(0, 8), 5).unwrap(),
            vec![
                (NodeId(0), LayerRange::new(0, 2)),
                (NodeId(1), LayerRange::new(6, 8))
            ]
        );
        let e = fetch_plan(&h, NodeId(3), LayerRange::new(7, 9), 5).unwrap_err();
        assert!(e.contains("layer 8 of model version 5"), "{e}");
        let mut whole = Holders::new();
        whole.insert(NodeId(4), None);
        assert_eq!(
            fetch_plan(&whole, NodeId(3), LayerRange::new(1, 3), 0).unwrap(),
            vec![(NodeId(4), LayerRange::new(1, 3))]
        );
    }

    #[test]
    fn a_sharded_worker_fetches_what_it_lacks() {
        let l = LayerRange::new;
        let all = l(0, 8);
        let mut h = Holders::new();
        h.insert(NodeId(0), Some(l(0, 3)));
        h.insert(NodeId(1), Some(l(3, 8)));
        // Same part as before: nothing to fetch.
        assert_eq!(
            shard_fetch(&h, Some(l(0, 3)), NodeId(0), l(0, 3), all, 4),
            Ok(vec![])
        );
        // A part grown by a re-plan: the state of the layers it gains, from their owner.
        assert_eq!(
            shard_fetch(&h, Some(l(0, 3)), NodeId(0), l(0, 5), all, 4),
            Ok(vec![(NodeId(1), l(3, 5))])
        );
        // A joiner: every layer, from the owners.
        assert_eq!(
            shard_fetch(&h, None, NodeId(2), l(5, 8), all, 4),
            Ok(vec![(NodeId(0), l(0, 3)), (NodeId(1), l(3, 8))])
        );
        // A pipeline stage of 0..3 before (no other weights): the rest of the layers.
        assert_eq!(
            shard_fetch(&h, None, NodeId(0), l(0, 3), all, 4),
            Ok(vec![(NodeId(1), l(3, 8))])
        );
        // The whole version: nothing. A layer nobody live holds: an error naming it.
        let mut whole = Holders::new();
        whole.insert(NodeId(3), None);
        assert_eq!(
            shard_fetch(&whole, None, NodeId(3), l(2, 4), all, 4),
            Ok(vec![])
        );
        h.remove(&NodeId(1));
        let e = shard_fetch(&h, None, NodeId(2), l(5, 8), all, 4).unwrap_err();
        assert!(e.contains("layer 3 of model version 4"), "{e}");
    }

    #[test]
    fn bounds_of_a_split() {
        let a = |node: u32, batch: u64| Assign {
            node: NodeId(node),
            offset: 0,
            batch,
            ring: vec![],
            stage: None,
            flop_share: 1.0,
            chunk: 0,
            shard: None,
        };
        let split = [a(0, 30), a(1, 10)];
        let cost = |n: NodeId| if n.0 == 0 { (1.0, 0.0) } else { (3.0, 0.0) };
        assert_eq!(compute_bound(&split, cost), 30.0);
        // 40 samples over speeds 1 and 1/3: 30 s.
        assert!((balanced_bound(&split, cost) - 30.0).abs() < 1e-9);
        // A fixed 4 s on the second node: T − 4 = 3·b₁ and T = b₀ with b₀ + b₁ = 40 → T = 31.
        let fixed = |n: NodeId| if n.0 == 0 { (1.0, 0.0) } else { (3.0, 4.0) };
        assert!((balanced_bound(&split, fixed) - 31.0).abs() < 1e-9);
        assert_eq!(compute_bound(&split, fixed), 34.0);
    }
}

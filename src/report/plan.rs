//! `ravnest plan`: the plan as text (node table, sync, layers) and as JSON.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use ravnest_core::planner::layers::Bounds;
use ravnest_core::planner::sync::{Collective, SyncMethod, secs};
use ravnest_core::planner::{Layout, NodePlan, Role};
use ravnest_core::units::{bytes_u64, num, rate, ratio, ratio_value};
use ravnest_core::{LayerRange, Plan, PlanError, Scenario};

use super::text::*;

fn layers_text(r: &Option<LayerRange>, total: usize) -> String {
    match r {
        None => "-".into(),
        Some(r) if r.range() == (0..total) => "all".into(),
        Some(r) => format!("{}-{}", r.start, r.end - 1),
    }
}

fn role_text(n: &NodePlan) -> String {
    match &n.role {
        Role::Worker => "worker".into(),
        Role::Stage { replica, stage } => format!("r{replica}/s{stage}"),
        Role::Idle { .. } => "idle".into(),
    }
}

fn layout_text(p: &Plan) -> String {
    match &p.layout {
        Layout::DataParallel { workers } => format!("data parallel over {workers} node(s)"),
        Layout::Pipeline {
            stages,
            replicas,
            micro_batch,
            ..
        } => format!(
            "{replicas} pipeline replica(s) x {stages} stages, micro-batch {micro_batch}, 1F1B schedule"
        ),
        Layout::Sharded { workers, .. } => format!(
            "sharded data parallel over {workers} nodes (optimizer state in parts sized by memory)"
        ),
    }
}

fn collective_text(c: Collective) -> &'static str {
    match c {
        Collective::Ring => "ring all-reduce",
        Collective::ParamServer => "parameter server",
        Collective::Ring2d => "two-level ring all-reduce",
    }
}

/// A plan's synchronization in a few words.
fn sync_head(p: &Plan) -> String {
    match p.sync.method {
        SyncMethod::None => "none".to_string(),
        SyncMethod::EveryStep { collective } => {
            format!("{} every step", collective_text(collective))
        }
        SyncMethod::LocalSgd {
            collective,
            local_steps,
            outer,
        } => {
            let outer = if outer.is_plain_average() {
                String::new()
            } else {
                format!(" ({})", outer.describe())
            };
            format!(
                "local SGD: {local_steps} local steps, then {}{outer}",
                collective_text(collective)
            )
        }
    }
}

fn sync_text(p: &Plan, names: &dyn Fn(ravnest_core::NodeId) -> String) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "sync: {}", sync_head(p));
    if !matches!(p.sync.method, SyncMethod::None) {
        for (k, g) in p.sync.groups.iter().enumerate() {
            let label = if p.sync.groups.len() > 1 {
                format!("  stage {k}: ")
            } else {
                "  ".to_string()
            };
            let order: Vec<String> = if g.order.len() > 8 {
                let mut v: Vec<String> = g.order[..4].iter().map(|&i| names(i)).collect();
                v.push(format!("... {} more", g.order.len() - 5));
                v.push(names(*g.order.last().unwrap()));
                v
            } else {
                g.order.iter().map(|&i| names(i)).collect()
            };
            let sep = match p.sync.method {
                SyncMethod::EveryStep {
                    collective: Collective::ParamServer,
                }
                | SyncMethod::LocalSgd {
                    collective: Collective::ParamServer,
                    ..
                } => " <- ",
                _ => " -> ",
            };
            let _ = writeln!(
                out,
                "{label}{} ({} nodes, {} each, slowest link {} Gbit/s, {} per round)",
                order.join(sep),
                g.order.len(),
                bytes_u64(g.bytes),
                num(g.bottleneck_gbps),
                secs(g.round_s)
            );
            if p.sync.groups.len() > 6 && k == 2 {
                let _ = writeln!(out, "  ... {} more stages", p.sync.groups.len() - 3);
                break;
            }
        }
    }
    let _ = writeln!(out, "  why: {}", p.sync.reason);
    out
}

/// One printed row: the first node of a group, and how many nodes the group has.
type Row<'a> = (String, usize, &'a NodePlan);

/// Nodes that print identically: device, role, batch, layers.
type GroupKey = (String, String, u64, String);

/// The table of nodes (grouped when the cluster is large).
fn node_table(p: &Plan, layers_total: usize) -> String {
    let grouped = p.nodes.len() > MAX_ROWS;
    let rows: Vec<Row<'_>> = if !grouped {
        p.nodes.iter().map(|n| (n.name.clone(), 1, n)).collect()
    } else {
        // Group identical rows: same device, role kind, stage, batch and layers.
        let mut groups: BTreeMap<GroupKey, Row<'_>> = BTreeMap::new();
        for n in &p.nodes {
            let role = match &n.role {
                Role::Stage { stage, .. } => format!("stage {stage}"),
                r => format!("{r:?}")
                    .split_whitespace()
                    .next()
                    .unwrap_or("")
                    .to_string(),
            };
            let key = (
                n.device.clone(),
                role,
                n.batch,
                layers_text(&n.layers, layers_total),
            );
            groups
                .entry(key)
                .or_insert_with(|| (n.name.clone(), 0, n))
                .1 += 1;
        }
        let mut v: Vec<_> = groups.into_values().collect();
        v.sort_by_key(|(_, _, n)| n.id);
        v
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<16} {:>5} {:<10} {:<7} {:>6} {:>6} {:>7}  {:>24}  {:>9} {:>9} {:>9}",
        "node",
        if grouped { "count" } else { "" },
        "device",
        "role",
        "batch",
        "micro",
        "layers",
        "memory",
        "compute",
        "comm",
        "idle"
    );
    for (name, count, n) in rows {
        let mem = if n.memory_bytes > 0 {
            format!(
                "{:>9}/{:<9} {:>3.0}%",
                bytes_u64(n.memory_bytes),
                bytes_u64(n.memory_limit_bytes),
                100.0 * n.memory_bytes as f64 / n.memory_limit_bytes.max(1) as f64
            )
        } else {
            format!("{:>9}/{:<9}    -", "-", bytes_u64(n.memory_limit_bytes))
        };
        let _ = writeln!(
            out,
            "{:<16} {:>5} {:<10} {:<7} {:>6} {:>6} {:>7}  {:>24}  {:>9} {:>9} {:>9}",
            truncate(&name, 16),
            if grouped {
                count.to_string()
            } else {
                String::new()
            },
            n.device,
            role_text(n),
            n.batch,
            n.micro_batches,
            layers_text(&n.layers, layers_total),
            mem,
            secs(n.compute_s),
            secs(n.comm_s),
            secs(n.idle_s)
        );
    }
    // Idle nodes by reason (a node too small for any part of the model is one of them): each
    // reason once, with the nodes it applies to.
    let mut idle: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for n in &p.nodes {
        if let Role::Idle { reason } = &n.role {
            idle.entry(reason.as_str())
                .or_default()
                .push(n.name.as_str());
        }
    }
    for (reason, names) in idle {
        let who = if names.len() <= 4 {
            names.join(", ")
        } else {
            format!("{}, ... {} more", names[..3].join(", "), names.len() - 3)
        };
        let _ = writeln!(out, "idle ({}: {who}): {reason}", names.len());
    }
    out
}

fn bounds_text(b: &Bounds) -> String {
    b.windows(2)
        .map(|w| format!("{}-{}", w[0], w[1] - 1))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// What a plan is compared with.
#[derive(Debug, Default)]
pub struct Comparisons {
    /// The uniform (equal split) plan, unless the plan is the uniform one.
    pub uniform: Option<Result<Plan, PlanError>>,
    /// The same planner with synchronization every step (no local SGD), when the plan uses
    /// local SGD: the like-for-like comparison with a synchronous baseline.
    pub every_step: Option<Result<Plan, PlanError>>,
}

/// `ravnest plan` as text.
pub fn plan_text(origin: &str, s: &Scenario, p: &Plan, cmp: &Comparisons) -> String {
    super::text::wrap(&plan_lines(origin, s, p, cmp), super::text::WIDTH)
}

/// The plan's lines, before wrapping.
fn plan_lines(origin: &str, s: &Scenario, p: &Plan, cmp: &Comparisons) -> String {
    let mut out = String::new();
    let params = s.model.params();
    let _ = writeln!(out, "ravnest plan: {} ({origin})", s.cluster.name);
    let _ = writeln!(
        out,
        "model {}: {:.1}M parameters in {} layers; global batch {}, micro-batch {}, {}, {}",
        s.model.name,
        params as f64 / 1e6,
        s.model.layers.len(),
        s.training.global_batch,
        s.training.micro_batch,
        s.training.optimizer.as_str(),
        s.training.precision.as_str()
    );
    let _ = writeln!(out, "planner {}: {}", p.planner, layout_text(p));
    let _ = writeln!(out, "split: {}", p.split_line());
    match &p.layout {
        Layout::Pipeline { bounds, .. } => {
            let _ = writeln!(out, "stage layers: {}", bounds_text(bounds));
        }
        Layout::Sharded { bounds, .. } => {
            let _ = writeln!(out, "part layers: {}", bounds_text(bounds));
        }
        Layout::DataParallel { .. } => {}
    }
    out.push('\n');
    out.push_str(&node_table(p, s.model.layers.len()));
    out.push('\n');
    let names = |id: ravnest_core::NodeId| s.cluster.node(id).name.clone();
    out.push_str(&sync_text(p, &names));
    for n in &p.notes {
        let _ = writeln!(out, "note: {n}");
    }
    let noise = match p.step.noise_s > 0.0 {
        true => format!(
            " (of it {} waiting for the slowest of noisy workers)",
            secs(p.step.noise_s)
        ),
        false => String::new(),
    };
    let _ = writeln!(
        out,
        "predicted: {} per step = compute {}{noise} + sync {}; {} samples/s",
        secs(p.step.step_s),
        secs(p.step.compute_s),
        secs(p.step.sync_s),
        rate(p.step.samples_per_s)
    );
    let t = &s.training;
    out.push_str(&super::recovery::recovery_text(
        p,
        t.node_mtbf_h,
        t.checkpoint_every_steps,
        t.redundancy.as_str(),
    ));
    if let Some(b) = &cmp.uniform {
        out.push('\n');
        out.push_str(&comparison_text(p, b, cmp.every_step.as_ref()));
    }
    out
}

/// Whether a plan averages models every few steps (local SGD) rather than gradients every step.
fn is_local_sgd(p: &Plan) -> bool {
    matches!(p.sync.method, SyncMethod::LocalSgd { .. })
}

/// One plan's step in a line: layout, sync, step time, samples/s.
fn step_line(label: &str, p: &Plan) -> String {
    format!(
        "{label} ({}, {}): {} per step, {} samples/s\n",
        short_layout(p),
        sync_head(p),
        secs(p.step.step_s),
        rate(p.step.samples_per_s)
    )
}

/// The plan against the uniform baseline: a bounded ratio that says what it compares, and,
/// when the plan uses local SGD and the baseline does not, that the two are different
/// algorithms (with the synchronous plan as the like-for-like comparison).
fn comparison_text(
    p: &Plan,
    uniform: &Result<Plan, PlanError>,
    every_step: Option<&Result<Plan, PlanError>>,
) -> String {
    let mut out = String::new();
    let u = match uniform {
        Ok(u) => u,
        Err(e) => {
            let _ = writeln!(out, "{e}");
            return out;
        }
    };
    out.push_str(&step_line("uniform, equal split", u));
    let speedup = ratio(p.step.samples_per_s, u.step.samples_per_s);
    if !is_local_sgd(p) || is_local_sgd(u) {
        let _ = writeln!(
            out,
            "{} vs uniform (same model, global batch and update rule): {speedup} the samples/s",
            p.planner
        );
        return out;
    }
    let SyncMethod::LocalSgd { local_steps, .. } = p.sync.method else {
        unreachable!("checked above")
    };
    if let Some(Ok(sync)) = every_step {
        out.push_str(&step_line(
            &format!("{} synchronizing every step", p.planner),
            sync,
        ));
        let _ = writeln!(
            out,
            "{} vs uniform, both synchronous (same update rule): {} the samples/s",
            p.planner,
            ratio(sync.step.samples_per_s, u.step.samples_per_s)
        );
    }
    let _ = writeln!(
        out,
        "{} with local SGD is a different algorithm, not a speedup of the same one: it averages \
         the models once every {local_steps} steps instead of reducing gradients every step \
         ({speedup} uniform's samples/s), and its steps may converge differently; \
         set `sync = \"ring\"` for exact synchronous updates",
        p.planner
    );
    out
}

/// `ravnest plan --json`.
/// `speedup` is samples/s over the uniform plan's, bounded (see `units::ratio_value`), null when
/// it has no meaning; `same_algorithm` is false when the plan uses local SGD and uniform does
/// not, and `every_step` then holds the synchronous plan and its bounded speedup.
pub fn plan_json(s: &Scenario, p: &Plan, cmp: &Comparisons) -> anyhow::Result<String> {
    let base = cmp.uniform.as_ref().map(|b| match b {
        Ok(u) => {
            let every_step = cmp.every_step.as_ref().map(|e| match e {
                Ok(e) => serde_json::json!({
                    "plan": e,
                    "speedup": ratio_value(e.step.samples_per_s, u.step.samples_per_s),
                }),
                Err(e) => serde_json::json!({ "error": e.to_string() }),
            });
            serde_json::json!({
                "plan": u,
                "speedup": ratio_value(p.step.samples_per_s, u.step.samples_per_s),
                "same_algorithm": !is_local_sgd(p) || is_local_sgd(u),
                "every_step": every_step,
            })
        }
        Err(e) => serde_json::json!({ "error": e.to_string() }),
    });
    Ok(serde_json::to_string_pretty(&serde_json::json!({
        "cluster": s.cluster.name,
        "model": { "name": s.model.name, "params": s.model.params(), "layers": s.model.layers.len() },
        "training": s.training,
        "plan": p,
        "uniform": base,
    }))?)
}

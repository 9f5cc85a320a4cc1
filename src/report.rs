//! Human-readable and JSON reports. Formatting only: every figure comes from the plan.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use ravnest_core::device::{self, GIB};
use ravnest_core::model::PRESETS;
use ravnest_core::planner::layers::Bounds;
use ravnest_core::planner::sync::{Collective, SyncMethod, secs};
use ravnest_core::planner::{Layout, NodePlan, Role};
use ravnest_core::{Plan, PlanError, PlannerKind, Scenario};

/// Clusters larger than this print one row per group of identical nodes.
const MAX_ROWS: usize = 24;

fn gib(bytes: u64) -> String {
    format!("{:.1}", bytes as f64 / GIB)
}

fn layers_text(r: &Option<std::ops::Range<usize>>, total: usize) -> String {
    match r {
        None => "-".into(),
        Some(r) if r.start == 0 && r.end == total => "all".into(),
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
    }
}

fn short_layout(p: &Plan) -> String {
    match &p.layout {
        Layout::DataParallel { workers } => format!("dp x{workers}"),
        Layout::Pipeline {
            stages, replicas, ..
        } => format!("pp {replicas}x{stages}"),
    }
}

fn collective_text(c: Collective) -> &'static str {
    match c {
        Collective::Ring => "ring all-reduce",
        Collective::ParamServer => "parameter server",
        Collective::Ring2d => "two-level ring all-reduce",
    }
}

fn sync_text(p: &Plan, names: &dyn Fn(ravnest_core::NodeId) -> String) -> String {
    let mut out = String::new();
    let head = match p.sync.method {
        SyncMethod::None => "none".to_string(),
        SyncMethod::EveryStep { collective } => {
            format!("{} every step", collective_text(collective))
        }
        SyncMethod::LocalSgd {
            collective,
            local_steps,
        } => format!(
            "local SGD: {local_steps} local steps, then {}",
            collective_text(collective)
        ),
    };
    let _ = writeln!(out, "sync: {head}");
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
                "{label}{} ({} nodes, {:.1} MB each, slowest link {} Gbit/s, {} per round)",
                order.join(sep),
                g.order.len(),
                g.bytes as f64 / 1e6,
                g.bottleneck_gbps,
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
        "{:<16} {:>5} {:<10} {:<7} {:>6} {:>6} {:>7}  {:>17}  {:>9} {:>9} {:>9}",
        "node",
        if grouped { "count" } else { "" },
        "device",
        "role",
        "batch",
        "micro",
        "layers",
        "memory GiB",
        "compute",
        "comm",
        "idle"
    );
    for (name, count, n) in rows {
        let mem = if n.memory_bytes > 0 {
            format!(
                "{:>5}/{:<5} {:>3.0}%",
                gib(n.memory_bytes),
                gib(n.memory_limit_bytes),
                100.0 * n.memory_bytes as f64 / n.memory_limit_bytes as f64
            )
        } else {
            format!("    -/{:<5}   -", gib(n.memory_limit_bytes))
        };
        let _ = writeln!(
            out,
            "{:<16} {:>5} {:<10} {:<7} {:>6} {:>6} {:>7}  {:>17}  {:>9} {:>9} {:>9}",
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
    let idle: Vec<&NodePlan> = p
        .nodes
        .iter()
        .filter(|n| matches!(n.role, Role::Idle { .. }))
        .collect();
    if let Some(first) = idle.first()
        && let Role::Idle { reason } = &first.role
    {
        let _ = writeln!(out, "idle nodes ({}): {reason}", idle.len());
    }
    out
}

fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n - 1).chain(['~']).collect()
    }
}

fn bounds_text(b: &Bounds) -> String {
    b.windows(2)
        .map(|w| format!("{}-{}", w[0], w[1] - 1))
        .collect::<Vec<_>>()
        .join(" | ")
}

/// `ravnest plan` as text.
pub fn plan_text(
    origin: &str,
    s: &Scenario,
    p: &Plan,
    baseline: Option<&Result<Plan, PlanError>>,
) -> String {
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
    if let Layout::Pipeline { bounds, .. } = &p.layout {
        let _ = writeln!(out, "stage layers: {}", bounds_text(bounds));
    }
    out.push('\n');
    out.push_str(&node_table(p, s.model.layers.len()));
    out.push('\n');
    let names = |id: ravnest_core::NodeId| s.cluster.node(id).name.clone();
    out.push_str(&sync_text(p, &names));
    for n in &p.notes {
        let _ = writeln!(out, "note: {n}");
    }
    let _ = writeln!(
        out,
        "predicted: {} per step = compute {} + sync {}; {:.1} samples/s",
        secs(p.step.step_s),
        secs(p.step.compute_s),
        secs(p.step.sync_s),
        p.step.samples_per_s
    );
    if let Some(b) = baseline {
        out.push('\n');
        match b {
            Ok(u) => {
                let _ = writeln!(
                    out,
                    "uniform (equal split, {}): {} per step, {:.1} samples/s",
                    short_layout(u),
                    secs(u.step.step_s),
                    u.step.samples_per_s
                );
                let _ = writeln!(
                    out,
                    "{} is {:.2}x the samples/s of uniform",
                    p.planner,
                    p.step.samples_per_s / u.step.samples_per_s
                );
            }
            Err(e) => {
                let _ = writeln!(out, "uniform: {e}");
            }
        }
    }
    out
}

/// `ravnest plan --json`.
pub fn plan_json(
    s: &Scenario,
    p: &Plan,
    baseline: Option<&Result<Plan, PlanError>>,
) -> anyhow::Result<String> {
    let base = baseline.map(|b| match b {
        Ok(u) => serde_json::json!({
            "plan": u,
            "speedup": p.step.samples_per_s / u.step.samples_per_s,
        }),
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

/// One row of `ravnest bench planners`.
#[derive(Debug)]
pub struct BenchRow {
    /// Scenario name.
    pub scenario: String,
    /// Node count.
    pub nodes: usize,
    /// Planner.
    pub planner: PlannerKind,
    /// Outcome.
    pub result: Result<Plan, PlanError>,
    /// Wall time of planning, ms.
    pub plan_ms: f64,
}

/// The planner quality table.
pub fn bench_table(rows: &[BenchRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<18} {:>5}  {:<12} {:<10} {:>10} {:>12} {:>11} {:>10}",
        "scenario", "nodes", "planner", "layout", "step", "samples/s", "vs uniform", "plan time"
    );
    for chunk in rows.chunk_by(|a, b| a.scenario == b.scenario) {
        let uniform = chunk
            .iter()
            .find(|r| r.planner == PlannerKind::Uniform)
            .and_then(|r| r.result.as_ref().ok())
            .map(|p| p.step.samples_per_s);
        for (i, r) in chunk.iter().enumerate() {
            let (sc, n) = if i == 0 {
                (r.scenario.clone(), r.nodes.to_string())
            } else {
                (String::new(), String::new())
            };
            match &r.result {
                Ok(p) => {
                    let vs = uniform.map_or("-".to_string(), |u| {
                        format!("{:.2}x", p.step.samples_per_s / u)
                    });
                    let _ = writeln!(
                        out,
                        "{:<18} {:>5}  {:<12} {:<10} {:>10} {:>12.1} {:>11} {:>8.2}ms",
                        sc,
                        n,
                        r.planner.as_str(),
                        short_layout(p),
                        secs(p.step.step_s),
                        p.step.samples_per_s,
                        vs,
                        r.plan_ms
                    );
                }
                Err(e) => {
                    let why = match e {
                        PlanError::TooLargeForExhaustive { limit, .. } => {
                            format!("n/a (more than {limit} nodes)")
                        }
                        PlanError::NoEqualSplit { .. } => "does not fit (equal split)".to_string(),
                        other => other.to_string(),
                    };
                    let _ = writeln!(
                        out,
                        "{:<18} {:>5}  {:<12} {}",
                        sc,
                        n,
                        r.planner.as_str(),
                        why
                    );
                }
            }
        }
    }
    out
}

/// `ravnest catalog`.
pub fn catalog_text() -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<11} {:<28} {:>7} {:>10} {:>10} {:>10} {:>11}  grounding",
        "device", "name", "GiB", "fp32 peak", "fp16 peak", "fp32 eff.", "efficiency"
    );
    for d in device::CATALOG {
        let eff = d
            .effective_flops(ravnest_core::Precision::Fp32)
            .unwrap_or(0.0)
            / 1e12;
        let grounding = match d.grounding {
            device::Grounding::Measured(m) => {
                format!("measured (Sailor {}, mbs {})", m.sailor_gpu, m.mbs)
            }
            device::Grounding::Sibling(s) => format!("efficiency of {s}"),
            device::Grounding::Assumed(e) => format!("assumed efficiency {e}"),
        };
        let _ = writeln!(
            out,
            "{:<11} {:<28} {:>7.0} {:>10.1} {:>10} {:>10.1} {:>11.2}  {grounding}",
            d.id,
            d.name,
            d.memory_gib,
            d.fp32_peak_tflops,
            d.fp16_peak_tflops.map_or("-".into(), |x| format!("{x:.1}")),
            eff,
            d.fp32_efficiency()
        );
    }
    let _ = writeln!(
        out,
        "(TFLOP/s; fp16 peak is the dense tensor rate with fp32 accumulate)\n"
    );
    let _ = writeln!(out, "{:<17} {:>10}  about", "model preset", "params");
    for p in PRESETS {
        let n = p.build().params() as f64;
        let size = if n >= 1e6 {
            format!("{:.1}M", n / 1e6)
        } else {
            format!("{:.1}K", n / 1e3)
        };
        let _ = writeln!(out, "{:<17} {:>10}  {}", p.name, size, p.about);
    }
    out
}

/// `ravnest sim` as text.
pub fn sim_text(origin: &str, r: &ravnest_sim::SimReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "ravnest sim: {} ({origin}), planner {}, seed {}",
        r.scenario, r.planner, r.seed
    );
    let _ = writeln!(
        out,
        "simulated {:.1} s: {}/{} steps, {:.1} samples/s, capacity efficiency {:.2}",
        r.sim_time_s, r.steps_completed, r.steps_requested, r.samples_per_s, r.capacity_efficiency
    );
    out.push('\n');
    let _ = writeln!(
        out,
        "{:<16} {:<10} {:<7} {:>12} {:>6} {:>6} {:>6} {:>12} {:>6} {:>8}",
        "node", "device", "role", "memory GiB", "busy", "comm", "idle", "sent", "steps", "aborted"
    );
    for n in r.nodes.iter().take(MAX_ROWS) {
        let _ = writeln!(
            out,
            "{:<16} {:<10} {:<7} {:>12} {:>5.0}% {:>5.0}% {:>5.0}% {:>9.1} MB {:>6} {:>8}",
            truncate(&n.name, 16),
            n.device,
            n.role,
            if n.memory_bytes > 0 {
                format!(
                    "{:.1}/{:.1}",
                    n.memory_bytes as f64 / GIB,
                    n.memory_limit_bytes as f64 / GIB
                )
            } else {
                format!("-/{:.1}", n.memory_limit_bytes as f64 / GIB)
            },
            n.busy * 100.0,
            n.comm * 100.0,
            n.idle * 100.0,
            n.bytes_sent as f64 / 1e6,
            n.steps,
            n.aborted
        );
    }
    if r.nodes.len() > MAX_ROWS {
        let _ = writeln!(
            out,
            "... {} more nodes (--json lists all)",
            r.nodes.len() - MAX_ROWS
        );
    }
    if !r.faults.is_empty() {
        let _ = writeln!(out, "\nfaults:");
        for f in &r.faults {
            let mut line = format!("  at {:>7.1} s  {}", f.at_s, f.fault);
            if let Some(j) = f.rejoined_after_s {
                let _ = write!(line, ": rejoined after {j:.2} s");
            }
            if let Some(d) = f.detected_after_s {
                let _ = write!(line, ": detected after {d:.2} s");
            }
            match (f.resumed_after_s, f.detected_after_s) {
                (Some(x), Some(_)) => {
                    let _ = write!(line, ", training resumed after {x:.2} s");
                }
                (Some(x), None) => {
                    let sep = if f.rejoined_after_s.is_some() {
                        ","
                    } else {
                        ":"
                    };
                    let _ = write!(line, "{sep} next step completed {x:.2} s later");
                }
                (None, _) => line.push_str(": no step completed after it"),
            }
            if let Some(k) = f.replanned_after_steps {
                let _ = write!(line, "; re-planned for measured speeds {k} steps later");
            }
            let _ = writeln!(out, "{line}");
        }
    }
    let _ = writeln!(
        out,
        "\nplans made: {} · messages dropped by the network: {}",
        r.plans, r.dropped
    );
    match r.checkpoints.last() {
        Some(last) => {
            let _ = writeln!(
                out,
                "checkpoints: {} complete, the latest at step {last}",
                r.checkpoints.len()
            );
        }
        None => {
            let _ = writeln!(out, "checkpoints: none");
        }
    }
    if r.violations.is_empty() {
        let _ = writeln!(
            out,
            "checkers: all held (replicas identical after every synchronized step; final model equals single-node training, max error {:.1e})",
            r.max_model_error
        );
    } else {
        for v in &r.violations {
            let _ = writeln!(out, "CHECKER FAILED: {v}");
        }
    }
    let _ = writeln!(
        out,
        "trace: {} entries, hash {:016x}",
        r.trace_len, r.trace_hash
    );
    out
}

/// Two runs side by side.
pub fn sim_compare(a: &ravnest_sim::SimReport, b: &ravnest_sim::SimReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<14} {:>12} {:>10} {:>12} {:>11}",
        "planner", "sim time", "steps", "samples/s", "efficiency"
    );
    for r in [a, b] {
        let _ = writeln!(
            out,
            "{:<14} {:>10.1} s {:>10} {:>12.1} {:>11.2}",
            r.planner, r.sim_time_s, r.steps_completed, r.samples_per_s, r.capacity_efficiency
        );
    }
    if b.samples_per_s > 0.0 {
        let _ = writeln!(
            out,
            "{} / {} samples/s: {:.2}x",
            a.planner,
            b.planner,
            a.samples_per_s / b.samples_per_s
        );
    }
    out
}

/// One row of `ravnest bench sim`.
#[derive(Debug)]
pub struct SimBenchRow {
    /// Scenario name.
    pub scenario: String,
    /// Planner.
    pub planner: PlannerKind,
    /// The run, or why it could not run.
    pub result: Result<ravnest_sim::SimReport, String>,
    /// Wall seconds the simulation took.
    pub wall_s: f64,
}

/// The simulated planner comparison with simulator speed.
pub fn sim_bench_table(rows: &[SimBenchRow]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<16} {:<12} {:>7} {:>10} {:>11} {:>11} {:>9} {:>12} {:>9}",
        "scenario",
        "planner",
        "steps",
        "sim time",
        "samples/s",
        "efficiency",
        "vs unif.",
        "events/s",
        "wall"
    );
    for chunk in rows.chunk_by(|a, b| a.scenario == b.scenario) {
        let uniform = chunk
            .iter()
            .find(|r| r.planner == PlannerKind::Uniform)
            .and_then(|r| r.result.as_ref().ok())
            .map(|r| r.samples_per_s);
        for (i, row) in chunk.iter().enumerate() {
            let name = if i == 0 { row.scenario.as_str() } else { "" };
            match &row.result {
                Ok(r) => {
                    let vs =
                        uniform.map_or("-".to_string(), |u| format!("{:.2}x", r.samples_per_s / u));
                    let flag = if r.violations.is_empty() {
                        ""
                    } else {
                        "  CHECKER FAILED"
                    };
                    let _ = writeln!(
                        out,
                        "{:<16} {:<12} {:>7} {:>8.1} s {:>11.1} {:>11.2} {:>9} {:>12.0} {:>7.2} s{flag}",
                        name,
                        row.planner.as_str(),
                        r.steps_completed,
                        r.sim_time_s,
                        r.samples_per_s,
                        r.capacity_efficiency,
                        vs,
                        r.trace_len as f64 / row.wall_s.max(1e-9),
                        row.wall_s
                    );
                }
                Err(e) => {
                    let short = if e.contains("no equal split fits") {
                        "does not fit (equal split)".to_string()
                    } else {
                        e.clone()
                    };
                    let _ = writeln!(out, "{:<16} {:<12} {short}", name, row.planner.as_str());
                }
            }
        }
    }
    out
}

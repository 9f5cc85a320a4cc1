//! `ravnest bench planners` and `bench sim`: one row per scenario and planner.

use std::fmt::Write as _;

use ravnest_core::planner::sync::secs;
use ravnest_core::{Plan, PlanError, PlannerKind};

use super::text::*;

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

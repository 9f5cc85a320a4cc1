//! `ravnest bench planners`: every planner on every scenario, and ravnest against the
//! exhaustive oracle on seeded random clusters.

use std::time::Instant;

use anyhow::{Result, bail};
use ravnest_core::{PlannerKind, Scenario};

use crate::report;

/// Every planner on every input, with its planning time.
pub fn scenarios(inputs: &[(String, Scenario)]) -> String {
    let mut rows = Vec::new();
    for (name, s) in inputs {
        for kind in PlannerKind::ALL {
            let t0 = Instant::now();
            let p = ravnest_core::plan_scenario(kind, s);
            rows.push(report::BenchRow {
                scenario: name.clone(),
                nodes: s.cluster.nodes.len(),
                planner: kind,
                result: p,
                plan_ms: t0.elapsed().as_secs_f64() * 1e3,
            });
        }
    }
    report::bench_table(&rows)
}

/// Planning times: median, p99 and max, in milliseconds.
fn times(v: &mut [f64]) -> String {
    if v.is_empty() {
        return "-".into();
    }
    v.sort_by(f64::total_cmp);
    let at = |f: f64| v[((v.len() as f64 - 1.0) * f).round() as usize] * 1e3;
    format!(
        "median {:.2} ms, p99 {:.1} ms, max {:.1} ms",
        at(0.5),
        at(0.99),
        at(1.0)
    )
}

/// `bench planners --random N --seed S [--max-nodes M]`: ravnest against the exhaustive oracle
/// on the seeded random clusters of seeds S..S+N with at most M nodes, each by the objective
/// both minimize (step time plus the priced recovery term). Names the seeds over 1% off.
pub fn random(first: u64, n: u64, max_nodes: usize) -> Result<String> {
    use ravnest_core::planner::random::{random_case, summarize};
    let mut ratios = Vec::new();
    let (mut ours_s, mut oracle_s) = (Vec::new(), Vec::new());
    let (mut worst, mut slowest) = ((0.0f64, 0u64), (0.0f64, 0u64));
    let (mut neither, mut skipped, mut off) = (0, 0, Vec::new());
    let mut kinds: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
    for seed in first..first + n {
        let c = random_case(seed);
        if c.cluster.nodes.len() > max_nodes {
            skipped += 1;
            continue;
        }
        let t0 = Instant::now();
        let ours = ravnest_core::plan(PlannerKind::Ravnest, &c.cluster, &c.model, &c.training);
        let dt = t0.elapsed().as_secs_f64();
        ours_s.push(dt);
        if dt > slowest.0 {
            slowest = (dt, seed);
        }
        let t1 = Instant::now();
        let oracle = ravnest_core::plan(PlannerKind::Exhaustive, &c.cluster, &c.model, &c.training);
        oracle_s.push(t1.elapsed().as_secs_f64());
        if let Ok(o) = &ours {
            let class = ravnest_core::planner::LayoutClass::of(&o.layout);
            *kinds.entry(class.as_str()).or_default() += 1;
        }
        let r = match (&ours, &oracle) {
            (Ok(o), Ok(x)) => o.objective_s() / x.objective_s(),
            (Err(_), Ok(_)) => f64::INFINITY,
            (Ok(_), Err(e)) => {
                bail!("seed {seed}: the oracle found no plan where ravnest did: {e}")
            }
            (Err(_), Err(_)) => {
                neither += 1;
                continue;
            }
        };
        if r > worst.0 {
            worst = (r, seed);
        }
        if r > 1.01 {
            off.push(format!("{seed} ({r:.3})"));
        }
        ratios.push(r);
    }
    let q = summarize(&ratios);
    let off = match off.is_empty() {
        true => String::new(),
        false => format!("  over 1%: seeds {}\n", off.join(", ")),
    };
    let kinds: Vec<String> = kinds.iter().map(|(k, n)| format!("{k} {n}")).collect();
    Ok(format!(
        "ravnest vs the exhaustive oracle on {n} random clusters (seeds {first}..{}; {skipped} with more than {max_nodes} nodes skipped), step + expected recovery ratio (1 = the optimum under the cost model):\n  {} cases planned ({neither} fit nowhere for both); ravnest chose: {}\n  median {:.3}, p90 {:.3}, p99 {:.3}, max {:.3} (seed {})\n  within 1%: {:.1}% of cases\n{off}  planning time: ravnest {} (slowest: seed {}); oracle {}\n",
        first + n,
        q.cases,
        kinds.join(", "),
        q.median,
        q.p90,
        q.p99,
        q.max,
        worst.1,
        q.within_1pct * 100.0,
        times(&mut ours_s),
        slowest.1,
        times(&mut oracle_s),
    ))
}

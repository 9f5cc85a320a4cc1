//! `ravnest bench sharded`: one cluster file trained as the planner chooses (sharded data
//! parallel, where the model's state fits no node) and as a pipeline (`[training] layout =
//! "pipeline"`), side by side: real `ravnest run`s of the same steps, rounds interleaved so
//! that the machine's drift hits both alike. It prints each side's steady samples/s and their
//! ratio, and each node's held state against what the plan gives it.

use std::fmt::Write as _;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use ravnest_core::cost::Costs;
use ravnest_core::planner::Layout;
use serde_json::Value;

/// What to compare.
#[derive(Debug, Clone)]
pub struct ShardedArgs {
    /// The cluster file's text (its addresses are replaced by spare local ports).
    pub text: String,
    /// Where it came from, for messages.
    pub origin: String,
    /// Steps per run.
    pub steps: u64,
    /// Interleaved rounds.
    pub rounds: usize,
}

/// One run's figures.
#[derive(Debug, Clone, Default)]
struct Figures {
    layout: String,
    samples_per_s: f64,
    /// Per node: (name, held state MiB).
    held: Vec<(String, f64)>,
}

/// `text` with each `address = "..."` on fresh local ports, and `[training] layout` set to
/// `layout` (`None`: as the file says).
fn variant(text: &str, layout: Option<&str>) -> Result<String> {
    let count = text
        .lines()
        .filter(|l| l.trim_start().starts_with("address"))
        .count();
    let mut ports = ravnest_runtime::tcp::spare_ports(count)?.into_iter();
    let mut out = String::new();
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("address") {
            let port = ports.next().context("a spare port")?;
            let _ = writeln!(out, "address = \"127.0.0.1:{port}\"");
        } else if t.starts_with("layout") && layout.is_some() {
            continue;
        } else {
            let _ = writeln!(out, "{line}");
            if let (Some(l), "[training]") = (layout, t.trim_end()) {
                let _ = writeln!(out, "layout = \"{l}\"");
            }
        }
    }
    Ok(out)
}

/// One `ravnest run FILE --json` of `text` in `dir`.
fn run(a: &ShardedArgs, text: &str, dir: &Path) -> Result<Figures> {
    std::fs::create_dir_all(dir)?;
    let file = dir.join("cluster.toml");
    std::fs::write(&file, text)?;
    let out = Command::new(std::env::current_exe()?)
        .arg("run")
        .arg(&file)
        .args(["--json", "--steps", &a.steps.to_string(), "--out"])
        .arg(dir.join("out"))
        .stderr(Stdio::null())
        .output()
        .context("cannot start `ravnest run`")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = summary_of(&stdout).with_context(|| {
        format!(
            "`ravnest run` of {} gave no summary ({})",
            a.origin, out.status
        )
    })?;
    let s = ravnest_core::parse(text, &a.origin)?;
    let plan = ravnest_core::plan_scenario(ravnest_core::PlannerKind::Ravnest, &s)?;
    let layout = match plan.layout {
        Layout::Sharded { workers, .. } => format!("sharded x{workers}"),
        Layout::Pipeline {
            stages, replicas, ..
        } => format!("pipeline {replicas}x{stages}"),
        Layout::DataParallel { workers } => format!("data parallel x{workers}"),
    };
    let held = summary["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|n| {
            let mib = n["report"]["held_state_mib"].as_f64().unwrap_or(0.0);
            (n["node"].as_str().unwrap_or("?").to_string(), mib)
        })
        .collect();
    Ok(Figures {
        layout,
        samples_per_s: summary["coordinator"]["steady_samples_per_s"]
            .as_f64()
            .unwrap_or(0.0),
        held,
    })
}

/// The `summary` event among a `ravnest run --json`'s lines.
pub fn summary_of(stdout: &str) -> Option<Value> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["event"] == "summary")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Each node's planned state (weights, gradient and its part's optimizer state) under the
/// file's own plan, when it is sharded: (name, MiB).
fn planned(a: &ShardedArgs) -> Result<Vec<(String, f64)>> {
    let s = ravnest_core::parse(&a.text, &a.origin)?;
    let p = ravnest_core::plan_scenario(ravnest_core::PlannerKind::Ravnest, &s)?;
    if !matches!(p.layout, Layout::Sharded { .. }) {
        return Ok(Vec::new());
    }
    let costs = Costs::new(&s.cluster, &s.model, &s.training);
    Ok(p.nodes
        .iter()
        .filter_map(|n| {
            let part = n.layers?;
            let mib = costs.shard_memory_bytes(part, 0) as f64 / (1 << 20) as f64;
            Some((n.name.clone(), mib))
        })
        .collect())
}

/// Run the comparison and return its table.
pub fn sharded(a: &ShardedArgs) -> Result<String> {
    if a.rounds == 0 || a.steps < 4 {
        bail!("--rounds at least 1, --steps at least 4");
    }
    let dir = tempfile_dir()?;
    let mut chosen: Vec<Figures> = Vec::new();
    let mut pipeline: Vec<Figures> = Vec::new();
    for round in 0..a.rounds {
        let d = dir.join(format!("round-{round}"));
        chosen.push(run(a, &variant(&a.text, None)?, &d.join("chosen"))?);
        pipeline.push(run(
            a,
            &variant(&a.text, Some("pipeline"))?,
            &d.join("pipeline"),
        )?);
        eprintln!(
            "round {}: {} {:.2} samples/s, {} {:.2} samples/s",
            round + 1,
            chosen[round].layout,
            chosen[round].samples_per_s,
            pipeline[round].layout,
            pipeline[round].samples_per_s
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    let ours = median(chosen.iter().map(|f| f.samples_per_s).collect());
    let pipe = median(pipeline.iter().map(|f| f.samples_per_s).collect());
    let mut out = format!(
        "ravnest bench sharded: {} ({} steps, {} interleaved rounds, median of each)\n\n",
        a.origin, a.steps, a.rounds
    );
    let _ = writeln!(out, "{:<28} {:>14}", "layout", "samples/s");
    let _ = writeln!(
        out,
        "{:<28} {:>14.2}",
        format!("planner's: {}", chosen[0].layout),
        ours
    );
    let _ = writeln!(
        out,
        "{:<28} {:>14.2}",
        format!("forced: {}", pipeline[0].layout),
        pipe
    );
    let _ = writeln!(
        out,
        "\nplanner's choice vs the pipeline: {:.2}x the samples/s",
        ours / pipe.max(1e-9)
    );
    let plan = planned(a)?;
    if !plan.is_empty() {
        let _ = writeln!(
            out,
            "\n{:<12} {:>18} {:>24} {:>8}",
            "node", "held state MiB", "planned (w + g + part)", "ratio"
        );
        for (name, want) in plan {
            let held = median(
                chosen
                    .iter()
                    .flat_map(|f| f.held.iter().filter(|h| h.0 == name).map(|h| h.1))
                    .collect(),
            );
            let _ = writeln!(
                out,
                "{name:<12} {held:>18.1} {want:>24.1} {:>8.3}",
                held / want.max(1e-9)
            );
        }
    }
    Ok(out)
}

/// A fresh folder for the runs' files.
fn tempfile_dir() -> Result<std::path::PathBuf> {
    let d = std::env::temp_dir().join(format!("ravnest-bench-sharded-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

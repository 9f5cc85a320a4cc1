//! `ravnest bench ddp`: ravnest against PyTorch DDP on the same job, side by side.
//!
//! Two processes with one compute thread each, one of them emulating a device k times slower
//! (each gradient bucket handed over (k − 1) times its compute time late: the same rule on
//! both sides), the same model, data, global batch, optimizer and steps. Two jobs: an MLP on
//! Fashion-MNIST IDX files with SGD and momentum, and gpt-small (transformers'
//! `GPT2LMHeadModel` of the same shape on the PyTorch side) on a text's bytes with AdamW. Four runs per round, rounds interleaved so that the machine's drift hits every run
//! alike: ravnest heterogeneous, ravnest with the equal split, DDP with the equal split, and
//! DDP with the split a person would choose by hand (in proportion to speed). Each side
//! measures its own solo throughput in situ (both processes computing at once, without
//! synchronizing) for its capacity efficiency. The PyTorch side is `benches/ddp_compare.py`,
//! embedded in the binary; without an importable torch it is skipped, and said so.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// The PyTorch side, written to a temporary file when run.
const DDP_SCRIPT: &str = include_str!("../benches/ddp_compare.py");

/// The model a comparison trains.
#[derive(Debug, Clone, PartialEq)]
pub enum Job {
    /// An MLP of these widths on Fashion-MNIST, SGD with momentum.
    Mlp(Vec<usize>),
    /// gpt-small (6 blocks, hidden 384, 6 heads, 128 tokens, bytes) on a text, AdamW.
    GptSmall,
}

impl Job {
    /// The shape of gpt-small as `ddp_compare.py --gpt` takes it: layers, hidden, heads,
    /// sequence, vocabulary (ravnest's preset `gpt-small`).
    const GPT_SMALL: &str = "6,384,6,128,256";

    fn describe(&self) -> String {
        match self {
            Job::Mlp(dims) => format!(
                "MLP {}",
                dims.iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join("-")
            ),
            Job::GptSmall => "gpt-small (6 blocks, hidden 384, 128 tokens), AdamW".into(),
        }
    }
}

/// What to compare.
#[derive(Debug, Clone)]
pub struct DdpArgs {
    /// What is trained.
    pub job: Job,
    /// The MLP's Fashion-MNIST training images (IDX, gzipped or not; labels beside it), or
    /// the GPT's text.
    pub data: PathBuf,
    /// Interleaved rounds.
    pub rounds: usize,
    /// Timed steps per run.
    pub steps: u64,
    /// Untimed steps before them.
    pub warmup: u64,
    /// Global batch.
    pub batch: u64,
    /// Learning rate (both sides).
    pub lr: f64,
    /// How much slower the second process is.
    pub slowdown: f64,
    /// Python with torch (default: `RAVNEST_PYTHON`, else `python3`).
    pub python: Option<String>,
}

/// One run's figures.
#[derive(Debug, Clone, Default)]
struct Figures {
    samples_per_s: f64,
    efficiency: f64,
    /// Per node: (name, batch, busy, comm, idle).
    nodes: Vec<(String, u64, f64, f64, f64)>,
    /// ravnest's per node: its step by phase, as the run's report gives it.
    phases: Vec<(String, Value)>,
}

fn free_port() -> Result<u16> {
    Ok(ravnest_runtime::tcp::spare_ports(1)?[0])
}

/// The cluster file of the ravnest side.
fn cluster_file(a: &DdpArgs) -> Result<String> {
    let (model, optimizer, network) = match &a.job {
        Job::Mlp(dims) => {
            let dims: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
            (
                format!("kind = \"mlp\"\ndims = [{}]", dims.join(", ")),
                "sgd-momentum",
                "",
            )
        }
        Job::GptSmall => (
            "preset = \"gpt-small\"".to_string(),
            "adamw",
            "network = \"gpt\"\nweight_decay = 0.01\n",
        ),
    };
    Ok(format!(
        "[cluster]\nname = \"bench-ddp\"\nsecret = \"bench-ddp\"\n\n\
         [[node]]\nname = \"fast\"\ndevice = \"cpu\"\naddress = \"127.0.0.1:{}\"\n\n\
         [[node]]\nname = \"slow\"\ndevice = \"cpu\"\naddress = \"127.0.0.1:{}\"\nemulate_slowdown = {:.3}\n\n\
         [model]\n{model}\n\n\
         [training]\nglobal_batch = {}\noptimizer = \"{optimizer}\"\nsync = \"ring\"\n\n\
         [run]\n{network}steps = {}\nlearning_rate = {}\nmomentum = 0.9\nseed = 1\ndataset = {:?}\n\
         checkpoint_every_steps = 0\n",
        free_port()?,
        free_port()?,
        a.slowdown,
        a.batch,
        a.warmup + a.steps,
        a.lr,
        a.data.display().to_string(),
    ))
}

/// One ravnest run (`ravnest run FILE --json`) with `planner`, in a fresh folder under `dir`.
fn ravnest_run(a: &DdpArgs, planner: &str, dir: &Path, round: usize) -> Result<Figures> {
    let dir = dir.join(format!("{planner}-{round}"));
    std::fs::create_dir_all(&dir)?;
    let file = dir.join("cluster.toml");
    std::fs::write(&file, cluster_file(a)?)?;
    let out = Command::new(std::env::current_exe()?)
        .arg("run")
        .arg(&file)
        .args(["--json", "--planner", planner, "--out"])
        .arg(dir.join("out"))
        .stderr(Stdio::inherit())
        .output()
        .context("cannot start `ravnest run`")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let summary = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|v| v["event"] == "summary")
        .with_context(|| format!("`ravnest run` ({planner}) gave no summary ({})", out.status))?;
    let c = &summary["coordinator"];
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
    let (mut nodes, mut phases) = (Vec::new(), Vec::new());
    for n in summary["nodes"].as_array().into_iter().flatten() {
        let (name, r) = (n["node"].as_str().unwrap_or("?").to_string(), &n["report"]);
        let (busy, comm) = (f(r, "steady_busy"), f(r, "steady_comm"));
        if r["phases"].is_object() {
            phases.push((name.clone(), r["phases"].clone()));
        }
        nodes.push((
            name,
            r["batch"].as_u64().unwrap_or(0),
            busy.min(1.0),
            comm.min(1.0),
            (1.0 - busy - comm).max(0.0),
        ));
    }
    Ok(Figures {
        samples_per_s: f(c, "steady_samples_per_s"),
        efficiency: f(c, "steady_samples_per_s") / f(c, "solo_sum_samples_per_s").max(1e-9),
        nodes,
        phases,
    })
}

/// One PyTorch DDP run with `split`; `Err(why)` inside when torch is not importable.
fn ddp_run(
    a: &DdpArgs,
    python: &str,
    script: &Path,
    split: &str,
) -> Result<Result<Figures, String>> {
    let mut cmd = Command::new(python);
    cmd.arg(script)
        .args(["--world", "2", "--split", split, "--threads", "1"])
        .args(["--slowdown", &format!("1,{}", a.slowdown)])
        .args(["--lr", &a.lr.to_string()]);
    match &a.job {
        Job::Mlp(dims) => {
            let dims: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
            cmd.args(["--dims", &dims.join(",")]);
        }
        Job::GptSmall => {
            // Seconds per step: a few steps measure the solo throughput, as ravnest's do.
            cmd.args(["--gpt", Job::GPT_SMALL, "--calib-steps", "5"]);
        }
    }
    let out = cmd
        .args(["--global-batch", &a.batch.to_string()])
        .args(["--steps", &a.steps.to_string()])
        .args(["--warmup", &a.warmup.to_string()])
        .arg("--data")
        .arg(&a.data)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot start `{python}`"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let Some(v) = text
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<Value>(l).ok())
    else {
        bail!("benches/ddp_compare.py gave no result ({})", out.status);
    };
    if let Some(why) = v["skipped"].as_str() {
        return Ok(Err(why.to_string()));
    }
    let f = |v: &Value, k: &str| v[k].as_f64().unwrap_or(0.0);
    let nodes = v["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|n| {
            (
                format!("rank {}", n["rank"]),
                n["batch"].as_u64().unwrap_or(0),
                f(n, "busy"),
                f(n, "comm"),
                f(n, "idle"),
            )
        })
        .collect();
    Ok(Ok(Figures {
        samples_per_s: f(&v, "samples_per_s"),
        efficiency: f(&v, "capacity_efficiency"),
        nodes,
        phases: Vec::new(),
    }))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// Run the comparison; the table.
pub fn ddp(a: &DdpArgs) -> Result<String> {
    if !a.data.exists() {
        match a.job {
            Job::Mlp(_) => bail!(
                "{}: no such file (Fashion-MNIST comes from Debian's `dataset-fashion-mnist`; or pass --data)",
                a.data.display()
            ),
            Job::GptSmall => bail!(
                "{}: no such file (the GPT job reads a text: data/eighty-days.txt from the repository's root; or pass --text)",
                a.data.display()
            ),
        }
    }
    // The cluster file lives elsewhere: it names the data by its absolute path.
    let a = &DdpArgs {
        data: std::path::absolute(&a.data)?,
        ..a.clone()
    };
    let python = a
        .python
        .clone()
        .or_else(|| std::env::var("RAVNEST_PYTHON").ok())
        .unwrap_or_else(|| "python3".into());
    let dir = std::env::temp_dir().join(format!("ravnest-bench-ddp-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let script = dir.join("ddp_compare.py");
    std::fs::write(&script, DDP_SCRIPT)?;
    let k = a.slowdown.max(1.0);
    let fast = (a.batch as f64 * k / (k + 1.0)).round() as u64;
    let by_hand = format!("{fast},{}", a.batch - fast);
    let names = [
        "ravnest heterogeneous".to_string(),
        "ravnest --planner uniform".to_string(),
        "PyTorch DDP, equal split".to_string(),
        format!("PyTorch DDP, split by hand {by_hand}"),
    ];
    let mut runs: Vec<Vec<Figures>> = vec![Vec::new(); 4];
    let mut skipped = None;
    for round in 0..a.rounds {
        eprintln!("[bench ddp] round {}/{}", round + 1, a.rounds);
        runs[0].push(ravnest_run(a, "ravnest", &dir, round)?);
        runs[1].push(ravnest_run(a, "uniform", &dir, round)?);
        if skipped.is_none() {
            for (i, split) in [(2, "equal"), (3, by_hand.as_str())] {
                match ddp_run(a, &python, &script, split)? {
                    Ok(f) => runs[i].push(f),
                    Err(why) => skipped = Some(why),
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(table(a, &names, &runs, skipped))
}

/// Each round's ratios of ravnest to the DDP run it is measured against (its own split to DDP
/// split by hand, the equal split to DDP's): a median of a few rounds hides how far one round
/// is from the next on a shared machine. Empty without the PyTorch side.
fn round_ratios(runs: &[Vec<Figures>]) -> String {
    let each = |ours: usize, theirs: usize| -> Vec<String> {
        runs[ours]
            .iter()
            .zip(&runs[theirs])
            .map(|(a, b)| format!("{:.2}x", a.samples_per_s / b.samples_per_s.max(1e-9)))
            .collect()
    };
    let (split, equal) = (each(0, 3), each(1, 2));
    if split.is_empty() {
        return String::new();
    }
    format!(
        "\neach round: ravnest heterogeneous / DDP split by hand {}; uniform / DDP equal {}\n",
        split.join(" "),
        equal.join(" ")
    )
}

/// ravnest's runs' steps by phase, per node, from the last round (ms per step).
fn phase_table(names: &[String], runs: &[Vec<Figures>]) -> String {
    let keys = [
        ("step", "step_ms"),
        ("forward", "forward_ms"),
        ("backward", "backward_ms"),
        ("slowdown", "slowdown_ms"),
        ("optimizer", "optimizer_ms"),
        ("all-reduce", "allreduce_ms"),
        ("hidden", "hidden_ms"),
        ("exposed", "exposed_ms"),
        ("wait", "wait_ms"),
    ];
    let mut out = String::new();
    for (name, figs) in names.iter().zip(runs) {
        let Some(last) = figs.last().filter(|f| !f.phases.is_empty()) else {
            continue;
        };
        if out.is_empty() {
            out += &format!("\n{:<36}", "ravnest, ms per step (last round)");
            for (k, _) in keys {
                out += &format!(" {k:>10}");
            }
            out += "\n";
        }
        for (node, p) in &last.phases {
            out += &format!("{:<36}", format!("{name}: {node}"));
            for (_, k) in keys {
                out += &format!(" {:>10.1}", p[k].as_f64().unwrap_or(0.0));
            }
            out += "\n";
        }
    }
    out
}

fn table(a: &DdpArgs, names: &[String], runs: &[Vec<Figures>], skipped: Option<String>) -> String {
    let mut out = format!(
        "2 processes x 1 thread, {}, {}, global batch {}, the second process {}x slower; \
         {} timed steps after {}; {} interleaved rounds (median)\n\n",
        a.job.describe(),
        a.data
            .file_name()
            .and_then(|f| f.to_str())
            .unwrap_or("data"),
        a.batch,
        a.slowdown,
        a.steps,
        a.warmup,
        a.rounds
    );
    let base = median(runs[2].iter().map(|f| f.samples_per_s).collect());
    out += "run                                  samples/s   vs DDP equal   capacity eff.   per node: batch busy/comm/idle\n";
    for (name, figs) in names.iter().zip(runs) {
        if figs.is_empty() {
            out += &format!("{name:<36} {:>9}\n", "-");
            continue;
        }
        let sps = median(figs.iter().map(|f| f.samples_per_s).collect());
        let eff = median(figs.iter().map(|f| f.efficiency).collect());
        let last = figs.last().expect("non-empty");
        let nodes: Vec<String> = last
            .nodes
            .iter()
            .map(|(n, b, busy, comm, idle)| {
                format!(
                    "{n} {b}: {:.0}/{:.0}/{:.0}%",
                    100.0 * busy,
                    100.0 * comm,
                    100.0 * idle
                )
            })
            .collect();
        let ratio = if base.is_finite() && base > 0.0 {
            format!("{:.2}x", sps / base)
        } else {
            "-".into()
        };
        out += &format!(
            "{name:<36} {sps:>9.1} {ratio:>14} {eff:>15.2}   {}\n",
            nodes.join(", ")
        );
    }
    out += &round_ratios(runs);
    out += &phase_table(names, runs);
    if let Some(why) = skipped {
        out += &format!(
            "\nPyTorch side skipped: {why} (install torch into a virtualenv, `pip install torch numpy`, and point RAVNEST_PYTHON at its python)\n"
        );
    }
    out += "\nbusy: computing (the emulated slowdown included); comm: waiting for the all-reduce after compute; idle: the rest. Per-node figures are from the last round.\n";
    out
}

#[cfg(test)]
mod tests {
    use super::{Figures, round_ratios};

    fn at(samples_per_s: f64) -> Figures {
        Figures {
            samples_per_s,
            ..Figures::default()
        }
    }

    /// Each round's ravnest run against the same round's DDP run; nothing without PyTorch.
    #[test]
    fn each_rounds_ratio_is_to_the_same_rounds_ddp() {
        let runs = vec![
            vec![at(16.5), at(15.0)],
            vec![at(8.2), at(9.0)],
            vec![at(7.0), at(7.5)],
            vec![at(13.3), at(15.0)],
        ];
        assert_eq!(
            round_ratios(&runs),
            "\neach round: ravnest heterogeneous / DDP split by hand 1.24x 1.00x; \
             uniform / DDP equal 1.17x 1.20x\n"
        );
        let no_torch = vec![vec![at(16.5)], vec![at(8.2)], vec![], vec![]];
        assert_eq!(round_ratios(&no_torch), "");
    }
}

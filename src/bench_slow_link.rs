//! `ravnest bench slow-link`: real node processes on a shaped link, one run per way of
//! synchronizing, side by side on the same data and samples.
//!
//! Each node runs in a Linux network namespace of its own, joined to the others through veth
//! pairs on a bridge (in a namespace of its own too), and each node's egress is shaped with a
//! token bucket (`tc qdisc ... tbf`) to the given rate. The runs: a ring every step (exact
//! synchronous SGD), plain local SGD (averaging every H steps), DiLoCo (a Nesterov outer step
//! on the averaged delta, fp32), DiLoCo on fp16 and int8 deltas, and DiLoCo on int8 deltas
//! with each round's exchange overlapped with the inner steps after it (`outer_overlap`). For
//! each: wall time, synchronization bytes sent per node and per sample, compute utilisation
//! (each node's compute time over its training time), the last training loss and the
//! held-out accuracy. Needs root and `ip`
//! / `tc` (iproute2); where namespaces cannot be made it says so and stops.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};
use ravnest_runtime::netns::ShapedNet;
use serde_json::Value;

/// What to compare.
#[derive(Debug, Clone)]
pub struct SlowLinkArgs {
    /// Node processes (2 or more).
    pub nodes: usize,
    /// Each node's egress rate, Mbit/s.
    pub rate_mbit: f64,
    /// Steps per run.
    pub steps: u64,
    /// MLP widths.
    pub dims: Vec<usize>,
    /// Global batch.
    pub batch: u64,
    /// The dataset (`digits`, or an IDX / CSV path).
    pub data: String,
    /// Local steps per round (`None`: the planner's choice from the measured link).
    pub local_steps: Option<u32>,
    /// Which runs (names of [`VARIANTS`]).
    pub variants: Vec<String>,
    /// Inner optimizer.
    pub optimizer: String,
    /// Learning rate.
    pub lr: f64,
    /// Where each run's files stay (`None`: a temporary folder, removed after a good run).
    pub keep: Option<PathBuf>,
}

/// One way of synchronizing: (name, `[training]` lines).
pub const VARIANTS: [(&str, &str); 6] = [
    // Every node trains, as under DDP (the planner alone would leave a node behind a slow link
    // out of an every-step ring).
    ("ring", "sync = \"ring\"\nredundancy = \"always\"\n"),
    (
        "local-sgd",
        "sync = \"local-sgd\"\nouter_optimizer = \"average\"\nouter_precision = \"fp32\"\n",
    ),
    (
        "diloco",
        "sync = \"local-sgd\"\nouter_optimizer = \"nesterov\"\nouter_precision = \"fp32\"\n",
    ),
    (
        "diloco-fp16",
        "sync = \"local-sgd\"\nouter_optimizer = \"nesterov\"\nouter_precision = \"fp16\"\n",
    ),
    (
        "diloco-int8",
        "sync = \"local-sgd\"\nouter_optimizer = \"nesterov\"\nouter_precision = \"int8\"\n",
    ),
    (
        "overlap-int8",
        "sync = \"local-sgd\"\nouter_optimizer = \"nesterov\"\nouter_precision = \"int8\"\n\
         outer_overlap = true\n",
    ),
];

/// One run's figures.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Figures {
    /// Variant.
    pub name: String,
    /// What the plan chose, in words.
    pub sync: String,
    /// The coordinator's training time, s.
    pub train_s: f64,
    /// Synchronization bytes sent, per node (mean).
    pub sync_bytes_per_node: f64,
    /// Synchronization bytes sent per training sample (all nodes).
    pub sync_bytes_per_sample: f64,
    /// Mean over nodes of compute time / the run's training time.
    pub utilisation: f64,
    /// Mean over nodes of the time steps waited for their collectives / the training time.
    pub link_wait: f64,
    /// The coordinator's last training loss.
    pub loss: f64,
    /// Held-out accuracy of the final model.
    pub accuracy: f64,
}

/// The cluster file of one variant.
fn cluster_file(a: &SlowLinkArgs, training: &str) -> String {
    let mut out =
        String::from("[cluster]\nname = \"slow-link\"\nsecret = \"slow-link-bench-secret\"\n\n");
    for i in 0..a.nodes {
        let _ = writeln!(
            out,
            "[[node]]\nname = \"n{i}\"\ndevice = \"cpu\"\naddress = \"{}:47900\"\n",
            ShapedNet::addr(i)
        );
    }
    let dims: Vec<String> = a.dims.iter().map(ToString::to_string).collect();
    let _ = writeln!(
        out,
        "[model]\nkind = \"mlp\"\ndims = [{}]\n",
        dims.join(", ")
    );
    let _ = writeln!(
        out,
        "[training]\nglobal_batch = {}\noptimizer = \"{}\"\n{training}",
        a.batch, a.optimizer
    );
    if let Some(h) = a.local_steps {
        let _ = writeln!(out, "local_steps = {h}");
    }
    let _ = writeln!(
        out,
        "\n[run]\nsteps = {}\nlearning_rate = {}\nmomentum = 0.9\nseed = 1\ndataset = \"{}\"\n\
         checkpoint_every_steps = 0",
        a.steps, a.lr, a.data
    );
    out
}

/// One run of `text` over `net`: every node a process in its namespace.
fn run(net: &ShapedNet, name: &str, text: &str, dir: &Path, nodes: usize) -> Result<Figures> {
    std::fs::create_dir_all(dir)?;
    let file = dir.join("cluster.toml");
    std::fs::write(&file, text)?;
    let exe = std::env::current_exe()?;
    // Each node stands for a machine of its own: it gets its share of this one's cores, as
    // `ravnest run` gives the processes it starts (more compute threads than cores make the
    // start-up calibration, and so the plan's balance, a matter of scheduling luck).
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = std::env::var("RAYON_NUM_THREADS")
        .unwrap_or_else(|_| (cores / nodes.max(1)).max(1).to_string());
    let spawn = |i: usize| -> Result<Child> {
        let log = std::fs::File::create(dir.join(format!("n{i}.log")))?;
        Command::new("ip")
            .args(["netns", "exec", &net.ns(i)])
            .env("RAYON_NUM_THREADS", &threads)
            .arg(&exe)
            .arg("run")
            .arg(&file)
            .args(["--node", &format!("n{i}"), "--json", "--out"])
            .arg(dir.join(format!("out-{i}")))
            .stdout(if i == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stderr(log)
            .spawn()
            .context("cannot start a node in its namespace")
    };
    let mut others = Vec::new();
    for i in 1..nodes {
        others.push(spawn(i)?);
    }
    let first = spawn(0)?.wait_with_output()?;
    let mut failed = Vec::new();
    for (i, mut c) in others.into_iter().enumerate() {
        if !c.wait().is_ok_and(|st| st.success()) {
            failed.push(format!("n{}", i + 1));
        }
    }
    // A node that left the run leaves figures of another cluster: not comparable.
    if !failed.is_empty() {
        bail!(
            "the `{name}` run lost {} (it exited with an error); its logs are in {}",
            failed.join(", "),
            dir.display()
        );
    }
    let stdout = String::from_utf8_lossy(&first.stdout);
    std::fs::write(dir.join("n0.out"), stdout.as_bytes())?;
    let summary = crate::bench_sharded::summary_of(&stdout).with_context(|| {
        format!(
            "the `{name}` run gave no summary ({}); its logs are in {}",
            first.status,
            dir.display()
        )
    })?;
    let sync = plan_sync(&stdout);
    figures(name, &summary, text, sync)
}

/// The figures of a run's summary.
fn figures(name: &str, summary: &Value, text: &str, sync: String) -> Result<Figures> {
    let c = &summary["coordinator"];
    let reports: Vec<&Value> = summary["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|n| &n["report"])
        .collect();
    if reports.is_empty() {
        bail!("the `{name}` run's summary has no node reports");
    }
    let n = reports.len() as f64;
    let sync_bytes: f64 = reports
        .iter()
        .map(|r| r["sync_bytes_sent"].as_f64().unwrap_or(0.0))
        .sum();
    let train_s = c["train_s"].as_f64().unwrap_or(0.0);
    let utilisation = reports
        .iter()
        .map(|r| r["compute_s"].as_f64().unwrap_or(0.0) / train_s.max(1e-9))
        .sum::<f64>()
        / n;
    let link_wait = reports
        .iter()
        .map(|r| r["comm_s"].as_f64().unwrap_or(0.0) / train_s.max(1e-9))
        .sum::<f64>()
        / n;
    let steps = c["steps"].as_f64().unwrap_or(0.0);
    let s = ravnest_core::parse(text, "slow-link")?;
    let samples = steps * f64::from(s.training.global_batch);
    Ok(Figures {
        name: name.to_string(),
        sync,
        train_s,
        sync_bytes_per_node: sync_bytes / n,
        sync_bytes_per_sample: sync_bytes / samples.max(1.0),
        utilisation,
        link_wait,
        loss: c["last_loss"].as_f64().unwrap_or(f64::NAN),
        accuracy: c["accuracy"].as_f64().unwrap_or(f64::NAN),
    })
}

/// What the run's last plan said about synchronization, shortened: `H = 12`, or `every step`.
fn plan_sync(stdout: &str) -> String {
    if let Some(i) = stdout.rfind("local SGD with ") {
        let rest = &stdout[i + "local SGD with ".len()..];
        let h: String = rest.chars().take_while(char::is_ascii_digit).collect();
        return format!("H = {h}");
    }
    "every step".into()
}

/// Run the comparison; the table, and the figures.
pub fn slow_link(a: &SlowLinkArgs) -> Result<(String, Vec<Figures>)> {
    if a.nodes < 2 || a.steps < 4 {
        bail!("--nodes at least 2, --steps at least 4");
    }
    let chosen: Vec<(&str, &str)> = if a.variants.is_empty() {
        VARIANTS.to_vec()
    } else {
        let mut v = Vec::new();
        for name in &a.variants {
            let Some(x) = VARIANTS.iter().find(|(n, _)| n == name) else {
                let names: Vec<&str> = VARIANTS.iter().map(|(n, _)| *n).collect();
                bail!("unknown run `{name}`: one of {}", names.join(", "));
            };
            v.push(*x);
        }
        v
    };
    let net = ShapedNet::up(a.nodes, a.rate_mbit).map_err(anyhow::Error::msg)?;
    let dir = a.keep.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("ravnest-bench-slow-link-{}", std::process::id()))
    });
    let mut all = Vec::new();
    for (name, training) in chosen {
        let f = run(
            &net,
            name,
            &cluster_file(a, training),
            &dir.join(name),
            a.nodes,
        )?;
        eprintln!(
            "{name}: {:.1} s, {:.2} MB sync per node, utilisation {:.2}, accuracy {:.3}",
            f.train_s,
            f.sync_bytes_per_node / 1e6,
            f.utilisation,
            f.accuracy
        );
        all.push(f);
    }
    drop(net);
    if a.keep.is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok((table(a, &all), all))
}

fn table(a: &SlowLinkArgs, all: &[Figures]) -> String {
    let mut out = format!(
        "ravnest bench slow-link: {} nodes, each sending at {} Mbit/s (tbf), {} steps of {} \
         samples, mlp {:?}, {}\n\n",
        a.nodes, a.rate_mbit, a.steps, a.batch, a.dims, a.data
    );
    let _ = writeln!(
        out,
        "{:<12} {:>12} {:>9} {:>14} {:>12} {:>10} {:>10} {:>8} {:>9} {:>9}",
        "run",
        "sync",
        "wall s",
        "MB/node sync",
        "B/sample",
        "fewer B",
        "compute",
        "waits",
        "loss",
        "accuracy"
    );
    let ring = all.iter().find(|f| f.name == "ring");
    for f in all {
        let fewer = ring.map_or(String::from("-"), |r| {
            format!(
                "{:.0}x",
                r.sync_bytes_per_sample / f.sync_bytes_per_sample.max(1e-9)
            )
        });
        let _ = writeln!(
            out,
            "{:<12} {:>12} {:>9.1} {:>14.2} {:>12.0} {:>10} {:>10.3} {:>8.3} {:>9.4} {:>9.4}",
            f.name,
            f.sync,
            f.train_s,
            f.sync_bytes_per_node / 1e6,
            f.sync_bytes_per_sample,
            fewer,
            f.utilisation,
            f.link_wait,
            f.loss,
            f.accuracy
        );
    }
    if let Some(r) = ring {
        let _ = writeln!(out);
        for f in all.iter().filter(|f| f.name != "ring") {
            let _ = writeln!(
                out,
                "{} vs ring every step: {:.2}x faster, {:.0}x fewer sync bytes per sample, \
                 accuracy {:+.2} points, loss {:+.1}%",
                f.name,
                r.train_s / f.train_s.max(1e-9),
                r.sync_bytes_per_sample / f.sync_bytes_per_sample.max(1e-9),
                100.0 * (f.accuracy - r.accuracy),
                100.0 * (f.loss / r.loss - 1.0)
            );
        }
    }
    out
}

/// Where the default dataset is: Fashion-MNIST when Debian's package is installed, else the
/// embedded digits.
pub fn default_data() -> (String, Vec<usize>) {
    let fashion = PathBuf::from("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
    if fashion.exists() {
        (fashion.display().to_string(), vec![784, 1024, 1024, 10])
    } else {
        ("digits".into(), vec![64, 1024, 1024, 10])
    }
}

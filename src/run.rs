//! `ravnest run`: one node process (`--node NAME`), or a local cluster of processes (no
//! `--node`: one child per node of the file, all on this machine's loopback).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use ravnest_core::Scenario;
use ravnest_train::process::{Options, human};
use serde_json::{Value, json};

/// What the user asked for.
#[derive(Debug)]
pub struct RunArgs {
    /// Origin (file name) and its text.
    pub origin: String,
    /// The file's text.
    pub text: String,
    /// This process's node, if one.
    pub node: Option<String>,
    /// Rejoin a running cluster.
    pub join: bool,
    /// Continue from the latest checkpoint.
    pub resume: bool,
    /// Output directory.
    pub out: Option<PathBuf>,
    /// JSON lines.
    pub json: bool,
    /// Override `[run] steps`.
    pub steps: Option<u64>,
    /// Planner name.
    pub planner: String,
    /// Write a timeline picture (SVG) of the run here (local clusters).
    pub timeline: Option<PathBuf>,
    /// Include this node's activity spans in its report (set by the local launcher).
    pub spans: bool,
}

fn default_out(s: &Scenario) -> PathBuf {
    Path::new("ravnest-out").join(&s.cluster.name)
}

/// Run as asked.
pub fn run(args: RunArgs) -> Result<()> {
    let mut scenario = ravnest_core::parse(&args.text, &args.origin)?;
    if let Some(n) = args.steps {
        scenario.run.steps = n;
    }
    let steps = scenario.run.steps;
    let out = args.out.clone().unwrap_or_else(|| default_out(&scenario));
    if args.join && args.node.is_none() {
        bail!("--join restarts one node: name it with --node NAME");
    }
    match &args.node {
        Some(node) => {
            let report = ravnest_train::process::run(Options {
                scenario,
                origin: args.origin.clone(),
                node: node.clone(),
                out_dir: out,
                resume: args.resume,
                join: args.join,
                json: args.json,
                register_timeout: Duration::from_secs(60),
                planner: ravnest_core::PlannerKind::parse(&args.planner)
                    .with_context(|| format!("unknown planner `{}`", args.planner))?,
                quiet: false,
                share: Some(ravnest_train::process::share_document(
                    &args.origin,
                    &args.text,
                    steps,
                )),
                spans: args.spans,
            })?;
            if !args.json && report["role"] == "coordinator" {
                eprintln!("{}", coordinator_summary(&report));
            }
            Ok(())
        }
        None => local_cluster(&args, &scenario, &out),
    }
}

fn is_local(addr: &str) -> bool {
    addr.starts_with("127.") || addr.starts_with("localhost:") || addr.starts_with("[::1]:")
}

/// Start one child process per node and show their progress; the final report merges theirs.
fn local_cluster(args: &RunArgs, s: &Scenario, out: &Path) -> Result<()> {
    for n in &s.cluster.nodes {
        match &n.address {
            Some(a) if is_local(a) => {}
            Some(a) => bail!(
                "{}: node `{}` is at {a}, not on this machine; start `ravnest run {} --node {}` there (a run without --node starts every node locally)",
                args.origin,
                n.name,
                args.origin,
                n.name
            ),
            None => bail!(
                "{}: node `{}` has no `address`; `ravnest run` needs host:port for every node",
                args.origin,
                n.name
            ),
        }
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create `{}`", out.display()))?;
    let file = out.join("cluster.toml");
    std::fs::write(&file, &args.text)
        .with_context(|| format!("cannot write `{}`", file.display()))?;
    let exe = std::env::current_exe().context("cannot find this program's path")?;
    let (tx, rx) = mpsc::channel::<(usize, Option<Value>)>();
    let mut children: Vec<(String, Child)> = Vec::new();
    for (i, n) in s.cluster.nodes.iter().enumerate() {
        let mut cmd = Command::new(&exe);
        cmd.arg("run")
            .arg(&file)
            .args(["--node", &n.name, "--json", "--out"])
            .arg(out)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(k) = args.steps {
            cmd.args(["--steps", &k.to_string()]);
        }
        if args.resume {
            cmd.arg("--resume");
        }
        cmd.args(["--planner", &args.planner]);
        if args.timeline.is_some() {
            cmd.arg("--report-spans");
        }
        // Several processes share this machine's cores: one compute thread each.
        if std::env::var_os("RAYON_NUM_THREADS").is_none() {
            cmd.env("RAYON_NUM_THREADS", "1");
        }
        // The child dies with this process (`kill -9` of the launcher leaves nothing behind).
        cmd.env(
            ravnest_train::process::LAUNCHER_PID,
            std::process::id().to_string(),
        );
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start node `{}`", n.name))?;
        let stdout = child.stdout.take().expect("piped");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                if let Ok(v) = serde_json::from_str::<Value>(&line) {
                    let _ = tx.send((i, Some(v)));
                }
            }
            let _ = tx.send((i, None));
        });
        say(
            args.json,
            json!({"event": "spawned", "node": n.name, "pid": child.id()}),
        );
        children.push((n.name.clone(), child));
    }
    drop(tx);
    // One progress bar per node (indicatif draws only on a terminal); events print above them.
    let bars = MultiProgress::new();
    if args.json {
        bars.set_draw_target(ProgressDrawTarget::hidden());
    }
    let style =
        ProgressStyle::with_template("{prefix:>10} [{bar:30.cyan/blue}] {pos:>5}/{len:5} {msg}")
            .expect("a valid template")
            .progress_chars("#>-");
    let node_bars: Vec<ProgressBar> = children
        .iter()
        .map(|(name, _)| {
            let b = bars.add(ProgressBar::new(s.run.steps));
            b.set_style(style.clone());
            b.set_prefix(name.clone());
            b.set_message("starting");
            b
        })
        .collect();
    let mut reports: Vec<Option<Value>> = vec![None; children.len()];
    let mut open = children.len();
    while open > 0 {
        let Ok((i, msg)) = rx.recv() else { break };
        let Some(v) = msg else {
            open -= 1;
            // A node that exits with an error before its report failed to start or to go on
            // (a port in use, a bad dataset): the run cannot do what was asked; stop the others
            // now rather than let them wait. A node killed by a signal is a lost node, which
            // the cluster survives (and which may rejoin with `--join`).
            if reports[i].is_none() {
                let status = children[i].1.wait()?;
                if status.code().is_some_and(|c| c != 0) {
                    for (_, c) in children.iter_mut() {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                    for b in &node_bars {
                        b.abandon();
                    }
                    bail!(
                        "node `{}` failed ({status}); see its message above",
                        children[i].0
                    );
                }
            }
            continue;
        };
        match v["event"].as_str() {
            Some("progress") => {
                if args.json {
                    say(true, v.clone());
                }
                let b = &node_bars[i];
                b.set_length(v["steps"].as_u64().unwrap_or(s.run.steps));
                b.set_position(v["step"].as_u64().unwrap_or(0));
                b.set_message(format!(
                    "{:>7.0} samples/s  loss {:.3}",
                    v["samples_per_s"].as_f64().unwrap_or(0.0),
                    v["loss"].as_f64().unwrap_or(f64::NAN)
                ));
            }
            Some("report") => {
                node_bars[i].finish_with_message("done");
                reports[i] = Some(v);
            }
            _ => {
                if args.json {
                    say(true, v);
                } else if matches!(
                    v["event"].as_str(),
                    Some("plan" | "links" | "cluster" | "measured")
                ) {
                    let line = format!("[{}] {}", v["node"].as_str().unwrap_or("?"), human(&v));
                    if bars.is_hidden() {
                        eprintln!("{line}");
                    } else {
                        let _ = bars.println(line);
                    }
                }
            }
        }
    }
    for b in &node_bars {
        if !b.is_finished() {
            b.abandon();
        }
    }
    let mut failed = Vec::new();
    for (name, child) in &mut children {
        let status = child.wait()?;
        if !status.success() {
            failed.push(format!("{name} ({status})"));
        }
    }
    let coordinator = reports
        .iter()
        .flatten()
        .find(|r| r["role"] == "coordinator")
        .cloned();
    let merged = json!({
        "event": "summary",
        "cluster": s.cluster.name,
        "coordinator": coordinator,
        "nodes": children.iter().zip(&reports).map(|((name, _), r)| json!({"node": name, "report": r})).collect::<Vec<_>>(),
        "failed": failed,
    });
    if let Some(path) = &args.timeline {
        let t = timeline(&merged);
        std::fs::write(
            path,
            ravnest_sim::timeline::svg(&t, &format!("ravnest run: {}", s.cluster.name)),
        )
        .with_context(|| format!("cannot write `{}`", path.display()))?;
        eprintln!("timeline written to {}", path.display());
    }
    if args.json {
        say(true, merged);
    } else {
        eprintln!();
        use std::io::Write;
        let _ = writeln!(std::io::stdout().lock(), "{}", summary_text(&merged));
    }
    match coordinator {
        Some(_) => Ok(()),
        None => bail!(
            "the coordinator did not finish (failed: {})",
            failed.join(", ")
        ),
    }
}

/// The timeline of a local run from its nodes' reports: one lane per node on the clock all
/// the processes share, with the coordinator's events as markers.
fn timeline(m: &Value) -> ravnest_sim::timeline::Timeline {
    use ravnest_runtime::node::SpanKind;
    use ravnest_sim::timeline::{Lane, Timeline};
    let nodes: Vec<(&str, &Value)> = m["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|n| (n["node"].as_str().unwrap_or("?"), &n["report"]))
        .collect();
    let abs = |r: &Value, ns: u64| r["t0_unix_ns"].as_u64().unwrap_or(0) + ns;
    let first = |r: &Value| {
        r["spans"]
            .as_array()
            .and_then(|a| a.first())
            .and_then(|s| s[0].as_u64())
            .map(|ns| abs(r, ns))
    };
    let origin = nodes
        .iter()
        .filter_map(|(_, r)| first(r))
        .min()
        .unwrap_or(0);
    let mut end = 0;
    let lanes = nodes
        .iter()
        .map(|(name, r)| {
            let spans: Vec<(u64, u64, SpanKind)> = r["spans"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|s| {
                    let (a, b) = (s[0].as_u64()?, s[1].as_u64()?);
                    let kind = if s[2] == "comm" {
                        SpanKind::Comm
                    } else {
                        SpanKind::Compute
                    };
                    Some((
                        abs(r, a).saturating_sub(origin),
                        abs(r, b).saturating_sub(origin),
                        kind,
                    ))
                })
                .collect();
            end = end.max(spans.last().map_or(0, |s| s.1));
            Lane {
                name: name.to_string(),
                spans,
                down: Vec::new(),
            }
        })
        .collect();
    let coord = nodes
        .iter()
        .find(|(_, r)| r["role"] == "coordinator")
        .map(|n| n.1);
    let markers = coord
        .map(|c| {
            m["coordinator"]["events"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|e| {
                    let what = e["what"].as_str()?;
                    let at = abs(c, (e["t_s"].as_f64()? * 1e9) as u64).checked_sub(origin)?;
                    let fault = what.contains("lost") || what.contains("aborted");
                    let worth = fault || what.contains("planned") || what.contains("joined");
                    worth.then(|| (at, what.to_string(), fault))
                })
                .collect()
        })
        .unwrap_or_default();
    Timeline {
        end_ns: end,
        lanes,
        markers,
    }
}

fn say(json: bool, v: Value) {
    if json {
        use std::io::Write;
        let _ = writeln!(std::io::stdout().lock(), "{v}");
    } else if v["event"] != "spawned" {
        eprintln!("{}", human(&v));
    }
}

fn coordinator_summary(c: &Value) -> String {
    let f = |k: &str| c[k].as_f64().unwrap_or(0.0);
    let acc = f("accuracy");
    let target = f("target_accuracy");
    let sample = match (
        c["sample"]["prompt"].as_str(),
        c["sample"]["continuation"].as_str(),
    ) {
        (Some(p), Some(more)) => format!(
            "\nthe model continues the first test context: {:?} → {:?}",
            p, more
        ),
        _ => String::new(),
    };
    let body = format!(
        "trained steps {}..{} in {:.1} s: {:.0} samples/s\n\
         accuracy on the held-out split: {:.3} (target {:.2}: {})\n\
         capacity efficiency: {:.2} (achieved ÷ {:.0} samples/s, the sum of each node's measured solo throughput)\n\
         checkpoints: steps {} in {} (final: {})",
        c["start_step"],
        c["steps"],
        f("train_s"),
        f("samples_per_s"),
        acc,
        target,
        if acc >= target {
            "reached"
        } else {
            "NOT reached"
        },
        f("capacity_efficiency"),
        f("solo_sum_samples_per_s"),
        c["checkpoints"]
            .as_array()
            .map(|a| a
                .iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", "))
            .unwrap_or_default(),
        c["checkpoint_dir"].as_str().unwrap_or(""),
        c["final_checkpoint"].as_str().unwrap_or("")
    );
    body + &sample
}

/// The final report of a local cluster run.
fn summary_text(m: &Value) -> String {
    let mut out = format!("ravnest run: {}\n", m["cluster"].as_str().unwrap_or(""));
    let Some(c) = m["coordinator"]
        .as_object()
        .map(|o| Value::Object(o.clone()))
    else {
        return out + "the coordinator did not report\n";
    };
    out += &coordinator_summary(&c);
    out += "\n\nnode          role          steps   busy   comm   idle   solo samples/s     sent\n";
    let wall = c["train_s"].as_f64().unwrap_or(1.0).max(1e-9);
    for n in m["nodes"].as_array().into_iter().flatten() {
        let r = &n["report"];
        if r.is_null() {
            out += &format!(
                "{:<13} (no report: the process ended early)\n",
                n["node"].as_str().unwrap_or("?")
            );
            continue;
        }
        let busy = r["compute_s"].as_f64().unwrap_or(0.0) / wall;
        let comm = r["comm_s"].as_f64().unwrap_or(0.0) / wall;
        out += &format!(
            "{:<13} {:<12} {:>6} {:>5.0}% {:>5.0}% {:>5.0}% {:>16.0} {:>7.1} MB\n",
            n["node"].as_str().unwrap_or("?"),
            r["role"].as_str().unwrap_or("?"),
            r["steps_applied"],
            100.0 * busy.min(1.0),
            100.0 * comm.min(1.0),
            100.0 * (1.0 - busy - comm).max(0.0),
            c["solo_by_node"][n["node"].as_str().unwrap_or("?")]
                .as_f64()
                .unwrap_or(0.0),
            r["bytes_sent"].as_f64().unwrap_or(0.0) / 1e6
        );
    }
    let all: Vec<&str> = c["events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e["what"].as_str())
        .collect();
    let plans = all.iter().filter(|w| w.contains(": planned ")).count();
    let rebalanced = all.iter().filter(|w| w.ends_with("re-planned")).count();
    out += &format!(
        "
{plans} distinct plan(s); {rebalanced} re-plan(s) for measured speeds\n"
    );
    let events: Vec<&str> = all
        .into_iter()
        .filter(|w| {
            w.contains("lost")
                || w.contains("aborted")
                || w.contains("joined")
                || w.starts_with("violation")
                || w.starts_with("stalled")
        })
        .collect();
    if !events.is_empty() {
        out += "\nevents:\n";
        for e in events {
            out += &format!("  {e}\n");
        }
    }
    if let Some(f) = m["failed"].as_array().filter(|f| !f.is_empty()) {
        out += &format!(
            "\nprocesses that failed: {}\n",
            f.iter()
                .filter_map(|x| x.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    out
}

/// `--join HOST:PORT`: the cluster file from a running node, authenticated with the secret in
/// `RAVNEST_SECRET` (the default secret of files without one when unset). Returns (origin,
/// text, steps).
pub fn fetch_cluster_file(addr: &str) -> Result<(String, String, u64)> {
    let sa: std::net::SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(addr)
        .ok()
        .and_then(|mut it| it.next())
        .with_context(|| format!("--join {addr}: not a reachable host:port"))?;
    let secret = std::env::var("RAVNEST_SECRET")
        .unwrap_or_else(|_| ravnest_train::process::DEFAULT_SECRET.to_string());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let doc = rt
        .block_on(ravnest_runtime::tcp::fetch_cluster_file(
            sa,
            secret.as_bytes(),
        ))
        .map_err(|e| {
            anyhow::anyhow!(
                "--join {addr}: {e}{}",
                if matches!(e, ravnest_runtime::tcp::HandshakeError::Secret(_)) {
                    " (set RAVNEST_SECRET to the cluster's secret)"
                } else {
                    ""
                }
            )
        })?;
    let (origin, text, steps) = ravnest_train::process::read_share_document(&doc)
        .with_context(|| format!("--join {addr}"))?;
    Ok((format!("{origin} (from {addr})"), text, steps))
}

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
use ravnest_node::discover::Announce;
use ravnest_node::events::RunEvent;
use ravnest_node::process::Options;
use ravnest_node::summary::{NodeReport, NodeRow, RunReport};
use serde_json::Value;

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
    /// Replace the checkpoints already in the output directory.
    pub overwrite: bool,
    /// The registration window, s (overrides `[run] register_timeout_s`).
    pub wait: Option<u64>,
    /// This node's listen address (overrides its `listen`).
    pub bind: Option<String>,
    /// The address peers dial for this node (overrides its `address`).
    pub advertise: Option<String>,
    /// Compute on this device (overrides the nodes' `device`).
    pub device: Option<String>,
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
    /// When each node announces itself on the LAN (for `--discover`).
    pub announce: ravnest_node::discover::Announce,
    /// The coordinator's host gave this node its place (`--join` with a name the cluster file
    /// lacked): it registers as a new node.
    pub newcomer: bool,
    /// The node whose process hosts the coordinator, as the node that handed out the file
    /// knows it (`--join`: a fail-over may have moved it away from the file's).
    pub host: Option<ravnest_core::NodeId>,
    /// Serve the live view at this address (a local cluster).
    pub dashboard: Option<String>,
    /// Write TensorBoard event files to this folder (a local cluster).
    pub tensorboard: Option<PathBuf>,
}

fn default_out(s: &Scenario) -> PathBuf {
    Path::new("ravnest-out").join(&s.cluster.name)
}

/// Run as asked.
pub fn run(args: RunArgs) -> Result<()> {
    let mut scenario = ravnest_train::folder::parse_scenario(&args.text, &args.origin)?;
    if let Some(n) = args.steps {
        scenario.run.steps = n;
    }
    if let Some(w) = args.wait {
        scenario.run.register_timeout_s = w;
    }
    if let Some(host) = args
        .host
        .filter(|h| h.index() < scenario.cluster.nodes.len())
    {
        scenario.run.coordinator = Some(host);
    }
    let steps = scenario.run.steps;
    let out = args.out.clone().unwrap_or_else(|| default_out(&scenario));
    if args.join && args.node.is_none() {
        bail!("--join restarts one node: name it with --node NAME");
    }
    // A name the file did not have joins as a new node: the coordinator's host gave it its
    // place in the file it fetched (which needs the address peers reach it at).
    let text = args.text.clone();
    let newcomer = args.join && args.newcomer;
    if let Some(me) = args
        .node
        .as_ref()
        .filter(|me| args.join && !scenario.cluster.nodes.iter().any(|n| &n.name == *me))
    {
        if args.advertise.is_none() {
            bail!(
                "--join: `{me}` is not a node of the cluster file, so it joins as a new node: say where peers reach it with --advertise HOST:PORT"
            );
        }
        bail!(
            "--join: `{me}` is not a node of the cluster file, and the coordinator's host gave it no place"
        );
    }
    // (A name not in the file is the node process's error, which lists the names.)
    if let Some(i) = args
        .node
        .as_ref()
        .and_then(|node| scenario.cluster.nodes.iter().position(|n| &n.name == node))
    {
        if let Some(b) = &args.bind {
            scenario.cluster.nodes[i].listen = Some(b.clone());
        }
        if let Some(a) = &args.advertise {
            scenario.cluster.nodes[i].address = Some(a.clone());
        }
    }
    let register_timeout = Duration::from_secs(scenario.run.register_timeout_s);
    match &args.node {
        Some(node) => {
            // A node the local launcher started is drawn by the launcher.
            let launched = std::env::var_os(ravnest_node::process::LAUNCHER_PID).is_some();
            let view = (!launched)
                .then(|| {
                    crate::view::View::of_node(
                        &scenario,
                        args.dashboard.as_deref(),
                        args.tensorboard.as_deref(),
                    )
                })
                .transpose()?;
            let (s, dir) = (scenario.clone(), out.clone());
            let ran = ravnest_node::process::run(Options {
                scenario,
                origin: args.origin.clone(),
                node: node.clone(),
                out_dir: out,
                resume: args.resume,
                join: args.join,
                json: args.json,
                register_timeout,
                advertise: args.advertise.clone(),
                overwrite: args.overwrite,
                device: args.device.clone(),
                planner: ravnest_core::PlannerKind::parse(&args.planner)
                    .with_context(|| format!("unknown planner `{}`", args.planner))?,
                quiet: false,
                share: Some(ravnest_node::process::share_document(
                    &args.origin,
                    &text,
                    steps,
                )),
                spans: args.spans,
                announce: args.announce,
                newcomer,
                observe: view.as_ref().map(crate::view::View::observer),
            });
            // The coordinator's host at the end writes the run's page.
            if let (Some(v), Ok(r)) = (&view, &ran)
                && r.coordinator.is_some()
            {
                let mut v = v.lock().unwrap_or_else(|p| p.into_inner());
                if let Some(m) = v.summary().cloned() {
                    v.finish(&s, &dir, &m, None);
                }
            }
            if let Err(ravnest_node::process::RunError::SteppedDown(why)) = &ran {
                // A stale coordinator that stepped down: said, and not a failure of the run.
                eprintln!("{why}");
                std::process::exit(ravnest_node::process::STEPPED_DOWN_EXIT);
            }
            if ran?.coordinator.is_some_and(|c| c.stopped.is_some()) {
                // Stopped on request, cleanly: the report and the `--resume` line are printed.
                std::process::exit(ravnest_node::process::STOPPED_EXIT);
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
    check_local(args, s, out)?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create `{}`", out.display()))?;
    // The children read the file itself where there is one (its relative paths, `[model]
    // from`, are relative to it), else (the embedded default) a copy in the output folder.
    let given = Path::new(&args.origin);
    let file = if given.is_file() {
        given.to_path_buf()
    } else {
        let file = out.join("cluster.toml");
        std::fs::write(&file, &args.text)
            .with_context(|| format!("cannot write `{}`", file.display()))?;
        file
    };
    let exe = std::env::current_exe().context("cannot find this program's path")?;
    let mut view =
        crate::view::View::new(s, args.dashboard.as_deref(), args.tensorboard.as_deref())?;
    let (tx, rx) = mpsc::channel::<(usize, Option<RunEvent>)>();
    let mut children: Vec<(String, Child)> = Vec::new();
    for (i, n) in s.cluster.nodes.iter().enumerate() {
        let mut child = node_command(args, &exe, &file, out, &n.name)
            .spawn()
            .with_context(|| format!("cannot start node `{}`", n.name))?;
        let stdout = child.stdout.take().expect("piped");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                if let Ok(e) = serde_json::from_str::<RunEvent>(&line) {
                    let _ = tx.send((i, Some(e)));
                }
            }
            let _ = tx.send((i, None));
        });
        let spawned = RunEvent::Spawned {
            node: n.name.clone(),
            pid: child.id(),
        };
        view.see(&spawned);
        say(args.json, &spawned);
        children.push((n.name.clone(), child));
    }
    relay_stops(tx.clone());
    drop(tx);
    let bars = Bars::new(args.json, s.run.steps, &children);
    let reports = watch(args, out, &rx, &mut children, (&bars, &mut view))?;
    bars.done();
    finish(args, s, out, &mut children, (&reports, &mut view))
}

/// The message on the children's channel that says this process was asked to stop.
const STOP: usize = usize::MAX;

/// SIGINT (a terminal's Ctrl-C, `timeout`) and SIGTERM (a service manager, a job scheduler)
/// to this process become [`STOP`] messages: this process tells its children (see [`watch`]),
/// which run in process groups of their own.
fn relay_stops(tx: mpsc::Sender<(usize, Option<RunEvent>)>) {
    use tokio::signal::unix::{SignalKind, signal};
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => return eprintln!("note: Ctrl-C will not stop the run cleanly: {e}"),
    };
    let (int, term) = rt.block_on(async {
        (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        )
    });
    let (Ok(mut int), Ok(mut term)) = (int, term) else {
        return eprintln!("note: Ctrl-C will not stop the run cleanly: no signal handler");
    };
    std::thread::spawn(move || {
        rt.block_on(async move {
            loop {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
                if tx.send((STOP, None)).is_err() {
                    return;
                }
            }
        });
    });
}

/// Send `sig` to every child still running.
fn signal_children(children: &mut [(String, Child)], sig: rustix::process::Signal) {
    for (_, c) in children.iter_mut() {
        if matches!(c.try_wait(), Ok(None))
            && let Some(pid) = rustix::process::Pid::from_raw(c.id() as i32)
        {
            let _ = rustix::process::kill_process(pid, sig);
        }
    }
}

/// A stop request to the launcher: the first asks the children to stop (the coordinator's host
/// ends the run cleanly, with a checkpoint, and its report follows as usual); a second kills
/// them at once, removes the checkpoint parts no round will complete, and exits.
fn on_stop(stops: &mut u32, out: &Path, children: &mut [(String, Child)], bars: &Bars) {
    *stops += 1;
    if *stops == 1 {
        bars.println(
            "stop requested (Ctrl-C or SIGTERM): the run ends once the steps in flight finish, with a checkpoint there (Ctrl-C again to stop at once)".into(),
        );
        signal_children(children, rustix::process::Signal::USR1);
        return;
    }
    signal_children(children, rustix::process::Signal::KILL);
    for (_, c) in children.iter_mut() {
        let _ = c.wait();
    }
    let _ = std::fs::remove_dir_all(out.join("checkpoints").join(".parts"));
    bars.done();
    eprintln!(
        "stopped at once: every node process ended; the latest checkpoint in {} stays the latest (continue with --resume)",
        out.join("checkpoints").display()
    );
    std::process::exit(ravnest_node::process::INTERRUPTED_EXIT);
}

/// Before starting anything: every node is on this machine, no earlier run's checkpoints are
/// in the way, and this binary can use every node's device.
fn check_local(args: &RunArgs, s: &Scenario, out: &Path) -> Result<()> {
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
    // Another run's checkpoints are not written over (a `--node` process checks for itself).
    if ravnest_train::store::guard(&out.join("checkpoints"), args.resume, args.overwrite)? {
        eprintln!(
            "--overwrite: removed the previous checkpoints in {}",
            out.join("checkpoints").display()
        );
    }
    // Devices this binary cannot use fail here, once, rather than in every child.
    for (i, n) in s.cluster.nodes.iter().enumerate() {
        ravnest_train::device::of_node(s, i, args.device.as_deref())
            .and_then(|d| d.check())
            .map_err(|e| anyhow::anyhow!("{}: node `{}`: {e}", args.origin, n.name))?;
    }
    Ok(())
}

/// The command that starts node `name` as a child process that speaks JSON lines.
fn node_command(args: &RunArgs, exe: &Path, file: &Path, out: &Path, name: &str) -> Command {
    let mut cmd = Command::new(exe);
    cmd.arg("run")
        .arg(file)
        .args(["--node", name, "--json", "--out"])
        .arg(out)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    if let Some(k) = args.steps {
        cmd.args(["--steps", &k.to_string()]);
    }
    if args.resume {
        cmd.arg("--resume");
    }
    if let Some(w) = args.wait {
        cmd.args(["--wait", &w.to_string()]);
    }
    if let Some(d) = &args.device {
        cmd.args(["--device", d]);
    }
    cmd.args(["--planner", &args.planner]);
    if args.timeline.is_some() {
        cmd.arg("--report-spans");
    }
    match args.announce {
        Announce::Always => {
            cmd.arg("--discover");
        }
        Announce::Never => {
            cmd.arg("--no-announce");
        }
        Announce::Reachable => {}
    }
    // Several processes share this machine's cores: one compute thread each.
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        cmd.env("RAYON_NUM_THREADS", "1");
    }
    // Its own process group: a terminal's Ctrl-C reaches this process only, which tells every
    // child (see `on_stop`); a signal to one child is that node's (a worker leaves).
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    // The child dies with this process (`kill -9` of the launcher leaves nothing behind).
    cmd.env(
        ravnest_node::process::LAUNCHER_PID,
        std::process::id().to_string(),
    );
    cmd
}

/// One progress bar per node (indicatif draws only on a terminal); events print above them.
struct Bars {
    all: MultiProgress,
    nodes: Vec<ProgressBar>,
}

impl Bars {
    fn new(json: bool, steps: u64, children: &[(String, Child)]) -> Bars {
        let all = MultiProgress::new();
        if json {
            all.set_draw_target(ProgressDrawTarget::hidden());
        }
        let style = ProgressStyle::with_template(
            "{prefix:>10} [{bar:30.cyan/blue}] {pos:>5}/{len:5} {msg}",
        )
        .expect("a valid template")
        .progress_chars("#>-");
        let nodes = children
            .iter()
            .map(|(name, _)| {
                let b = all.add(ProgressBar::new(steps));
                b.set_style(style.clone());
                b.set_prefix(name.clone());
                b.set_message("starting");
                b
            })
            .collect();
        Bars { all, nodes }
    }

    /// A line above the bars (or on stderr when they are hidden).
    fn println(&self, line: String) {
        if self.all.is_hidden() {
            eprintln!("{line}");
        } else {
            let _ = self.all.println(line);
        }
    }

    /// Leave the bars of nodes that did not finish as they are.
    fn done(&self) {
        for b in &self.nodes {
            if !b.is_finished() {
                b.abandon();
            }
        }
    }
}

/// Follow the nodes' JSON lines until every node's output ends: progress moves its bar,
/// reports are kept, events are shown. A node that exits with an error before its report
/// failed to start or to go on (a port in use, a bad dataset): the run cannot do what was
/// asked, so the others are stopped now rather than left waiting. A node killed by a signal is
/// a lost node, which the cluster survives (and which may rejoin with `--join`); so is a stale
/// coordinator that stepped down (`STEPPED_DOWN_EXIT`) once a newer term took over.
fn watch(
    args: &RunArgs,
    out: &Path,
    rx: &mpsc::Receiver<(usize, Option<RunEvent>)>,
    children: &mut [(String, Child)],
    (bars, view): (&Bars, &mut crate::view::View),
) -> Result<Vec<Option<NodeReport>>> {
    let mut reports: Vec<Option<NodeReport>> = vec![None; children.len()];
    let mut open = children.len();
    let mut stops = 0;
    while open > 0 {
        let Ok((i, msg)) = rx.recv() else { break };
        if i == STOP {
            on_stop(&mut stops, out, children, bars);
            continue;
        }
        let Some(v) = msg else {
            open -= 1;
            view.ended(&children[i].0);
            if reports[i].is_none() {
                let status = children[i].1.wait()?;
                let stepped_down = status.code() == Some(ravnest_node::process::STEPPED_DOWN_EXIT);
                if stops > 0 && status.code() == Some(ravnest_node::process::STOPPED_EXIT) {
                    // Stopped before training began (nothing to save): the others go too.
                    signal_children(children, rustix::process::Signal::KILL);
                    for (_, c) in children.iter_mut() {
                        let _ = c.wait();
                    }
                    bars.done();
                    eprintln!("stopped before training began; nothing to save");
                    std::process::exit(ravnest_node::process::STOPPED_EXIT);
                }
                if status.code().is_some_and(|c| c != 0) && !stepped_down {
                    for (_, c) in children.iter_mut() {
                        let _ = c.kill();
                        let _ = c.wait();
                    }
                    for b in &bars.nodes {
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
        // (A child's summary is its own; the launcher's, merged from all, comes at the end.)
        if !matches!(v, RunEvent::Summary(_)) {
            view.see(&v);
        }
        if let Some(r) = show(args, bars, i, v) {
            reports[i] = Some(r);
        }
    }
    Ok(reports)
}

/// One line of node `i`'s output on the console; its report, when that is what it is.
fn show(args: &RunArgs, bars: &Bars, i: usize, e: RunEvent) -> Option<NodeReport> {
    match e {
        RunEvent::Progress {
            step,
            steps,
            loss,
            samples_per_s,
            ..
        } => {
            let b = &bars.nodes[i];
            b.set_length(steps);
            b.set_position(step);
            b.set_message(format!(
                "{samples_per_s:>7.0} samples/s  loss {:.3}",
                loss.unwrap_or(f64::NAN)
            ));
            if args.json {
                say(true, &e);
            }
        }
        RunEvent::Report(r) => {
            bars.nodes[i].finish_with_message("done");
            return Some(r);
        }
        // The launcher merges the reports itself (it has every node's spans).
        RunEvent::Summary(_) => {}
        RunEvent::Plan { .. }
        | RunEvent::Links { .. }
        | RunEvent::Cluster { .. }
        | RunEvent::Measured { .. }
            if !args.json =>
        {
            bars.println(format!("[{}] {}", e.node().unwrap_or("?"), e.human()));
        }
        _ => {
            if args.json {
                say(true, &e);
            }
        }
    }
    None
}

/// Wait for every node, merge their reports into the run's (and its timeline), print it.
fn finish(
    args: &RunArgs,
    s: &Scenario,
    out: &Path,
    children: &mut [(String, Child)],
    (reports, view): (&[Option<NodeReport>], &mut crate::view::View),
) -> Result<()> {
    let mut failed = Vec::new();
    for (name, child) in children.iter_mut() {
        let status = child.wait()?;
        if status.code() == Some(ravnest_node::process::STEPPED_DOWN_EXIT) {
            failed.push(format!("{name} (stepped down)"));
        } else if status.code() == Some(ravnest_node::process::STOPPED_EXIT) {
            // Stopped on request, cleanly.
        } else if !status.success() {
            failed.push(format!("{name} ({status})"));
        }
    }
    let coordinator = reports
        .iter()
        .flatten()
        .find(|r| r.coordinator.is_some())
        .cloned();
    let nodes: Vec<NodeRow> = children
        .iter()
        .zip(reports)
        .map(|((name, _), r)| NodeRow {
            node: name.clone(),
            report: r.clone(),
        })
        .collect();
    let finished = coordinator.is_some();
    // Stopped on request: the command that continues this local run.
    let coordinator = coordinator.map(|mut r| {
        if let Some(c) = r.coordinator.as_mut().filter(|c| c.stopped.is_some()) {
            c.stopped = Some(local_resume_command(args, out));
        }
        r
    });
    let stopped = coordinator
        .as_ref()
        .and_then(|r| r.coordinator.as_ref())
        .is_some_and(|c| c.stopped.is_some());
    let mut merged = RunReport {
        cluster: s.cluster.name.clone(),
        coordinator,
        nodes,
        failed: failed.clone(),
    };
    merged.measure_pipeline();
    let mut spans_svg = None;
    if let Some(path) = &args.timeline {
        let t = timeline(&merged, &out.join("events.jsonl"));
        let svg = ravnest_sim::timeline::svg(&t, &format!("ravnest run: {}", s.cluster.name));
        std::fs::write(path, &svg).with_context(|| format!("cannot write `{}`", path.display()))?;
        eprintln!("timeline written to {}", path.display());
        spans_svg = Some(svg);
    }
    view.see(&RunEvent::Summary(merged.clone()));
    view.finish(s, out, &merged, spans_svg);
    if args.json {
        say(true, &RunEvent::Summary(merged));
    } else {
        eprintln!();
        use std::io::Write;
        let _ = writeln!(std::io::stdout().lock(), "{}", merged.text());
    }
    if !finished {
        bail!(
            "the coordinator did not finish (failed: {})",
            failed.join(", ")
        );
    }
    if stopped {
        std::process::exit(ravnest_node::process::STOPPED_EXIT);
    }
    Ok(())
}

/// `ravnest run [FILE] --out DIR --resume`, as this local run was started.
fn local_resume_command(args: &RunArgs, out: &Path) -> String {
    let mut cmd = String::from("ravnest run");
    if Path::new(&args.origin).is_file() {
        cmd += &format!(" {}", args.origin);
    }
    if let Some(k) = args.steps {
        cmd += &format!(" --steps {k}");
    }
    cmd + &format!(" --out {} --resume", out.display())
}

/// The timeline of a local run from its nodes' reports: one lane per node on the clock all
/// the processes share, with the coordinator's events as markers.
fn timeline(m: &RunReport, events: &Path) -> ravnest_sim::timeline::Timeline {
    use ravnest_runtime::counters::SpanKind;
    use ravnest_sim::timeline::{Lane, Timeline};
    let abs = |r: &NodeReport, ns: u64| r.t0_unix_ns.unwrap_or(0) + ns;
    let origin = m
        .nodes
        .iter()
        .filter_map(|n| n.report.as_ref())
        .filter_map(|r| r.spans.first().map(|s| abs(r, s.0)))
        .min()
        .unwrap_or(0);
    let mut end = 0;
    let lanes = m
        .nodes
        .iter()
        .map(|n| {
            let spans: Vec<(u64, u64, SpanKind)> = n
                .report
                .iter()
                .flat_map(|r| r.spans.iter().map(move |s| (r, s)))
                .map(|(r, (a, b, kind))| {
                    let kind = if kind == "comm" {
                        SpanKind::Comm
                    } else {
                        SpanKind::Compute
                    };
                    (
                        abs(r, *a).saturating_sub(origin),
                        abs(r, *b).saturating_sub(origin),
                        kind,
                    )
                })
                .collect();
            end = end.max(spans.last().map_or(0, |s| s.1));
            Lane {
                name: n.node.clone(),
                spans,
                down: Vec::new(),
            }
        })
        .collect();
    // The coordinator's events, from `events.jsonl` (`t_s` on its host's clock).
    let events: Vec<Value> = std::fs::read_to_string(events)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let markers = m
        .coordinator
        .as_ref()
        .map(|c| {
            events
                .iter()
                .filter_map(|e| {
                    let what = e["what"].as_str()?;
                    let at = abs(c, (e["t_s"].as_f64()? * 1e9) as u64).checked_sub(origin)?;
                    let fault = what.contains("lost")
                        || what.contains("aborted")
                        || what.contains("took over");
                    let worth = fault
                        || what.contains("planned")
                        || what.contains("joined")
                        || what.contains("joins the running cluster")
                        || what.contains("left cleanly");
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

/// An event of the launcher's: a JSON line on stdout, or text on stderr (`spawned` only as
/// JSON).
fn say(json: bool, e: &RunEvent) {
    if json {
        use std::io::Write;
        let _ = writeln!(std::io::stdout().lock(), "{}", e.json());
    } else if !matches!(e, RunEvent::Spawned { .. }) {
        eprintln!("{}", e.human());
    }
}

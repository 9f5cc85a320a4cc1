//! What the local launcher shows besides its console: the live dashboard (`--dashboard`),
//! TensorBoard files (`--tensorboard`), and after the run `report.html` (the same page, with
//! what `ravnest sim` predicts for the same file beside what was measured) and each step's loss
//! at the end of `events.jsonl`. It sees every node's events, so it draws the whole cluster, and
//! it outlives any node's process: a coordinator take-over shows as the host changing.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result};
use ravnest_core::Scenario;
use ravnest_node::events::RunEvent;
use ravnest_node::summary::RunReport;
use ravnest_view::Board;
use ravnest_view::serve::Shared;
use ravnest_view::tfevents::EventWriter;

/// The launcher's view of the run (or a `--node` process's).
pub struct View {
    board: Shared,
    t0: Instant,
    unix0: f64,
    /// The TensorBoard file, the next step to write, and evaluations written.
    tb: Option<(EventWriter, u64, usize)>,
    /// The run's report, when its summary came.
    summary: Option<RunReport>,
}

impl std::fmt::Debug for View {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("View").finish_non_exhaustive()
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl View {
    /// A view of `s`, served at `dashboard` and written to `tensorboard` where asked.
    pub fn new(s: &Scenario, dashboard: Option<&str>, tensorboard: Option<&Path>) -> Result<View> {
        let names: Vec<String> = s.cluster.nodes.iter().map(|n| n.name.clone()).collect();
        let host = s
            .run
            .coordinator
            .and_then(|c| names.get(c.index()).cloned())
            .or_else(|| names.first().cloned())
            .unwrap_or_default();
        let board = Arc::new(Mutex::new(Board::new(
            &s.cluster.name,
            &names,
            &host,
            s.run.steps,
        )));
        if let Some(addr) = dashboard {
            let d = ravnest_view::serve::start(addr, board.clone())
                .with_context(|| format!("--dashboard: cannot listen on {addr}"))?;
            eprintln!(
                "dashboard: http://{}/  (Prometheus metrics at http://{}/metrics)",
                d.addr, d.addr
            );
        }
        let unix0 = unix_now();
        let tb = match tensorboard {
            Some(dir) => {
                let w = EventWriter::create(dir, unix0).with_context(|| {
                    format!("--tensorboard: cannot write in `{}`", dir.display())
                })?;
                eprintln!("TensorBoard events: {}", w.path().display());
                Some((w, 0, 0))
            }
            None => None,
        };
        Ok(View {
            board,
            t0: Instant::now(),
            unix0,
            tb,
            summary: None,
        })
    }

    /// A `--node` process's view: its own node's figures, and the cluster's (events, plans,
    /// every node's step timings) while it hosts the coordinator. With `--dashboard`, the page
    /// links every node's dashboard at the same port (a stream that stops offers them).
    pub fn of_node(
        s: &Scenario,
        dashboard: Option<&str>,
        tensorboard: Option<&Path>,
    ) -> Result<Arc<Mutex<View>>> {
        let v = View::new(s, dashboard, tensorboard)?;
        {
            let mut b = v.board();
            b.partial_loss = true;
            let port = dashboard.and_then(|d| d.rsplit_once(':')).map(|(_, p)| p);
            if let Some(port) = port.filter(|p| *p != "0") {
                b.dashboards = s
                    .cluster
                    .nodes
                    .iter()
                    .filter_map(|n| {
                        let host = n.address.as_deref()?.rsplit_once(':')?.0;
                        Some((n.name.clone(), format!("http://{host}:{port}/")))
                    })
                    .collect();
            }
        }
        Ok(Arc::new(Mutex::new(v)))
    }

    /// What a node process calls with every event it says.
    pub fn observer(v: &Arc<Mutex<View>>) -> ravnest_node::events::Observer {
        let v = v.clone();
        ravnest_node::events::Observer(Arc::new(move |e: &RunEvent| {
            v.lock().unwrap_or_else(|p| p.into_inner()).see(e)
        }))
    }

    /// The run's report, if its summary came.
    pub fn summary(&self) -> Option<&RunReport> {
        self.summary.as_ref()
    }

    fn board(&self) -> std::sync::MutexGuard<'_, Board> {
        self.board.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A node's event, now.
    pub fn see(&mut self, e: &RunEvent) {
        let t = self.t0.elapsed().as_secs_f64();
        self.board().apply(t, e);
        if let RunEvent::Summary(r) = e {
            self.summary = Some(r.clone());
        }
        if matches!(e, RunEvent::Progress { .. } | RunEvent::Eval { .. }) {
            self.tensorboard(false);
        }
    }

    /// Node `name`'s process ended.
    pub fn ended(&mut self, name: &str) {
        let t = self.t0.elapsed().as_secs_f64();
        self.board().ended(t, name);
    }

    /// Scalars of the steps every training node has gone past (all of them at the end).
    fn tensorboard(&mut self, all: bool) {
        let Some((w, next, evals)) = self.tb.as_mut() else {
            return;
        };
        let b = self.board.lock().unwrap_or_else(|p| p.into_inner());
        let settled = if all {
            u64::MAX
        } else {
            b.nodes
                .iter()
                .filter(|n| n.state == ravnest_view::board::NodeState::Training)
                .map(|n| n.step)
                .min()
                .unwrap_or(0)
        };
        let now = unix_now();
        let mut rows: Vec<(u64, Vec<(&str, f32)>)> = Vec::new();
        for (step, loss, _) in b.step_losses_in(*next..settled) {
            let mut s = vec![("train/loss", loss as f32)];
            if let Some(n) = b.grad_norms.get(&step) {
                s.push(("train/grad_norm", *n as f32));
            }
            rows.push((step, s));
        }
        if let Some(last) = rows.last() {
            let rate = b.throughput.last().map_or(0.0, |t| t.1);
            let at = last.0;
            rows.push((at, vec![("train/samples_per_s", rate as f32)]));
            *next = at + 1;
        }
        for e in b.evals.iter().skip(*evals) {
            rows.push((
                e.step,
                vec![
                    ("eval/loss", e.loss as f32),
                    ("eval/accuracy", e.accuracy as f32),
                ],
            ));
        }
        *evals = b.evals.len();
        drop(b);
        for (step, s) in rows {
            if let Err(e) = w.scalars(now, step, &s) {
                eprintln!("--tensorboard: cannot write: {e}");
                self.tb = None;
                return;
            }
        }
    }

    /// After the run: each step's loss at the end of `events.jsonl`, `report.html` with what
    /// the simulator predicts for `s` beside what was measured, the last TensorBoard scalars.
    pub fn finish(&mut self, s: &Scenario, out: &Path, m: &RunReport, spans_svg: Option<String>) {
        self.tensorboard(true);
        // (A `--node` process has only its own node's losses: they are not the steps'.)
        if !self.board().partial_loss
            && let Err(e) = self.append_losses(&out.join("events.jsonl"))
        {
            eprintln!("cannot add the step losses to events.jsonl: {e}");
        }
        let mut snap = self.board().snapshot(2000);
        snap["predicted"] = predicted_vs_measured(s, m);
        if let Some(svg) = spans_svg {
            snap["spans_svg"] = serde_json::json!(svg);
        }
        snap["unix_start_s"] = serde_json::json!(self.unix0);
        let path = out.join("report.html");
        match std::fs::write(&path, ravnest_view::page::report(&snap)) {
            Ok(()) => eprintln!("report: {}", path.display()),
            Err(e) => eprintln!("cannot write {}: {e}", path.display()),
        }
    }

    fn append_losses(&self, path: &Path) -> std::io::Result<()> {
        use std::io::Write;
        if !path.exists() {
            return Ok(());
        }
        let mut f = std::fs::OpenOptions::new().append(true).open(path)?;
        for (step, loss, samples) in self.board().step_losses() {
            let line = serde_json::json!({"what": "step loss", "step": step, "loss": loss, "samples": samples});
            writeln!(f, "{line}")?;
        }
        Ok(())
    }
}

/// What `ravnest sim` predicts for this file beside what the run measured, for
/// `report.html` to draw: a note, and per node (busy, comm, idle) predicted and measured.
fn predicted_vs_measured(s: &Scenario, m: &RunReport) -> serde_json::Value {
    let mut opts = ravnest_sim::SimOptions::for_scenario(s);
    opts.steps = s.run.steps.min(200);
    opts.progress = false;
    let sim = match ravnest_sim::run(s, &opts) {
        Ok(r) => r,
        Err(e) => {
            return serde_json::json!({"note": format!("the simulator cannot run this file: {e}")});
        }
    };
    let measured_rate = m
        .coordinator()
        .map(|(_, c)| c.steady_samples_per_s)
        .unwrap_or(0.0);
    let rows: Vec<serde_json::Value> = m
        .nodes
        .iter()
        .map(|row| {
            let p = sim.nodes.iter().find(|n| n.name == row.node);
            let r = row.report.as_ref();
            let measured = r
                .and_then(|r| r.steady_busy.zip(r.steady_comm))
                .map(|(b, c)| [b, c, (1.0 - b - c).max(0.0)]);
            serde_json::json!({
                "node": row.node,
                "predicted": p.map(|p| [p.busy, p.comm, p.idle]),
                "measured": measured,
            })
        })
        .collect();
    serde_json::json!({
        "note": format!(
            "cluster samples/s: predicted {:.0}, measured {:.0} (steady state). The simulator uses the file's device figures; the run measured its own.",
            sim.steady_samples_per_s, measured_rate
        ),
        "rows": rows,
    })
}

/// `report.html` for a simulated run: the same page, drawn from the simulator's report
/// (its timeline, faults and per-node figures; a simulation has no loss curve).
pub fn sim_report(r: &ravnest_sim::SimReport, path: &Path) -> Result<()> {
    use ravnest_runtime::counters::SpanKind;
    use ravnest_view::board::NodeState;
    let names: Vec<String> = r.timeline.lanes.iter().map(|l| l.name.clone()).collect();
    let mut b = Board::new(
        &r.scenario,
        &names,
        names.first().map_or("", String::as_str),
        r.steps_requested,
    );
    let s = |ns: u64| ns as f64 * 1e-9;
    for (n, lane) in b.nodes.iter_mut().zip(&r.timeline.lanes) {
        n.state = NodeState::Done;
        n.segments = lane
            .spans
            .iter()
            .map(|&(a, z, kind)| match kind {
                SpanKind::Comm => (s(a), s(z), 0.0, 1.0),
                _ => (s(a), s(z), 1.0, 0.0),
            })
            .collect();
        n.down = lane.down.iter().map(|&(a, z)| (s(a), Some(s(z)))).collect();
        if let Some(sim) = r.nodes.iter().find(|x| x.name == n.name) {
            n.device = sim.device.clone();
            n.step = sim.steps;
            n.figures.steps_applied = sim.steps;
            n.figures.compute_s = sim.busy * r.sim_time_s;
            n.figures.comm_s = sim.comm * r.sim_time_s;
            n.figures.peers = vec![("(all)".into(), sim.bytes_sent, 0)];
            if lane.down.last().is_some_and(|d| d.1 >= r.timeline.end_ns) {
                n.state = NodeState::Down;
            }
        }
    }
    b.now_s = r.sim_time_s.max(s(r.timeline.end_ns));
    b.step = r.steps_completed;
    b.finished = true;
    b.plans.push(ravnest_view::board::PlanView {
        t_s: 0.0,
        reason: format!("planner {}, seed {}", r.planner, r.seed),
        what: r.planned.clone(),
        rows: Vec::new(),
        sync: String::new(),
    });
    for (t, what, fault) in &r.timeline.markers {
        b.events.push(ravnest_view::board::EventRow {
            t_s: s(*t),
            node: "sim".into(),
            what: what.clone(),
            kind: if *fault {
                ravnest_view::board::EventKind::Fault
            } else {
                ravnest_view::board::EventKind::Join
            },
        });
    }
    let mut snap = b.snapshot(2000);
    snap["predicted"] = serde_json::json!({"note": format!(
        "a simulated run (virtual time): {}/{} steps in {:.1} s, {:.0} samples/s, capacity efficiency {:.2}, trace {:016x}",
        r.steps_completed,
        r.steps_requested,
        r.sim_time_s,
        r.samples_per_s,
        r.capacity_efficiency,
        r.trace_hash
    )});
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create `{}`", dir.display()))?;
    }
    // Written whole or not at all (two simulations of one file may write it at once).
    let tmp = path.with_extension(format!("html.{}.tmp", std::process::id()));
    std::fs::write(&tmp, ravnest_view::page::report(&snap))
        .and_then(|()| std::fs::rename(&tmp, path))
        .with_context(|| format!("cannot write `{}`", path.display()))
}

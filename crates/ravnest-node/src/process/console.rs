//! What a node process says: events as JSON lines on stdout (`--json`) or text on stderr, the
//! progress lines, and the coordinator's events relayed to the console and `events.jsonl`.

use std::sync::Arc;
use std::time::Duration;

use ravnest_core::NodeId;
use ravnest_protocol::coordinator::Event;
use ravnest_runtime::coordinator::Note;
use ravnest_runtime::counters::Counters;
use serde_json::json;
use tokio::time::Instant;

use crate::events::RunEvent;
use ravnest_train::compute::CandleCompute;

/// Prints events: JSON lines on stdout, or text on stderr.
#[derive(Debug, Clone)]
pub(super) struct Say {
    pub json: bool,
    pub quiet: bool,
    pub node: String,
    /// Sees every event (a live view).
    pub observe: Option<crate::events::Observer>,
}

impl Say {
    /// Whether the figures for scripts and views (losses, each node's counters) are wanted.
    pub(super) fn figures(&self) -> bool {
        self.json || self.observe.is_some()
    }

    /// Tell only the observer (what it draws of other nodes; no console line).
    pub(super) fn observe(&self, e: &RunEvent) {
        if let Some(o) = &self.observe {
            (o.0)(e);
        }
    }

    /// Say `e`.
    pub(super) fn say(&self, e: &RunEvent) {
        self.observe(e);
        if self.quiet {
            return;
        }
        // A closed stdout or stderr (the reader is gone) is not a reason to panic.
        use std::io::Write;
        if self.json {
            let _ = writeln!(std::io::stdout().lock(), "{}", e.json());
        } else if !matches!(
            e,
            RunEvent::Report(_) | RunEvent::Loss { .. } | RunEvent::GradNorm { .. }
        ) {
            // (A node's report is printed as the run's table: see `crate::summary`; losses are
            // JSON lines only.)
            let text = crate::summary::clip_lines(&format!("[{}] {}", self.node, e.human()));
            let _ = writeln!(std::io::stderr().lock(), "{text}");
        }
    }

    /// Something that happened to the cluster, in words.
    pub(super) fn cluster(&self, what: impl Into<String>) {
        self.say(&RunEvent::Cluster {
            node: self.node.clone(),
            what: what.into(),
            t_s: None,
            fact: None,
        });
    }

    /// A phase of start-up that may take a while (loading data, measuring): said once it has
    /// taken a second, then every 5 s with the time so far, until the returned guard is
    /// dropped (a quick one says nothing).
    pub(super) fn phase(&self, what: &str) -> super::options::AbortOnDrop {
        let (say, what) = (self.clone(), what.to_string());
        super::options::AbortOnDrop(tokio::spawn(async move {
            let t0 = tokio::time::Instant::now();
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            say.cluster(format!("{what} ..."));
            loop {
                tokio::time::sleep(std::time::Duration::from_secs(5)).await;
                say.waiting(format!("{what}: {} s so far", t0.elapsed().as_secs()));
            }
        }))
    }

    /// What this node waits for, in words.
    pub(super) fn waiting(&self, what: impl Into<String>) {
        self.say(&RunEvent::Waiting {
            node: self.node.clone(),
            what: what.into(),
        });
    }
}

/// What the progress lines watch.
pub(super) struct Progress {
    pub counters: Counters,
    pub compute: Arc<CandleCompute>,
    pub me: NodeId,
    pub steps: u64,
    pub global_batch: u64,
    /// For a worker: "coordinator `a` at ADDR", what it waits for before training.
    pub coordinator: Option<String>,
    /// ms since `t0` the coordinator was last heard from (`u64::MAX`: never).
    pub heard: Arc<std::sync::atomic::AtomicU64>,
    pub t0: Instant,
    /// The registration window, s.
    pub wait_s: u64,
    /// The transport (its bytes per peer) and the cluster's node names.
    pub net: ravnest_runtime::tcp::TcpTransport,
    pub names: Vec<String>,
}

/// This node's own figures so far, for a live view.
fn own_figures(p: &Progress) -> crate::events::NodeFigures {
    let (compute_s, comm_s, steps_applied, batch) = p
        .counters
        .read(p.me, |c| {
            (
                c.compute_ns as f64 * 1e-9,
                c.comm_ns as f64 * 1e-9,
                c.steps,
                c.batch,
            )
        })
        .unwrap_or((0.0, 0.0, 0, 0));
    let peers = p
        .net
        .peer_bytes()
        .into_iter()
        .map(|(id, sent, received)| {
            let name = p.names.get(id.index()).cloned();
            (
                name.unwrap_or_else(|| format!("node {}", id.0)),
                sent,
                received,
            )
        })
        .collect();
    crate::events::NodeFigures {
        compute_s,
        comm_s,
        steps_applied,
        batch,
        peers,
    }
}

/// The losses the node computed since last said, and the gradient norms it clipped by, as JSON
/// lines (scripts only: a person reads the progress lines).
pub(super) fn say_losses(say: &Say, compute: &CandleCompute, counters: &Counters) {
    if !say.figures() {
        return;
    }
    let norms = counters.take_grad_norms();
    for (step, norm) in norms {
        say.say(&RunEvent::GradNorm {
            node: say.node.clone(),
            step,
            norm,
        });
    }
    for l in compute.take_losses() {
        say.say(&RunEvent::Loss {
            node: say.node.clone(),
            step: l.step,
            first_sample: l.samples.start,
            samples: l.samples.end - l.samples.start,
            loss_sum: l.loss_sum,
        });
    }
}

/// Progress lines: nothing about training before it starts here (a worker says what it waits
/// for instead, every few seconds); then the step, loss and the cluster's samples/s over the
/// last interval, counted from the steps this node applied (a node that joins and fetches the
/// model at step 500 did not train 500 steps in half a second).
pub(super) fn spawn_progress(say: Say, p: Progress) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        // Every half second for scripts (JSON) and views, every two for people.
        let period = if say.figures() { 500 } else { 2000 };
        let mut tick = tokio::time::interval(Duration::from_millis(period));
        let mut last: Option<(std::time::Instant, u64)> = None;
        let mut next_wait = 5u64;
        let mut printed: Option<(u64, std::time::Instant)> = None;
        loop {
            tick.tick().await;
            if p.compute.started.get().is_none() {
                let waited = p.t0.elapsed().as_secs();
                if let Some(c) = &p.coordinator
                    && waited >= next_wait
                {
                    next_wait = waited + 5;
                    let what = match p.heard.load(std::sync::atomic::Ordering::Relaxed) {
                        u64::MAX => format!(
                            "waiting for {c} ({waited} s of {} s; the window is `[run] register_timeout_s`, or `--wait SECS`)",
                            p.wait_s
                        ),
                        _ => format!(
                            "registered with {c}; waiting for training to start ({waited} s)"
                        ),
                    };
                    say.waiting(what);
                }
                continue;
            }
            let (step, applied) = p
                .counters
                .read(p.me, |c| (c.version, c.steps))
                .unwrap_or((0, 0));
            let now = std::time::Instant::now();
            // The first interval starts when training started here.
            let (t, a) = last.unwrap_or_else(|| (*p.compute.started.get().expect("started"), 0));
            let rate = if applied >= a && now > t {
                (applied - a) as f64 * p.global_batch as f64 / (now - t).as_secs_f64()
            } else {
                0.0
            };
            last = Some((now, applied));
            // People get a line every two seconds when something moved; scripts and views get
            // every tick.
            let moved = printed.is_none_or(|(s, _)| s != step);
            let due = printed.is_none_or(|(_, at)| now - at >= Duration::from_millis(1900));
            let line = say.json || (moved && due);
            if !line && say.observe.is_none() {
                continue;
            }
            if line {
                printed = Some((step, now));
            }
            say_losses(&say, &p.compute, &p.counters);
            let loss = p.compute.stats().last_loss;
            let e = RunEvent::Progress {
                node: say.node.clone(),
                step,
                steps: p.steps,
                loss: loss.is_finite().then_some(loss),
                samples_per_s: rate,
                own: say.figures().then(|| own_figures(&p)),
            };
            if line { say.say(&e) } else { say.observe(&e) }
        }
    })
}

/// Where the coordinator's events go as they happen: the console (as `cluster` events) and
/// `events.jsonl` in the output folder, one JSON object per line (`t_s`, `what`), after a
/// first line that says where the run started.
pub(super) struct EventSink {
    file: Option<std::fs::File>,
    say: Say,
    cluster: ravnest_core::ClusterSpec,
    /// For an observer: the other nodes' counters, from their step reports (with the last
    /// step counted: a redone step's report is counted once), and their batches.
    others: std::collections::BTreeMap<NodeId, (crate::events::NodeFigures, u64)>,
    batches: std::collections::BTreeMap<NodeId, u64>,
}

impl EventSink {
    pub(super) fn open(
        path: &std::path::Path,
        append: bool,
        start_step: u64,
        say: Say,
        cluster: ravnest_core::ClusterSpec,
    ) -> EventSink {
        let file = path
            .parent()
            .map(std::fs::create_dir_all)
            .transpose()
            .and_then(|_| {
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(append)
                    .write(true)
                    .truncate(!append)
                    .open(path)
            });
        let mut file = match file {
            Ok(f) => Some(f),
            Err(e) => {
                say.cluster(format!("cannot write {}: {e}", path.display()));
                None
            }
        };
        if let Some(f) = &mut file {
            use std::io::Write;
            let unix = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            let _ = writeln!(
                f,
                "{}",
                json!({"t_s": 0.0, "what": format!("run started at step {start_step}"), "unix_s": unix})
            );
        }
        EventSink {
            file,
            say,
            cluster,
            others: Default::default(),
            batches: Default::default(),
        }
    }

    /// A node's step report, for the observer (a live view of the nodes that are not this
    /// process's): its counters so far, as a progress event that is not printed.
    fn stepped(&mut self, node: NodeId, step: u64, compute_ns: u64, comm_ns: u64) {
        let Some(name) = self.cluster.nodes.get(node.index()).map(|n| n.name.clone()) else {
            return;
        };
        if self.say.observe.is_none() || name == self.say.node {
            // (This process's node says its own figures, from its counters.)
            return;
        }
        let (f, last) = self.others.entry(node).or_default();
        if f.steps_applied > 0 && step <= *last {
            return;
        }
        *last = step;
        f.compute_s += compute_ns as f64 * 1e-9;
        f.comm_s += comm_ns as f64 * 1e-9;
        f.steps_applied += 1;
        f.batch = self.batches.get(&node).copied().unwrap_or(0);
        self.say.observe(&RunEvent::Progress {
            node: name,
            step: step + 1,
            steps: 0,
            loss: None,
            samples_per_s: 0.0,
            own: Some(f.clone()),
        });
    }

    /// Pass on a held-out evaluation (or why one failed).
    pub(super) fn eval(&mut self, r: Result<super::evaluate::Evaluation, String>) {
        use std::io::Write;
        let e = match r {
            Ok(e) => e.event(&self.say.node),
            Err(why) => {
                self.say.cluster(format!("an evaluation failed: {why}"));
                return;
            }
        };
        if let (
            Some(f),
            RunEvent::Eval {
                step,
                loss,
                accuracy,
                samples,
                perplexity,
                ..
            },
        ) = (&mut self.file, &e)
        {
            let eval = json!({"step": step, "loss": loss, "accuracy": accuracy, "samples": samples, "perplexity": perplexity});
            let _ = writeln!(f, "{}", json!({"what": e.human(), "eval": eval}));
        }
        self.say.say(&e);
    }

    /// Pass on an event of the journal (agreed steps are the progress lines' business).
    pub(super) fn note(&mut self, note: &Note) {
        use std::io::Write;
        if let Note::Stepped {
            node,
            step,
            compute_ns,
            comm_ns,
        } = note
        {
            return self.stepped(*node, *step, *compute_ns, *comm_ns);
        }
        let Note::Event(t, e) = note else {
            return;
        };
        learn_member(&mut self.cluster, e);
        if let Event::Planned { workers, .. } = e {
            self.batches = workers.iter().copied().collect();
        }
        let (t_s, what) = (*t as f64 / 1e9, describe(e, &self.cluster));
        if let Some(f) = &mut self.file {
            let mut line = json!({"t_s": t_s, "what": what});
            // The record of who trains which samples from which step (exactly once: each
            // step's ranges tile its global batch; a redone step redoes the same samples).
            if let Event::Planned { step, samples, .. } = e {
                let name = |n: &NodeId| {
                    self.cluster
                        .nodes
                        .get(n.index())
                        .map_or("?", |x| x.name.as_str())
                };
                line["from_step"] = json!(step);
                line["samples"] = samples
                    .iter()
                    .map(|(n, r)| json!([name(n), r.start, r.end]))
                    .collect();
            }
            let _ = writeln!(f, "{line}");
        }
        // A measured ring that changes no plan is a figure for events.jsonl, not a console line
        // every few seconds.
        if matches!(
            e,
            Event::LinksScaled {
                replanned: false,
                ..
            }
        ) {
            return;
        }
        self.say.say(&RunEvent::Cluster {
            node: self.say.node.clone(),
            what,
            t_s: Some(t_s),
            fact: fact_of(e, &self.cluster),
        });
    }
}

/// What a live view classifies `e` as, with names from `cluster`.
fn fact_of(e: &Event, cluster: &ravnest_core::ClusterSpec) -> Option<crate::events::Fact> {
    use crate::events::Fact;
    let name = |n: &NodeId| {
        cluster
            .nodes
            .get(n.index())
            .map_or_else(|| format!("node {}", n.0), |x| x.name.clone())
    };
    Some(match e {
        Event::Planned {
            step,
            workers,
            stages,
            ..
        } => {
            let mut nodes: Vec<String> = workers
                .iter()
                .filter(|w| w.1 > 0)
                .map(|w| name(&w.0))
                .chain(stages.iter().map(|s| name(&s.0)))
                .collect();
            nodes.sort();
            nodes.dedup();
            Fact::Planned { step: *step, nodes }
        }
        Event::Detected { node, .. } => Fact::Lost { node: name(node) },
        Event::Aborted { step } => Fact::Aborted { step: *step },
        Event::Joined { node } => Fact::Joined { node: name(node) },
        Event::Admitted { name, .. } => Fact::Joined { node: name.clone() },
        Event::TookOver { node, from, .. } => Fact::TookOver {
            node: name(node),
            from: name(from),
        },
        Event::CheckpointComplete { step, .. } => Fact::Checkpoint { step: *step },
        _ => return None,
    })
}

/// A node admitted from outside the cluster file (`Event::Admitted`) gets its place in
/// `cluster`, so that events about it name it (ids are given in order, but a later joiner may
/// register first: places before it wait for their names).
pub(super) fn learn_member(cluster: &mut ravnest_core::ClusterSpec, e: &Event) {
    if let Event::Admitted { node, name, .. } = e
        && let Some(like) = cluster.nodes.first().cloned()
    {
        while cluster.nodes.len() <= node.index() {
            cluster.nodes.push(ravnest_core::NodeSpec {
                name: "?".into(),
                ..like.clone()
            });
        }
        cluster.nodes[node.index()].name.clone_from(name);
    }
}

/// The events of a stale term and of a checkpoint not written, in words.
fn describe_split(e: &Event) -> String {
    match e {
        Event::Resync { step, silent_ms } => format!(
            "no step agreed for {:.1} s though every node is alive (a message was lost): step {step} and on redone from what every node holds",
            *silent_ms as f64 / 1e3
        ),
        Event::Waiting { step, why } => {
            format!("{why}: training waits at step {step} for lost nodes to come back")
        }

        Event::Stopping { at, checkpoint } => format!(
            "stopping: the run ends at step {at}{}",
            if *checkpoint {
                ", once the steps in flight finish, with a checkpoint there"
            } else {
                " (no epoch was running)"
            }
        ),
        Event::CutOff { step, why } => {
            format!("this coordinator gives its term up at step {step}: {why}, for three silences")
        }
        Event::CheckpointFailed { step, why } => format!(
            "the checkpoint of step {step} could not be written ({why}); the previous one stays the latest, and training goes on"
        ),
        Event::Superseded { step, newer } => format!(
            "a coordinator of the newer term {newer} writes to the checkpoint folder: {} refused",
            if *step == 0 {
                "restoring from it".to_string()
            } else {
                format!("the checkpoint of step {step}")
            }
        ),
        _ => String::new(),
    }
}

/// A coordinator event in words, with node names.
pub fn describe(e: &Event, cluster: &ravnest_core::ClusterSpec) -> String {
    let name = |n: &NodeId| {
        cluster
            .nodes
            .get(n.index())
            .map_or("?", |x| x.name.as_str())
            .to_string()
    };
    match e {
        Event::Planned {
            step,
            workers,
            stages,
            ..
        } if !stages.is_empty() => format!(
            "step {step}: planned a pipeline of {} stage(s), batch {} in micro-batches: {}",
            stages
                .iter()
                .map(|s| s.1)
                .collect::<std::collections::BTreeSet<_>>()
                .len(),
            workers.first().map_or(0, |w| w.1),
            stages
                .iter()
                .map(|(n, l)| format!("{} layers {l}", name(n)))
                .collect::<Vec<_>>()
                .join(" | ")
        ),
        Event::Planned { step, workers, .. } => format!(
            "step {step}: planned {}",
            workers
                .iter()
                .map(|(n, b)| format!("{}={b}", name(n)))
                .collect::<Vec<_>>()
                .join(" ")
        ),
        Event::Restoring { node, why } => format!(
            "{why}: restoring the lost layers from the latest checkpoint on `{}`; training goes back to it",
            name(node)
        ),
        Event::Detected { node, silent_ms } => {
            format!("node `{}` lost (silent {silent_ms} ms)", name(node))
        }
        Event::Aborted { step } => {
            format!("step {step} aborted; re-planning without the lost node")
        }
        Event::Rebalanced {
            step,
            predicted_gain,
            speeds,
        } => format!(
            "after step {step}: measured speeds predict a {:.0}% faster plan ({}): re-planned",
            100.0 * predicted_gain,
            speeds
                .iter()
                .map(|(n, planned, measured)| format!(
                    "{} {:.0} samples/s, planned {:.0}",
                    name(n),
                    1.0 / measured,
                    1.0 / planned
                ))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        Event::LinksScaled {
            step,
            ring_s,
            ring_nodes,
            scale,
            replanned,
        } => format!(
            "after step {step}: the ring of {ring_nodes} took {} per step: planning on links at {scale:.2}x their bandwidth{}",
            ravnest_core::units::secs(*ring_s),
            if *replanned {
                ": re-planned"
            } else {
                " (the plan stays)"
            }
        ),
        Event::Probation { step, nodes } => {
            let names: Vec<String> = nodes.iter().map(|n| format!("`{}`", name(n))).collect();
            format!(
                "after step {step}: {} left out for measured slowness, tried again at the configured speed (probation; the next try waits twice as long): re-planned",
                names.join(", ")
            )
        }
        Event::Refused(why) => format!("checkpoint shard refused: {why}"),
        Event::Joined { node } => format!("node `{}` joined", name(node)),
        Event::Admitted { name, device, .. } => format!(
            "node `{name}` (not in the cluster file) joins the running cluster: {device}; it gets work at the next epoch"
        ),
        Event::Leaving { node } => format!(
            "node `{}` asked to leave: planned out at the next epoch (no re-plan for a loss)",
            name(node)
        ),
        Event::Left { node } => format!("node `{}` left cleanly", name(node)),
        Event::TookOver {
            node,
            from,
            step,
            term,
        } => format!(
            "`{}` took over as coordinator (term {term}) from `{}`: training goes on from step {step}",
            name(node),
            name(from)
        ),
        Event::CheckpointComplete { step, .. } => format!("checkpoint of step {step} written"),
        Event::Violation(w) => format!("violation: {w}"),
        Event::CutOff { .. }
        | Event::CheckpointFailed { .. }
        | Event::Superseded { .. }
        | Event::Stopping { .. }
        | Event::Resync { .. }
        | Event::Waiting { .. } => describe_split(e),
        Event::Stalled(w) => format!("stalled: {w}"),
        Event::Finished => "finished".into(),
    }
}

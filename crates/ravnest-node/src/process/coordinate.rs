//! The coordinator's host: registrations, link probes, the nodes measured together, the plan on
//! measured figures, then the coordinator and checkpoint actors until training ends, and the
//! coordinator's report.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use ravnest_core::{Link, NodeId, Scenario};
use ravnest_protocol::coordinator::Event;
use ravnest_protocol::coordinator::core::{Config, Tuning};
use ravnest_protocol::msg::Capabilities;
use ravnest_protocol::msg::Replica;
use ravnest_protocol::msg::{Addr, Envelope};
use ravnest_runtime::coordinator::{Note, spawn_leases};
use ravnest_runtime::counters::Counters;
use ravnest_runtime::tcp::TcpTransport;
use ravnest_runtime::{Compute, Launch, Transport};
use tokio::sync::mpsc;
use tokio::time::Instant;

use super::console::{EventSink, Say};
use super::evaluate::Evaluator;
use super::options::{AbortOnDrop, CALIBRATE_MS, Options, RunError};
use super::setup::Setup;
use crate::events::RunEvent;
use crate::summary::CoordinatorReport;

mod report;
use ravnest_protocol::node::values::Values;
use report::coordinator_report;

/// What the coordinator's host works with.
pub(super) struct Host<'a> {
    pub opts: &'a Options,
    pub say: &'a Say,
    pub su: &'a Setup,
    pub tcp: &'a TcpTransport,
    pub counters: &'a Counters,
    pub t0: Instant,
    /// Set while the coordinator runs here: new nodes get their ids from this process.
    pub hosting: Arc<super::admission::Hosted>,
    /// Stop requests (Ctrl-C, SIGTERM, the launcher's): the run ends early, cleanly.
    pub stops: super::stops::Stops,
}

/// Registrations arrive here; so do link reports and measurements.
type Inbox = mpsc::UnboundedReceiver<(Addr, Envelope)>;

/// What the coordinator's host hands back when training is over: the run's figures, the
/// receiver the workers' reports arrive on, and the nodes expected to send one.
pub(super) type Coordinated = (CoordinatorReport, Inbox, Vec<NodeId>);

/// The node's verdicts over the coordinator (fail-over): while this process coordinates, one
/// that follows another host means a newer term took over, and this one steps down.
pub(super) type Verdicts =
    mpsc::UnboundedReceiver<(NodeId, ravnest_protocol::coordinator::succession::Verdict)>;

/// The coordinator's host, from registrations to the end of training.
pub(super) async fn coordinate(
    h: &Host<'_>,
    reg_rx: &mut Inbox,
    verdicts: &mut Verdicts,
) -> Result<Coordinated, RunError> {
    let everyone: Vec<NodeId> = h.opts.scenario.cluster.ids().collect();
    let _leases = leases(h, &everyone, 0);
    let caps = register(h, reg_rx).await?;
    let all: Vec<NodeId> = caps.keys().copied().collect();
    let mut cluster = h.opts.scenario.cluster.clone();
    probe_links(h, reg_rx, &all, &mut cluster).await;
    let solo = measure_together(h, reg_rx, &caps, &mut cluster).await;
    let (text, nodes, sync) = plan_text(h, &cluster, &all, &solo)?;
    h.say.say(&RunEvent::Plan {
        node: h.say.node.clone(),
        text,
        nodes,
        sync,
    });
    let absent = cluster.ids().filter(|id| !caps.contains_key(id)).collect();
    let config = Config {
        start_step: h.su.compute.initial_version(),
        initial_holders: h.opts.resume.then(|| vec![h.su.me]),
        absent,
        ..config(h, &cluster)
    };
    let trained = train(h, config, None, verdicts).await?;
    let report = coordinator_report(h, &cluster, &solo, &trained);
    let members: Vec<NodeId> = caps.keys().copied().collect();
    let (reports_rx, expected) = finish_workers(h, &cluster, &members, &trained.log).await;
    Ok((report, reports_rx, expected))
}

/// Fail-over: the coordinator (hosted by `from`) is lost and this node succeeds it, with the
/// replica `r` of the new term. From the replica's figures (the measured cluster), it halts
/// every member, resumes from the newest version they all hold, and finishes the run as the
/// coordinator's host: checkpoints, the final evaluation, `Finish`, the run's report.
pub(super) async fn take_over(
    h: &Host<'_>,
    r: Replica,
    from: NodeId,
    verdicts: &mut Verdicts,
) -> Result<Option<Coordinated>, RunError> {
    // Nodes given their place by the predecessor that have not registered get the leases too:
    // they follow this host and register here.
    let leased: Vec<NodeId> = r.members.iter().chain(&r.reserved).copied().collect();
    let _leases = leases(h, &leased, r.term);
    let cluster = r.cluster.clone();
    let name = |n: NodeId| {
        cluster
            .nodes
            .get(n.index())
            .map_or("?", |x| x.name.as_str())
    };
    h.say.cluster(format!(
        "the coordinator on `{}` is silent: `{}` takes over (term {}), from the last consistent step",
        name(from),
        name(h.su.me),
        r.term
    ));
    let config = Config {
        start_step: r.agreed,
        ..config(h, &cluster)
    };
    let members = r.members.clone();
    let trained = train(h, config, Some((r, from)), verdicts).await?;
    let report = coordinator_report(h, &cluster, &BTreeMap::new(), &trained);
    let (reports_rx, expected) = finish_workers(h, &cluster, &members, &trained.log).await;
    Ok(Some((report, reports_rx, expected)))
}

/// The coordinator's leases (of `term`): one to each of `nodes` but this one every period, so
/// that workers (idle ones too) know it is there, and one that knows a newer term can tell it
/// to step down; stopped when dropped.
fn leases(h: &Host<'_>, nodes: &[NodeId], term: u32) -> AbortOnDrop {
    let s = &h.opts.scenario;
    AbortOnDrop(spawn_leases(
        h.tcp.clone(),
        nodes.iter().copied().filter(|&id| id != h.su.me).collect(),
        Duration::from_millis(s.run.heartbeat_ms.max(10)),
        (term, h.su.me),
    ))
}

/// What the coordinator of this run is given on `cluster` (the measured figures), hosted here.
fn config(h: &Host<'_>, cluster: &ravnest_core::ClusterSpec) -> Config {
    let (s, su) = (&h.opts.scenario, h.su);
    let base = Config::new(
        cluster.clone(),
        su.compute.net.model_spec(),
        s.training.clone(),
        s.run.steps,
    );
    Config {
        planner: h.opts.planner,
        heartbeat_timeout_ms: s.run.heartbeat_timeout_ms,
        checkpoint_every: s.run.checkpoint_cadence(),
        checkpoint_at_end: true,
        allow_pipeline: su.compute.runs_stages(),
        tuning: Tuning {
            measure_min_batch: measure_min_batch(cluster, base.train_flops),
            ..Tuning::default()
        },
        host: Some(su.me),
        ..base
    }
}

/// The smallest share whose step time is measured: fixed per-step costs dominate the figure
/// of a tiny share, so a share is measured where its samples take at least as long as the
/// step's fixed cost on every node, and from 16 samples whatever they take. (An MLP's sample
/// takes microseconds against milliseconds of fixed cost: 16. A GPT's takes a tenth of a
/// second: 1, so the slow node's share of a few samples is measured too.)
fn measure_min_batch(cluster: &ravnest_core::ClusterSpec, train_flops: f64) -> u64 {
    cluster
        .ids()
        .map(|n| {
            let node = cluster.node(n);
            let per_sample = train_flops / node.flops.max(f64::MIN_POSITIVE);
            (node.step_overhead_s.max(0.0) / per_sample.max(f64::MIN_POSITIVE)).ceil()
        })
        .fold(1.0, f64::max)
        .min(16.0) as u64
}

/// Wait for every node of the file to register (saying what it waits for every few seconds),
/// within the registration window; enough of them must (`[run] min_nodes`).
async fn register(
    h: &Host<'_>,
    reg_rx: &mut Inbox,
) -> Result<BTreeMap<NodeId, Capabilities>, RunError> {
    let (s, opts) = (&h.opts.scenario, h.opts);
    let n = s.cluster.nodes.len();
    let mut caps: BTreeMap<NodeId, Capabilities> = BTreeMap::new();
    let waiting_since = Instant::now();
    let deadline = waiting_since + opts.register_timeout;
    let mut next_word = waiting_since + Duration::from_secs(5);
    while caps.len() < n {
        match tokio::time::timeout_at(deadline.min(next_word), reg_rx.recv()).await {
            Ok(Some((Addr::Node(from), Envelope::Register(c)))) => {
                h.say.cluster(format!(
                    "node `{}` registered: {}",
                    s.cluster.nodes[from.index()].name,
                    c.device
                ));
                caps.insert(from, c);
            }
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(_) if Instant::now() >= deadline => break,
            Err(_) => {
                // Say what we wait for, every few seconds.
                next_word += Duration::from_secs(5);
                let missing = unregistered(s, &caps);
                h.say.waiting(format!(
                    "waiting for {} of {n} nodes to register: {} ({} s of {} s; the window is `[run] register_timeout_s`, or `--wait SECS`)",
                    missing.len(),
                    missing.join(", "),
                    waiting_since.elapsed().as_secs(),
                    opts.register_timeout.as_secs()
                ));
            }
        }
    }
    let need = s.run.min_nodes.unwrap_or(n as u64) as usize;
    if caps.len() < need.max(1) {
        let missing = unregistered(s, &caps);
        return Err(RunError::Registration(format!(
            "{}: {} of {} nodes registered within {} s; missing: {} (start them with `ravnest run FILE --node NAME`; wait longer with `[run] register_timeout_s` or --wait SECS, or allow fewer with [run] min_nodes)",
            opts.origin,
            caps.len(),
            n,
            opts.register_timeout.as_secs(),
            missing.join(", ")
        )));
    }
    for id in s.cluster.ids().filter(|id| !caps.contains_key(id)) {
        h.say.cluster(format!(
            "node `{}` did not register: left out until it joins",
            s.cluster.nodes[id.index()].name
        ));
    }
    Ok(caps)
}

/// Link probes: every node (this one too) echo-probes the peers after it and reports, so each
/// pair is measured once, by the same code everywhere. A node's access link, as the plan shows
/// it, is its measured link to this host.
async fn probe_links(
    h: &Host<'_>,
    reg_rx: &mut Inbox,
    all: &[NodeId],
    cluster: &mut ravnest_core::ClusterSpec,
) {
    let mut asked = 0;
    for (k, &id) in all.iter().enumerate() {
        let peers = all[k + 1..].to_vec();
        if peers.is_empty() {
            continue;
        }
        asked += 1;
        let _ = h.tcp.send(
            Addr::Coordinator,
            Addr::Node(id),
            Envelope::ProbePeers { peers },
        );
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while asked > 0 {
        match tokio::time::timeout_at(deadline, reg_rx.recv()).await {
            Ok(Some((Addr::Node(from), Envelope::LinkReport { links }))) => {
                asked -= 1;
                for (peer, latency_ms, bandwidth_gbps) in links {
                    let link = Link {
                        bandwidth_gbps,
                        latency_ms,
                    };
                    cluster
                        .pair_links
                        .insert((from.min(peer), from.max(peer)), link);
                }
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    let me = h.su.me;
    for &id in all {
        if let Some(l) = cluster.pair_links.get(&(me.min(id), me.max(id))) {
            cluster.nodes[id.index()].link = *l;
        }
    }
    let links: Vec<crate::events::LinkRow> = cluster
        .pair_links
        .iter()
        .map(|((a, b), l)| crate::events::LinkRow {
            a: cluster.nodes[a.index()].name.clone(),
            b: cluster.nodes[b.index()].name.clone(),
            latency_ms: l.latency_ms,
            gbit_s: l.bandwidth_gbps,
        })
        .collect();
    let pairs = links
        .iter()
        .map(|l| {
            format!(
                "{}-{} {:.2} ms {:.1} Gbit/s",
                l.a, l.b, l.latency_ms, l.gbit_s
            )
        })
        .collect();
    h.say.say(&RunEvent::Links {
        node: h.say.node.clone(),
        pairs,
        links,
    });
}

/// Every node measures its training throughput at the same time, at about the batch it will
/// get: the figures include the contention that real steps see (on a shared machine, a node
/// measured alone looks faster than it will be), and their sum is the capacity the run is
/// measured against. The cluster gets the registered and measured figures.
async fn measure_together(
    h: &Host<'_>,
    reg_rx: &mut Inbox,
    caps: &BTreeMap<NodeId, Capabilities>,
    cluster: &mut ravnest_core::ClusterSpec,
) -> BTreeMap<NodeId, Calibration> {
    let model_spec = h.su.compute.net.model_spec();
    for (id, c) in caps {
        let node = &mut cluster.nodes[id.index()];
        node.flops = c.flops;
        node.memory_bytes = c.memory_bytes;
    }
    let all: Vec<NodeId> = caps.keys().copied().collect();
    let solo = calibrate(&h.opts.scenario, reg_rx, h.tcp, &all).await;
    for (id, m) in &solo {
        let node = &mut cluster.nodes[id.index()];
        node.flops = model_spec.train_flops_per_sample() / m.per_sample_s;
        node.step_overhead_s = m.overhead_s;
    }
    let figures: Vec<String> = solo
        .iter()
        .map(|(id, m)| {
            format!(
                "{} {:.0} samples/s ({:.2} ms per step + {:.1} us per sample)",
                cluster.nodes[id.index()].name,
                m.samples_per_s,
                m.overhead_s * 1e3,
                m.per_sample_s * 1e6
            )
        })
        .collect();
    h.say
        .cluster(format!("measured together: {}", figures.join(", ")));
    solo
}

/// The plan the coordinator will make, as the console shows it (the same policy,
/// `ravnest_core::policy`), or why there is none.
fn plan_text(
    h: &Host<'_>,
    cluster: &ravnest_core::ClusterSpec,
    registered: &[NodeId],
    solo: &BTreeMap<NodeId, Calibration>,
) -> Result<(String, Vec<crate::events::PlanRow>, String), RunError> {
    let (opts, su) = (h.opts, h.su);
    let model_spec = su.compute.net.model_spec();
    let training = &opts.scenario.training;
    let live = cluster.subset(registered);
    // The coordinator's policy, with this backend's stages.
    let planned = ravnest_core::policy(
        opts.planner,
        &live,
        &model_spec,
        training,
        su.compute.runs_stages(),
    );
    let p = match planned {
        Ok(p) => p,
        Err(e) if !su.compute.runs_stages() => {
            return Err(RunError::NoPlan(format!(
                "{}: no data-parallel plan for the registered nodes ({e}); the candle backend does not run pipeline stages yet",
                opts.origin
            )));
        }
        Err(e) => {
            return Err(RunError::NoPlan(format!(
                "{}: no plan for the registered nodes: {e}",
                opts.origin
            )));
        }
    };
    let mut lines = Vec::new();
    let mut rows = Vec::new();
    for pn in &p.nodes {
        let id = registered[pn.id.index()];
        let node = &cluster.nodes[id.index()];
        let layers = pn.layers.filter(|l| l.len() < model_spec.layers.len());
        let stage = match layers {
            Some(l) => format!(
                "   stage layers {l} ({})",
                model_spec.layers[l.range()]
                    .iter()
                    .map(|x| x.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            None => String::new(),
        };
        // The figure `measured together` printed, the same in the report's table.
        let measured = solo.get(&id).map_or(0.0, |m| m.samples_per_s);
        lines.push(format!(
            "  {:<10} batch {:>4}   measured {:>8.0} samples/s   link {:.2} ms, {:.1} Gbit/s{stage}",
            node.name,
            pn.batch,
            measured,
            node.link.latency_ms,
            node.link.bandwidth_gbps
        ));
        rows.push(crate::events::PlanRow {
            node: node.name.clone(),
            batch: pn.batch,
            measured_samples_per_s: measured,
            latency_ms: node.link.latency_ms,
            gbit_s: node.link.bandwidth_gbps,
            layers: layers.map(|l| (l.range().start, l.range().end)),
        });
    }
    lines.push(format!("  sync: {}", p.sync.reason));
    Ok((lines.join("\n"), rows, p.sync.reason.clone()))
}

/// What training left behind, for the report.
pub(super) struct Trained {
    log: ravnest_runtime::coordinator::RunLog,
    /// The run's last version: `[run] steps`, or where a stop request ended it.
    end: u64,
    /// A stop request ended the run early.
    stopped: bool,
    start_step: u64,
    train_s: f64,
    events_path: std::path::PathBuf,
    /// The held-out evaluations during the run.
    evaluations: Vec<super::evaluate::Evaluation>,
}

/// The coordinator and checkpoint actors, until the run has finished and its final checkpoint
/// is written (or 15 s have passed); their events go to the console and `events.jsonl` as they
/// happen.
async fn train(
    h: &Host<'_>,
    config: Config,
    succeeds: Option<(Replica, NodeId)>,
    verdicts: &mut Verdicts,
) -> Result<Trained, RunError> {
    let (s, su) = (&h.opts.scenario, h.su);
    let start_step = config.start_step;
    let cluster = config.cluster.clone();
    let term = succeeds.as_ref().map_or(0, |(r, _)| r.term);
    // The checkpoint actor is of this coordinator's term: a successor's fence (raised to its
    // term) must not silence its own checkpoints' events.
    let launch = Launch::new(h.tcp.clone()).at(h.t0).hosted(su.me, term);
    let journal = launch.journal();
    let mut notes = journal.subscribe();
    let files = ravnest_train::store::CheckpointFiles {
        term,
        ..su.files.clone()
    };
    let files = Arc::new(files);
    let ck = launch.checkpoints(files.clone(), 4).await?;
    // A shared checkpoint folder also tells a stale coordinator of a newer term (one that
    // waits, cut off, or whose successor finished while it was frozen, hears from no node).
    let mut look = tokio::time::interval(Duration::from_secs(1));
    let train_started = Instant::now();
    let tick = Duration::from_millis(s.run.heartbeat_ms / 2 + 1);
    // A successor appends to the events its predecessor wrote.
    let append = h.opts.resume || succeeds.is_some();
    let (coord, mut done) = match succeeds {
        None => launch.coordinator(config, tick).await?,
        Some((r, from)) => launch.successor(config, r, from, tick).await?,
    };
    let _hosting = super::admission::Hosting::start(&h.hosting);
    // Relay the coordinator's events as they happen, to the console and to `events.jsonl`.
    let events_path = h.opts.out_dir.join("events.jsonl");
    let mut sink = EventSink::open(&events_path, append, start_step, h.say.clone(), cluster);
    let mut evals = Evaluator::new(
        s.run.eval_every_steps,
        files.clone(),
        Arc::new(su.test.clone()),
    );
    // Nodes not in the cluster file get the leases too once admitted (an idle one would
    // otherwise take the coordinator's silence for its loss).
    let mut joined_leases = Vec::new();
    let mut stops = h.stops.clone();
    stops.enter(super::stops::Phase::Training);
    stops.clear_on_exit(files.dir.join(".parts"));
    loop {
        tokio::select! {
            _ = stops.requested() => {
                let _ = coord.cast(ravnest_runtime::coordinator::CoordMsg::Stop);
                h.say.cluster(
                    "stop requested (Ctrl-C or SIGTERM): the run ends once the steps in flight finish, with a checkpoint there (Ctrl-C again to stop at once)",
                );
            }
            r = evals.next() => sink.eval(r),
            Some(n) = notes.recv() => {
                evals.note(&n);
                sink.note(&n);
                if matches!(n, Note::Agreed { .. }) {
                    h.hosting.beat();
                }
                if let Note::Event(_, Event::Admitted { node, .. }) = n {
                    joined_leases.push(leases(h, &[node], term));
                }
                if let Note::Event(_, Event::Superseded { newer, .. }) = n {
                    // The folder says a newer term took over (before any node could say so).
                    coord.stop(None);
                    ck.stop(None);
                    return Err(step_down(h, term, newer, None));
                }
            }
            _ = &mut done => break,
            _ = look.tick() => {
                if let Some(newer) = ravnest_runtime::checkpoint::Store::superseded(&*files) {
                    coord.stop(None);
                    ck.stop(None);
                    return Err(step_down(h, term, newer, None));
                }
            }
            Some((_, v)) = verdicts.recv() => {
                if let ravnest_protocol::coordinator::succession::Verdict::Follow(next) = v {
                    // A newer term took over while this process was cut off or frozen: stop
                    // at once (no more work, grants or checkpoint rounds from this term).
                    coord.stop(None);
                    ck.stop(None);
                    return Err(step_down(h, term, term + 1, Some(next)));
                }
            }
        }
    }
    let train_s = train_started.elapsed().as_secs_f64();
    // A stop request ends the run early, at the version it chose.
    let stopped_at = |log: &ravnest_runtime::coordinator::RunLog| {
        log.events.iter().find_map(|(_, e)| match e {
            Event::Stopping { at, .. } => Some(*at),
            _ => None,
        })
    };
    let end = stopped_at(&journal.snapshot()).unwrap_or(s.run.steps);
    drain(end, &mut notes, &mut sink, &mut evals).await;
    coord.stop(None);
    ck.stop(None);
    // Parts of rounds that never completed are of no use now.
    files.clear_parts();
    let log = journal.snapshot();
    how_it_ended(h, term, &files, &log, end)?;
    Ok(Trained {
        stopped: stopped_at(&log).is_some(),
        end,
        log,
        start_step,
        train_s,
        events_path,
        evaluations: evals.done,
    })
}

/// After the last step: the final checkpoint's shards may still be on their way (15 s at
/// most), and the evaluations of the last checkpoints may still run (2 min at most).
async fn drain(
    steps: u64,
    notes: &mut tokio::sync::mpsc::UnboundedReceiver<Note>,
    sink: &mut EventSink,
    evals: &mut Evaluator,
) {
    let is_final = |n: &Note| matches!(n, Note::Event(_, Event::CheckpointComplete { step, .. }) if *step == steps);
    let deadline = Instant::now() + Duration::from_secs(15);
    while let Ok(Some(n)) = tokio::time::timeout_at(deadline, notes.recv()).await {
        evals.note(&n);
        sink.note(&n);
        if is_final(&n) {
            break;
        }
    }
    while let Ok(n) = notes.try_recv() {
        evals.note(&n);
        sink.note(&n);
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while evals.busy() {
        match tokio::time::timeout_at(deadline, evals.next()).await {
            Ok(r) => sink.eval(r),
            Err(_) => break,
        }
    }
}

/// How the coordinator's run ended, from its events: an error when it stalled or failed, or
/// when this process must step down (a newer term, or cut off after taking over).
fn how_it_ended(
    h: &Host<'_>,
    term: u32,
    files: &ravnest_train::store::CheckpointFiles,
    log: &ravnest_runtime::coordinator::RunLog,
    end: u64,
) -> Result<(), RunError> {
    for (_, e) in &log.events {
        match e {
            Event::Stalled(why) | Event::Violation(why) => {
                // Stalled, but a newer term wrote to the folder meanwhile: this one was stale.
                if let Some(newer) = ravnest_runtime::checkpoint::Store::superseded(files) {
                    return Err(step_down(h, term, newer, None));
                }
                return Err(RunError::Stopped(why.clone()));
            }
            // Its last checkpoint refused: a newer term wrote to the folder meanwhile.
            Event::Superseded { newer, .. } => return Err(step_down(h, term, *newer, None)),
            // It took over cut off from most members and could not reach them: it leaves.
            Event::CutOff { step, why } => {
                let why = format!(
                    "stepping down: this node took over as coordinator (term {term}) while cut off from most of the members, and could not reach them ({why}); it leaves the run at step {step}, which goes on under the coordinator it replaced if that one lives"
                );
                h.say.cluster(why.clone());
                return Err(RunError::SteppedDown(why));
            }
            // An earlier one is said and passed over; the run's final model must be on disk.
            Event::CheckpointFailed { step, why } if *step == end => {
                return Err(RunError::Stopped(format!(
                    "the final checkpoint (step {step}) could not be written: {why}"
                )));
            }
            _ => {}
        }
    }
    Ok(())
}

/// This process coordinated term `term` and learned of a newer one (`newer`, hosted by `next`
/// when a node said so; the checkpoint folder says only the term): what it says, and the error
/// that ends it (the launcher counts it as a lost node, not a failure).
fn step_down(h: &Host<'_>, term: u32, newer: u32, next: Option<NodeId>) -> RunError {
    let nodes = &h.opts.scenario.cluster.nodes;
    let (who, at) = match next.and_then(|n| nodes.get(n.index())) {
        Some(n) => (
            format!("`{}`", n.name),
            n.address.clone().unwrap_or_else(|| "HOST:PORT".into()),
        ),
        None => ("another node".to_string(), "HOST:PORT".to_string()),
    };
    let why = format!(
        "stepping down: this node coordinated term {term}, and {who} took over (term {newer}) while this process was cut off or frozen past the failure timeout; it writes no more checkpoints and leaves the run, which goes on without it (`ravnest run --join {at} --node {}` brings it back as a worker)",
        nodes[h.su.me.index()].name,
    );
    h.say.cluster(why.clone());
    // Joiners that come here are sent on (`STEPPED_DOWN_LINGER`): to the successor, or when
    // this process does not know it, to the first other node, which knows.
    let me = h.su.me;
    let to = next.or_else(|| (0..nodes.len() as u32).map(NodeId).find(|&n| n != me));
    if let Some(to) = to {
        ravnest_runtime::Transport::set_coordinator(h.tcp, to);
    }
    RunError::SteppedDown(why)
}

/// Tell every worker that training finished; the nodes still in the run will report back on
/// the returned receiver.
async fn finish_workers(
    h: &Host<'_>,
    cluster: &ravnest_core::ClusterSpec,
    members: &[NodeId],
    log: &ravnest_runtime::coordinator::RunLog,
) -> (Inbox, Vec<NodeId>) {
    let mut expected: BTreeSet<NodeId> = members.iter().copied().collect();
    for (_, e) in &log.events {
        match e {
            Event::Detected { node, .. } => {
                expected.remove(node);
            }
            Event::Joined { node } => {
                expected.insert(*node);
            }
            _ => {}
        }
    }
    expected.remove(&h.su.me);
    let (reports_tx, reports_rx) = mpsc::unbounded_channel();
    h.tcp.register(
        Addr::Coordinator,
        Arc::new(move |from, env| {
            let _ = reports_tx.send((from, env));
        }),
    );
    // Every node but a lost coordinator's host (fail-over): a node that is still dialing in
    // must be told too.
    let joined: Vec<NodeId> = log
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::Admitted { node, .. } => Some(*node),
            _ => None,
        })
        .collect();
    let lost_hosts: BTreeSet<NodeId> = log
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::TookOver { from, .. } => Some(*from),
            _ => None,
        })
        .collect();
    for id in cluster
        .ids()
        .chain(joined)
        .filter(|id| *id != h.su.me && !lost_hosts.contains(id))
    {
        let _ = h
            .tcp
            .send(Addr::Coordinator, Addr::Node(id), Envelope::Finish);
    }
    // Lost nodes (and a lost coordinator's host) will not acknowledge what is queued for them.
    for (_, e) in &log.events {
        match e {
            Event::Detected { node, .. } if !expected.contains(node) => h.tcp.forget(*node),
            Event::TookOver { from, .. } => h.tcp.forget(*from),
            _ => {}
        }
    }
    // `Finish` must reach every worker before this process exits (a node that is still
    // dialing in, such as a rejoiner, would otherwise wait for it in vain).
    if !h.tcp.drain(Duration::from_secs(5)).await {
        h.say
            .cluster("some nodes could not be told that training finished");
    }
    (reports_rx, expected.into_iter().collect())
}

/// The nodes of the file that have not registered, as "`name` (address)".
fn unregistered(s: &Scenario, caps: &BTreeMap<NodeId, Capabilities>) -> Vec<String> {
    s.cluster
        .ids()
        .filter(|id| !caps.contains_key(id))
        .map(|id| {
            let node = &s.cluster.nodes[id.index()];
            format!(
                "`{}` ({})",
                node.name,
                node.address.as_deref().unwrap_or("no address")
            )
        })
        .collect()
}

/// A node's step time, measured with every node measuring at once.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Calibration {
    /// At the batch asked for.
    samples_per_s: f64,
    per_sample_s: f64,
    overhead_s: f64,
}

/// How many times slower than the first node to answer a node may measure and still be
/// waited for (a node slower still gets no batch worth its link anyway).
const SLOWEST: u32 = 10;

/// Ask every registered node to measure its step time at once; the answers that came within
/// the time allowed.
async fn calibrate(
    s: &Scenario,
    reg_rx: &mut mpsc::UnboundedReceiver<(Addr, Envelope)>,
    tcp: &TcpTransport,
    nodes: &[NodeId],
) -> BTreeMap<NodeId, Calibration> {
    let batch = (u64::from(s.training.global_batch) / nodes.len().max(1) as u64).max(1);
    for &id in nodes {
        let _ = tcp.send(
            Addr::Coordinator,
            Addr::Node(id),
            Envelope::Measure {
                batch,
                duration_ms: CALIBRATE_MS,
            },
        );
    }
    let mut got = BTreeMap::new();
    let start = Instant::now();
    let mut deadline = start + Duration::from_millis(CALIBRATE_MS) + Duration::from_secs(20);
    while got.len() < nodes.len() {
        match tokio::time::timeout_at(deadline, reg_rx.recv()).await {
            Ok(Some((
                Addr::Node(from),
                Envelope::Measured {
                    samples_per_s,
                    per_sample_s,
                    overhead_s,
                },
            ))) if [samples_per_s, per_sample_s]
                .iter()
                .all(|x| x.is_finite() && *x > 0.0)
                && overhead_s.is_finite()
                && overhead_s >= 0.0 =>
            {
                // A node measures a few whole steps whatever the time allowed: a model that
                // takes seconds per step takes that many seconds, on a slower node that many
                // times more. The others are waited for as long as a node `SLOWEST` times
                // slower than the first to answer would take.
                if got.is_empty() {
                    deadline = deadline.max(Instant::now() + start.elapsed() * SLOWEST);
                }
                got.insert(
                    from,
                    Calibration {
                        samples_per_s,
                        per_sample_s,
                        overhead_s,
                    },
                );
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    got
}

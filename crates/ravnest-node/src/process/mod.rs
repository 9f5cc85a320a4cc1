//! One node process of `ravnest run`: the same code on every machine.
//!
//! Every process binds its node's address, measures itself (candle matmul throughput, the
//! model's own samples/s, free memory) and starts its node actor. The coordinator's host (the
//! configured coordinator, else the lowest id) collects the registrations, probes each link
//! (latency and bandwidth by echo), plans on the measured figures, prints the plan, and starts
//! the coordinator and checkpoint actors: the very actors the simulator runs, over TCP and with
//! candle instead of SimNet and virtual time.
//!
//! Output is one event per line: human text on stderr, or JSON on stdout with `--json` (what
//! the local demo's parent reads).

mod admission;
mod console;
mod coordinate;
mod data;
mod evaluate;
mod gather;
mod options;
mod setup;
mod stops;
mod tap;
mod worker;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use ravnest_core::{NodeId, Scenario};
use ravnest_protocol::coordinator::succession::Verdict;
use ravnest_protocol::msg::{Addr, Envelope};
use ravnest_runtime::counters::Counters;
use ravnest_runtime::node::Start;
use ravnest_runtime::succession::Succession;
use ravnest_runtime::tcp::{PROTOCOL_VERSION, TcpConfig, TcpTransport};
use ravnest_runtime::{Launch, Nodes, Transport};
use serde_json::{Value, json};

use crate::discover::Announcer;
use crate::events::RunEvent;
use crate::summary::{CoordinatorReport, NodeReport, RunReport, STEADY_STEPS_MAX, Slowdown};
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use console::{Progress, Say, spawn_progress};
use coordinate::{Host, coordinate};
use setup::Setup;
use tap::Tap;

pub use console::describe;
pub use data::{describe_data, load_dataset, train_and_test};
use options::coordinator_of;
pub use options::{CALIBRATE_MS, Options, RunError, STEPPED_DOWN_EXIT, warmup_steps};
pub use setup::{network_for, network_for_file, optim_for, precision_line};
pub use stops::{INTERRUPTED_EXIT, STOPPED_EXIT};

/// The environment variable through which the local launcher tells its children its pid.
pub const LAUNCHER_PID: &str = "RAVNEST_LAUNCHER_PID";

/// A node process started by the local launcher dies with it (a parent-death signal, so that
/// `kill -9` of the launcher leaves no node training on its own); if the launcher is already
/// gone, this process exits now.
pub fn die_with_launcher(launcher: u32) {
    #[cfg(target_os = "linux")]
    {
        use rustix::process::{Signal, getppid, set_parent_process_death_signal};
        let _ = set_parent_process_death_signal(Some(Signal::KILL));
        if getppid().map(|p| p.as_raw_nonzero().get() as u32) != Some(launcher) {
            std::process::exit(3);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = launcher;
}

/// What a node hands a joiner: the cluster file's text and the command-line overrides.
pub fn share_document(origin: &str, text: &str, steps: u64) -> String {
    json!({"origin": origin, "text": text, "steps": steps}).to_string()
}

/// The cluster file's section for a node that joined a running cluster (appended to the text
/// a joiner is handed, so that every process numbers the nodes alike: the file's, then the
/// joined ones in order).
pub fn member_section(name: &str, device: &str, address: &str) -> String {
    format!("\n[[node]]\nname = {name:?}\ndevice = {device:?}\naddress = {address:?}\n")
}

/// A [`share_document`] handed to the new node `name`, which the coordinator's host just gave
/// its place in the file (so the joiner knows that it is new, not a restarted node).
pub fn newcomer_document(origin: &str, text: &str, steps: u64, name: &str) -> String {
    json!({"origin": origin, "text": text, "steps": steps, "newcomer": name}).to_string()
}

/// Whether a [`share_document`] was handed to `name` as a new node ([`newcomer_document`]).
pub fn is_newcomer_document(doc: &str, name: &str) -> bool {
    serde_json::from_str::<Value>(doc).is_ok_and(|v| v["newcomer"].as_str() == Some(name))
}

/// `doc` (a [`share_document`]) saying that node `host`'s process hosts the coordinator now,
/// as the node that hands it out knows: a joiner registers there, not with the file's
/// coordinator, which a fail-over may have replaced.
pub fn with_coordinator(doc: String, host: NodeId) -> String {
    match serde_json::from_str::<Value>(&doc) {
        Ok(mut v) => {
            v["coordinator"] = json!(host.0);
            v.to_string()
        }
        Err(_) => doc,
    }
}

/// The coordinator's host a [`share_document`] names ([`with_coordinator`]), if it does.
pub fn share_coordinator(doc: &str) -> Option<NodeId> {
    let v = serde_json::from_str::<Value>(doc).ok()?;
    Some(NodeId(u32::try_from(v["coordinator"].as_u64()?).ok()?))
}

/// How long a coordinator's host that stepped down still answers joiners (sending them to its
/// successor) before its process ends.
const STEPPED_DOWN_LINGER: std::time::Duration = std::time::Duration::from_secs(3);

/// A coordinator's host that stepped down stops its node and waits [`STEPPED_DOWN_LINGER`]: a
/// joiner that knew only this address is sent on to the successor meanwhile, instead of finding
/// no one here.
async fn linger(sup: &ractor::ActorRef<ravnest_runtime::supervisor::SupMsg>) {
    sup.stop(None);
    tokio::time::sleep(STEPPED_DOWN_LINGER).await;
}

/// Read a [`share_document`]: (origin, text, steps).
pub fn read_share_document(doc: &str) -> Result<(String, String, u64), RunError> {
    let v: Value = serde_json::from_str(doc)
        .map_err(|e| RunError::Config(format!("the shared cluster file is not JSON: {e}")))?;
    match (
        v["origin"].as_str(),
        v["text"].as_str(),
        v["steps"].as_u64(),
    ) {
        (Some(o), Some(t), Some(n)) => Ok((o.to_string(), t.to_string(), n)),
        _ => Err(RunError::Config(
            "the shared cluster file lacks origin, text or steps".into(),
        )),
    }
}

/// The handshake key of a cluster file without `[cluster] secret`.
pub const DEFAULT_SECRET: &str = "ravnest-default-secret";

/// The environment variable that holds the cluster secret (it takes precedence over the
/// file's `[cluster] secret`, so a file shared between machines need not hold it).
pub const SECRET_ENV: &str = "RAVNEST_SECRET";

/// The cluster secret: `RAVNEST_SECRET`, else the file's, else the default.
pub fn secret(s: &Scenario) -> String {
    std::env::var(SECRET_ENV)
        .ok()
        .filter(|v| !v.is_empty())
        .or_else(|| s.run.secret.clone())
        .unwrap_or_else(|| DEFAULT_SECRET.into())
}

/// `host:port` resolved, or a message that names the node and the address.
fn resolve(origin: &str, node: &str, what: &str, a: &str) -> Result<SocketAddr, RunError> {
    std::net::ToSocketAddrs::to_socket_addrs(a)
        .ok()
        .and_then(|mut it| it.next())
        .ok_or_else(|| {
            RunError::Config(format!(
                "{origin}: node `{node}`: cannot resolve {what}`{a}`"
            ))
        })
}

/// The TCP view of a scenario for node `me`, or why `run` cannot use it.
pub fn tcp_config(s: &Scenario, origin: &str, me: NodeId) -> Result<TcpConfig, RunError> {
    let mut peers = BTreeMap::new();
    for (i, n) in s.cluster.nodes.iter().enumerate() {
        let a = n.address.as_deref().ok_or_else(|| {
            RunError::Config(format!(
                "{origin}: node `{}` has no `address`; `ravnest run` needs host:port for every node",
                n.name
            ))
        })?;
        peers.insert(NodeId(i as u32), resolve(origin, &n.name, "address ", a)?);
    }
    let node = &s.cluster.nodes[me.index()];
    let listen = match node.listen.as_deref() {
        None => None,
        Some(l) => Some(resolve(origin, &node.name, "listen address ", l)?),
    };
    Ok(TcpConfig {
        me,
        peers,
        listen,
        coordinator: coordinator_of(s),
        secret: secret(s).into_bytes(),
        max_frame: ravnest_runtime::wire::MAX_FRAME,
        connect_window: Duration::from_secs(30),
        cluster_file: None,
        encrypt: true,
    })
}

/// Run one node process to the end of training. Returns its report.
pub fn run(opts: Options) -> Result<NodeReport, RunError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run_async(opts))
}

async fn run_async(opts: Options) -> Result<NodeReport, RunError> {
    let mut stops = stops::Stops::install(std::env::var_os(LAUNCHER_PID).is_some())?;
    let say = Say {
        json: opts.json,
        quiet: opts.quiet,
        node: opts.node.clone(),
        observe: opts.observe.clone(),
    };
    let started = Instant::now();
    let (tcp, is_coord) = open_port(&opts).await?;
    let mut reg_rx = registrations(&tcp, is_coord);
    // A worker's coordinator must be reachable within the registration window, counted from
    // this process's start (`--wait` bounds the whole start-up, measuring included).
    let _reach = (!is_coord && !opts.join).then(|| reach_coordinator(&opts, started));
    let su = setup::setup(&opts, &say).await?;
    // Found by `run --discover` while this process runs: dropped on every way out of this
    // function, which says goodbye.
    let _announcer = announce(&opts, &say, tcp.local_addr());
    let t0 = Instant::now();
    let (summary_tx, summary_rx) = mpsc::unbounded_channel();
    let net = Tap {
        inner: tcp.clone(),
        finish: Arc::new(Notify::new()),
        heard: Arc::new(AtomicU64::new(u64::MAX)),
        t0,
        started: su.compute.started.clone(),
        summary: summary_tx,
        armed: Arc::default(),
        share: Arc::new(std::sync::Mutex::new(
            opts.share
                .as_deref()
                .and_then(|d| read_share_document(d).ok()),
        )),
    };
    let silence_ms = (3 * opts.scenario.run.heartbeat_timeout_ms).max(1000);
    let hosting = admission::Admission::install(&net.share, &tcp, su.me, silence_ms);
    let counters = Counters::default();
    let (verdict_tx, mut verdicts) = mpsc::unbounded_channel();
    let sup = start_node(&opts, &su, &net, &counters, t0, verdict_tx).await?;
    let progress = spawn_progress(say.clone(), progress_of(&opts, &su, &net, &counters));
    let host = Host {
        opts: &opts,
        say: &say,
        su: &su,
        tcp: &tcp,
        counters: &counters,
        t0,
        hosting,
        stops: stops.clone(),
    };
    let role = if is_coord {
        coordinate(&host, &mut reg_rx, &mut verdicts)
            .await
            .map(Some)
    } else {
        match worker::wait_for_finish(&host, &net, &mut verdicts, &mut stops).await {
            Ok(worker::Ending::Finished) => Ok(None),
            Ok(worker::Ending::Left) => {
                progress.abort();
                console::say_losses(&say, &su.compute, &counters);
                sup.stop(None);
                return Ok(leave(&host).await);
            }
            Ok(worker::Ending::TakeOver(r, from)) => {
                coordinate::take_over(&host, r, from, &mut verdicts).await
            }
            Err(e) => Err(e),
        }
    };
    progress.abort();
    console::say_losses(&say, &su.compute, &counters);
    if matches!(role, Err(RunError::SteppedDown(_))) {
        linger(&sup).await;
    }
    let role = role.inspect_err(|_| {
        sup.stop(None);
        tcp.shutdown();
    })?;
    let (figures, collect) = match role {
        Some((figures, reports, expected)) => (Some(figures), Some((reports, expected))),
        None => (None, None),
    };
    let mut report = node_report(figures, &opts, &su, &counters, &tcp, t0);
    // One report for the run, the same on every node: the coordinator's host collects every
    // worker's report and sends the whole back; each prints it. The steady steps go to the
    // coordinator's host only (its profile is fitted from them): printed, every step of a
    // long run would make one enormous line.
    let wire_report = NodeReport {
        spans: Vec::new(),
        ..report.clone()
    };
    report.steady_steps = Vec::new();
    let summary = match collect {
        Some((reports, expected)) => {
            let merged = gather::collect(&opts, &su, &tcp, wire_report, reports, expected).await;
            // The coordinator's host reports after the profile is written, with its path.
            if let (Some(c), Some(m)) = (
                report.coordinator.as_mut(),
                merged
                    .coordinator
                    .as_ref()
                    .and_then(|h| h.coordinator.as_ref()),
            ) {
                c.profile_file.clone_from(&m.profile_file);
            }
            say.say(&RunEvent::Report(report.clone()));
            Some(merged)
        }
        None => {
            say.say(&RunEvent::Report(report.clone()));
            gather::fetch(&su, &net, wire_report, summary_rx).await
        }
    };
    if let Some(m) = &summary {
        print_summary(&opts, m);
    }
    sup.stop(None);
    tcp.shutdown();
    Ok(report)
}

/// This node's port, opened first: a wrong address or a port in use is said before minutes of
/// loading and measuring, and peers can connect while this node measures itself. Also whether
/// this node hosts the coordinator.
async fn open_port(opts: &Options) -> Result<(TcpTransport, bool), RunError> {
    let s = &opts.scenario;
    let me = setup::whoami(opts)?;
    let mut cfg = tcp_config(s, &opts.origin, me)?;
    cfg.cluster_file = opts.share.as_deref().map(Arc::from);
    let verbose = (!opts.json && !opts.quiet) || std::env::var_os("RAVNEST_LOG_NET").is_some();
    let tcp = if s.run.p2p {
        p2p_port(opts, cfg, verbose).await?
    } else {
        TcpTransport::bind(cfg, verbose).await?
    };
    Ok((tcp, me == coordinator_of(s)))
}

/// The transport over libp2p (`[cluster] relays`, `transport = "p2p"`): listen, reserve a
/// slot on every relay (a node behind a NAT is dialled through it), then the same sessions as
/// over TCP. A relay that gives no reservation in time is named, and the run goes on (peers
/// that can dial this node directly still do).
async fn p2p_port(opts: &Options, cfg: TcpConfig, verbose: bool) -> Result<TcpTransport, RunError> {
    use ravnest_runtime::p2p::{P2pConfig, P2pNet, relay_addr};
    let s = &opts.scenario;
    let mut relays = Vec::new();
    for r in &s.run.relays {
        relays.push(
            relay_addr(r).map_err(|e| {
                RunError::Config(format!("{}: `[cluster] relays`: {e}", opts.origin))
            })?,
        );
    }
    let listen = cfg.listen.unwrap_or(cfg.peers[&cfg.me]);
    let net = P2pNet::start(P2pConfig {
        me: cfg.me,
        secret: cfg.secret.clone(),
        listen,
        relays: relays.clone(),
        peers: cfg.peers.clone(),
    })
    .await
    .map_err(|e| RunError::Config(format!("node `{}`: {e}", opts.node)))?;
    for r in net.reserved(Duration::from_secs(10)).await {
        eprintln!(
            "warning: node `{}`: relay {r} gave no reservation within 10 s; peers that cannot \
             dial this node directly cannot reach it through that relay",
            opts.node
        );
    }
    if cfg.me == coordinator_of(s) && !opts.quiet {
        for r in &relays {
            let t = ravnest_runtime::p2p::ticket(r, &cfg.secret, cfg.me);
            eprintln!(
                "join through the relay: RAVNEST_SECRET=... ravnest run --join {t} --node NAME"
            );
        }
    }
    Ok(TcpTransport::over_p2p(cfg, net, listen, verbose))
}

/// Until the coordinator's address accepts a connection: past the registration window from
/// `started`, the process ends with an error that names the address (a typo in it, a
/// coordinator not started, a firewall). Stopped when dropped. Not over libp2p: there the
/// coordinator may be behind a NAT, and the transport says when it cannot be reached.
fn reach_coordinator(opts: &Options, started: Instant) -> options::AbortOnDrop {
    let s = &opts.scenario;
    if s.run.p2p {
        return options::AbortOnDrop(tokio::spawn(async {}));
    }
    let c = &s.cluster.nodes[coordinator_of(s).index()];
    let (name, at) = (c.name.clone(), c.address.clone().unwrap_or_default());
    let deadline = started + opts.register_timeout;
    let wait_s = opts.register_timeout.as_secs();
    options::AbortOnDrop(tokio::spawn(async move {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let tried = tokio::time::timeout(
                left.min(Duration::from_secs(2)),
                tokio::net::TcpStream::connect(&at),
            )
            .await;
            if matches!(tried, Ok(Ok(_))) {
                return;
            }
            if Instant::now() >= deadline {
                eprintln!(
                    "error: coordinator `{name}` at {at} did not accept a connection within {wait_s} s of this node's start: nothing listens there, or it cannot be reached from here\n  help: is `{name}` started, and is {at} its address and port? (wait longer with --wait SECS or `[run] register_timeout_s`)"
                );
                std::process::exit(2);
            }
            tokio::time::sleep(Duration::from_millis(250).min(left)).await;
        }
    }))
}

/// The coordinator's host listens for registrations before its node exists.
fn registrations(tcp: &TcpTransport, is_coord: bool) -> mpsc::UnboundedReceiver<(Addr, Envelope)> {
    let (reg_tx, reg_rx) = mpsc::unbounded_channel();
    if is_coord {
        tcp.register(
            Addr::Coordinator,
            Arc::new(move |from, env| {
                let _ = reg_tx.send((from, env));
            }),
        );
    }
    reg_rx
}

/// A worker that left the cluster cleanly: its own report, printed, and the transport drained
/// and shut down.
async fn leave(host: &Host<'_>) -> NodeReport {
    let Host {
        opts,
        say,
        su,
        tcp,
        counters,
        t0,
        ..
    } = *host;
    let report = NodeReport {
        steady_steps: Vec::new(),
        ..node_report(None, opts, su, counters, tcp, t0)
    };
    say.say(&RunEvent::Report(report.clone()));
    say.cluster("left the cluster cleanly; the run goes on without this node");
    tcp.drain(Duration::from_secs(2)).await;
    tcp.shutdown();
    report
}

/// This node's announcement on the LAN, when it makes one (see [`Options::announce`]). A
/// failure is said and the run goes on: `--join HOST:PORT` still finds this node.
fn announce(opts: &Options, say: &Say, listen: SocketAddr) -> Option<Announcer> {
    if !opts.announce.wants(listen.ip()) {
        return None;
    }
    let cluster = &opts.scenario.cluster.name;
    match Announcer::start(cluster, &opts.node, listen, PROTOCOL_VERSION) {
        Ok(a) => {
            say.cluster(format!(
                "announced by mDNS as `{}` (found by `ravnest run --discover --cluster {cluster}`)",
                a.fullname()
            ));
            Some(a)
        }
        Err(e) => {
            say.cluster(format!(
                "{e}; `--discover` will not find this node (`--join {listen}` still does)"
            ));
            None
        }
    }
}

/// This process's node actor, under its supervisor; it registers with the coordinator (or,
/// with `--join`, asks to join), after saying its `--advertise` address.
async fn start_node(
    opts: &Options,
    su: &Setup,
    net: &Tap,
    counters: &Counters,
    t0: Instant,
    verdicts: mpsc::UnboundedSender<(NodeId, Verdict)>,
) -> Result<ractor::ActorRef<ravnest_runtime::supervisor::SupMsg>, RunError> {
    let s = &opts.scenario;
    let is_coord = su.me == coordinator_of(s);
    let first_start = if opts.join {
        Start::Rejoin
    } else if opts.resume && !is_coord {
        Start::Empty
    } else {
        Start::Fresh
    };
    // An address of our own for peers to dial (`--advertise`): said to the coordinator's host
    // first (the same connection carries it before anything else), which passes it on.
    if let Some(addr) = opts.advertise.as_ref().filter(|_| !is_coord) {
        let _ = net.send(
            Addr::Node(su.me),
            Addr::Coordinator,
            Envelope::Address {
                node: su.me,
                addr: addr.clone(),
            },
        );
    }
    let nodes = Nodes::new(
        su.compute.clone(),
        vec![su.me],
        4 * su.compute.model_len() as u64,
    )
    .grad_bytes(4 * su.compute.params() as u64)
    .heartbeat(Duration::from_millis(s.run.heartbeat_ms))
    .start(first_start)
    .counters(counters.clone())
    .succession(Succession {
        host: coordinator_of(s),
        // As long as a worker waited before fail-over existed: a few heartbeat timeouts.
        silence: Duration::from_millis((3 * s.run.heartbeat_timeout_ms).max(1000)),
        on_verdict: Arc::new(move |n, v| {
            let _ = verdicts.send((n, v));
        }),
    });
    // A node not in the file registers first (its `Join`, sent as its actor starts, follows on
    // the same connection): the coordinator admits it as the next node.
    if opts.newcomer {
        let _ = net.send(
            Addr::Node(su.me),
            Addr::Coordinator,
            Envelope::Register(su.caps.clone()),
        );
    }
    let sup = Launch::new(net.clone()).at(t0).nodes(nodes).await?;
    if !opts.join {
        let _ = net.send(
            Addr::Node(su.me),
            Addr::Coordinator,
            Envelope::Register(su.caps.clone()),
        );
    }
    Ok(sup)
}

/// What a node that joins a running cluster says to the coordinator to be let in (and says
/// again to a successor, should the host be lost first): where it is reached (the host passes
/// it on to every peer), then, a new node, what it measured; then it asks to join.
fn hello(opts: &Options, su: &Setup) -> Vec<Envelope> {
    let address = opts.advertise.as_ref().map(|addr| Envelope::Address {
        node: su.me,
        addr: addr.clone(),
    });
    let register = opts.newcomer.then(|| Envelope::Register(su.caps.clone()));
    let join = opts.join.then_some(Envelope::Join);
    address.into_iter().chain(register).chain(join).collect()
}

/// What the progress lines of this process watch.
fn progress_of(opts: &Options, su: &Setup, net: &Tap, counters: &Counters) -> Progress {
    let s = &opts.scenario;
    let coord = coordinator_of(s);
    Progress {
        counters: counters.clone(),
        compute: su.compute.clone(),
        me: su.me,
        steps: s.run.steps,
        global_batch: u64::from(s.training.global_batch),
        coordinator: (su.me != coord).then(|| {
            let n = &s.cluster.nodes[coord.index()];
            format!(
                "coordinator `{}` at {}",
                n.name,
                n.address.as_deref().unwrap_or("?")
            )
        }),
        heard: net.heard.clone(),
        t0: net.t0,
        wait_s: opts.register_timeout.as_secs(),
        net: net.inner.clone(),
        names: s.cluster.nodes.iter().map(|n| n.name.clone()).collect(),
    }
}

/// Each step after the first `warmup` of `history` (the latest [`STEADY_STEPS_MAX`]), as the
/// differences of consecutive entries.
fn steady_steps(
    history: &[ravnest_runtime::counters::StepMark],
    warmup: u64,
) -> Vec<ravnest_core::profile::StepSample> {
    let from = (warmup as usize).max(1);
    let all: Vec<_> = history
        .windows(2)
        .skip(from - 1)
        .map(|w| {
            let (a, b) = (w[0], w[1]);
            ravnest_core::profile::StepSample {
                version: b.version,
                batch: b.batch,
                compute_s: b.compute_ns.saturating_sub(a.compute_ns) as f64 / 1e9,
                comm_s: b.comm_ns.saturating_sub(a.comm_ns) as f64 / 1e9,
                period_s: b.at_ns.saturating_sub(a.at_ns) as f64 / 1e9,
            }
        })
        .collect();
    all[all.len().saturating_sub(STEADY_STEPS_MAX)..].to_vec()
}

/// Its steady steps by phase (after `warmup` steps), from the marks of the first and the last;
/// `None` without steady steps or where no all-reduce ran (pipelines, local SGD: the phases
/// describe a data-parallel step).
fn step_phases(
    history: &[ravnest_runtime::counters::StepMark],
    warmup: u64,
) -> Option<crate::summary::StepPhases> {
    let from = (warmup as usize).max(1);
    let (a, b) = (history.get(from - 1)?, history.last()?);
    let steps = (history.len() - from) as f64;
    if steps < 1.0 || b.allreduce_ns <= a.allreduce_ns {
        return None;
    }
    let ms = |x: u64, y: u64| y.saturating_sub(x) as f64 / 1e6 / steps;
    let (pa, pb) = (a.phases, b.phases);
    let step_ms = ms(a.at_ns, b.at_ns);
    let compute_ms = ms(a.compute_ns, b.compute_ns);
    let exposed_ms = ms(a.comm_ns, b.comm_ns);
    let allreduce_ms = ms(a.allreduce_ns, b.allreduce_ns);
    Some(crate::summary::StepPhases {
        step_ms,
        forward_ms: ms(pa.forward_ns, pb.forward_ns),
        backward_ms: ms(pa.backward_ns, pb.backward_ns),
        slowdown_ms: ms(pa.slowdown_ns, pb.slowdown_ns),
        optimizer_ms: ms(pa.optimizer_ns, pb.optimizer_ns),
        allreduce_ms,
        hidden_ms: (allreduce_ms - exposed_ms).max(0.0),
        exposed_ms,
        wait_ms: (step_ms - compute_ms - exposed_ms).max(0.0),
    })
}

/// This node's report: what it applied, computed and sent, its loss and slowdown (and its
/// activity spans with `--timeline`); on the coordinator's host, with the run's `figures`.
fn node_report(
    figures: Option<CoordinatorReport>,
    opts: &Options,
    su: &Setup,
    counters: &Counters,
    tcp: &TcpTransport,
    t0: Instant,
) -> NodeReport {
    let c = counters.read(su.me, Clone::clone).unwrap_or_default();
    // Times on a clock every process on the machine shares: ns since the Unix epoch.
    let t0_unix_ns = opts.spans.then(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            .saturating_sub(t0.elapsed().as_nanos() as u64)
    });
    let spans = c
        .spans
        .iter()
        .filter(|_| opts.spans)
        .map(|sp| {
            let kind = match sp.kind {
                ravnest_runtime::counters::SpanKind::Compute => "compute",
                ravnest_runtime::counters::SpanKind::Comm => "comm",
            };
            (sp.start_ns, sp.end_ns, kind.to_string())
        })
        .collect();
    let steady = c.steady_fractions(warmup_steps(opts.scenario.run.steps));
    let steady_steps = steady_steps(&c.history, warmup_steps(opts.scenario.run.steps));
    let phases = step_phases(&c.history, warmup_steps(opts.scenario.run.steps));
    let stats = su.compute.stats();
    NodeReport {
        node: opts.node.clone(),
        role: if figures.is_some() {
            "coordinator"
        } else {
            "worker"
        }
        .into(),
        coordinator: figures,
        steps_applied: c.steps,
        compute_s: c.compute_ns as f64 / 1e9,
        comm_s: c.comm_ns as f64 / 1e9,
        wall_s: t0.elapsed().as_secs_f64(),
        aborted_collectives: c.aborted,
        batch: c.batch,
        t0_unix_ns,
        spans,
        steady_busy: steady.map(|s| s.0),
        steady_comm: steady.map(|s| s.1),
        steady_steps,
        bytes_sent: tcp.bytes_sent(),
        sync_bytes_sent: tcp.sync_bytes_sent(),
        solo_samples_per_s: su.solo_samples_per_s,
        last_loss: stats.last_loss.is_finite().then_some(stats.last_loss),
        stage_memory: {
            let l = *su.compute.ledger.lock().unwrap();
            (l.peak > 0).then_some((l.peak, l.budget))
        },
        slowdown: Slowdown {
            factor: stats.slowdown.0,
            since_step: stats.slowdown.1,
        },
        phases,
        paths: paths(opts, tcp),
        ..memory_report(su, &c)
    }
}

/// Over libp2p, how this node reaches each peer by name: direct, direct (hole punched), or
/// relayed.
fn paths(opts: &Options, tcp: &TcpTransport) -> BTreeMap<String, String> {
    let Some(net) = tcp.p2p() else {
        return BTreeMap::new();
    };
    let nodes = &opts.scenario.cluster.nodes;
    net.paths()
        .into_iter()
        .filter_map(|(n, p)| Some((nodes.get(n.index())?.name.clone(), p.to_string())))
        .collect()
}

/// What this node's model state cost: the most its backend held at once, the process's peak
/// resident memory when training ended (against what it held before the model existed), and
/// the copies of the state it holds made per step (counted by the backend).
fn memory_report(su: &Setup, c: &ravnest_runtime::counters::NodeCounters) -> NodeReport {
    let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
    let state = ravnest_runtime::Compute::state_stats(su.compute.as_ref());
    let peak = su
        .trained_peak_rss
        .get()
        .copied()
        .or_else(|| ravnest_train::measure::resident_memory().map(|m| m.1))
        .unwrap_or(0);
    // One version of what the node holds: its layers' parameters and optimizer state.
    let one_version = match c.layers {
        Some(l) => ravnest_protocol::node::values::Values::layer_slots(su.compute.as_ref(), l)
            .iter()
            .map(|r| r.len())
            .sum::<usize>(),
        None => su.compute.model_len(),
    } as u64
        * 4;
    NodeReport {
        held_state_mib: mib(state.peak_bytes),
        peak_rss_mib: mib(peak),
        rss_before_model_mib: mib(su.rss_before_model),
        full_model_copies_per_step: state.copied_bytes as f64
            / one_version.max(1) as f64
            / c.steps.max(1) as f64,
        ..NodeReport::default()
    }
}

/// The run's summary, on stdout (unless `--quiet`), and to the observer.
fn print_summary(opts: &Options, summary: &RunReport) {
    use std::io::Write;
    let m = RunEvent::Summary(summary.clone());
    if let Some(o) = &opts.observe {
        (o.0)(&m);
    }
    if opts.quiet {
        return;
    }
    let text = if opts.json { m.json() } else { m.human() };
    let _ = writeln!(std::io::stdout().lock(), "{text}");
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The file a node hands out says which node hosts the coordinator now; a joiner reads it
    /// back (and a document without it, from an older node, says nothing).
    #[test]
    fn a_shared_file_names_the_coordinators_host() {
        let doc = share_document("c.toml", "[cluster]\n", 40);
        assert_eq!(share_coordinator(&doc), None);
        let doc = with_coordinator(newcomer_document("c.toml", "x", 40, "new1"), NodeId(2));
        assert_eq!(share_coordinator(&doc), Some(NodeId(2)));
        assert!(is_newcomer_document(&doc, "new1"));
        assert_eq!(
            read_share_document(&doc).unwrap(),
            ("c.toml".to_string(), "x".to_string(), 40)
        );
    }

    /// The phases are the differences of the first steady mark and the last, per step: the
    /// all-reduce's hidden part is what the exposed communication does not cover, the wait
    /// what neither compute nor communication does.
    #[test]
    fn steady_phases_are_per_step_differences_of_the_marks() {
        use ravnest_runtime::counters::StepMark;
        use ravnest_runtime::seams::PhaseNs;
        let mark = |v: u64, k: u64| StepMark {
            version: v,
            compute_ns: 8_000_000 * k,
            comm_ns: 1_000_000 * k,
            at_ns: 10_000_000 * k,
            batch: 4,
            allreduce_ns: 3_000_000 * k,
            phases: PhaseNs {
                forward_ns: 2_000_000 * k,
                backward_ns: 4_000_000 * k,
                slowdown_ns: 2_000_000 * k,
                optimizer_ns: 500_000 * k,
            },
        };
        // Warm-up: the first 2 steps; the marks after steps 1..=6 (with a slow first step).
        let mut history: Vec<StepMark> = (1..=6).map(|v| mark(v, v + 1)).collect();
        history[0].at_ns = 1;
        let p = step_phases(&history, 2).unwrap();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(p.step_ms, 10.0), "{p:?}");
        assert!(
            close(p.forward_ms, 2.0) && close(p.backward_ms, 4.0),
            "{p:?}"
        );
        assert!(
            close(p.slowdown_ms, 2.0) && close(p.optimizer_ms, 0.5),
            "{p:?}"
        );
        assert!(
            close(p.allreduce_ms, 3.0) && close(p.exposed_ms, 1.0),
            "{p:?}"
        );
        assert!(close(p.hidden_ms, 2.0) && close(p.wait_ms, 1.0), "{p:?}");
        // Without an all-reduce (a pipeline, local SGD), or without steady steps: none.
        let none: Vec<StepMark> = history
            .iter()
            .map(|m| StepMark {
                allreduce_ns: 0,
                ..*m
            })
            .collect();
        assert_eq!(step_phases(&none, 2), None);
        assert_eq!(step_phases(&history[..2], 2), None);
    }
}

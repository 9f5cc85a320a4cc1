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

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use ractor::Actor;
use ravnest_core::{Link, NodeId, PlannerKind, Scenario};
use ravnest_runtime::checkpoint::CheckpointActor;
use ravnest_runtime::coordinator::{Config, CoordinatorActor, Event, RunLog, Tuning};
use ravnest_runtime::msg::Capabilities;
use ravnest_runtime::node::{Counters, NodeActor, Start};
use ravnest_runtime::supervisor::SupervisorActor;
use ravnest_runtime::tcp::{TcpConfig, TcpTransport};
use ravnest_runtime::{Addr, Compute, Envelope, Inbox, Trace, Transport, TransportError};
use serde_json::{Value, json};
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use crate::compute::CandleCompute;
use crate::data::Dataset;
use crate::net::Network;
use crate::optim::Optim;
use crate::store::CheckpointFiles;

/// What one process is asked to do.
#[derive(Debug, Clone)]
pub struct Options {
    /// The cluster file, parsed.
    pub scenario: Scenario,
    /// Its name, for messages.
    pub origin: String,
    /// This process's node name.
    pub node: String,
    /// Where checkpoints go (on the coordinator's host).
    pub out_dir: PathBuf,
    /// Continue from the latest checkpoint in `out_dir`.
    pub resume: bool,
    /// Rejoin a running cluster (a restarted worker).
    pub join: bool,
    /// JSON lines on stdout instead of text on stderr.
    pub json: bool,
    /// How long the coordinator waits for every node to register.
    pub register_timeout: Duration,
    /// The planner (`uniform` is the equal-split baseline).
    pub planner: PlannerKind,
    /// Print nothing (benchmarks).
    pub quiet: bool,
    /// The cluster file as handed to a joiner (`ravnest run --join HOST:PORT`); see
    /// [`share_document`].
    pub share: Option<String>,
    /// Put this node's activity spans in its report (for `run --timeline`).
    pub spans: bool,
    /// The address peers dial for this node, when not the file's (`--advertise`); the
    /// coordinator's host passes it on.
    pub advertise: Option<String>,
    /// Delete the checkpoints already in `out_dir` (otherwise a run refuses to write over
    /// them, unless it resumes from them).
    pub overwrite: bool,
    /// Compute here instead of the node's `device` (`run --device cpu|cuda[:N]`).
    pub device: Option<String>,
}

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

/// Read a [`share_document`]: (origin, text, steps).
pub fn read_share_document(doc: &str) -> anyhow::Result<(String, String, u64)> {
    let v: Value = serde_json::from_str(doc).context("the shared cluster file is not JSON")?;
    match (
        v["origin"].as_str(),
        v["text"].as_str(),
        v["steps"].as_u64(),
    ) {
        (Some(o), Some(t), Some(n)) => Ok((o.to_string(), t.to_string(), n)),
        _ => bail!("the shared cluster file lacks origin, text or steps"),
    }
}

/// The dataset a scenario names: a text file for the character model, else digits, CSV or IDX.
pub fn load_dataset(s: &Scenario, origin: &str) -> anyhow::Result<Dataset> {
    if s.run.network == "char" {
        if s.run.dataset == "digits" {
            bail!(
                "{origin}: [run] network = \"char\" trains on text: set [run] dataset to a text file's path"
            );
        }
        return Ok(Dataset::load_text(
            &s.run.dataset,
            s.run.context_chars as usize,
        )?);
    }
    Ok(Dataset::load(&s.run.dataset)?)
}

/// The network a scenario trains on a dataset, checked against each other.
pub fn network_for(s: &Scenario, origin: &str, data: &Dataset) -> anyhow::Result<Network> {
    match s.run.network.as_str() {
        "char" => Ok(Network::Char {
            context: data.features,
            vocab: data.classes,
            embed: crate::net::CHAR_EMBED,
            hidden: s.run.char_hidden as usize,
        }),
        "cnn" => {
            let side = data.side.with_context(|| {
                format!(
                    "{origin}: [run] network = \"cnn\" needs square images; {} has {} features",
                    data.name, data.features
                )
            })?;
            Ok(Network::Cnn {
                side,
                classes: data.classes,
            })
        }
        _ => {
            // The [model]'s MLP widths, recovered from its layers (params = in·out + out).
            let mut dims = Vec::new();
            for l in &s.model.layers {
                let out = l.output_elems_per_sample;
                if out == 0 || l.params % out != 0 || !l.name.starts_with("fc") {
                    bail!(
                        "{origin}: `ravnest run` trains MLPs ([model] preset = \"mlp-digits\" or kind = \"mlp\") or, with [run] network = \"cnn\", a small CNN; model `{}` is neither",
                        s.model.name
                    );
                }
                if dims.is_empty() {
                    dims.push((l.params / out - 1) as usize);
                }
                dims.push(out as usize);
            }
            if dims.first() != Some(&data.features) {
                bail!(
                    "{origin}: the model takes {} inputs but dataset {} has {} features per sample",
                    dims.first().copied().unwrap_or(0),
                    data.name,
                    data.features
                );
            }
            if dims.last().copied().unwrap_or(0) < data.classes {
                bail!(
                    "{origin}: the model has {} outputs but dataset {} has {} classes",
                    dims.last().copied().unwrap_or(0),
                    data.name,
                    data.classes
                );
            }
            Ok(Network::Mlp { dims })
        }
    }
}

/// The optimizer a scenario asks for.
pub fn optim_for(s: &Scenario) -> Optim {
    Optim {
        kind: s.training.optimizer,
        lr: s.run.learning_rate as f32,
        momentum: s.run.momentum as f32,
        weight_decay: s.run.weight_decay as f32,
    }
}

/// The transport, with `Finish` for this process's node taken out of the node's stream, and
/// the time anything last came from the coordinator (its liveness, as this node sees it).
#[derive(Clone, Debug)]
struct Tap {
    inner: TcpTransport,
    finish: Arc<Notify>,
    /// ms since `t0` of the coordinator's last envelope; `u64::MAX` before the first.
    heard: Arc<std::sync::atomic::AtomicU64>,
    t0: Instant,
    /// Set when the first work arrives: training started here.
    started: Arc<std::sync::OnceLock<std::time::Instant>>,
    /// The run's final report, when the coordinator's host sends it.
    summary: mpsc::UnboundedSender<String>,
}

impl Transport for Tap {
    fn register(&self, addr: Addr, inbox: Inbox) {
        let (finish, heard, t0) = (self.finish.clone(), self.heard.clone(), self.t0);
        let started = self.started.clone();
        let summary = self.summary.clone();
        self.inner.register(
            addr,
            Arc::new(move |from, env| {
                if from == Addr::Coordinator {
                    let ms = t0.elapsed().as_millis() as u64;
                    heard.store(ms, std::sync::atomic::Ordering::Relaxed);
                }
                match env {
                    Envelope::Finish => finish.notify_one(),
                    Envelope::Summary(text) => {
                        let _ = summary.send(text);
                    }
                    env => {
                        if matches!(env, Envelope::Work(_)) {
                            let _ = started.set(std::time::Instant::now());
                        }
                        inbox(from, env)
                    }
                }
            }),
        );
    }

    fn send(&self, from: Addr, to: Addr, env: Envelope) -> Result<(), TransportError> {
        self.inner.send(from, to, env)
    }
}

/// Prints events: JSON lines on stdout, or text on stderr.
#[derive(Debug, Clone)]
struct Say {
    json: bool,
    quiet: bool,
    node: String,
}

impl Say {
    fn event(&self, mut v: Value) {
        if self.quiet {
            return;
        }
        v["node"] = json!(self.node);
        // A closed stdout or stderr (the reader is gone) is not a reason to panic.
        use std::io::Write;
        if self.json {
            let _ = writeln!(std::io::stdout().lock(), "{v}");
        } else if v["event"] != "report" {
            // (A node's report is printed as the run's table: see `crate::summary`.)
            let text = crate::summary::clip_lines(&format!("[{}] {}", self.node, human(&v)));
            let _ = writeln!(std::io::stderr().lock(), "{text}");
        }
    }
}

/// One line of text for an event.
pub fn human(v: &Value) -> String {
    let f = |k: &str| v.get(k).cloned().unwrap_or(Value::Null);
    match v["event"].as_str().unwrap_or("") {
        "measured" => format!(
            "measured on {}: {:.1} GFLOP/s candle matmul{}, {:.0} samples/s on the model, {:.1} GiB free{}",
            f("device").as_str().unwrap_or("cpu"),
            f("matmul_gflops").as_f64().unwrap_or(0.0),
            match f("matmul_bf16_gflops").as_f64() {
                Some(g) => format!(" ({g:.1} in bf16)"),
                None => String::new(),
            },
            f("samples_per_s").as_f64().unwrap_or(0.0),
            f("memory_gib").as_f64().unwrap_or(0.0),
            match f("slowdown").as_f64() {
                Some(k) if k > 1.0 => format!(" (emulating a {k}x slower device)"),
                _ => String::new(),
            }
        ),
        "plan" => format!("plan:\n{}", f("text").as_str().unwrap_or("")),
        "links" => format!(
            "links measured by echo probes: {}",
            f("pairs")
                .as_array()
                .map(|a| a
                    .iter()
                    .filter_map(|p| p.as_str())
                    .collect::<Vec<_>>()
                    .join(", "))
                .unwrap_or_default()
        ),
        "progress" => format!(
            "step {}/{}  loss {:.3}  {:.0} samples/s",
            f("step"),
            f("steps"),
            f("loss").as_f64().unwrap_or(f64::NAN),
            f("samples_per_s").as_f64().unwrap_or(0.0)
        ),
        "cluster" => f("what").as_str().unwrap_or("").to_string(),
        "report" => format!("report of node `{}`", f("node").as_str().unwrap_or("?")),
        "waiting" => f("what").as_str().unwrap_or("").to_string(),
        _ => v.to_string(),
    }
}

fn coordinator_of(s: &Scenario) -> NodeId {
    s.run.coordinator.unwrap_or(NodeId(0))
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

/// The TCP view of a scenario for node `me`, or why `run` cannot use it.
pub fn tcp_config(s: &Scenario, origin: &str, me: NodeId) -> anyhow::Result<TcpConfig> {
    let mut peers = BTreeMap::new();
    for (i, n) in s.cluster.nodes.iter().enumerate() {
        let a = n.address.as_deref().with_context(|| {
            format!(
                "{origin}: node `{}` has no `address`; `ravnest run` needs host:port for every node",
                n.name
            )
        })?;
        let sa: SocketAddr = std::net::ToSocketAddrs::to_socket_addrs(a)
            .ok()
            .and_then(|mut it| it.next())
            .with_context(|| {
                format!("{origin}: node `{}`: cannot resolve address `{a}`", n.name)
            })?;
        peers.insert(NodeId(i as u32), sa);
    }
    let node = &s.cluster.nodes[me.index()];
    let listen = match node.listen.as_deref() {
        None => None,
        Some(l) => Some(
            std::net::ToSocketAddrs::to_socket_addrs(l)
                .ok()
                .and_then(|mut it| it.next())
                .with_context(|| {
                    format!(
                        "{origin}: node `{}`: cannot resolve listen address `{l}`",
                        node.name
                    )
                })?,
        ),
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
    })
}

/// Run one node process to the end of training. Returns its report.
pub fn run(opts: Options) -> anyhow::Result<Value> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(run_async(opts))
}

struct Setup {
    me: NodeId,
    compute: Arc<CandleCompute>,
    test: Dataset,
    files: CheckpointFiles,
    caps: Capabilities,
    solo_samples_per_s: f64,
}

async fn setup(opts: &Options, say: &Say) -> anyhow::Result<Setup> {
    let s = &opts.scenario;
    let names: Vec<&str> = s.cluster.nodes.iter().map(|n| n.name.as_str()).collect();
    let me = names
        .iter()
        .position(|n| *n == opts.node)
        .map(|i| NodeId(i as u32))
        .with_context(|| {
            format!(
                "{}: no node named `{}` (nodes: {})",
                opts.origin,
                opts.node,
                names.join(", ")
            )
        })?;
    // The device first: everything this process computes is made there.
    let run_device = crate::device::of_node(s, me.index(), opts.device.as_deref())
        .and_then(|d| crate::device::select(d).map(|_| d))
        .map_err(|e| anyhow::anyhow!("{}: node `{}`: {e}", opts.origin, opts.node))?;
    let data = load_dataset(s, &opts.origin)?;
    let (train, test) = data.split();
    let net = network_for(s, &opts.origin, &data)?;
    let optim = optim_for(s);
    let slowdown = s
        .run
        .emulate_slowdown
        .get(me.index())
        .copied()
        .unwrap_or(1.0);
    let mut compute = CandleCompute::new(net.clone(), Arc::new(train), optim, s.run.seed, slowdown);
    // A cluster file's `slowdown` faults for this node happen for real: seconds from the moment
    // training starts here. (Crashes, partitions and link faults are the simulator's.)
    for f in &s.faults {
        if let ravnest_core::config::Fault::Slowdown {
            node,
            factor,
            from_s,
            to_s,
        } = f
            && *node == me
        {
            compute.schedule.push((*from_s, *to_s, *factor));
        }
    }
    let files = CheckpointFiles {
        dir: opts.out_dir.join("checkpoints"),
        net,
        optim,
        meta: BTreeMap::from([
            ("seed".to_string(), s.run.seed.to_string()),
            ("dataset".to_string(), s.run.dataset.clone()),
            ("cluster".to_string(), s.cluster.name.clone()),
            ("ravnest".to_string(), env!("CARGO_PKG_VERSION").to_string()),
        ]),
    };
    // Only the coordinator's host writes checkpoints: never over another run's by accident.
    if me == coordinator_of(s)
        && !opts.join
        && crate::store::guard(&files.dir, opts.resume, opts.overwrite)?
    {
        say.event(json!({"event": "cluster", "what": format!(
            "--overwrite: removed the previous checkpoints in {}",
            files.dir.display()
        )}));
    }
    if opts.resume && me == coordinator_of(s) {
        match files.latest()? {
            Some(step) => {
                let flat = files.load(step)?;
                say.event(json!({"event": "cluster", "what": format!(
                    "resuming from the checkpoint of step {step} ({})",
                    files.path(step).display()
                )}));
                compute.resume = Some((step, flat));
            }
            None => bail!(
                "--resume: no checkpoint in {} (its `latest` file is missing)",
                files.dir.display()
            ),
        }
    }
    // Measure: candle matmul, then the model itself on one global batch (emulated slowdown
    // included: that is what this node delivers).
    let gflops =
        tokio::task::block_in_place(|| crate::measure::matmul_flops(Duration::from_millis(150)))
            / 1e9;
    let dev = crate::device::current();
    // On a GPU, half precision too (what larger models train in).
    let bf16_gflops = (!dev.is_cpu()).then(|| {
        tokio::task::block_in_place(|| {
            crate::measure::matmul_flops_in(Duration::from_millis(150), candle_core::DType::BF16)
        }) / 1e9
    });
    let model = compute.initial_model();
    let b = u64::from(s.training.global_batch).clamp(1, 512);
    let model = Arc::new(model);
    let noop: ravnest_runtime::seams::BucketSink = Arc::new(|_: usize, _: Vec<f32>| {});
    let _ = compute
        .gradient_sum(me, 0, 0..b.min(8), model.clone(), noop.clone())
        .await;
    // The best of three: other processes on the machine may be measuring at the same time.
    // (The plan uses the in-situ figure every node measures at once after registering.)
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        let _ = compute
            .gradient_sum(me, 0, 0..b, model.clone(), noop.clone())
            .await;
        best = best.min(t.elapsed().as_secs_f64());
    }
    let solo = b as f64 / best.max(1e-9);
    // Free memory where the model lives: the GPU's, or the machine's.
    let memory = crate::device::free_memory(&dev)
        .or_else(crate::measure::available_memory)
        .unwrap_or(s.cluster.nodes[me.index()].memory_bytes);
    let train_flops = compute.net.model_spec().train_flops_per_sample();
    let caps = Capabilities {
        flops: solo * train_flops,
        memory_bytes: memory,
        device: format!("{run_device} (candle matmul {gflops:.1} GFLOP/s, {solo:.0} samples/s)"),
    };
    say.event(json!({
        "event": "measured",
        "device": run_device.to_string(),
        "matmul_gflops": gflops,
        "matmul_bf16_gflops": bf16_gflops,
        "samples_per_s": solo,
        "memory_gib": memory as f64 / (1u64 << 30) as f64,
        "slowdown": slowdown,
    }));
    Ok(Setup {
        me,
        compute: Arc::new(compute),
        test,
        files,
        caps,
        solo_samples_per_s: solo,
    })
}

async fn run_async(opts: Options) -> anyhow::Result<Value> {
    let say = Say {
        json: opts.json,
        quiet: opts.quiet,
        node: opts.node.clone(),
    };
    let su = setup(&opts, &say).await?;
    let s = &opts.scenario;
    let mut cfg = tcp_config(s, &opts.origin, su.me)?;
    cfg.cluster_file = opts.share.as_deref().map(Arc::from);
    let verbose = (!opts.json && !opts.quiet) || std::env::var_os("RAVNEST_LOG_NET").is_some();
    let tcp = TcpTransport::bind(cfg, verbose).await?;
    let finish = Arc::new(Notify::new());
    let t0 = Instant::now();
    let heard = Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX));
    let (summary_tx, mut summary_rx) = mpsc::unbounded_channel();
    let net = Tap {
        inner: tcp.clone(),
        finish: finish.clone(),
        heard: heard.clone(),
        t0,
        started: su.compute.started.clone(),
        summary: summary_tx,
    };
    let counters: Counters = Arc::default();
    let model_bytes = 4 * su.compute.model_len() as u64;
    let grad_bytes = 4 * su.compute.params() as u64;
    let is_coord = su.me == coordinator_of(s);

    // The coordinator's host listens for registrations before its node exists.
    let (reg_tx, mut reg_rx) = mpsc::unbounded_channel();
    if is_coord {
        tcp.register(
            Addr::Coordinator,
            Arc::new(move |from, env| {
                let _ = reg_tx.send((from, env));
            }),
        );
    }

    let make_node = {
        let (net, compute, counters) = (net.clone(), su.compute.clone(), counters.clone());
        Arc::new(move |id: NodeId| NodeActor {
            id,
            transport: net.clone(),
            compute: compute.clone(),
            grad_bytes,
            model_bytes,
            counters: counters.clone(),
            t0,
        })
    };
    let first_start = if opts.join {
        Start::Rejoin
    } else if opts.resume && !is_coord {
        Start::Empty
    } else {
        Start::Fresh
    };
    let heartbeat = Duration::from_millis(s.run.heartbeat_ms);
    let supervisor = SupervisorActor {
        make_node,
        transport: net.clone(),
        heartbeat,
        nodes: vec![su.me],
        first_start,
        trace: Trace::default(),
        t0,
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
    let (sup, _) = Actor::spawn(None, supervisor, ())
        .await
        .map_err(|e| anyhow::anyhow!("cannot start the node actor: {e}"))?;
    if !opts.join {
        let _ = net.send(
            Addr::Node(su.me),
            Addr::Coordinator,
            Envelope::Register(su.caps.clone()),
        );
    }

    // Progress lines, the same for every role.
    let coord = coordinator_of(s);
    let progress = spawn_progress(
        say.clone(),
        Progress {
            counters: counters.clone(),
            compute: su.compute.clone(),
            me: su.me,
            steps: s.run.steps,
            global_batch: u64::from(s.training.global_batch),
            coordinator: (!is_coord).then(|| {
                let n = &s.cluster.nodes[coord.index()];
                format!(
                    "coordinator `{}` at {}",
                    n.name,
                    n.address.as_deref().unwrap_or("?")
                )
            }),
            heard: heard.clone(),
            t0,
            wait_s: opts.register_timeout.as_secs(),
        },
    );
    let mut collect = None;
    let report = if is_coord {
        let (report, reports, expected) =
            coordinate(&opts, &say, &su, &tcp, &mut reg_rx, &counters, t0).await?;
        collect = Some((reports, expected));
        report
    } else {
        let coord = coordinator_of(s);
        if let Err(why) = watch_coordinator(&opts, &finish, &heard, t0).await {
            progress.abort();
            sup.stop(None);
            tcp.shutdown();
            let c = &s.cluster.nodes[coord.index()];
            bail!(
                "{why}: coordinator `{}` at {}; training cannot go on without it{}",
                c.name,
                c.address.as_deref().unwrap_or("?"),
                if tcp
                    .log_lines()
                    .iter()
                    .any(|l| l.contains("wrong cluster secret"))
                {
                    "\n  help: its port answered with another cluster secret: check RAVNEST_SECRET or `[cluster] secret`; another cluster's node may own that port"
                } else if why.starts_with("no word") {
                    "\n  help: is it started, and is its port reachable from here? (wait longer with `[run] register_timeout_s` or --wait SECS)"
                } else {
                    ""
                }
            );
        }
        json!({ "role": "worker" })
    };
    progress.abort();
    let mut report = report;
    let c = counters
        .lock()
        .unwrap()
        .get(&su.me)
        .cloned()
        .unwrap_or_default();
    let wall = t0.elapsed().as_secs_f64();
    report["event"] = json!("report");
    report["node"] = json!(opts.node);
    report["steps_applied"] = json!(c.steps);
    report["compute_s"] = json!(c.compute_ns as f64 / 1e9);
    report["comm_s"] = json!(c.comm_ns as f64 / 1e9);
    report["wall_s"] = json!(wall);
    report["aborted_collectives"] = json!(c.aborted);
    report["batch"] = json!(c.batch);
    if opts.spans {
        // Times on a clock every process on the machine shares: ns since the Unix epoch.
        let origin = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            .saturating_sub(t0.elapsed().as_nanos() as u64);
        report["t0_unix_ns"] = json!(origin);
        report["spans"] = json!(
            c.spans
                .iter()
                .map(|sp| json!([
                    sp.start_ns,
                    sp.end_ns,
                    match sp.kind {
                        ravnest_runtime::node::SpanKind::Compute => "compute",
                        ravnest_runtime::node::SpanKind::Comm => "comm",
                    }
                ]))
                .collect::<Vec<_>>()
        );
    }
    if let Some((busy, comm)) = c.steady_fractions(warmup_steps(s.run.steps)) {
        report["steady_busy"] = json!(busy);
        report["steady_comm"] = json!(comm);
    }
    report["bytes_sent"] = json!(tcp.bytes_sent());
    report["solo_samples_per_s"] = json!(su.solo_samples_per_s);
    report["last_loss"] = json!(su.compute.stats().last_loss);
    let (factor, since) = su.compute.stats().slowdown;
    report["slowdown"] = json!({"factor": factor, "since_step": since});
    say.event(report.clone());
    // One report for the run, the same on every node: the coordinator's host collects every
    // worker's report and sends the whole back; each prints it.
    let mut wire_report = report.clone();
    if let Some(o) = wire_report.as_object_mut() {
        o.remove("spans");
    }
    let summary = match collect {
        Some((mut reports, expected)) => {
            let mut got: BTreeMap<NodeId, Value> = BTreeMap::new();
            let deadline = Instant::now() + Duration::from_secs(3);
            while !expected.iter().all(|id| got.contains_key(id)) {
                match tokio::time::timeout_at(deadline, reports.recv()).await {
                    Ok(Some((Addr::Node(from), Envelope::Report(text)))) => {
                        if let Ok(v) = serde_json::from_str::<Value>(&text) {
                            got.insert(from, v);
                        }
                    }
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => break,
                }
            }
            // Every node that is still in the run, or answered, gets the whole.
            let recipients: std::collections::BTreeSet<NodeId> =
                expected.iter().chain(got.keys()).copied().collect();
            let nodes: Vec<(String, Option<Value>)> = s
                .cluster
                .ids()
                .map(|id| {
                    let r = if id == su.me {
                        Some(wire_report.clone())
                    } else {
                        got.remove(&id)
                    };
                    (s.cluster.nodes[id.index()].name.clone(), r)
                })
                .collect();
            let merged =
                crate::summary::merge(&s.cluster.name, Some(wire_report.clone()), &nodes, &[]);
            for &id in &recipients {
                let _ = tcp.send(
                    Addr::Coordinator,
                    Addr::Node(id),
                    Envelope::Summary(merged.to_string()),
                );
            }
            let _ = tcp.drain(Duration::from_secs(3)).await;
            Some(merged)
        }
        None => {
            let _ = net.send(
                Addr::Node(su.me),
                Addr::Coordinator,
                Envelope::Report(wire_report.to_string()),
            );
            match tokio::time::timeout(Duration::from_secs(10), summary_rx.recv()).await {
                Ok(Some(text)) => serde_json::from_str::<Value>(&text).ok(),
                _ => None,
            }
        }
    };
    if let Some(m) = &summary
        && !opts.quiet
    {
        use std::io::Write;
        if opts.json {
            let _ = writeln!(std::io::stdout().lock(), "{m}");
        } else {
            let _ = writeln!(std::io::stdout().lock(), "{}", crate::summary::text(m));
        }
    }
    sup.stop(None);
    tcp.shutdown();
    Ok(report)
}

/// What the progress lines watch.
struct Progress {
    counters: Counters,
    compute: Arc<CandleCompute>,
    me: NodeId,
    steps: u64,
    global_batch: u64,
    /// For a worker: "coordinator `a` at ADDR", what it waits for before training.
    coordinator: Option<String>,
    /// ms since `t0` the coordinator was last heard from (`u64::MAX`: never).
    heard: Arc<std::sync::atomic::AtomicU64>,
    t0: Instant,
    /// The registration window, s.
    wait_s: u64,
}

/// Progress lines: nothing about training before it starts here (a worker says what it waits
/// for instead, every few seconds); then the step, loss and the cluster's samples/s over the
/// last interval, counted from the steps this node applied (a node that joins and fetches the
/// model at step 500 did not train 500 steps in half a second).
fn spawn_progress(say: Say, p: Progress) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        // Every half second for scripts (JSON), every two for people.
        let period = if say.json { 500 } else { 2000 };
        let mut tick = tokio::time::interval(Duration::from_millis(period));
        let mut last: Option<(std::time::Instant, u64)> = None;
        let mut next_wait = 5u64;
        let mut printed: Option<u64> = None;
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
                    say.event(json!({"event": "waiting", "what": what}));
                }
                continue;
            }
            let (step, applied) = p
                .counters
                .lock()
                .unwrap()
                .get(&p.me)
                .map_or((0, 0), |c| (c.model.0, c.steps));
            let now = std::time::Instant::now();
            // The first interval starts when training started here.
            let (t, a) = last.unwrap_or_else(|| (*p.compute.started.get().expect("started"), 0));
            let rate = if applied >= a && now > t {
                (applied - a) as f64 * p.global_batch as f64 / (now - t).as_secs_f64()
            } else {
                0.0
            };
            last = Some((now, applied));
            // People get a line when something moved; scripts get every tick.
            if !say.json && printed == Some(step) {
                continue;
            }
            printed = Some(step);
            say.event(json!({
                "event": "progress",
                "step": step,
                "steps": p.steps,
                "loss": p.compute.stats().last_loss,
                "samples_per_s": rate,
            }));
        }
    })
}

#[allow(clippy::too_many_arguments)]
async fn coordinate(
    opts: &Options,
    say: &Say,
    su: &Setup,
    tcp: &TcpTransport,
    reg_rx: &mut mpsc::UnboundedReceiver<(Addr, Envelope)>,
    counters: &Counters,
    t0: Instant,
) -> anyhow::Result<(
    Value,
    mpsc::UnboundedReceiver<(Addr, Envelope)>,
    Vec<NodeId>,
)> {
    let s = &opts.scenario;
    let n = s.cluster.nodes.len();
    let heartbeats = spawn_coordinator_heartbeats(
        tcp.clone(),
        s.cluster.ids().filter(|&id| id != su.me).collect(),
        Duration::from_millis(s.run.heartbeat_ms.max(10)),
    );
    let _stop_heartbeats = AbortOnDrop(heartbeats);
    // Registrations.
    let mut caps: BTreeMap<NodeId, Capabilities> = BTreeMap::new();
    let waiting_since = Instant::now();
    let deadline = waiting_since + opts.register_timeout;
    let mut next_word = waiting_since + Duration::from_secs(5);
    while caps.len() < n {
        match tokio::time::timeout_at(deadline.min(next_word), reg_rx.recv()).await {
            Ok(Some((Addr::Node(from), Envelope::Register(c)))) => {
                say.event(json!({"event": "cluster", "what": format!("node `{}` registered: {}", s.cluster.nodes[from.index()].name, c.device)}));
                caps.insert(from, c);
            }
            Ok(Some(_)) => {}
            Ok(None) => break,
            Err(_) if Instant::now() >= deadline => break,
            Err(_) => {
                // Say what we wait for, every few seconds.
                next_word += Duration::from_secs(5);
                let missing = unregistered(s, &caps);
                say.event(json!({"event": "waiting", "what": format!(
                    "waiting for {} of {n} nodes to register: {} ({} s of {} s; the window is `[run] register_timeout_s`, or `--wait SECS`)",
                    missing.len(),
                    missing.join(", "),
                    waiting_since.elapsed().as_secs(),
                    opts.register_timeout.as_secs()
                )}));
            }
        }
    }
    let need = s.run.min_nodes.unwrap_or(n as u64) as usize;
    if caps.len() < need.max(1) {
        let missing = unregistered(s, &caps);
        bail!(
            "{}: {} of {} nodes registered within {} s; missing: {} (start them with `ravnest run FILE --node NAME`; wait longer with `[run] register_timeout_s` or --wait SECS, or allow fewer with [run] min_nodes)",
            opts.origin,
            caps.len(),
            n,
            opts.register_timeout.as_secs(),
            missing.join(", ")
        );
    }
    // Link probes: every node (this one too) echo-probes the peers after it and reports, so
    // each pair is measured once, by the same code everywhere.
    let mut cluster = s.cluster.clone();
    let all: Vec<NodeId> = caps.keys().copied().collect();
    let mut asked = 0;
    for (k, &id) in all.iter().enumerate() {
        let peers = all[k + 1..].to_vec();
        if peers.is_empty() {
            continue;
        }
        asked += 1;
        let _ = tcp.send(
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
                    cluster.pair_links.insert(
                        (from.min(peer), from.max(peer)),
                        Link {
                            bandwidth_gbps,
                            latency_ms,
                        },
                    );
                }
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    // A node's access link, as the plan shows it: its measured link to this host.
    for &id in &all {
        if let Some(l) = cluster.pair_links.get(&(su.me.min(id), su.me.max(id))) {
            cluster.nodes[id.index()].link = *l;
        }
    }
    let pairs: Vec<String> = cluster
        .pair_links
        .iter()
        .map(|((a, b), l)| {
            format!(
                "{}-{} {:.2} ms {:.1} Gbit/s",
                cluster.nodes[a.index()].name,
                cluster.nodes[b.index()].name,
                l.latency_ms,
                l.bandwidth_gbps
            )
        })
        .collect();
    say.event(json!({"event": "links", "pairs": pairs}));
    let model_spec = su.compute.net.model_spec();
    for (id, c) in &caps {
        let node = &mut cluster.nodes[id.index()];
        node.flops = c.flops;
        node.memory_bytes = c.memory_bytes;
    }
    // Every node measures its training throughput at the same time, at about the batch it will
    // get: the figures include the contention that real steps see (on a shared machine, a
    // node measured alone looks faster than it will be), and their sum is the capacity the
    // run is measured against.
    let solo = calibrate(s, reg_rx, tcp, &all).await;
    for (id, m) in &solo {
        let node = &mut cluster.nodes[id.index()];
        node.flops = model_spec.train_flops_per_sample() / m.per_sample_s;
        node.step_overhead_s = m.overhead_s;
    }
    say.event(json!({"event": "cluster", "what": format!(
        "measured together: {}",
        solo.iter()
            .map(|(id, m)| format!(
                "{} {:.0} samples/s ({:.2} ms per step + {:.1} us per sample)",
                cluster.nodes[id.index()].name,
                m.samples_per_s,
                m.overhead_s * 1e3,
                m.per_sample_s * 1e6
            ))
            .collect::<Vec<_>>()
            .join(", ")
    )}));
    let registered: Vec<NodeId> = caps.keys().copied().collect();
    // The same policy as the coordinator: data parallel first; a pipeline only when none fits
    // and the backend runs stages.
    let live = cluster.subset(&registered);
    let dp = ravnest_core::PlanOptions {
        allow_pipeline: false,
    };
    let planned = ravnest_core::plan_with(opts.planner, &live, &model_spec, &s.training, dp)
        .or_else(|e| {
            if su.compute.runs_stages() {
                ravnest_core::plan(opts.planner, &live, &model_spec, &s.training)
            } else {
                Err(e)
            }
        });
    let plan_text = match planned {
        Ok(p) => p
            .nodes
            .iter()
            .map(|pn| {
                let id = registered[pn.id.index()];
                let node = &cluster.nodes[id.index()];
                format!(
                    "  {:<10} batch {:>4}   measured {:>8.0} samples/s   link {:.2} ms, {:.1} Gbit/s",
                    node.name,
                    pn.batch,
                    node.flops / model_spec.train_flops_per_sample(),
                    node.link.latency_ms,
                    node.link.bandwidth_gbps
                )
            })
            .chain(std::iter::once(format!("  sync: {}", p.sync.reason)))
            .collect::<Vec<_>>()
            .join("\n"),
        Err(e) if !su.compute.runs_stages() => bail!(
            "{}: no data-parallel plan for the registered nodes ({e}); the candle backend does not run pipeline stages yet",
            opts.origin
        ),
        Err(e) => bail!("{}: no plan for the registered nodes: {e}", opts.origin),
    };
    say.event(json!({"event": "plan", "text": plan_text}));

    // The actors.
    let log: Arc<Mutex<RunLog>> = Arc::default();
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let start_step = su.compute.initial_version();
    let checkpointer = CheckpointActor {
        transport: tcp.clone(),
        store: Arc::new(su.files.clone()),
        log: log.clone(),
        trace: Trace::default(),
        t0,
        bytes_per_elem: 4,
    };
    let (ck, _) = Actor::spawn(None, checkpointer, ())
        .await
        .map_err(|e| anyhow::anyhow!("cannot start the checkpoint actor: {e}"))?;
    let train_started = Instant::now();
    let coordinator = CoordinatorActor {
        transport: tcp.clone(),
        config: Config {
            cluster: cluster.clone(),
            model: model_spec.clone(),
            training: s.training.clone(),
            planner: opts.planner,
            steps: s.run.steps,
            heartbeat_timeout_ms: s.run.heartbeat_timeout_ms,
            train_flops: model_spec.train_flops_per_sample(),
            checkpoint_every: s.run.checkpoint_every_steps,
            checkpoint_at_end: true,
            start_step,
            initial_holders: opts.resume.then(|| vec![su.me]),
            absent: cluster.ids().filter(|id| !caps.contains_key(id)).collect(),
            allow_pipeline: su.compute.runs_stages(),
            tuning: Tuning {
                // Fixed per-step costs dominate the figure of a tiny share.
                measure_min_batch: 16,
                ..Tuning::default()
            },
        },
        tick: Duration::from_millis(s.run.heartbeat_ms / 2 + 1),
        t0,
        trace: Trace::default(),
        log: log.clone(),
    };
    let (coord, _) = Actor::spawn(None, coordinator, done_tx)
        .await
        .map_err(|e| anyhow::anyhow!("cannot start the coordinator: {e}"))?;
    // A lost connection is not a lost node (a peer may reconnect): deaths are the failure
    // detector's call, on heartbeats. A node that never registered is left out until it joins.
    for id in cluster.ids() {
        if !caps.contains_key(&id) {
            say.event(json!({"event": "cluster", "what": format!("node `{}` did not register: left out until it joins", cluster.nodes[id.index()].name)}));
        }
    }
    // Relay the coordinator's events as they happen, to the console and to `events.jsonl`.
    let events_path = opts.out_dir.join("events.jsonl");
    let sink = Arc::new(Mutex::new(EventSink::open(
        &events_path,
        opts.resume,
        start_step,
        say.clone(),
        cluster.clone(),
    )));
    let relay = {
        let (log, sink) = (log.clone(), sink.clone());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                sink.lock().unwrap().flush(&log);
            }
        })
    };
    let _ = done_rx.await;
    let train_s = train_started.elapsed().as_secs_f64();
    // The final checkpoint's shard may still be on its way.
    let final_ck = |log: &RunLog| {
        log.events.iter().any(
            |(_, e)| matches!(e, Event::CheckpointComplete { step, .. } if *step == s.run.steps),
        )
    };
    let wait_until = Instant::now() + Duration::from_secs(15);
    while !final_ck(&log.lock().unwrap()) && Instant::now() < wait_until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    relay.abort();
    sink.lock().unwrap().flush(&log);
    let log = log.lock().unwrap().clone();
    for (t, e) in &log.events {
        let _ = t;
        if let Event::Stalled(why) | Event::Violation(why) = e {
            bail!("training stopped: {why}");
        }
    }
    let final_step = start_step + log.step_done_ns.len() as u64;
    let model = match su.files.load(s.run.steps) {
        Ok(m) => m,
        Err(_) => counters
            .lock()
            .unwrap()
            .get(&su.me)
            .map(|c| c.model.1.to_vec())
            .unwrap_or_default(),
    };
    let accuracy = su
        .compute
        .net
        .accuracy(
            &model[..su.compute.params().min(model.len())],
            &su.test.x,
            &su.test.y,
        )
        .unwrap_or(0.0);
    // The character model writes: the first test context, continued greedily.
    let sample = match (&su.compute.net, su.test.vocab.is_empty()) {
        (Network::Char { context, .. }, false) => {
            let prompt: Vec<u32> = su.test.x[..*context].iter().map(|&k| k as u32).collect();
            let more = su
                .compute
                .net
                .continue_text(&model[..su.compute.params().min(model.len())], &prompt, 80)
                .unwrap_or_default();
            let text = |ids: &[u32]| -> String {
                ids.iter()
                    .map(|&k| su.test.vocab.get(k as usize).copied().unwrap_or('?'))
                    .collect()
            };
            Some(json!({"prompt": text(&prompt), "continuation": text(&more)}))
        }
        _ => None,
    };
    // The nodes still in the run, which will report back after `Finish`.
    let mut expected: std::collections::BTreeSet<NodeId> = caps.keys().copied().collect();
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
    expected.remove(&su.me);
    let (reports_tx, reports_rx) = mpsc::unbounded_channel();
    tcp.register(
        Addr::Coordinator,
        Arc::new(move |from, env| {
            let _ = reports_tx.send((from, env));
        }),
    );
    for id in cluster.ids() {
        if id != su.me {
            let _ = tcp.send(Addr::Coordinator, Addr::Node(id), Envelope::Finish);
        }
    }
    // `Finish` must reach every worker before this process exits (a node that is still
    // dialing in, such as a rejoiner, would otherwise wait for it in vain).
    if !tcp.drain(Duration::from_secs(5)).await {
        say.event(json!({"event": "cluster", "what": "some nodes could not be told that training finished"}));
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    coord.stop(None);
    ck.stop(None);
    let trained = final_step - start_step;
    let samples_per_s = trained as f64 * f64::from(s.training.global_batch) / train_s.max(1e-9);
    // The same after the first steps (caches, allocators and the first plan settle there).
    let skip = warmup_steps(trained) as usize;
    let steady = match (
        log.step_done_ns.get(skip.saturating_sub(1)),
        log.step_done_ns.last(),
    ) {
        (Some(a), Some(b)) if b > a && skip > 0 => {
            (trained as usize - skip) as f64 * f64::from(s.training.global_batch)
                / ((b - a) as f64 / 1e9)
        }
        _ => samples_per_s,
    };
    // Each node's solo throughput at the batch it measured (B / n), fixed costs included.
    let solo_sum: f64 = solo.values().map(|m| m.samples_per_s).sum();
    let checkpoints: Vec<u64> = log
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::CheckpointComplete { step, .. } => Some(*step),
            _ => None,
        })
        .collect();
    let said: Vec<String> = log
        .events
        .iter()
        .map(|(_, e)| describe(e, &cluster))
        .collect();
    let all_notable: Vec<&String> = said.iter().filter(|w| crate::summary::notable(w)).collect();
    let mut notable: Vec<String> = all_notable.iter().take(20).map(|w| w.to_string()).collect();
    if all_notable.len() > 20 {
        notable.push(format!("... and {} more", all_notable.len() - 20));
    }
    let report = json!({
        "role": "coordinator",
        "steps": final_step,
        "start_step": start_step,
        "train_s": train_s,
        "samples_per_s": samples_per_s,
        "steady_samples_per_s": steady,
        "warmup_steps": skip,
        "solo_sum_samples_per_s": solo_sum,
        "capacity_efficiency": samples_per_s / solo_sum.max(1e-9),
        "solo_by_node": solo
            .iter()
            .map(|(id, m)| (cluster.nodes[id.index()].name.clone(), json!(m.samples_per_s)))
            .collect::<serde_json::Map<String, Value>>(),
        "replans": log
            .events
            .iter()
            .filter(|(_, e)| matches!(e, Event::Planned { .. }))
            .count()
            .saturating_sub(1),
        "accuracy": accuracy,
        "target_accuracy": s.run.target_accuracy,
        "sample": sample,
        "checkpoints": checkpoints,
        "checkpoint_dir": su.files.dir.display().to_string(),
        "final_checkpoint": su.files.path(s.run.steps).display().to_string(),
        "optimizer": s.training.optimizer.as_str(),
        "plans": said.iter().filter(|w| w.contains(": planned ")).count(),
        "rebalances": said.iter().filter(|w| w.ends_with("re-planned")).count(),
        "notable_events": notable,
        "events_file": events_path.display().to_string(),
    });
    Ok((report, reports_rx, expected.into_iter().collect()))
}

/// Where the coordinator's events go as they happen: the console (as `cluster` events) and
/// `events.jsonl` in the output folder, one JSON object per line (`t_s`, `what`), after a
/// first line that says where the run started.
struct EventSink {
    seen: usize,
    file: Option<std::fs::File>,
    say: Say,
    cluster: ravnest_core::ClusterSpec,
}

impl EventSink {
    fn open(
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
                say.event(json!({"event": "cluster", "what": format!("cannot write {}: {e}", path.display())}));
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
            seen: 0,
            file,
            say,
            cluster,
        }
    }

    /// Pass on the events of `log` not passed on yet (copying only those, and writing them
    /// with the log unlocked: the coordinator keeps appending).
    fn flush(&mut self, log: &Mutex<RunLog>) {
        use std::io::Write;
        let new: Vec<(u64, Event)> = {
            let log = log.lock().unwrap();
            log.events.get(self.seen..).unwrap_or_default().to_vec()
        };
        self.seen += new.len();
        for (t, e) in &new {
            let v = json!({"t_s": *t as f64 / 1e9, "what": describe(e, &self.cluster)});
            if let Some(f) = &mut self.file {
                let _ = writeln!(f, "{v}");
            }
            let mut c = v;
            c["event"] = json!("cluster");
            self.say.event(c);
        }
    }
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

/// A worker waits for `Finish`, watching that the coordinator is there: it must be heard from
/// within the registration window, and then at least every few heartbeat timeouts (its
/// process sends heartbeats to every node). A closed connection alone is not a loss: peers
/// reconnect.
async fn watch_coordinator(
    opts: &Options,
    finish: &Notify,
    heard: &std::sync::atomic::AtomicU64,
    t0: Instant,
) -> Result<(), String> {
    let s = &opts.scenario;
    let silence_ms = (3 * s.run.heartbeat_timeout_ms).max(1000);
    let period = s.run.heartbeat_ms.max(10);
    let mut tick = tokio::time::interval(Duration::from_millis(period));
    // Time this process spent not running (frozen, swapped out) is nobody's silence: the
    // last word, as counted, moves later by such a stall.
    let mut last_tick = 0u64;
    let mut counted_from = 0u64;
    loop {
        tokio::select! {
            biased;
            _ = finish.notified() => return Ok(()),
            _ = tick.tick() => {}
        }
        let now = t0.elapsed().as_millis() as u64;
        let gap = now.saturating_sub(last_tick);
        last_tick = now;
        match heard.load(std::sync::atomic::Ordering::Relaxed) {
            u64::MAX if now > opts.register_timeout.as_millis() as u64 => {
                return Err(format!(
                    "no word from the coordinator within {} s",
                    opts.register_timeout.as_secs()
                ));
            }
            u64::MAX => {}
            last => {
                counted_from = counted_from.max(last);
                if gap > (silence_ms / 3).max(4 * period) {
                    counted_from = (counted_from + gap).min(now);
                }
                let silent = now.saturating_sub(counted_from);
                if silent > silence_ms {
                    return Err(format!(
                        "lost the coordinator: silent for {:.1} s",
                        silent as f64 / 1e3
                    ));
                }
            }
        }
    }
}

/// The coordinator's side of liveness: a heartbeat to every other node each period, so that
/// workers (idle ones too) know it is there.
fn spawn_coordinator_heartbeats(
    tcp: TcpTransport,
    nodes: Vec<NodeId>,
    period: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            for &n in &nodes {
                let _ = tcp.send(Addr::Coordinator, Addr::Node(n), Envelope::Heartbeat);
            }
        }
    })
}

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
    let deadline = Instant::now() + Duration::from_millis(CALIBRATE_MS) + Duration::from_secs(20);
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

/// Aborts a task when dropped (when the function that started it returns, by any path).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Steps a report leaves out as warm-up: a tenth of the run, at most 20.
pub fn warmup_steps(steps: u64) -> u64 {
    (steps / 10).min(20)
}

/// How long every node measures itself, together, before training.
pub const CALIBRATE_MS: u64 = 800;

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
        Event::Planned { step, workers } => format!(
            "step {step}: planned {}",
            workers
                .iter()
                .map(|(n, b)| format!("{}={b}", name(n)))
                .collect::<Vec<_>>()
                .join(" ")
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
        Event::Refused(why) => format!("checkpoint shard refused: {why}"),
        Event::Resync { step, silent_ms } => format!(
            "no step agreed for {:.1} s though every node is alive (a message was lost): step {step} and on redone from what every node holds",
            *silent_ms as f64 / 1e3
        ),
        Event::Joined { node } => format!("node `{}` joined", name(node)),
        Event::CheckpointComplete { step, .. } => format!("checkpoint of step {step} written"),
        Event::Violation(w) => format!("violation: {w}"),
        Event::Stalled(w) => format!("stalled: {w}"),
        Event::Finished => "finished".into(),
    }
}

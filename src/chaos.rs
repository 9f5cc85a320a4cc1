//! `ravnest bench chaos`: real clusters of processes on loopback under seeded schedules of
//! real-network faults, each run checked against what it must do whatever happened.
//!
//! Every node sits behind a fault-injecting proxy (its `address` is the proxy, its `listen` the
//! real port), so connections can be reset and delayed on the path. A schedule is a few faults,
//! each fired when the cluster reaches a step: `kill -9` of a worker (and its rejoin with
//! `--join`), `kill -9` of the coordinator's process (another node takes over), the
//! coordinator's process frozen past the failure timeout (another node takes over; thawed, the
//! stale coordinator learns of the newer term from the first node it reaches and steps down), a
//! frozen process (SIGSTOP, then SIGCONT), a reset of every connection to a node, a delayed
//! link, two machines not in the file joining at the same instant, a forged connection that
//! claims a live node id, a forged connection that sends a
//! corrupted or oversized frame after authenticating, and a port in use at the start. After
//! each run: the exit code is the one the schedule calls for; every checkpoint is there and
//! readable; the final model equals, within float tolerance, a single-node run of the same steps
//! (every step applies the whole global batch, whoever computed it); and the checkpoints' terms
//! never go down from one step to the next (a stale coordinator wrote none after its successor).
//!
//! The schedule is a pure function of its seed ([`schedule`]); a failing one prints the seed and
//! the command that replays it.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use ravnest_core::NodeId;
use ravnest_runtime::chaos::Proxy;
use ravnest_runtime::tcp;
use ravnest_train::store::compare::{float_tensors, worst_difference};
use serde_json::Value;

mod joiners;
use joiners::{JOINERS, judge_newcomers, newcomer, rejoin, seeds};

/// Steps of every chaos run (checkpoints every [`EVERY`]).
const STEPS: u64 = 150;
/// How much slower every node computes in a schedule where machines join while the
/// coordinator is lost: the fail-over takes the silence (4.5 s) of a run whose 150 steps take
/// about 1.5 s, and a joiner that arrives meanwhile must find training left to join once the
/// successor is up. (More steps would do too, but the float error of the data-parallel sums
/// against the single-node replay grows with them past the tolerance.)
const JOIN_SLOWDOWN: f64 = 10.0;
const EVERY: u64 = 50;
/// Faults fire within this long after the plan (training takes about a second undisturbed).
const WINDOW_MS: u64 = 1200;
const NODES: [&str; 3] = ["lead", "peer", "slow"];
const SECRET: &str = "chaos-secret";
/// Largest relative difference (per tensor, Euclidean) between the final model and the
/// single-node replay. Measured on this job: float rounding (the ring sums in another order
/// than one node does) leaves 5e-5; one step skipped or applied twice is 4.7e-3; one node's
/// share of one step (about 12%) would be about 6e-4.
const TOLERANCE: f64 = 3e-4;

/// The coordinator's process is frozen this long at least: past the nodes' silence (three
/// heartbeat timeouts of the cluster file, 4.5 s), so that another node takes over.
const LONG_FREEZE_MS: u64 = 5500;

/// One injected fault.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// `kill -9` of a worker; restarted with `--join` after `rejoin_ms` if given.
    Kill { node: usize, rejoin_ms: Option<u64> },
    /// `kill -9` of the coordinator's process (node 0): the next node takes over.
    KillCoordinator,
    /// SIGSTOP of the coordinator's process past the failure timeout, SIGCONT after `ms`:
    /// another node takes over, and the thawed one must step down.
    FreezeCoordinator { ms: u64 },
    /// The disk is full when the checkpoint of `step` is written (a write error injected in
    /// the store, `RAVNEST_FAIL_CHECKPOINT`): it is said, the previous checkpoint stays, and
    /// training goes on to the next.
    DiskFull { step: u64 },
    /// SIGSTOP of a node's process, SIGCONT after `ms`.
    Freeze { node: usize, ms: u64 },
    /// Node `node` cut off from every other node for `ms` (past the failure timeout): its
    /// proxy refuses every connection, and the others' proxies refuse the connections it
    /// dials; then healed. Its process runs on meanwhile.
    Partition { node: usize, ms: u64 },
    /// Every connection to the node is reset on the path.
    Reset { node: usize },
    /// What travels to the node is held `ms` per chunk, for `for_ms`.
    Delay { node: usize, ms: u64, for_ms: u64 },
    /// Two machines not in the cluster file join at the same instant (`--join` with new
    /// names), one through the coordinator's address, one through a worker's (`via`).
    TwoJoiners { via: usize },
    /// A holder of the secret connects to `target` claiming the live node `claim`.
    Duplicate { target: usize, claim: usize },
    /// A holder of the secret connects to `target` as `claim` and, if let in, sends a frame
    /// whose header announces a huge payload (`huge`) or random bytes.
    Corrupt {
        target: usize,
        claim: usize,
        huge: bool,
    },
}

/// A fault and when it fires: this long after the coordinator printed its plan.
#[derive(Debug, Clone, PartialEq)]
pub struct Timed {
    pub at_ms: u64,
    pub fault: Fault,
}

/// What one seed does.
#[derive(Debug, Clone, PartialEq)]
pub enum Schedule {
    /// Another program holds a node's port: the run must fail fast, naming the port.
    PortInUse { node: usize },
    /// Train under these faults: the run must finish with exit 0.
    Faults(Vec<Timed>),
}

/// A small deterministic generator (SplitMix64): the schedule is a pure function of the seed.
struct Mix(u64);

impl Mix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}

/// The schedule of `seed`.
pub fn schedule(seed: u64) -> Schedule {
    let mut r = Mix(seed);
    if r.below(12) == 0 {
        return Schedule::PortInUse {
            node: r.below(3) as usize,
        };
    }
    let n = r.range(1, 3);
    let mut faults = Vec::new();
    let mut killed = false;
    let mut joiners = false;
    for _ in 0..n {
        let at_ms = r.range(0, WINDOW_MS);
        let any = r.below(3) as usize;
        let worker = r.range(1, 2) as usize;
        let fault = match r.below(9) {
            // One loss per schedule: two lost nodes leave one, a different test.
            0 if !killed => {
                killed = true;
                Fault::Kill {
                    node: worker,
                    rejoin_ms: (r.below(3) != 0).then(|| r.range(200, 1500)),
                }
            }
            0 | 7 if !killed && r.below(2) == 0 => {
                killed = true;
                Fault::Partition {
                    node: any,
                    ms: r.range(LONG_FREEZE_MS, LONG_FREEZE_MS + 2500),
                }
            }
            6 if !killed => {
                killed = true;
                Fault::KillCoordinator
            }
            7 if !killed => {
                killed = true;
                Fault::FreezeCoordinator {
                    ms: r.range(LONG_FREEZE_MS, LONG_FREEZE_MS + 2500),
                }
            }
            6 | 7 => Fault::Reset { node: any },
            8 if r.below(2) == 0 => Fault::DiskFull {
                step: EVERY * r.range(1, STEPS / EVERY - 1),
            },
            8 if !joiners => {
                joiners = true;
                Fault::TwoJoiners { via: worker }
            }
            8 => Fault::Reset { node: any },
            0 | 1 => Fault::Freeze {
                node: any,
                ms: r.range(100, 2500),
            },
            2 => Fault::Reset { node: any },
            3 => Fault::Delay {
                node: any,
                ms: r.range(5, 60),
                for_ms: r.range(200, 1500),
            },
            4 => Fault::Duplicate {
                target: 0,
                claim: worker,
            },
            _ => Fault::Corrupt {
                target: worker,
                claim: 3 - worker,
                huge: r.below(2) == 0,
            },
        };
        faults.push(Timed { at_ms, fault });
    }
    faults.sort_by_key(|t| t.at_ms);
    // A forged second connection claims a node that is alive and connected to its target
    // throughout: not a killed worker, nor a worker cut off; with the coordinator cut off, no
    // worker's connection to it is live, so the forgery is a reset instead.
    if let Some(k) = faults.iter().find_map(|t| match t.fault {
        Fault::Kill { node, .. } | Fault::Partition { node, .. } if node != 0 => Some(node),
        _ => None,
    }) {
        for t in &mut faults {
            if let Fault::Duplicate { claim, .. } = &mut t.fault {
                *claim = 3 - k;
            }
        }
    }
    if faults
        .iter()
        .any(|t| matches!(t.fault, Fault::Partition { node: 0, .. }))
    {
        for t in &mut faults {
            if let Fault::Duplicate { target, .. } = t.fault {
                t.fault = Fault::Reset { node: target };
            }
        }
    }
    Schedule::Faults(faults)
}

/// The cluster file: `addresses` are what peers dial, `listens` where the nodes bind.
fn cluster_text(addresses: &[SocketAddr], listens: &[SocketAddr], slowdown: f64) -> String {
    let mut t = format!("[cluster]\nname = \"chaos\"\nsecret = \"{SECRET}\"\n\n");
    for (i, name) in NODES.iter().enumerate().take(addresses.len()) {
        let slow = slowdown * if *name == "slow" { 2.0 } else { 1.0 };
        t += &format!(
            "[[node]]\nname = \"{name}\"\ndevice = \"cpu\"\naddress = \"{}\"\nlisten = \"{}\"\nemulate_slowdown = {slow:.1}\n\n",
            addresses[i], listens[i]
        );
    }
    t + &format!(
        "[model]\nkind = \"mlp\"\ndims = [64, 512, 512, 10]\n\n[training]\nglobal_batch = 384\noptimizer = \"sgd-momentum\"\nsync = \"ring\"\n\n[run]\nsteps = {STEPS}\nlearning_rate = 0.02\nmomentum = 0.9\nseed = 5\ncheckpoint_every_steps = {EVERY}\nheartbeat_ms = 100\nheartbeat_timeout_ms = 1500\n"
    )
}

fn free_addr() -> Result<SocketAddr> {
    Ok(SocketAddr::from((
        [127, 0, 0, 1],
        ravnest_runtime::tcp::spare_ports(1)?[0],
    )))
}

/// Every checkpoint a run of [`STEPS`] writes, present and readable, and written by one
/// coordinator term at a time: the terms in their manifests never go down from one step to the
/// next (a stale coordinator wrote nothing after its successor did). A round that a lost
/// coordinator had open died with it; its successor checkpoints the first synchronized version
/// after it took over instead, so each interval of [`EVERY`] steps must hold one checkpoint,
/// and the last step its own. The final one's weights.
///
/// A checkpoint is one with a manifest, as the store reads them: a coordinator's host killed
/// while it wrote one leaves its weights file without a manifest, which no reader takes.
fn checkpoints(out: &Path, failed: Option<u64>) -> Result<BTreeMap<String, Vec<f32>>> {
    let dir = out.join("checkpoints");
    let mut steps: Vec<u64> = std::fs::read_dir(&dir)
        .with_context(|| format!("no checkpoint folder {}", dir.display()))?
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.strip_prefix("step-")?
                .strip_suffix(".json")?
                .parse()
                .ok()
        })
        .collect();
    steps.sort_unstable();
    for k in (EVERY..STEPS).step_by(EVERY as usize) {
        if Some(k) != failed && !steps.iter().any(|s| (k..k + EVERY).contains(s)) {
            bail!(
                "no checkpoint between steps {k} and {} (have {steps:?})",
                k + EVERY - 1
            );
        }
    }
    let mut last = None;
    let mut terms: Vec<(u64, u64)> = Vec::new();
    for &step in &steps {
        let f = dir.join(format!("step-{step:08}.safetensors"));
        let w = float_tensors(&f)
            .map_err(anyhow::Error::msg)
            .with_context(|| format!("checkpoint of step {step}"))?;
        if step == STEPS {
            last = Some(w);
        }
        let m = dir.join(format!("step-{step:08}.json"));
        let text = std::fs::read_to_string(&m)
            .with_context(|| format!("manifest of the checkpoint of step {step}"))?;
        let v: Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not JSON", m.display()))?;
        let term = v["term"]
            .as_u64()
            .with_context(|| format!("{} records no term", m.display()))?;
        if let Some((s0, t0)) = terms.last()
            && *t0 > term
        {
            bail!(
                "the checkpoint of step {step} was written by term {term}, after term {t0} wrote step {s0}: a stale coordinator wrote after its successor"
            );
        }
        terms.push((step, term));
    }
    last.with_context(|| format!("no checkpoint of the last step, {STEPS} (have {steps:?})"))
}

/// Single-node training of the same file and steps: the model every chaos run must end with.
fn reference(exe: &Path, root: &Path) -> Result<BTreeMap<String, Vec<f32>>> {
    let dir = root.join("reference");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    // The first node alone (it is not the slow one).
    let a = free_addr()?;
    let one = cluster_text(&[a], &[a], 1.0);
    let file = dir.join("one.toml");
    std::fs::write(&file, one)?;
    let out = dir.join("out");
    let st = Command::new(exe)
        .args(["run", file.to_str().context("path")?, "--json", "--out"])
        .arg(&out)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()?;
    if !st.success() {
        bail!("the single-node reference run failed ({st})");
    }
    checkpoints(&out, None)
}

/// How much slower the nodes of schedule `faults` compute: [`JOIN_SLOWDOWN`] where machines
/// join and the coordinator is lost, not at all otherwise.
fn slowdown_of(faults: &[Timed]) -> f64 {
    let joiners = faults
        .iter()
        .any(|t| matches!(t.fault, Fault::TwoJoiners { .. }));
    if joiners && coordinator_lost(faults) {
        JOIN_SLOWDOWN
    } else {
        1.0
    }
}

/// Whether a fault of `faults` takes the coordinator away (its process or its links).
fn coordinator_lost(faults: &[Timed]) -> bool {
    faults.iter().any(|t| {
        matches!(
            t.fault,
            Fault::KillCoordinator
                | Fault::FreezeCoordinator { .. }
                | Fault::Partition { node: 0, .. }
        )
    })
}

/// Something a fault leaves to do later.
enum Later {
    Cont(u32),
    Undelay(usize),
    Heal(usize),
    Rejoin(usize),
}

/// One schedule's outcome.
#[derive(Debug)]
pub struct Outcome {
    pub seed: u64,
    pub ok: bool,
    pub what: String,
    pub secs: f64,
}

fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &pid.to_string()])
        .stderr(Stdio::null())
        .status();
}

/// Launch the cluster (the local launcher, `--json`) and stream its events.
fn launch(
    exe: &Path,
    file: &Path,
    out: &Path,
    log: &Path,
    full_disk_at: Option<u64>,
) -> Result<(Child, mpsc::Receiver<Value>)> {
    let mut child = Command::new(exe);
    if let Some(step) = full_disk_at {
        child.env("RAVNEST_FAIL_CHECKPOINT", step.to_string());
    }
    let mut child = child
        .args(["run", file.to_str().context("path")?, "--json", "--out"])
        .arg(out)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log)?)
        .spawn()?;
    let stdout = child.stdout.take().context("stdout")?;
    let (tx, rx) = mpsc::channel();
    let mut events = std::fs::File::create(log.with_extension("jsonl"))?;
    std::thread::spawn(move || {
        use std::io::Write;
        for line in BufReader::new(stdout).lines().map_while(|l| l.ok()) {
            let _ = writeln!(events, "{line}");
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                let _ = tx.send(v);
            }
        }
    });
    Ok((child, rx))
}

/// Run schedule `seed` under `root`; `want` is the single-node model.
fn run_one(
    rt: &tokio::runtime::Runtime,
    exe: &Path,
    root: &Path,
    seed: u64,
    want: &BTreeMap<String, Vec<f32>>,
) -> Result<String> {
    let dir = root.join(format!("seed-{seed}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    // The nodes' ports lie below the ephemeral range, where no proxy's port (nor any outgoing
    // connection's) is taken from.
    let listens: Vec<SocketAddr> = ravnest_runtime::tcp::spare_ports(3)?
        .into_iter()
        .map(|p| SocketAddr::from(([127, 0, 0, 1], p)))
        .collect();
    let proxies = listens
        .iter()
        .map(|&l| rt.block_on(Proxy::start("127.0.0.1:0".parse().expect("addr"), l)))
        .collect::<std::io::Result<Vec<_>>>()?;
    let addresses: Vec<SocketAddr> = proxies.iter().map(|p| p.addr()).collect();
    let file = dir.join("cluster.toml");
    let out = dir.join("out");
    let log = dir.join("stderr.log");
    let faults = match schedule(seed) {
        Schedule::PortInUse { node } => {
            std::fs::write(&file, cluster_text(&addresses, &listens, 1.0))?;
            return port_in_use(exe, &file, &out, &log, listens[node]);
        }
        Schedule::Faults(f) => f,
    };
    let slowdown = slowdown_of(&faults);
    std::fs::write(&file, cluster_text(&addresses, &listens, slowdown))?;
    let full_disk = faults.iter().find_map(|t| match t.fault {
        Fault::DiskFull { step } => Some(step),
        _ => None,
    });
    let (mut child, rx) = launch(exe, &file, &out, &log, full_disk)?;
    let deadline = Instant::now() + Duration::from_secs(150);
    let mut pids: BTreeMap<String, u32> = BTreeMap::new();
    let mut step = 0u64;
    let mut planned: Option<Instant> = None;
    let mut pending = faults.clone().into_iter().peekable();
    let mut later: Vec<(Instant, Later)> = Vec::new();
    let mut joined: Vec<Child> = Vec::new();
    let mut newcomers: Vec<(&str, Child)> = Vec::new();
    let mut forged: Vec<tokio::task::JoinHandle<Result<(), String>>> = Vec::new();
    let mut summary = None;
    loop {
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!(
                "no end within 150 s (at step {step}); see {}",
                log.display()
            );
        }
        let now = Instant::now();
        let (due, rest): (Vec<_>, Vec<_>) = later.into_iter().partition(|(t, _)| *t <= now);
        later = rest;
        for (_, l) in due {
            match l {
                Later::Cont(pid) => signal(pid, "-CONT"),
                Later::Undelay(node) => proxies[node].set_delay(Duration::ZERO),
                Later::Heal(node) => heal(&proxies, node),
                Later::Rejoin(node) => {
                    joined.push(rejoin(exe, &dir, &out, &seeds(&addresses, 0, node), node)?)
                }
            }
        }
        match rx.recv_timeout(Duration::from_millis(20)) {
            Ok(v) => match v["event"].as_str() {
                Some("spawned") => {
                    if let (Some(n), Some(p)) = (v["node"].as_str(), v["pid"].as_u64()) {
                        pids.insert(n.to_string(), p as u32);
                    }
                }
                Some("progress") => step = step.max(v["step"].as_u64().unwrap_or(0)),
                Some("plan") if planned.is_none() => planned = Some(Instant::now()),
                Some("summary") => summary = Some(v),
                _ => {}
            },
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
        let since = planned.map_or(0, |p: Instant| p.elapsed().as_millis() as u64);
        while let Some(t) = pending.next_if(|t| planned.is_some() && t.at_ms <= since) {
            match t.fault {
                // Forged peers run beside the schedule (a frozen target would hold them).
                f @ (Fault::Duplicate { .. } | Fault::Corrupt { .. }) => {
                    forged.push(forge(rt, &f, &listens, seed));
                }
                Fault::TwoJoiners { via } => {
                    for (name, first) in JOINERS.into_iter().zip([0, via]) {
                        let seeds = seeds(&addresses, first, usize::MAX);
                        newcomers.push((name, newcomer(exe, &dir, &out, &seeds, name)?));
                    }
                }
                f => later.extend(inject(f, &pids, &proxies)),
            }
        }
    }
    for (_, l) in later {
        match l {
            Later::Cont(pid) => signal(pid, "-CONT"),
            Later::Heal(node) => heal(&proxies, node),
            Later::Undelay(_) | Later::Rejoin(_) => {}
        }
    }
    let status = wait_for(&mut child, Duration::from_secs(20))?;
    for f in forged {
        rt.block_on(f)?.map_err(anyhow::Error::msg)?;
    }
    for mut j in joined {
        let _ = wait_for(&mut j, Duration::from_secs(20));
    }
    let admitted = judge_newcomers(newcomers, &dir, &log)?;
    judge(status, summary, (&out, &log), &faults, want).map(|s| s + &admitted)
}

/// A fault on a node or its link, now; what is to be undone later (and when).
fn inject(
    fault: Fault,
    pids: &BTreeMap<String, u32>,
    proxies: &[Proxy],
) -> Option<(Instant, Later)> {
    let pid = |i: usize| pids.get(NODES[i]).copied();
    match fault {
        Fault::Kill { node, rejoin_ms } => {
            if let Some(p) = pid(node) {
                signal(p, "-KILL");
            }
            rejoin_ms.map(|ms| (at(ms), Later::Rejoin(node)))
        }
        Fault::Freeze { node, ms } => pid(node).map(|p| {
            signal(p, "-STOP");
            (at(ms), Later::Cont(p))
        }),
        Fault::KillCoordinator => {
            if let Some(p) = pid(0) {
                signal(p, "-KILL");
            }
            None
        }
        Fault::FreezeCoordinator { ms } => pid(0).map(|p| {
            signal(p, "-STOP");
            (at(ms), Later::Cont(p))
        }),
        Fault::Reset { node } => {
            proxies[node].reset();
            None
        }
        Fault::Partition { node, ms } => {
            for (i, p) in proxies.iter().enumerate() {
                if i == node {
                    p.isolate(true);
                } else {
                    p.refuse_dialer(Some(node as u32));
                }
            }
            Some((at(ms), Later::Heal(node)))
        }
        Fault::Delay { node, ms, for_ms } => {
            proxies[node].set_delay(Duration::from_millis(ms));
            Some((at(for_ms), Later::Undelay(node)))
        }
        Fault::Duplicate { .. }
        | Fault::Corrupt { .. }
        | Fault::DiskFull { .. }
        | Fault::TwoJoiners { .. } => None,
    }
}

/// The partition of `node` heals: every proxy lets its connections through again.
fn heal(proxies: &[Proxy], node: usize) {
    proxies[node].isolate(false);
    for p in proxies {
        p.refuse_dialer(None);
    }
}

/// Schedule "port in use": with node's port held, the run must fail fast, naming the port.
fn port_in_use(
    exe: &Path,
    file: &Path,
    out: &Path,
    log: &Path,
    listen: SocketAddr,
) -> Result<String> {
    let _hold = std::net::TcpListener::bind(listen)?;
    let t0 = Instant::now();
    let (mut child, _rx) = launch(exe, file, out, log, None)?;
    let status = wait_for(&mut child, Duration::from_secs(20))?;
    let secs = t0.elapsed().as_secs_f64();
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let port = listen.port().to_string();
    if status.is_none_or(|s| s.success()) || secs > 5.0 || !text.contains(&port) {
        bail!(
            "port {port} in use: exit {status:?} after {secs:.1} s; the message {} the port",
            if text.contains(&port) {
                "names"
            } else {
                "does not name"
            }
        );
    }
    Ok(format!("port in use: exit {status:?} in {secs:.1} s"))
}

/// A forged peer, beside the run: a duplicate of a live node (it must be refused) or garbage
/// after a good handshake (it must be survived).
fn forge(
    rt: &tokio::runtime::Runtime,
    fault: &Fault,
    listens: &[SocketAddr],
    seed: u64,
) -> tokio::task::JoinHandle<Result<(), String>> {
    match *fault {
        Fault::Duplicate { target, claim } => {
            let addr = listens[target];
            rt.spawn(async move {
                match tcp::dial_as(
                    addr,
                    NodeId(target as u32),
                    NodeId(claim as u32),
                    SECRET.as_bytes(),
                )
                .await
                {
                    Ok(_) => Err(format!(
                        "a second connection claiming the live node `{}` was let in",
                        NODES[claim]
                    )),
                    // Refused as a duplicate, or the target frozen or restarting:
                    // nothing was let in.
                    Err(_) => Ok(()),
                }
            })
        }
        Fault::Corrupt {
            target,
            claim,
            huge,
        } => {
            let addr = listens[target];
            let bytes: Vec<u8> = if huge {
                let mut b = u32::MAX.to_le_bytes().to_vec();
                b.extend([0u8; 16]);
                b
            } else {
                let mut r = Mix(seed ^ 0x5eed);
                (0..4096).map(|_| r.next() as u8).collect()
            };
            rt.spawn(async move {
                use tokio::io::AsyncWriteExt;
                if let Ok(mut s) = tcp::dial_as(
                    addr,
                    NodeId(target as u32),
                    NodeId(claim as u32),
                    SECRET.as_bytes(),
                )
                .await
                {
                    let _ = s.write_all(&bytes).await;
                    let _ = s.flush().await;
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Ok(())
            })
        }
        _ => rt.spawn(async { Ok(()) }),
    }
}

/// The run's end: it succeeded, trained every step, and its final model equals the
/// single-node replay.
fn judge(
    status: Option<std::process::ExitStatus>,
    summary: Option<Value>,
    (out, log): (&Path, &Path),
    faults: &[Timed],
    want: &BTreeMap<String, Vec<f32>>,
) -> Result<String> {
    if status.is_none_or(|s| !s.success()) {
        bail!("the run ended with {status:?}; see {}", log.display());
    }
    let s = summary.context("no summary")?;
    let steps = s["coordinator"]["steps"].as_u64();
    if steps != Some(STEPS) {
        bail!("the run trained {steps:?} steps, not {STEPS}");
    }
    // A full disk at a checkpoint: said, and the interval it began has no checkpoint (unless
    // a successor, redoing steps, wrote one after all).
    let full_disk = faults.iter().find_map(|t| match t.fault {
        Fault::DiskFull { step } => Some(step),
        _ => None,
    });
    if let Some(step) = full_disk.filter(|_| !coordinator_lost(faults)) {
        let said = format!("the checkpoint of step {step} could not be written (");
        let events = std::fs::read_to_string(log.with_extension("jsonl")).unwrap_or_default();
        if !events.contains(&said) || !events.contains("no space left on device") {
            bail!("the full disk at the checkpoint of step {step} was not said");
        }
    }
    let got = checkpoints(out, full_disk)?;
    let worst = worst_difference(&got, want);
    if worst > TOLERANCE {
        bail!("the final model differs from the single-node replay by {worst:.2e} (relative)");
    }
    Ok(format!("equal to the replay within {worst:.1e}"))
}

fn at(ms: u64) -> Instant {
    Instant::now() + Duration::from_millis(ms)
}

fn wait_for(child: &mut Child, limit: Duration) -> Result<Option<std::process::ExitStatus>> {
    let end = Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait()? {
            return Ok(Some(s));
        }
        if Instant::now() > end {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Run `count` schedules from `first`; print one line each and a total. Err if any failed.
pub fn bench(first: u64, count: u64, root: Option<PathBuf>) -> Result<String> {
    let exe = std::env::current_exe().context("cannot find this program's path")?;
    let temporary = root.is_none();
    let root = root.unwrap_or_else(|| {
        std::env::temp_dir().join(format!("ravnest-chaos-{}", std::process::id()))
    });
    std::fs::create_dir_all(&root)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let want = reference(&exe, &root)?;
    let mut failed = Vec::new();
    let t0 = Instant::now();
    for seed in first..first + count {
        let t = Instant::now();
        let got = run_one(&rt, &exe, &root, seed, &want);
        let o = Outcome {
            seed,
            ok: got.is_ok(),
            what: match &got {
                Ok(w) => w.clone(),
                Err(e) => format!("{e:#}"),
            },
            secs: t.elapsed().as_secs_f64(),
        };
        eprintln!(
            "seed {:>5} {:>5.1} s  {}  {:?}: {}",
            o.seed,
            o.secs,
            if o.ok { "ok  " } else { "FAIL" },
            schedule(seed),
            o.what
        );
        if o.ok {
            let _ = std::fs::remove_dir_all(root.join(format!("seed-{seed}")));
        } else {
            failed.push(o);
        }
    }
    let mut text = format!(
        "chaos: {} of {count} schedules held ({:.0} s)\n",
        count - failed.len() as u64,
        t0.elapsed().as_secs_f64()
    );
    for f in &failed {
        text += &format!(
            "FAILED seed {}: {}\n  replay: ravnest bench chaos --seed {} --schedules 1 --keep DIR\n",
            f.seed, f.what, f.seed
        );
    }
    if failed.is_empty() {
        if temporary {
            let _ = std::fs::remove_dir_all(&root);
        }
        Ok(text)
    } else {
        bail!("{text}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_schedule_is_a_function_of_its_seed_and_uses_every_fault_kind() {
        let mut kinds = std::collections::BTreeSet::new();
        for seed in 0..500 {
            assert_eq!(schedule(seed), schedule(seed));
            match schedule(seed) {
                Schedule::PortInUse { .. } => {
                    kinds.insert("port");
                }
                Schedule::Faults(f) => {
                    assert!(!f.is_empty() && f.len() <= 3);
                    assert!(f.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
                    for t in f {
                        kinds.insert(match t.fault {
                            Fault::Kill { node, .. } => {
                                assert_ne!(node, 0, "a worker's kill is not the coordinator's");
                                "kill"
                            }
                            Fault::KillCoordinator => "kill-coordinator",
                            Fault::DiskFull { step } => {
                                assert!(step % EVERY == 0 && step < STEPS);
                                "disk-full"
                            }
                            Fault::FreezeCoordinator { ms } => {
                                assert!(ms >= LONG_FREEZE_MS);
                                "freeze-coordinator"
                            }
                            Fault::Freeze { .. } => "freeze",
                            Fault::Partition { ms, .. } => {
                                assert!(ms >= LONG_FREEZE_MS);
                                "partition"
                            }
                            Fault::Reset { .. } => "reset",
                            Fault::Delay { .. } => "delay",
                            Fault::Duplicate { claim, .. } => {
                                assert_ne!(claim, 0);
                                "duplicate"
                            }
                            Fault::TwoJoiners { via } => {
                                assert_ne!(via, 0);
                                "two-joiners"
                            }
                            Fault::Corrupt { target, claim, .. } => {
                                assert_ne!(target, claim);
                                "corrupt"
                            }
                        });
                    }
                }
            }
        }
        assert_eq!(kinds.len(), 12, "{kinds:?}");
    }
}

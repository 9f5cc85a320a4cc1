//! `ravnest bench allreduce`: ring all-reduce over loopback TCP, the same `RingMember` and
//! `TcpTransport` that `ravnest run` uses, one transport per rank (each with its own sockets,
//! handshake and frames), timed from start until every rank holds the sum; with connections
//! plain and encrypted (`TcpConfig::encrypt`), and over libp2p (`ravnest_runtime::p2p`: the
//! same sessions on libp2p streams, Noise-encrypted, direct on loopback), rounds interleaved,
//! side by side.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use ravnest_core::NodeId;
use ravnest_core::collective::{CollEffect, CollId, CollInput};
use ravnest_core::ring::RingMember;
use ravnest_protocol::msg::{Addr, Envelope};
use ravnest_runtime::Transport;
use ravnest_runtime::tcp::LoopbackCluster;
use tokio::sync::mpsc;

/// One measurement.
#[derive(Debug, Clone)]
pub struct Row {
    /// Ranks.
    pub n: usize,
    /// Bytes reduced per rank.
    pub bytes: usize,
    /// Median seconds per all-reduce.
    pub secs: f64,
    /// What the connections were.
    pub channel: Channel,
}

/// The connections a measurement ran on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Channel {
    /// TCP, frames in the clear.
    Plain,
    /// TCP, ravnest's Noise channel (AES-256-GCM).
    Encrypted,
    /// libp2p streams (Noise, ChaCha20-Poly1305; yamux), direct.
    P2p,
}

impl Channel {
    fn name(self) -> &'static str {
        match self {
            Channel::Plain => "plain",
            Channel::Encrypted => "encrypted",
            Channel::P2p => "p2p",
        }
    }
}

impl Row {
    /// Algorithm bandwidth, GB/s.
    pub fn algbw(&self) -> f64 {
        self.bytes as f64 / self.secs / 1e9
    }
    /// Bus bandwidth, GB/s (algbw · 2(n−1)/n, as NCCL and gloo report it).
    pub fn busbw(&self) -> f64 {
        self.algbw() * 2.0 * (self.n as f64 - 1.0) / self.n as f64
    }
}

async fn one_round(net: &LoopbackCluster, n: usize, len: usize, epoch: u64) -> Result<Duration> {
    let mut inboxes = Vec::new();
    for r in 0..n {
        let (tx, rx) = mpsc::unbounded_channel();
        net.register(
            Addr::Node(NodeId(r as u32)),
            std::sync::Arc::new(move |_, env| {
                let _ = tx.send(env);
            }),
        );
        inboxes.push(rx);
    }
    // The contributions exist before the clock starts, as gradients do in training.
    let inputs: Vec<Vec<f32>> = (0..n).map(|r| vec![r as f32 + 1.0; len]).collect();
    let t = Instant::now();
    let mut tasks = Vec::new();
    for ((r, mut rx), input) in inboxes.into_iter().enumerate().zip(inputs) {
        let net = net.clone();
        tasks.push(tokio::spawn(async move {
            let me = Addr::Node(NodeId(r as u32));
            let mut m = RingMember::new(CollId::epoch(epoch), r, n, len);
            let mut effects = m.handle(CollInput::Start(input));
            loop {
                for e in effects {
                    match e {
                        CollEffect::Send { to, msg } => {
                            let bytes = 4 * msg.data().len() as u64;
                            let _ = net.send(
                                me,
                                Addr::Node(NodeId(to as u32)),
                                Envelope::Coll {
                                    msg,
                                    virtual_bytes: bytes,
                                    packing: ravnest_core::pack::Packing::Fp32,
                                },
                            );
                        }
                        CollEffect::Done(sum) => return Ok(sum[len / 2]),
                        CollEffect::Aborted => bail!("aborted"),
                    }
                }
                match rx.recv().await {
                    Some(Envelope::Coll { msg, .. }) => effects = m.handle(CollInput::Msg(msg)),
                    Some(_) => effects = Vec::new(),
                    None => bail!("inbox closed"),
                }
            }
        }));
    }
    let want = (n * (n + 1) / 2) as f32;
    for t in tasks {
        let got = t.await??;
        if got != want {
            bail!("wrong sum {got}, expected {want}");
        }
    }
    Ok(t.elapsed())
}

/// Measure every (n, size), `reps` rounds each (after one warm-up), on each of `modes`, their
/// rounds interleaved so that the machine's drift hits them alike. A size under 16 MiB gets
/// proportionally more rounds (1 MiB: 16 times `reps`): its round takes a few milliseconds, so
/// that a median of five was one scheduler hiccup away from another figure.
pub fn measure(
    ns: &[usize],
    sizes_mib: &[usize],
    reps: usize,
    modes: &[Channel],
) -> Result<Vec<Row>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut rows = Vec::new();
        for &n in ns {
            let mut nets = Vec::new();
            for &mode in modes {
                nets.push(match mode {
                    Channel::P2p => LoopbackCluster::start_p2p(n as u32, b"bench")
                        .await
                        .map_err(anyhow::Error::msg)?,
                    c => {
                        LoopbackCluster::start_with(n as u32, b"bench", c == Channel::Encrypted)
                            .await?
                    }
                });
            }
            let mut epoch = 0;
            for &mib in sizes_mib {
                let len = mib * (1 << 20) / 4;
                let mut times = vec![Vec::new(); nets.len()];
                for rep in 0..=reps * (16 / mib.max(1)).max(1) {
                    for (net, times) in nets.iter().zip(&mut times) {
                        epoch += 1;
                        let t = one_round(net, n, len, epoch).await?.as_secs_f64();
                        // The first round of each is a warm-up.
                        if rep > 0 {
                            times.push(t);
                        }
                    }
                }
                for (&channel, mut times) in modes.iter().zip(times) {
                    times.sort_by(f64::total_cmp);
                    rows.push(Row {
                        n,
                        bytes: len * 4,
                        secs: times[times.len() / 2],
                        channel,
                    });
                }
            }
            for net in &nets {
                for t in net.nodes.values() {
                    t.shutdown();
                }
            }
        }
        Ok(rows)
    })
}

/// The table; then, for every cell measured on two channels, their busbw side by side: plain
/// TCP against encrypted TCP, and libp2p against encrypted TCP.
pub fn table(rows: &[Row]) -> String {
    let mut out = format!(
        "ring all-reduce over loopback (median of the rounds; encrypted: {}; p2p: libp2p over TCP, yamux with 256 KiB frames, the encrypted channel on its streams, direct)\n\n  n       size  channel          time   algbw GB/s   busbw GB/s\n",
        ravnest_runtime::tcp::NOISE_PROTOCOL
    );
    for r in rows {
        out += &format!(
            "{:>3} {:>6} MiB  {:<9} {:>8.1} ms {:>12.3} {:>12.3}\n",
            r.n,
            r.bytes >> 20,
            r.channel.name(),
            r.secs * 1e3,
            r.algbw(),
            r.busbw()
        );
    }
    for (a, b) in [
        (Channel::Plain, Channel::Encrypted),
        (Channel::Encrypted, Channel::P2p),
    ] {
        let pairs: Vec<(&Row, &Row)> = rows
            .iter()
            .filter(|p| p.channel == a)
            .filter_map(|p| {
                rows.iter()
                    .find(|e| e.channel == b && (e.n, e.bytes) == (p.n, p.bytes))
                    .map(|e| (p, e))
            })
            .collect();
        if pairs.is_empty() {
            continue;
        }
        let (x, y) = (a.name(), b.name());
        out += &format!(
            "\n{x} vs {y} busbw\n\n  n       size {x:>12} GB/s {y:>12} GB/s {:>17}\n",
            format!("{y}/{x}")
        );
        for (p, e) in pairs {
            out += &format!(
                "{:>3} {:>6} MiB {:>17.3} {:>17.3} {:>17.2}\n",
                p.n,
                p.bytes >> 20,
                p.busbw(),
                e.busbw(),
                e.busbw() / p.busbw()
            );
        }
    }
    out
}

/// PyTorch's side of `bench overhead`: the same MLP, batch, optimizer and steps, one thread,
/// best of `rounds`; prints seconds.
const TORCH_LOOP: &str = r#"
import sys, time
try:
    import torch
except Exception as e:
    print("skipped", e); sys.exit(0)
dims = [int(x) for x in sys.argv[1].split(",")]
b, steps, rounds = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dev = sys.argv[5] if len(sys.argv) > 5 else "cpu"
if dev == "cpu":
    torch.set_num_threads(1)
elif not torch.cuda.is_available():
    print("skipped: torch sees no CUDA device"); sys.exit(0)
sync = torch.cuda.synchronize if dev != "cpu" else (lambda: None)
layers = []
for i in range(len(dims) - 1):
    layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
    if i + 2 < len(dims):
        layers.append(torch.nn.ReLU())
m = torch.nn.Sequential(*layers).to(dev)
opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
x = torch.rand(b, dims[0], device=dev); y = torch.randint(0, dims[-1], (b,), device=dev)
loss = torch.nn.CrossEntropyLoss(reduction="sum")
best = float("inf")
for _ in range(rounds):
    sync(); t = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss(m(x), y).backward()
        opt.step()
    sync(); best = min(best, time.perf_counter() - t)
print(best, torch.__version__)
"#;

/// PyTorch's best seconds for `steps` steps, or why not.
fn torch_seconds(dims: &[usize], batch: u64, steps: u64, rounds: usize) -> Result<f64, String> {
    torch_seconds_on("cpu", dims, batch, steps, rounds)
}

/// The same on `device` (`cpu`, or `cuda` for PyTorch's first GPU).
fn torch_seconds_on(
    device: &str,
    dims: &[usize],
    batch: u64,
    steps: u64,
    rounds: usize,
) -> Result<f64, String> {
    let python = std::env::var("RAVNEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let dims: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    let out = std::process::Command::new(&python)
        .args(["-c", TORCH_LOOP, &dims.join(",")])
        .args([batch.to_string(), steps.to_string(), rounds.to_string()])
        .arg(device)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .map_err(|e| format!("cannot start {python}: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    match text.split_whitespace().next().map(str::parse::<f64>) {
        Some(Ok(s)) => Ok(s),
        _ => Err(text.trim().to_string()),
    }
}

/// A real one-node `ravnest run` (TCP transport, actors, coordinator, a checkpoint at the end)
/// of an MLP on the digits, on `device`, quiet; its report.
fn one_node_run(
    dims: &[usize],
    batch: u64,
    steps: u64,
    device: &str,
    out: &std::path::Path,
) -> Result<f64> {
    let port = ravnest_runtime::tcp::spare_ports(1)?[0];
    let widths: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    let text = format!(
        "[cluster]\nname = \"bench\"\n[[node]]\nname = \"solo\"\ndevice = \"{device}\"\naddress = \"127.0.0.1:{port}\"\n[model]\nkind = \"mlp\"\ndims = [{}]\n[training]\nglobal_batch = {batch}\noptimizer = \"sgd-momentum\"\nsync = \"ring\"\n[run]\nsteps = {steps}\nlearning_rate = 0.05\nseed = 1\ncheckpoint_every_steps = 0\n",
        widths.join(", ")
    );
    let scenario = ravnest_core::parse(&text, "bench")?;
    let report = ravnest_node::process::run(ravnest_node::process::Options {
        scenario,
        origin: "bench".into(),
        node: "solo".into(),
        out_dir: out.to_path_buf(),
        resume: false,
        join: false,
        json: false,
        register_timeout: Duration::from_secs(10),
        planner: ravnest_core::PlannerKind::Ravnest,
        quiet: true,
        share: None,
        spans: false,
        advertise: None,
        overwrite: true,
        device: Some(device.to_string()),
        announce: ravnest_node::discover::Announce::Never,
        newcomer: false,
        observe: None,
    })?;
    // Per step after warm-up.
    Ok(report
        .coordinator
        .map_or(f64::NAN, |c| c.steady_samples_per_s))
}

/// A bare candle training loop on the digits, on this process's device: ravnest's own
/// forward/backward and optimizer, nothing else. Returns the seconds for `steps` steps (timed
/// after the warm-up steps a run's steady figure leaves out, scaled to the whole run) and the
/// compute, for more loops on the same data.
fn bare_loop(
    dims: &[usize],
    batch: u64,
    steps: u64,
) -> Result<(f64, ravnest_train::compute::CandleCompute)> {
    use ravnest_protocol::node::values::Values;
    let data = std::sync::Arc::new(ravnest_train::data::Dataset::load("digits")?.split().0);
    let optim = ravnest_train::optim::Optim {
        kind: ravnest_core::Optimizer::SgdMomentum,
        lr: 0.05,
        momentum: 0.9,
        weight_decay: 0.0,
        schedule: ravnest_core::recipe::Schedule::CONSTANT,
    };
    let net = ravnest_train::net::Network::Mlp {
        dims: dims.to_vec(),
    };
    let c = ravnest_train::compute::CandleCompute::new(net, data, optim, 1, 1.0);
    let mut model = c.initial(None);
    let skip = ravnest_node::process::warmup_steps(steps);
    let mut t = Instant::now();
    for k in 0..steps {
        if k == skip {
            t = Instant::now();
        }
        // (The gradient comes back to the host: a GPU's queued work is done by then.)
        c.train_step(&mut model, k * batch..(k + 1) * batch)?;
    }
    let secs = t.elapsed().as_secs_f64() * steps as f64 / (steps - skip) as f64;
    Ok((secs, c))
}

/// `ravnest bench overhead`: one node training through ravnest (a real `run` process: TCP
/// transport, actors, coordinator, checkpoint at the end) against a bare candle loop on the
/// same model, data and steps. Alternates the two `rounds` times and keeps each one's best.
pub fn overhead(steps: u64, rounds: usize) -> Result<String> {
    let batch = 384u64;
    let dims = [64usize, 512, 512, 10];
    let mut autograd = f64::INFINITY;
    let out = std::env::temp_dir().join(format!("ravnest-overhead-{}", std::process::id()));
    let mut best = (f64::INFINITY, f64::INFINITY);
    for _ in 0..rounds {
        // Bare candle: forward/backward on the same rows, our optimizer, nothing else.
        let (secs, c) = bare_loop(&dims, batch, steps)?;
        best.0 = best.0.min(secs);

        // The same step through candle's autograd (what ravnest used before its own backward).
        let mut model = c.initial_model();
        let params = c.params();
        let t = Instant::now();
        for k in 0..steps {
            let (x, y) = c.batch(k * batch..(k + 1) * batch)?;
            let (_, g) = c.net.loss_and_grad_sum(&model[..params], &x, &y)?;
            let mean: Vec<f32> = g.iter().map(|x| x / batch as f32).collect();
            c.step_now(&mut model, &mean);
        }
        autograd = autograd.min(t.elapsed().as_secs_f64());

        // The same through ravnest, one node.
        // Per step after warm-up, scaled to the whole run (as the bare loop's).
        let steady = one_node_run(&dims, batch, steps, "cpu", &out)?;
        best.1 = best.1.min((steps * batch) as f64 / steady);
    }
    let _ = std::fs::remove_dir_all(&out);
    let rate = |secs: f64| (steps * batch) as f64 / secs;
    let mut text = format!(
        "one node, MLP 64-512-512-10, batch {batch}, {steps} steps, one thread (best of {rounds}; \
         each timed after the first {} steps, scaled to the whole run)\n\n\
         bare candle loop           {:>8.3} s {:>9.0} samples/s   (ravnest's own forward/backward)\n\
         through ravnest            {:>8.3} s {:>9.0} samples/s   overhead {:+.1}%\n\
         candle autograd loop       {:>8.3} s {:>9.0} samples/s\n",
        ravnest_node::process::warmup_steps(steps),
        best.0,
        rate(best.0),
        best.1,
        rate(best.1),
        100.0 * (best.1 / best.0 - 1.0),
        autograd,
        rate(autograd),
    );
    match torch_seconds(&dims, batch, steps, rounds) {
        Ok(t) => {
            text += &format!(
                "PyTorch (1 thread)         {:>8.3} s {:>9.0} samples/s\n\n\
                 compute per sample vs PyTorch: bare loop {:.2}x, through ravnest {:.2}x, candle autograd {:.2}x\n",
                t,
                rate(t),
                t / best.0,
                t / best.1,
                t / autograd
            );
        }
        Err(why) => text += &format!("PyTorch: skipped ({why})\n"),
    }
    Ok(text)
}

/// `ravnest bench gpu`: one node on the first CUDA GPU, through ravnest (a real one-node `run`:
/// transport, actors, checkpoint at the end) and as a bare candle loop, against PyTorch on the
/// same GPU with the same MLP, batch, optimizer and steps. Needs a build with `--features cuda`.
pub fn gpu(dims: &[usize], batch: u64, steps: u64, rounds: usize) -> Result<String> {
    use ravnest_train::device::RunDevice;

    ravnest_train::device::select(RunDevice::Cuda(0))?;
    let data = ravnest_train::data::Dataset::load("digits")?;
    if dims.first() != Some(&data.features) {
        anyhow::bail!(
            "--dims must start with {} (the digits' inputs)",
            data.features
        );
    }
    let out = std::env::temp_dir().join(format!("ravnest-gpu-{}", std::process::id()));
    let (mut bare, mut through) = (f64::INFINITY, f64::INFINITY);
    let skip = ravnest_node::process::warmup_steps(steps);
    for _ in 0..rounds {
        bare = bare.min(bare_loop(dims, batch, steps)?.0);

        let steady = one_node_run(dims, batch, steps, "cuda:0", &out)?;
        through = through.min((steps * batch) as f64 / steady);
    }
    let _ = std::fs::remove_dir_all(&out);
    let rate = |secs: f64| (steps * batch) as f64 / secs;
    let widths: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    let mut text = format!(
        "one node on cuda:0, MLP {}, batch {batch}, {steps} steps, f32 (best of {rounds}; each timed after the first {skip} steps, scaled to the whole run)\n\n\
         bare candle loop           {:>8.3} s {:>10.0} samples/s\n\
         through ravnest            {:>8.3} s {:>10.0} samples/s\n",
        widths.join("-"),
        bare,
        rate(bare),
        through,
        rate(through),
    );
    match torch_seconds_on("cuda", dims, batch, steps, rounds) {
        Ok(t) => {
            text += &format!(
                "PyTorch on the same GPU    {:>8.3} s {:>10.0} samples/s\n\n\
                 ravnest / PyTorch: {:.2}x through ravnest, {:.2}x bare loop (goal >= 0.8x)\n",
                t,
                rate(t),
                t / through,
                t / bare
            );
        }
        Err(why) => text += &format!("PyTorch: skipped ({why})\n"),
    }
    Ok(text)
}

//! `ravnest bench ...`: what each benchmark is asked on the command line, and its run.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use ravnest_core::PlannerKind;

use super::{
    bench_ddp, bench_gpt, bench_inputs, bench_net, bench_planners, bench_sharded, bench_slow_link,
    chaos, compute_threads, emit, one_thread, report, scenarios,
};

/// What `ravnest bench` measures.
#[derive(Subcommand, Debug)]
pub(super) enum BenchWhat {
    /// One node training a GPT (gpt-small at batch 16, gpt2-small's shape at batch 4) through
    /// ravnest's compute against PyTorch's GPT2LMHeadModel of the same shape, one thread each.
    /// The PyTorch side needs torch and transformers (RAVNEST_PYTHON, or python3), else it is
    /// skipped.
    #[command(after_help = "Example:\n  ravnest bench gpt --steps 5 --rounds 3")]
    Gpt {
        /// Timed steps per round.
        #[arg(long, default_value_t = 5)]
        steps: u64,
        /// Interleaved rounds (each side's median is printed).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Python with torch and transformers (default: RAVNEST_PYTHON, else python3).
        #[arg(long)]
        python: Option<String>,
        /// Compute threads on each side (ravnest's rayon pool, PyTorch's set_num_threads).
        #[arg(long, default_value_t = 1)]
        threads: usize,
    },
    /// One cluster file trained as the planner chooses and as a pipeline (`[training] layout =
    /// "pipeline"`), real runs side by side: samples/s of each, and each node's held state
    /// against its plan. Default: scenarios/sharded-gpt-small.toml, where the model's state
    /// fits no node and the planner chooses sharded data parallel.
    #[command(after_help = "Example:\n  ravnest bench sharded --steps 30 --rounds 3")]
    Sharded {
        /// The cluster file (default: the embedded scenarios/sharded-gpt-small.toml; its
        /// dataset is read from the current folder).
        file: Option<PathBuf>,
        /// Steps per run.
        #[arg(long, default_value_t = 30)]
        steps: u64,
        /// Interleaved rounds (each side's median is printed).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
    /// Real node processes on a shaped link (Linux network namespaces, `tc tbf`), one run per
    /// way of synchronizing on the same data and samples: a ring every step, plain local SGD,
    /// DiLoCo (Nesterov outer step, fp32), DiLoCo on fp16 / int8 deltas, and on int8 deltas
    /// with each exchange overlapped with the next round. Prints wall time,
    /// synchronization bytes, compute utilisation, loss and held-out accuracy. Needs root and
    /// iproute2. Default data: Fashion-MNIST when Debian's dataset-fashion-mnist is installed,
    /// else the embedded digits.
    #[command(
        after_help = "Example:\n  ravnest bench slow-link --rate-mbit 100 --steps 600\n  ravnest bench slow-link --runs ring,diloco-int8 --steps 60 --json"
    )]
    SlowLink(SlowLinkCli),
    /// One node through ravnest against a bare candle training loop: the framework's overhead.
    #[command(after_help = "Example:\n  ravnest bench overhead --steps 200 --rounds 3")]
    Overhead {
        /// Steps per run.
        #[arg(long, default_value_t = 100)]
        steps: u64,
        /// Alternating rounds (each side keeps its best).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
    /// ravnest against PyTorch DDP on the same job, side by side: 2 processes, one of them k
    /// times slower; ravnest heterogeneous and uniform, DDP with the equal split and with the
    /// split by hand. Two jobs: an MLP on Fashion-MNIST (SGD, global batch 128, 300 steps) and
    /// gpt-small on a text (AdamW, global batch 32, 20 steps). The PyTorch side needs torch
    /// (and transformers for the GPT; RAVNEST_PYTHON, or python3), else it is skipped.
    ///
    /// Example: ravnest bench ddp --job gpt --rounds 1
    Ddp {
        /// Which job: mlp, gpt, or both.
        #[arg(long, default_value = "both", value_parser = ["mlp", "gpt", "both"])]
        job: String,
        /// The MLP's Fashion-MNIST training images (IDX); the labels file sits beside it.
        #[arg(
            long,
            default_value = "/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz"
        )]
        data: PathBuf,
        /// The GPT's text (its bytes are the tokens).
        #[arg(long, default_value = "data/eighty-days.txt")]
        text: PathBuf,
        /// Interleaved rounds (each runs all four).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
        /// Timed steps per run (default: 300 for the MLP, 20 for the GPT).
        #[arg(long)]
        steps: Option<u64>,
        /// Untimed steps before them (default: 20 for the MLP, 4 for the GPT).
        #[arg(long)]
        warmup: Option<u64>,
        /// MLP widths.
        #[arg(long, value_delimiter = ',', default_value = "784,512,512,10")]
        dims: Vec<usize>,
        /// Global batch (default: 128 for the MLP, 32 for the GPT).
        #[arg(long)]
        batch: Option<u64>,
        /// How many times slower the second process is.
        #[arg(long, default_value_t = 3.0)]
        slowdown: f64,
        /// Python with torch (default: RAVNEST_PYTHON, else python3).
        #[arg(long)]
        python: Option<String>,
    },
    /// Real 3-process clusters on loopback under seeded schedules of network faults (kill -9
    /// and rejoin, frozen processes, connection resets and delays through a proxy, forged
    /// connections, corrupted frames, a port in use). Each run must end as its schedule says,
    /// lose no checkpoint, and end with the model of a single-node run of the same steps. A
    /// failing seed is printed with the command that replays it.
    ///
    /// Example: ravnest bench chaos --schedules 500
    Chaos {
        /// Schedules to run.
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..))]
        schedules: u64,
        /// The first schedule's seed (the others follow).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Keep the runs' folders here (default: a temporary folder, removed when all hold).
        #[arg(long)]
        keep: Option<PathBuf>,
        /// Print the schedules without running them.
        #[arg(long)]
        list: bool,
    },
    /// One node on the first CUDA GPU: ravnest (through a real one-node run, and as a bare
    /// candle loop) against PyTorch on the same GPU, same MLP, batch and optimizer. Needs a
    /// build with `--features cuda` (docs/gpu.md) and, for the PyTorch side, torch with CUDA.
    #[command(
        after_help = "Example:\n  ravnest bench gpu --dims 64,4096,4096,10 --batch 2048 --steps 200"
    )]
    Gpu {
        /// MLP widths (the first is the digits' 64 inputs).
        #[arg(long, value_delimiter = ',', default_value = "64,4096,4096,10")]
        dims: Vec<usize>,
        /// Batch.
        #[arg(long, default_value_t = 2048)]
        batch: u64,
        /// Timed steps per run.
        #[arg(long, default_value_t = 200)]
        steps: u64,
        /// Rounds (each side keeps its best).
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
    /// Ring all-reduce over loopback: algorithm and bus bandwidth for 2, 3 and 4 ranks, on
    /// plain and encrypted TCP connections and on libp2p (what peers behind NATs use), side by
    /// side.
    #[command(
        after_help = "Example:\n  ravnest bench allreduce --sizes 1,16,64 --nodes 2,4\n  ravnest bench allreduce --sizes 64 --nodes 2,4 --channel encrypted"
    )]
    Allreduce {
        /// Sizes in MiB.
        #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
        sizes: Vec<usize>,
        /// Rank counts.
        #[arg(long, value_delimiter = ',', default_value = "2,3,4")]
        nodes: Vec<usize>,
        /// Timed rounds per cell.
        #[arg(long, default_value_t = 5)]
        reps: usize,
        /// Connections: plain, encrypted, p2p, both (plain and encrypted TCP), or all three side
        /// by side (with their ratios).
        #[arg(long, default_value = "all", value_parser = ["all", "both", "plain", "encrypted", "p2p"])]
        channel: String,
    },
    /// Predicted samples/s of every planner on every shipped scenario (or the given files).
    #[command(after_help = "Example:\n  ravnest bench planners scenarios/slow-link.toml")]
    Planners {
        /// Scenario files; default: every scenario shipped in `scenarios/` (embedded).
        files: Vec<PathBuf>,
        /// Instead of the scenarios: this many seeded random small clusters (2-8 nodes of
        /// mixed catalog GPUs and CPUs, slow links, tight memory), each planned by ravnest and
        /// by the exhaustive oracle; prints the ratio's median, p90, p99, max, the fraction
        /// within 1%, and the planning times.
        #[arg(long, value_name = "N")]
        random: Option<u64>,
        /// The first seed of `--random`.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// With `--random`: only the seeds whose cluster has at most this many nodes.
        #[arg(long, default_value_t = 8)]
        max_nodes: usize,
    },
    /// Simulated samples/s and capacity efficiency of ravnest, uniform and param-count on every
    /// shipped scenario the simulator runs (or the given files), with simulator speed.
    #[command(
        after_help = "Examples:\n  ravnest bench sim --steps 200\n  ravnest bench sim --seeds 1000 --first 5000"
    )]
    Sim {
        /// Scenario files; default: the shipped scenarios except `large-1000` (run it by name).
        files: Vec<PathBuf>,
        /// Steps per run.
        #[arg(long, default_value_t = 100)]
        steps: u64,
        /// Instead of the table: sweep this many seeds over the fault scenarios (flaky-3090,
        /// partition, straggler, memory-limited), each seed with 1-3 connection resets of its
        /// own, every run checked; parallel over the machine's cores.
        #[arg(long)]
        seeds: Option<u64>,
        /// The sweep's first seed.
        #[arg(long, default_value_t = 0)]
        first: u64,
    },
}

/// `bench slow-link`'s options.
#[derive(Debug, clap::Args)]
pub(super) struct SlowLinkCli {
    /// Node processes.
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    /// Each node's egress rate, Mbit/s.
    #[arg(long, default_value_t = 100.0)]
    rate_mbit: f64,
    /// Steps per run (600 by default: a run's start-up and its last, waited round weigh on
    /// a shorter one's utilisation; the ring every step takes about 7 minutes of it).
    #[arg(long, default_value_t = 600)]
    steps: u64,
    /// MLP widths (default: 784,1024,1024,10 on Fashion-MNIST, 64,1024,1024,10 on digits).
    #[arg(long, value_delimiter = ',')]
    dims: Vec<usize>,
    /// Global batch.
    #[arg(long, default_value_t = 256)]
    batch: u64,
    /// Dataset: `digits`, or an IDX / CSV path.
    #[arg(long)]
    data: Option<String>,
    /// Local steps per round (default: the planner's, from the measured link).
    #[arg(long)]
    local_steps: Option<u32>,
    /// Runs, comma-separated (default all): ring, local-sgd, diloco, diloco-fp16,
    /// diloco-int8, overlap-int8.
    #[arg(long, value_delimiter = ',')]
    runs: Vec<String>,
    /// Inner optimizer.
    #[arg(long, default_value = "sgd-momentum")]
    optimizer: String,
    /// Inner learning rate.
    #[arg(long, default_value_t = 0.05)]
    lr: f64,
    /// Keep each run's cluster file, node logs, outputs and the first node's report in
    /// DIR/RUN (default: a temporary folder, removed when every run went well).
    #[arg(long)]
    keep: Option<PathBuf>,
    /// Print the figures as JSON (one line) after the table.
    #[arg(long)]
    json: bool,
}

/// `ravnest bench ...`.
pub(super) fn bench_command(what: BenchWhat) -> Result<()> {
    match what {
        BenchWhat::Planners {
            files,
            random: Some(n),
            seed,
            max_nodes,
        } => {
            if !files.is_empty() {
                bail!("give scenario files or --random N, not both");
            }
            emit(&bench_planners::random(seed, n, max_nodes)?);
            Ok(())
        }
        BenchWhat::Planners { files, .. } => {
            let inputs = bench_inputs(&files, &[])?;
            emit(&bench_planners::scenarios(&inputs));
            Ok(())
        }
        BenchWhat::Sim {
            files,
            steps,
            seeds,
            first,
        } => match seeds {
            Some(count) => sim_sweep(first, count),
            None => bench_sim(&files, steps),
        },
        BenchWhat::Gpu {
            dims,
            batch,
            steps,
            rounds,
        } => {
            if dims.len() < 2 || batch == 0 || steps < 2 || rounds == 0 {
                bail!(
                    "--dims at least two widths, --batch at least 1, --steps at least 2, --rounds at least 1"
                );
            }
            emit(&bench_net::gpu(&dims, batch, steps, rounds)?);
            Ok(())
        }
        BenchWhat::Allreduce {
            sizes,
            nodes,
            reps,
            channel,
        } => {
            if nodes.iter().any(|&n| n < 2) || reps == 0 {
                bail!("--nodes must be 2 or more and --reps at least 1");
            }
            use bench_net::Channel;
            let modes: &[Channel] = match channel.as_str() {
                "plain" => &[Channel::Plain],
                "encrypted" => &[Channel::Encrypted],
                "p2p" => &[Channel::P2p],
                "both" => &[Channel::Plain, Channel::Encrypted],
                _ => &[Channel::Plain, Channel::Encrypted, Channel::P2p],
            };
            let rows = bench_net::measure(&nodes, &sizes, reps, modes)?;
            emit(&bench_net::table(&rows));
            Ok(())
        }
        BenchWhat::Ddp {
            job,
            data,
            text,
            rounds,
            steps,
            warmup,
            dims,
            batch,
            slowdown,
            python,
        } => ddp_command(
            &job,
            [data, text],
            rounds,
            (steps, warmup, batch),
            dims,
            slowdown,
            python,
        ),
        BenchWhat::Sharded {
            file,
            steps,
            rounds,
        } => sharded_command(file, steps, rounds),
        BenchWhat::SlowLink(a) => slow_link_command(a),
        BenchWhat::Overhead { steps, rounds } => {
            one_thread()?;
            emit(&bench_net::overhead(steps.max(1), rounds.max(1))?);
            Ok(())
        }
        BenchWhat::Gpt {
            steps,
            rounds,
            python,
            threads,
        } => {
            compute_threads(threads.max(1))?;
            emit(&bench_gpt::gpt(python, steps, rounds, threads.max(1))?);
            Ok(())
        }
        BenchWhat::Chaos {
            schedules,
            seed,
            keep,
            list,
        } => chaos_command(schedules, seed, keep, list),
    }
}

/// `bench chaos`: its schedules listed, or run.
fn chaos_command(schedules: u64, seed: u64, keep: Option<PathBuf>, list: bool) -> Result<()> {
    if list {
        for s in seed..seed + schedules {
            emit(&format!("seed {s}: {:?}\n", chaos::schedule(s)));
        }
        return Ok(());
    }
    emit(&chaos::bench(seed, schedules, keep)?);
    Ok(())
}

/// `bench sharded`: on a scenario file, or the embedded sharded GPT.
fn sharded_command(file: Option<PathBuf>, steps: u64, rounds: usize) -> Result<()> {
    let (origin, text) = match file {
        Some(f) => (
            f.display().to_string(),
            std::fs::read_to_string(&f).with_context(|| format!("cannot read {}", f.display()))?,
        ),
        None => (
            "scenarios/sharded-gpt-small.toml".to_string(),
            include_str!("../scenarios/sharded-gpt-small.toml").to_string(),
        ),
    };
    emit(&bench_sharded::sharded(&bench_sharded::ShardedArgs {
        text,
        origin,
        steps,
        rounds,
    })?);
    Ok(())
}

/// `bench slow-link`: the runs side by side (the data and widths defaulted here).
fn slow_link_command(a: SlowLinkCli) -> Result<()> {
    let (default_data, default_dims) = bench_slow_link::default_data();
    let data_given = a.data.is_some();
    let data = a.data.unwrap_or(default_data);
    let dims = match (a.dims.is_empty(), data_given) {
        (false, _) => a.dims,
        (true, false) => default_dims,
        (true, true) if data == "digits" => vec![64, 1024, 1024, 10],
        (true, true) => vec![784, 1024, 1024, 10],
    };
    let (table, figures) = bench_slow_link::slow_link(&bench_slow_link::SlowLinkArgs {
        nodes: a.nodes,
        rate_mbit: a.rate_mbit,
        steps: a.steps,
        dims,
        batch: a.batch,
        data,
        local_steps: a.local_steps,
        variants: a.runs,
        optimizer: a.optimizer,
        lr: a.lr,
        keep: a.keep,
    })?;
    emit(&table);
    if a.json {
        emit(&format!("{}\n", serde_json::to_string(&figures)?));
    }
    Ok(())
}

/// `bench sim`: every scenario under three planners.
fn bench_sim(files: &[PathBuf], steps: u64) -> Result<()> {
    // The 1,000-node scenario takes about half a minute: run it by naming it.
    let inputs = bench_inputs(files, &["large-1000"])?;
    let mut rows = Vec::new();
    for (name, s) in &inputs {
        for kind in [
            PlannerKind::Ravnest,
            PlannerKind::Uniform,
            PlannerKind::ParamCount,
        ] {
            let mut o = ravnest_sim::SimOptions::for_scenario(s);
            o.planner = kind;
            o.steps = steps;
            let t0 = Instant::now();
            let r = ravnest_sim::run(s, &o);
            rows.push(report::SimBenchRow {
                scenario: name.clone(),
                planner: kind,
                result: r.map_err(|e| e.to_string()),
                wall_s: t0.elapsed().as_secs_f64(),
            });
        }
    }
    emit(&report::sim_bench_table(&rows));
    Ok(())
}

/// `bench sim --seeds N`: the seed sweep with checkers, resets added per seed.
fn sim_sweep(first: u64, count: u64) -> Result<()> {
    use ravnest_sim::sweep::{HostCrash, SweepCase};
    let mut cases = Vec::new();
    for (name, steps, how) in [
        ("flaky-3090", 170, HostCrash::AsWritten),
        ("partition", 80, HostCrash::AsWritten),
        ("straggler", 60, HostCrash::AsWritten),
        ("memory-limited", 45, HostCrash::AsWritten),
        ("coordinator-crash", 60, HostCrash::Steady),
        ("coordinator-crash-replan", 60, HostCrash::Replan),
        ("coordinator-crash", 60, HostCrash::Checkpoint),
        ("stale-coordinator", 60, HostCrash::Isolated),
        ("sharded-gpt-small", 60, HostCrash::AsWritten),
    ] {
        let text = scenarios::SHIPPED
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, t)| *t)
            .context("a shipped scenario")?;
        let s = ravnest_core::parse(text, &format!("scenarios/{name}.toml"))?;
        cases.push(
            SweepCase::new(name, s, steps)
                .map_err(anyhow::Error::msg)?
                .host_crash(how),
        );
    }
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let t0 = Instant::now();
    let r = ravnest_sim::sweep::sweep(&cases, first, count, threads);
    let secs = t0.elapsed().as_secs_f64();
    let mut text = format!(
        "sim sweep: seeds {first}..{} ({}), {} connection resets injected, {} threads, {secs:.0} s\n",
        first + count,
        r.per_case
            .iter()
            .map(|(n, k)| format!("{n} {k}"))
            .collect::<Vec<_>>()
            .join(", "),
        r.resets,
        threads
    );
    if !r.take_overs.is_empty() {
        text += &format!(
            "coordinator fail-overs: {} (the host crashed in {})\n",
            r.take_overs.values().sum::<u64>(),
            r.take_overs
                .iter()
                .map(|(phase, k)| format!("{phase} {k}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    text += &format!(
        "violations or incomplete runs: {} of {count}\n",
        r.failures.len()
    );
    for f in &r.failures {
        text += &format!(
            "FAILED seed {} ({}): {}\n  replay: ravnest bench sim --seeds 1 --first {}\n",
            f.seed, f.scenario, f.what, f.seed
        );
    }
    if r.failures.is_empty() {
        emit(&text);
        Ok(())
    } else {
        bail!("{text}")
    }
}

/// `ravnest bench ddp`: the jobs asked for (`mlp`, `gpt` or `both`), one table each; `paths`:
/// the MLP's images and the GPT's text; `(steps, warmup, batch)` override each job's own.
fn ddp_command(
    job: &str,
    [data, text]: [PathBuf; 2],
    rounds: usize,
    (steps, warmup, batch): (Option<u64>, Option<u64>, Option<u64>),
    dims: Vec<usize>,
    slowdown: f64,
    python: Option<String>,
) -> Result<()> {
    if rounds == 0
        || steps == Some(0)
        || batch.is_some_and(|b| b < 2)
        || dims.len() < 2
        || slowdown < 1.0
    {
        bail!(
            "--rounds, --steps at least 1, --batch at least 2, --dims at least two widths, --slowdown at least 1"
        );
    }
    let mut jobs = Vec::new();
    if job != "gpt" {
        jobs.push((bench_ddp::Job::Mlp(dims), data, 300, 20, 128, 0.05));
    }
    if job != "mlp" {
        jobs.push((bench_ddp::Job::GptSmall, text, 20, 4, 32, 6e-4));
    }
    let mut tables = Vec::new();
    for (job, data, s, w, b, lr) in jobs {
        tables.push(bench_ddp::ddp(&bench_ddp::DdpArgs {
            job,
            data,
            rounds,
            steps: steps.unwrap_or(s),
            warmup: warmup.unwrap_or(w),
            batch: batch.unwrap_or(b),
            lr,
            slowdown,
            python: python.clone(),
        })?);
    }
    emit(&tables.join("\n"));
    Ok(())
}

//! `ravnest`: the command-line front end. Reads files, prints reports; every decision is made
//! by the pure `ravnest-core` crate.

mod bench;
mod bench_ddp;
mod bench_gpt;
mod bench_net;
mod bench_planners;
mod bench_sharded;
mod bench_slow_link;
mod chaos;
mod join;
mod models;
mod relay;
mod report;
mod run;
mod scenarios;
mod view;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use ravnest_core::planner::sync::SyncMethod;
use ravnest_core::{PlannerKind, Scenario};

use bench::{BenchWhat, bench_command};
use models::{EvalCmd, GenerateCmd};

/// mimalloc keeps freed pages for reuse: gradient segments and frames are allocated and freed
/// at a high rate, and glibc's allocator hands their pages back to the kernel and faults them in
/// again (a fifth of the all-reduce's time in a profile).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (its place in `mi_option_e`, the same in v2 and v3).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Freed pages stay with the process (mimalloc never purges them): a training step frees its
/// activations and allocates them again on the next step, seconds later at gpt2-small's shape,
/// so mimalloc's default (give pages back after a second) had the kernel zero and fault them
/// in again every step: a quarter of the step in `clear_page_erms` (perf, gpt2-small's shape at
/// batch 4), 0.42 samples/s against 0.56 with this. What the process holds is then the high
/// water of its working set, as with PyTorch on glibc.
#[allow(unsafe_code)]
fn keep_freed_pages() {
    // SAFETY: setting an option is allowed at any time; mimalloc reads it at each purge.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
}

/// From now on, freed pages go back to the kernel at once: a node whose plan needs more than
/// half of its memory budget cannot keep its high water (given back after a second, a pipeline
/// stage of `scenarios/pipeline-gpt-small.toml` peaked at 150-162 MiB where it holds 56 MiB of
/// state; 115-119 MiB with this; see docs/layouts.md, "Memory").
#[allow(unsafe_code)]
fn purge_at_once() {
    // SAFETY: as above.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
}

#[derive(Parser, Debug)]
#[command(
    name = "ravnest",
    version,
    about = "Train neural networks on heterogeneous clusters",
    after_help = "Examples:
  ravnest run                                   train on a local 3-process cluster (embedded default)
  ravnest run cluster.toml --node a             be node `a` of a cluster of several machines
  ravnest plan cluster.toml                     what each node would do, next to an equal split
  ravnest sim                                   a simulated cluster where a 3090 crashes and comes back
  ravnest bench ddp                             ravnest vs PyTorch DDP on the same job
  ravnest generate DIR --prompt \"It was\"        continue a prompt with a trained GPT's checkpoint

Docs: docs/ in the repository (README.md, docs/multi-machine.md, docs/cluster-format.md,
docs/checkpoints.md, docs/reading-reports.md); `ravnest <command> --help` for each command."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show what ravnest would do on each node, next to an equal split.
    #[command(after_help = "Examples:
  ravnest plan                                  the embedded 2x RTX 4090 + 2x RTX 3060 scenario
  ravnest plan scenarios/slow-link.toml --planner uniform
  ravnest plan scenarios/large-1000.toml --json
  ravnest plan scenarios/local-digits.toml --profile ravnest-out/local-digits/profile.toml

File format: docs/cluster-format.md. Reading the output: docs/reading-reports.md.")]
    Plan {
        /// Cluster or scenario file (TOML). Without it, the embedded `mixed-4090-3060` scenario.
        file: Option<PathBuf>,
        /// Planner: ravnest, uniform, param-count or exhaustive.
        #[arg(long, default_value = "ravnest")]
        planner: String,
        /// Print JSON instead of tables.
        #[arg(long)]
        json: bool,
        /// A profile a real run measured (`profile.toml` in `ravnest run`'s output folder): its
        /// nodes' speeds, fixed costs per step and links replace the file's, by node name.
        #[arg(long, value_name = "FILE")]
        profile: Option<PathBuf>,
    },
    /// Replay a scenario on a simulated cluster: the real actors, virtual time, injected faults.
    #[command(after_help = "Examples:
  ravnest sim                                   flaky-3090: a 3090 crashes at 60 s and comes back
  ravnest sim --timeline run.svg                the same, with a picture of every node's time
  ravnest sim scenarios/mixed-4090-3060.toml --steps 100 --compare uniform
  ravnest sim scenarios/memory-limited.toml --seed 7 --json
  ravnest sim scenarios/local-digits.toml --steps 200 --profile ravnest-out/local-digits/profile.toml
                                                what the last `ravnest run` measured, simulated

Same seed, same trace hash. Reading the output: docs/reading-reports.md.")]
    Sim(SimCmd),
    /// Train for real over TCP. Without --node: start every node of the file as a local
    /// process (the embedded default: two processes on loopback, one emulating a 3x slower
    /// device). With --node NAME: be that node (the same command on every machine).
    #[command(after_help = "Examples:
  ravnest run                                   the embedded local-digits cluster (2 processes)
  ravnest run --resume                          continue from its latest checkpoint
  ravnest run --overwrite                       start again, replacing its checkpoints
  ravnest run scenarios/local-text.toml --out runs/text
  ravnest run cluster.toml --node a             on machine a (the coordinator)
  ravnest run cluster.toml --node g --device cuda:1   node g on its second GPU (--features cuda)
  ravnest run cluster.toml --node b --bind 0.0.0.0:47702 --advertise 203.0.113.7:47702
  RAVNEST_SECRET=... ravnest run --join 10.0.0.5:47701 --node b   rejoin with only an address
  RAVNEST_SECRET=... ravnest run --discover --cluster lab --node b  rejoin, found on the LAN

Output goes to ravnest-out/<cluster>/: checkpoints/ (docs/checkpoints.md), events.jsonl.
Several machines: docs/multi-machine.md. File format: docs/cluster-format.md.")]
    Run(RunCmd),
    /// Benchmarks that print a table.
    #[command(after_help = "Examples:
  ravnest bench ddp                             ravnest vs PyTorch DDP, side by side (needs torch)
  ravnest bench overhead                        one node: ravnest vs a bare loop vs PyTorch
  ravnest bench allreduce --sizes 1,64          ring all-reduce over loopback TCP, plain and encrypted
  ravnest bench planners                        every planner on every shipped scenario
  ravnest bench sim --seeds 1000                the simulator's fault sweep
  ravnest bench chaos --schedules 20            real processes under injected network faults

Reading the tables: docs/reading-reports.md.")]
    Bench {
        #[command(subcommand)]
        what: BenchWhat,
    },
    /// Continue a prompt with a trained transformer: tokens sampled from a checkpoint or a
    /// Hugging Face model folder, printed after the prompt.
    #[command(after_help = "Examples:
  ravnest generate ravnest-out/local-gpt/checkpoints --prompt \"It was a dark\"
  ravnest generate ravnest-out/local-gpt/checkpoints --prompt \"The \" --tokens 400 --temperature 0.5 --seed 7
  ravnest generate ravnest-out/local-gpt/checkpoints/step-00000200.safetensors --prompt \"Once\"
  ravnest generate models/SmolLM-135M --prompt \"The capital of France\" --top-k 40

CHECKPOINT: a checkpoints folder (its model.safetensors, else the step `latest` names), one
weights file, or a Hugging Face model folder (its tokenizer.json encodes the prompt; a
generation stops at its end-of-text token). Checkpoint folders are Hugging Face model
folders: docs/checkpoints.md.")]
    Generate(GenerateCmd),
    /// The mean next-token cross-entropy (nats per token) of a model on a text file.
    #[command(after_help = "Examples:
  ravnest eval models/SmolLM-135M --data data/eighty-days.txt
  ravnest eval ravnest-out/my-run/checkpoints --data held-out.txt --seq 512 --json

DIR: a Hugging Face model folder or a ravnest checkpoints folder. FILE is tokenized as one
document with the folder's tokenizer.json (bytes for ravnest's byte-level GPTs), no special
tokens added; window i feeds tokens [iN, iN+N) and predicts tokens [iN+1, iN+N+1); a last
partial window is dropped. --json prints {\"loss\": ..., \"tokens\": ...}.")]
    Eval(EvalCmd),
    /// Relay for nodes behind NATs: they reserve a slot here and are dialled through it, and
    /// pairs punch direct connections through it where their NATs allow.
    #[command(after_help = "Example:
  ravnest relay --listen 203.0.113.7:4001 --seed my-relay

Then in the cluster file: [cluster] relays = [\"<the address it prints>\"]. How-to: docs/internet.md.")]
    Relay(relay::RelayCmd),
    /// List the device catalog and the model presets.
    #[command(after_help = "Example:
  ravnest catalog

The figures and their sources: docs/cost-model.md.")]
    Catalog,
}

/// `ravnest sim`'s arguments.
#[derive(clap::Args, Debug)]
struct SimCmd {
    /// Scenario file (TOML). Without it, the embedded `flaky-3090` scenario.
    file: Option<PathBuf>,
    /// Seed (default: the scenario's `[sim] seed`).
    #[arg(long)]
    seed: Option<u64>,
    /// Steps to simulate (default: the scenario's `[sim] steps`).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    steps: Option<u64>,
    /// Planner: ravnest, uniform, param-count or exhaustive.
    #[arg(long, default_value = "ravnest")]
    planner: String,
    /// Run a second planner on the same seed and print both side by side: ravnest,
    /// uniform, param-count or exhaustive.
    #[arg(long, value_name = "PLANNER")]
    compare: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// Write the run's page (the same as `run`'s report.html) here; default
    /// `ravnest-out/<cluster name>/sim/report.html`.
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
    /// Write a timeline picture (SVG) of the run to this file.
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// A profile a real run measured (`profile.toml` in `ravnest run`'s output folder): its
    /// nodes' speeds, fixed costs per step and links replace the file's, by node name.
    #[arg(long, value_name = "FILE")]
    profile: Option<PathBuf>,
}

/// `ravnest generate`'s arguments.
/// `ravnest run`'s arguments.
#[derive(clap::Args, Debug)]
struct RunCmd {
    /// Cluster file (TOML) with an `address` per node. Without it, the embedded
    /// `local-digits` cluster.
    file: Option<PathBuf>,
    /// Print the plan the run's coordinator makes from the file's figures (the same as
    /// `ravnest plan`), and whether `run` can train the file's model; start nothing.
    #[arg(long)]
    dry_run: bool,
    /// Be this node of the file (otherwise start them all locally).
    #[arg(long)]
    node: Option<String>,
    /// Rejoin a running cluster (a restarted node). With HOST:PORT (any running node's
    /// address) and no FILE: fetch the cluster file from that node, authenticated with the
    /// secret in RAVNEST_SECRET. Several addresses, comma separated, are asked in turn (one
    /// that is down does not keep this node out).
    #[arg(long, value_name = "HOST:PORT[,...]", num_args = 0..=1, default_missing_value = "")]
    join: Option<String>,
    /// Continue from the latest checkpoint in the output directory.
    #[arg(long, conflicts_with = "overwrite")]
    resume: bool,
    /// Delete the checkpoints already in the output directory and start from step 0 (a
    /// run refuses to write over another run's checkpoints without it).
    #[arg(long)]
    overwrite: bool,
    /// Seconds the coordinator waits for nodes to register, and a worker for the
    /// coordinator (default: the file's `[run] register_timeout_s`, else 60).
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    wait: Option<u64>,
    /// (With --node) the local address to listen on, e.g. 0.0.0.0:47701 (default: the
    /// node's `listen`, else its `address`).
    #[arg(long, value_name = "HOST:PORT", requires = "node")]
    bind: Option<String>,
    /// (With --node) the address peers dial to reach this node, when the file's is not
    /// it (NAT, a cloud's public address); the coordinator passes it on to the others.
    #[arg(long, value_name = "HOST:PORT", requires = "node")]
    advertise: Option<String>,
    /// Compute on this device instead of each node's `device`: cpu, cuda, or cuda:N (a GPU
    /// needs a build with `--features cuda`: docs/gpu.md).
    #[arg(long, value_name = "cpu|cuda[:N]")]
    device: Option<String>,
    /// Output directory (checkpoints); default `ravnest-out/<cluster name>`.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Override the file's `[run] steps`.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    steps: Option<u64>,
    /// JSON lines on stdout instead of text.
    #[arg(long)]
    json: bool,
    /// Planner: ravnest, or uniform (the equal split of DDP-style frameworks) to compare.
    #[arg(long, default_value = "ravnest")]
    planner: String,
    /// Write a timeline picture (SVG) of the run to this file: per node, computing,
    /// waiting for the all-reduce, idle (a local cluster, started without --node).
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Find each other on the LAN by mDNS. With --node NAME and no FILE: listen for the
    /// announcements of the cluster's nodes, then join as `--join HOST:PORT` does, with the
    /// address of the lowest-named node that answers (the secret is still RAVNEST_SECRET). With
    /// a FILE: announce every node started here, even on a loopback address (nodes on other
    /// addresses announce themselves anyway, unless --no-announce).
    #[arg(long, conflicts_with_all = ["join", "no_announce"])]
    discover: bool,
    /// (With --discover and no FILE) the cluster to find, by its `[cluster] name` (default: the
    /// only cluster that answers).
    #[arg(long, value_name = "NAME", requires = "discover")]
    cluster: Option<String>,
    /// (With --discover and no FILE) how long to listen for announcements, in seconds
    /// (default 5).
    #[arg(long, value_name = "SECS", requires = "discover", value_parser = clap::value_parser!(u64).range(1..))]
    discover_timeout: Option<u64>,
    /// Do not announce this node (or, without --node, the local cluster's nodes) on the LAN.
    /// By default a node that listens on an address other than a loopback one announces its
    /// cluster's and its own name, and its port, by mDNS, for `--discover` (never the secret).
    #[arg(long)]
    no_announce: bool,
    /// (Set by the local launcher) put this node's activity spans in its report.
    #[arg(long, hide = true)]
    report_spans: bool,
    /// Serve a live view of the run here (default 127.0.0.1 and a free port, printed): the
    /// page at /, its stream at /events, Prometheus text at /metrics. A local cluster's launcher
    /// draws every node; a `--node` process its node, and the cluster while it hosts the
    /// coordinator.
    #[arg(long, value_name = "HOST:PORT", num_args = 0..=1, default_missing_value = "127.0.0.1:0")]
    dashboard: Option<String>,
    /// Write TensorBoard event files (loss, samples/s, gradient norm, evaluations) to this
    /// folder, for `tensorboard --logdir DIR`.
    #[arg(long, value_name = "DIR")]
    tensorboard: Option<PathBuf>,
}

fn main() -> ExitCode {
    // The environment's MIMALLOC_PURGE_DELAY, read by mimalloc at start, wins.
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        keep_freed_pages();
        ravnest_train::measure::on_tight_memory(purge_at_once);
    }
    init_logs();
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// Library logs (`tracing`, targets `ravnest::*`) go to stderr as plain lines; other crates'
/// (ractor's) stay quiet.
fn init_logs() {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{Layer, filter, fmt};
    let lines = fmt::layer()
        .without_time()
        .with_level(false)
        .with_target(false)
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .with_filter(filter::filter_fn(|m| m.target().starts_with("ravnest")));
    let _ = tracing_subscriber::registry().with(lines).try_init();
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Plan {
            file,
            planner,
            json,
            profile,
        } => plan_command(file.as_deref(), &planner, json, profile.as_deref()),
        Command::Sim(cmd) => sim_command(cmd),
        Command::Run(cmd) => run_command(cmd),
        Command::Bench { what } => bench_command(what),
        Command::Generate(cmd) => models::generate_command(cmd),
        Command::Eval(cmd) => models::eval_command(cmd),
        Command::Relay(cmd) => relay::relay_command(cmd),
        Command::Catalog => {
            emit(&report::catalog_text());
            Ok(())
        }
    }
}

/// `ravnest plan`.
fn plan_command(
    file: Option<&std::path::Path>,
    planner: &str,
    json: bool,
    profile: Option<&Path>,
) -> Result<()> {
    let kind = parse_planner(planner)?;
    let (origin, mut scenario) = load(file)?;
    if let Some(p) = profile {
        apply_profile(&mut scenario, p)?;
    }
    let ours = ravnest_core::plan_scenario(kind, &scenario)
        .with_context(|| format!("{origin}: planner `{kind}`"))?;
    let uniform = (kind != PlannerKind::Uniform)
        .then(|| ravnest_core::plan_scenario(PlannerKind::Uniform, &scenario));
    // Local SGD is another algorithm than the baseline's every-step sync: plan the same
    // cluster with every-step sync too, for a like-for-like comparison.
    let every_step = matches!(ours.sync.method, SyncMethod::LocalSgd { .. }).then(|| {
        let training = ravnest_core::TrainingSpec {
            sync: ravnest_core::SyncPreference::Auto,
            local_sgd_threshold: f64::INFINITY,
            ..scenario.training.clone()
        };
        ravnest_core::plan_scenario(
            kind,
            &Scenario {
                training,
                ..scenario.clone()
            },
        )
    });
    let cmp = report::Comparisons {
        uniform,
        every_step,
    };
    if json {
        emit(&format!("{}\n", report::plan_json(&scenario, &ours, &cmp)?));
    } else {
        emit(&report::plan_text(&origin, &scenario, &ours, &cmp));
    }
    Ok(())
}

/// `ravnest run --dry-run`: the plan the run's coordinator makes on the file's figures (one
/// policy with `plan` and `sim`), what the run would train on (data, tokenizer, precision),
/// and the checks `run` makes before it starts (the devices this build can use, addresses,
/// the data, the output folder): a problem `run` would refuse is an error, after the plan.
fn dry_run_command(
    file: Option<&Path>,
    kind: PlannerKind,
    device: Option<&str>,
    out: (Option<&Path>, bool, bool),
) -> Result<()> {
    let (origin, scenario) = load(file)?;
    let p = ravnest_core::plan_scenario(kind, &scenario)
        .with_context(|| format!("{origin}: planner `{kind}`"))?;
    let mut text = format!(
        "ravnest run --dry-run: {} ({origin})\nplanner {kind}: {} samples/s predicted on the file's figures (the run re-plans on what each node measures)\nsplit: {}\n",
        scenario.cluster.name,
        ravnest_core::units::rate(p.step.samples_per_s),
        p.split_line()
    );
    let mut refused = Vec::new();
    match ravnest_node::process::describe_data(&scenario, &origin) {
        Ok(d) => text += &format!("{d}\n"),
        Err(e) => refused.push(e.to_string()),
    }
    let trains = ravnest_node::process::network_for_file(&scenario, &origin);
    match trains {
        Ok(m) if m.layers == scenario.model.layers => {
            text += &format!(
                "network: `{}`, {}\n",
                scenario.run.network, scenario.model.name
            );
        }
        Ok(m) => {
            text += &format!(
                "note: run trains network `{}` ({} layers), which is not the file's [model] `{}`; it plans for what it trains\n",
                scenario.run.network,
                m.layers.len(),
                scenario.model.name
            )
        }
        Err(e) => refused.push(e.to_string()),
    }
    text += &ravnest_node::process::precision_line(&scenario);
    for note in ignored_by_run(&scenario) {
        text += &format!("note: {note}\n");
    }
    refused.extend(run_checks(&origin, &scenario, device, out));
    emit(&text);
    if refused.is_empty() {
        emit("`ravnest run` would start with this file\n");
        return Ok(());
    }
    for r in &refused {
        eprintln!("error: {r}");
    }
    bail!(
        "`ravnest run` would refuse this file: {} problem(s) above",
        refused.len()
    )
}

/// The checks `run` makes before it starts anything: every node has an address, and this
/// build can use its device (a GPU needs a `--features cuda` build); another run's checkpoints
/// in the output folder need `--resume` or `--overwrite`.
fn run_checks(
    origin: &str,
    s: &Scenario,
    device: Option<&str>,
    (out, resume, overwrite): (Option<&Path>, bool, bool),
) -> Vec<String> {
    let mut refused = Vec::new();
    for (i, n) in s.cluster.nodes.iter().enumerate() {
        if n.address.is_none() {
            refused.push(format!(
                "{origin}: node `{}` has no `address`; `ravnest run` needs host:port for every node",
                n.name
            ));
        }
        if let Err(e) = ravnest_train::device::of_node(s, i, device).and_then(|d| d.check()) {
            refused.push(format!("{origin}: node `{}`: {e}", n.name));
        }
    }
    let out = out.map_or_else(
        || Path::new("ravnest-out").join(&s.cluster.name),
        Path::to_path_buf,
    );
    if !overwrite
        && let Err(e) = ravnest_train::store::guard(&out.join("checkpoints"), resume, false)
    {
        refused.push(e.to_string());
    }
    refused
}

/// What the file asks for that `run` does not do (the simulator's faults; mixed precision).
fn ignored_by_run(s: &Scenario) -> Vec<String> {
    let sim_only = s
        .faults
        .iter()
        .filter(|f| !matches!(f, ravnest_core::config::Fault::Slowdown { .. }))
        .count();
    let mut notes = Vec::new();
    if sim_only > 0 {
        notes.push(format!(
            "{sim_only} [[fault]] table(s) other than `slowdown` are the simulator's: `run` ignores them (`ravnest sim` injects them)"
        ));
    }
    notes
}

/// `ravnest sim`.
fn sim_command(cmd: SimCmd) -> Result<()> {
    let SimCmd {
        file,
        seed,
        steps,
        planner,
        compare,
        json,
        timeline,
        profile,
        report,
    } = cmd;
    let (origin, mut scenario) = match &file {
        Some(_) => load(file.as_deref())?,
        None => {
            let (name, text) = scenarios::SIM_DEFAULT;
            (name.to_string(), ravnest_core::parse(text, name)?)
        }
    };
    let measured = match &profile {
        Some(p) => Some(apply_profile(&mut scenario, p)?),
        None => None,
    };
    let mut opts = ravnest_sim::SimOptions::for_scenario(&scenario);
    if let Some(p) = &measured {
        opts.compute_spread = p.compute_spread(&scenario);
    }
    if let Some(s) = seed {
        opts.seed = s;
    }
    if let Some(n) = steps {
        opts.steps = n;
    }
    opts.planner = parse_planner(&planner)?;
    opts.progress = !json && std::io::IsTerminal::is_terminal(&std::io::stderr());
    let mut reports = vec![ravnest_sim::run(&scenario, &opts).with_context(|| origin.clone())?];
    if let Some(path) = &timeline {
        let r = &reports[0];
        let title = format!(
            "{} · planner {} · seed {} · {}/{} steps in {:.1} s · trace {:016x}",
            r.scenario,
            r.planner,
            r.seed,
            r.steps_completed,
            r.steps_requested,
            r.sim_time_s,
            r.trace_hash
        );
        std::fs::write(path, ravnest_sim::timeline::svg(&r.timeline, &title))
            .with_context(|| format!("cannot write `{}`", path.display()))?;
        eprintln!("timeline written to {}", path.display());
    }
    let page = report.unwrap_or_else(|| {
        PathBuf::from("ravnest-out")
            .join(&scenario.cluster.name)
            .join("sim")
            .join("report.html")
    });
    // (A page that cannot be written does not fail the simulation: it is said.)
    match view::sim_report(&reports[0], &page) {
        Ok(()) => eprintln!("report: {}", page.display()),
        Err(e) => eprintln!("warning: {e:#}"),
    }
    let mut compare_error = None;
    if let Some(other) = compare {
        let mut o = opts.clone();
        o.planner = parse_planner(&other)?;
        match ravnest_sim::run(&scenario, &o) {
            Ok(r) => reports.push(r),
            // The baseline not fitting is a result, not a failure of the command.
            Err(e) => compare_error = Some(format!("{other} cannot run this scenario: {e}")),
        }
    }
    if json {
        emit(&format!("{}\n", serde_json::to_string_pretty(&reports)?));
    } else {
        for r in &reports {
            emit(&format!("{}\n", report::sim_text(&origin, r)));
        }
        if reports.len() == 2 {
            emit(&report::sim_compare(&reports[0], &reports[1]));
        }
        if let Some(e) = &compare_error {
            emit(&format!("{e}\n"));
        }
    }
    if reports.iter().any(|r| !r.violations.is_empty()) {
        bail!(
            "checkers failed; replay with: ravnest sim {origin} --seed {} --steps {}",
            opts.seed,
            opts.steps
        );
    }
    Ok(())
}

/// `ravnest run`: the cluster file (from a path, a running node, or the embedded default),
/// then the local launcher or this process's node.
/// A fetched cluster file as `run` takes it: (origin, text, steps, newcomer, host); `--steps`
/// over the file's.
fn fetched(
    j: join::Joined,
    steps: Option<u64>,
) -> (
    String,
    String,
    Option<u64>,
    bool,
    Option<ravnest_core::NodeId>,
) {
    let steps = Some(steps.unwrap_or(j.steps));
    (j.origin, j.text, steps, j.newcomer, j.host)
}

/// `run`'s flags that do not go together.
fn flags_agree(
    timeline: bool,
    node: bool,
    cluster: &Option<String>,
    file: &Option<PathBuf>,
) -> Result<()> {
    if timeline && node {
        bail!(
            "--timeline draws a local cluster (started without --node): each node's activity is on its own machine"
        );
    }
    if let (Some(c), Some(p)) = (cluster, file) {
        bail!(
            "--cluster {c} names the cluster --discover finds when no file is given; with `{}`, the cluster is the file's `[cluster] name`",
            p.display()
        );
    }
    Ok(())
}

fn run_command(cmd: RunCmd) -> Result<()> {
    let RunCmd {
        file,
        node,
        join,
        resume,
        overwrite,
        wait,
        bind,
        advertise,
        device,
        out,
        steps,
        json,
        planner,
        timeline,
        report_spans,
        discover,
        cluster,
        discover_timeout,
        no_announce,
        dry_run,
        dashboard,
        tensorboard,
    } = cmd;
    let kind = parse_planner(&planner)?;
    if dry_run {
        return dry_run_command(
            file.as_deref(),
            kind,
            device.as_deref(),
            (out.as_deref(), resume, overwrite),
        );
    }
    if let Some(pid) = std::env::var(ravnest_node::process::LAUNCHER_PID)
        .ok()
        .and_then(|p| p.parse().ok())
        .filter(|_| node.is_some())
    {
        ravnest_node::process::die_with_launcher(pid);
    }
    flags_agree(timeline.is_some(), node.is_some(), &cluster, &file)?;
    // --discover without a file finds a cluster to join; with one, it announces its nodes.
    let find = discover && file.is_none();
    let seed = join.as_deref().filter(|a| !a.is_empty());
    let (origin, text, steps, newcomer, host) = match (&file, seed) {
        (None, None) if find => {
            let Some(me) = node.as_deref() else {
                bail!(
                    "--discover without a cluster file finds a running cluster to join as one of its nodes: name it with --node NAME (to announce the nodes of a file instead: ravnest run FILE --discover)"
                );
            };
            let wait = discover_timeout.map_or(ravnest_node::discover::DEFAULT_TIMEOUT, |s| {
                std::time::Duration::from_secs(s)
            });
            let j =
                join::discover_cluster_file(cluster.as_deref(), me, advertise.as_deref(), wait)?;
            fetched(j, steps)
        }
        (Some(p), Some(a)) => bail!(
            "give a cluster file or --join {a}, not both (`{}` and the file fetched from {a} could differ)",
            p.display()
        ),
        (None, Some(a)) => {
            let Some(me) = node.as_deref() else {
                bail!("--join {a}: name the node this process is with --node NAME");
            };
            // As long as a worker waits for its cluster (`--wait`), 60 s unless said.
            let patience = std::time::Duration::from_secs(wait.unwrap_or(60));
            fetched(
                join::fetch_cluster_file(a, me, advertise.as_deref(), patience)?,
                steps,
            )
        }
        (None, None) => (
            scenarios::RUN_DEFAULT.0.to_string(),
            scenarios::RUN_DEFAULT.1.to_string(),
            steps,
            false,
            None,
        ),
        (Some(p), None) => (
            p.display().to_string(),
            std::fs::read_to_string(p).with_context(|| format!("cannot read `{}`", p.display()))?,
            steps,
            false,
            None,
        ),
    };
    run::run(run::RunArgs {
        origin,
        text,
        node,
        join: join.is_some() || find,
        newcomer,
        host,
        resume,
        overwrite,
        wait,
        bind,
        advertise,
        device,
        out,
        json,
        steps,
        planner,
        timeline,
        spans: report_spans,
        dashboard,
        tensorboard,
        announce: if no_announce {
            ravnest_node::discover::Announce::Never
        } else if discover {
            ravnest_node::discover::Announce::Always
        } else {
            ravnest_node::discover::Announce::Reachable
        },
    })
}

/// Write to stdout; a closed pipe (`ravnest sim | head`) ends the program quietly instead of
/// panicking as `print!` would.
fn emit(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: cannot write to stdout: {e}");
        std::process::exit(2);
    }
}

fn parse_planner(name: &str) -> Result<PlannerKind> {
    match PlannerKind::parse(name) {
        Some(k) => Ok(k),
        None => {
            let names: Vec<&str> = PlannerKind::ALL.iter().map(|k| k.as_str()).collect();
            match ravnest_core::config::nearest(name, names.iter().copied()) {
                Some(n) => bail!(
                    "unknown planner `{name}`\n  help: did you mean `{n}`? valid: {}",
                    names.join(", ")
                ),
                None => bail!(
                    "unknown planner `{name}`\n  help: valid: {}",
                    names.join(", ")
                ),
            }
        }
    }
}

/// The given scenario files, or every shipped scenario but those in `skip`.
fn bench_inputs(files: &[PathBuf], skip: &[&str]) -> Result<Vec<(String, Scenario)>> {
    if files.is_empty() {
        scenarios::SHIPPED
            .iter()
            .filter(|(name, _)| !skip.contains(name))
            .map(|(name, text)| Ok((name.to_string(), ravnest_core::parse(text, name)?)))
            .collect()
    } else {
        files.iter().map(|f| load(Some(f))).collect()
    }
}

/// Put a measured profile (`ravnest run`'s `profile.toml`) over `scenario`'s cluster; its
/// notes (nodes it does not name, another global batch) go to stderr.
fn apply_profile(scenario: &mut Scenario, path: &Path) -> Result<ravnest_core::profile::Profile> {
    let origin = path.display().to_string();
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the profile `{origin}`"))?;
    let profile = ravnest_core::profile::Profile::parse(&text, &origin)?;
    for note in profile.apply(scenario, &origin)? {
        eprintln!("note: {note}");
    }
    let m = &profile.profile;
    eprintln!(
        "profile {origin}: measured on `{}` over steps {}..{}: {:.0} samples/s, ring {:.2} ms per step",
        m.cluster,
        m.steps[0],
        m.steps[1],
        m.samples_per_s,
        m.ring_s * 1e3
    );
    Ok(profile)
}

/// Read and parse a scenario; `None` is the embedded default.
fn load(path: Option<&Path>) -> Result<(String, Scenario)> {
    let (origin, text) = match path {
        None => (
            scenarios::DEFAULT.0.to_string(),
            scenarios::DEFAULT.1.to_string(),
        ),
        Some(p) => {
            let origin = p.display().to_string();
            let text =
                std::fs::read_to_string(p).with_context(|| format!("cannot read `{origin}`"))?;
            (origin, text)
        }
    };
    let scenario = ravnest_train::folder::parse_scenario(&text, &origin)?;
    Ok((origin, scenario))
}

/// One compute thread on both sides of a one-node bench (candle reads RAYON_NUM_THREADS at
/// each product; PyTorch is told set_num_threads(1)): run this command again with it set, if
/// it is not.
fn one_thread() -> Result<()> {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        return compute_threads(1);
    }
    Ok(())
}

/// `threads` compute threads for this process (candle's rayon pool): run this command again
/// with `RAYON_NUM_THREADS` set to it, unless it is already.
fn compute_threads(threads: usize) -> Result<()> {
    let want = threads.to_string();
    if std::env::var("RAYON_NUM_THREADS").ok().as_deref() != Some(want.as_str()) {
        let status = std::process::Command::new(std::env::current_exe()?)
            .args(std::env::args_os().skip(1))
            .env("RAYON_NUM_THREADS", &want)
            .status()
            .with_context(|| format!("cannot restart with RAYON_NUM_THREADS={want}"))?;
        std::process::exit(status.code().unwrap_or(2));
    }
    Ok(())
}

#[cfg(test)]
mod tests;

//! The `cluster.toml` / scenario format: parsing and validation, from text (no file I/O here).
//!
//! One format serves `plan`, `run` and `sim`: a scenario is a cluster file plus `[sim]` and
//! `[[fault]]` tables. Every error names the file, the line and column, and, for a misspelt key,
//! device or preset, the nearest valid name. The format is documented in `docs/cluster-format.md`.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ops::Range;

use serde::Deserialize;
use toml::Spanned;

use crate::cluster::{ClusterSpec, Link, NodeId, NodeSpec, SyncPreference, TrainingSpec};
use crate::device::{self, GIB};
use crate::model::{self, LayerSpec, ModelSpec, Optimizer, Precision};

/// A configuration error with its place in the file.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub struct ConfigError {
    /// File name (or `<embedded>`).
    pub origin: String,
    /// 1-based line and column, when the error has a place.
    pub at: Option<(usize, usize)>,
    /// What is wrong.
    pub message: String,
    /// A hint: the nearest valid name, or what is allowed.
    pub help: Option<String>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.at {
            Some((line, col)) => write!(f, "{}:{line}:{col}: {}", self.origin, self.message)?,
            None => write!(f, "{}: {}", self.origin, self.message)?,
        }
        if let Some(help) = &self.help {
            write!(f, "\n  help: {help}")?;
        }
        Ok(())
    }
}

/// A fault to inject in `sim` (validated now; executed by the simulator).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Fault {
    /// The node's process dies at `at_s`.
    Crash {
        /// Node.
        node: NodeId,
        /// Virtual seconds.
        at_s: f64,
    },
    /// A crashed node restarts and rejoins at `at_s`.
    Restart {
        /// Node.
        node: NodeId,
        /// Virtual seconds.
        at_s: f64,
    },
    /// The node computes `factor` times slower between `from_s` and `to_s`.
    Slowdown {
        /// Node.
        node: NodeId,
        /// Multiplier on compute time (> 0).
        factor: f64,
        /// Start, virtual seconds.
        from_s: f64,
        /// End, virtual seconds.
        to_s: f64,
    },
    /// The link between two nodes takes other figures between `from_s` and `to_s`.
    LinkDegraded {
        /// One end.
        a: NodeId,
        /// Other end.
        b: NodeId,
        /// The degraded link.
        link: Link,
        /// Start, virtual seconds.
        from_s: f64,
        /// End, virtual seconds.
        to_s: f64,
    },
    /// The connection between two nodes is reset at `at_s`: what was in flight on it, in both
    /// directions, is lost (both nodes stay up; the protocol must notice and redo).
    Reset {
        /// One end.
        a: NodeId,
        /// Other end.
        b: NodeId,
        /// Virtual seconds.
        at_s: f64,
    },
    /// No messages cross between groups between `from_s` and `to_s`.
    Partition {
        /// Disjoint groups of nodes.
        groups: Vec<Vec<NodeId>>,
        /// Start, virtual seconds.
        from_s: f64,
        /// End, virtual seconds.
        to_s: f64,
    },
}

/// Settings that only `sim` reads.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct SimSettings {
    /// Seed of the run.
    pub seed: u64,
    /// Training steps to simulate.
    pub steps: u64,
    /// Checkpoint every this many steps (0: never).
    pub checkpoint_every_steps: u64,
}

/// Settings that only `run` reads.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RunSettings {
    /// Cluster secret (HMAC key), if any.
    pub secret: Option<String>,
    /// Coordinator node.
    pub coordinator: Option<NodeId>,
    /// Per-node compute slowdown to emulate a slower device (1.0 = none), by node index.
    pub emulate_slowdown: Vec<f64>,
    /// Each node's `device` as written (`cpu`, `cuda:1`, `rtx3090`), by node index: where
    /// `ravnest run` computes (the catalog id in [`NodeSpec::device`] is what the planner uses).
    pub devices: Vec<String>,
    /// Training steps.
    pub steps: u64,
    /// Learning rate.
    pub learning_rate: f64,
    /// Momentum (SGD with momentum) or β1 (AdamW).
    pub momentum: f64,
    /// Decoupled weight decay (AdamW).
    pub weight_decay: f64,
    /// Seed of the weight initialization and the data order.
    pub seed: u64,
    /// `"digits"` (embedded) or a path: a CSV file (features then label per row) or an IDX
    /// images file (its labels file beside it).
    pub dataset: String,
    /// The network that `run` trains: `"mlp"` (the [model]'s dims), `"cnn"`, or `"char"` (a
    /// character model over a text file).
    pub network: String,
    /// Characters of context the `"char"` network sees.
    pub context_chars: u64,
    /// Hidden width of the `"char"` network.
    pub char_hidden: u64,
    /// Checkpoint every this many steps (0: only at the end).
    pub checkpoint_every_steps: u64,
    /// Test accuracy the run reports against (and the demo test requires).
    pub target_accuracy: f64,
    /// Heartbeat period, ms.
    pub heartbeat_ms: u64,
    /// Heartbeat silence after which a node is declared dead, ms.
    pub heartbeat_timeout_ms: u64,
    /// Nodes that must register before training starts (`None`: every node of the file); a
    /// run with fewer fails at the end of the registration window.
    pub min_nodes: Option<u64>,
    /// How long the coordinator waits for nodes to register, and a worker for the
    /// coordinator's first word, s.
    pub register_timeout_s: u64,
}

impl Default for RunSettings {
    fn default() -> Self {
        RunSettings {
            secret: None,
            coordinator: None,
            emulate_slowdown: Vec::new(),
            devices: Vec::new(),
            steps: 300,
            learning_rate: 0.05,
            momentum: 0.9,
            weight_decay: 0.0,
            seed: 0,
            dataset: "digits".into(),
            network: "mlp".into(),
            context_chars: 16,
            char_hidden: 256,
            checkpoint_every_steps: 100,
            target_accuracy: 0.9,
            heartbeat_ms: 100,
            heartbeat_timeout_ms: 1500,
            min_nodes: None,
            register_timeout_s: 60,
        }
    }
}

/// Everything one file describes.
#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    /// The cluster.
    pub cluster: ClusterSpec,
    /// The model.
    pub model: ModelSpec,
    /// Training settings.
    pub training: TrainingSpec,
    /// `run` settings.
    pub run: RunSettings,
    /// `sim` settings, when the file has a `[sim]` table.
    pub sim: Option<SimSettings>,
    /// Faults, in file order.
    pub faults: Vec<Fault>,
}

// ---------------------------------------------------------------------------------------------
// The file as written.

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileToml {
    cluster: Option<ClusterToml>,
    links: Option<LinksToml>,
    #[serde(default)]
    node: Vec<Spanned<NodeToml>>,
    model: Option<Spanned<ModelToml>>,
    training: Option<TrainingToml>,
    run: Option<RunToml>,
    sim: Option<SimToml>,
    #[serde(default)]
    fault: Vec<Spanned<FaultToml>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ClusterToml {
    name: Option<String>,
    secret: Option<String>,
    coordinator: Option<Spanned<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LinksToml {
    bandwidth_gbps: Option<Spanned<f64>>,
    latency_ms: Option<Spanned<f64>>,
    #[serde(default)]
    pair: Vec<Spanned<PairToml>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PairToml {
    between: Spanned<Vec<Spanned<String>>>,
    bandwidth_gbps: Option<Spanned<f64>>,
    latency_ms: Option<Spanned<f64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeToml {
    name: Spanned<String>,
    device: Spanned<String>,
    count: Option<Spanned<u32>>,
    memory_gib: Option<Spanned<f64>>,
    tflops: Option<Spanned<f64>>,
    bandwidth_gbps: Option<Spanned<f64>>,
    latency_ms: Option<Spanned<f64>>,
    address: Option<Spanned<String>>,
    listen: Option<Spanned<String>>,
    emulate_slowdown: Option<Spanned<f64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelToml {
    preset: Option<Spanned<String>>,
    kind: Option<Spanned<String>>,
    name: Option<String>,
    // gpt
    layers: Option<Spanned<u32>>,
    hidden: Option<Spanned<u64>>,
    heads: Option<Spanned<u64>>,
    seq_len: Option<Spanned<u64>>,
    vocab: Option<Spanned<u64>>,
    flash_attention: Option<bool>,
    // mlp
    dims: Option<Spanned<Vec<u64>>>,
    // custom
    #[serde(default)]
    layer: Vec<Spanned<LayerToml>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LayerToml {
    name: String,
    params: u64,
    fwd_flops_per_sample: Spanned<f64>,
    activation_elems_per_sample: u64,
    output_elems_per_sample: u64,
    repeat: Option<Spanned<u32>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TrainingToml {
    global_batch: Option<Spanned<u32>>,
    micro_batch: Option<Spanned<u32>>,
    optimizer: Option<Optimizer>,
    precision: Option<Precision>,
    sync: Option<SyncPreference>,
    local_sgd_threshold: Option<Spanned<f64>>,
    memory_reserve_gib: Option<Spanned<f64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RunToml {
    steps: Option<Spanned<u64>>,
    learning_rate: Option<Spanned<f64>>,
    momentum: Option<Spanned<f64>>,
    weight_decay: Option<Spanned<f64>>,
    seed: Option<u64>,
    dataset: Option<String>,
    network: Option<Spanned<String>>,
    context_chars: Option<Spanned<u64>>,
    char_hidden: Option<Spanned<u64>>,
    checkpoint_every_steps: Option<u64>,
    target_accuracy: Option<Spanned<f64>>,
    heartbeat_ms: Option<Spanned<u64>>,
    heartbeat_timeout_ms: Option<Spanned<u64>>,
    min_nodes: Option<Spanned<u64>>,
    register_timeout_s: Option<Spanned<u64>>,
}

const NETWORKS: &[&str] = &["mlp", "cnn", "char"];

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SimToml {
    seed: Option<u64>,
    steps: Option<Spanned<u64>>,
    checkpoint_every_steps: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FaultToml {
    kind: Spanned<String>,
    node: Option<Spanned<String>>,
    between: Option<Spanned<Vec<Spanned<String>>>>,
    groups: Option<Spanned<Vec<Vec<Spanned<String>>>>>,
    at_s: Option<Spanned<f64>>,
    from_s: Option<Spanned<f64>>,
    to_s: Option<Spanned<f64>>,
    factor: Option<Spanned<f64>>,
    bandwidth_gbps: Option<Spanned<f64>>,
    latency_ms: Option<Spanned<f64>>,
}

const FAULT_KINDS: &[&str] = &["crash", "restart", "slowdown", "link", "reset", "partition"];
const MODEL_KINDS: &[&str] = &["gpt", "mlp", "custom"];

/// Default access link when `[links]` says nothing: 10 Gbit/s Ethernet, 0.1 ms.
pub const DEFAULT_LINK: Link = Link {
    bandwidth_gbps: 10.0,
    latency_ms: 0.1,
};

/// Default checkpoint period of `sim`, in steps.
pub const DEFAULT_CHECKPOINT_EVERY_STEPS: u64 = 50;

/// Memory kept back on every node for the framework (CUDA context, allocator slack), GiB.
pub const DEFAULT_MEMORY_RESERVE_GIB: f64 = 1.0;

// ---------------------------------------------------------------------------------------------
// Parsing.

struct Ctx<'a> {
    origin: &'a str,
    text: &'a str,
}

impl Ctx<'_> {
    fn loc(&self, span: &Range<usize>) -> (usize, usize) {
        let start = span.start.min(self.text.len());
        let before = &self.text[..start];
        let line = before.matches('\n').count() + 1;
        let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        (line, col)
    }

    fn err(&self, span: Option<&Range<usize>>, message: impl Into<String>) -> ConfigError {
        ConfigError {
            origin: self.origin.to_string(),
            at: span.map(|s| self.loc(s)),
            message: message.into(),
            help: None,
        }
    }

    fn positive<T: Figure>(&self, v: &Spanned<T>, what: &str) -> Result<T, ConfigError> {
        let x = *v.get_ref();
        // (NaN compares as nothing: it is not greater than 0.)
        if x.partial_cmp(&T::default()) != Some(std::cmp::Ordering::Greater) {
            return Err(self.err(
                Some(&v.span()),
                format!("`{what}` must be greater than 0, got {}", x.show()),
            ));
        }
        x.sane(what).map_err(|m| self.err(Some(&v.span()), m))
    }

    fn non_negative(&self, v: &Spanned<f64>, what: &str) -> Result<f64, ConfigError> {
        let x = *v.get_ref();
        if x.is_nan() || x < 0.0 {
            return Err(self.err(
                Some(&v.span()),
                format!("`{what}` must be 0 or more, got {}", x.show()),
            ));
        }
        x.sane(what).map_err(|m| self.err(Some(&v.span()), m))
    }
}

/// A number of the file: shown in human units, and refused when no real cluster has it.
trait Figure: Copy + PartialOrd + Default {
    /// The number as a message shows it (no 300-digit numbers).
    fn show(self) -> String;
    /// Finite and below the largest value a real `what` can have, or why not.
    fn sane(self, what: &str) -> Result<Self, String>;
}

impl Figure for u64 {
    fn show(self) -> String {
        self.to_string()
    }
    fn sane(self, _: &str) -> Result<u64, String> {
        Ok(self)
    }
}

impl Figure for u32 {
    fn show(self) -> String {
        self.to_string()
    }
    fn sane(self, _: &str) -> Result<u32, String> {
        Ok(self)
    }
}

/// The largest value a field can sensibly have (beyond it, a unit is wrong): what a node,
/// link or run of any real cluster stays far below.
fn largest(what: &str) -> f64 {
    match what {
        "tflops" => 100_000.0,                              // 100 PFLOP/s for one node
        "memory_gib" | "memory_reserve_gib" => 1_048_576.0, // 1 PiB
        "bandwidth_gbps" => 1_000_000.0,                    // 1 Pbit/s
        "latency_ms" => 3_600_000.0,                        // an hour
        "emulate_slowdown" | "factor" => 1_000_000.0,
        "learning_rate" => 1_000.0,
        _ => 1e18,
    }
}

impl Figure for f64 {
    fn show(self) -> String {
        if self != 0.0 && self.is_finite() && !(1e-3..1e7).contains(&self.abs()) {
            format!("{self:.3e}")
        } else {
            format!("{self}")
        }
    }
    fn sane(self, what: &str) -> Result<f64, String> {
        if !self.is_finite() {
            return Err(format!("`{what}` must be a finite number, got {self}"));
        }
        let max = largest(what);
        if self > max {
            return Err(format!(
                "`{what}` = {} is beyond any real cluster (at most {}): check its unit",
                self.show(),
                max.show()
            ));
        }
        Ok(self)
    }
}

fn with_help(mut e: ConfigError, help: Option<String>) -> ConfigError {
    e.help = help;
    e
}

/// Levenshtein distance, for "did you mean".
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The candidate nearest to `word`, if it is near enough to be a plausible typo.
pub fn nearest<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let lw = word.to_lowercase();
    candidates
        .into_iter()
        .map(|c| (edit_distance(&lw, &c.to_lowercase()), c))
        .filter(|(d, c)| *d <= (c.len() / 3).max(2))
        .min_by_key(|(d, _)| *d)
        .map(|(_, c)| c)
}

fn did_you_mean<'a>(word: &str, candidates: impl IntoIterator<Item = &'a str> + Clone) -> String {
    let all: Vec<&str> = candidates.clone().into_iter().collect();
    match nearest(word, candidates) {
        Some(n) => format!("did you mean `{n}`? valid: {}", all.join(", ")),
        None => format!("valid: {}", all.join(", ")),
    }
}

/// Turn serde's "unknown field `x`, expected one of `a`, `b`" into a suggestion.
fn suggestion_from_serde(message: &str) -> Option<String> {
    let unknown = ["unknown field `", "unknown variant `"]
        .iter()
        .find_map(|p| message.split_once(p))?
        .1
        .split('`')
        .next()?
        .to_string();
    let expected = message.split_once("expected")?.1;
    let names: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
    if names.is_empty() {
        return None;
    }
    Some(did_you_mean(&unknown, names))
}

/// Parse and validate a cluster or scenario file. `origin` names it in errors.
pub fn parse(text: &str, origin: &str) -> Result<Scenario, ConfigError> {
    let ctx = Ctx { origin, text };
    let file: FileToml = toml::from_str(text).map_err(|e| {
        let msg = e.message().trim().to_string();
        let help = suggestion_from_serde(&msg);
        with_help(ctx.err(e.span().as_ref(), msg), help)
    })?;
    resolve(&ctx, file)
}

fn resolve(ctx: &Ctx<'_>, file: FileToml) -> Result<Scenario, ConfigError> {
    let default_link = resolve_default_link(ctx, file.links.as_ref())?;
    // Training (needed before nodes: precision decides throughput, reserve decides memory).
    let (training, reserve_gib) = resolve_training(ctx, file.training.as_ref())?;
    let defaults = NodeDefaults {
        precision: training.precision,
        reserve_gib,
        link: default_link,
    };
    let Nodes {
        specs: nodes,
        raw_devices,
        slowdown,
        index,
    } = resolve_nodes(ctx, &file.node, &defaults)?;
    let lookup_node = |s: &Spanned<String>| find_node(ctx, &index, s);
    let pair_links = resolve_pair_links(ctx, file.links.as_ref(), default_link, &lookup_node)?;

    let cluster_name = cluster_name(ctx, file.cluster.as_ref());
    let coordinator = match file.cluster.as_ref().and_then(|c| c.coordinator.as_ref()) {
        Some(c) => Some(lookup_node(c)?),
        None => None,
    };
    let run = RunSettings {
        secret: file.cluster.as_ref().and_then(|c| c.secret.clone()),
        coordinator,
        emulate_slowdown: slowdown,
        devices: raw_devices,
        ..RunSettings::default()
    };
    let run = resolve_run(ctx, file.run.as_ref(), run, nodes.len())?;

    let model = resolve_model(ctx, file.model.as_ref())?;
    let sim = resolve_sim(ctx, file.sim.as_ref())?;

    let mut faults = Vec::new();
    for f in &file.fault {
        faults.push(resolve_fault(ctx, f, &lookup_node)?);
    }

    Ok(Scenario {
        cluster: ClusterSpec {
            name: cluster_name,
            nodes,
            pair_links,
        },
        model,
        training,
        run,
        sim,
        faults,
    })
}

/// The access link of nodes that name none: `[links]`'s figures over [`DEFAULT_LINK`].
fn resolve_default_link(ctx: &Ctx<'_>, links: Option<&LinksToml>) -> Result<Link, ConfigError> {
    let mut default_link = DEFAULT_LINK;
    if let Some(l) = links {
        if let Some(b) = &l.bandwidth_gbps {
            default_link.bandwidth_gbps = ctx.positive(b, "bandwidth_gbps")?;
        }
        if let Some(x) = &l.latency_ms {
            default_link.latency_ms = ctx.non_negative(x, "latency_ms")?;
        }
    }
    Ok(default_link)
}

/// The `[training]` table over [`TrainingSpec::default`], and the memory reserve (GiB).
fn resolve_training(
    ctx: &Ctx<'_>,
    t: Option<&TrainingToml>,
) -> Result<(TrainingSpec, f64), ConfigError> {
    let mut training = TrainingSpec::default();
    let mut reserve_gib = DEFAULT_MEMORY_RESERVE_GIB;
    if let Some(t) = t {
        if let Some(b) = &t.global_batch {
            training.global_batch = ctx.positive(b, "global_batch")?;
        }
        if let Some(m) = &t.micro_batch {
            training.micro_batch = ctx.positive(m, "micro_batch")?;
        }
        if let Some(o) = t.optimizer {
            training.optimizer = o;
        }
        if let Some(p) = t.precision {
            training.precision = p;
        }
        if let Some(s) = t.sync {
            training.sync = s;
        }
        if let Some(x) = &t.local_sgd_threshold {
            training.local_sgd_threshold = ctx.positive(x, "local_sgd_threshold")?;
        }
        if let Some(r) = &t.memory_reserve_gib {
            reserve_gib = ctx.non_negative(r, "memory_reserve_gib")?;
        }
    }
    Ok((training, reserve_gib))
}

/// What every `[[node]]` takes from the rest of the file.
struct NodeDefaults {
    /// Training precision: decides a catalog device's throughput.
    precision: Precision,
    /// Memory kept back on every node, GiB.
    reserve_gib: f64,
    /// Access link of a node that names none.
    link: Link,
}

/// The nodes of the file, each `count` expanded, in id order.
struct Nodes {
    /// The nodes.
    specs: Vec<NodeSpec>,
    /// Each node's `device` as written, by node index.
    raw_devices: Vec<String>,
    /// Each node's `emulate_slowdown`, by node index.
    slowdown: Vec<f64>,
    /// Node ids by name.
    index: BTreeMap<String, NodeId>,
}

/// One `[[node]]` table's figures, before its `count` is expanded.
struct NodeFigures {
    dev: &'static device::DeviceSpec,
    count: u32,
    memory_gib: f64,
    flops: f64,
    emulate: f64,
    link: Link,
}

/// The `[[node]]` tables, checked and expanded.
fn resolve_nodes(
    ctx: &Ctx<'_>,
    tables: &[Spanned<NodeToml>],
    defaults: &NodeDefaults,
) -> Result<Nodes, ConfigError> {
    if tables.is_empty() {
        return Err(with_help(
            ctx.err(None, "the cluster has no nodes"),
            Some("add at least one [[node]] table with `name` and `device`".into()),
        ));
    }
    let mut out = Nodes {
        specs: Vec::new(),
        raw_devices: Vec::new(),
        slowdown: Vec::new(),
        index: BTreeMap::new(),
    };
    for n in tables {
        let figures = node_figures(ctx, n, defaults)?;
        let n = n.get_ref();
        check_addresses(ctx, n, figures.count, &out.specs)?;
        push_nodes(ctx, n, &figures, defaults.reserve_gib, &mut out)?;
    }
    Ok(out)
}

/// A `[[node]]` table's device, count, memory, throughput, slowdown and link.
fn node_figures(
    ctx: &Ctx<'_>,
    n: &Spanned<NodeToml>,
    defaults: &NodeDefaults,
) -> Result<NodeFigures, ConfigError> {
    let span = n.span();
    let n = n.get_ref();
    let reserve_gib = defaults.reserve_gib;
    let dev_name = n.device.get_ref();
    let dev = device::lookup(dev_name).ok_or_else(|| {
        with_help(
            ctx.err(
                Some(&n.device.span()),
                format!("unknown device `{dev_name}`"),
            ),
            Some(did_you_mean(dev_name, device::ids())),
        )
    })?;
    let count = match &n.count {
        Some(c) => ctx.positive(c, "count")?,
        None => 1,
    };
    let memory_gib = match &n.memory_gib {
        Some(m) => ctx.positive(m, "memory_gib")?,
        None => dev.memory_gib,
    };
    if memory_gib <= reserve_gib {
        return Err(ctx.err(
            Some(&span),
            format!(
                "node `{}` has {memory_gib} GiB, not more than the {reserve_gib} GiB reserve \
                 (`memory_reserve_gib` in [training])",
                n.name.get_ref()
            ),
        ));
    }
    let flops = match &n.tflops {
        Some(t) => ctx.positive(t, "tflops")? * 1e12,
        None => dev.effective_flops(defaults.precision).ok_or_else(|| {
            with_help(
                ctx.err(
                    Some(&n.device.span()),
                    format!(
                        "device `{}` has no {} support",
                        dev.id,
                        defaults.precision.as_str()
                    ),
                ),
                Some("use precision = \"fp32\" (or \"fp16\" on pre-Ampere GPUs), or set `tflops` for this node".into()),
            )
        })?,
    };
    let emulate = match &n.emulate_slowdown {
        Some(e) => ctx.positive(e, "emulate_slowdown")?,
        None => 1.0,
    };
    let mut link = defaults.link;
    if let Some(b) = &n.bandwidth_gbps {
        link.bandwidth_gbps = ctx.positive(b, "bandwidth_gbps")?;
    }
    if let Some(x) = &n.latency_ms {
        link.latency_ms = ctx.non_negative(x, "latency_ms")?;
    }
    Ok(NodeFigures {
        dev,
        count,
        memory_gib,
        flops,
        emulate,
        link,
    })
}

/// A `[[node]]` table's `listen` and `address`: one machine each, no address taken twice.
fn check_addresses(
    ctx: &Ctx<'_>,
    n: &NodeToml,
    count: u32,
    earlier: &[NodeSpec],
) -> Result<(), ConfigError> {
    if let Some(listen) = &n.listen
        && (n.address.is_none() || count > 1)
    {
        return Err(ctx.err(
            Some(&listen.span()),
            "`listen` (the local address to bind) goes with one node's `address` (the one peers dial)",
        ));
    }
    if let Some(address) = &n.address
        && count > 1
    {
        return Err(ctx.err(
            Some(&address.span()),
            "`address` names one machine; it cannot go with `count` > 1",
        ));
    }
    if let Some(address) = &n.address
        && let Some(other) = earlier
            .iter()
            .find(|o: &&NodeSpec| o.address.as_deref() == Some(address.get_ref().as_str()))
    {
        return Err(ctx.err(
            Some(&address.span()),
            format!(
                "node `{}` has the same address as node `{}` ({}): each node listens on its own",
                n.name.get_ref(),
                other.name,
                address.get_ref()
            ),
        ));
    }
    Ok(())
}

/// Add a `[[node]]` table's `count` nodes (`name`, or `name-0`, `name-1`, ..) to `out`.
fn push_nodes(
    ctx: &Ctx<'_>,
    n: &NodeToml,
    figures: &NodeFigures,
    reserve_gib: f64,
    out: &mut Nodes,
) -> Result<(), ConfigError> {
    let count = figures.count;
    let base = n.name.get_ref().trim();
    if base.is_empty() {
        return Err(ctx.err(Some(&n.name.span()), "node `name` is empty"));
    }
    for i in 0..count {
        let name = if count == 1 {
            base.to_string()
        } else {
            format!("{base}-{i}")
        };
        let id = NodeId(out.specs.len() as u32);
        if out.index.insert(name.clone(), id).is_some() {
            return Err(ctx.err(
                Some(&n.name.span()),
                format!("duplicate node name `{name}`"),
            ));
        }
        out.specs.push(NodeSpec {
            name,
            device: figures.dev.id.to_string(),
            memory_bytes: ((figures.memory_gib - reserve_gib) * GIB) as u64,
            flops: figures.flops / figures.emulate,
            link: figures.link,
            step_overhead_s: 0.0,
            address: n.address.as_ref().map(|a| a.get_ref().clone()),
            listen: n.listen.as_ref().map(|a| a.get_ref().clone()),
        });
        out.slowdown.push(figures.emulate);
        out.raw_devices.push(n.device.get_ref().clone());
    }
    Ok(())
}

/// The id of the node a name refers to, or an error suggesting the nearest name.
fn find_node(
    ctx: &Ctx<'_>,
    index: &BTreeMap<String, NodeId>,
    s: &Spanned<String>,
) -> Result<NodeId, ConfigError> {
    index.get(s.get_ref().as_str()).copied().ok_or_else(|| {
        with_help(
            ctx.err(Some(&s.span()), format!("unknown node `{}`", s.get_ref())),
            nearest(s.get_ref(), index.keys().map(String::as_str))
                .map(|n| format!("did you mean `{n}`?")),
        )
    })
}

/// The `[[links.pair]]` tables: links between two nodes, over the default link.
fn resolve_pair_links(
    ctx: &Ctx<'_>,
    links: Option<&LinksToml>,
    default_link: Link,
    lookup_node: &dyn Fn(&Spanned<String>) -> Result<NodeId, ConfigError>,
) -> Result<BTreeMap<(NodeId, NodeId), Link>, ConfigError> {
    let mut pair_links = BTreeMap::new();
    if let Some(l) = links {
        for p in &l.pair {
            let p = p.get_ref();
            let ends = p.between.get_ref();
            if ends.len() != 2 {
                return Err(ctx.err(
                    Some(&p.between.span()),
                    format!("`between` takes exactly two node names, got {}", ends.len()),
                ));
            }
            let (a, b) = (lookup_node(&ends[0])?, lookup_node(&ends[1])?);
            if a == b {
                return Err(ctx.err(
                    Some(&p.between.span()),
                    "`between` names the same node twice",
                ));
            }
            let mut link = default_link;
            if let Some(x) = &p.bandwidth_gbps {
                link.bandwidth_gbps = ctx.positive(x, "bandwidth_gbps")?;
            }
            if let Some(x) = &p.latency_ms {
                link.latency_ms = ctx.non_negative(x, "latency_ms")?;
            }
            pair_links.insert((a.min(b), a.max(b)), link);
        }
    }
    Ok(pair_links)
}

/// `[cluster] name`, else the file name without its directory and `.toml`.
fn cluster_name(ctx: &Ctx<'_>, cluster: Option<&ClusterToml>) -> String {
    cluster.and_then(|c| c.name.clone()).unwrap_or_else(|| {
        ctx.origin
            .rsplit('/')
            .next()
            .unwrap_or("cluster")
            .trim_end_matches(".toml")
            .to_string()
    })
}

/// The `[run]` table over `run` (defaults and what the cluster section gave); `node_count`
/// bounds `min_nodes`.
fn resolve_run(
    ctx: &Ctx<'_>,
    r: Option<&RunToml>,
    mut run: RunSettings,
    node_count: usize,
) -> Result<RunSettings, ConfigError> {
    let Some(r) = r else {
        return Ok(run);
    };
    if let Some(x) = &r.steps {
        run.steps = ctx.positive(x, "steps")?;
    }
    if let Some(x) = &r.learning_rate {
        run.learning_rate = ctx.positive(x, "learning_rate")?;
    }
    if let Some(x) = &r.momentum {
        run.momentum = ctx.non_negative(x, "momentum")?;
        if run.momentum >= 1.0 {
            return Err(ctx.err(Some(&x.span()), "`momentum` must be below 1"));
        }
    }
    if let Some(x) = &r.weight_decay {
        run.weight_decay = ctx.non_negative(x, "weight_decay")?;
    }
    if let Some(x) = r.seed {
        run.seed = x;
    }
    if let Some(x) = &r.dataset {
        run.dataset = x.clone();
    }
    if let Some(x) = &r.network {
        if !NETWORKS.contains(&x.get_ref().as_str()) {
            return Err(with_help(
                ctx.err(
                    Some(&x.span()),
                    format!("unknown network `{}`", x.get_ref()),
                ),
                Some(did_you_mean(x.get_ref(), NETWORKS.iter().copied())),
            ));
        }
        run.network = x.get_ref().clone();
    }
    if let Some(x) = &r.context_chars {
        run.context_chars = ctx.positive(x, "context_chars")?;
    }
    if let Some(x) = &r.char_hidden {
        run.char_hidden = ctx.positive(x, "char_hidden")?;
    }
    if let Some(x) = r.checkpoint_every_steps {
        run.checkpoint_every_steps = x;
    }
    if let Some(x) = &r.target_accuracy {
        run.target_accuracy = ctx.positive(x, "target_accuracy")?;
    }
    if let Some(x) = &r.heartbeat_ms {
        run.heartbeat_ms = ctx.positive(x, "heartbeat_ms")?;
    }
    if let Some(x) = &r.heartbeat_timeout_ms {
        run.heartbeat_timeout_ms = ctx.positive(x, "heartbeat_timeout_ms")?;
    }
    if let Some(x) = &r.register_timeout_s {
        run.register_timeout_s = ctx.positive(x, "register_timeout_s")?;
    }
    if let Some(x) = &r.min_nodes {
        let n = ctx.positive(x, "min_nodes")?;
        if n > node_count as u64 {
            return Err(ctx.err(
                Some(&x.span()),
                format!("`min_nodes` is {n}, but the file has {node_count} nodes"),
            ));
        }
        run.min_nodes = Some(n);
    }
    Ok(run)
}

/// The `[sim]` table, when the file has one.
fn resolve_sim(ctx: &Ctx<'_>, s: Option<&SimToml>) -> Result<Option<SimSettings>, ConfigError> {
    let Some(s) = s else {
        return Ok(None);
    };
    Ok(Some(SimSettings {
        seed: s.seed.unwrap_or(0),
        steps: match &s.steps {
            Some(x) => ctx.positive(x, "steps")?,
            None => 100,
        },
        checkpoint_every_steps: s
            .checkpoint_every_steps
            .unwrap_or(DEFAULT_CHECKPOINT_EVERY_STEPS),
    }))
}

fn resolve_model(ctx: &Ctx<'_>, m: Option<&Spanned<ModelToml>>) -> Result<ModelSpec, ConfigError> {
    let Some(m) = m else {
        return Err(with_help(
            ctx.err(None, "the file has no [model] table"),
            Some("add `[model]` with `preset = \"mlp-digits\"` (or kind = \"gpt\" / \"mlp\" / \"custom\")".into()),
        ));
    };
    let span = m.span();
    let m = m.get_ref();
    let presets = || model::PRESETS.iter().map(|p| p.name);
    let mut spec = match (&m.preset, &m.kind) {
        (Some(_), Some(k)) => {
            return Err(ctx.err(Some(&k.span()), "give either `preset` or `kind`, not both"));
        }
        (None, None) => {
            return Err(with_help(
                ctx.err(Some(&span), "[model] needs `preset` or `kind`"),
                Some(format!(
                    "presets: {}",
                    presets().collect::<Vec<_>>().join(", ")
                )),
            ));
        }
        (Some(p), None) => model::preset(p.get_ref())
            .ok_or_else(|| {
                with_help(
                    ctx.err(
                        Some(&p.span()),
                        format!("unknown model preset `{}`", p.get_ref()),
                    ),
                    Some(did_you_mean(p.get_ref(), presets())),
                )
            })?
            .build(),
        (None, Some(k)) => match k.get_ref().as_str() {
            "gpt" => resolve_gpt(ctx, m, k)?,
            "mlp" => resolve_mlp(ctx, m, k)?,
            "custom" => resolve_custom(ctx, m, k)?,
            other => {
                return Err(with_help(
                    ctx.err(Some(&k.span()), format!("unknown model kind `{other}`")),
                    Some(did_you_mean(other, MODEL_KINDS.iter().copied())),
                ));
            }
        },
    };
    if let Some(n) = &m.name {
        spec.name = n.clone();
    }
    Ok(spec)
}

/// A `kind = "gpt"` model; `k` is the `kind` field, where a missing size is reported.
fn resolve_gpt(
    ctx: &Ctx<'_>,
    m: &ModelToml,
    k: &Spanned<String>,
) -> Result<ModelSpec, ConfigError> {
    let need = |v: &Option<Spanned<u64>>, what: &str| -> Result<u64, ConfigError> {
        match v {
            Some(x) => ctx.positive(x, what),
            None => Err(ctx.err(Some(&k.span()), format!("kind = \"gpt\" needs `{what}`"))),
        }
    };
    let layers = match &m.layers {
        Some(x) => ctx.positive(x, "layers")?,
        None => return Err(ctx.err(Some(&k.span()), "kind = \"gpt\" needs `layers`")),
    };
    let hidden = need(&m.hidden, "hidden")?;
    let heads = need(&m.heads, "heads")?;
    if hidden % heads != 0 {
        return Err(ctx.err(
            Some(&m.heads.as_ref().unwrap().span()),
            format!("`hidden` ({hidden}) must be a multiple of `heads` ({heads})"),
        ));
    }
    Ok(model::gpt_spec(
        "gpt",
        layers,
        hidden,
        heads,
        need(&m.seq_len, "seq_len")?,
        need(&m.vocab, "vocab")?,
        m.flash_attention.unwrap_or(false),
    ))
}

/// A `kind = "mlp"` model: its `dims`.
fn resolve_mlp(
    ctx: &Ctx<'_>,
    m: &ModelToml,
    k: &Spanned<String>,
) -> Result<ModelSpec, ConfigError> {
    let Some(d) = &m.dims else {
        return Err(ctx.err(
            Some(&k.span()),
            "kind = \"mlp\" needs `dims = [in, hidden.., out]`",
        ));
    };
    if d.get_ref().len() < 2 || d.get_ref().contains(&0) {
        return Err(ctx.err(
            Some(&d.span()),
            "`dims` needs at least two sizes, all greater than 0",
        ));
    }
    Ok(model::mlp_spec("mlp", d.get_ref()))
}

/// A `kind = "custom"` model: its `[[model.layer]]` tables, each `repeat` expanded.
fn resolve_custom(
    ctx: &Ctx<'_>,
    m: &ModelToml,
    k: &Spanned<String>,
) -> Result<ModelSpec, ConfigError> {
    if m.layer.is_empty() {
        return Err(ctx.err(
            Some(&k.span()),
            "kind = \"custom\" needs [[model.layer]] tables",
        ));
    }
    let mut layers = Vec::new();
    for l in &m.layer {
        let l = l.get_ref();
        let flops = ctx.non_negative(&l.fwd_flops_per_sample, "fwd_flops_per_sample")?;
        let repeat = match &l.repeat {
            Some(r) => ctx.positive(r, "repeat")?,
            None => 1,
        };
        for i in 0..repeat {
            layers.push(LayerSpec {
                name: if repeat == 1 {
                    l.name.clone()
                } else {
                    format!("{}{i}", l.name)
                },
                params: l.params,
                fwd_flops_per_sample: flops,
                activation_elems_per_sample: l.activation_elems_per_sample,
                output_elems_per_sample: l.output_elems_per_sample,
            });
        }
    }
    Ok(ModelSpec {
        name: "custom".into(),
        layers,
    })
}

fn resolve_fault(
    ctx: &Ctx<'_>,
    f: &Spanned<FaultToml>,
    lookup_node: &dyn Fn(&Spanned<String>) -> Result<NodeId, ConfigError>,
) -> Result<Fault, ConfigError> {
    let r = FaultReader {
        ctx,
        span: f.span(),
        f: f.get_ref(),
        kind: f.get_ref().kind.get_ref().as_str(),
        lookup_node,
    };
    let f = r.f;
    Ok(match r.kind {
        "crash" => Fault::Crash {
            node: r.need_node()?,
            at_s: r.need_f(&f.at_s, "at_s")?,
        },
        "restart" => Fault::Restart {
            node: r.need_node()?,
            at_s: r.need_f(&f.at_s, "at_s")?,
        },
        "slowdown" => r.slowdown()?,
        "reset" => {
            let (a, b) = r.need_pair()?;
            Fault::Reset {
                a,
                b,
                at_s: r.need_f(&f.at_s, "at_s")?,
            }
        }
        "link" => r.link()?,
        "partition" => r.partition()?,
        other => {
            return Err(with_help(
                ctx.err(
                    Some(&f.kind.span()),
                    format!("unknown fault kind `{other}`"),
                ),
                Some(did_you_mean(other, FAULT_KINDS.iter().copied())),
            ));
        }
    })
}

/// One `[[fault]]` table being read: its fields, its `kind`, and how to find its nodes.
struct FaultReader<'a> {
    ctx: &'a Ctx<'a>,
    /// The whole table, where a missing field is reported.
    span: Range<usize>,
    f: &'a FaultToml,
    kind: &'a str,
    lookup_node: &'a dyn Fn(&Spanned<String>) -> Result<NodeId, ConfigError>,
}

impl FaultReader<'_> {
    /// A required time (0 or more).
    fn need_f(&self, v: &Option<Spanned<f64>>, what: &str) -> Result<f64, ConfigError> {
        match v {
            Some(x) => self.ctx.non_negative(x, what),
            None => Err(self.ctx.err(
                Some(&self.span),
                format!("fault kind = \"{}\" needs `{what}`", self.kind),
            )),
        }
    }

    /// The required `node`.
    fn need_node(&self) -> Result<NodeId, ConfigError> {
        match &self.f.node {
            Some(n) => (self.lookup_node)(n),
            None => Err(self.ctx.err(
                Some(&self.span),
                format!("fault kind = \"{}\" needs `node`", self.kind),
            )),
        }
    }

    /// `between = [a, b]`: exactly two node names.
    fn need_pair(&self) -> Result<(NodeId, NodeId), ConfigError> {
        let Some(between) = &self.f.between else {
            return Err(self.ctx.err(
                Some(&self.span),
                format!("fault kind = \"{}\" needs `between = [a, b]`", self.kind),
            ));
        };
        if between.get_ref().len() != 2 {
            return Err(self.ctx.err(
                Some(&between.span()),
                "`between` takes exactly two node names",
            ));
        }
        Ok((
            (self.lookup_node)(&between.get_ref()[0])?,
            (self.lookup_node)(&between.get_ref()[1])?,
        ))
    }

    /// The required `from_s` .. `to_s`, `to_s` after `from_s`.
    fn window(&self) -> Result<(f64, f64), ConfigError> {
        let f = self.f;
        let (a, b) = (
            self.need_f(&f.from_s, "from_s")?,
            self.need_f(&f.to_s, "to_s")?,
        );
        if b <= a {
            return Err(self.ctx.err(
                Some(&f.to_s.as_ref().unwrap().span()),
                format!("`to_s` ({b}) must be after `from_s` ({a})"),
            ));
        }
        Ok((a, b))
    }

    /// `kind = "slowdown"`.
    fn slowdown(&self) -> Result<Fault, ConfigError> {
        let factor = match &self.f.factor {
            Some(x) => self.ctx.positive(x, "factor")?,
            None => {
                return Err(self
                    .ctx
                    .err(Some(&self.span), "fault kind = \"slowdown\" needs `factor`"));
            }
        };
        let node = self.need_node()?;
        let (from_s, to_s) = self.window()?;
        Ok(Fault::Slowdown {
            node,
            factor,
            from_s,
            to_s,
        })
    }

    /// `kind = "link"`.
    fn link(&self) -> Result<Fault, ConfigError> {
        let (a, b) = self.need_pair()?;
        let bandwidth_gbps = match &self.f.bandwidth_gbps {
            Some(x) => self.ctx.positive(x, "bandwidth_gbps")?,
            None => {
                return Err(self.ctx.err(
                    Some(&self.span),
                    "fault kind = \"link\" needs `bandwidth_gbps`",
                ));
            }
        };
        let latency_ms = match &self.f.latency_ms {
            Some(x) => self.ctx.non_negative(x, "latency_ms")?,
            None => DEFAULT_LINK.latency_ms,
        };
        let (from_s, to_s) = self.window()?;
        Ok(Fault::LinkDegraded {
            a,
            b,
            link: Link {
                bandwidth_gbps,
                latency_ms,
            },
            from_s,
            to_s,
        })
    }

    /// `kind = "partition"`: at least two disjoint groups.
    fn partition(&self) -> Result<Fault, ConfigError> {
        let Some(groups) = &self.f.groups else {
            return Err(self.ctx.err(
                Some(&self.span),
                "fault kind = \"partition\" needs `groups = [[..], [..]]`",
            ));
        };
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        for g in groups.get_ref() {
            let mut ids = Vec::new();
            for n in g {
                let id = (self.lookup_node)(n)?;
                if !seen.insert(id) {
                    return Err(self.ctx.err(
                        Some(&n.span()),
                        format!("node `{}` is in two partition groups", n.get_ref()),
                    ));
                }
                ids.push(id);
            }
            out.push(ids);
        }
        if out.len() < 2 {
            return Err(self.ctx.err(
                Some(&groups.span()),
                "a partition needs at least two groups",
            ));
        }
        let (from_s, to_s) = self.window()?;
        Ok(Fault::Partition {
            groups: out,
            from_s,
            to_s,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distance_and_nearest() {
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(nearest("rtx3909", device::ids()), Some("rtx3090"));
        assert_eq!(nearest("zzzzzzzz", device::ids()), None);
    }

    #[test]
    fn serde_messages_become_suggestions() {
        let m = "unknown field `globl_batch`, expected one of `global_batch`, `micro_batch`";
        assert!(
            suggestion_from_serde(m)
                .unwrap()
                .starts_with("did you mean `global_batch`?")
        );
        let m = "unknown variant `adam`, expected one of `sgd`, `sgd-momentum`, `adamw`";
        assert!(
            suggestion_from_serde(m)
                .unwrap()
                .starts_with("did you mean `adamw`?")
        );
    }
}

//! The public types of a parsed file: the [`Scenario`] and its settings, the [`Fault`]s, the
//! [`ConfigError`], and the defaults the file falls back on. A leaf: every other part of
//! `config` builds these.

use std::fmt;

use crate::cluster::{ClusterSpec, Link, NodeId, TrainingSpec};
use crate::model::ModelSpec;

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
    /// Nodes reach each other over libp2p (`[cluster] transport = "p2p"`, or `relays`):
    /// through relays and punched holes, for peers behind NATs.
    pub p2p: bool,
    /// The relays (`/ip4/HOST/tcp/PORT/p2p/PEER_ID`) nodes reserve a slot on.
    pub relays: Vec<String>,
    /// Per-node compute slowdown to emulate a slower device (1.0 = none), by node index.
    pub emulate_slowdown: Vec<f64>,
    /// Each node's `device` as written (`cpu`, `cuda:1`, `rtx3090`), by node index: where
    /// `ravnest run` computes (the catalog id in [`NodeSpec::device`](crate::cluster::NodeSpec::device) is what the planner uses).
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
    /// The network that `run` trains: `"mlp"` (the `[model]`'s dims), `"cnn"`, `"char"` (a
    /// character model over a text file), or `"gpt"` (the `[model]`'s GPT over the bytes of a
    /// text file, split into pipeline stages when it fits no node).
    pub network: String,
    /// Characters of context the `"char"` network sees.
    pub context_chars: u64,
    /// Hidden width of the `"char"` network.
    pub char_hidden: u64,
    /// Checkpoint every this many steps (0: only at the end).
    pub checkpoint_every_steps: u64,
    /// Test accuracy the run reports against (and the demo test requires).
    pub target_accuracy: f64,
    /// For the GPT: the bits per byte on held-out text the run reports against.
    pub target_bits_per_byte: f64,
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
    /// The Hugging Face folder `[model] from` names, when it does.
    pub model_from: Option<ModelFrom>,
    /// The learning rate's schedule over the run's steps ([`RunSettings::schedule`]).
    pub lr_schedule: crate::recipe::ScheduleKind,
    /// Steps of linear warm-up from 0.
    pub warmup_steps: u64,
    /// The lowest learning rate the schedule decays to.
    pub min_lr: f64,
    /// `wsd`: steps of the final decay (default: a fifth of the steps).
    pub decay_steps: Option<u64>,
    /// The field of a JSON Lines corpus that holds each document's text.
    pub dataset_field: String,
    /// The tokens of a `.bin` corpus: `uint16` or `uint32`.
    pub dataset_dtype: Option<String>,
    /// Held-out data of its own (else the end of `dataset` is held out).
    pub eval_dataset: Option<String>,
    /// The fraction of `dataset` held out at its end (default: a sixth).
    pub eval_fraction: Option<f64>,
    /// Evaluate on the held-out data every this many steps (0: only at the end).
    pub eval_every_steps: u64,
    /// Clip the global gradient norm to this (`None`: no clipping), as
    /// `torch.nn.utils.clip_grad_norm_` after DDP's averaging: data-parallel runs (under local
    /// SGD, each node's own gradient).
    pub max_grad_norm: Option<f64>,
}

impl RunSettings {
    /// The steps between checkpoints the coordinator takes: the file's, and every evaluation's
    /// too (an evaluation reads the checkpoint of its step, whatever the layout).
    pub fn checkpoint_cadence(&self) -> u64 {
        fn gcd(a: u64, b: u64) -> u64 {
            if b == 0 { a } else { gcd(b, a % b) }
        }
        match (self.checkpoint_every_steps, self.eval_every_steps) {
            (c, 0) => c,
            (0, e) => e,
            (c, e) => gcd(c, e),
        }
    }

    /// The learning rate's schedule over `steps` steps.
    pub fn schedule(&self) -> crate::recipe::Schedule {
        crate::recipe::Schedule {
            kind: self.lr_schedule,
            warmup_steps: self.warmup_steps,
            total_steps: self.steps,
            min_ratio: self.min_lr / self.learning_rate,
            decay_steps: self.decay_steps.unwrap_or(self.steps / 5),
        }
    }
}

/// A model from a local Hugging Face folder (`[model] from`).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModelFrom {
    /// The folder, as the run opens it (relative ones resolved against the cluster file's).
    pub dir: String,
    /// Start from its weights (`init = "pretrained"`, the default) or from seeded random
    /// ones of the same architecture (`init = "random"`).
    pub pretrained: bool,
    /// The model its `config.json` describes.
    pub decoder: crate::decoder::Decoder,
}

impl Default for RunSettings {
    fn default() -> Self {
        RunSettings {
            secret: None,
            coordinator: None,
            p2p: false,
            relays: Vec::new(),
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
            target_bits_per_byte: 3.0,
            heartbeat_ms: 100,
            heartbeat_timeout_ms: 1500,
            min_nodes: None,
            register_timeout_s: 60,
            model_from: None,
            lr_schedule: crate::recipe::ScheduleKind::Constant,
            warmup_steps: 0,
            min_lr: 0.0,
            decay_steps: None,
            dataset_field: "text".into(),
            dataset_dtype: None,
            eval_dataset: None,
            eval_fraction: None,
            eval_every_steps: 0,
            max_grad_norm: None,
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

impl Scenario {
    /// Whether the network `ravnest run` trains for this file runs as pipeline stages (the
    /// GPT does; the MLP, CNN and character models train whole on each node). `plan` and
    /// `sim` plan pipelines only when it does, so that all three show the same plan.
    pub fn runs_stages(&self) -> bool {
        self.run.network == "gpt"
    }
}

/// Default access link when `[links]` says nothing: 10 Gbit/s Ethernet, 0.1 ms.
pub const DEFAULT_LINK: Link = Link {
    bandwidth_gbps: 10.0,
    latency_ms: 0.1,
};

/// Default checkpoint period of `sim`, in steps.
pub const DEFAULT_CHECKPOINT_EVERY_STEPS: u64 = 50;

/// Memory kept back on every node for the framework (CUDA context, allocator slack), GiB.
pub const DEFAULT_MEMORY_RESERVE_GIB: f64 = 1.0;

//! What a node process (and the local launcher) says as it runs: typed [`RunEvent`]s, written
//! as JSON lines with `--json` (`{"event": "progress", "node": "a", ...}`, the format
//! `docs/reading-reports.md` describes) and as one line of text each otherwise.

use serde::{Deserialize, Serialize};

use crate::summary::{NodeReport, RunReport};

/// One thing a run says. Every event but the summary names the node that says it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum RunEvent {
    /// The local launcher started a node's process.
    Spawned {
        /// The node.
        node: String,
        /// Its process id.
        pid: u32,
    },
    /// A node measured itself.
    Measured {
        /// The node.
        node: String,
        /// The device it computes on.
        device: String,
        /// candle matmul throughput, f32.
        matmul_gflops: f64,
        /// The same in bf16 (GPUs only).
        matmul_bf16_gflops: Option<f64>,
        /// Its samples/s on the model, alone.
        samples_per_s: f64,
        /// Free memory where the model lives.
        memory_gib: f64,
        /// The emulated slowdown (1: none).
        slowdown: f64,
    },
    /// The links the coordinator's host measured, "a-b 0.05 ms 3.1 Gbit/s" each.
    Links {
        /// The coordinator's host.
        node: String,
        /// One line per measured pair.
        pairs: Vec<String>,
        /// The same as fields.
        #[serde(default)]
        links: Vec<LinkRow>,
    },
    /// The plan on measured figures: as text, and as fields.
    Plan {
        /// The coordinator's host.
        node: String,
        /// One line per node, then the sync.
        text: String,
        /// Each planned node's share.
        #[serde(default)]
        nodes: Vec<PlanRow>,
        /// How the replicas synchronize, and why.
        #[serde(default)]
        sync: String,
    },
    /// Training progress as a node sees it.
    Progress {
        /// The node.
        node: String,
        /// The model version it holds.
        step: u64,
        /// Steps of the run.
        steps: u64,
        /// Its last batch's mean loss.
        loss: Option<f64>,
        /// The cluster's samples/s over the last interval.
        samples_per_s: f64,
        /// This node's own figures so far (absent from older nodes).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        own: Option<NodeFigures>,
    },
    /// The loss of the samples a node trained on (its share of a step, or a last stage's
    /// micro-batch), at full precision: JSON lines only. A step's loss is Σ `loss_sum` ÷ Σ
    /// samples over its events (a redone step's later events replace its earlier ones).
    Loss {
        /// The node.
        node: String,
        /// The step.
        step: u64,
        /// The first global sample index.
        first_sample: u64,
        /// Samples.
        samples: u64,
        /// Σ over them of each sample's mean loss per token.
        loss_sum: f64,
    },
    /// Under `[run] max_grad_norm`, a step's global gradient norm before clipping (what
    /// `torch.nn.utils.clip_grad_norm_` returns), as the node that clipped by it computed it,
    /// at full precision: JSON lines only. Every node that applies a part of the step says it
    /// (they agree).
    GradNorm {
        /// The node.
        node: String,
        /// The step.
        step: u64,
        /// The norm.
        norm: f64,
    },
    /// The model of a step on the held-out data (`[run] eval_every_steps`), at full precision.
    Eval {
        /// The node that evaluated (the coordinator's host).
        node: String,
        /// The step (the model after it).
        step: u64,
        /// Mean loss: cross-entropy per token (language models) or per sample, in nats.
        loss: f64,
        /// Next-token (or class) accuracy.
        accuracy: f64,
        /// Held-out samples evaluated.
        samples: u64,
        /// A language model's perplexity, e^loss.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        perplexity: Option<f64>,
    },
    /// Something that happened to the cluster (a registration, a lost node, a checkpoint).
    Cluster {
        /// The node that says it.
        node: String,
        /// In words.
        what: String,
        /// When, s since training started (the coordinator's events).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        t_s: Option<f64>,
        /// What it is, for those who classify it (a live view): the coordinator's typed event,
        /// with names (none for the events nobody classifies).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fact: Option<Fact>,
    },
    /// What a node waits for (registrations, the coordinator).
    Waiting {
        /// The node.
        node: String,
        /// In words.
        what: String,
    },
    /// A node's report at the end.
    Report(NodeReport),
    /// The run's report, the same on every node.
    Summary(RunReport),
}

/// Something that watches a node process's events as it says them (a live view), besides or
/// instead of the console: it sees every event, the losses and each node's counters included,
/// in text mode too.
#[derive(Clone)]
pub struct Observer(pub std::sync::Arc<dyn Fn(&RunEvent) + Send + Sync>);

impl std::fmt::Debug for Observer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Observer")
    }
}

/// A relayed coordinator event by its kind, with node names ([`RunEvent::Cluster`]'s `fact`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Fact {
    /// A plan from `step`; `nodes` get work under it (workers, stages), the others none.
    Planned {
        /// The step it starts at.
        step: u64,
        /// The nodes with work.
        nodes: Vec<String>,
    },
    /// A node was declared lost.
    Lost {
        /// The node.
        node: String,
    },
    /// The running epoch was halted; steps from `step` on are redone.
    Aborted {
        /// The first step not agreed.
        step: u64,
    },
    /// A node (re)joined, or one not in the cluster file was admitted.
    Joined {
        /// The node.
        node: String,
    },
    /// `node` took over as coordinator from `from` (which is lost).
    TookOver {
        /// The successor.
        node: String,
        /// The lost coordinator's host.
        from: String,
    },
    /// The checkpoint of `step` was written.
    Checkpoint {
        /// The model version.
        step: u64,
    },
}

/// A measured link between two nodes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinkRow {
    /// One end.
    pub a: String,
    /// The other.
    pub b: String,
    /// Round-trip latency / 2, ms.
    pub latency_ms: f64,
    /// Bandwidth, Gbit/s.
    pub gbit_s: f64,
}

/// One node's share of a plan.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlanRow {
    /// The node.
    pub node: String,
    /// Samples per step (0: left out).
    pub batch: u64,
    /// Its measured samples/s when all nodes computed at once.
    pub measured_samples_per_s: f64,
    /// Its link: latency, ms, and bandwidth, Gbit/s.
    pub latency_ms: f64,
    /// (See `latency_ms`.)
    pub gbit_s: f64,
    /// The layers its pipeline stage holds, `[first, end)` (none: the whole model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<(usize, usize)>,
}

/// A node's own counters, cumulative since it started: what a live view draws its timeline
/// (computing, communicating, idle) and its traffic from.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeFigures {
    /// Seconds computing.
    pub compute_s: f64,
    /// Seconds of communication the compute did not hide.
    pub comm_s: f64,
    /// Steps it applied.
    pub steps_applied: u64,
    /// Samples per step of its current share.
    pub batch: u64,
    /// Per peer: (peer, bytes sent, bytes received).
    pub peers: Vec<(String, u64, u64)>,
}

impl RunEvent {
    /// The node that says it (none for the summary).
    pub fn node(&self) -> Option<&str> {
        match self {
            RunEvent::Spawned { node, .. }
            | RunEvent::Measured { node, .. }
            | RunEvent::Links { node, .. }
            | RunEvent::Plan { node, .. }
            | RunEvent::Progress { node, .. }
            | RunEvent::Loss { node, .. }
            | RunEvent::GradNorm { node, .. }
            | RunEvent::Eval { node, .. }
            | RunEvent::Cluster { node, .. }
            | RunEvent::Waiting { node, .. } => Some(node),
            RunEvent::Report(r) => Some(&r.node),
            RunEvent::Summary(_) => None,
        }
    }

    /// The JSON line.
    pub fn json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }

    /// One line of text (the summary: the whole report).
    pub fn human(&self) -> String {
        match self {
            RunEvent::Spawned { node, pid } => format!("started node `{node}` (pid {pid})"),
            RunEvent::Measured {
                device,
                matmul_gflops,
                matmul_bf16_gflops,
                memory_gib,
                slowdown,
                ..
            } => format!(
                "measured on {device}: {matmul_gflops:.1} GFLOP/s candle matmul{}, {memory_gib:.1} GiB free{} (the model's speed is measured next, every node at once)",
                match matmul_bf16_gflops {
                    Some(g) => format!(" ({g:.1} in bf16)"),
                    None => String::new(),
                },
                if *slowdown > 1.0 {
                    format!(" (emulating a {slowdown}x slower device)")
                } else {
                    String::new()
                }
            ),
            RunEvent::Plan { text, .. } => format!("plan:\n{text}"),
            RunEvent::Links { pairs, .. } => {
                format!("links measured by echo probes: {}", pairs.join(", "))
            }
            RunEvent::Progress {
                step,
                steps,
                loss,
                samples_per_s,
                ..
            } => format!(
                "step {step}/{steps}  loss {:.3}  {samples_per_s:.0} samples/s",
                loss.unwrap_or(f64::NAN)
            ),
            RunEvent::Loss {
                step,
                samples,
                loss_sum,
                ..
            } => format!(
                "step {step}: loss {:.6} over {samples} samples",
                loss_sum / (*samples).max(1) as f64
            ),
            RunEvent::GradNorm { step, norm, .. } => {
                format!("step {step}: gradient norm {norm:.6} before clipping")
            }
            RunEvent::Eval {
                step,
                loss,
                accuracy,
                samples,
                perplexity,
                ..
            } => format!(
                "evaluation at step {step}: held-out loss {loss:.4}{}, accuracy {accuracy:.3} ({samples} samples)",
                perplexity.map_or(String::new(), |p| format!(" (perplexity {p:.2})"))
            ),
            RunEvent::Cluster { what, .. } | RunEvent::Waiting { what, .. } => what.clone(),
            RunEvent::Report(r) => format!("report of node `{}`", r.node),
            RunEvent::Summary(s) => s.text(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_are_json_lines_with_their_kind_and_node_and_read_back() {
        let e = RunEvent::Progress {
            node: "a".into(),
            step: 3,
            steps: 10,
            loss: None,
            samples_per_s: 12.5,
            own: None,
        };
        let v: serde_json::Value = serde_json::from_str(&e.json()).unwrap();
        assert_eq!(v["event"], "progress");
        assert_eq!(v["node"], "a");
        assert_eq!(v["step"], 3);
        assert!(v["loss"].is_null());
        assert_eq!(serde_json::from_value::<RunEvent>(v).unwrap(), e);
        let c = RunEvent::Cluster {
            node: "a".into(),
            what: "node `b` lost".into(),
            t_s: None,
            fact: None,
        };
        assert!(!c.json().contains("t_s"), "{}", c.json());
        assert_eq!(c.human(), "node `b` lost");
    }
}

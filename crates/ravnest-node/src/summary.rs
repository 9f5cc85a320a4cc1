//! The report of a `ravnest run`, the same in every mode: the coordinator's figures, then one
//! row per node. A local run (the launcher) and a `--node` run (the coordinator's host, which
//! collects every worker's report and sends the whole back to them) print the same text.
//! [`NodeReport`] and [`RunReport`] are also the JSON of `--json` (`report` and `summary`
//! events).
//!
//! Console lines stay short: the full event list is in the output folder's `events.jsonl`.

use ravnest_protocol::coordinator::Event;
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The longest line the console gets; longer text is cut with a pointer to the full record.
pub const MAX_LINE: usize = 300;

/// Cut each line of `text` to [`MAX_LINE`] characters.
pub fn clip_lines(text: &str) -> String {
    text.lines()
        .map(|l| {
            if l.chars().count() <= MAX_LINE {
                l.to_string()
            } else {
                let cut: String = l.chars().take(MAX_LINE - 60).collect();
                format!("{cut} … (cut; the whole line is in events.jsonl)")
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// What one node did, at the end of the run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeReport {
    /// The node.
    pub node: String,
    /// `coordinator` (its host) or `worker`.
    pub role: String,
    /// The run's figures, on the coordinator's host.
    #[serde(flatten, default, skip_serializing_if = "Option::is_none")]
    pub coordinator: Option<CoordinatorReport>,
    /// Steps this node applied.
    pub steps_applied: u64,
    /// Seconds computing.
    pub compute_s: f64,
    /// Seconds in collectives (waiting included).
    pub comm_s: f64,
    /// Seconds since the process started its transport.
    pub wall_s: f64,
    /// Collectives abandoned (a lost peer, a halt).
    pub aborted_collectives: u64,
    /// Its last batch share.
    pub batch: u64,
    /// With `--timeline`: the start of its clock, ns since the Unix epoch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub t0_unix_ns: Option<u64>,
    /// With `--timeline`: (start ns, end ns, `compute` or `comm`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub spans: Vec<(u64, u64, String)>,
    /// Fraction of the steady steps spent computing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steady_busy: Option<f64>,
    /// Fraction of the steady steps spent in collectives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steady_comm: Option<f64>,
    /// Its steady-state steps (after the warm-up; the last [`STEADY_STEPS_MAX`] at most):
    /// batch, compute, exposed communication and time since the previous step, from which
    /// the coordinator's host fits the run's profile. Only in the report a worker sends its
    /// coordinator's host: printed reports and the run's summary leave them out.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub steady_steps: Vec<ravnest_core::profile::StepSample>,
    /// Bytes it sent.
    pub bytes_sent: u64,
    /// Of them, the bytes of gradient and model synchronization (collective frames).
    #[serde(default)]
    pub sync_bytes_sent: u64,
    /// Its samples/s alone, measured before training.
    pub solo_samples_per_s: f64,
    /// Its last batch's mean loss.
    pub last_loss: Option<f64>,
    /// A pipeline stage: (the most memory its ledger counted at once, its budget), bytes.
    #[serde(default)]
    pub stage_memory: Option<(u64, u64)>,
    /// The emulated slowdown at the end.
    pub slowdown: Slowdown,
    /// MiB of model state (parameters, gradients, optimizer state) this node held at most at
    /// once, counted as its backend made and dropped them.
    #[serde(default)]
    pub held_state_mib: f64,
    /// The process's peak resident memory (`VmHWM`) when its training ended, MiB.
    #[serde(default)]
    pub peak_rss_mib: f64,
    /// Its resident memory before any model state was made (data loaded, runtime started), MiB.
    #[serde(default)]
    pub rss_before_model_mib: f64,
    /// Copies of the state it holds made per step by step work (0: updates make the next
    /// version in place of the old, versions share what they have in common).
    #[serde(default)]
    pub full_model_copies_per_step: f64,
    /// A data-parallel node's steady step by phase (ms per step).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phases: Option<StepPhases>,
    /// Over libp2p (`[cluster] relays`): how it reached each peer at the end, by name
    /// (`direct`, `direct (hole punched)`, `relayed`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub paths: BTreeMap<String, String>,
}

/// Where a node's steady steps went, in ms per step (the mean over the steps after the
/// warm-up): its compute split into forward, backward and the emulated slowdown's waits, the
/// optimizer, the all-reduce from the first bucket handed over to the last applied (hidden
/// behind the backward and exposed after it), and the rest, waiting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepPhases {
    /// The step, wall time.
    pub step_ms: f64,
    /// Forward passes.
    pub forward_ms: f64,
    /// Backward passes.
    pub backward_ms: f64,
    /// The emulated slowdown's waits (`emulate_slowdown`).
    pub slowdown_ms: f64,
    /// The optimizer (applying each reduced bucket, during and after the compute).
    pub optimizer_ms: f64,
    /// The all-reduce, first bucket handed over to the last applied.
    pub allreduce_ms: f64,
    /// Of it, what ran while the node computed.
    pub hidden_ms: f64,
    /// After the compute, waiting for the collectives (and for slower peers in them).
    pub exposed_ms: f64,
    /// Neither computing nor in a step's collectives: waiting for the next step.
    pub wait_ms: f64,
}

impl StepPhases {
    /// Its row of the phase table.
    fn text(&self, node: &str) -> String {
        format!(
            "{node:<13} {:>8.1} {:>8.1} {:>8.1} {:>8.1} {:>9.1} {:>10.1} {:>7.1} {:>7.1} {:>7.1}\n",
            self.step_ms,
            self.forward_ms,
            self.backward_ms,
            self.slowdown_ms,
            self.optimizer_ms,
            self.allreduce_ms,
            self.hidden_ms,
            self.exposed_ms,
            self.wait_ms
        )
    }
}

impl NodeReport {
    /// Its memory row: held state, peak RSS, RSS before the model, copies per step.
    fn memory_text(&self) -> String {
        format!(
            "{:<13} {:>10.1} MiB {:>9.0} MiB {:>12.0} MiB {:>12.2}\n",
            self.node,
            self.held_state_mib,
            self.peak_rss_mib,
            self.rss_before_model_mib,
            self.full_model_copies_per_step
        )
    }
}

/// An emulated slowdown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Slowdown {
    /// Times slower (1: none).
    pub factor: f64,
    /// The step it last changed at.
    pub since_step: u64,
}

/// The run as the coordinator saw it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CoordinatorReport {
    /// The last step trained.
    pub steps: u64,
    /// The step it started from (a resumed run: its checkpoint's).
    pub start_step: u64,
    /// Seconds of training.
    pub train_s: f64,
    /// Samples/s over the whole training.
    pub samples_per_s: f64,
    /// Samples/s after the warm-up steps.
    pub steady_samples_per_s: f64,
    /// Steps left out as warm-up.
    pub warmup_steps: u64,
    /// The sum of every node's solo samples/s, measured together, each at the batch it trains
    /// in the last data-parallel plan (its calibrated line there; B / n for a node left out or
    /// a pipeline's).
    pub solo_sum_samples_per_s: f64,
    /// Achieved samples/s ÷ that sum.
    pub capacity_efficiency: f64,
    /// What an equal split of the batch would compute: n × the slowest node's samples/s at
    /// B / n, measured together (no all-reduce counted); 0 when nothing was measured.
    #[serde(default)]
    pub equal_split_samples_per_s: f64,
    /// Each node's solo samples/s (as in the sum).
    pub solo_by_node: BTreeMap<String, f64>,
    /// Plans after the first.
    pub replans: u64,
    /// Accuracy of the final model on the held-out split.
    pub accuracy: f64,
    /// The file's target.
    pub target_accuracy: f64,
    /// The character model's continuation of a test context (the GPT's sampled one).
    pub sample: Option<Sample>,
    /// MiB of the whole model's state: parameters, one gradient and the optimizer state.
    #[serde(default)]
    pub model_state_mib: f64,
    /// The GPT: bits per byte on the held-out text (mean cross-entropy per token ÷ ln 2), and
    /// the file's target.
    #[serde(default)]
    pub bits_per_byte: Option<(f64, f64)>,
    /// A model from a folder (with its tokenizer): the mean cross-entropy per token on the
    /// held-out text, in nats.
    #[serde(default)]
    pub nats_per_token: Option<f64>,
    /// The held-out evaluations during the run (`[run] eval_every_steps`): (step, mean loss,
    /// accuracy).
    #[serde(default)]
    pub evaluations: Vec<(u64, f64, f64)>,
    /// A pipeline: its stages (the first plan), and the measured bubble.
    #[serde(default)]
    pub pipeline: Option<PipelineFigures>,
    /// Steps of the checkpoints written.
    pub checkpoints: Vec<u64>,
    /// Where they are.
    pub checkpoint_dir: String,
    /// The final checkpoint's file.
    pub final_checkpoint: String,
    /// The optimizer.
    pub optimizer: String,
    /// Distinct plans.
    pub plans: u64,
    /// Re-plans for measured speeds.
    pub rebalances: u64,
    /// Faults, membership, refusals (at most 20, then a count).
    pub notable_events: Vec<String>,
    /// Every event: `events.jsonl`.
    pub events_file: String,
    /// Fail-over: this coordinator took over from the one on this node (its figures count from
    /// `start_step`, where it took over).
    #[serde(default)]
    pub took_over_from: Option<String>,
    /// A run stopped on request (Ctrl-C, SIGTERM): the command that continues it from its
    /// latest checkpoint.
    #[serde(default)]
    pub stopped: Option<String>,
    /// The profile this run measured (`profile.toml` in its output folder), when written.
    #[serde(default)]
    pub profile_file: Option<String>,
    /// What the coordinator's host fits the profile from (on that host only).
    #[serde(skip)]
    pub profile_inputs: Option<ravnest_core::profile::RunFigures>,
}

/// Steady-state steps a node report carries at most (the latest).
pub const STEADY_STEPS_MAX: usize = 2000;

/// Text the character model wrote.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// The first test context.
    pub prompt: String,
    /// Its greedy continuation.
    pub continuation: String,
}

/// What a pipeline run measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PipelineFigures {
    /// Each stage: its nodes and layers, in words.
    pub stages: Vec<String>,
    /// Each stage node's counted memory peak against its budget, in words.
    #[serde(default)]
    pub memory: Vec<String>,
    /// The nodes that run stages.
    pub nodes: Vec<String>,
    /// Micro-batches per step.
    pub micro_batches: u64,
    /// (p − 1) / (m + p − 1): the 1F1B bubble with equal stages and no communication.
    pub bubble_theory: f64,
    /// The bottleneck stage's idle fraction over the steady steps (its wait is all bubble).
    pub bubble_bottleneck: f64,
    /// The mean idle fraction of the stages (bubble and imbalance together).
    pub bubble_mean: f64,
    /// Activation and activation-gradient bytes sent between stages per step.
    pub activation_bytes_per_step: u64,
}

/// One node's row of the run's report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeRow {
    /// The node.
    pub node: String,
    /// Its report (`null`: the process ended early or left).
    pub report: Option<NodeReport>,
}

/// The run's report: the coordinator's, each node's, and the processes that failed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunReport {
    /// The cluster's name.
    pub cluster: String,
    /// The coordinator's host's report.
    pub coordinator: Option<NodeReport>,
    /// Every node of the file, in order.
    pub nodes: Vec<NodeRow>,
    /// Processes that failed (the local launcher's view).
    #[serde(default)]
    pub failed: Vec<String>,
}

impl RunReport {
    /// The coordinator's figures (and its host's report), if it reported.
    pub fn coordinator(&self) -> Option<(&NodeReport, &CoordinatorReport)> {
        let host = self.coordinator.as_ref()?;
        Some((host, host.coordinator.as_ref()?))
    }

    /// A pipeline run: fill in the bubble and memory its stage nodes' reports measured.
    pub fn measure_pipeline(&mut self) {
        let Some(c) = self
            .coordinator
            .as_mut()
            .and_then(|h| h.coordinator.as_mut())
        else {
            return;
        };
        let wall = c.train_s;
        if let Some(p) = c.pipeline.as_mut() {
            measure_bubble(p, &self.nodes, wall);
        }
    }

    /// The whole report as text.
    pub fn text(&self) -> String {
        let mut out = format!("ravnest run: {}\n", self.cluster);
        let Some((host, c)) = self.coordinator() else {
            return out + "the coordinator did not report\n";
        };
        out += &c.text();
        out += &format!(
            "\n\n{:<13} {:<12} {:>6} {:>6} {:>6} {:>6} {:>16} {:>10}\n",
            "node", "role", "steps", "busy", "comm", "idle", "solo samples/s", "sent"
        );
        let wall = c.train_s.max(1e-9);
        for n in &self.nodes {
            out += &n.text(c, wall);
        }
        out += &format!(
            "\n{:<13} {:>14} {:>13} {:>16} {:>12}\n",
            "memory", "held state", "peak RSS", "RSS before model", "copies/step"
        );
        for r in self.nodes.iter().filter_map(|n| n.report.as_ref()) {
            out += &r.memory_text();
        }
        out += &format!(
            "model state (parameters, gradients, optimizer state): {:.1} MiB\n",
            c.model_state_mib
        );
        let phases: Vec<(&str, StepPhases)> = self
            .nodes
            .iter()
            .filter_map(|n| Some((n.node.as_str(), n.report.as_ref()?.phases?)))
            .collect();
        if !phases.is_empty() {
            out += &format!(
                "\n{:<13} {:>8} {:>8} {:>8} {:>8} {:>9} {:>10} {:>7} {:>7} {:>7}\n",
                "ms per step",
                "step",
                "forward",
                "backward",
                "slowdown",
                "optimizer",
                "all-reduce",
                "hidden",
                "exposed",
                "wait"
            );
            for (node, p) in phases {
                out += &p.text(node);
            }
        }
        out += &format!(
            "\n{} distinct plan(s); {} re-plan(s) for measured speeds\n",
            c.plans, c.rebalances
        );
        if !c.notable_events.is_empty() {
            out += "\nevents:\n";
            for e in &c.notable_events {
                out += &format!("  {e}\n");
            }
        }
        if !c.events_file.is_empty() {
            out += &format!(
                "every event: {} (on `{}`'s machine)\n",
                c.events_file, host.node
            );
        }
        if let Some(p) = &c.profile_file {
            out += &format!(
                "measured profile: {p} (`ravnest sim --profile {p} FILE` predicts this run)\n"
            );
        }
        if !self.failed.is_empty() {
            out += &format!("\nprocesses that failed: {}\n", self.failed.join(", "));
        }
        clip_lines(&out)
    }
}

/// The pipeline's bubble from its stage nodes' busy and communicating fractions of the
/// training's `wall` seconds (as the report's table shows them): the idle fraction of the
/// busiest stage (the bottleneck, whose every wait is bubble), and the mean over the stages.
fn measure_bubble(p: &mut PipelineFigures, nodes: &[NodeRow], wall: f64) {
    let idle: Vec<(f64, f64)> = nodes
        .iter()
        .filter(|n| p.nodes.contains(&n.node))
        .filter_map(|n| {
            let r = n.report.as_ref()?;
            let busy = (r.compute_s / wall.max(1e-9)).min(1.0);
            let comm = r.comm_s / wall.max(1e-9);
            Some((busy, (1.0 - busy - comm).max(0.0)))
        })
        .collect();
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    p.memory = nodes
        .iter()
        .filter(|n| p.nodes.contains(&n.node))
        .filter_map(|n| {
            let (peak, budget) = n.report.as_ref()?.stage_memory?;
            Some(format!(
                "{} {:.1} of {:.1} MiB",
                n.node,
                mib(peak),
                mib(budget)
            ))
        })
        .collect();
    if let Some(b) = idle.iter().max_by(|a, b| a.0.total_cmp(&b.0)) {
        p.bubble_bottleneck = b.1;
        p.bubble_mean = idle.iter().map(|x| x.1).sum::<f64>() / idle.len() as f64;
    }
}

impl NodeRow {
    /// Its row of the table (`wall`: the training's seconds).
    fn text(&self, c: &CoordinatorReport, wall: f64) -> String {
        let Some(r) = &self.report else {
            return format!(
                "{:<13} (no report: the process ended early or left)\n",
                self.node
            );
        };
        // A successor's figures start where it took over; a node's time is its process's then.
        let wall = if c.took_over_from.is_some() {
            r.wall_s.max(1e-9)
        } else {
            wall
        };
        let busy = r.compute_s / wall;
        let comm = r.comm_s / wall;
        format!(
            "{:<13} {:<12} {:>6} {:>5.0}% {:>5.0}% {:>5.0}% {:>16.0} {:>7.1} MB\n",
            self.node,
            r.role,
            r.steps_applied,
            100.0 * busy.min(1.0),
            100.0 * comm.min(1.0),
            100.0 * (1.0 - busy - comm).max(0.0),
            c.solo_by_node.get(&self.node).copied().unwrap_or(0.0),
            r.bytes_sent as f64 / 1e6
        )
    }
}

impl CoordinatorReport {
    /// The coordinator's figures in words.
    pub fn text(&self) -> String {
        let sample = match &self.sample {
            Some(s) => format!(
                "\nthe model continues the first test context: {:?} → {:?}",
                s.prompt, s.continuation
            ),
            None => String::new(),
        };
        let resumed = match (self.start_step, &self.took_over_from) {
            (s, Some(from)) => {
                format!(" (since step {s}, when this node took over as coordinator from `{from}`)")
            }
            (0, None) => String::new(),
            (s, None) => format!(" (resumed from the checkpoint of step {s})"),
        };
        let mut efficiency = if self.solo_sum_samples_per_s > 0.0 {
            format!(
                "capacity efficiency: {:.2} (achieved ÷ {:.0} samples/s, the sum of each node's measured solo throughput at its batch)\n",
                self.capacity_efficiency, self.solo_sum_samples_per_s
            )
        } else {
            String::new()
        };
        if self.equal_split_samples_per_s > 0.0 && self.solo_by_node.len() > 1 {
            efficiency += &format!(
                "against an equal split: {:.2}x ({:.0} samples/s at most: every node at the same batch waits for the slowest, measured together)\n",
                self.samples_per_s / self.equal_split_samples_per_s,
                self.equal_split_samples_per_s
            );
        }
        let checkpoints: Vec<String> = self.checkpoints.iter().map(u64::to_string).collect();
        let quality = match (self.nats_per_token, self.bits_per_byte) {
            (Some(nats), _) => format!(
                "loss on the held-out text: {nats:.4} nats per token (perplexity {:.2}; next-token accuracy {:.3})\n",
                nats.exp(),
                self.accuracy
            ),
            (None, Some((bpb, target))) => format!(
                "bits per byte on the held-out text: {bpb:.3} (target {target:.2}: {}; next-byte accuracy {:.3})\n",
                if bpb <= target {
                    "reached"
                } else {
                    "NOT reached"
                },
                self.accuracy
            ),
            (None, None) => format!(
                "accuracy on the held-out split: {:.3} (target {:.2}: {})\n",
                self.accuracy,
                self.target_accuracy,
                if self.accuracy >= self.target_accuracy {
                    "reached"
                } else {
                    "NOT reached"
                }
            ),
        };
        let quality = if self.evaluations.is_empty() {
            quality
        } else {
            let shown: Vec<String> = self
                .evaluations
                .iter()
                .rev()
                .take(8)
                .rev()
                .map(|(s, l, _)| format!("{s}: {l:.4}"))
                .collect();
            format!(
                "{quality}held-out loss during the run (step: loss{}): {}\n",
                if self.evaluations.len() > 8 {
                    ", the last 8"
                } else {
                    ""
                },
                shown.join(", ")
            )
        };
        let pipeline = match &self.pipeline {
            Some(p) => format!(
                "pipeline: {} stage(s), {} micro-batches per step: {}\n\
                 bubble: the bottleneck stage idles {:.2} of the time (1F1B theory (p-1)/(m+p-1) = {:.2}); stages idle {:.2} on average\n\
                 activations between stages: {:.1} MB per step (forward and backward)\n\
                 memory counted at its peak (weights, gradients, optimizer state, activations) of the budget: {}\n",
                p.stages.len(),
                p.micro_batches,
                p.stages.join(" | "),
                p.bubble_bottleneck,
                p.bubble_theory,
                p.bubble_mean,
                p.activation_bytes_per_step as f64 / 1e6,
                p.memory.join(", ")
            ),
            None => String::new(),
        };
        let body = format!(
            "trained steps {}..{} in {:.1} s: {:.0} samples/s{resumed}\n\
             {quality}{pipeline}{efficiency}checkpoints: steps {} in {} (final: {})",
            self.start_step,
            self.steps,
            self.train_s,
            self.samples_per_s,
            checkpoints.join(", "),
            self.checkpoint_dir,
            self.final_checkpoint
        );
        let stopped = match (&self.stopped, self.checkpoints.last()) {
            (Some(cmd), Some(last)) => format!(
                "\nstopped on request at step {}: the latest checkpoint is step {last}; continue with: {cmd}",
                self.steps
            ),
            (Some(_), None) => format!(
                "\nstopped on request at step {}: no checkpoint was written (set `[run] checkpoint_every_steps`); --resume has nothing to continue from",
                self.steps
            ),
            (None, _) => String::new(),
        };
        body + &sample + &stopped
    }
}

/// Whether an event belongs in the printed report: faults, membership, take-overs, resumes
/// and restores (classified on the typed event, not on its words).
pub fn notable(e: &Event) -> bool {
    matches!(
        e,
        Event::Detected { .. }
            | Event::Aborted { .. }
            | Event::Restoring { .. }
            | Event::Resync { .. }
            | Event::Waiting { .. }
            | Event::Joined { .. }
            | Event::Left { .. }
            | Event::TookOver { .. }
            | Event::Violation(_)
            | Event::Stalled(_)
            | Event::Refused(_)
            | Event::CheckpointFailed { .. }
            | Event::Superseded { .. }
            | Event::CutOff { .. }
    )
}

/// Whether an event is a re-plan the coordinator decided on measurements (speeds, or links
/// slower than planned).
pub fn rebalance(e: &Event) -> bool {
    matches!(
        e,
        Event::Rebalanced { .. }
            | Event::LinksScaled {
                replanned: true,
                ..
            }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> RunReport {
        let c = CoordinatorReport {
            train_s: 1.0,
            steps: 10,
            solo_by_node: BTreeMap::from([("fast-a".to_string(), 1234.0)]),
            ..CoordinatorReport::default()
        };
        let r = NodeReport {
            node: "fast-a".into(),
            role: "coordinator".into(),
            coordinator: Some(c),
            steps_applied: 10,
            compute_s: 0.5,
            comm_s: 0.25,
            bytes_sent: 2_500_000,
            sync_bytes_sent: 2_000_000,
            ..NodeReport::default()
        };
        RunReport {
            cluster: "x".into(),
            coordinator: Some(r.clone()),
            nodes: vec![NodeRow {
                node: "fast-a".into(),
                report: Some(r),
            }],
            failed: Vec::new(),
        }
    }

    #[test]
    fn the_table_header_lines_up_with_its_rows() {
        let t = report().text();
        let lines: Vec<&str> = t.lines().collect();
        let h = lines.iter().position(|l| l.starts_with("node ")).unwrap();
        let (head, row) = (lines[h], lines[h + 1]);
        assert_eq!(head.chars().count(), row.chars().count(), "\n{head}\n{row}");
        // Each column's title ends where its values end.
        for title in ["steps", "busy", "idle", "solo samples/s", "sent"] {
            let end = head.find(title).unwrap() + title.len();
            assert!(
                row[..end].ends_with(|c: char| c.is_ascii_digit() || c == '%' || c == 'B'),
                "{title}:\n{head}\n{row}"
            );
        }
    }

    #[test]
    fn a_report_reads_back_from_its_json_with_the_coordinator_figures_flat() {
        let r = report();
        let v = serde_json::to_value(&r).unwrap();
        // The coordinator's figures sit beside the node's own, as scripts read them.
        assert_eq!(v["coordinator"]["steps"], 10);
        assert_eq!(v["coordinator"]["steps_applied"], 10);
        assert_eq!(serde_json::from_value::<RunReport>(v).unwrap(), r);
        // A worker's report has no coordinator figures.
        let w = NodeReport {
            node: "b".into(),
            role: "worker".into(),
            ..NodeReport::default()
        };
        let back: NodeReport = serde_json::from_str(&serde_json::to_string(&w).unwrap()).unwrap();
        assert_eq!(back, w);
    }

    #[test]
    fn long_lines_are_cut() {
        let long = "x".repeat(1000);
        let t = clip_lines(&format!("short\n{long}"));
        assert!(t.lines().all(|l| l.chars().count() <= MAX_LINE), "{t}");
        assert!(t.starts_with("short\n"));
    }
}

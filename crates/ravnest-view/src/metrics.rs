//! The board in Prometheus' text exposition format (version 0.0.4): what `/metrics` answers.
//! Every sample is named `ravnest_*`, per node where it is a node's.

use std::fmt::Write;

use crate::board::{Board, NodeState};

/// Escape a label value (backslash, quote, newline).
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// A number as Prometheus reads it.
fn num(x: f64) -> String {
    if x.is_nan() {
        "NaN".into()
    } else if x.is_infinite() {
        if x > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        format!("{x}")
    }
}

struct Family<'a> {
    out: &'a mut String,
}

impl Family<'_> {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP ravnest_{name} {help}");
        let _ = writeln!(self.out, "# TYPE ravnest_{name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], v: f64) {
        let ls: Vec<String> = labels
            .iter()
            .map(|(k, v)| format!("{k}=\"{}\"", label(v)))
            .collect();
        let ls = if ls.is_empty() {
            String::new()
        } else {
            format!("{{{}}}", ls.join(","))
        };
        let _ = writeln!(self.out, "ravnest_{name}{ls} {}", num(v));
    }
}

/// The metrics text.
pub fn render(b: &Board) -> String {
    let mut out = String::new();
    let mut f = Family { out: &mut out };
    type Per = fn(&crate::board::NodeView) -> f64;
    let per_node: [(&str, &str, &str, Per); 8] = [
        ("step", "gauge", "The model version the node holds.", |n| {
            n.step as f64
        }),
        (
            "samples_per_second",
            "gauge",
            "Samples/s the node trained over its last progress interval.",
            |n| n.samples_per_s,
        ),
        (
            "batch",
            "gauge",
            "Samples per step of the node's current share.",
            |n| n.figures.batch as f64,
        ),
        (
            "compute_seconds_total",
            "counter",
            "Seconds the node spent computing (step phase: compute).",
            |n| n.figures.compute_s,
        ),
        (
            "comm_seconds_total",
            "counter",
            "Seconds of communication the node's compute did not hide (step phase: comm).",
            |n| n.figures.comm_s,
        ),
        (
            "steps_applied_total",
            "counter",
            "Steps the node applied.",
            |n| n.figures.steps_applied as f64,
        ),
        ("loss", "gauge", "The node's last batch's mean loss.", |n| {
            n.loss.unwrap_or(f64::NAN)
        }),
        (
            "up",
            "gauge",
            "1 while the node is not down (lost, or its process ended without a report).",
            |n| f64::from(u8::from(n.state != NodeState::Down)),
        ),
    ];
    for (name, kind, help, get) in per_node {
        f.head(name, kind, help);
        for n in &b.nodes {
            f.sample(name, &[("node", &n.name)], get(n));
        }
    }
    f.head(
        "node_state",
        "gauge",
        "1 for the state the node is in (starting, measuring, training, standby, down, done).",
    );
    for n in &b.nodes {
        let state = serde_json::to_value(n.state).unwrap_or_default();
        let state = state.as_str().unwrap_or("?");
        f.sample("node_state", &[("node", &n.name), ("state", state)], 1.0);
    }
    for (i, name, help) in [
        (0, "bytes_sent_total", "Bytes the node sent to a peer."),
        (
            1,
            "bytes_received_total",
            "Bytes the node received from a peer.",
        ),
    ] {
        f.head(name, "counter", help);
        for n in &b.nodes {
            for (peer, sent, received) in &n.figures.peers {
                let v = if i == 0 { *sent } else { *received };
                f.sample(name, &[("node", &n.name), ("peer", peer)], v as f64);
            }
        }
    }
    f.head(
        "cluster_samples_per_second",
        "gauge",
        "The cluster's samples/s over the last interval.",
    );
    f.sample(
        "cluster_samples_per_second",
        &[],
        b.throughput.last().map_or(0.0, |t| t.1),
    );
    f.head("replans_total", "counter", "Re-plans after the first plan.");
    f.sample("replans_total", &[], b.replans() as f64);
    f.head("cluster_step", "gauge", "The furthest step any node holds.");
    f.sample("cluster_step", &[], b.step as f64);
    if let Some((step, loss, _)) = b.step_losses().last() {
        f.head(
            "step_loss",
            "gauge",
            "The latest step's loss over every node.",
        );
        f.sample("step_loss", &[], *loss);
        f.head("step_loss_step", "gauge", "The step of ravnest_step_loss.");
        f.sample("step_loss_step", &[], *step as f64);
    }
    if let Some(e) = b.evals.last() {
        f.head("eval_loss", "gauge", "The latest held-out loss.");
        f.sample("eval_loss", &[], e.loss);
        f.head("eval_accuracy", "gauge", "The latest held-out accuracy.");
        f.sample("eval_accuracy", &[], e.accuracy);
    }
    out
}

//! `ravnest sim`: a simulated run's report, and two side by side.

use std::fmt::Write as _;

use ravnest_core::device::GIB;

use super::text::*;

/// `ravnest sim` as text.
pub fn sim_text(origin: &str, r: &ravnest_sim::SimReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "ravnest sim: {} ({origin}), planner {}, seed {}",
        r.scenario, r.planner, r.seed
    );
    let _ = writeln!(
        out,
        "simulated {:.1} s: {}/{} steps, {:.1} samples/s, capacity efficiency {:.2}",
        r.sim_time_s, r.steps_completed, r.steps_requested, r.samples_per_s, r.capacity_efficiency
    );
    let _ = writeln!(out, "split: {}", r.planned);
    if r.steady_step_s > 0.0 {
        let _ = writeln!(
            out,
            "steady state: {:.1} ms per step (mean after the first two), {:.1} samples/s",
            r.steady_step_s * 1e3,
            r.steady_samples_per_s
        );
    }
    out.push('\n');
    let _ = writeln!(
        out,
        "{:<16} {:<10} {:<7} {:>12} {:>6} {:>6} {:>6} {:>12} {:>6} {:>8}",
        "node", "device", "role", "memory GiB", "busy", "comm", "idle", "sent", "steps", "aborted"
    );
    for n in r.nodes.iter().take(MAX_ROWS) {
        let _ = writeln!(
            out,
            "{:<16} {:<10} {:<7} {:>12} {:>5.0}% {:>5.0}% {:>5.0}% {:>9.1} MB {:>6} {:>8}",
            truncate(&n.name, 16),
            n.device,
            n.role,
            if n.memory_bytes > 0 {
                format!(
                    "{:.1}/{:.1}",
                    n.memory_bytes as f64 / GIB,
                    n.memory_limit_bytes as f64 / GIB
                )
            } else {
                format!("-/{:.1}", n.memory_limit_bytes as f64 / GIB)
            },
            n.busy * 100.0,
            n.comm * 100.0,
            n.idle * 100.0,
            n.bytes_sent as f64 / 1e6,
            n.steps,
            n.aborted
        );
    }
    if r.nodes.len() > MAX_ROWS {
        let _ = writeln!(
            out,
            "... {} more nodes (--json lists all)",
            r.nodes.len() - MAX_ROWS
        );
    }
    if !r.faults.is_empty() {
        let _ = writeln!(out, "\nfaults:");
        for f in &r.faults {
            let _ = writeln!(out, "{}", fault_line(f));
        }
    }
    let _ = writeln!(
        out,
        "\nplans made: {} · messages dropped by the network: {}",
        r.plans, r.dropped
    );
    match r.checkpoints.last() {
        Some(last) => {
            let _ = writeln!(
                out,
                "checkpoints: {} complete, the latest at step {last}",
                r.checkpoints.len()
            );
        }
        None => {
            let _ = writeln!(out, "checkpoints: none");
        }
    }
    if r.violations.is_empty() {
        match r.local_sgd_steps {
            None => {
                let _ = writeln!(
                    out,
                    "checkers: all held (replicas identical after every synchronized step; final model equals single-node training, max error {:.1e})",
                    r.max_model_error
                );
            }
            // Local SGD is another algorithm: saying the model equals single-node training
            // would be a claim the checker does not make.
            Some(h) => {
                let _ = writeln!(
                    out,
                    "checkers: all held (replicas identical after every averaging step, every {h} local steps; \
                     the final model is not checked against single-node training: local SGD is a different \
                     algorithm. On the toy model, whose loss has the same curvature everywhere, weighted \
                     averaging happens to match it: max difference {:.1e}, for information)",
                    r.max_model_error
                );
            }
        }
    } else {
        for v in &r.violations {
            let _ = writeln!(out, "CHECKER FAILED: {v}");
        }
    }
    let _ = writeln!(
        out,
        "trace: {} entries, hash {:016x}",
        r.trace_len, r.trace_hash
    );
    out
}

/// Two runs side by side.
pub fn sim_compare(a: &ravnest_sim::SimReport, b: &ravnest_sim::SimReport) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<14} {:>12} {:>10} {:>12} {:>11}",
        "planner", "sim time", "steps", "samples/s", "efficiency"
    );
    for r in [a, b] {
        let _ = writeln!(
            out,
            "{:<14} {:>10.1} s {:>10} {:>12.1} {:>11.2}",
            r.planner, r.sim_time_s, r.steps_completed, r.samples_per_s, r.capacity_efficiency
        );
    }
    if b.samples_per_s > 0.0 {
        let _ = writeln!(
            out,
            "{} / {} samples/s: {:.2}x",
            a.planner,
            b.planner,
            a.samples_per_s / b.samples_per_s
        );
    }
    out
}

/// One fault of a simulation and how the run answered it.
fn fault_line(f: &ravnest_sim::FaultReport) -> String {
    let mut line = format!("  at {:>7.1} s  {}", f.at_s, f.fault);
    if let Some(j) = f.rejoined_after_s {
        let _ = write!(line, ": rejoined after {j:.2} s");
    }
    if let Some(d) = f.detected_after_s {
        let _ = write!(line, ": detected after {d:.2} s");
    }
    if let Some(t) = &f.taken_over {
        let _ = write!(
            line,
            " (the coordinator's host, {} then): {} took over as coordinator after {:.2} s, from step {}",
            match t.during.as_str() {
                "re-plan" => "re-planning",
                "checkpoint" => "a checkpoint round open",
                _ => "steady state",
            },
            t.by,
            t.after_s,
            t.from_step
        );
    }
    match (f.resumed_after_s, f.detected_after_s) {
        (Some(x), Some(_)) => {
            let _ = write!(line, ", training resumed after {x:.2} s");
        }
        (Some(x), None) => {
            let sep = if f.rejoined_after_s.is_some() {
                ","
            } else {
                ":"
            };
            let _ = write!(line, "{sep} next step completed {x:.2} s later");
        }
        (None, _) => line.push_str(": no step completed after it"),
    }
    if !f.lost.is_empty() {
        let _ = write!(line, "; declared dead: {}", f.lost.join(", "));
    }
    if let Some(w) = f.waited_s {
        let _ = write!(
            line,
            "; no plan fitted the rest: training waited {w:.2} s for them"
        );
    }
    if let Some(k) = f.replanned_after_steps {
        let _ = write!(line, "; re-planned for measured speeds {k} steps later");
    }
    line
}

//! The report of a `ravnest run`, the same in every mode: the coordinator's figures, then one
//! row per node. A local run (the launcher) and a `--node` run (the coordinator's host, which
//! collects every worker's report and sends the whole back to them) print the same text.
//!
//! Console lines stay short: the full event list is in the output folder's `events.jsonl`.

use serde_json::{Value, json};

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

/// The run's summary document: the coordinator's report, each node's (by name, `null` for a
/// node that did not report), and the processes that failed.
pub fn merge(
    cluster: &str,
    coordinator: Option<Value>,
    nodes: &[(String, Option<Value>)],
    failed: &[String],
) -> Value {
    json!({
        "event": "summary",
        "cluster": cluster,
        "coordinator": coordinator,
        "nodes": nodes.iter().map(|(name, r)| json!({"node": name, "report": r})).collect::<Vec<_>>(),
        "failed": failed,
    })
}

/// The coordinator's figures in words.
pub fn coordinator_text(c: &Value) -> String {
    let f = |k: &str| c[k].as_f64().unwrap_or(0.0);
    let acc = f("accuracy");
    let target = f("target_accuracy");
    let sample = match (
        c["sample"]["prompt"].as_str(),
        c["sample"]["continuation"].as_str(),
    ) {
        (Some(p), Some(more)) => format!(
            "\nthe model continues the first test context: {:?} → {:?}",
            p, more
        ),
        _ => String::new(),
    };
    let resumed = match c["start_step"].as_u64() {
        Some(s) if s > 0 => format!(" (resumed from the checkpoint of step {s})"),
        _ => String::new(),
    };
    let body = format!(
        "trained steps {}..{} in {:.1} s: {:.0} samples/s{resumed}\n\
         accuracy on the held-out split: {:.3} (target {:.2}: {})\n\
         capacity efficiency: {:.2} (achieved ÷ {:.0} samples/s, the sum of each node's measured solo throughput)\n\
         checkpoints: steps {} in {} (final: {})",
        c["start_step"],
        c["steps"],
        f("train_s"),
        f("samples_per_s"),
        acc,
        target,
        if acc >= target {
            "reached"
        } else {
            "NOT reached"
        },
        f("capacity_efficiency"),
        f("solo_sum_samples_per_s"),
        c["checkpoints"]
            .as_array()
            .map(|a| a
                .iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(", "))
            .unwrap_or_default(),
        c["checkpoint_dir"].as_str().unwrap_or(""),
        c["final_checkpoint"].as_str().unwrap_or("")
    );
    body + &sample
}

/// The whole report of a run (a [`merge`] document) as text.
pub fn text(m: &Value) -> String {
    let mut out = format!("ravnest run: {}\n", m["cluster"].as_str().unwrap_or(""));
    let Some(c) = m["coordinator"]
        .as_object()
        .map(|o| Value::Object(o.clone()))
    else {
        return out + "the coordinator did not report\n";
    };
    out += &coordinator_text(&c);
    out += &format!(
        "\n\n{:<13} {:<12} {:>6} {:>6} {:>6} {:>6} {:>16} {:>10}\n",
        "node", "role", "steps", "busy", "comm", "idle", "solo samples/s", "sent"
    );
    let wall = c["train_s"].as_f64().unwrap_or(1.0).max(1e-9);
    for n in m["nodes"].as_array().into_iter().flatten() {
        let name = n["node"].as_str().unwrap_or("?");
        let r = &n["report"];
        if r.is_null() {
            out += &format!("{name:<13} (no report: the process ended early or left)\n");
            continue;
        }
        let busy = r["compute_s"].as_f64().unwrap_or(0.0) / wall;
        let comm = r["comm_s"].as_f64().unwrap_or(0.0) / wall;
        out += &format!(
            "{:<13} {:<12} {:>6} {:>5.0}% {:>5.0}% {:>5.0}% {:>16.0} {:>7.1} MB\n",
            name,
            r["role"].as_str().unwrap_or("?"),
            // (A JSON value's Display ignores the width: the number itself.)
            r["steps_applied"].as_u64().unwrap_or(0),
            100.0 * busy.min(1.0),
            100.0 * comm.min(1.0),
            100.0 * (1.0 - busy - comm).max(0.0),
            c["solo_by_node"][name].as_f64().unwrap_or(0.0),
            r["bytes_sent"].as_f64().unwrap_or(0.0) / 1e6
        );
    }
    out += &format!(
        "\n{} distinct plan(s); {} re-plan(s) for measured speeds\n",
        c["plans"].as_u64().unwrap_or(0),
        c["rebalances"].as_u64().unwrap_or(0)
    );
    let notable: Vec<&str> = c["notable_events"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e.as_str())
        .collect();
    if !notable.is_empty() {
        out += "\nevents:\n";
        for e in notable {
            out += &format!("  {e}\n");
        }
    }
    if let Some(f) = c["events_file"].as_str() {
        match c["node"].as_str() {
            Some(n) => out += &format!("every event: {f} (on `{n}`'s machine)\n"),
            None => out += &format!("every event: {f}\n"),
        }
    }
    if let Some(f) = m["failed"].as_array().filter(|f| !f.is_empty()) {
        out += &format!(
            "\nprocesses that failed: {}\n",
            f.iter()
                .filter_map(|x| x.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    clip_lines(&out)
}

/// Whether an event (in words) belongs in the printed report: faults, membership, resumes.
pub fn notable(what: &str) -> bool {
    what.contains("lost")
        || what.contains("aborted")
        || what.contains("joined")
        || what.starts_with("violation")
        || what.starts_with("stalled")
        || what.starts_with("no step agreed")
        || what.starts_with("checkpoint shard refused")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_header_lines_up_with_its_rows() {
        let c = json!({"train_s": 1.0, "solo_by_node": {"fast-a": 1234.0}, "steps": 10, "start_step": 0});
        let r = json!({"role": "coordinator", "steps_applied": 10, "compute_s": 0.5, "comm_s": 0.25, "bytes_sent": 2.5e6});
        let t = text(&merge("x", Some(c), &[("fast-a".into(), Some(r))], &[]));
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
    fn long_lines_are_cut() {
        let long = "x".repeat(1000);
        let t = clip_lines(&format!("short\n{long}"));
        assert!(t.lines().all(|l| l.chars().count() <= MAX_LINE), "{t}");
        assert!(t.starts_with("short\n"));
    }
}

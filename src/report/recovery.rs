//! `ravnest plan`'s recovery lines: what losing a node costs the plan, and the best plan of
//! every other kind of layout with its step time and recovery cost (what the choice traded).

use std::fmt::Write as _;

use ravnest_core::Plan;
use ravnest_core::planner::choice::ALTERNATIVES_WITHIN;
use ravnest_core::planner::recovery::DETECT_S;
use ravnest_core::planner::{Layout, Recovery, RecoveryKind};
use ravnest_core::units::{num, secs};

/// A layout in a few words.
fn shape(layout: &Layout) -> String {
    match layout {
        Layout::DataParallel { workers: 1 } => "one worker".into(),
        Layout::DataParallel { workers } => format!("data parallel over {workers} nodes"),
        Layout::Pipeline {
            stages,
            replicas: 1,
            ..
        } => format!("one pipeline of {stages} stages"),
        Layout::Pipeline {
            stages, replicas, ..
        } => format!("{replicas} pipeline replicas x {stages} stages"),
        Layout::Sharded { workers, .. } => format!("sharded data parallel over {workers} nodes"),
    }
}

/// Copies in words: "1 copy", "4 copies".
fn copies(r: &Recovery) -> String {
    match r.copies {
        1 => "1 copy".into(),
        n => format!("{n} copies"),
    }
}

/// What a loss costs, in parts: detection, the steps redone, the checkpoint read.
fn loss_parts(r: &Recovery, every: u64) -> String {
    match r.kind {
        RecoveryKind::Replan => format!(
            "a lost node is re-planned from a surviving copy: {} to notice + the step in flight {} = {}",
            secs(DETECT_S),
            secs(r.redo_s),
            secs(r.per_loss_s)
        ),
        RecoveryKind::Restore => format!(
            "a lost node means restoring the latest checkpoint: {} to notice + {} steps redone \
             (half the checkpoint interval of {every}) {} + reading it {} = {}",
            secs(DETECT_S),
            every as f64 / 2.0,
            secs(r.redo_s),
            secs(r.read_s),
            secs(r.per_loss_s)
        ),
    }
}

/// The `recovery:` line and, when the planner compared other kinds of layout, their lines.
pub(super) fn recovery_text(p: &Plan, mtbf_h: f64, every: u64, redundancy: &str) -> String {
    let mut out = String::new();
    let r = &p.recovery;
    let charged = match r.charged {
        true => format!("; step + recovery {}", secs(p.objective_s())),
        false => " (not charged: `redundancy = \"never\"`)".into(),
    };
    let _ = writeln!(
        out,
        "recovery ({} of every layer): {};\n  expected {} per step ({} node(s), one loss per {} h each){charged}",
        copies(r),
        loss_parts(r, every),
        secs(r.per_step_s),
        r.nodes,
        num(mtbf_h),
    );
    if p.alternatives.is_empty() && p.not_within.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "other layouts, the best of each (step + expected recovery; redundancy = {redundancy}):"
    );
    let mut alts: Vec<_> = p.alternatives.iter().collect();
    alts.sort_by(|a, b| a.objective_s().total_cmp(&b.objective_s()));
    for a in alts {
        let cost = match a.recovery.charged {
            true => format!(
                "{} + {} = {}",
                secs(a.step.step_s),
                secs(a.recovery.per_step_s),
                secs(a.objective_s())
            ),
            false => format!(
                "{} (recovery {} not charged)",
                secs(a.step.step_s),
                secs(a.recovery.per_step_s)
            ),
        };
        let _ = writeln!(
            out,
            "  {} ({}): {cost}: {}",
            shape(&a.layout),
            copies(&a.recovery),
            a.why
        );
    }
    if !p.not_within.is_empty() {
        let kinds: Vec<&str> = p.not_within.iter().map(|c| c.as_str()).collect();
        let _ = writeln!(
            out,
            "  {}: none within {ALTERNATIVES_WITHIN}x of a plan above (searched no further)",
            kinds.join(", ")
        );
    }
    out
}

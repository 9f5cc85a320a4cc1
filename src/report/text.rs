//! Small text helpers every report uses (a leaf).

use ravnest_core::Plan;
use ravnest_core::planner::Layout;

/// Clusters larger than this print one row per group of identical nodes.
pub(super) const MAX_ROWS: usize = 24;

pub(super) fn truncate(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n - 1).chain(['~']).collect()
    }
}

pub(super) fn short_layout(p: &Plan) -> String {
    match &p.layout {
        Layout::DataParallel { workers } => format!("dp x{workers}"),
        Layout::Pipeline {
            stages, replicas, ..
        } => format!("pp {replicas}x{stages}"),
        Layout::Sharded { workers, .. } => format!("zero x{workers}"),
    }
}

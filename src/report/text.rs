//! Small text helpers every report uses (a leaf).

use ravnest_core::Plan;
use ravnest_core::planner::Layout;

/// Clusters larger than this print one row per group of identical nodes.
pub(super) const MAX_ROWS: usize = 24;

/// The widest line a plan prints: longer ones wrap at a space, continued indented.
pub(super) const WIDTH: usize = 200;

/// `text` with every line longer than `width` characters wrapped at spaces, each continuation
/// indented four spaces past the line's own indent (a word longer than a line stays whole).
pub(super) fn wrap(text: &str, width: usize) -> String {
    let mut out = String::with_capacity(text.len());
    for line in text.split_inclusive('\n') {
        let (body, nl) = line.strip_suffix('\n').map_or((line, ""), |b| (b, "\n"));
        if body.chars().count() <= width {
            out.push_str(line);
            continue;
        }
        let indent = body.len() - body.trim_start().len();
        let pad = " ".repeat(indent + 4);
        let mut cur = body[..indent].to_string();
        let mut first = true;
        for word in body.trim_start().split(' ') {
            let len = cur.chars().count();
            let fresh = len == indent || (!first && len == pad.len());
            if !fresh && len + 1 + word.chars().count() > width {
                out.push_str(&cur);
                out.push('\n');
                cur = pad.clone();
                first = false;
            } else if !fresh {
                cur.push(' ');
            }
            cur.push_str(word);
        }
        out.push_str(&cur);
        out.push_str(nl);
    }
    out
}

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

#[cfg(test)]
mod tests {
    use super::*;

    /// Wrapped, no line is wider than the width (but for a single longer word), and the words
    /// are the same in the same order.
    #[test]
    fn wrap_keeps_the_words_and_the_width() {
        let long = format!("  why: {}", "word ".repeat(90).trim_end());
        let text = format!("short\n{long}\nend\n");
        let w = wrap(&text, 60);
        assert!(w.lines().all(|l| l.chars().count() <= 60), "{w}");
        let words = |t: &str| t.split_whitespace().map(String::from).collect::<Vec<_>>();
        assert_eq!(words(&w), words(&text));
        assert!(w.lines().nth(2).unwrap().starts_with("      word"), "{w}");
        assert_eq!(wrap("a\n", 60), "a\n");
    }
}

//! A picture of a run: one lane per node, compute / communication / idle / down over virtual
//! time, with fault and recovery markers. Self-contained SVG, readable in any browser.

use std::fmt::Write as _;

use ravnest_runtime::counters::SpanKind;

/// One node's lane.
#[derive(Debug, Clone, Default)]
pub struct Lane {
    /// Node name.
    pub name: String,
    /// (start ns, end ns, kind).
    pub spans: Vec<(u64, u64, SpanKind)>,
    /// Intervals the node was down.
    pub down: Vec<(u64, u64)>,
}

/// Everything the picture shows.
#[derive(Debug, Clone, Default)]
pub struct Timeline {
    /// End of the run, ns.
    pub end_ns: u64,
    /// Lanes in node order.
    pub lanes: Vec<Lane>,
    /// (time ns, label, is a fault (red) rather than a recovery (green)).
    pub markers: Vec<(u64, String, bool)>,
}

/// Lanes drawn at most; the rest are summarized in a note.
const MAX_LANES: usize = 64;
const WIDTH: f64 = 1200.0;
const LEFT: f64 = 130.0;
const LANE: f64 = 18.0;
const TOP: f64 = 60.0;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The drawing: where time goes on the x axis, how many lanes, the SVG so far.
struct Canvas {
    o: String,
    lanes: usize,
    span_w: f64,
    end: f64,
}

impl Canvas {
    /// x of a time.
    fn x(&self, ns: u64) -> f64 {
        LEFT + self.span_w * ns as f64 / self.end
    }

    /// y below the last lane.
    fn bottom(&self) -> f64 {
        TOP + LANE * self.lanes as f64
    }

    /// Grid lines and labels every round number of seconds (at most about 12).
    fn axis(&mut self) {
        let secs = self.end / 1e9;
        let step = [
            1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
        ]
        .into_iter()
        .find(|s| secs / s <= 12.0)
        .unwrap_or(7200.0);
        let mut s = 0.0;
        while s <= secs {
            let xs = self.x((s * 1e9) as u64);
            let bottom = self.bottom();
            let _ = writeln!(
                self.o,
                r##"<line x1="{xs:.1}" y1="{}" x2="{xs:.1}" y2="{bottom}" stroke="#dddddd"/>"##,
                TOP - 5.0,
            );
            let _ = writeln!(
                self.o,
                r#"<text x="{xs:.1}" y="{}" text-anchor="middle">{s:.0} s</text>"#,
                bottom + 14.0
            );
            s += step;
        }
    }

    /// A bar of a lane from `a` to `b` (at least half a pixel wide).
    fn bar(&mut self, y: f64, a: u64, b: u64, color: &str) {
        let (xa, xb) = (self.x(a), self.x(b));
        let _ = writeln!(
            self.o,
            r#"<rect x="{xa:.2}" y="{:.1}" width="{:.2}" height="{:.1}" fill="{color}"/>"#,
            y + 2.0,
            (xb - xa).max(0.5),
            LANE - 4.0
        );
    }

    /// Lane `i`: its name, idle background, compute and communication spans, downtime.
    fn lane(&mut self, i: usize, lane: &Lane) {
        let y = TOP + LANE * i as f64;
        let _ = writeln!(
            self.o,
            r#"<text x="{}" y="{:.1}" text-anchor="end">{}</text>"#,
            LEFT - 6.0,
            y + 12.0,
            esc(&lane.name)
        );
        let _ = writeln!(
            self.o,
            r##"<rect x="{LEFT}" y="{:.1}" width="{:.1}" height="{:.1}" fill="#eeeeee"/>"##,
            y + 2.0,
            self.span_w,
            LANE - 4.0
        );
        // Merge spans closer than a pixel so long runs stay small.
        let px_ns = (self.end / self.span_w) as u64;
        let mut merged: Vec<(u64, u64, SpanKind)> = Vec::new();
        for &(a, b, k) in &lane.spans {
            match merged.last_mut() {
                Some(m) if m.2 == k && a <= m.1 + px_ns => m.1 = m.1.max(b),
                _ => merged.push((a, b, k)),
            }
        }
        for (a, b, k) in merged {
            let color = match k {
                SpanKind::Compute => "#3b7dd8",
                SpanKind::Comm => "#f0a030",
            };
            self.bar(y, a, b, color);
        }
        for &(a, b) in &lane.down {
            self.bar(y, a, b, "#444444");
        }
    }

    /// Fault (red) and recovery (green) markers across the lanes, labels alternating rows.
    fn markers(&mut self, markers: &[(u64, String, bool)]) {
        for (k, (ns, label, fault)) in markers.iter().enumerate() {
            let xs = self.x(*ns);
            let color = if *fault { "#d62728" } else { "#2ca02c" };
            let _ = writeln!(
                self.o,
                r#"<line x1="{xs:.1}" y1="{}" x2="{xs:.1}" y2="{}" stroke="{color}" stroke-width="1.5"/>"#,
                TOP - 8.0,
                self.bottom()
            );
            let _ = writeln!(
                self.o,
                r#"<text x="{:.1}" y="{}" fill="{color}">{}</text>"#,
                xs + 3.0,
                TOP - 10.0 - 11.0 * (k % 2) as f64,
                esc(label)
            );
        }
    }

    /// What the colours mean, and how many lanes were left out.
    fn legend(&mut self, not_drawn: usize) {
        let ly = self.bottom() + 36.0;
        let legend = [
            (10.0, "#3b7dd8", "compute"),
            (
                110.0,
                "#f0a030",
                "communication (incl. waiting in a collective)",
            ),
            (420.0, "#eeeeee", "idle"),
            (490.0, "#444444", "down"),
        ];
        for (lx, color, what) in legend {
            let _ = writeln!(
                self.o,
                r##"<rect x="{lx}" y="{}" width="12" height="12" fill="{color}" stroke="#999999"/>"##,
                ly - 10.0
            );
            let _ = writeln!(self.o, r#"<text x="{}" y="{ly}">{what}</text>"#, lx + 16.0);
        }
        if not_drawn > 0 {
            let _ = writeln!(
                self.o,
                r#"<text x="10" y="{}">... {not_drawn} more nodes not drawn</text>"#,
                ly + 18.0,
            );
        }
    }
}

/// Render the timeline as SVG.
pub fn svg(t: &Timeline, title: &str) -> String {
    let lanes = t.lanes.len().min(MAX_LANES);
    let height = TOP + LANE * lanes as f64 + 70.0;
    let mut c = Canvas {
        o: String::new(),
        lanes,
        span_w: WIDTH - LEFT - 20.0,
        end: t.end_ns.max(1) as f64,
    };
    let _ = writeln!(
        c.o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(
        c.o,
        r##"<rect width="100%" height="100%" fill="#ffffff"/>"##
    );
    let _ = writeln!(
        c.o,
        r#"<text x="10" y="20" font-size="14" font-weight="bold">{}</text>"#,
        esc(title)
    );
    c.axis();
    for (i, lane) in t.lanes.iter().take(lanes).enumerate() {
        c.lane(i, lane);
    }
    c.markers(&t.markers);
    c.legend(t.lanes.len() - lanes);
    c.o.push_str("</svg>\n");
    c.o
}

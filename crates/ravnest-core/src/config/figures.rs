//! The numbers of the file: how a message shows them (human units, no 300-digit numbers) and
//! the range a real cluster can have for each field. A leaf.

use crate::units::num;

/// A number of the file: shown in human units, and refused when no real cluster has it.
pub(super) trait Figure: Copy + PartialOrd + Default {
    /// The number as a message shows it (no 300-digit numbers, no exponent).
    fn show(self) -> String;
    /// Finite and within the range a real `what` can have, or why not.
    fn sane(self, what: &str) -> Result<Self, String>;
}

/// The range a field can sensibly have, and what the bound stands for. Beyond it, a unit is
/// wrong (GB for TB, bit/s for Gbit/s) or a figure was mistyped; letting it through gives plans
/// with a step of 10^300 s or a node that computes in no time.
struct Range {
    /// Smallest sensible value (above 0 when 0 is already refused by the caller).
    smallest: f64,
    /// Largest sensible value.
    largest: f64,
    /// What the largest stands for, in the message.
    why: &'static str,
}

/// The sensible range of a field, by its key. The table in `docs/cluster-format.md` lists the
/// same bounds.
fn range(what: &str) -> Range {
    let r = |smallest, largest, why| Range {
        smallest,
        largest,
        why,
    };
    match what {
        // One node is one accelerator: the fastest sold (B200) does ~2.3 PFLOP/s dense fp16;
        // a machine that trains does more than 1 GFLOP/s.
        "tflops" => r(1e-3, 10_000.0, "10 PFLOP/s, 4x any single accelerator"),
        // Small memory is allowed (the planner leaves such a node out, with the reason).
        "memory_gib" | "memory_reserve_gib" => r(0.0, 100_000.0, "about 100 TiB in one node"),
        // NVLink 5 gives a GPU 14.4 Tbit/s; a link slower than 100 kbit/s moves no model.
        "bandwidth_gbps" => r(1e-4, 20_000.0, "20 Tbit/s, above NVLink 5"),
        "latency_ms" => r(0.0, 60_000.0, "a minute"),
        "emulate_slowdown" | "factor" => r(1e-3, 10_000.0, "10,000 times slower"),
        "learning_rate" => r(0.0, 10.0, "10"),
        "weight_decay" => r(0.0, 10.0, "10"),
        "local_sgd_threshold" => r(0.0, 1e6, "a million"),
        "outer_lr" => r(0.0, 10.0, "10"),
        // A node that fails every 36 s trains nothing; a million hours is 114 years.
        "node_mtbf_h" => r(0.01, 1e6, "a million hours (114 years)"),
        "target_accuracy" => r(0.0, 1.0, "1, every test sample right"),
        "target_bits_per_byte" => r(0.0, 64.0, "64 bits per byte"),
        // A year of virtual time.
        "at_s" | "from_s" | "to_s" => r(0.0, 31_536_000.0, "a year"),
        // 10^17 FLOPs per sample is 50x a whole 175B-parameter GPT's forward pass.
        "fwd_flops_per_sample" => r(0.0, 1e17, "10^17 per sample per layer"),
        _ => r(0.0, 1e18, "10^18"),
    }
}

/// The largest value an integer field can sensibly have; past it the planner's arithmetic
/// would run for hours or overflow.
fn largest_count(what: &str) -> u64 {
    match what {
        "count" => 100_000,                           // nodes in one table
        "global_batch" | "micro_batch" => 16_777_216, // 2^24 samples
        "layers" | "repeat" => 10_000,                // layers in a model
        "hidden" | "heads" | "dims" => 1 << 17,       // 131,072
        "seq_len" | "vocab" => 1 << 24,               // 16,777,216
        "params" => 10_000_000_000_000,               // 10^13 per layer
        "activation_elems_per_sample" | "output_elems_per_sample" => 1_000_000_000_000, // 10^12
        _ => u64::MAX,
    }
}

fn sane_count(x: u64, what: &str) -> Result<u64, String> {
    let max = largest_count(what);
    if x > max {
        return Err(format!(
            "`{what}` = {} is beyond any real cluster (at most {}): check the figure",
            num(x as f64),
            num(max as f64)
        ));
    }
    Ok(x)
}

impl Figure for u64 {
    fn show(self) -> String {
        self.to_string()
    }
    fn sane(self, what: &str) -> Result<u64, String> {
        sane_count(self, what)
    }
}

impl Figure for u32 {
    fn show(self) -> String {
        self.to_string()
    }
    fn sane(self, what: &str) -> Result<u32, String> {
        sane_count(u64::from(self), what).map(|_| self)
    }
}

impl Figure for f64 {
    fn show(self) -> String {
        if self.is_nan() {
            "nan".to_string()
        } else if self.is_infinite() {
            if self > 0.0 { "inf" } else { "-inf" }.to_string()
        } else if self != 0.0 && !(1e-4..1e15).contains(&self.abs()) {
            // Only the order of magnitude of such a figure matters to its reader.
            let sign = if self < 0.0 { "-" } else { "" };
            format!("{sign}about 10^{}", self.abs().log10().round())
        } else {
            num(self)
        }
    }
    fn sane(self, what: &str) -> Result<f64, String> {
        if !self.is_finite() {
            return Err(format!(
                "`{what}` must be a finite number, got {}",
                self.show()
            ));
        }
        let r = range(what);
        if self > r.largest {
            return Err(format!(
                "`{what}` = {} is beyond any real cluster (at most {}, {}): check its unit",
                self.show(),
                num(r.largest),
                r.why
            ));
        }
        if self < r.smallest {
            return Err(format!(
                "`{what}` = {} is below any real cluster (at least {}): check its unit",
                self.show(),
                r.smallest.show()
            ));
        }
        Ok(self)
    }
}

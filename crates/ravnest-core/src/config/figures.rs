//! The numbers of the file: how a message shows them (human units, no 300-digit numbers) and
//! the largest value a real cluster can have for each field. A leaf.

/// A number of the file: shown in human units, and refused when no real cluster has it.
pub(super) trait Figure: Copy + PartialOrd + Default {
    /// The number as a message shows it (no 300-digit numbers).
    fn show(self) -> String;
    /// Finite and below the largest value a real `what` can have, or why not.
    fn sane(self, what: &str) -> Result<Self, String>;
}

impl Figure for u64 {
    fn show(self) -> String {
        self.to_string()
    }
    fn sane(self, _: &str) -> Result<u64, String> {
        Ok(self)
    }
}

impl Figure for u32 {
    fn show(self) -> String {
        self.to_string()
    }
    fn sane(self, _: &str) -> Result<u32, String> {
        Ok(self)
    }
}

/// The largest value a field can sensibly have (beyond it, a unit is wrong): what a node,
/// link or run of any real cluster stays far below.
fn largest(what: &str) -> f64 {
    match what {
        "tflops" => 100_000.0,                              // 100 PFLOP/s for one node
        "memory_gib" | "memory_reserve_gib" => 1_048_576.0, // 1 PiB
        "bandwidth_gbps" => 1_000_000.0,                    // 1 Pbit/s
        "latency_ms" => 3_600_000.0,                        // an hour
        "emulate_slowdown" | "factor" => 1_000_000.0,
        "learning_rate" => 1_000.0,
        _ => 1e18,
    }
}

impl Figure for f64 {
    fn show(self) -> String {
        if self != 0.0 && self.is_finite() && !(1e-3..1e7).contains(&self.abs()) {
            format!("{self:.3e}")
        } else {
            format!("{self}")
        }
    }
    fn sane(self, what: &str) -> Result<f64, String> {
        if !self.is_finite() {
            return Err(format!("`{what}` must be a finite number, got {self}"));
        }
        let max = largest(what);
        if self > max {
            return Err(format!(
                "`{what}` = {} is beyond any real cluster (at most {}): check its unit",
                self.show(),
                max.show()
            ));
        }
        Ok(self)
    }
}

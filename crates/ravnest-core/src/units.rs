//! Figures in human units for every message the planner, the config and the CLI print.
//!
//! One place decides how a duration, a size, a rate or a ratio reads, so that no message
//! prints a 300-digit number, an exponent of 300, or "0.0 GiB" for 40 MiB. Each function
//! keeps at most four significant digits (a count of samples per second at most six), names
//! its unit, and says `unbounded` / `n/a` for infinities and NaN rather than `inf` / `NaN`.
//! Figures beyond any real cluster (a year of step time, an exbibyte of memory) print as a
//! bound (`> 1 year`), since their digits carry no information.

/// Bytes in a KiB, MiB, .. EiB.
const BINARY_UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];

/// A non-finite figure, as words (`None` when finite).
fn non_finite(x: f64) -> Option<&'static str> {
    if x.is_nan() {
        Some("n/a")
    } else if x.is_infinite() {
        Some(if x > 0.0 { "unbounded" } else { "-unbounded" })
    } else {
        None
    }
}

/// Seconds as `0`, `250 ns`, `524 µs`, `12.3 ms`, `1.23 s`, `41.90 s`, `12.5 min`, `3.2 h`,
/// `4.1 days`; beyond a year, `> 1 year`. Below 100 s the forms are those the plan has
/// always printed (golden files rely on them).
pub fn secs(s: f64) -> String {
    if let Some(w) = non_finite(s) {
        return w.to_string();
    }
    if s < 0.0 {
        return format!("-{}", secs(-s));
    }
    const MIN: f64 = 60.0;
    const HOUR: f64 = 3600.0;
    const DAY: f64 = 86_400.0;
    const YEAR: f64 = 365.0 * DAY;
    if s == 0.0 {
        "0".to_string()
    } else if s > YEAR {
        "> 1 year".to_string()
    } else if s >= 2.0 * DAY {
        format!("{:.1} days", s / DAY)
    } else if s >= 2.0 * HOUR {
        format!("{:.1} h", s / HOUR)
    } else if s >= 100.0 {
        format!("{:.1} min", s / MIN)
    } else if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.1} ms", s * 1e3)
    } else if s >= 1e-6 {
        format!("{:.0} µs", s * 1e6)
    } else if s >= 1e-9 {
        format!("{:.0} ns", s * 1e9)
    } else {
        "< 1 ns".to_string()
    }
}

/// A size in bytes as `512 B`, `41.5 MiB`, `12.8 GiB`, `3.0 TiB`; beyond 1024 EiB,
/// `> 1024 EiB`. Sub-GiB sizes keep their own unit, so 40 MiB never reads "0.0 GiB".
pub fn bytes(b: f64) -> String {
    if let Some(w) = non_finite(b) {
        return w.to_string();
    }
    if b < 0.0 {
        return format!("-{}", bytes(-b));
    }
    if b < 1024.0 {
        return format!("{b:.0} B");
    }
    let mut x = b;
    for unit in &BINARY_UNITS[1..] {
        x /= 1024.0;
        // 1023.96 KiB would round to "1024.0 KiB": move up a unit before that.
        if x < 1023.95 {
            return format!("{x:.1} {unit}");
        }
    }
    "> 1024 EiB".to_string()
}

/// [`bytes`] of an integer byte count.
pub fn bytes_u64(b: u64) -> String {
    bytes(b as f64)
}

/// [`bytes`] of a size in GiB (figures the planner keeps in GiB).
pub fn gib(g: f64) -> String {
    bytes(g * 1024.0 * 1024.0 * 1024.0)
}

/// A plain figure with at most four significant digits and no exponent: `0.1`, `25`,
/// `13.08`, `1234`, `12.35k`, `3.2M`; beyond 10^15, `> 10^15`.
pub fn num(x: f64) -> String {
    if let Some(w) = non_finite(x) {
        return w.to_string();
    }
    if x < 0.0 {
        return format!("-{}", num(-x));
    }
    if x == 0.0 {
        return "0".to_string();
    }
    if x < 1e-4 {
        return "< 0.0001".to_string();
    }
    if x >= 1e15 {
        return "> 10^15".to_string();
    }
    let (scaled, suffix) = if x >= 1e12 {
        (x / 1e12, "T")
    } else if x >= 1e9 {
        (x / 1e9, "G")
    } else if x >= 1e6 {
        (x / 1e6, "M")
    } else if x >= 1e4 {
        (x / 1e3, "k")
    } else {
        (x, "")
    };
    // Four significant digits, trailing zeros trimmed.
    let digits = scaled.abs().log10().floor() as i32 + 1;
    let decimals = (4 - digits).clamp(0, 4) as usize;
    let mut s = format!("{scaled:.decimals$}");
    if s.contains('.') {
        s = s.trim_end_matches('0').trim_end_matches('.').to_string();
    }
    format!("{s}{suffix}")
}

/// A rate such as samples per second: `46.6`, `1362.4`, `156567`, `1.23M`; at most six
/// significant digits.
pub fn rate(x: f64) -> String {
    if (0.0..1e4).contains(&x) {
        format!("{x:.1}")
    } else if (0.0..1e6).contains(&x) {
        format!("{x:.0}")
    } else {
        num(x)
    }
}

/// The largest ratio a report prints as a figure; above it, `> 1000x` (a ratio that large
/// says one side is broken or idle, not how much faster the other is).
pub const RATIO_MAX: f64 = 1000.0;

/// A ratio of two positive figures as `3.70x`; `> 1000x` above [`RATIO_MAX`], `< 0.001x`
/// below its inverse, and `n/a` when either side is zero, negative or not finite.
pub fn ratio(num: f64, den: f64) -> String {
    if !(num.is_finite() && den.is_finite() && num > 0.0 && den > 0.0) {
        return "n/a".to_string();
    }
    let r = num / den;
    if r > RATIO_MAX {
        format!("> {RATIO_MAX:.0}x")
    } else if r < 1.0 / RATIO_MAX {
        format!("< {:.3}x", 1.0 / RATIO_MAX)
    } else {
        format!("{r:.2}x")
    }
}

/// A ratio for machine-readable output: `num / den` clamped to
/// [1/[`RATIO_MAX`], [`RATIO_MAX`]], or `None` when it has no meaning (see [`ratio`]).
pub fn ratio_value(num: f64, den: f64) -> Option<f64> {
    (num.is_finite() && den.is_finite() && num > 0.0 && den > 0.0)
        .then(|| (num / den).clamp(1.0 / RATIO_MAX, RATIO_MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_read_in_the_unit_of_their_size() {
        assert_eq!(secs(0.0), "0");
        assert_eq!(secs(2.5e-7), "250 ns");
        assert_eq!(secs(5.24e-4), "524 µs");
        assert_eq!(secs(0.3046), "304.6 ms");
        assert_eq!(secs(41.9), "41.90 s");
        assert_eq!(secs(750.0), "12.5 min");
        assert_eq!(secs(3.0 * 3600.0), "3.0 h");
        assert_eq!(secs(5.0 * 86_400.0), "5.0 days");
        assert_eq!(secs(1e300), "> 1 year");
        assert_eq!(secs(f64::INFINITY), "unbounded");
        assert_eq!(secs(f64::NAN), "n/a");
    }

    #[test]
    fn bytes_never_read_zero_gib() {
        assert_eq!(bytes(0.0), "0 B");
        assert_eq!(bytes(512.0), "512 B");
        assert_eq!(bytes(40.0 * 1024.0 * 1024.0), "40.0 MiB");
        assert_eq!(bytes(12.8 * 1024.0 * 1024.0 * 1024.0), "12.8 GiB");
        assert_eq!(bytes(1023.99 * 1024.0), "1.0 MiB");
        assert_eq!(bytes(1e300), "> 1024 EiB");
        assert_eq!(bytes_u64(u64::MAX), "16.0 EiB");
        assert_eq!(bytes(f64::INFINITY), "unbounded");
    }

    #[test]
    fn plain_numbers_keep_four_digits_and_no_exponent() {
        assert_eq!(num(0.1), "0.1");
        assert_eq!(num(25.0), "25");
        assert_eq!(num(13.0849), "13.08");
        assert_eq!(num(104.613), "104.6");
        assert_eq!(num(12_345.0), "12.35k");
        assert_eq!(num(3.2e6), "3.2M");
        assert_eq!(num(1e301), "> 10^15");
        assert_eq!(num(1e-300), "< 0.0001");
        assert_eq!(rate(46.63), "46.6");
        assert_eq!(rate(156_566.6), "156567");
        assert_eq!(rate(2.3e301), "> 10^15");
    }

    #[test]
    fn ratios_are_bounded_and_never_divide_by_zero() {
        assert_eq!(ratio(370.0, 100.0), "3.70x");
        assert_eq!(ratio(2.3e301, 1.0), "> 1000x");
        assert_eq!(ratio(1.0, 1e9), "< 0.001x");
        assert_eq!(ratio(1.0, 0.0), "n/a");
        assert_eq!(ratio(f64::INFINITY, 1.0), "n/a");
        assert_eq!(ratio_value(5.0, 0.0), None);
        assert_eq!(ratio_value(1e9, 1.0), Some(RATIO_MAX));
        for x in [1e-300, 1e-9, 0.5, 1.0, 7.5, 1e12, 1e300] {
            for s in [secs(x), bytes(x), num(x), rate(x), ratio(x, 1.0)] {
                assert!(s.len() <= 12, "{x}: `{s}` too long");
                let exponent = s
                    .as_bytes()
                    .windows(2)
                    .any(|w| w[0].is_ascii_digit() && w[1] == b'e');
                assert!(!exponent, "{x}: `{s}` has an exponent");
            }
        }
    }
}

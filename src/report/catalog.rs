//! `ravnest catalog`: the devices and model presets ravnest knows.

use std::fmt::Write as _;

use ravnest_core::device::{self};
use ravnest_core::model::PRESETS;

/// `ravnest catalog`.
pub fn catalog_text() -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<11} {:<28} {:>7} {:>10} {:>10} {:>10} {:>11}  grounding",
        "device", "name", "GiB", "fp32 peak", "fp16 peak", "fp32 eff.", "efficiency"
    );
    for d in device::CATALOG {
        let eff = d
            .effective_flops(ravnest_core::Precision::Fp32)
            .unwrap_or(0.0)
            / 1e12;
        let grounding = match d.grounding {
            device::Grounding::Measured(m) => {
                format!("measured (Sailor {}, mbs {})", m.sailor_gpu, m.mbs)
            }
            device::Grounding::Sibling(s) => format!("efficiency of {s}"),
            device::Grounding::Assumed(e) => format!("assumed efficiency {e}"),
        };
        let _ = writeln!(
            out,
            "{:<11} {:<28} {:>7.0} {:>10.1} {:>10} {:>10.1} {:>11.2}  {grounding}",
            d.id,
            d.name,
            d.memory_gib,
            d.fp32_peak_tflops,
            d.fp16_peak_tflops.map_or("-".into(), |x| format!("{x:.1}")),
            eff,
            d.fp32_efficiency()
        );
    }
    let _ = writeln!(
        out,
        "(TFLOP/s; fp16 peak is the dense tensor rate with fp32 accumulate)\n"
    );
    let _ = writeln!(out, "{:<17} {:>10}  about", "model preset", "params");
    for p in PRESETS {
        let n = p.build().params() as f64;
        let size = if n >= 1e6 {
            format!("{:.1}M", n / 1e6)
        } else {
            format!("{:.1}K", n / 1e3)
        };
        let _ = writeln!(out, "{:<17} {:>10}  {}", p.name, size, p.about);
    }
    out
}

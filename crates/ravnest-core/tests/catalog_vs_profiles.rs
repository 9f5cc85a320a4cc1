//! The device catalog checked against measured GPU profiles (the Sailor artifact, SOSP'25,
//! eth-easl/sailor, MIT; copied into `tests/data/gpu-profiles/`, see its ATTRIBUTION.md).
//!
//! For every catalog GPU the profiles measured: its fp32 throughput relative to the RTX 3090
//! must follow the measured relative speed (OPT-350, seq 2048, forward + backward seconds per
//! sample at micro-batch 2, which every profiled GPU has), its memory must be the measured
//! GPU's, and its mixed-precision figure must not be below what the GPU measurably does in
//! fp32. The tolerances are stated with each check.

use std::collections::BTreeMap;

use ravnest_core::device::{self, GIB, Grounding, opt350_train_flops_per_sample};
use ravnest_core::model::Precision;
use serde_json::Value;

/// Sailor's GPU names and the catalog entries they are. Sailor's "RTX-2080" has 11 GiB of
/// memory: the 2080 Ti's (the plain 2080 has 8).
const MAP: &[(&str, &str)] = &[
    ("A100-40", "a100-40"),
    ("A100-80", "a100-80"),
    ("GH-96", "gh200"),
    ("RTX-2080", "rtx2080ti"),
    ("RTX-3090", "rtx3090"),
    ("Titan-RTX", "titan-rtx"),
    ("V100-16", "v100-16"),
];

/// The GPU speeds are normalized to.
const REFERENCE: &str = "RTX-3090";

/// The micro-batch size every profiled GPU was measured at.
const MBS: u64 = 2;

/// Largest relative difference between the catalog's fp32 speed ratio and the measured one.
/// The catalog takes each GPU's best micro-batch size and the check a common one (2): the
/// per-sample time varies by at most ~4% across sizes in the data, so 10% is loose for a
/// correct entry and still catches a figure off by a generation.
const SPEED_TOLERANCE: f64 = 0.10;

/// Largest relative difference in memory: the profiles' A100-40 has 42,338,615,296 bytes
/// (39.4 GiB) and their GH200 95.6 GiB, where the catalog says 40 and 96 GiB as sold.
const MEMORY_TOLERANCE: f64 = 0.05;

fn data(name: &str) -> Value {
    let path = format!(
        "{}/tests/data/gpu-profiles/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Measured seconds per sample of OPT-350 (tp 1) at micro-batch [`MBS`], by Sailor GPU name.
fn measured_s_per_sample() -> BTreeMap<String, f64> {
    let profiles = data("profiles_summary.json");
    let rows = profiles["rows"].as_array().expect("rows");
    rows.iter()
        .filter(|r| r["model"] == "OPT-350" && r["tp"] == 1 && r["mbs"] == MBS)
        .map(|r| {
            let gpu = r["gpu"].as_str().expect("gpu").to_string();
            let s = r["total_fwd_bwd_s"].as_f64().expect("total_fwd_bwd_s") / MBS as f64;
            (gpu, s)
        })
        .collect()
}

fn fp32(id: &str) -> f64 {
    device::lookup(id)
        .unwrap_or_else(|| panic!("catalog has no `{id}`"))
        .effective_flops(Precision::Fp32)
        .expect("every GPU runs fp32")
}

#[test]
fn every_measured_catalog_entry_is_in_the_map_and_the_profiles() {
    let measured = measured_s_per_sample();
    for d in device::CATALOG {
        if let Grounding::Measured(m) = d.grounding {
            assert!(
                MAP.contains(&(m.sailor_gpu, d.id)),
                "{}: grounded on `{}`, which the map does not pair with it",
                d.id,
                m.sailor_gpu
            );
        }
    }
    for (gpu, _) in MAP {
        assert!(
            measured.contains_key(*gpu),
            "no OPT-350 mbs {MBS} row for {gpu}"
        );
    }
}

#[test]
fn relative_fp32_speed_follows_the_measured_profiles() {
    let measured = measured_s_per_sample();
    let ref_id = MAP.iter().find(|(g, _)| *g == REFERENCE).unwrap().1;
    let mut failures = Vec::new();
    for (gpu, id) in MAP {
        let want = measured[REFERENCE] / measured[*gpu];
        let got = fp32(id) / fp32(ref_id);
        let off = (got / want - 1.0).abs();
        eprintln!(
            "{id:<10} catalog {got:.3}x {ref_id}, measured {want:.3}x ({:+.1}%)",
            100.0 * (got / want - 1.0)
        );
        if off > SPEED_TOLERANCE {
            failures.push(format!(
                "{id}: catalog says {got:.2}x {ref_id} in fp32, the profiles {want:.2}x ({:.0}% off)",
                100.0 * off
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn memory_follows_the_measured_gpus() {
    let gpus = data("gpus.json");
    for (gpu, id) in MAP {
        let bytes = gpus["gpus"][*gpu]["mem_per_gpu_bytes"]
            .as_f64()
            .unwrap_or_else(|| panic!("gpus.json has no memory for {gpu}"));
        let have = device::lookup(id).unwrap().memory_gib;
        let want = bytes / GIB;
        assert!(
            (have / want - 1.0).abs() <= MEMORY_TOLERANCE,
            "{id}: catalog {have} GiB, {gpu} measured with {want:.1} GiB"
        );
    }
}

/// Mixed precision never trains slower than fp32 does, so a GPU's fp16/bf16 figure is at least
/// what the profiles measured it doing in fp32 (within the speed tolerance).
#[test]
fn mixed_precision_is_not_below_the_measured_fp32_speed() {
    let measured = measured_s_per_sample();
    let flops = opt350_train_flops_per_sample();
    for (gpu, id) in MAP {
        let d = device::lookup(id).unwrap();
        let measured_fp32 = flops / measured[*gpu];
        for p in [Precision::Fp16, Precision::Bf16] {
            if let Some(f) = d.effective_flops(p) {
                assert!(
                    f >= measured_fp32 * (1.0 - SPEED_TOLERANCE),
                    "{id} {}: {:.1} TFLOP/s, below the {:.1} TFLOP/s measured in fp32",
                    p.as_str(),
                    f / 1e12,
                    measured_fp32 / 1e12
                );
            }
        }
    }
}

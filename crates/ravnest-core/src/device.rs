//! The device catalog: memory and training throughput of the accelerators people actually own.
//!
//! Every entry carries spec-sheet peaks (dense, no sparsity) and an *effective* fp32 training
//! throughput. Where the Sailor artifact (SOSP'25, eth-easl/sailor, MIT; re-keyed in
//! `shared/data/gpu-profiles/`) measured a GPU, the effective figure is derived from that
//! measurement: OPT-350 (seq 2048) forward+backward seconds per sample at the best micro-batch
//! size, divided into the FLOPs our own GPT cost model charges for that model. Unmeasured GPUs
//! borrow the efficiency (effective ÷ peak) of a measured sibling of the same architecture. See
//! `docs/cost-model.md` for the derivation table.

use crate::model::{Precision, gpt_spec};

/// One bytes-per-GiB constant so nobody writes `1 << 30` by hand.
pub const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Tensor-core efficiency for mixed precision (fp16/bf16): the fraction of the dense tensor-core
/// peak a training step reaches. A documented assumption (no measurement in our data set): large
/// transformer training in mixed precision typically reports 35–50% model FLOPs utilisation.
pub const MIXED_PRECISION_EFFICIENCY: f64 = 0.40;

/// A measurement from the Sailor profiles: OPT-350 fp32 training, best seconds per sample.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SailorMeasurement {
    /// GPU name as the Sailor artifact spells it.
    pub sailor_gpu: &'static str,
    /// Forward+backward seconds for one sample (seq 2048) at the best micro-batch size.
    pub opt350_s_per_sample: f64,
    /// The micro-batch size that row was measured at.
    pub mbs: u32,
}

/// Where an entry's effective throughput comes from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Grounding {
    /// Measured on this GPU.
    Measured(SailorMeasurement),
    /// Efficiency borrowed from a measured sibling (by catalog id).
    Sibling(&'static str),
    /// A stated assumption (used for `cpu`, which `ravnest run` measures for real).
    Assumed(f64),
}

/// One catalog entry.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceSpec {
    /// Catalog id used in `cluster.toml` (`device = "rtx3090"`).
    pub id: &'static str,
    /// Human name.
    pub name: &'static str,
    /// Memory in GiB as sold.
    pub memory_gib: f64,
    /// Dense fp32 peak, TFLOP/s (spec sheet).
    pub fp32_peak_tflops: f64,
    /// Dense fp16 tensor peak with fp32 accumulate, TFLOP/s (spec sheet; GeForce cards run
    /// fp32-accumulate at half the fp16-accumulate rate).
    pub fp16_peak_tflops: Option<f64>,
    /// Dense bf16 tensor peak, TFLOP/s; `None` before Ampere.
    pub bf16_peak_tflops: Option<f64>,
    /// Where the effective throughput comes from.
    pub grounding: Grounding,
}

/// FLOPs of one OPT-350 training sample (forward + backward, seq 2048) under our cost model.
/// Computed from the same GPT preset the planner uses, so the catalog and the model agree.
pub fn opt350_train_flops_per_sample() -> f64 {
    let model = gpt_spec("opt-350", 24, 1024, 16, 2048, 50272, false);
    model.train_flops_per_sample()
}

impl DeviceSpec {
    /// Memory in bytes.
    pub fn memory_bytes(&self) -> u64 {
        (self.memory_gib * GIB) as u64
    }

    /// Effective fp32 efficiency (effective ÷ peak). Can exceed 1 on A100/H100, whose fp32
    /// matmuls run on TF32 tensor cores by default in the frameworks Sailor measured.
    pub fn fp32_efficiency(&self) -> f64 {
        match self.grounding {
            Grounding::Measured(m) => {
                opt350_train_flops_per_sample()
                    / m.opt350_s_per_sample
                    / 1e12
                    / self.fp32_peak_tflops
            }
            Grounding::Sibling(id) => lookup(id)
                .expect("catalog sibling ids are checked by a test")
                .fp32_efficiency(),
            Grounding::Assumed(e) => e,
        }
    }

    /// Effective training throughput in FLOP/s for a precision, or `None` when the device has
    /// no fast path for it (bf16 before Ampere, half precision on `cpu`).
    pub fn effective_flops(&self, precision: Precision) -> Option<f64> {
        let fp32 = self.fp32_peak_tflops * self.fp32_efficiency() * 1e12;
        let tensor = match precision {
            Precision::Fp32 => return Some(fp32),
            // A CPU has no half-precision units: its half-precision step is planned at its
            // fp32 speed (candle computes half precision on a CPU no faster).
            _ if self.id == "cpu" => return Some(fp32),
            Precision::Fp16 => self.fp16_peak_tflops?,
            Precision::Bf16 => self.bf16_peak_tflops?,
        };
        // Mixed precision never makes a step slower than plain fp32 would be.
        Some((tensor * MIXED_PRECISION_EFFICIENCY * 1e12).max(fp32))
    }
}

const fn dev(
    id: &'static str,
    name: &'static str,
    memory_gib: f64,
    fp32: f64,
    fp16: Option<f64>,
    bf16: Option<f64>,
    grounding: Grounding,
) -> DeviceSpec {
    DeviceSpec {
        id,
        name,
        memory_gib,
        fp32_peak_tflops: fp32,
        fp16_peak_tflops: fp16,
        bf16_peak_tflops: bf16,
        grounding,
    }
}

const fn sailor(gpu: &'static str, s: f64, mbs: u32) -> Grounding {
    Grounding::Measured(SailorMeasurement {
        sailor_gpu: gpu,
        opt350_s_per_sample: s,
        mbs,
    })
}

use Grounding::{Assumed, Sibling};

/// The catalog, sorted by id. Peaks: NVIDIA spec sheets and architecture whitepapers (dense).
/// Measured rows: `profiles_summary.json`, model OPT-350, tp 1, min over mbs of
/// `total_fwd_bwd_s / mbs`.
pub static CATALOG: &[DeviceSpec] = &[
    dev(
        "a100-40",
        "NVIDIA A100 40GB",
        40.0,
        19.5,
        Some(312.0),
        Some(312.0),
        sailor("A100-40", 0.191_382, 8),
    ),
    dev(
        "a100-80",
        "NVIDIA A100 80GB",
        80.0,
        19.5,
        Some(312.0),
        Some(312.0),
        sailor("A100-80", 0.167_382, 8),
    ),
    // `cpu` is a placeholder for planning: `ravnest run` measures a real CPU's matmul rate.
    dev(
        "cpu",
        "CPU (generic, 8 cores AVX2)",
        16.0,
        1.0,
        None,
        None,
        Assumed(0.3),
    ),
    // `cuda` (also `cuda:N`) is a placeholder for planning, like `cpu`: a GPU that `ravnest run`
    // measures (matmul rate and free memory on the device). Figures of a mid-range 24 GB card.
    dev(
        "cuda",
        "CUDA GPU (generic; `ravnest run` measures it)",
        24.0,
        35.6,
        Some(71.0),
        Some(71.0),
        Assumed(0.35),
    ),
    dev(
        "gh200",
        "NVIDIA GH200 (H100 96GB)",
        96.0,
        66.9,
        Some(989.4),
        Some(989.4),
        sailor("GH-96", 0.087_316_5, 4),
    ),
    dev(
        "h100",
        "NVIDIA H100 SXM 80GB",
        80.0,
        66.9,
        Some(989.4),
        Some(989.4),
        Sibling("gh200"),
    ),
    dev(
        "l4",
        "NVIDIA L4",
        24.0,
        30.3,
        Some(121.0),
        Some(121.0),
        Sibling("rtx3090"),
    ),
    // Turing GeForce fp16 tensor peaks with fp32 accumulate: NVIDIA Turing architecture
    // whitepaper, appendix A (reference clocks): 2080 40.3 TFLOP/s, 2080 Ti 53.8, i.e. half
    // their fp16-accumulate 80.5 / 107.6. (These entries said 20.1 and 26.9, the CUDA-core fp16
    // rate, half the tensor figure.)
    dev(
        "rtx2080",
        "GeForce RTX 2080",
        8.0,
        10.07,
        Some(40.3),
        None,
        Sibling("rtx2080ti"),
    ),
    // Sailor calls this GPU "RTX-2080" but gives it 11 GiB of memory, which is the 2080 Ti's.
    dev(
        "rtx2080ti",
        "GeForce RTX 2080 Ti",
        11.0,
        13.45,
        Some(53.8),
        None,
        sailor("RTX-2080", 0.762_133, 2),
    ),
    dev(
        "rtx3060",
        "GeForce RTX 3060 12GB",
        12.0,
        12.74,
        Some(25.5),
        Some(25.5),
        Sibling("rtx3090"),
    ),
    dev(
        "rtx3070",
        "GeForce RTX 3070",
        8.0,
        20.31,
        Some(40.6),
        Some(40.6),
        Sibling("rtx3090"),
    ),
    dev(
        "rtx3080",
        "GeForce RTX 3080 10GB",
        10.0,
        29.77,
        Some(59.5),
        Some(59.5),
        Sibling("rtx3090"),
    ),
    dev(
        "rtx3090",
        "GeForce RTX 3090",
        24.0,
        35.58,
        Some(71.0),
        Some(71.0),
        sailor("RTX-3090", 0.410_754_5, 4),
    ),
    dev(
        "rtx4060ti",
        "GeForce RTX 4060 Ti 16GB",
        16.0,
        22.06,
        Some(44.1),
        Some(44.1),
        Sibling("rtx3090"),
    ),
    dev(
        "rtx4070",
        "GeForce RTX 4070",
        12.0,
        29.15,
        Some(58.3),
        Some(58.3),
        Sibling("rtx3090"),
    ),
    dev(
        "rtx4080",
        "GeForce RTX 4080",
        16.0,
        48.74,
        Some(97.5),
        Some(97.5),
        Sibling("rtx3090"),
    ),
    dev(
        "rtx4090",
        "GeForce RTX 4090",
        24.0,
        82.58,
        Some(165.2),
        Some(165.2),
        Sibling("rtx3090"),
    ),
    dev(
        "t4",
        "NVIDIA T4",
        16.0,
        8.14,
        Some(65.1),
        None,
        Sibling("titan-rtx"),
    ),
    dev(
        "titan-rtx",
        "NVIDIA Titan RTX",
        24.0,
        16.3,
        Some(130.5),
        None,
        sailor("Titan-RTX", 0.717_04, 2),
    ),
    dev(
        "v100-16",
        "NVIDIA V100 16GB",
        16.0,
        15.7,
        Some(125.0),
        None,
        sailor("V100-16", 0.625, 2),
    ),
    dev(
        "v100-32",
        "NVIDIA V100 32GB",
        32.0,
        15.7,
        Some(125.0),
        None,
        Sibling("v100-16"),
    ),
];

/// Look a device up by catalog id. Case-insensitive, and `-`/`_`/spaces are ignored, so
/// `RTX 3090`, `rtx_3090` and `rtx3090` all name the same card.
pub fn lookup(name: &str) -> Option<&'static DeviceSpec> {
    // `MODEL:N` (`cuda:1`, `rtx3090:1`) names GPU N of the machine for `ravnest run`; the
    // catalog entry is the model's.
    let key = normalize(split_ordinal(name).0);
    CATALOG.iter().find(|d| normalize(d.id) == key).or_else(|| {
        // Aliases people type: vendor prefixes.
        let stripped = key
            .strip_prefix("nvidia")
            .or_else(|| key.strip_prefix("geforce"))?;
        CATALOG.iter().find(|d| normalize(d.id) == stripped)
    })
}

/// A device name and the GPU ordinal it names (`rtx3090:1` → (`rtx3090`, Some(1))).
pub fn split_ordinal(name: &str) -> (&str, Option<u32>) {
    match name.trim().rsplit_once(':') {
        Some((model, n)) if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => {
            (model, n.parse().ok())
        }
        _ => (name.trim(), None),
    }
}

/// A hint for a device name the catalog lacks, by family and model number rather than by
/// spelling (`RTX 3060 Ti` is not an `rtx4060ti`): the catalog's entry of the same family and
/// number (another variant of the card), else of the same family (its nearest number), with
/// the generic `cuda` entry and its own figures as the way to name any card. `None` for a name
/// without a model number (a misspelling is the caller's to suggest by spelling).
pub fn hint(name: &str) -> Option<String> {
    let key = normalize(split_ordinal(name).0);
    let key = key
        .strip_prefix("nvidia")
        .or_else(|| key.strip_prefix("geforce"))
        .unwrap_or(&key)
        .to_string();
    let parts = |k: &str| -> (String, Option<u32>) {
        let family: String = k.chars().take_while(|c| c.is_ascii_alphabetic()).collect();
        let digits: String = k[family.len()..]
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        (family, digits.parse().ok())
    };
    let (family, number) = parts(&key);
    let same_family: Vec<(&DeviceSpec, Option<u32>)> = CATALOG
        .iter()
        .map(|d| (d, parts(&normalize(d.id)).1))
        .filter(|(d, _)| !family.is_empty() && parts(&normalize(d.id)).0 == family)
        .collect();
    let generic = "or any card: device = \"cuda\" (GPU 0; \"cuda:1\" the second) with its memory_gib and tflops (effective training TFLOP/s)";
    let sorted_digits = |n: u32| {
        let mut d: Vec<char> = n.to_string().chars().collect();
        d.sort_unstable();
        d
    };
    // The same digits in another order: a typo of that card (`rtx3600`).
    if let Some(n) = number
        && let Some((d, _)) = same_family
            .iter()
            .find(|(_, m)| m.is_some_and(|m| m != n && sorted_digits(m) == sorted_digits(n)))
    {
        return Some(format!("did you mean `{}`? ({generic})", d.id));
    }
    let near = match number {
        Some(n) => same_family
            .iter()
            .filter(|(_, m)| m.is_some())
            .min_by_key(|(_, m)| m.unwrap_or(0).abs_diff(n))
            .map(|(d, m)| (*d, *m == Some(n))),
        // No model number: a misspelt name (`titan-rtc`), the caller's to spell-check.
        None => return None,
    };
    Some(match near {
        Some((d, true)) => format!(
            "`{}` ({}, {} GiB) is the catalog's card of that model number; {generic}",
            d.id, d.name, d.memory_gib
        ),
        Some((d, false)) => format!(
            "not in the catalog (`ravnest catalog` lists it); its family's nearest is `{}` ({}, {} GiB): a different card; {generic}",
            d.id, d.name, d.memory_gib
        ),
        None => format!("not in the catalog (`ravnest catalog` lists it); {generic}"),
    })
}

fn normalize(s: &str) -> String {
    s.chars()
        .filter(|c| !matches!(c, '-' | '_' | ' '))
        .flat_map(char::to_lowercase)
        .collect()
}

/// All catalog ids, for error messages.
pub fn ids() -> impl Iterator<Item = &'static str> + Clone {
    CATALOG.iter().map(|d| d.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_go_by_family_and_model_number_and_ordinals_name_a_card() {
        let full = hint;
        let hint = |n: &str| full(n).unwrap_or_default();
        assert!(hint("rtx3600").contains("did you mean `rtx3060`?"));
        assert_eq!(full("titan-rtc"), None);
        assert!(
            hint("RTX 3060 Ti").contains("`rtx3060`"),
            "{}",
            hint("RTX 3060 Ti")
        );
        let h = hint("rtx5090");
        assert!(
            h.contains("`rtx4090`") && h.contains("a different card"),
            "{h}"
        );
        let h = hint("h200");
        assert!(h.contains("`h100`") && !h.contains("gh200"), "{h}");
        assert!(hint("quadro9000").contains("device = \"cuda\""));
        assert_eq!(lookup("rtx3090:1").map(|d| d.id), Some("rtx3090"));
        assert_eq!(lookup("cuda:2").map(|d| d.id), Some("cuda"));
        assert_eq!(split_ordinal("rtx3090:1"), ("rtx3090", Some(1)));
        assert_eq!(split_ordinal("cpu"), ("cpu", None));
    }

    #[test]
    fn catalog_is_sorted_and_siblings_resolve() {
        let ids: Vec<_> = ids().collect();
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        assert_eq!(ids, sorted, "keep CATALOG sorted by id");
        for d in CATALOG {
            if let Grounding::Sibling(s) = d.grounding {
                let sib = lookup(s).unwrap_or_else(|| panic!("{}: unknown sibling {s}", d.id));
                assert!(
                    matches!(sib.grounding, Grounding::Measured(_)),
                    "{}: sibling must be measured",
                    d.id
                );
            }
            let e = d.fp32_efficiency();
            assert!(e > 0.1 && e < 2.0, "{}: implausible efficiency {e}", d.id);
        }
    }

    #[test]
    fn measured_relative_speeds_follow_sailor() {
        // Sailor: A100-40 is 0.4108/0.1914 = 2.15x an RTX 3090 on OPT-350; our catalog must keep it.
        let f = |id| {
            lookup(id)
                .unwrap()
                .effective_flops(Precision::Fp32)
                .unwrap()
        };
        let ratio = f("a100-40") / f("rtx3090");
        assert!((ratio - 0.410_754_5 / 0.191_382).abs() < 1e-9, "{ratio}");
        // Spec-sheet ordering inside one architecture is kept.
        assert!(f("rtx4090") > f("rtx4080") && f("rtx4080") > f("rtx4070"));
        assert!(f("rtx3090") > f("rtx3080") && f("rtx3080") > f("rtx3060"));
    }

    #[test]
    fn turing_geforce_tensor_peaks_are_the_whitepapers() {
        // Turing whitepaper, appendix A: fp16 tensor with fp32 accumulate is 4x the fp32 peak
        // on GeForce (8x on Titan RTX, which does not halve it).
        for id in ["rtx2080", "rtx2080ti"] {
            let d = lookup(id).unwrap();
            let ratio = d.fp16_peak_tflops.unwrap() / d.fp32_peak_tflops;
            assert!((ratio - 4.0).abs() < 0.05, "{id}: {ratio}");
        }
        let t = lookup("titan-rtx").unwrap();
        assert!((t.fp16_peak_tflops.unwrap() / t.fp32_peak_tflops - 8.0).abs() < 0.05);
    }

    #[test]
    fn lookup_is_forgiving_about_spelling() {
        assert_eq!(lookup("RTX 3090").unwrap().id, "rtx3090");
        assert_eq!(lookup("nvidia-a100_80").unwrap().id, "a100-80");
        assert_eq!(lookup("GeForce RTX4090").unwrap().id, "rtx4090");
        assert!(lookup("rtx9090").is_none());
    }

    #[test]
    fn half_precision_support_follows_architecture() {
        assert!(
            lookup("v100-16")
                .unwrap()
                .effective_flops(Precision::Bf16)
                .is_none()
        );
        // A CPU has no half-precision units: planned at its fp32 speed.
        let cpu = lookup("cpu").unwrap();
        assert_eq!(
            cpu.effective_flops(Precision::Fp16),
            cpu.effective_flops(Precision::Fp32)
        );
        let a = lookup("a100-80").unwrap();
        assert!(
            a.effective_flops(Precision::Bf16).unwrap()
                > a.effective_flops(Precision::Fp32).unwrap()
        );
    }
}

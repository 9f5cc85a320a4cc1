//! Model descriptions: a model is an ordered list of layers, each with a parameter count,
//! forward FLOPs per sample and activation bytes per sample. That is all the planner needs.
//!
//! Presets cover what `ravnest run` trains (an MLP on the digits data, a small character-level
//! transformer) and GPT-style models built from (layers, hidden, heads, sequence, vocabulary),
//! so a user can plan a 7B model on a room of 3090s.

use serde::{Deserialize, Serialize};

/// Numeric precision of training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, PartialOrd, Ord, Hash)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Plain fp32 everywhere.
    Fp32,
    /// Mixed precision: fp16 weights/activations, fp32 master weights.
    Fp16,
    /// Mixed precision with bf16.
    Bf16,
}

impl Precision {
    /// Bytes of one activation / gradient element on the wire and in memory.
    pub fn element_bytes(self) -> u64 {
        match self {
            Precision::Fp32 => 4,
            Precision::Fp16 | Precision::Bf16 => 2,
        }
    }

    /// Name as written in config files.
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Fp16 => "fp16",
            Precision::Bf16 => "bf16",
        }
    }
}

/// Optimizer, which decides how many bytes of state each parameter carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, PartialOrd, Ord, Hash)]
#[serde(rename_all = "kebab-case")]
pub enum Optimizer {
    /// Plain SGD: no state.
    Sgd,
    /// SGD with momentum: one fp32 buffer.
    SgdMomentum,
    /// AdamW: two fp32 moments.
    Adamw,
}

impl Optimizer {
    /// Name as written in config files.
    pub fn as_str(self) -> &'static str {
        match self {
            Optimizer::Sgd => "sgd",
            Optimizer::SgdMomentum => "sgd-momentum",
            Optimizer::Adamw => "adamw",
        }
    }

    /// Bytes of its state per parameter (f32 values).
    pub fn state_bytes_per_param(self) -> u64 {
        match self {
            Optimizer::Sgd => 0,
            Optimizer::SgdMomentum => 4,
            Optimizer::Adamw => 8,
        }
    }
}

/// Bytes of persistent training state per parameter: weights + gradients + optimizer state
/// (+ fp32 master weights under mixed precision), as in the ZeRO paper's accounting.
pub fn state_bytes_per_param(precision: Precision, optimizer: Optimizer) -> u64 {
    let e = precision.element_bytes();
    let master = if precision == Precision::Fp32 { 0 } else { 4 };
    e + e + master + optimizer.state_bytes_per_param()
}

/// One layer as the planner sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LayerSpec {
    /// Name for reports.
    pub name: String,
    /// Number of parameters.
    pub params: u64,
    /// Forward FLOPs for one sample (backward is charged as 2x forward).
    pub fwd_flops_per_sample: f64,
    /// Activation *elements* retained for backward, per sample (multiplied by the precision's
    /// element size to get bytes).
    pub activation_elems_per_sample: u64,
    /// Elements of the layer's output per sample: what a pipeline stage sends to the next one.
    pub output_elems_per_sample: u64,
}

/// A model: an ordered list of layers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Name for reports.
    pub name: String,
    /// Layers in forward order.
    pub layers: Vec<LayerSpec>,
}

impl ModelSpec {
    /// Total parameter count.
    pub fn params(&self) -> u64 {
        self.layers.iter().map(|l| l.params).sum()
    }

    /// Forward + backward FLOPs per sample (backward = 2x forward, no recomputation).
    pub fn train_flops_per_sample(&self) -> f64 {
        3.0 * self
            .layers
            .iter()
            .map(|l| l.fwd_flops_per_sample)
            .sum::<f64>()
    }
}

/// A GPT-style decoder: embedding, `layers` transformer blocks, final norm + LM head.
///
/// FLOPs per block and sample: 24·s·h² + 4·s²·h (Narayanan et al. 2021, Megatron-LM, eq. 3
/// without the batch); LM head 2·s·h·V. Activations per block and sample in elements:
/// s·h·(17 + 2.5·a·s/h), i.e. Korthikanti et al. 2022 eq. 1 (34 + 5as/h bytes at 16 bits),
/// and s·h·17 with flash attention (the a·s² score matrices are not kept).
pub fn gpt_spec(
    name: &str,
    layers: u32,
    hidden: u64,
    heads: u64,
    seq_len: u64,
    vocab: u64,
    flash_attention: bool,
) -> ModelSpec {
    let (h, s, v, a) = (hidden as f64, seq_len as f64, vocab as f64, heads as f64);
    let mut out = Vec::with_capacity(layers as usize + 2);
    out.push(LayerSpec {
        name: "embed".into(),
        params: vocab * hidden + seq_len * hidden,
        fwd_flops_per_sample: 0.0,
        activation_elems_per_sample: seq_len * hidden,
        output_elems_per_sample: seq_len * hidden,
    });
    let attn_scores = if flash_attention {
        0.0
    } else {
        2.5 * a * s / h
    };
    for i in 0..layers {
        out.push(LayerSpec {
            name: format!("block{i}"),
            params: 12 * hidden * hidden + 13 * hidden,
            fwd_flops_per_sample: 24.0 * s * h * h + 4.0 * s * s * h,
            activation_elems_per_sample: (s * h * (17.0 + attn_scores)) as u64,
            output_elems_per_sample: seq_len * hidden,
        });
    }
    out.push(LayerSpec {
        name: "head".into(),
        params: vocab * hidden + 2 * hidden,
        fwd_flops_per_sample: 2.0 * s * h * v,
        // logits and their softmax are kept for the loss's backward.
        activation_elems_per_sample: 2 * seq_len * vocab + seq_len * hidden,
        output_elems_per_sample: 1,
    });
    ModelSpec {
        name: name.to_string(),
        layers: out,
    }
}

/// Whether `spec` is a transformer as [`gpt_spec`] lays it out (`embed`, blocks, `head`), with
/// or without flash attention: a model whose layers run as pipeline stages.
pub fn is_transformer(spec: &ModelSpec) -> bool {
    let names: Vec<&str> = spec.layers.iter().map(|l| l.name.as_str()).collect();
    matches!(names.as_slice(), ["embed", blocks @ .., "head"]
        if !blocks.is_empty() && blocks.iter().all(|b| b.starts_with("block")))
}

/// The sizes of a GPT as [`gpt_spec`] describes it, read back from its layers: (layers,
/// hidden, heads, seq_len, vocab). `None` for another model, or a GPT described with flash
/// attention (its head count leaves no trace in the layers).
pub fn gpt_shape(spec: &ModelSpec) -> Option<(u32, u64, u64, u64, u64)> {
    let (embed, rest) = spec.layers.split_first()?;
    let (head, blocks) = rest.split_last()?;
    if embed.name != "embed" || head.name != "head" || blocks.is_empty() {
        return None;
    }
    let b = &blocks[0];
    // params = 12h² + 13h.
    let h = ((-13.0 + (169.0 + 48.0 * b.params as f64).sqrt()) / 24.0).round() as u64;
    if h == 0 || 12 * h * h + 13 * h != b.params || !embed.output_elems_per_sample.is_multiple_of(h)
    {
        return None;
    }
    let seq = embed.output_elems_per_sample / h;
    let vocab = embed.params.checked_sub(seq * h)? / h;
    // activations = s·h·17 + 2.5·a·s² (truncated to an integer).
    let extra = b.activation_elems_per_sample as f64 - (17 * seq * h) as f64;
    let heads = (extra / (2.5 * (seq * seq) as f64)).round() as u64;
    let again = gpt_spec(
        &spec.name,
        blocks.len() as u32,
        h,
        heads.max(1),
        seq,
        vocab,
        false,
    );
    (heads > 0 && h.is_multiple_of(heads) && again.layers == spec.layers).then_some((
        blocks.len() as u32,
        h,
        heads,
        seq,
        vocab,
    ))
}

/// A multilayer perceptron with ReLU between layers: `dims = [in, hidden.., out]`.
pub fn mlp_spec(name: &str, dims: &[u64]) -> ModelSpec {
    let layers = dims
        .windows(2)
        .enumerate()
        .map(|(i, w)| LayerSpec {
            name: format!("fc{i}"),
            params: w[0] * w[1] + w[1],
            fwd_flops_per_sample: 2.0 * (w[0] * w[1]) as f64,
            // input kept for the weight gradient, output kept for the ReLU mask.
            activation_elems_per_sample: w[0] + w[1],
            output_elems_per_sample: w[1],
        })
        .collect();
    ModelSpec {
        name: name.to_string(),
        layers,
    }
}

/// A named preset's description, for `--help` texts and error messages.
#[derive(Debug, Clone, Copy)]
pub struct Preset {
    /// Name used in `[model] preset = "..."`.
    pub name: &'static str,
    /// One line for users.
    pub about: &'static str,
    build: fn() -> ModelSpec,
}

impl Preset {
    /// Build the model.
    pub fn build(&self) -> ModelSpec {
        (self.build)()
    }
}

/// All named presets, sorted by name.
pub static PRESETS: &[Preset] = &[
    Preset {
        name: "char-transformer",
        about: "character-level GPT (4 layers, hidden 128, 4 heads, seq 128, vocab 96) that `run` trains",
        build: || gpt_spec("char-transformer", 4, 128, 4, 128, 96, false),
    },
    Preset {
        name: "gpt-1.3b",
        about: "GPT-3 XL shape (24 layers, hidden 2048, 16 heads, seq 2048, vocab 50257)",
        build: || gpt_spec("gpt-1.3b", 24, 2048, 16, 2048, 50257, true),
    },
    Preset {
        name: "gpt-7b",
        about: "LLaMA-7B shape (32 layers, hidden 4096, 32 heads, seq 2048, vocab 32000), flash attention",
        build: || gpt_spec("gpt-7b", 32, 4096, 32, 2048, 32000, true),
    },
    Preset {
        name: "gpt-small",
        about: "byte-level GPT (6 layers, hidden 384, 6 heads, seq 128, vocab 256; 10.9M parameters) that `run` trains",
        build: || gpt_spec("gpt-small", 6, 384, 6, 128, 256, false),
    },
    Preset {
        name: "gpt-tiny",
        about: "byte-level GPT (4 layers, hidden 128, 4 heads, seq 64, vocab 256; 0.87M parameters) that `run` trains (CI)",
        build: || gpt_spec("gpt-tiny", 4, 128, 4, 64, 256, false),
    },
    Preset {
        name: "gpt2-medium",
        about: "GPT-2 medium (24 layers, hidden 1024, 16 heads, seq 1024, vocab 50257)",
        build: || gpt_spec("gpt2-medium", 24, 1024, 16, 1024, 50257, false),
    },
    Preset {
        name: "gpt2-small",
        about: "GPT-2 small (12 layers, hidden 768, 12 heads, seq 1024, vocab 50257)",
        build: || gpt_spec("gpt2-small", 12, 768, 12, 1024, 50257, false),
    },
    Preset {
        name: "mlp-digits",
        about: "MLP 64-128-64-10 on the 8x8 digits data that `run` trains by default",
        build: || mlp_spec("mlp-digits", &[64, 128, 64, 10]),
    },
    Preset {
        name: "opt-350m",
        about: "OPT-350M (24 layers, hidden 1024, 16 heads, seq 2048, vocab 50272), the Sailor profiles' model",
        build: || gpt_spec("opt-350m", 24, 1024, 16, 2048, 50272, false),
    },
];

/// Look up a preset by name.
pub fn preset(name: &str) -> Option<&'static Preset> {
    PRESETS.iter().find(|p| p.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_sorted_and_sizes_match_published_counts() {
        let names: Vec<_> = PRESETS.iter().map(|p| p.name).collect();
        let mut sorted = names.clone();
        sorted.sort_unstable();
        assert_eq!(names, sorted);
        // GPT-2 small is published as 124M parameters (tied embeddings); we count the LM head
        // separately, so 124M + 38.6M.
        let p = preset("gpt2-small").unwrap().build().params() as f64 / 1e6;
        assert!((p - 163.0).abs() < 2.0, "{p}");
        // LLaMA-7B: 6.7B with SwiGLU; our 12h² block gives the same order.
        let p = preset("gpt-7b").unwrap().build().params() as f64 / 1e9;
        assert!((6.0..7.5).contains(&p), "{p}");
        // Sailor's OPT-350 per-block parameter count is 12,596,224 = 12h² + 13h at h = 1024.
        let opt = preset("opt-350m").unwrap().build();
        assert_eq!(opt.layers[1].params, 12_596_224);
    }

    #[test]
    fn gpt_sizes_are_read_back_from_the_layers() {
        for (l, h, a, s, v) in [
            (4u32, 128u64, 4u64, 64u64, 256u64),
            (12, 768, 12, 1024, 50257),
            (2, 16, 2, 6, 20),
            (6, 384, 6, 128, 256),
        ] {
            assert_eq!(
                gpt_shape(&gpt_spec("g", l, h, a, s, v, false)),
                Some((l, h, a, s, v))
            );
        }
        assert_eq!(gpt_shape(&gpt_spec("g", 2, 64, 4, 32, 256, true)), None);
        assert_eq!(gpt_shape(&mlp_spec("m", &[4, 8, 2])), None);
        for p in PRESETS {
            let m = p.build();
            if let Some((l, h, a, s, v)) = gpt_shape(&m) {
                assert_eq!(gpt_spec(&m.name, l, h, a, s, v, false), m, "{}", p.name);
            }
        }
    }

    #[test]
    fn mlp_digits_counts() {
        let m = preset("mlp-digits").unwrap().build();
        assert_eq!(m.params(), 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10);
        assert_eq!(m.layers.len(), 3);
    }

    #[test]
    fn state_bytes_follow_zero_accounting() {
        assert_eq!(state_bytes_per_param(Precision::Fp16, Optimizer::Adamw), 16);
        assert_eq!(state_bytes_per_param(Precision::Fp32, Optimizer::Adamw), 16);
        assert_eq!(state_bytes_per_param(Precision::Fp32, Optimizer::Sgd), 8);
    }
}

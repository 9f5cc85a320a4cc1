//! The decoder-only transformers people train, described once: GPT-2 (LayerNorm, learned
//! positions, GELU) and the Llama family (RMSNorm, rotary positions, SwiGLU, grouped-query
//! attention; Llama 2 / 3.x, Qwen2 with its q/k/v biases, Mistral). One [`Decoder`] drives the
//! planner's figures ([`Decoder::spec`]), the training code's tensors and passes, and the
//! checkpoint's Hugging Face names and `config.json`.
//!
//! Pure: a `config.json` comes in as parsed JSON ([`Decoder::from_hf_config`]), never as a
//! path. The rotary frequencies ([`Decoder::inv_freq`]) follow transformers'
//! `modeling_rope_utils.py` (default, `linear` and `llama3`).

use serde::Serialize;
use serde_json::Value;

use crate::model::{LayerSpec, ModelSpec};

/// The Hugging Face class a model is (what `architectures` names, and what ravnest writes
/// back).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum HfClass {
    /// `GPT2LMHeadModel`.
    Gpt2,
    /// `LlamaForCausalLM`.
    Llama,
    /// `Qwen2ForCausalLM`.
    Qwen2,
    /// `MistralForCausalLM`.
    Mistral,
}

/// Every class ravnest trains, with its `architectures` entry and `model_type`.
pub const CLASSES: &[(HfClass, &str, &str)] = &[
    (HfClass::Gpt2, "GPT2LMHeadModel", "gpt2"),
    (HfClass::Llama, "LlamaForCausalLM", "llama"),
    (HfClass::Qwen2, "Qwen2ForCausalLM", "qwen2"),
    (HfClass::Mistral, "MistralForCausalLM", "mistral"),
];

impl HfClass {
    /// The `architectures` entry (`LlamaForCausalLM`).
    pub fn architecture(self) -> &'static str {
        CLASSES.iter().find(|c| c.0 == self).map_or("?", |c| c.1)
    }

    /// The `model_type` (`llama`).
    pub fn model_type(self) -> &'static str {
        CLASSES.iter().find(|c| c.0 == self).map_or("?", |c| c.2)
    }

    /// Whether its blocks are Llama's (RMSNorm, rotary positions, SwiGLU), not GPT-2's.
    pub fn is_llama(self) -> bool {
        self != HfClass::Gpt2
    }
}

/// How rotary positions scale their frequencies (`rope_scaling`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Rope {
    /// None: `1 / θ^(2i/d)`.
    Default,
    /// Positions divided by `factor`.
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3.1's: long wavelengths divided by `factor`, short ones kept, a smooth blend
    /// between.
    Llama3 {
        /// The divisor of long wavelengths.
        factor: f64,
        /// Below this many wavelengths per original context: divided.
        low_freq_factor: f64,
        /// Above this many: kept.
        high_freq_factor: f64,
        /// The context the model was trained at first.
        original_max_position_embeddings: f64,
    },
}

/// What a family's block looks like beyond its sizes.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Arch {
    /// The Hugging Face class.
    pub class: HfClass,
    /// Key/value heads (grouped-query attention: a divisor of the heads).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// The MLP's inner width.
    pub intermediate: usize,
    /// Positions the model has (GPT-2's position table; Llama's `max_position_embeddings`).
    pub positions: usize,
    /// Biases on the q, k and v projections (Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the attention's output projection (Llama's `attention_bias`).
    pub out_bias: bool,
    /// Biases on the MLP's projections (Llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// The norms' epsilon.
    pub norm_eps: f64,
    /// Rotary θ.
    pub rope_theta: f64,
    /// Rotary scaling.
    pub rope: Rope,
    /// Whether the folder ties the LM head to the token embedding. ravnest trains the two
    /// apart (a pipeline holds them on different stages) from the same start, and writes
    /// both back.
    pub tied: bool,
}

/// A decoder-only transformer: its sizes and its family's block.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Decoder {
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden width.
    pub hidden: usize,
    /// Attention (query) heads.
    pub heads: usize,
    /// Tokens per training sample.
    pub seq: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// The block.
    pub arch: Arch,
}

/// The longest sequence a model from a folder trains on unless `[model] seq_len` says.
pub const DEFAULT_MAX_SEQ: usize = 1024;

fn size(c: &Value, k: &str, need: &str) -> Result<usize, String> {
    match c.get(k) {
        Some(v) => v
            .as_u64()
            .map(|n| n as usize)
            .ok_or_else(|| format!("`{k}` is {v}, not a whole number")),
        None => Err(format!("has no `{k}` (a {need} config has it)")),
    }
}

fn opt_size(c: &Value, k: &str) -> Result<Option<usize>, String> {
    match c.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| format!("`{k}` is {v}, not a whole number")),
    }
}

fn num(c: &Value, k: &str, default: f64) -> Result<f64, String> {
    match c.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_f64()
            .ok_or_else(|| format!("`{k}` is {v}, not a number")),
    }
}

fn flag(c: &Value, k: &str, default: bool) -> Result<bool, String> {
    match c.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v
            .as_bool()
            .ok_or_else(|| format!("`{k}` is {v}, not true or false")),
    }
}

/// The class a config names: its `architectures` entry, else its `model_type`.
fn class_of(c: &Value) -> Result<HfClass, String> {
    let known = || CLASSES.iter().map(|c| c.1).collect::<Vec<_>>().join(", ");
    if let Some(list) = c.get("architectures").and_then(Value::as_array) {
        let names: Vec<&str> = list.iter().filter_map(Value::as_str).collect();
        return names
            .iter()
            .find_map(|n| CLASSES.iter().find(|c| c.1 == *n).map(|c| c.0))
            .ok_or_else(|| {
                format!(
                    "`architectures` is {names:?}: ravnest trains {} (a causal language model of one of these families)",
                    known()
                )
            });
    }
    match c.get("model_type").and_then(Value::as_str) {
        Some(t) => CLASSES
            .iter()
            .find(|c| c.2 == t)
            .map(|c| c.0)
            .ok_or_else(|| format!("model_type `{t}` is not one ravnest trains ({})", known())),
        None => Err(format!(
            "names neither `architectures` nor `model_type` (ravnest trains {})",
            known()
        )),
    }
}

/// Rotary settings: transformers 4.x writes `rope_theta` and `rope_scaling`, 5.x one
/// `rope_parameters` table with both.
fn rope_of(c: &Value) -> Result<(f64, Rope), String> {
    let params = c.get("rope_parameters").filter(|v| v.is_object());
    let theta = match params.and_then(|p| p.get("rope_theta")) {
        Some(_) => num(params.unwrap_or(c), "rope_theta", 10_000.0)?,
        None => num(c, "rope_theta", 10_000.0)?,
    };
    let scaling = match c.get("rope_scaling").filter(|v| v.is_object()) {
        Some(s) => Some(s),
        None => params,
    };
    let Some(s) = scaling else {
        return Ok((theta, Rope::Default));
    };
    let kind = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let factor = || num(s, "factor", 1.0);
    let rope = match kind {
        "default" => Rope::Default,
        "linear" => Rope::Linear { factor: factor()? },
        "llama3" => Rope::Llama3 {
            factor: factor()?,
            low_freq_factor: num(s, "low_freq_factor", 1.0)?,
            high_freq_factor: num(s, "high_freq_factor", 4.0)?,
            original_max_position_embeddings: num(s, "original_max_position_embeddings", 8192.0)?,
        },
        other => {
            return Err(format!(
                "rope scaling `{other}`: ravnest computes the default, `linear` and `llama3` rotary embeddings"
            ));
        }
    };
    Ok((theta, rope))
}

impl Decoder {
    /// ravnest's own byte-level GPT-2 shape: positions as many as `seq`, MLP 4 · hidden,
    /// LayerNorm ε 1e-5, an LM head of its own.
    pub const fn gpt2(
        layers: usize,
        hidden: usize,
        heads: usize,
        seq: usize,
        vocab: usize,
    ) -> Decoder {
        Decoder {
            layers,
            hidden,
            heads,
            seq,
            vocab,
            arch: Arch {
                class: HfClass::Gpt2,
                kv_heads: heads,
                head_dim: hidden / if heads == 0 { 1 } else { heads },
                intermediate: 4 * hidden,
                positions: seq,
                qkv_bias: true,
                out_bias: true,
                mlp_bias: true,
                norm_eps: 1e-5,
                rope_theta: 0.0,
                rope: Rope::Default,
                tied: false,
            },
        }
    }

    /// A Llama model of these sizes (ε 1e-5, θ 10000, untied, no biases): the tests' and the
    /// benches' shapes; models from folders come through [`Decoder::from_hf_config`].
    pub const fn llama(
        layers: usize,
        hidden: usize,
        heads: usize,
        kv_heads: usize,
        intermediate: usize,
        seq: usize,
        vocab: usize,
    ) -> Decoder {
        Decoder {
            layers,
            hidden,
            heads,
            seq,
            vocab,
            arch: Arch {
                class: HfClass::Llama,
                kv_heads,
                head_dim: hidden / if heads == 0 { 1 } else { heads },
                intermediate,
                positions: seq,
                qkv_bias: false,
                out_bias: false,
                mlp_bias: false,
                norm_eps: 1e-5,
                rope_theta: 10_000.0,
                rope: Rope::Default,
                tied: false,
            },
        }
    }

    /// Whether its blocks are Llama's.
    pub fn is_llama(&self) -> bool {
        self.arch.class.is_llama()
    }

    /// The model a Hugging Face `config.json` describes, training on `seq` tokens per sample
    /// (`None`: its context, at most [`DEFAULT_MAX_SEQ`]). Says what does not fit.
    pub fn from_hf_config(c: &Value, seq: Option<usize>) -> Result<Decoder, String> {
        if !c.is_object() {
            return Err("is not a JSON object".into());
        }
        let class = class_of(c)?;
        let d = if class == HfClass::Gpt2 {
            Self::gpt2_config(c, seq)?
        } else {
            Self::llama_config(c, class, seq)?
        };
        d.check()?;
        Ok(d)
    }

    fn gpt2_config(c: &Value, seq: Option<usize>) -> Result<Decoder, String> {
        let need = "GPT-2";
        let hidden = size(c, "n_embd", need)?;
        let heads = size(c, "n_head", need)?;
        let positions = size(c, "n_positions", need)?;
        let mut d = Decoder::gpt2(
            size(c, "n_layer", need)?,
            hidden,
            heads,
            seq.unwrap_or(positions.min(DEFAULT_MAX_SEQ)),
            size(c, "vocab_size", need)?,
        );
        d.arch.positions = positions;
        d.arch.intermediate = opt_size(c, "n_inner")?.unwrap_or(4 * hidden);
        d.arch.norm_eps = num(c, "layer_norm_epsilon", 1e-5)?;
        d.arch.tied = flag(c, "tie_word_embeddings", true)?;
        let act = c
            .get("activation_function")
            .and_then(Value::as_str)
            .unwrap_or("gelu_new");
        if !matches!(act, "gelu_new" | "gelu_pytorch_tanh") {
            return Err(format!(
                "activation_function `{act}`: ravnest's GPT-2 block computes `gelu_new` (tanh GELU)"
            ));
        }
        if !flag(c, "scale_attn_weights", true)? {
            return Err("`scale_attn_weights` is false: ravnest scales attention by 1/√d".into());
        }
        for k in ["scale_attn_by_inverse_layer_idx", "add_cross_attention"] {
            if flag(c, k, false)? {
                return Err(format!(
                    "`{k}` is true: ravnest's GPT-2 block has no such option"
                ));
            }
        }
        Ok(d)
    }

    fn llama_config(c: &Value, class: HfClass, seq: Option<usize>) -> Result<Decoder, String> {
        let need = class.architecture();
        let hidden = size(c, "hidden_size", need)?;
        let heads = size(c, "num_attention_heads", need)?;
        let kv_heads = opt_size(c, "num_key_value_heads")?.unwrap_or(heads);
        let head_dim = opt_size(c, "head_dim")?.unwrap_or(hidden / heads.max(1));
        let positions = opt_size(c, "max_position_embeddings")?.unwrap_or(2048);
        let act = c
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        if act != "silu" {
            return Err(format!(
                "hidden_act `{act}`: ravnest's Llama block computes SwiGLU with `silu`"
            ));
        }
        let (rope_theta, rope) = rope_of(c)?;
        let attention_bias = flag(c, "attention_bias", false)?;
        let seq = seq.unwrap_or(positions.min(DEFAULT_MAX_SEQ));
        let window = match class {
            HfClass::Mistral => opt_size(c, "sliding_window")?,
            HfClass::Qwen2 if flag(c, "use_sliding_window", false)? => {
                opt_size(c, "sliding_window")?
            }
            _ => None,
        };
        if let Some(w) = window
            && w < seq
        {
            return Err(format!(
                "sliding_window {w} is shorter than the {seq} tokens a sample holds: ravnest computes full causal attention (set [model] seq_len to at most {w})"
            ));
        }
        Ok(Decoder {
            layers: size(c, "num_hidden_layers", need)?,
            hidden,
            heads,
            seq,
            vocab: size(c, "vocab_size", need)?,
            arch: Arch {
                class,
                kv_heads,
                head_dim,
                intermediate: size(c, "intermediate_size", need)?,
                positions,
                qkv_bias: class == HfClass::Qwen2 || attention_bias,
                out_bias: attention_bias,
                mlp_bias: flag(c, "mlp_bias", false)?,
                norm_eps: num(c, "rms_norm_eps", 1e-6)?,
                rope_theta,
                rope,
                tied: flag(c, "tie_word_embeddings", false)?,
            },
        })
    }

    /// Whether the sizes can run: at least one of everything, the key/value heads dividing
    /// the heads, GPT-2's heads dividing the width, a sample within the positions.
    pub fn check(&self) -> Result<(), String> {
        let a = &self.arch;
        if self.layers == 0
            || self.hidden == 0
            || self.heads == 0
            || self.seq == 0
            || self.vocab == 0
            || a.kv_heads == 0
            || a.head_dim == 0
            || a.intermediate == 0
        {
            return Err(format!(
                "a transformer needs at least one of each: {} blocks, width {}, {} heads ({} key/value, width {}), MLP {}, {} tokens, vocabulary {}",
                self.layers,
                self.hidden,
                self.heads,
                a.kv_heads,
                a.head_dim,
                a.intermediate,
                self.seq,
                self.vocab
            ));
        }
        if !self.heads.is_multiple_of(a.kv_heads) {
            return Err(format!(
                "{} key/value heads do not divide the {} attention heads",
                a.kv_heads, self.heads
            ));
        }
        if !self.is_llama() && !self.hidden.is_multiple_of(self.heads) {
            return Err(format!(
                "{} heads do not divide the hidden width {}",
                self.heads, self.hidden
            ));
        }
        if self.is_llama() && !a.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head width {}: rotary positions need an even one",
                a.head_dim
            ));
        }
        if self.seq > a.positions {
            return Err(format!(
                "a sample of {} tokens is longer than the model's {} positions",
                self.seq, a.positions
            ));
        }
        Ok(())
    }

    /// The rotary frequencies of one head (`head_dim / 2` of them), scaled as the config says.
    pub fn inv_freq(&self) -> Vec<f64> {
        let d = self.arch.head_dim;
        let base: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / self.arch.rope_theta.powf((2 * i) as f64 / d as f64))
            .collect();
        match self.arch.rope {
            Rope::Default => base,
            Rope::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
            Rope::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wavelen = old / low_freq_factor;
                let high_wavelen = old / high_freq_factor;
                base.into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect()
            }
        }
    }

    /// Width of the queries (heads · head width) and of the keys or values.
    pub fn qkv_widths(&self) -> (usize, usize) {
        let a = &self.arch;
        (self.heads * a.head_dim, a.kv_heads * a.head_dim)
    }

    /// Parameters of one block.
    pub fn block_params(&self) -> u64 {
        let (h, i) = (self.hidden as u64, self.arch.intermediate as u64);
        let (q, kv) = self.qkv_widths();
        let (q, kv) = (q as u64, kv as u64);
        let a = &self.arch;
        let bias = |on: bool, n: u64| if on { n } else { 0 };
        if self.is_llama() {
            h * (q + 2 * kv)
                + q * h
                + 3 * h * i
                + 2 * h
                + bias(a.qkv_bias, q + 2 * kv)
                + bias(a.out_bias, h)
                + bias(a.mlp_bias, 2 * i + h)
        } else {
            // ln_1, c_attn, c_proj, ln_2, c_fc, c_proj: each with its bias.
            2 * h + h * 3 * h + 3 * h + h * h + h + 2 * h + h * i + i + i * h + h
        }
    }

    /// The planner's description: `embed`, `block0 …`, `head` (the layers a pipeline splits),
    /// with this family's parameters, FLOPs and activations.
    ///
    /// FLOPs per block and sample: 2 · s · (the block's matrix parameters) for the
    /// projections, and 4 · s² · (heads · head width) for scores and their weighting.
    /// Activations kept for the backward, in elements per sample: GPT-2's as [`gpt_spec`]
    /// counts them (Korthikanti et al. 2022), Llama's as ravnest's hand-written pass keeps
    /// them: the block's input and normed input twice, q, k, v, the attention's output, the
    /// MLP's gate, up, its SiLU and product, and the a · s² scores.
    ///
    /// [`gpt_spec`]: crate::model::gpt_spec
    pub fn spec(&self, name: &str) -> ModelSpec {
        if !self.is_llama()
            && self.arch.positions == self.seq
            && self.arch.intermediate == 4 * self.hidden
        {
            return crate::model::gpt_spec(
                name,
                self.layers as u32,
                self.hidden as u64,
                self.heads as u64,
                self.seq as u64,
                self.vocab as u64,
                false,
            );
        }
        let (h, s, v) = (self.hidden as u64, self.seq as u64, self.vocab as u64);
        let (q, kv) = self.qkv_widths();
        let (q, kv, i) = (q as u64, kv as u64, self.arch.intermediate as u64);
        let a = self.heads as f64;
        let sf = s as f64;
        let matrix = if self.is_llama() {
            h * (q + 2 * kv) + q * h + 3 * h * i
        } else {
            4 * h * h + 2 * h * i
        };
        let embed_params = if self.is_llama() {
            v * h
        } else {
            v * h + self.arch.positions as u64 * h
        };
        let act = if self.is_llama() {
            s * (4 * h + q + 2 * kv + q + 4 * i) + (2.5 * a * sf * sf) as u64
        } else {
            s * (9 * h + 2 * i) + (2.5 * a * sf * sf) as u64
        };
        let mut layers = Vec::with_capacity(self.layers + 2);
        layers.push(LayerSpec {
            name: "embed".into(),
            params: embed_params,
            fwd_flops_per_sample: 0.0,
            activation_elems_per_sample: s * h,
            output_elems_per_sample: s * h,
        });
        for b in 0..self.layers {
            layers.push(LayerSpec {
                name: format!("block{b}"),
                params: self.block_params(),
                fwd_flops_per_sample: 2.0 * sf * matrix as f64 + 4.0 * sf * sf * q as f64,
                activation_elems_per_sample: act,
                output_elems_per_sample: s * h,
            });
        }
        let norm = if self.is_llama() { h } else { 2 * h };
        layers.push(LayerSpec {
            name: "head".into(),
            params: v * h + norm,
            fwd_flops_per_sample: 2.0 * sf * (h * v) as f64,
            activation_elems_per_sample: 2 * s * v + s * h,
            output_elems_per_sample: 1,
        });
        ModelSpec {
            name: name.to_string(),
            layers,
        }
    }

    /// A Hugging Face `config.json` for this model, as ravnest writes it with a checkpoint
    /// (untied: the LM head is a tensor of its own). A model from a folder writes the folder's
    /// own config back with the keys that changed ([`Decoder::patch_hf_config`]).
    pub fn hf_config(&self) -> Value {
        let a = &self.arch;
        let mut c = if self.is_llama() {
            serde_json::json!({
                "hidden_size": self.hidden,
                "intermediate_size": a.intermediate,
                "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads,
                "num_key_value_heads": a.kv_heads,
                "head_dim": a.head_dim,
                "max_position_embeddings": a.positions,
                "rms_norm_eps": a.norm_eps,
                "rope_theta": a.rope_theta,
                "hidden_act": "silu",
                "attention_bias": a.out_bias,
                "mlp_bias": a.mlp_bias,
                "vocab_size": self.vocab,
                "attention_dropout": 0.0,
                "initializer_range": 0.02,
            })
        } else {
            serde_json::json!({
                "vocab_size": self.vocab,
                "n_positions": a.positions,
                "n_ctx": a.positions,
                "n_embd": self.hidden,
                "n_layer": self.layers,
                "n_head": self.heads,
                "n_inner": a.intermediate,
                "activation_function": "gelu_new",
                "layer_norm_epsilon": a.norm_eps,
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "attn_pdrop": 0.0,
                "initializer_range": 0.02,
                "scale_attn_weights": true,
                "bos_token_id": 10,
                "eos_token_id": 10,
            })
        };
        c["architectures"] = serde_json::json!([a.class.architecture()]);
        c["model_type"] = a.class.model_type().into();
        c["torch_dtype"] = "float32".into();
        c["tie_word_embeddings"] = false.into();
        if let Rope::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } = a.rope
        {
            c["rope_scaling"] = serde_json::json!({
                "rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_position_embeddings as u64,
            });
        } else if let Rope::Linear { factor } = a.rope {
            c["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": factor});
        }
        c
    }

    /// The folder's own `config.json` as a checkpoint of this model writes it: the LM head
    /// untied (its own tensor in the file) and the weights in float32.
    pub fn patch_hf_config(&self, original: &Value) -> Value {
        let mut c = original.clone();
        if let Some(o) = c.as_object_mut() {
            o.insert("tie_word_embeddings".into(), false.into());
            o.insert("torch_dtype".into(), "float32".into());
            if o.contains_key("dtype") {
                o.insert("dtype".into(), "float32".into());
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_json() -> Value {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300,
            "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
            "tie_word_embeddings": true, "hidden_act": "silu"
        })
    }

    #[test]
    fn a_llama_config_reads_back_and_writes_the_same_model() {
        let d = Decoder::from_hf_config(&llama_json(), Some(32)).unwrap();
        assert_eq!(d.arch.kv_heads, 2);
        assert_eq!(d.arch.head_dim, 16);
        assert!(d.arch.tied && !d.arch.qkv_bias);
        assert!(matches!(d.arch.rope, Rope::Llama3 { factor: 8.0, .. }));
        let again = Decoder::from_hf_config(&d.hf_config(), Some(32)).unwrap();
        assert_eq!(again.arch.rope, d.arch.rope);
        assert_eq!((again.layers, again.hidden, again.vocab), (2, 64, 300));
        // Written untied.
        assert!(!again.arch.tied);
    }

    #[test]
    fn transformers_5_rope_parameters_are_read() {
        let mut c = llama_json();
        let o = c.as_object_mut().unwrap();
        o.remove("rope_theta");
        o.remove("rope_scaling");
        o.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "default", "rope_theta": 1000.0}),
        );
        let d = Decoder::from_hf_config(&c, None).unwrap();
        assert_eq!(d.arch.rope_theta, 1000.0);
        assert_eq!(d.arch.rope, Rope::Default);
        assert_eq!(d.seq, 128);
    }

    #[test]
    fn llama3_frequencies_follow_transformers() {
        // transformers' _compute_llama3_parameters on head_dim 16, θ 500000, factor 8, low 1,
        // high 4, original 16: wavelengths below 4 kept, above 16 divided by 8, a blend between.
        let d = Decoder::from_hf_config(&llama_json(), Some(32)).unwrap();
        let base: Vec<f64> = (0..8)
            .map(|i| 1.0 / 500_000f64.powf(2.0 * i as f64 / 16.0))
            .collect();
        let got = d.inv_freq();
        // Wavelength 2π, between 4 and 16: blended, smooth = (16 / 2π − 1) / 3.
        let smooth = (16.0 / (2.0 * std::f64::consts::PI) - 1.0) / 3.0;
        assert!((got[0] - ((1.0 - smooth) / 8.0 + smooth)).abs() < 1e-15);
        let w1 = 2.0 * std::f64::consts::PI / base[1];
        assert!(w1 > 16.0);
        assert!((got[1] - base[1] / 8.0).abs() < 1e-18);
    }

    #[test]
    fn what_does_not_fit_is_named() {
        let mut c = llama_json();
        c["architectures"] = serde_json::json!(["BertForMaskedLM"]);
        assert!(
            Decoder::from_hf_config(&c, None)
                .unwrap_err()
                .contains("BertForMaskedLM")
        );
        let mut c = llama_json();
        c["num_key_value_heads"] = 3.into();
        assert!(
            Decoder::from_hf_config(&c, None)
                .unwrap_err()
                .contains("do not divide")
        );
        let mut c = llama_json();
        c["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
        assert!(
            Decoder::from_hf_config(&c, None)
                .unwrap_err()
                .contains("yarn")
        );
        let mut c = llama_json();
        c.as_object_mut().unwrap().remove("hidden_size");
        assert!(
            Decoder::from_hf_config(&c, None)
                .unwrap_err()
                .contains("`hidden_size`")
        );
        let mut m = llama_json();
        m["architectures"] = serde_json::json!(["MistralForCausalLM"]);
        m["sliding_window"] = 16.into();
        assert!(
            Decoder::from_hf_config(&m, Some(32))
                .unwrap_err()
                .contains("sliding_window")
        );
        assert!(Decoder::from_hf_config(&m, Some(16)).is_ok());
    }

    #[test]
    fn the_byte_gpt_spec_is_the_planners_gpt() {
        let d = Decoder::gpt2(3, 32, 4, 8, 256);
        assert_eq!(
            d.spec("g"),
            crate::model::gpt_spec("g", 3, 32, 4, 8, 256, false)
        );
        assert_eq!(d.spec("g").layers[1].params, d.block_params());
        let l = Decoder::llama(2, 64, 4, 2, 172, 32, 300);
        let s = l.spec("l");
        assert_eq!(s.layers.len(), 4);
        // q 64x64, k and v 64x32 each, o 64x64, three 64x172, two norms.
        assert_eq!(s.layers[1].params, 64 * 128 + 64 * 64 + 3 * 64 * 172 + 128);
        assert_eq!(s.layers[0].params, 300 * 64);
        assert_eq!(s.layers[3].params, 300 * 64 + 64);
    }
}

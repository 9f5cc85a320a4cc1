//! The `[model]` table: a preset, a model of a kind (`gpt`, `mlp`, `custom`) by its sizes, or
//! a Hugging Face folder (`from`).

use toml::Spanned;

use super::ctx::Ctx;
use super::figures::Figure;
use super::raw::{MODEL_KINDS, ModelToml};
use super::suggest::{did_you_mean, with_help};
use super::types::{ConfigError, ModelFrom};
use crate::decoder::Decoder;
use crate::model::{self, LayerSpec, ModelSpec};

/// The `[model]` table: a preset, a `gpt`, `mlp` or `custom` model, or a Hugging Face folder
/// (`from`, with what it is), and its `name`.
pub(super) fn resolve_model(
    ctx: &Ctx<'_>,
    m: Option<&Spanned<ModelToml>>,
) -> Result<(ModelSpec, Option<ModelFrom>), ConfigError> {
    let Some(m) = m else {
        return Err(with_help(
            ctx.err(None, "the file has no [model] table"),
            Some("add `[model]` with `preset = \"mlp-digits\"` (or kind = \"gpt\" / \"mlp\" / \"custom\", or from = \"a Hugging Face folder\")".into()),
        ));
    };
    let span = m.span();
    let m = m.get_ref();
    if let Some(from) = &m.from {
        let given = [m.preset.as_ref(), m.kind.as_ref()]
            .into_iter()
            .flatten()
            .next();
        if let Some(other) = given {
            return Err(ctx.err(
                Some(&other.span()),
                "give one of `preset`, `kind` and `from`, not two",
            ));
        }
        let f = resolve_from(ctx, m, from)?;
        let name = m.name.clone().unwrap_or_else(|| {
            let dir = from.get_ref().trim_end_matches('/');
            dir.rsplit('/').next().unwrap_or(dir).to_string()
        });
        return Ok((f.decoder.spec(&name), Some(f)));
    }
    if let Some(i) = &m.init {
        return Err(ctx.err(
            Some(&i.span()),
            "`init` chooses how a model from a folder starts: it needs `from`",
        ));
    }
    let presets = || model::PRESETS.iter().map(|p| p.name);
    let mut spec = match (&m.preset, &m.kind) {
        (Some(_), Some(k)) => {
            return Err(ctx.err(Some(&k.span()), "give either `preset` or `kind`, not both"));
        }
        (None, None) => {
            return Err(with_help(
                ctx.err(Some(&span), "[model] needs `preset` or `kind`"),
                Some(format!(
                    "presets: {}",
                    presets().collect::<Vec<_>>().join(", ")
                )),
            ));
        }
        (Some(p), None) => model::preset(p.get_ref())
            .ok_or_else(|| {
                with_help(
                    ctx.err(
                        Some(&p.span()),
                        format!("unknown model preset `{}`", p.get_ref()),
                    ),
                    Some(did_you_mean(p.get_ref(), presets())),
                )
            })?
            .build(),
        (None, Some(k)) => match k.get_ref().as_str() {
            "gpt" => resolve_gpt(ctx, m, k)?,
            "mlp" => resolve_mlp(ctx, m, k)?,
            "custom" => resolve_custom(ctx, m, k)?,
            other => {
                return Err(with_help(
                    ctx.err(Some(&k.span()), format!("unknown model kind `{other}`")),
                    Some(did_you_mean(other, MODEL_KINDS.iter().copied())),
                ));
            }
        },
    };
    if let Some(n) = &m.name {
        spec.name = n.clone();
    }
    Ok((spec, None))
}

/// `from = "DIR"`: the folder's `config.json` read through the context's reader, `init`, and
/// `seq_len` (the tokens a sample holds; the model's context, at most 1024, by default).
fn resolve_from(
    ctx: &Ctx<'_>,
    m: &ModelToml,
    from: &Spanned<String>,
) -> Result<ModelFrom, ConfigError> {
    for (v, key) in [
        (m.layers.as_ref().map(Spanned::span), "layers"),
        (m.hidden.as_ref().map(Spanned::span), "hidden"),
        (m.heads.as_ref().map(Spanned::span), "heads"),
        (m.vocab.as_ref().map(Spanned::span), "vocab"),
        (m.dims.as_ref().map(Spanned::span), "dims"),
    ] {
        if let Some(span) = v {
            return Err(ctx.err(
                Some(&span),
                format!("`{key}` comes from the folder's config.json with `from`: leave it out"),
            ));
        }
    }
    let pretrained = match m.init.as_ref().map(|i| (i, i.get_ref().as_str())) {
        None | Some((_, "pretrained")) => true,
        Some((_, "random")) => false,
        Some((i, other)) => {
            return Err(with_help(
                ctx.err(Some(&i.span()), format!("unknown init `{other}`")),
                Some(did_you_mean(other, ["pretrained", "random"])),
            ));
        }
    };
    let seq = match &m.seq_len {
        Some(s) => Some(ctx.positive(s, "seq_len")? as usize),
        None => None,
    };
    let (dir, text) = (ctx.models)(from.get_ref()).map_err(|e| ctx.err(Some(&from.span()), e))?;
    let config = format!("{dir}/config.json");
    let json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ctx.err(Some(&from.span()), format!("{config}: not JSON: {e}")))?;
    let decoder = Decoder::from_hf_config(&json, seq)
        .map_err(|e| ctx.err(Some(&from.span()), format!("{config}: {e}")))?;
    Ok(ModelFrom {
        dir,
        pretrained,
        decoder,
    })
}

/// A `kind = "gpt"` model; `k` is the `kind` field, where a missing size is reported.
fn resolve_gpt(
    ctx: &Ctx<'_>,
    m: &ModelToml,
    k: &Spanned<String>,
) -> Result<ModelSpec, ConfigError> {
    let need = |v: &Option<Spanned<u64>>, what: &str| -> Result<u64, ConfigError> {
        match v {
            Some(x) => ctx.positive(x, what),
            None => Err(ctx.err(Some(&k.span()), format!("kind = \"gpt\" needs `{what}`"))),
        }
    };
    let layers = match &m.layers {
        Some(x) => ctx.positive(x, "layers")?,
        None => return Err(ctx.err(Some(&k.span()), "kind = \"gpt\" needs `layers`")),
    };
    let hidden = need(&m.hidden, "hidden")?;
    let heads = need(&m.heads, "heads")?;
    if hidden % heads != 0 {
        return Err(ctx.err(
            Some(&m.heads.as_ref().unwrap().span()),
            format!("`hidden` ({hidden}) must be a multiple of `heads` ({heads})"),
        ));
    }
    Ok(model::gpt_spec(
        "gpt",
        layers,
        hidden,
        heads,
        need(&m.seq_len, "seq_len")?,
        need(&m.vocab, "vocab")?,
        m.flash_attention.unwrap_or(false),
    ))
}

/// A `kind = "mlp"` model: its `dims`.
fn resolve_mlp(
    ctx: &Ctx<'_>,
    m: &ModelToml,
    k: &Spanned<String>,
) -> Result<ModelSpec, ConfigError> {
    let Some(d) = &m.dims else {
        return Err(ctx.err(
            Some(&k.span()),
            "kind = \"mlp\" needs `dims = [in, hidden.., out]`",
        ));
    };
    if d.get_ref().len() < 2 || d.get_ref().contains(&0) {
        return Err(ctx.err(
            Some(&d.span()),
            "`dims` needs at least two sizes, all greater than 0",
        ));
    }
    for &x in d.get_ref() {
        x.sane("dims").map_err(|m| ctx.err(Some(&d.span()), m))?;
    }
    Ok(model::mlp_spec("mlp", d.get_ref()))
}

/// A `kind = "custom"` model: its `[[model.layer]]` tables, each `repeat` expanded.
fn resolve_custom(
    ctx: &Ctx<'_>,
    m: &ModelToml,
    k: &Spanned<String>,
) -> Result<ModelSpec, ConfigError> {
    if m.layer.is_empty() {
        return Err(ctx.err(
            Some(&k.span()),
            "kind = \"custom\" needs [[model.layer]] tables",
        ));
    }
    let mut layers = Vec::new();
    for l in &m.layer {
        let l = l.get_ref();
        let flops = ctx.non_negative(&l.fwd_flops_per_sample, "fwd_flops_per_sample")?;
        let params = ctx.count(&l.params, "params")?;
        let activation = ctx.count(
            &l.activation_elems_per_sample,
            "activation_elems_per_sample",
        )?;
        let output = ctx.count(&l.output_elems_per_sample, "output_elems_per_sample")?;
        let repeat = match &l.repeat {
            Some(r) => ctx.positive(r, "repeat")?,
            None => 1,
        };
        for i in 0..repeat {
            layers.push(LayerSpec {
                name: if repeat == 1 {
                    l.name.clone()
                } else {
                    format!("{}{i}", l.name)
                },
                params,
                fwd_flops_per_sample: flops,
                activation_elems_per_sample: activation,
                output_elems_per_sample: output,
            });
        }
    }
    Ok(ModelSpec {
        name: "custom".into(),
        layers,
    })
}

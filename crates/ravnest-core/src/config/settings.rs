//! The `[training]`, `[run]` and `[sim]` tables, each over its defaults.

use super::ctx::Ctx;
use super::raw::{NETWORKS, RunToml, SimToml, TrainingToml};
use super::suggest::{did_you_mean, with_help};
use super::types::{
    ConfigError, DEFAULT_CHECKPOINT_EVERY_STEPS, DEFAULT_MEMORY_RESERVE_GIB, RunSettings,
    SimSettings,
};
use crate::cluster::TrainingSpec;

/// The `[training]` table over [`TrainingSpec::default`], and the memory reserve (GiB).
pub(super) fn resolve_training(
    ctx: &Ctx<'_>,
    t: Option<&TrainingToml>,
) -> Result<(TrainingSpec, f64), ConfigError> {
    let mut training = TrainingSpec::default();
    let mut reserve_gib = DEFAULT_MEMORY_RESERVE_GIB;
    if let Some(t) = t {
        if let Some(b) = &t.global_batch {
            training.global_batch = ctx.positive(b, "global_batch")?;
        }
        if let Some(m) = &t.micro_batch {
            training.micro_batch = ctx.positive(m, "micro_batch")?;
        }
        if let Some(o) = t.optimizer {
            training.optimizer = o;
        }
        if let Some(p) = t.precision {
            training.precision = p;
        }
        if let Some(s) = t.sync {
            training.sync = s;
        }
        if let Some(x) = &t.local_sgd_threshold {
            training.local_sgd_threshold = ctx.positive(x, "local_sgd_threshold")?;
        }
        if let Some(a) = t.accumulate {
            training.accumulate = a;
        }
        if let Some(x) = &t.node_mtbf_h {
            training.node_mtbf_h = ctx.positive(x, "node_mtbf_h")?;
        }
        if let Some(r) = t.redundancy {
            training.redundancy = r;
        }
        if let Some(l) = t.layout {
            training.layout = l;
        }
        let outer = &mut training.outer;
        if let Some(o) = t.outer_optimizer {
            outer.optimizer = o;
        }
        if let Some(x) = &t.outer_lr {
            outer.lr = ctx.positive(x, "outer_lr")?;
        }
        if let Some(x) = &t.outer_momentum {
            outer.momentum = ctx.non_negative(x, "outer_momentum")?;
            if outer.momentum >= 1.0 {
                return Err(ctx.err(Some(&x.span()), "`outer_momentum` must be below 1"));
            }
        }
        if let Some(p) = &t.outer_precision {
            outer.precision = *p.get_ref();
            let lossy = matches!(
                outer.precision,
                crate::cluster::OuterPrecision::Fp16 | crate::cluster::OuterPrecision::Int8
            );
            if lossy && training.optimizer == crate::model::Optimizer::Adamw {
                return Err(ctx.err(
                    Some(&p.span()),
                    "a lossy `outer_precision` with `optimizer = \"adamw\"`: a round averages AdamW's second moments too, and int8 or fp16 rounding takes them to zero or below (the run diverges); use \"fp32\", or sgd-momentum",
                ));
            }
        }
        if let Some(h) = &t.local_steps {
            outer.local_steps = Some(ctx.positive(h, "local_steps")?);
        }
        if let Some(o) = t.outer_overlap {
            outer.overlap = o;
        }
        if let Some(d) = &t.outer_delay {
            if t.outer_overlap == Some(false) {
                return Err(ctx.err(
                    Some(&d.span()),
                    "`outer_delay` is for overlapped rounds, and `outer_overlap = false`",
                ));
            }
            outer.overlap = true;
            outer.delay = Some(ctx.positive(d, "outer_delay")?);
        }
        if let Some(r) = &t.memory_reserve_gib {
            reserve_gib = ctx.non_negative(r, "memory_reserve_gib")?;
        }
    }
    Ok((training, reserve_gib))
}

/// The `[run]` table over `run` (defaults and what the cluster section gave); `node_count`
/// bounds `min_nodes`.
pub(super) fn resolve_run(
    ctx: &Ctx<'_>,
    r: Option<&RunToml>,
    mut run: RunSettings,
    node_count: usize,
) -> Result<RunSettings, ConfigError> {
    let Some(r) = r else {
        return Ok(run);
    };
    if let Some(x) = &r.steps {
        run.steps = ctx.positive(x, "steps")?;
    }
    if let Some(x) = &r.learning_rate {
        run.learning_rate = ctx.positive(x, "learning_rate")?;
    }
    if let Some(x) = &r.momentum {
        run.momentum = ctx.non_negative(x, "momentum")?;
        if run.momentum >= 1.0 {
            return Err(ctx.err(Some(&x.span()), "`momentum` must be below 1"));
        }
    }
    if let Some(x) = &r.weight_decay {
        run.weight_decay = ctx.non_negative(x, "weight_decay")?;
    }
    if let Some(x) = r.seed {
        run.seed = x;
    }
    if let Some(x) = &r.dataset {
        run.dataset = x.clone();
    }
    if let Some(x) = &r.network {
        if !NETWORKS.contains(&x.get_ref().as_str()) {
            return Err(with_help(
                ctx.err(
                    Some(&x.span()),
                    format!("unknown network `{}`", x.get_ref()),
                ),
                Some(did_you_mean(x.get_ref(), NETWORKS.iter().copied())),
            ));
        }
        run.network = x.get_ref().clone();
    }
    if let Some(x) = &r.context_chars {
        run.context_chars = ctx.positive(x, "context_chars")?;
    }
    if let Some(x) = &r.char_hidden {
        run.char_hidden = ctx.positive(x, "char_hidden")?;
    }
    if let Some(x) = r.checkpoint_every_steps {
        run.checkpoint_every_steps = x;
    }
    if let Some(x) = &r.target_accuracy {
        run.target_accuracy = ctx.positive(x, "target_accuracy")?;
    }
    if let Some(x) = &r.target_bits_per_byte {
        run.target_bits_per_byte = ctx.positive(x, "target_bits_per_byte")?;
    }
    if let Some(x) = &r.heartbeat_ms {
        run.heartbeat_ms = ctx.positive(x, "heartbeat_ms")?;
    }
    if let Some(x) = &r.heartbeat_timeout_ms {
        run.heartbeat_timeout_ms = ctx.positive(x, "heartbeat_timeout_ms")?;
    }
    if let Some(x) = &r.register_timeout_s {
        run.register_timeout_s = ctx.positive(x, "register_timeout_s")?;
    }
    if let Some(x) = &r.min_nodes {
        let n = ctx.positive(x, "min_nodes")?;
        if n > node_count as u64 {
            return Err(ctx.err(
                Some(&x.span()),
                format!("`min_nodes` is {n}, but the file has {node_count} nodes"),
            ));
        }
        run.min_nodes = Some(n);
    }
    resolve_schedule(ctx, r, &mut run)?;
    resolve_data(ctx, r, &mut run)?;
    Ok(run)
}

/// `lr_schedule`, `warmup_steps`, `min_lr` and `decay_steps`, checked against the steps.
fn resolve_schedule(ctx: &Ctx<'_>, r: &RunToml, run: &mut RunSettings) -> Result<(), ConfigError> {
    if let Some(k) = r.lr_schedule {
        run.lr_schedule = k;
    }
    if let Some(x) = &r.warmup_steps {
        run.warmup_steps = ctx.count(x, "warmup_steps")?;
        if run.warmup_steps >= run.steps {
            return Err(ctx.err(
                Some(&x.span()),
                format!(
                    "`warmup_steps` ({}) must be below the run's `steps` ({})",
                    run.warmup_steps, run.steps
                ),
            ));
        }
    }
    if let Some(x) = &r.min_lr {
        run.min_lr = ctx.non_negative(x, "min_lr")?;
        if run.min_lr > run.learning_rate {
            return Err(ctx.err(
                Some(&x.span()),
                format!(
                    "`min_lr` ({}) is above the `learning_rate` ({})",
                    run.min_lr, run.learning_rate
                ),
            ));
        }
    }
    if let Some(x) = &r.decay_steps {
        let d = ctx.positive(x, "decay_steps")?;
        if run.lr_schedule != crate::recipe::ScheduleKind::Wsd {
            return Err(ctx.err(
                Some(&x.span()),
                "`decay_steps` is the final decay of `lr_schedule = \"wsd\"`",
            ));
        }
        if d + run.warmup_steps > run.steps {
            return Err(ctx.err(
                Some(&x.span()),
                format!(
                    "`decay_steps` ({d}) and `warmup_steps` ({}) are more than the run's `steps` ({})",
                    run.warmup_steps, run.steps
                ),
            ));
        }
        run.decay_steps = Some(d);
    }
    Ok(())
}

/// `dataset_field`, `dataset_dtype`, `eval_dataset` and `eval_fraction`.
fn resolve_data(ctx: &Ctx<'_>, r: &RunToml, run: &mut RunSettings) -> Result<(), ConfigError> {
    if let Some(f) = &r.dataset_field {
        run.dataset_field = f.clone();
    }
    if let Some(d) = &r.dataset_dtype {
        if !matches!(d.get_ref().as_str(), "uint16" | "uint32") {
            return Err(with_help(
                ctx.err(
                    Some(&d.span()),
                    format!("unknown dataset_dtype `{}`", d.get_ref()),
                ),
                Some(did_you_mean(d.get_ref(), ["uint16", "uint32"])),
            ));
        }
        run.dataset_dtype = Some(d.get_ref().clone());
    }
    if let Some(e) = &r.eval_dataset {
        run.eval_dataset = Some(e.clone());
    }
    if let Some(f) = &r.eval_fraction {
        let x = ctx.positive(f, "eval_fraction")?;
        if x >= 1.0 {
            return Err(ctx.err(Some(&f.span()), "`eval_fraction` must be below 1"));
        }
        if r.eval_dataset.is_some() {
            return Err(ctx.err(
                Some(&f.span()),
                "give `eval_fraction` (the end of `dataset` held out) or `eval_dataset`, not both",
            ));
        }
        run.eval_fraction = Some(x);
    }
    if let Some(e) = &r.eval_every_steps {
        run.eval_every_steps = ctx.count(e, "eval_every_steps")?;
    }
    if let Some(m) = &r.max_grad_norm {
        run.max_grad_norm = Some(ctx.positive(m, "max_grad_norm")?);
    }
    Ok(())
}

/// The `[sim]` table, when the file has one.
pub(super) fn resolve_sim(
    ctx: &Ctx<'_>,
    s: Option<&SimToml>,
) -> Result<Option<SimSettings>, ConfigError> {
    let Some(s) = s else {
        return Ok(None);
    };
    Ok(Some(SimSettings {
        seed: s.seed.unwrap_or(0),
        steps: match &s.steps {
            Some(x) => ctx.positive(x, "steps")?,
            None => 100,
        },
        checkpoint_every_steps: s
            .checkpoint_every_steps
            .unwrap_or(DEFAULT_CHECKPOINT_EVERY_STEPS),
    }))
}

//! The `cluster.toml` / scenario format: parsing and validation, from text (no file I/O here).
//!
//! One format serves `plan`, `run` and `sim`: a scenario is a cluster file plus `[sim]` and
//! `[[fault]]` tables. Every error names the file, the line and column, and, for a misspelt key,
//! device or preset, the nearest valid name. The format is documented in `docs/cluster-format.md`.
//!
//! The parts, each importing only those listed before it: `types` (the public types and the
//! defaults), `raw` (the file as written), `figures` (numbers in messages and their bounds),
//! `ctx` (errors with a place), `suggest` ("did you mean"), then one part per table: `nodes`,
//! `settings`, `models`, `faults`.

mod ctx;
mod faults;
mod figures;
mod models;
mod nodes;
mod raw;
mod settings;
mod suggest;
#[cfg(test)]
mod tests;
mod types;

use toml::Spanned;

use crate::cluster::ClusterSpec;
use ctx::Ctx;
use faults::resolve_fault;
use models::resolve_model;
use nodes::{
    NodeDefaults, Nodes, cluster_name, find_node, network, resolve_default_link, resolve_nodes,
    resolve_pair_links,
};
use raw::FileToml;
use settings::{resolve_run, resolve_sim, resolve_training};
use suggest::{suggestion_from_serde, with_help};

pub use suggest::nearest;
pub use types::{
    ConfigError, DEFAULT_CHECKPOINT_EVERY_STEPS, DEFAULT_LINK, DEFAULT_MEMORY_RESERVE_GIB, Fault,
    ModelFrom, RunSettings, Scenario, SimSettings,
};

/// Reads a Hugging Face model folder's `config.json` for `[model] from`: given the folder as
/// the file writes it, (the folder as the run opens it, the file's text), or why not. The
/// binary's reader resolves a relative folder against the cluster file's own folder.
pub type ModelReader<'a> = &'a dyn Fn(&str) -> Result<(String, String), String>;

/// Parse and validate a cluster or scenario file. `origin` names it in errors. A file with
/// `[model] from` needs [`parse_with`] and a reader.
pub fn parse(text: &str, origin: &str) -> Result<Scenario, ConfigError> {
    parse_with(text, origin, &|dir| {
        Err(format!(
            "cannot read the model folder `{dir}` here: this caller reads no files"
        ))
    })
}

/// [`parse`], reading the `config.json` of a `[model] from` folder with `models`.
pub fn parse_with(
    text: &str,
    origin: &str,
    models: ModelReader<'_>,
) -> Result<Scenario, ConfigError> {
    let ctx = Ctx {
        origin,
        text,
        models,
    };
    let file: FileToml = toml::from_str(text).map_err(|e| {
        let msg = e.message().trim().to_string();
        let help = suggestion_from_serde(&msg);
        with_help(ctx.err(e.span().as_ref(), msg), help)
    })?;
    resolve(&ctx, file)
}

/// Each table of the file over its defaults, in the order they depend on one another.
fn resolve(ctx: &Ctx<'_>, file: FileToml) -> Result<Scenario, ConfigError> {
    let default_link = resolve_default_link(ctx, file.links.as_ref())?;
    // Training (needed before nodes: precision decides throughput, reserve decides memory).
    let (mut training, reserve_gib) = resolve_training(ctx, file.training.as_ref())?;
    let defaults = NodeDefaults {
        precision: training.precision,
        reserve_gib,
        link: default_link,
    };
    let Nodes {
        specs: nodes,
        raw_devices,
        slowdown,
        index,
    } = resolve_nodes(ctx, &file.node, &defaults)?;
    let lookup_node = |s: &Spanned<String>| find_node(ctx, &index, s);
    let pair_links = resolve_pair_links(ctx, file.links.as_ref(), default_link, &lookup_node)?;

    let cluster_name = cluster_name(ctx, file.cluster.as_ref());
    let (p2p, relays) = network(ctx, file.cluster.as_ref())?;
    let coordinator = match file.cluster.as_ref().and_then(|c| c.coordinator.as_ref()) {
        Some(c) => Some(lookup_node(c)?),
        None => None,
    };
    let run = RunSettings {
        secret: file.cluster.as_ref().and_then(|c| c.secret.clone()),
        coordinator,
        p2p,
        relays,
        emulate_slowdown: slowdown,
        devices: raw_devices,
        ..RunSettings::default()
    };
    let mut run = resolve_run(ctx, file.run.as_ref(), run, nodes.len())?;
    // A restore goes back to the latest checkpoint a real run wrote (only the final one: to
    // the start). `plan`, `sim` and `run` price recovery with this one figure.
    training.checkpoint_every_steps = match run.checkpoint_cadence() {
        0 => run.steps,
        k => k,
    };

    let (model, from) = resolve_model(ctx, file.model.as_ref())?;
    run.model_from = from;
    // A transformer's file trains the GPT unless `[run] network` says otherwise.
    let network_given = file.run.as_ref().is_some_and(|r| r.network.is_some());
    if !network_given && crate::model::is_transformer(&model) {
        run.network = "gpt".into();
    }
    let sim = resolve_sim(ctx, file.sim.as_ref())?;

    let mut faults = Vec::new();
    for f in &file.fault {
        faults.push(resolve_fault(ctx, f, &lookup_node)?);
    }

    Ok(Scenario {
        cluster: ClusterSpec {
            name: cluster_name,
            nodes,
            pair_links,
        },
        model,
        training,
        run,
        sim,
        faults,
    })
}

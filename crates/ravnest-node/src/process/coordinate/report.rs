//! The coordinator's report: throughput, accuracy (the final evaluation), checkpoints, plans,
//! the pipeline's figures and what the run's profile is fitted from.

use std::collections::BTreeMap;

use ravnest_core::NodeId;
use ravnest_protocol::coordinator::Event;

use super::super::console::{describe, learn_member};
use super::super::options::warmup_steps;
use super::super::setup::Setup;
use super::{Calibration, Host, Trained};
use crate::summary::{CoordinatorReport, PipelineFigures, Sample};
use ravnest_train::net::Network;

/// The first pipeline plan's stages, its micro-batches and bubble in theory, and the bytes its
/// stages send each other per step (the bubble measured is filled in with the nodes' reports).
pub(super) fn pipeline_figures(
    h: &Host<'_>,
    cluster: &ravnest_core::ClusterSpec,
    log: &ravnest_runtime::coordinator::RunLog,
) -> Option<PipelineFigures> {
    let (workers, stages) = log.events.iter().find_map(|(_, e)| match e {
        Event::Planned {
            workers, stages, ..
        } if !stages.is_empty() => Some((workers, stages)),
        _ => None,
    })?;
    let spec = h.su.compute.net.model_spec();
    let name = |n: &NodeId| {
        cluster
            .nodes
            .get(n.index())
            .map_or_else(|| format!("node {}", n.0), |x| x.name.clone())
    };
    let mut by_layers: BTreeMap<ravnest_core::LayerRange, Vec<String>> = BTreeMap::new();
    for (n, l) in stages {
        by_layers.entry(*l).or_default().push(name(n));
    }
    let batch = |n: &NodeId| workers.iter().find(|w| w.0 == *n).map_or(0, |w| w.1);
    let elem = 4u64;
    // Every node but the last stage's sends its output forward and gets its gradient back.
    let last_layer = spec.layers.len() as u32;
    let activation_bytes_per_step = stages
        .iter()
        .filter(|(_, l)| l.range().end as u32 != last_layer)
        .map(|(n, l)| {
            let out = spec.layers[l.range().end - 1].output_elems_per_sample;
            2 * batch(n) * out * elem
        })
        .sum();
    let p = by_layers.len() as f64;
    let micro = u64::from(h.opts.scenario.training.micro_batch.max(1));
    let m = workers.first().map_or(1, |w| w.1.div_ceil(micro)).max(1);
    Some(PipelineFigures {
        stages: by_layers
            .iter()
            .map(|(l, nodes)| {
                let names: Vec<&str> = spec.layers[l.range()]
                    .iter()
                    .map(|x| x.name.as_str())
                    .collect();
                format!("layers {l} ({}) on {}", names.join(", "), nodes.join(", "))
            })
            .collect(),
        nodes: stages.iter().map(|(n, _)| name(n)).collect(),
        micro_batches: m,
        bubble_theory: (p - 1.0) / (m as f64 + p - 1.0),
        activation_bytes_per_step,
        ..PipelineFigures::default()
    })
}

/// The final model's accuracy on the held-out data; for the character model, the first test
/// context continued greedily; for the GPT, bits per byte and a sampled continuation.
pub(super) fn evaluate(h: &Host<'_>, end: u64) -> (f64, Option<Sample>, Option<f64>) {
    let (s, su) = (&h.opts.scenario, h.su);
    // The weights alone: the optimizer state is not needed to evaluate.
    let model = match su.files.load_weights(end) {
        Ok(m) => m,
        Err(_) => h
            .counters
            .read(su.me, |c| c.final_model.clone())
            .flatten()
            .unwrap_or_default(),
    };
    let weights = &model[..su.compute.params().min(model.len())];
    if let Network::Gpt(g) = &su.compute.net {
        let tok = s
            .run
            .model_from
            .as_ref()
            .and_then(|m| ravnest_train::tok::Tok::open(std::path::Path::new(&m.dir)).ok());
        return evaluate_gpt(g, weights, &su.test, s.run.seed, tok.as_ref());
    }
    let accuracy = su
        .compute
        .net
        .accuracy(weights, &su.test.x, &su.test.y)
        .unwrap_or(0.0);
    let sample = match (&su.compute.net, su.test.vocab.is_empty()) {
        (Network::Char { context, .. }, false) => {
            let prompt: Vec<u32> = su.test.x[..*context].iter().map(|&k| k as u32).collect();
            let more = su
                .compute
                .net
                .continue_text(weights, &prompt, 80)
                .unwrap_or_default();
            let text = |ids: &[u32]| -> String {
                ids.iter()
                    .map(|&k| su.test.vocab.get(k as usize).copied().unwrap_or('?'))
                    .collect()
            };
            Some(Sample {
                prompt: text(&prompt),
                continuation: text(&more),
            })
        }
        _ => None,
    };
    (accuracy, sample, None)
}

/// How well the final model does on the held-out data.
struct Quality {
    accuracy: f64,
    sample: Option<Sample>,
    /// A byte-level GPT's bits per byte, and the file's target.
    bits_per_byte: Option<(f64, f64)>,
    /// A model from a folder's loss per token (it reads tokens: no byte target).
    nats_per_token: Option<f64>,
}

fn quality(h: &Host<'_>, end: u64) -> Quality {
    let s = &h.opts.scenario;
    // The training's peak memory, before the final model is read to be evaluated.
    if let Some((_, peak)) = ravnest_train::measure::resident_memory() {
        let _ = h.su.trained_peak_rss.set(peak);
    }
    let (accuracy, sample, bits) = evaluate(h, end);
    let tokenized = s.run.model_from.is_some();
    Quality {
        accuracy,
        sample,
        bits_per_byte: bits
            .filter(|_| !tokenized)
            .map(|b| (b, s.run.target_bits_per_byte)),
        nats_per_token: bits
            .filter(|_| tokenized)
            .map(|b| b * std::f64::consts::LN_2),
    }
}

/// Windows of held-out text the GPT is evaluated on, at most.
pub(super) const GPT_EVAL_WINDOWS: usize = 256;

/// The GPT on the first held-out windows: (next-token accuracy, a sampled continuation of the
/// first window's start, bits per token: per byte for byte-level GPTs). `tok`: the tokenizer
/// of a model from a folder (else the tokens are bytes).
pub(super) fn evaluate_gpt(
    g: &ravnest_train::gpt::Gpt,
    weights: &[f32],
    test: &ravnest_train::data::Dataset,
    seed: u64,
    tok: Option<&ravnest_train::tok::Tok>,
) -> (f64, Option<Sample>, Option<f64>) {
    let dev = ravnest_train::device::current();
    let w = test.features;
    let rows = test.len().min(GPT_EVAL_WINDOWS);
    // The first held-out windows (a corpus's read from disk).
    let Ok(x) = test.rows(0..rows) else {
        return (0.0, None, None);
    };
    let Ok((nats, accuracy)) = g.evaluate(&dev, weights, &x, 16) else {
        return (0.0, None, None);
    };
    let prompt: Vec<u32> = x[..w.min(g.seq / 2)].iter().map(|&t| t as u32).collect();
    let sampling = ravnest_train::gpt::Sampling {
        temperature: 0.8,
        top_k: 0,
        seed,
    };
    let more = g
        .generate_until(
            &dev,
            weights,
            &prompt,
            120,
            sampling,
            tok.and_then(|t| t.eos),
        )
        .unwrap_or_default();
    let text = |ids: &[u32]| -> String {
        match tok {
            Some(t) => t.decode(ids).unwrap_or_default(),
            None => ravnest_train::gpt::decode_bytes(ids),
        }
    };
    let sample = Sample {
        prompt: text(&prompt),
        continuation: text(&more),
    };
    (accuracy, Some(sample), Some(nats / std::f64::consts::LN_2))
}

/// What an equal split of the batch computes: every node at B / n, the batch each was measured
/// at together, so the step is the slowest node's (no all-reduce counted: a bound in its
/// favour); 0 without figures.
fn equal_split(solo: &BTreeMap<NodeId, Calibration>) -> f64 {
    let slowest = solo
        .values()
        .map(|m| m.samples_per_s)
        .fold(f64::INFINITY, f64::min);
    if slowest.is_finite() {
        solo.len() as f64 * slowest
    } else {
        0.0
    }
}

/// Each node's solo throughput at the batch it trains: the line its calibration fitted (fixed
/// seconds per step and seconds per sample, measured with every node computing at once) at its
/// batch in the run's last data-parallel plan, `b / (overhead + b · per_sample)`. A node that
/// plan leaves out, and every node of a pipeline plan (its calibration stands for the whole
/// model), counts at the batch it was measured at (B / n). What a node can do alone depends on
/// its batch: measured at B / n only, a node given more than that is undercounted, and the
/// efficiency against the sum can pass 1.
fn solo_at_batch(
    solo: &BTreeMap<NodeId, Calibration>,
    events: &[(u64, Event)],
) -> BTreeMap<NodeId, f64> {
    let planned = events.iter().rev().find_map(|(_, e)| match e {
        Event::Planned {
            workers, stages, ..
        } => Some((workers, stages.is_empty())),
        _ => None,
    });
    solo.iter()
        .map(|(id, m)| {
            let at = match planned {
                Some((workers, true)) => workers.iter().find(|w| w.0 == *id).map(|w| w.1),
                _ => None,
            };
            let step_s = at.map(|b| m.overhead_s + b as f64 * m.per_sample_s);
            let figure = match (at, step_s) {
                (Some(b), Some(t)) if b > 0 && t > 0.0 => b as f64 / t,
                _ => m.samples_per_s,
            };
            (*id, figure)
        })
        .collect()
}

/// The coordinator's report: throughput (overall, steady, against the nodes' summed solo
/// capacity), accuracy, checkpoints, plans and the notable events.
pub(super) fn coordinator_report(
    h: &Host<'_>,
    cluster: &ravnest_core::ClusterSpec,
    solo: &BTreeMap<NodeId, Calibration>,
    t: &Trained,
) -> CoordinatorReport {
    let s = &h.opts.scenario;
    let log = &t.log;
    let q = quality(h, t.end);
    // The steps agreed here end at the log's last; a successor that went back below the step
    // it took over at (the newest version every member held) redid the steps from there.
    let trained = log.step_done_ns.len() as u64;
    let final_step = log.last_step.map_or(t.start_step, |l| l + 1);
    let start_step = final_step.saturating_sub(trained);
    let batch = f64::from(s.training.global_batch);
    let samples_per_s = trained as f64 * batch / t.train_s.max(1e-9);
    // The same after the first steps (caches, allocators and the first plan settle there).
    let skip = warmup_steps(trained) as usize;
    let steady = match (
        log.step_done_ns.get(skip.saturating_sub(1)),
        log.step_done_ns.last(),
    ) {
        (Some(a), Some(b)) if b > a && skip > 0 => {
            (trained as usize - skip) as f64 * batch / ((b - a) as f64 / 1e9)
        }
        _ => samples_per_s,
    };
    // Each node's solo throughput at the batch it trains, fixed costs included.
    let at_batch = solo_at_batch(solo, &log.events);
    let solo_sum: f64 = at_batch.values().sum();
    let checkpoints: Vec<u64> = log
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::CheckpointComplete { step, .. } => Some(*step),
            _ => None,
        })
        .collect();
    // Nodes that joined without being in the file have names too.
    let mut cluster = cluster.clone();
    for (_, e) in &log.events {
        learn_member(&mut cluster, e);
    }
    let all_notable: Vec<String> = log
        .events
        .iter()
        .filter(|(_, e)| crate::summary::notable(e))
        .map(|(_, e)| describe(e, &cluster))
        .collect();
    let mut notable: Vec<String> = all_notable.iter().take(20).cloned().collect();
    if all_notable.len() > 20 {
        notable.push(format!("... and {} more", all_notable.len() - 20));
    }
    let plans = log
        .events
        .iter()
        .filter(|(_, e)| matches!(e, Event::Planned { .. }))
        .count();
    let files = &h.su.files;
    let mut profile_inputs =
        profile_inputs(h, &cluster, [start_step + skip as u64, final_step], steady);
    profile_inputs.rings = log
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::LinksScaled {
                ring_s, ring_nodes, ..
            } => Some((*ring_nodes, *ring_s)),
            _ => None,
        })
        .collect();
    CoordinatorReport {
        steps: final_step,
        start_step,
        train_s: t.train_s,
        samples_per_s,
        steady_samples_per_s: steady,
        warmup_steps: skip as u64,
        solo_sum_samples_per_s: solo_sum,
        equal_split_samples_per_s: equal_split(solo),
        // A successor (fail-over) has no solo figures: no efficiency then.
        capacity_efficiency: if solo_sum > 0.0 {
            samples_per_s / solo_sum
        } else {
            0.0
        },
        solo_by_node: at_batch
            .iter()
            .map(|(id, x)| (cluster.nodes[id.index()].name.clone(), *x))
            .collect(),
        replans: plans.saturating_sub(1) as u64,
        accuracy: q.accuracy,
        target_accuracy: s.run.target_accuracy,
        sample: q.sample,
        bits_per_byte: q.bits_per_byte,
        nats_per_token: q.nats_per_token,
        evaluations: t.evaluations.iter().map(|e| e.figures()).collect(),
        pipeline: pipeline_figures(h, &cluster, log),
        checkpoints,
        checkpoint_dir: files.dir.display().to_string(),
        final_checkpoint: files.path(t.end).display().to_string(),
        stopped: t.stopped.then(|| resume_command(h)),
        optimizer: s.training.optimizer.as_str().to_string(),
        plans: plans as u64,
        rebalances: log
            .events
            .iter()
            .filter(|(_, e)| crate::summary::rebalance(e))
            .count() as u64,
        notable_events: notable,
        events_file: t.events_path.display().to_string(),
        took_over_from: log.events.iter().find_map(|(_, e)| match e {
            Event::TookOver { from, .. } => cluster.nodes.get(from.index()).map(|n| n.name.clone()),
            _ => None,
        }),
        profile_file: None,
        profile_inputs: Some(profile_inputs),
        model_state_mib: model_state_mib(h.su),
    }
}

/// MiB of the whole model's state: its parameters, one gradient, and the optimizer state.
pub(super) fn model_state_mib(su: &Setup) -> f64 {
    let c = &su.compute;
    (c.model_len() + c.params()) as f64 * 4.0 / f64::from(1u32 << 20)
}

/// What the run's profile is fitted from, but the nodes' steps (their reports bring them):
/// each node's figures as calibrated (or registered) at the start and its probed link, and
/// the probed pairs.
pub(super) fn profile_inputs(
    h: &Host<'_>,
    cluster: &ravnest_core::ClusterSpec,
    steps: [u64; 2],
    samples_per_s: f64,
) -> ravnest_core::profile::RunFigures {
    let s = &h.opts.scenario;
    let spec = h.su.compute.net.model_spec();
    let train_flops = spec.train_flops_per_sample();
    let name = |id: NodeId| cluster.nodes[id.index()].name.clone();
    ravnest_core::profile::RunFigures {
        cluster: s.cluster.name.clone(),
        model: s.model.name.clone(),
        global_batch: s.training.global_batch,
        grad_bytes: (spec.params() * s.training.precision.element_bytes()) as f64,
        steps,
        samples_per_s,
        nodes: cluster
            .nodes
            .iter()
            .map(|n| ravnest_core::profile::NodeRun {
                name: n.name.clone(),
                calibrated: (train_flops / n.flops, n.step_overhead_s),
                memory_bytes: n.memory_bytes,
                link: n.link,
                steps: Vec::new(),
                busy: 0.0,
                comm: 0.0,
            })
            .collect(),
        pairs: cluster
            .pair_links
            .iter()
            .filter(|((a, b), _)| {
                a.index() < cluster.nodes.len() && b.index() < cluster.nodes.len()
            })
            .map(|(&(a, b), l)| (name(a), name(b), *l))
            .collect(),
        rings: Vec::new(),
    }
}

/// The command that continues a run stopped on request from its latest checkpoint: this
/// node's, and the same with `--resume` on every other node.
fn resume_command(h: &Host<'_>) -> String {
    let o = h.opts;
    format!(
        "ravnest run {} --node {} --out {} --resume (and every other node's command with --resume)",
        o.origin,
        o.node,
        o.out_dir.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(samples_per_s: f64, per_sample_s: f64, overhead_s: f64) -> Calibration {
        Calibration {
            samples_per_s,
            per_sample_s,
            overhead_s,
        }
    }

    fn planned(workers: Vec<(NodeId, u64)>, pipeline: bool) -> (u64, Event) {
        let stages = if pipeline {
            vec![(NodeId(0), ravnest_core::LayerRange::new(0, 1))]
        } else {
            Vec::new()
        };
        let e = Event::Planned {
            step: 0,
            workers,
            stages,
            samples: Vec::new(),
        };
        (0, e)
    }

    #[test]
    fn a_nodes_solo_figure_is_its_line_at_the_batch_it_trains() {
        // Measured at 16 each (B / n): 0.1 s + 0.01 s per sample, and 0.3 s + 0.03 s.
        let solo = BTreeMap::from([
            (NodeId(0), line(16.0 / 0.26, 0.01, 0.1)),
            (NodeId(1), line(16.0 / 0.78, 0.03, 0.3)),
        ]);
        // The last plan gives 24 and 8: the fast node does more at 24 than at 16, the slow
        // one less at 8.
        let events = vec![
            planned(vec![(NodeId(0), 16), (NodeId(1), 16)], false),
            planned(vec![(NodeId(0), 24), (NodeId(1), 8)], false),
        ];
        let at = solo_at_batch(&solo, &events);
        assert!((at[&NodeId(0)] - 24.0 / 0.34).abs() < 1e-9);
        assert!((at[&NodeId(1)] - 8.0 / 0.54).abs() < 1e-9);
        // Left out by the plan, or no plan, or a pipeline: the figure at B / n.
        let events = vec![planned(vec![(NodeId(0), 32)], false)];
        assert_eq!(solo_at_batch(&solo, &events)[&NodeId(1)], 16.0 / 0.78);
        assert_eq!(solo_at_batch(&solo, &[])[&NodeId(0)], 16.0 / 0.26);
        let events = vec![planned(vec![(NodeId(0), 24), (NodeId(1), 8)], true)];
        assert_eq!(solo_at_batch(&solo, &events)[&NodeId(0)], 16.0 / 0.26);
    }
}

//! A pipeline run equals single-node training: the node and coordinator actors, over one
//! loopback TCP transport per node, train a real multi-block GPT ([`Network::Gpt`] in candle,
//! through [`CandleCompute`]'s stage forward and backward) as a pipeline of 2 and of 3 stages
//! (1F1B, 4 micro-batches a step) for K steps; every stage's layers, parameters and optimizer
//! state ([`Values::layer_slots`](ravnest_protocol::node::values::Values::layer_slots)), must equal K single-node steps on the same global batches
//! within 1e-4, under AdamW and under SGD with momentum. The coordinator chooses the stage
//! count from the cluster file: each node's `memory_gib` is set so that the model fits no node
//! whole, no pipeline of fewer stages fits, and one of the wanted count does.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ravnest_core::cost::Costs;
use ravnest_core::{LayerRange, NodeId, Optimizer};
use ravnest_protocol::coordinator::Event;
use ravnest_protocol::coordinator::core::{Config, Tuning};
use ravnest_protocol::node::values::Values;
use ravnest_runtime::counters::Counters;
use ravnest_runtime::tcp::LoopbackCluster;
use ravnest_runtime::{Compute, Launch, Nodes};
use ravnest_train::compute::CandleCompute;
use ravnest_train::data::Dataset;
use ravnest_train::gpt::Gpt;
use ravnest_train::net::Network;
use ravnest_train::optim::Optim;
use ravnest_train::worker::ComputeThread;

const STEPS: u64 = 5;
const BATCH: u64 = 8;
const MICRO: u64 = 2;
const TOLERANCE: f32 = 1e-4;
/// The largest relative difference of a slot (parameters, or one optimizer state tensor, of a
/// node's layers): the norm of the difference over the norm of the single-node values.
const RELATIVE: f64 = 1e-5;

/// gpt-tiny's blocks (4, hidden 128, 4 heads, vocabulary 256) on windows of 32 bytes instead
/// of 64, for CI's time.
const GPT: Gpt = Gpt::gpt2(4, 128, 4, 32, 256);

fn optim(kind: Optimizer) -> Optim {
    match kind {
        Optimizer::Adamw => Optim {
            kind,
            lr: 1e-3,
            momentum: 0.9,
            weight_decay: 0.01,
            schedule: ravnest_core::recipe::Schedule::CONSTANT,
        },
        _ => Optim {
            kind,
            lr: 0.05,
            momentum: 0.9,
            weight_decay: 0.0,
            schedule: ravnest_core::recipe::Schedule::CONSTANT,
        },
    }
}

fn optimizer_name(kind: Optimizer) -> &'static str {
    match kind {
        Optimizer::Sgd => "sgd",
        Optimizer::SgdMomentum => "sgd-momentum",
        Optimizer::Adamw => "adamw",
    }
}

/// The cluster file: `nodes` CPU nodes of `memory_gib` each (no reserve), fp32, the GPT.
fn cluster_text(nodes: usize, memory_gib: f64, kind: Optimizer) -> String {
    cluster_of(&vec![memory_gib; nodes], kind, "pipeline")
}

/// The cluster file: a CPU node per entry of `memory_gib` (no reserve), fp32, the GPT, plans
/// of the kind `layout` only.
fn cluster_of(memory_gib: &[f64], kind: Optimizer, layout: &str) -> String {
    let mut t = String::from("[links]\nbandwidth_gbps = 10.0\nlatency_ms = 0.05\n\n");
    for (k, memory_gib) in memory_gib.iter().enumerate() {
        t += &format!(
            "[[node]]\nname = \"n{k}\"\ndevice = \"cpu\"\ntflops = 0.05\nmemory_gib = {memory_gib}\n\n"
        );
    }
    let g = GPT;
    t + &format!(
        "[model]\nkind = \"gpt\"\nlayers = {}\nhidden = {}\nheads = {}\nseq_len = {}\nvocab = {}\n\n\
         [training]\nglobal_batch = {BATCH}\nmicro_batch = {MICRO}\noptimizer = \"{}\"\n\
         precision = \"fp32\"\nmemory_reserve_gib = 0\nlayout = \"{layout}\"\n",
        g.layers,
        g.hidden,
        g.heads,
        g.seq,
        g.vocab,
        optimizer_name(kind)
    )
}

/// The least memory a pipeline of `s` stages needs on every node under the cost model: the
/// best contiguous split's largest stage (stage k keeps (s − k) micro-batches in flight, as
/// the planner charges 1F1B).
fn least_peak(costs: &Costs<'_>, s: usize) -> u64 {
    fn splits(
        at: usize,
        left: usize,
        layers: usize,
        bounds: &mut Vec<usize>,
        f: &mut dyn FnMut(&[usize]),
    ) {
        if left == 1 {
            bounds.push(layers);
            f(bounds);
            bounds.pop();
            return;
        }
        for b in at + 1..=layers - (left - 1) {
            bounds.push(b);
            splits(b, left - 1, layers, bounds, f);
            bounds.pop();
        }
    }
    let m = u64::from(costs.training.micro_batch);
    let mut best = u64::MAX;
    splits(0, s, costs.layers(), &mut vec![0], &mut |b| {
        let peak = (0..s)
            .map(|k| costs.memory_bytes(LayerRange::of_stage(b, k), (s - k) as u64 * m))
            .max()
            .unwrap();
        best = best.min(peak);
    });
    best
}

/// Per-node memory (GiB) under which the model fits no node whole, no pipeline of fewer than
/// `stages` stages fits, and one of `stages` stages does: halfway between the two needs.
fn memory_for(stages: usize, kind: Optimizer) -> f64 {
    // The needs do not depend on the memory: plan them on any cluster of this model.
    let s = ravnest_core::parse(&cluster_text(stages, 1.0, kind), "sizing").unwrap();
    let costs = Costs::new(&s.cluster, &s.model, &s.training);
    let whole = costs.memory_bytes(costs.all(), 1);
    let fewer = (2..stages)
        .map(|k| least_peak(&costs, k))
        .fold(whole, u64::min);
    let need = least_peak(&costs, stages);
    assert!(
        need < fewer,
        "{stages} stages need {need} B, fewer stages {fewer} B: no memory picks {stages}"
    );
    (need + fewer) as f64 / 2.0 / (1u64 << 30) as f64
}

fn dataset() -> Dataset {
    // Enough distinct windows for every step's samples (5 · 8 = 40) in one pass.
    let text = "It was the best of times, it was the worst of times, it was the age of wisdom, \
                it was the age of foolishness, it was the epoch of belief, it was the epoch of \
                incredulity, it was the season of Light, it was the season of Darkness. "
        .repeat(4);
    Dataset::bytes(text.as_bytes(), "dickens.txt", GPT.seq).unwrap()
}

/// A backend for `kind` (every run and the reference start from the same seeded model).
fn backend(kind: Optimizer) -> Arc<CandleCompute> {
    let data = Arc::new(dataset());
    assert!(data.len() as u64 >= STEPS * BATCH, "{} windows", data.len());
    Arc::new(CandleCompute::new(
        Network::Gpt(GPT),
        data,
        optim(kind),
        7,
        1.0,
    ))
}

/// Single-node training: `STEPS` steps on whole global batches (step k reads samples
/// k·B .. (k+1)·B, as `sample_range` numbers them for one replica). It runs on a compute
/// thread, as the backend's own jobs do: candle's CPU workers spin-wait for each other, and a
/// pool started from the (lower-priority) compute thread answers a normal-priority caller
/// slowly on a busy machine.
async fn single_node(kind: Optimizer) -> Vec<f32> {
    let single = backend(kind);
    ComputeThread::default()
        .run(move || {
            let mut model = single.initial_model();
            for k in 0..STEPS {
                let sum = single.gradient_sum_now(k * BATCH..(k + 1) * BATCH, &model);
                let mean: Vec<f32> = sum.iter().map(|g| g / BATCH as f32).collect();
                single.step_now(&mut model, &mean);
            }
            model
        })
        .await
        .expect("the reference was computed")
}

/// Train `STEPS` steps over loopback TCP on a cluster whose memory makes a pipeline of
/// `stages` stages, and compare each stage's layers with `reference`. Returns the largest
/// difference.
async fn pipeline_equals(stages: usize, kind: Optimizer, reference: &[f32]) -> f32 {
    let started = Instant::now();
    let memory_gib = memory_for(stages, kind);
    let s = ravnest_core::parse(&cluster_text(stages, memory_gib, kind), "pipeline-equiv").unwrap();
    let compute = backend(kind);
    let (log, counters) = train_over_tcp(&s, &compute).await;
    let counters = counters.snapshot();
    let planned: Vec<Vec<(NodeId, u64)>> = log
        .events
        .iter()
        .filter_map(|(_, e)| match e {
            Event::Planned { workers, .. } => Some(workers.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(planned.len(), 1, "one plan for the run: {planned:?}");
    assert_eq!(planned[0].len(), stages, "every node works: {planned:?}");
    let held = held_layers(&counters, &compute);
    assert_eq!(
        held.len(),
        stages,
        "the coordinator ran {} stages, not {stages}: {held:?}",
        held.len()
    );
    let worst_all = compare(
        &held,
        &counters,
        &compute,
        reference,
        &format!("{stages} stages, {kind:?}"),
    );
    eprintln!(
        "{stages} stages, {kind:?}: {memory_gib:.5} GiB per node; max difference \
         {worst_all:e}; trained in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    worst_all
}

/// Train `STEPS` steps of the cluster `s` over loopback TCP (a transport per node), every
/// node computing with `compute`; the run's journal and each node's counters (with what it
/// made last observed), after checking that it ran clean.
async fn train_over_tcp(
    s: &ravnest_core::Scenario,
    compute: &Arc<CandleCompute>,
) -> (ravnest_runtime::coordinator::RunLog, Counters) {
    let nodes_n = s.cluster.nodes.len();
    assert_eq!(
        compute.net.model_spec(),
        s.model,
        "the file describes the network trained"
    );
    assert!(compute.runs_stages());
    let ids: Vec<NodeId> = (0..nodes_n as u32).map(NodeId).collect();
    let tcp = LoopbackCluster::start(nodes_n as u32, b"pipeline-equivalence")
        .await
        .unwrap();
    let counters = Counters::default();
    let launch = Launch::new(tcp.clone()).at(tokio::time::Instant::now());
    let nodes = Nodes::new(compute.clone(), ids.clone(), 4 * compute.model_len() as u64)
        .grad_bytes(4 * compute.params() as u64)
        .heartbeat(Duration::from_millis(50))
        .observe()
        .counters(counters.clone());
    let sup = launch.nodes(nodes).await.unwrap();
    let costs = Costs::new(&s.cluster, &s.model, &s.training);
    let config = Config {
        heartbeat_timeout_ms: 10_000,
        train_flops: costs.train_flops(costs.all()),
        allow_pipeline: compute.runs_stages(),
        tuning: Tuning {
            measure_min_batch: u64::MAX,
            ..Tuning::default()
        },
        ..Config::new(
            s.cluster.clone(),
            s.model.clone(),
            s.training.clone(),
            STEPS,
        )
    };
    let (coord, done_rx) = launch
        .coordinator(config, Duration::from_millis(50))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(120), done_rx)
        .await
        .expect("training finished")
        .unwrap();
    coord.stop(None);
    sup.stop(None);
    let sent: Vec<u64> = tcp.nodes.values().map(|t| t.bytes_sent()).collect();
    for t in tcp.nodes.values() {
        t.shutdown();
    }

    let log = launch.journal().snapshot();
    for (_, e) in &log.events {
        assert!(
            !matches!(
                e,
                Event::Violation(_) | Event::Stalled(_) | Event::Aborted { .. }
            ),
            "{e:?}"
        );
    }
    assert_eq!(log.step_done_ns.len() as u64, STEPS);
    assert!(sent.iter().all(|&b| b > 0), "every node sent: {sent:?}");
    (log, counters)
}

/// What each node held whole at the end (a stage's layers, a sharded worker's part), from
/// what it made: the parameter range its versions apply to is a run of whole layers, smaller
/// than the model. Sorted by layer, checked to tile the model.
fn held_layers(
    counters: &std::collections::BTreeMap<NodeId, ravnest_runtime::counters::NodeCounters>,
    compute: &CandleCompute,
) -> Vec<(NodeId, LayerRange)> {
    let params = compute.params();
    let ranges = GPT.layer_ranges();
    let mut held: Vec<(NodeId, LayerRange)> = Vec::new();
    for (id, c) in counters.iter() {
        assert_eq!(c.version, STEPS, "node {id:?} version");
        let o = c.observed.as_ref().expect("observed");
        assert_eq!(o.version, STEPS, "node {id:?} observed version");
        let r = o.slots[0].clone();
        assert!(
            r.len() < params,
            "node {id:?} holds only its layers, not the whole model: {r:?}"
        );
        let lo = ranges.iter().position(|x| x.start == r.start);
        let hi = ranges.iter().position(|x| x.end == r.end);
        let (Some(lo), Some(hi)) = (lo, hi) else {
            panic!("node {id:?}: {r:?} is not a run of whole layers");
        };
        held.push((*id, LayerRange::from(lo..hi + 1)));
    }
    held.sort_by_key(|h| h.1.range().start);
    let mut at = 0;
    for (id, l) in &held {
        assert_eq!(
            l.range().start,
            at,
            "node {id:?}: layers {l} leave a gap or overlap"
        );
        at = l.range().end;
    }
    assert_eq!(
        at,
        GPT.planner_layers(),
        "every layer is held by a node: {held:?}"
    );
    held
}

/// Each node's layers, parameters and optimizer state, against single-node training: the
/// largest difference (each within [`TOLERANCE`]).
fn compare(
    held: &[(NodeId, LayerRange)],
    counters: &std::collections::BTreeMap<NodeId, ravnest_runtime::counters::NodeCounters>,
    compute: &CandleCompute,
    reference: &[f32],
    what: &str,
) -> f32 {
    let mut worst_all = 0.0f32;
    for (id, l) in held {
        let o = counters[id].observed.as_ref().expect("observed");
        let slots: Vec<Range<usize>> = compute.layer_slots(*l);
        assert_eq!(slots, o.slots, "node {id:?} exports its layers' slots");
        assert_eq!(slots[0], compute.param_range(*l));
        let (mut worst, mut worst_rel, mut values) = (0.0f32, 0.0f64, 0usize);
        for r in &slots {
            let held = o.range(r.clone()).expect("held");
            let (mut diff, mut norm) = (0.0f64, 0.0f64);
            for (a, b) in held.iter().zip(&reference[r.clone()]) {
                worst = worst.max((a - b).abs());
                diff += f64::from(a - b).powi(2);
                norm += f64::from(*b).powi(2);
            }
            if norm > 0.0 {
                worst_rel = worst_rel.max((diff / norm).sqrt());
            }
            values += r.len();
        }
        eprintln!(
            "{what}: node {id:?} layers {l}: {values} values (parameters and optimizer \
             state), max |distributed - single| = {worst:e}, largest relative difference of a \
             slot (|a - b| / |b| over its values) {worst_rel:e}"
        );
        assert!(
            worst < TOLERANCE,
            "node {id:?} layers {l}: max |distributed - single| = {worst}"
        );
        assert!(
            worst_rel < RELATIVE,
            "node {id:?} layers {l}: relative difference {worst_rel}"
        );
        worst_all = worst_all.max(worst);
    }
    worst_all
}

/// Sharded data parallel over 3 nodes of three memory sizes: each holds every weight and the
/// optimizer state of a part of the layers sized by its memory (three different sizes), and
/// its part, parameters and optimizer state, equals single-node training.
async fn sharded_equals(kind: Optimizer, reference: &[f32]) -> f32 {
    let started = Instant::now();
    let sizing = ravnest_core::parse(&cluster_of(&[1.0; 3], kind, "sharded"), "sizing").unwrap();
    let costs = Costs::new(&sizing.cluster, &sizing.model, &sizing.training);
    let all = costs.all();
    // Room for 30%, 80% and 55% of the optimizer state beside the weights, the gradient and
    // one sample's activations (workers accumulate): parts of three sizes, and the whole fits
    // no node.
    let base = costs.shard_memory_bytes(LayerRange::from(0..0), 1);
    let state =
        costs.shard_memory_bytes(all, 0) - costs.shard_memory_bytes(LayerRange::from(0..0), 0);
    let gib = |share: f64| (base as f64 + state as f64 * share) / (1u64 << 30) as f64;
    let memory = [gib(0.3), gib(0.8), gib(0.55)];
    assert!(costs.memory_bytes(all, 1) as f64 > gib(0.8) * (1u64 << 30) as f64);
    let s = ravnest_core::parse(&cluster_of(&memory, kind, "sharded"), "sharded-equiv").unwrap();
    let compute = backend(kind);
    let (log, counters) = train_over_tcp(&s, &compute).await;
    let counters = counters.snapshot();
    let planned = log
        .events
        .iter()
        .filter(|(_, e)| matches!(e, Event::Planned { .. }))
        .count();
    assert_eq!(planned, 1, "one plan for the run");
    let held = held_layers(&counters, &compute);
    assert_eq!(held.len(), 3, "a part per node: {held:?}");
    let sizes: std::collections::BTreeSet<usize> = held
        .iter()
        .map(|(_, l)| compute.param_range(*l).len())
        .collect();
    assert_eq!(sizes.len(), 3, "parts of three sizes: {held:?}");
    let worst = compare(
        &held,
        &counters,
        &compute,
        reference,
        &format!("sharded, {kind:?}"),
    );
    eprintln!(
        "sharded, {kind:?}: parts {held:?} on {memory:?} GiB; max difference {worst:e}; \
         trained in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    worst
}

/// Pipelines of 2 and of 3 stages under `kind` against one single-node reference.
fn pipelines_equal_single_node(kind: Optimizer) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let t = Instant::now();
        let reference = single_node(kind).await;
        // The weights moved: the comparison is not of two untouched models.
        let init = backend(kind);
        let moved = reference[..init.params()]
            .iter()
            .zip(&init.initial_model())
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(
            moved > 10.0 * TOLERANCE,
            "training moved the weights by {moved}"
        );
        eprintln!(
            "{kind:?}: single-node reference in {:.1} s (weights moved up to {moved:e})",
            t.elapsed().as_secs_f64()
        );
        pipeline_equals(2, kind, &reference).await;
        pipeline_equals(3, kind, &reference).await;
        sharded_equals(kind, &reference).await;
    });
}

#[test]
fn adamw_pipelines_equal_single_node_training() {
    pipelines_equal_single_node(Optimizer::Adamw);
}

#[test]
fn sgd_momentum_pipelines_equal_single_node_training() {
    pipelines_equal_single_node(Optimizer::SgdMomentum);
}

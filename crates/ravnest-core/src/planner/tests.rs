//! Planner-level properties on random small clusters, against the exhaustive oracle.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::cluster::{Link, NodeId, NodeSpec, SyncPreference};
use crate::model::{LayerSpec, Optimizer, Precision};

#[derive(Debug, Clone)]
struct Instance {
    cluster: ClusterSpec,
    model: ModelSpec,
    training: TrainingSpec,
}

fn instance(max_nodes: usize) -> impl Strategy<Value = Instance> {
    let node = (
        1u32..40,
        1u32..40,
        prop_oneof![Just(0.1f64), Just(1.0), Just(10.0), Just(100.0)],
        0u32..20,
    );
    let layer = (1u64..400, 1u32..50, 0u64..200, 1u64..50);
    (
        prop::collection::vec(node, 1..=max_nodes),
        prop::collection::vec(layer, 1..7),
        1u32..96,
        1u32..8,
        prop_oneof![Just(Optimizer::Sgd), Just(Optimizer::Adamw)],
        prop_oneof![
            Just(SyncPreference::Auto),
            Just(SyncPreference::Ring),
            Just(SyncPreference::ParamServer)
        ],
        prop::collection::vec((0u32..6, 0u32..6, 1u32..100), 0..3),
    )
        .prop_map(
            |(nodes, layers, global_batch, micro_batch, optimizer, sync, pairs)| {
                let n = nodes.len() as u32;
                let cluster = ClusterSpec {
                    name: "random".into(),
                    nodes: nodes
                        .iter()
                        .enumerate()
                        .map(|(i, &(mem, tf, bw, lat))| NodeSpec {
                            name: format!("n{i}"),
                            device: "cpu".into(),
                            // memory in units of 4 KiB so small models hit the limits sometimes
                            memory_bytes: u64::from(mem) * 4096,
                            flops: f64::from(tf) * 1e9,
                            link: Link {
                                bandwidth_gbps: bw,
                                latency_ms: f64::from(lat) / 10.0,
                            },
                            step_overhead_s: 0.0,
                            compute_spread: 0.0,
                            address: None,
                            listen: None,
                        })
                        .collect(),
                    pair_links: pairs
                        .into_iter()
                        .filter(|(a, b, _)| a != b && *a < n && *b < n)
                        .map(|(a, b, bw)| {
                            (
                                (NodeId(a.min(b)), NodeId(a.max(b))),
                                Link {
                                    bandwidth_gbps: f64::from(bw) / 10.0,
                                    latency_ms: 0.5,
                                },
                            )
                        })
                        .collect::<BTreeMap<_, _>>(),
                };
                let model = ModelSpec {
                    name: "random".into(),
                    layers: layers
                        .iter()
                        .enumerate()
                        .map(|(i, &(params, mflops, act, out))| LayerSpec {
                            name: format!("l{i}"),
                            params: params * 16,
                            fwd_flops_per_sample: f64::from(mflops) * 1e6,
                            activation_elems_per_sample: act * 8,
                            output_elems_per_sample: out * 64,
                        })
                        .collect(),
                };
                let training = TrainingSpec {
                    global_batch,
                    micro_batch,
                    optimizer,
                    precision: Precision::Fp32,
                    sync,
                    local_sgd_threshold: 1.0,
                    accumulate: true,
                    ..TrainingSpec::default()
                };
                Instance {
                    cluster,
                    model,
                    training,
                }
            },
        )
}

fn check_plan(inst: &Instance, p: &Plan) -> Result<(), TestCaseError> {
    let b = u64::from(inst.training.global_batch);
    prop_assert_eq!(p.nodes.len(), inst.cluster.nodes.len());
    for n in &p.nodes {
        prop_assert!(
            n.memory_bytes <= n.memory_limit_bytes,
            "{} over memory: {} > {}",
            n.name,
            n.memory_bytes,
            n.memory_limit_bytes
        );
        prop_assert!(n.idle_s >= 0.0 && n.compute_s >= 0.0 && n.comm_s >= 0.0);
        prop_assert!(
            n.compute_s + n.comm_s <= p.step.step_s * (1.0 + 1e-9) + 1e-12,
            "{} busy longer than the step",
            n.name
        );
    }
    match &p.layout {
        Layout::DataParallel { .. } => {
            let sum: u64 = p.nodes.iter().map(|n| n.batch).sum();
            prop_assert_eq!(sum, b);
            let w: f64 = p.nodes.iter().map(|n| n.grad_weight).sum();
            prop_assert!((w - 1.0).abs() < 1e-9, "gradient weights sum to {w}");
        }
        Layout::Pipeline {
            stages,
            replicas,
            bounds,
            ..
        } => {
            prop_assert_eq!(bounds.len(), stages + 1);
            let stage0: u64 = p
                .nodes
                .iter()
                .filter(|n| matches!(n.role, Role::Stage { stage: 0, .. }))
                .map(|n| n.batch)
                .sum();
            prop_assert_eq!(stage0, b);
            for k in 0..*stages {
                let holders = p
                    .nodes
                    .iter()
                    .filter(|n| matches!(n.role, Role::Stage { stage, .. } if stage == k))
                    .count();
                prop_assert_eq!(holders, *replicas);
            }
        }
        Layout::Sharded { workers, bounds } => {
            let sum: u64 = p.nodes.iter().map(|n| n.batch).sum();
            prop_assert_eq!(sum, b);
            prop_assert_eq!(bounds.len(), workers + 1);
            // Every worker owns one non-empty part; the parts tile the layers.
            let mut parts: Vec<(usize, usize)> = p
                .nodes
                .iter()
                .filter(|n| n.batch > 0)
                .map(|n| n.layers.expect("a part").range())
                .map(|r| (r.start, r.end))
                .collect();
            parts.sort_unstable();
            prop_assert_eq!(parts.len(), *workers);
            let mut at = 0;
            for (a, z) in parts {
                prop_assert!(a == at && z > a, "parts {:?} do not tile", bounds);
                at = z;
            }
            prop_assert_eq!(at, inst.model.layers.len());
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    /// Every plan is well-formed; ravnest is never predicted slower than `uniform` or
    /// `param-count`; `exhaustive` is never beaten.
    #[test]
    fn ravnest_beats_baselines_and_exhaustive_beats_everyone(inst in instance(4)) {
        let plan_of = |k| plan(k, &inst.cluster, &inst.model, &inst.training);
        let ours = plan_of(PlannerKind::Ravnest);
        let oracle = plan_of(PlannerKind::Exhaustive);
        match (&ours, &oracle) {
            (Err(PlanError::ModelFitsNowhere { .. }), Err(PlanError::ModelFitsNowhere { .. })) => {}
            (Ok(o), Ok(x)) => {
                check_plan(&inst, o)?;
                check_plan(&inst, x)?;
                prop_assert!(x.objective_s() <= o.objective_s() * (1.0 + 1e-9), "exhaustive {} > ravnest {}", x.objective_s(), o.objective_s());
                for k in [PlannerKind::Uniform, PlannerKind::ParamCount] {
                    if let Ok(base) = plan_of(k) {
                        check_plan(&inst, &base)?;
                        prop_assert!(o.objective_s() <= base.objective_s() * (1.0 + 1e-9), "ravnest {} > {k} {}", o.objective_s(), base.objective_s());
                        prop_assert!(x.objective_s() <= base.objective_s() * (1.0 + 1e-9));
                    }
                }
            }
            _ => prop_assert!(false, "ravnest {:?} vs exhaustive {:?}", ours.as_ref().map(Plan::objective_s), oracle.as_ref().map(Plan::objective_s)),
        }
    }

    /// Plans are pure functions of their input.
    #[test]
    fn planning_is_deterministic(inst in instance(6)) {
        let a = plan(PlannerKind::Ravnest, &inst.cluster, &inst.model, &inst.training);
        let b = plan(PlannerKind::Ravnest, &inst.cluster, &inst.model, &inst.training);
        prop_assert_eq!(a, b);
    }
}

fn node(name: &str, tflops: f64, mem_gib: f64) -> NodeSpec {
    NodeSpec {
        name: name.into(),
        device: "cpu".into(),
        memory_bytes: (mem_gib * GIB) as u64,
        flops: tflops * 1e12,
        link: Link {
            bandwidth_gbps: 10.0,
            latency_ms: 0.1,
        },
        step_overhead_s: 0.0,
        compute_spread: 0.0,
        address: None,
        listen: None,
    }
}

#[test]
fn one_slow_node_gets_a_third_of_the_share() {
    let cluster = ClusterSpec {
        name: "t".into(),
        nodes: vec![
            node("fast0", 30.0, 20.0),
            node("fast1", 30.0, 20.0),
            node("slow", 10.0, 20.0),
        ],
        pair_links: BTreeMap::new(),
    };
    let model = crate::model::preset("mlp-digits").unwrap().build();
    // The model is tiny, so its rounds are local SGD: DiLoCo's int8 rounds keep their cost
    // (the parameters and the momentum) below what the slow node adds; plain fp32 averaging
    // of all that state would leave it out. (With AdamW inside, rounds are fp32: its second
    // moments do not survive int8.)
    let training = TrainingSpec {
        global_batch: 700,
        optimizer: crate::model::Optimizer::SgdMomentum,
        outer: crate::cluster::OuterSpec {
            optimizer: crate::cluster::OuterOptimizer::Nesterov,
            ..Default::default()
        },
        ..TrainingSpec::default()
    };
    let p = plan(PlannerKind::Ravnest, &cluster, &model, &training).unwrap();
    let b: Vec<u64> = p.nodes.iter().map(|n| n.batch).collect();
    assert_eq!(b, vec![300, 300, 100]);
    let u = plan(PlannerKind::Uniform, &cluster, &model, &training).unwrap();
    assert!(
        u.step.compute_s / p.step.compute_s > 1.7,
        "{} vs {}",
        u.step.compute_s,
        p.step.compute_s
    );
}

#[test]
fn a_model_too_big_for_every_node_is_pipelined() {
    let cluster = ClusterSpec {
        name: "t".into(),
        nodes: (0..4).map(|i| node(&format!("n{i}"), 30.0, 23.0)).collect(),
        pair_links: BTreeMap::new(),
    };
    let model = crate::model::preset("gpt-1.3b").unwrap().build();
    let training = TrainingSpec {
        global_batch: 32,
        micro_batch: 1,
        ..TrainingSpec::default()
    };
    let p = plan(PlannerKind::Ravnest, &cluster, &model, &training).unwrap();
    assert!(
        matches!(p.layout, Layout::Pipeline { .. }),
        "{:?}",
        p.layout
    );
}

#[test]
fn a_model_that_fits_nowhere_says_how_much_it_needs() {
    let cluster = ClusterSpec {
        name: "t".into(),
        nodes: vec![node("small", 10.0, 2.0)],
        pair_links: BTreeMap::new(),
    };
    let model = crate::model::preset("gpt-7b").unwrap().build();
    let err = plan(
        PlannerKind::Ravnest,
        &cluster,
        &model,
        &TrainingSpec::default(),
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("fits nowhere") && msg.contains("`small` has 2.0 GiB"),
        "{msg}"
    );
}

/// Ours ÷ the oracle on generated clusters (`RAVNEST_ORACLE_CASES`, default 60), printed.
#[test]
#[ignore = "measurement; run by hand"]
fn measure_against_oracle() {
    let cases: u64 = std::env::var("RAVNEST_ORACLE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let mut ratios = Vec::new();
    for seed in 0..cases {
        let c = random::random_case(seed);
        let t0 = std::time::Instant::now();
        let ours = plan(PlannerKind::Ravnest, &c.cluster, &c.model, &c.training);
        let t1 = t0.elapsed();
        let oracle = plan(PlannerKind::Exhaustive, &c.cluster, &c.model, &c.training);
        let t2 = t0.elapsed() - t1;
        let r = match (&ours, &oracle) {
            (Ok(o), Ok(x)) => o.objective_s() / x.objective_s(),
            (Err(_), Ok(_)) => f64::INFINITY,
            _ => continue,
        };
        if r > 1.01 {
            println!(
                "seed {seed}: n={} {} b={} m={} ratio {r:.3} ours {:?} oracle {:?} ({:?} / {:?})",
                c.cluster.nodes.len(),
                c.model.name,
                c.training.global_batch,
                c.training.micro_batch,
                ours.as_ref().map(|p| p.split_line()),
                oracle.as_ref().map(|p| p.split_line()),
                t1,
                t2
            );
        }
        ratios.push(r);
    }
    println!("{:?}", random::summarize(&ratios));
}

/// One generated case in detail, ravnest's plan next to the oracle's (`SEED=N`).
#[test]
#[ignore = "inspection; run by hand"]
fn show_case_against_oracle() {
    let seed: u64 = std::env::var("SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let c = random::random_case(seed);
    for n in &c.cluster.nodes {
        println!(
            "{} {:.2e} {} {:?}",
            n.name,
            n.flops,
            n.memory_bytes >> 20,
            n.link
        );
    }
    println!("{:?}", c.cluster.pair_links);
    for k in [PlannerKind::Ravnest, PlannerKind::Exhaustive] {
        let p = plan(k, &c.cluster, &c.model, &c.training).unwrap();
        println!(
            "{k}: {} {:?} {:?} {:?}",
            p.split_line(),
            p.step,
            p.layout,
            p.sync.method
        );
    }
}

/// Generated cases per run of the oracle property (`RAVNEST_ORACLE_CASES`): each plans a
/// cluster of up to 8 nodes exhaustively (up to a second or two on 8 nodes).
fn oracle_cases() -> u32 {
    std::env::var("RAVNEST_ORACLE_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12)
}

/// The same cluster with its nodes in another order (pair links follow their nodes).
fn permuted(c: &random::Case, perm: &[usize]) -> random::Case {
    let mut out = c.clone();
    out.cluster.nodes = perm.iter().map(|&i| c.cluster.nodes[i].clone()).collect();
    let new_id = |old: NodeId| NodeId(perm.iter().position(|&i| i == old.index()).unwrap() as u32);
    out.cluster.pair_links = c
        .cluster
        .pair_links
        .iter()
        .map(|(&(a, b), &l)| {
            let (x, y) = (new_id(a), new_id(b));
            ((x.min(y), x.max(y)), l)
        })
        .collect();
    out
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: oracle_cases(),
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x0ac1e),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// On generated clusters (2-8 nodes of catalog GPUs and CPUs, slow pairs, tight memory;
    /// `planner::random`), ravnest's step is within 1% of the exhaustive oracle's, which
    /// searches every data-parallel subset and every arrangement of nodes into stages and
    /// replicas with every layer split. Fails with the case's seed (`ravnest bench planners
    /// --random 1 --seed SEED` replays it).
    #[test]
    fn ravnest_is_within_one_percent_of_the_oracle(seed in any::<u64>()) {
        let c = random::random_case(seed);
        let ours = plan(PlannerKind::Ravnest, &c.cluster, &c.model, &c.training);
        let oracle = plan(PlannerKind::Exhaustive, &c.cluster, &c.model, &c.training);
        match (&ours, &oracle) {
            (Ok(o), Ok(x)) => {
                let ratio = o.objective_s() / x.objective_s();
                prop_assert!(ratio <= 1.01, "seed {seed}: ravnest {} vs oracle {}: {ratio:.4}x", o.split_line(), x.split_line());
            }
            (Err(_), Err(_)) => {}
            _ => prop_assert!(false, "seed {seed}: ravnest {:?} vs oracle {:?}", ours.as_ref().map(Plan::objective_s), oracle.as_ref().map(Plan::objective_s)),
        }
    }

    /// The plan does not depend on the order of the nodes in the file: the same step time, and
    /// the same work for every node, by name.
    #[test]
    fn the_plan_does_not_depend_on_node_order(seed in any::<u64>(), rot in 1usize..8, rev in any::<bool>()) {
        let c = random::random_case(seed);
        let n = c.cluster.nodes.len();
        let mut perm: Vec<usize> = (0..n).map(|i| (i + rot) % n).collect();
        if rev {
            perm.reverse();
        }
        let p = permuted(&c, &perm);
        let a = plan(PlannerKind::Ravnest, &c.cluster, &c.model, &c.training);
        let b = plan(PlannerKind::Ravnest, &p.cluster, &p.model, &p.training);
        match (&a, &b) {
            (Ok(a), Ok(b)) => {
                let rel = (a.objective_s() - b.objective_s()).abs() / a.objective_s();
                prop_assert!(rel < 1e-9, "seed {seed}, order {perm:?}: {} vs {}", a.objective_s(), b.objective_s());
            }
            (Err(_), Err(_)) => {}
            _ => prop_assert!(false, "seed {seed}, order {perm:?}: one order plans, the other not"),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 24,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x51e9),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// The exact single-pipeline search equals brute force: every ordered choice of 2 or more
    /// of the nodes, every layer split (the layer DP's split above the oracle's budget, exact
    /// for one replica), each evaluated by the cost model. Generated clusters of up to 6
    /// nodes, pipelines allowed.
    #[test]
    fn the_exact_single_pipeline_is_the_best_over_every_order(seed in any::<u64>()) {
        let c = random::random_case(seed);
        prop_assume!(c.cluster.nodes.len() <= 6);
        let costs = crate::cost::Costs::new(&c.cluster, &c.model, &c.training);
        let mut exact = choice::Best::new(LayoutClass::OnePipeline);
        exact::exact_single_pipeline(&costs, &mut exact);
        let mut brute = choice::Best::new(LayoutClass::OnePipeline);
        let ids: Vec<NodeId> = c.cluster.ids().collect();
        for s in 2..=ids.len().min(costs.layers()) {
            let all = layers::count_splits(costs.layers(), s) <= EXHAUSTIVE_MAX_SPLITS;
            let mut pools = Vec::new();
            pipes::subsets(&ids, s, 0, &mut Vec::new(), &mut pools);
            for mut pool in pools {
                pipes::permutations(&mut pool, 0, &mut |row: &[NodeId]| {
                    pipes::search_grid(&costs, vec![row.to_vec()], all, &mut brute);
                });
            }
        }
        let (exact, brute) = (exact.into_plan(), brute.into_plan());
        match (&exact, &brute) {
            (Some(e), Some(b)) => {
                let rel = (e.objective_s() - b.objective_s()).abs() / b.objective_s();
                prop_assert!(rel < 1e-9, "seed {seed}: exact {} ({}) vs brute force {} ({})",
                    e.objective_s(), e.split_line(), b.objective_s(), b.split_line());
            }
            (None, None) => {}
            _ => prop_assert!(false, "seed {seed}: exact {:?} vs brute force {:?}",
                exact.as_ref().map(Plan::objective_s), brute.as_ref().map(Plan::objective_s)),
        }
    }
}

/// A memory-bound cluster where the best pipeline needs five stages, two of them on nodes with
/// a few GiB, and leaves out a 23 GiB node on a 0.1 Gbit/s link (generated case 10064): the
/// heuristic stage orders found a plan 2.01x slower than the oracle's.
#[test]
fn a_five_stage_pipeline_over_small_nodes_matches_the_oracle() {
    let c = random::random_case(10064);
    let ours = plan(PlannerKind::Ravnest, &c.cluster, &c.model, &c.training).unwrap();
    let oracle = plan(PlannerKind::Exhaustive, &c.cluster, &c.model, &c.training).unwrap();
    let ratio = ours.objective_s() / oracle.objective_s();
    assert!(
        ratio <= 1.0 + 1e-9,
        "{ratio}: {} vs {}",
        ours.split_line(),
        oracle.split_line()
    );
}

/// One GPU whose memory holds the model and a few samples, not the global batch: it trains
/// the whole batch in micro-batches, gradients accumulated (it used to "fit nowhere" while the
/// message said it needed 3.6 GiB of its 11). The equal-split baseline computes each batch at
/// once, as configured, and does not fit.
#[test]
fn a_batch_too_big_for_memory_is_accumulated_over_micro_batches() {
    let cluster = ClusterSpec {
        name: "t".into(),
        nodes: vec![node("g", 12.7, 11.0)],
        pair_links: BTreeMap::new(),
    };
    let model = crate::model::preset("gpt2-small").unwrap().build();
    let training = TrainingSpec {
        global_batch: 64,
        micro_batch: 4,
        ..TrainingSpec::default()
    };
    assert!(plan(PlannerKind::Uniform, &cluster, &model, &training).is_err());
    for kind in [PlannerKind::Ravnest, PlannerKind::Exhaustive] {
        let p = plan(kind, &cluster, &model, &training).unwrap();
        let g = &p.nodes[0];
        assert_eq!(g.batch, 64, "{kind}");
        assert!(g.micro_batches > 1, "{kind}: {g:?}");
        assert!(g.memory_bytes <= g.memory_limit_bytes, "{kind}: {g:?}");
        // Whole micro-batches of at most what fits: one sample more per micro-batch does not.
        let costs = crate::cost::Costs::new(&cluster, &model, &training);
        let per = 64u64.div_ceil(g.micro_batches);
        assert_eq!(
            g.memory_bytes,
            costs.memory_bytes(costs.all(), per),
            "{kind}"
        );
        let fewer = 64u64.div_ceil(g.micro_batches - 1);
        assert!(
            costs.memory_bytes(costs.all(), fewer) > g.memory_limit_bytes,
            "{kind}"
        );
    }
}

/// 8x RTX 2080 + 8x RTX 3090 + 8x Titan RTX training OPT-350M (sequence 2048) at micro-batch 8:
/// no pipeline holds eight samples in flight per micro-batch, so the planner tries smaller
/// micro-batches and keeps the fastest that fits (it used to say "fits nowhere").
#[test]
fn a_smaller_micro_batch_is_tried_when_the_files_fits_nowhere() {
    let text = "[links]\nbandwidth_gbps = 10.0\nlatency_ms = 0.2\n\
        [[node]]\nname = \"a\"\ndevice = \"rtx2080\"\ncount = 8\n\
        [[node]]\nname = \"b\"\ndevice = \"rtx3090\"\ncount = 8\n\
        [[node]]\nname = \"c\"\ndevice = \"titan-rtx\"\ncount = 8\n\
        [model]\npreset = \"opt-350m\"\n\
        [training]\nglobal_batch = 256\nmicro_batch = 8\noptimizer = \"adamw\"\n";
    let s = crate::config::parse(text, "opt24").unwrap();
    let at_8 = plan_at(
        PlannerKind::Ravnest,
        &s.cluster,
        &s.model,
        &s.training,
        PlanOptions::default(),
    );
    // Only sharded data parallel fits at 8: its workers accumulate one sample at a time.
    let at_8 = at_8.unwrap();
    assert!(
        matches!(at_8.layout, Layout::Sharded { .. }),
        "{:?}",
        at_8.layout
    );
    let p = plan(PlannerKind::Ravnest, &s.cluster, &s.model, &s.training).unwrap();
    assert!(p.objective_s() < at_8.objective_s());
    let Layout::Pipeline { micro_batch, .. } = p.layout else {
        panic!("{:?}", p.layout)
    };
    assert!(micro_batch < 8);
    assert!(
        p.notes
            .iter()
            .any(|n| n.contains("instead of the file's 8")),
        "{:?}",
        p.notes
    );
    for n in &p.nodes {
        assert!(n.memory_bytes <= n.memory_limit_bytes, "{n:?}");
    }
    // The fastest of the halvings: none of the others is faster.
    for m in [1, 2, 4] {
        let t = TrainingSpec {
            micro_batch: m,
            ..s.training.clone()
        };
        if let Ok(q) = plan_at(
            PlannerKind::Ravnest,
            &s.cluster,
            &s.model,
            &t,
            PlanOptions::default(),
        ) {
            assert!(
                q.objective_s() >= p.objective_s(),
                "micro-batch {m}: {} < {}",
                q.objective_s(),
                p.objective_s()
            );
        }
    }
}

/// Issue 34's second case: one H100 holds a 1.3B GPT (bf16, SGD, batch 512) alone, and the only
/// other card that holds it, an RTX 4090, sits behind a 0.66 Gbit/s link. Two working copies
/// cost a ring over that link every step (the step more than doubles); a lost H100 costs a
/// restore of half a checkpoint interval, about 0.03% of a step at one loss per 1000 h. Under
/// `auto` the H100 trains alone and the plan prices the second copy; under `always`, two
/// copies; under `never`, the H100 alone.
#[test]
fn a_second_copy_behind_a_slow_link_is_priced_not_imposed() {
    let text = |redundancy: &str| {
        format!(
            "[links]\nbandwidth_gbps = 100.0\nlatency_ms = 0.1\n\
             [[node]]\nname = \"h100\"\ndevice = \"h100\"\n\
             [[node]]\nname = \"rtx4090\"\ndevice = \"rtx4090\"\nbandwidth_gbps = 0.66\nlatency_ms = 5.0\n\
             [[node]]\nname = \"rtx3060\"\ndevice = \"rtx3060\"\n\
             [model]\npreset = \"gpt-1.3b\"\n\
             [training]\nglobal_batch = 512\nmicro_batch = 4\nprecision = \"bf16\"\n\
             optimizer = \"sgd\"\nredundancy = \"{redundancy}\"\n"
        )
    };
    let plan_of = |r: &str| {
        let s = crate::config::parse(&text(r), "case2").unwrap();
        plan_scenario(PlannerKind::Ravnest, &s).unwrap()
    };
    let workers = |p: &Plan| -> Vec<String> {
        p.nodes
            .iter()
            .filter(|n| n.batch > 0)
            .map(|n| n.name.clone())
            .collect()
    };
    let auto = plan_of("auto");
    println!("{}: {:?}", auto.split_line(), auto.recovery);
    assert_eq!(workers(&auto), ["h100"], "{}", auto.split_line());
    assert_eq!(auto.recovery.kind, RecoveryKind::Restore);
    let two = auto
        .alternatives
        .iter()
        .find(|a| a.class == LayoutClass::DataParallel)
        .expect("the two-copy plan is reported");
    println!("{two:?}");
    assert!(two.step.step_s > 2.0 * auto.step.step_s, "{two:?}");
    assert!(auto.recovery.per_step_s < 0.001 * auto.step.step_s);
    assert!(two.why.contains("more"), "{}", two.why);
    let always = plan_of("always");
    assert_eq!(
        workers(&always),
        ["h100", "rtx4090"],
        "{}",
        always.split_line()
    );
    assert_eq!(always.recovery.kind, RecoveryKind::Replan);
    let alone = always
        .alternatives
        .iter()
        .find(|a| a.class == LayoutClass::OneWorker)
        .expect("the one-copy plan is reported");
    assert!(alone.why.contains("always"), "{}", alone.why);
    let never = plan_of("never");
    assert_eq!(workers(&never), ["h100"]);
    assert!(!never.recovery.charged);
}

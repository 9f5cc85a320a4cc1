use super::*;

/// Three CPU nodes (two fast, one 3x slower) training the wide digits MLP: the shape the
/// figures below describe.
const SCENARIO: &str = r#"
[cluster]
name = "local-digits"
secret = "local-demo-secret"

[[node]]
name = "fast-a"
device = "cpu"
address = "127.0.0.1:47701"

[[node]]
name = "fast-b"
device = "cpu"
address = "127.0.0.1:47702"

[[node]]
name = "slow"
device = "cpu"
address = "127.0.0.1:47703"
emulate_slowdown = 3.0

[model]
kind = "mlp"
name = "mlp-digits-wide"
dims = [64, 512, 512, 10]

[training]
global_batch = 384
optimizer = "sgd-momentum"
sync = "ring"

[run]
steps = 200
learning_rate = 0.05
momentum = 0.9
seed = 1
dataset = "digits"
"#;

fn scenario() -> Scenario {
    crate::parse(SCENARIO, "local-digits.toml").unwrap()
}

fn link(bandwidth_gbps: f64, latency_ms: f64) -> Link {
    Link {
        bandwidth_gbps,
        latency_ms,
    }
}

/// Steps 20..40 of a node that computes `fixed + batch × per_sample` seconds, times `k`.
fn steps(
    batch: u64,
    (per_sample, fixed): (f64, f64),
    k: f64,
    comm_s: f64,
    gap: f64,
) -> Vec<StepSample> {
    (21..=40)
        .map(|v| {
            let compute_s = k * (fixed + batch as f64 * per_sample);
            StepSample {
                version: v,
                batch,
                compute_s,
                comm_s,
                period_s: compute_s + comm_s + gap,
            }
        })
        .collect()
}

fn run() -> RunFigures {
    let fast = (35e-6, 1.5e-3);
    let slow = (180e-6, 6.7e-3);
    let node = |name: &str, cal, steps| NodeRun {
        name: name.into(),
        calibrated: cal,
        memory_bytes: 16 << 30,
        link: link(15.0, 0.03),
        steps,
        busy: 0.6,
        comm: 0.35,
    };
    RunFigures {
        cluster: "local-digits".into(),
        model: "mlp-digits-wide".into(),
        global_batch: 384,
        grad_bytes: 1.2e6,
        steps: [20, 40],
        samples_per_s: 13_000.0,
        nodes: vec![
            // Twice as slow as calibrated, finishes first: waits 9 ms.
            node("fast-a", fast, steps(180, fast, 2.0, 9e-3, 0.5e-3)),
            node("fast-b", fast, steps(180, fast, 2.0, 8e-3, 0.5e-3)),
            // Finishes last: waits for the ring only, 6 ms.
            node("slow", slow, steps(24, slow, 1.5, 6e-3, 0.5e-3)),
        ],
        rings: Vec::new(),
        pairs: vec![
            ("fast-a".into(), "fast-b".into(), link(15.0, 0.03)),
            ("fast-a".into(), "slow".into(), link(14.0, 0.03)),
            ("fast-b".into(), "slow".into(), link(16.0, 0.01)),
        ],
    }
}

#[test]
fn fit_scales_the_calibration_by_what_steady_steps_took() {
    let p = fit(&run());
    let a = &p.nodes[0];
    assert!((a.secs_per_sample - 70e-6).abs() < 1e-12, "{a:?}");
    // Twice the calibrated fixed cost, plus the 0.5 ms between steps.
    assert!((a.step_overhead_s - 3.5e-3).abs() < 1e-12, "{a:?}");
    let s = &p.nodes[2];
    assert!((s.secs_per_sample - 270e-6).abs() < 1e-12, "{s:?}");
    assert_eq!((s.batch, p.profile.ring_nodes), (24, 3));
    // The ring is the least wait of a step: the last node's.
    assert!((p.profile.ring_s - 6e-3).abs() < 1e-15);
}

/// The slowest bandwidth and the largest latency of a profile's links: what its ring runs at.
fn ring_links(p: &Profile) -> (f64, f64) {
    let bottleneck = p
        .links
        .iter()
        .map(|l| l.bandwidth_gbps)
        .fold(f64::INFINITY, f64::min);
    let latency = p.links.iter().map(|l| l.latency_ms).fold(0.0, f64::max);
    (bottleneck, latency)
}

#[test]
fn fit_links_make_the_cost_models_ring_take_the_measured_time() {
    let p = fit(&run());
    let (bottleneck, latency) = ring_links(&p);
    let t = ring_allreduce_s(3, 1.2e6, bottleneck, latency);
    assert!((t - 6e-3).abs() < 1e-9, "{t}");
    // One factor on every link: their order is kept.
    assert!(p.links[2].bandwidth_gbps > p.links[0].bandwidth_gbps);
    assert!(p.nodes.iter().all(|n| n.bandwidth_gbps < 15.0));
}

/// The steady steps ran a ring of 3 in 6 ms; the coordinator also measured a ring of 2 in
/// 3.5 ms. The profile's links make the cost model's rings of both sizes take what they took
/// (bandwidth and per-hop latency both), not the one ring alone.
#[test]
fn rings_of_two_sizes_fit_bandwidth_and_latency() {
    let mut r = run();
    r.rings = vec![(3, 9e-3), (2, 3.5e-3)];
    let p = fit(&r);
    let (bottleneck, latency) = ring_links(&p);
    for (n, want) in [(3, 6e-3), (2, 3.5e-3)] {
        let t = ring_allreduce_s(n, 1.2e6, bottleneck, latency);
        assert!(
            (t - want).abs() < 1e-9,
            "ring of {n}: {t} s, measured {want}"
        );
    }
    assert!(p.nodes.iter().all(|n| n.latency_ms == latency));
    // A larger ring no slower fits no latency: the one ring's rule holds.
    r.rings = vec![(2, 7e-3)];
    assert_eq!(fit(&r).links, fit(&run()).links);
}

#[test]
fn a_node_left_out_of_the_steady_steps_gets_the_others_contention() {
    let mut r = run();
    r.nodes[2].steps.clear();
    let p = fit(&r);
    // The fast nodes ran at twice their calibration: so is `slow` charged.
    assert!(
        (p.nodes[2].secs_per_sample - 360e-6).abs() < 1e-12,
        "{:?}",
        p.nodes[2]
    );
    assert!((p.nodes[2].step_overhead_s - (13.4e-3 + 0.5e-3)).abs() < 1e-12);
    assert_eq!(
        (p.nodes[2].steps_measured, p.nodes[0].steps_measured),
        (0, 20)
    );
    // Its access link is its fastest probed pair.
    assert_eq!(p.nodes[2].latency_ms, 0.01);
    // The ring was fast-a and fast-b: their pair, not `slow`'s slower ones, is its bottleneck.
    assert_eq!(p.profile.ring_nodes, 2);
    let ab = &p.links[0];
    let t = ring_allreduce_s(2, 1.2e6, ab.bandwidth_gbps, ab.latency_ms);
    assert!((t - 8e-3).abs() < 1e-9, "{t}");
}

#[test]
fn fit_without_steps_keeps_the_calibration_and_the_probes() {
    let mut r = run();
    for n in &mut r.nodes {
        n.steps.clear();
    }
    let p = fit(&r);
    assert_eq!(p.nodes[0].secs_per_sample, 35e-6);
    assert_eq!(p.nodes[0].step_overhead_s, 1.5e-3);
    assert_eq!(p.links[0].bandwidth_gbps, 15.0);
    assert_eq!(p.nodes[2].bandwidth_gbps, 16.0);
    assert_eq!(p.profile.ring_s, 0.0);
}

#[test]
fn written_profile_reads_back_and_applies_by_name() {
    let p = fit(&run());
    let text = p.to_toml();
    let back = Profile::parse(&text, "profile.toml").unwrap();
    assert_eq!(back, p);
    let mut s = scenario();
    let notes = back.apply(&mut s, "profile.toml").unwrap();
    assert!(notes.is_empty(), "{notes:?}");
    let flops = s.model.train_flops_per_sample();
    let slow = &s.cluster.nodes[2];
    assert_eq!(slow.name, "slow");
    assert!((flops / slow.flops - 270e-6).abs() < 1e-12);
    assert_eq!(slow.step_overhead_s, p.nodes[2].step_overhead_s);
    assert_eq!(slow.memory_bytes, 16 << 30);
    let ab = s.cluster.link(crate::NodeId(0), crate::NodeId(1));
    assert_eq!(ab.bandwidth_gbps, p.links[0].bandwidth_gbps);
}

#[test]
fn the_cost_model_charges_the_profiles_fixed_costs() {
    let mut s = scenario();
    fit(&run()).apply(&mut s, "p").unwrap();
    let costs = crate::cost::Costs::new(&s.cluster, &s.model, &s.training);
    let a = crate::NodeId(0);
    let t = costs.compute_s(a, costs.all(), 100.0);
    assert!((t - (3.5e-3 + 100.0 * 70e-6)).abs() < 1e-9, "{t}");
    assert_eq!(costs.compute_s(a, costs.all(), 0.0), 0.0);
}

fn parse_err(text: &str) -> String {
    Profile::parse(text, "p.toml").unwrap_err().to_string()
}

fn apply_err(p: &Profile) -> String {
    p.apply(&mut scenario(), "p.toml").unwrap_err().to_string()
}

#[test]
fn unparsable_files_say_where() {
    let good = fit(&run()).to_toml();
    let e = parse_err("[profile]\nformat = 1\nmodel = \n");
    assert!(e.starts_with("p.toml:3:"), "{e}");
    let e = parse_err(&good.replace("secs_per_sample", "secs_per_sampel"));
    assert!(e.contains("secs_per_sampel"), "{e}");
    assert!(e.starts_with("p.toml:"), "{e}");
    let e = parse_err(&good.replace("format = 1", "format = 7"));
    assert!(e.contains("format 7"), "{e}");
}

#[test]
fn non_finite_and_negative_figures_are_refused_with_their_node() {
    let good = fit(&run()).to_toml();
    let first = good.find("step_overhead_s").unwrap();
    let line_end = first + good[first..].find('\n').unwrap();
    for bad in ["nan", "inf", "-0.5"] {
        let text = format!(
            "{}step_overhead_s = {bad}{}",
            &good[..first],
            &good[line_end..]
        );
        let e = parse_err(&text);
        assert!(
            e.contains("node `fast-a`") && e.contains("step_overhead_s"),
            "{e}"
        );
        let line = e.split(':').nth(1).unwrap().parse::<usize>().unwrap();
        assert!(line > 1, "{e}");
    }
}

#[test]
fn unknown_nodes_and_other_models_are_errors() {
    let mut p = fit(&run());
    p.nodes[1].name = "fast-c".into();
    let e = apply_err(&p);
    assert!(
        e.contains("`fast-c` is not in the cluster `local-digits`"),
        "{e}"
    );
    assert!(e.contains("fast-a, fast-b, slow"), "{e}");
    let mut p = fit(&run());
    p.profile.model = "gpt-tiny".into();
    let e = apply_err(&p);
    assert!(
        e.contains("measured on model `gpt-tiny`") && e.contains("mlp-digits-wide"),
        "{e}"
    );
}

#[test]
fn missing_nodes_and_another_batch_are_notes() {
    let mut p = fit(&run());
    p.nodes.remove(2);
    p.links.retain(|l| l.b != "slow");
    p.profile.global_batch = 256;
    let notes = p.apply(&mut scenario(), "p.toml").unwrap();
    assert_eq!(notes.len(), 2, "{notes:?}");
    assert!(
        notes
            .iter()
            .any(|n| n.contains("`slow` is not in the profile"))
    );
    assert!(notes.iter().any(|n| n.contains("global batch of 256")));
}

#[test]
fn spread_is_step_to_step_noise_not_the_change_between_epochs() {
    let mut r = run();
    let cal = r.nodes[0].calibrated;
    // Two epochs, each steady, one under twice the other's contention: no step noise.
    let mut steps = super::tests::steps(180, cal, 1.0, 9e-3, 0.0);
    steps.extend(super::tests::steps(120, cal, 2.0, 9e-3, 0.0));
    r.nodes[0].steps = steps;
    let (_, spread, _) = node_figures(&r.nodes[0]).unwrap();
    assert!(spread < 1e-9, "{spread}");
    // Alternate steps 20% above and below their mean: a spread of 0.2.
    for (i, s) in r.nodes[1].steps.iter_mut().enumerate() {
        s.compute_s *= if i % 2 == 0 { 1.2 } else { 0.8 };
    }
    let (_, spread, _) = node_figures(&r.nodes[1]).unwrap();
    assert!((spread - 0.2).abs() < 1e-9, "{spread}");
}

/// Two equal workers whose steps are 20% above and below their mean: when both are slow on the
/// same steps, the slowest of them costs nothing beyond the mean (spread factor 0); when one is
/// slow while the other is fast, every step takes 1.2x, which independent uniform noise of
/// spread 0.2 gives at 1 + 0.2 √12 α / 6 = 1.2, α = √3.
#[test]
fn the_profile_spread_makes_independent_noise_cost_what_the_real_noise_did() {
    for (together, want) in [(true, 0.0), (false, 3f64.sqrt())] {
        let mut r = run();
        r.nodes.truncate(2);
        r.nodes[1].steps = r.nodes[0].steps.clone();
        for (n, node) in r.nodes.iter_mut().enumerate() {
            for (i, s) in node.steps.iter_mut().enumerate() {
                let up = (i + usize::from(n == 1 && !together)) % 2 == 0;
                s.compute_s *= if up { 1.2 } else { 0.8 };
            }
        }
        let p = fit(&r);
        for node in &p.nodes {
            let alpha = node.compute_spread / 0.2;
            assert!(
                (alpha - want).abs() < 1e-3,
                "together {together}: factor {alpha}, want {want}"
            );
        }
    }
}

/// A node planned out after a few steps is not measured on them: it gets the contention, spread
/// and gap of the nodes that worked, as a node that never worked does.
#[test]
fn a_node_that_worked_a_few_steps_counts_as_left_out() {
    let mut r = run();
    r.nodes[2].steps.truncate(2);
    let p = fit(&r);
    let (slow, fast) = (&p.nodes[2], &p.nodes[0]);
    assert!(
        (slow.secs_per_sample - 2.0 * 180e-6).abs() < 1e-12,
        "{slow:?}"
    );
    assert_eq!(slow.compute_spread, fast.compute_spread);
}

/// The planner's wait for the slowest of n equal workers is the mean of the largest of n
/// independent uniform draws (the simulator's noise), computed by integration.
#[test]
fn the_planners_wait_for_the_slowest_is_the_simulators_expected_maximum() {
    for n in 2..7 {
        for spread in [0.01, 0.1, 0.3, 0.5] {
            let w = 12f64.sqrt() * spread;
            let spans = vec![(1.0 - w / 2.0, 1.0 + w / 2.0); n];
            let exact = expected_max_uniform(&spans) - 1.0;
            let model = crate::cost::wait_for_slowest(&vec![spread; n]);
            assert!(
                (exact - model).abs() < 1e-4,
                "n {n}, spread {spread}: {exact} vs {model}"
            );
        }
    }
    assert_eq!(
        crate::cost::wait_for_slowest(&[0.3]),
        0.0,
        "one worker waits for no one"
    );
    assert_eq!(crate::cost::wait_for_slowest(&[0.0, 0.0]), 0.0);
}

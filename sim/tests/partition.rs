//! A network partition between the two racks of `scenarios/partition.toml`, with plans that put
//! both racks to work (the file's own global batch of 48 leaves rack B out, so its partition
//! cuts off idle nodes only): the coordinator's rack trains alone when it can hold the global
//! batch, waits for the other rack when it cannot, and stops with the reason when the partition
//! never heals. Every run is bounded in wall-clock time, so a livelock fails instead of hanging
//! (`ravnest sim` used to spin forever at batch 72: restore, fail to plan, restore again).

use std::sync::mpsc;
use std::time::Duration;

use ravnest_core::config::{Fault, Scenario};
use ravnest_sim::{SimOptions, SimReport, run};

/// The partition scenario at global batch `batch`.
fn partition(batch: u32) -> Scenario {
    let mut s =
        ravnest_core::parse(include_str!("../../scenarios/partition.toml"), "partition").unwrap();
    s.training.global_batch = batch;
    s
}

/// Every batch computed at once (`accumulate = false`): rack A alone cannot hold a batch that
/// took all six nodes, so no plan fits it during the partition. (With accumulation, the
/// default, it trains on alone.)
fn at_once(mut s: Scenario) -> Scenario {
    s.training.accumulate = false;
    s
}

/// The partition never heals.
fn forever(mut s: Scenario) -> Scenario {
    for f in &mut s.faults {
        if let Fault::Partition { to_s, .. } = f {
            *to_s = 1e6;
        }
    }
    s
}

/// Run it in a thread; a run that has not ended after `WALL` fails the test with its replay
/// line (a livelock spins at one virtual instant, so the simulator's virtual-time bound never
/// comes).
fn bounded(s: &Scenario, seed: u64, steps: u64) -> SimReport {
    const WALL: Duration = Duration::from_secs(120);
    let mut o = SimOptions::for_scenario(s);
    o.seed = seed;
    o.steps = steps;
    let (tx, rx) = mpsc::channel();
    let (s2, o2) = (s.clone(), o.clone());
    std::thread::spawn(move || {
        let _ = tx.send(run(&s2, &o2));
    });
    let replay = format!(
        "partition.toml at global_batch = {}, seed {seed}, {steps} steps: ravnest sim FILE --seed {seed} --steps {steps}",
        s.training.global_batch
    );
    match rx.recv_timeout(WALL) {
        Ok(r) => r.unwrap_or_else(|e| panic!("{replay}: {e}")),
        Err(_) => panic!("{replay}: the run did not end within {WALL:?} of wall-clock time"),
    }
}

/// The first plan's role of node `name`.
fn role<'a>(r: &'a SimReport, name: &str) -> &'a str {
    &r.nodes.iter().find(|n| n.name == name).unwrap().role
}

/// Whether the timeline has a marker that contains `text`.
fn marked(r: &SimReport, text: &str) -> bool {
    r.timeline.markers.iter().any(|m| m.1.contains(text))
}

const RACK_B: [&str; 3] = ["rack-b-0", "rack-b-1", "rack-b-2"];

#[test]
fn the_coordinators_rack_trains_alone_through_the_partition_and_the_other_rejoins() {
    // At 50 the plan has five workers, two of rack B; rack A alone holds 50 (17 + 17 + 16).
    let r = bounded(&partition(50), 5, 150);
    assert_eq!(role(&r, "rack-b-0"), "worker");
    assert_eq!(role(&r, "rack-b-1"), "worker");
    assert!(r.violations.is_empty(), "{:?}", r.violations);
    assert_eq!(r.steps_completed, 150);
    assert!(r.max_model_error < 1e-5, "{}", r.max_model_error);
    assert!(r.dropped > 0);
    // Training went on during the partition (30 s to 40 s), not after it healed.
    let resumed = r.faults[0]
        .resumed_after_s
        .expect("a step after the partition");
    assert!(resumed < 10.0, "first step {resumed} s after the partition");
    for b in ["rack-b-0", "rack-b-1"] {
        assert!(marked(&r, &format!("{b} declared dead")), "{b} lost");
        assert!(marked(&r, &format!("{b} rejoined")), "{b} back");
        let n = r.nodes.iter().find(|n| n.name == b).unwrap();
        assert!(n.steps > 0 && n.steps < 150, "{b}: {} steps", n.steps);
    }
    assert!(!marked(&r, "rack-a-0 declared dead"));
    assert!(!marked(&r, "training waits"));
    // The idle rack-b-2 is watched too.
    assert_eq!(r.faults[0].lost, RACK_B);
    assert_eq!(r.faults[0].waited_s, None);
}

#[test]
fn the_coordinators_rack_that_cannot_hold_the_batch_waits_for_the_heal() {
    // At 72 all six train (12 each) and rack A alone cannot hold 72 at once in data parallel:
    // the run used to livelock here.
    let r = bounded(&at_once(partition(72)), 5, 60);
    for n in &r.nodes {
        assert_eq!(n.role, "worker", "{}", n.name);
    }
    assert!(r.violations.is_empty(), "{:?}", r.violations);
    assert_eq!(r.steps_completed, 60);
    assert!(r.max_model_error < 1e-5, "{}", r.max_model_error);
    for b in RACK_B {
        assert!(marked(&r, &format!("{b} declared dead")), "{b} lost");
        assert!(marked(&r, &format!("{b} rejoined")), "{b} back");
    }
    assert!(marked(&r, "training waits"));
    assert_eq!(r.faults[0].lost, RACK_B);
    let waited = r.faults[0].waited_s.expect("waited");
    assert!((8.0..10.0).contains(&waited), "waited {waited} s");
    // Nothing was agreed while rack B was away: the next step came after the heal at 40 s.
    let resumed = r.faults[0]
        .resumed_after_s
        .expect("a step after the partition");
    assert!(
        resumed >= 10.0,
        "first step {resumed} s after the partition"
    );
    // Same seed, same trace.
    assert_eq!(
        bounded(&at_once(partition(72)), 5, 60).trace_hash,
        r.trace_hash
    );
}

#[test]
fn a_partition_that_never_heals_stops_with_the_reason() {
    let r = bounded(&forever(at_once(partition(72))), 5, 150);
    assert!(r.steps_completed < 150);
    assert_eq!(r.violations.len(), 1, "{:?}", r.violations);
    let why = &r.violations[0];
    for part in [
        "training stalled",
        "no plan for the live nodes (rack-a-0, rack-a-1, rack-a-2) at global batch 72",
        "training waited 120 s",
    ] {
        assert!(why.contains(part), "{part:?} not in {why:?}");
    }
}

/// Seeds 0..20 at batches that put both racks to work (24: local SGD, rack A alone holds it;
/// 50: five workers; 54 to 96: all six, rack A alone cannot hold them at once) and at the
/// file's 48 (rack B idle), with gradient accumulation (the default: rack A trains on alone)
/// and without (it waits for the heal): every run ends, finishes its steps, and every checker
/// holds. At 120 without accumulation the plan is a pipeline across both racks whose last
/// stages are on rack B, and there is no checkpoint yet at the partition: the run goes back to
/// its start (the one version every run can restore) and finishes too.
#[test]
fn partition_sweep_over_seeds_and_batches_ends_every_run() {
    let mut failed = Vec::new();
    for accumulate in [true, false] {
        for (batch, steps) in [
            (24, 300),
            (48, 100),
            (50, 100),
            (54, 100),
            (60, 100),
            (72, 100),
            (96, 100),
            (120, 100),
        ] {
            for seed in 0..20 {
                let mut s = partition(batch);
                s.training.accumulate = accumulate;
                let r = bounded(&s, seed, steps);
                let ok = r.violations.is_empty() && r.steps_completed == steps;
                if !ok {
                    failed.push(format!(
                        "batch {batch} accumulate {accumulate} seed {seed}: {}/{steps} steps, {:?}",
                        r.steps_completed, r.violations
                    ));
                }
            }
        }
    }
    assert!(failed.is_empty(), "{failed:#?}");
}

//! Exactly-once sampling, as a property of the pure planning and assignment. The global sample
//! order is a pure function of (seed, epoch) (`ravnest_train::data::epoch_order`); step s
//! trains the contiguous range `[s·B, (s+1)·B)` of it, split over the nodes by their planned
//! shares (`digest::sample_range(s, B, offset, batch)`). So whatever the plans, losses, joins,
//! resumes and redone steps of a run, its trained samples are `[0, N·B)` exactly once when
//! every epoch's assignment tiles `[0, B)`: checked here for random clusters, layouts, memory
//! budgets and live sets, with a run's history of epochs drawn at random and its samples
//! counted one by one against that oracle.

use std::collections::BTreeMap;

use proptest::prelude::*;
use ravnest_core::NodeId;
use ravnest_protocol::coordinator::assign::{Assign, assignments};
use ravnest_protocol::digest::sample_range;

const DEVICES: &[&str] = &["rtx3060", "rtx3090", "rtx4090", "a100-80", "cpu"];

/// A cluster file of `nodes` (device index, memory GiB), a GPT, `layout` and a global batch.
fn file(nodes: &[(usize, f64)], layout: &str, batch: u32) -> String {
    let mut s = String::new();
    for (i, (d, mem)) in nodes.iter().enumerate() {
        s += &format!(
            "[[node]]\nname = \"n{i}\"\ndevice = \"{}\"\nmemory_gib = {mem}\n\n",
            DEVICES[*d]
        );
    }
    s + &format!(
        "[model]\nkind = \"gpt\"\nlayers = 6\nhidden = 256\nheads = 4\nseq_len = 64\nvocab = 256\n\n[training]\nglobal_batch = {batch}\nmicro_batch = 2\nmemory_reserve_gib = 0\nlayout = \"{layout}\"\n\n[run]\nnetwork = \"gpt\"\n"
    )
}

/// The nodes that own samples (a data-parallel or sharded worker, a pipeline's first stage).
fn sample_owners(assigns: &[Assign]) -> Vec<&Assign> {
    assigns
        .iter()
        .filter(|a| a.batch > 0 && a.stage.as_ref().is_none_or(|s| s.stage == 0))
        .collect()
}

/// The assignment of an epoch of the live nodes `live` (indices into `nodes`), or `None` when
/// no plan fits them.
fn epoch(nodes: &[(usize, f64)], live: &[usize], layout: &str, batch: u32) -> Option<Vec<Assign>> {
    let sub: Vec<(usize, f64)> = live.iter().map(|&i| nodes[i]).collect();
    let s = ravnest_core::parse(&file(&sub, layout, batch), "prop").expect("a valid file");
    // (A layout that fits none of the live nodes is no epoch: the run waits or stops.)
    let plan = ravnest_core::plan_scenario(ravnest_core::PlannerKind::Ravnest, &s).ok()?;
    assert_eq!(
        plan.global_batch,
        u64::from(batch),
        "a plan changed the global batch"
    );
    let ids: Vec<NodeId> = live.iter().map(|&i| NodeId(i as u32)).collect();
    let (assigns, _) = assignments(&plan, &ids, &s.cluster, &s.model, &s.training).ok()?;
    Some(assigns)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A run's history: epochs of random live sets (losses and joins), each from a step at
    /// or below the last agreed one (a halted epoch's steps redone, a resume from a
    /// checkpoint); at the end, every sample of `[0, N·B)` was trained exactly once by the
    /// epochs that made the final versions.
    #[test]
    fn every_sample_of_the_run_is_trained_exactly_once(
        nodes in proptest::collection::vec((0..DEVICES.len(), 0.05f64..40.0), 2..7),
        layout in prop_oneof![Just("auto"), Just("data-parallel"), Just("pipeline"), Just("sharded")],
        batch in 4u32..97,
        history in proptest::collection::vec((any::<u64>(), 0u64..30, any::<bool>()), 1..8),
    ) {
        let steps = 60u64;
        // Each epoch: (its live nodes, the step it starts at).
        let mut final_epoch_of_step: Vec<Option<Vec<Assign>>> = vec![None; steps as usize];
        let mut agreed = 0u64;
        for (mask, advance, back) in history {
            let live: Vec<usize> = (0..nodes.len()).filter(|i| mask >> i & 1 == 1).collect();
            let Some(assigns) = (!live.is_empty())
                .then(|| epoch(&nodes, &live, layout, batch))
                .flatten()
            else {
                continue;
            };
            // It starts at the last agreed step, or further back (a checkpoint's resume).
            let from = if back { agreed / 2 } else { agreed };
            let to = (agreed + advance).min(steps);
            for s in from..to {
                final_epoch_of_step[s as usize] = Some(assigns.clone());
            }
            agreed = to.max(agreed);
        }
        // Only the steps some epoch made count; every one of them is counted here.
        let mut count: BTreeMap<u64, u32> = BTreeMap::new();
        let b = u64::from(batch);
        for (s, e) in final_epoch_of_step.iter().enumerate() {
            let Some(assigns) = e else { continue };
            for a in sample_owners(assigns) {
                for id in sample_range(s as u64, b, a.offset, a.batch) {
                    *count.entry(id).or_default() += 1;
                }
            }
        }
        for (s, e) in final_epoch_of_step.iter().enumerate() {
            if e.is_none() {
                continue;
            }
            for id in s as u64 * b..(s as u64 + 1) * b {
                prop_assert_eq!(count.get(&id).copied(), Some(1), "sample {} of step {}", id, s);
            }
        }
        prop_assert!(count.keys().all(|id| final_epoch_of_step[(id / b) as usize].is_some()));
    }
}

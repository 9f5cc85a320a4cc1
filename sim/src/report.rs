//! What a simulated run reports: per node and per fault, take-overs, checkpoint rounds, the
//! checkers' violations, the model's error against the oracle and the timeline picture.

use super::{
    BTreeMap, Event, Fault, FaultReport, Hosted, MemStore, NodeId, NodeReport, RunLog, Scenario,
    SimNet, SimOptions, SimReport, TakeOverReport, Trace, describe, dumped_hash, fault_at,
    isolates, timeline,
};
/// The checks on terms: checkpoints were committed by one coordinator term at a time (terms
/// never go down from one commit to the next: a stale coordinator wrote nothing after its
/// successor did), and a coordinator cut off while another took over stepped down once the
/// partition healed (a lease period and a silence after it, at the latest).
pub(super) fn stale_violations(
    s: &Scenario,
    opts: &SimOptions,
    hosted: &Hosted,
    store: &MemStore,
    end_ns: u64,
) -> Vec<String> {
    let mut v = Vec::new();
    let commits = store.commits();
    for w in commits.windows(2) {
        if w[1].1 < w[0].1 {
            v.push(format!(
                "the checkpoint of version {} was committed by term {} after term {} committed version {}",
                w[1].0, w[1].1, w[0].1, w[0].0
            ));
        }
    }
    let by = hosted.by_host.lock().unwrap();
    let newest = by.values().map(|h| h.term).max().unwrap_or(0);
    let healed_ns = s
        .faults
        .iter()
        .filter_map(|f| isolates(f, s.run.coordinator.unwrap_or(NodeId(0))))
        .map(|t| (t * 1e9) as u64)
        .max();
    let grace = (opts.heartbeat + 3 * opts.timeout).as_nanos() as u64;
    for (host, h) in by.iter() {
        if h.term < newest && healed_ns.is_some_and(|t| end_ns > t + grace) {
            v.push(format!(
                "the coordinator of term {} on {} still ran at the end, under term {newest}: it never stepped down",
                h.term,
                s.cluster.node(*host).name
            ));
        }
    }
    v
}

pub(super) fn picture(
    s: &Scenario,
    log: &RunLog,
    counters: &BTreeMap<NodeId, ravnest_runtime::counters::NodeCounters>,
    down: Vec<Vec<(u64, u64)>>,
    end_ns: u64,
) -> timeline::Timeline {
    let lanes = s
        .cluster
        .ids()
        .zip(down)
        .map(|(id, down)| timeline::Lane {
            name: s.cluster.node(id).name.clone(),
            spans: counters
                .get(&id)
                .map(|c| {
                    c.spans
                        .iter()
                        .map(|sp| (sp.start_ns, sp.end_ns, sp.kind))
                        .collect()
                })
                .unwrap_or_default(),
            down,
        })
        .collect();
    let mut markers: Vec<(u64, String, bool)> = s
        .faults
        .iter()
        .map(|f| ((fault_at(f) * 1e9) as u64, describe(s, f), true))
        .collect();
    for (t, e) in &log.events {
        let name = |n: &NodeId| s.cluster.node(*n).name.clone();
        match e {
            Event::Detected { node, .. } => markers.push((
                *t,
                format!("{} declared dead, re-planned", name(node)),
                false,
            )),
            Event::Joined { node } => markers.push((*t, format!("{} rejoined", name(node)), false)),
            Event::Waiting { step, .. } => markers.push((
                *t,
                format!("no plan fits the live nodes: training waits at step {step}"),
                false,
            )),
            Event::TookOver { node, step, .. } => markers.push((
                *t,
                format!("{} took over as coordinator at step {step}", name(node)),
                false,
            )),
            _ => {}
        }
    }
    markers.sort_by_key(|m| m.0);
    timeline::Timeline {
        end_ns,
        lanes,
        markers,
    }
}

/// Every completed checkpoint's step; one that does not hold the agreed model is a
/// violation, as are the coordinator's own violations and stalls.
pub(super) fn checked_checkpoints(log: &RunLog, violations: &mut Vec<String>) -> Vec<u64> {
    let mut checkpoints = Vec::new();
    for (_, e) in &log.events {
        match e {
            Event::CheckpointComplete { step, digest } => {
                checkpoints.push(*step);
                if log.synced_digest.get(step) != Some(digest) {
                    violations.push(format!(
                        "checkpoint {step} does not hold the model the replicas agreed on"
                    ));
                }
            }
            Event::Violation(v) => violations.push(v.clone()),
            Event::CheckpointFailed { step, why } => {
                violations.push(format!("checkpoint {step} could not be stored: {why}"));
            }
            Event::Stalled(why) => violations.push(format!("training stalled: {why}")),
            _ => {}
        }
    }
    checkpoints
}

/// The largest difference of the final model (every live replica's, or each stage's layers)
/// from single-node training on the same data; an incomplete model is a violation, and so is a
/// differing one unless the run used local SGD (`local_sgd`): averaging models every few steps
/// is not single-node training, so no equality is claimed for it.
pub(super) fn model_error(
    s: &Scenario,
    toy: &crate::toy::Toy,
    counters: &BTreeMap<NodeId, ravnest_runtime::counters::NodeCounters>,
    steps_completed: u64,
    local_sgd: bool,
    violations: &mut Vec<String>,
) -> f64 {
    let reference = toy.reference_model(steps_completed, u64::from(s.training.global_batch));
    let mut max_err: f64 = 0.0;
    let mut covered = vec![false; reference.len()];
    let observed = counters
        .values()
        .filter_map(|c| c.observed.as_ref())
        .filter(|o| o.version == steps_completed && steps_completed > 0);
    for o in observed {
        for r in &o.slots {
            let Some(held) = o.range(r.clone()) else {
                continue;
            };
            for (a, b) in held.iter().zip(&reference[r.clone()]) {
                max_err = max_err.max(f64::from((a - b).abs()));
            }
            for x in &mut covered[r.clone()] {
                *x = true;
            }
        }
    }
    if steps_completed > 0
        && let Some(i) = covered.iter().position(|c| !c)
    {
        violations.push(format!(
            "no node ends with the final version of parameter {i}: the final model is incomplete"
        ));
    }
    if max_err > 1e-5 && !local_sgd {
        violations.push(format!(
            "final model differs from single-node training by {max_err:.2e}"
        ));
    }
    max_err
}

/// Per node: its first role, memory, time split and traffic.
pub(super) fn node_reports(
    s: &Scenario,
    first_plan: &ravnest_core::Plan,
    counters: &BTreeMap<NodeId, ravnest_runtime::counters::NodeCounters>,
    net: &SimNet,
    end_ns: u64,
) -> Vec<NodeReport> {
    let bytes = net.bytes_sent();
    s.cluster
        .ids()
        .map(|id| {
            let n = s.cluster.node(id);
            let c = counters.get(&id).cloned().unwrap_or_default();
            let busy = c.compute_ns as f64 / end_ns.max(1) as f64;
            let comm = c.comm_ns as f64 / end_ns.max(1) as f64;
            let planned = first_plan.nodes.get(id.index());
            NodeReport {
                role: match planned.map(|p| &p.role) {
                    Some(ravnest_core::planner::Role::Worker) => "worker".into(),
                    Some(ravnest_core::planner::Role::Stage { replica, stage }) => {
                        format!("r{replica}/s{stage}")
                    }
                    _ => "idle".into(),
                },
                memory_bytes: planned
                    .filter(|p| p.batch > 0)
                    .map_or(0, |p| p.memory_bytes),
                memory_limit_bytes: n.memory_bytes,
                name: n.name.clone(),
                device: n.device.clone(),
                busy,
                comm,
                idle: (1.0 - busy - comm).max(0.0),
                bytes_sent: bytes.get(&id).copied().unwrap_or(0),
                steps: c.steps,
                aborted: c.aborted,
            }
        })
        .collect()
}

/// A fault, and how the run answered it: detected, resumed, rejoined, re-planned after.
pub(super) fn fault_report(s: &Scenario, log: &RunLog, f: &Fault) -> FaultReport {
    let at_ns = (fault_at(f) * 1e9) as u64;
    let detected = match f {
        Fault::Crash { node, .. } => log.events.iter().find_map(|(t, e)| match e {
            Event::Detected { node: n, .. } if n == node && *t >= at_ns => Some(*t),
            _ => None,
        }),
        _ => None,
    };
    let after = detected.unwrap_or(at_ns);
    let resumed = log.step_done_ns.iter().copied().find(|&t| t >= after);
    let rejoined = match f {
        Fault::Restart { node, .. } => log.events.iter().find_map(|(t, e)| match e {
            Event::Joined { node: n } if n == node && *t >= at_ns => {
                Some((*t - at_ns) as f64 / 1e9)
            }
            _ => None,
        }),
        _ => None,
    };
    let replanned = match f {
        Fault::Slowdown { .. } => log.events.iter().find_map(|(t, e)| match e {
            Event::Rebalanced { .. } if *t >= at_ns => Some(
                log.step_done_ns
                    .iter()
                    .filter(|&&d| d >= at_ns && d <= *t)
                    .count() as u64,
            ),
            _ => None,
        }),
        _ => None,
    };
    let (lost, waited_s) = partition_losses(s, log, f, at_ns);
    FaultReport {
        lost,
        waited_s,
        taken_over: match f {
            Fault::Crash { node, .. } => taken_over(s, log, *node, at_ns),
            _ => None,
        },
        replanned_after_steps: replanned,
        rejoined_after_s: rejoined,
        fault: describe(s, f),
        at_s: fault_at(f),
        detected_after_s: detected.map(|t| (t - at_ns) as f64 / 1e9),
        resumed_after_s: resumed.map(|t| (t - at_ns) as f64 / 1e9),
    }
}

/// For a partition starting at `at_ns`: the nodes declared dead while it lasted, and how long
/// training waited for lost nodes when no plan fitted the rest (from the wait to the next
/// completed step, or to the run's last event).
pub(super) fn partition_losses(
    s: &Scenario,
    log: &RunLog,
    f: &Fault,
    at_ns: u64,
) -> (Vec<String>, Option<f64>) {
    let Fault::Partition { to_s, .. } = f else {
        return (Vec::new(), None);
    };
    let to_ns = (to_s * 1e9) as u64;
    let during = |t: u64| t >= at_ns && t <= to_ns;
    let lost = log
        .events
        .iter()
        .filter_map(|(t, e)| match e {
            Event::Detected { node, .. } if during(*t) => Some(s.cluster.node(*node).name.clone()),
            _ => None,
        })
        .collect();
    let waited = log.events.iter().find_map(|(t, e)| match e {
        Event::Waiting { .. } if during(*t) => Some(*t),
        _ => None,
    });
    let waited_s = waited.map(|w| {
        let until = log
            .step_done_ns
            .iter()
            .copied()
            .find(|&t| t >= w)
            .or(log.events.last().map(|e| e.0))
            .unwrap_or(w);
        (until - w) as f64 / 1e9
    });
    (lost, waited_s)
}

/// When `node`, crashed at `at_ns`, hosted the coordinator: who took over, when, from which
/// step, and what the coordinator was doing at the crash.
pub(super) fn taken_over(
    s: &Scenario,
    log: &RunLog,
    node: NodeId,
    at_ns: u64,
) -> Option<TakeOverReport> {
    let (t, by, step) = log.events.iter().find_map(|(t, e)| match e {
        Event::TookOver {
            node: by,
            from,
            step,
            ..
        } if *from == node && *t >= at_ns => Some((*t, *by, *step)),
        _ => None,
    })?;
    Some(TakeOverReport {
        by: s.cluster.node(by).name.clone(),
        after_s: (t - at_ns) as f64 / 1e9,
        from_step: step,
        during: phase_at(log, at_ns).into(),
    })
}

/// What the coordinator was doing at `t_ns`: in a re-plan (a loss detected, the survivors not
/// yet given their new epoch), with a checkpoint round open (a version it agreed whose
/// checkpoint it had not completed; its shards on their way), or neither.
pub(super) fn phase_at(log: &RunLog, t_ns: u64) -> &'static str {
    let before = |t: &u64| *t <= t_ns;
    let last_loss = log
        .events
        .iter()
        .filter(|(t, e)| before(t) && matches!(e, Event::Detected { .. } | Event::Resync { .. }))
        .map(|(t, _)| *t)
        .next_back();
    if let Some(lost) = last_loss
        && !log
            .events
            .iter()
            .any(|(t, e)| *t > lost && before(t) && matches!(e, Event::Planned { .. }))
    {
        return "re-plan";
    }
    let done: Vec<(u64, u64)> = log
        .events
        .iter()
        .filter_map(|(t, e)| match e {
            Event::CheckpointComplete { step, .. } => Some((*step, *t)),
            _ => None,
        })
        .collect();
    // A round opens when the coordinator agrees the step that makes a due version; its end is
    // when the round completed (never, when the crash cut it).
    let open = log
        .checkpoint_opened
        .iter()
        .any(|&(v, opened)| opened <= t_ns && done.iter().all(|&(step, t)| step != v || t > t_ns));
    if open { "checkpoint" } else { "steady" }
}

/// Per complete checkpoint: (opened, completed), virtual seconds.
pub(super) fn checkpoint_rounds(log: &RunLog) -> Vec<(f64, f64)> {
    log.events
        .iter()
        .filter_map(|(t, e)| match e {
            Event::CheckpointComplete { step, .. } => {
                let opened = log
                    .checkpoint_opened
                    .iter()
                    .rev()
                    .find(|(v, o)| v == step && o <= t)?
                    .1;
                Some((opened as f64 / 1e9, *t as f64 / 1e9))
            }
            _ => None,
        })
        .collect()
}

/// The run's report: throughput, checkers, per-node and per-fault figures.
#[allow(clippy::too_many_arguments)]
pub(super) fn report(
    s: &Scenario,
    opts: &SimOptions,
    toy: crate::toy::Toy,
    first_plan: &ravnest_core::Plan,
    log: &RunLog,
    counters: &BTreeMap<NodeId, ravnest_runtime::counters::NodeCounters>,
    net: &SimNet,
    trace: &Trace,
    end_ns: u64,
    (secs_per_sample, fixed_s): (&[f64], &[f64]),
    mut violations: Vec<String>,
) -> SimReport {
    let end_s = end_ns as f64 / 1e9;
    let steps_completed = log.step_done_ns.len() as u64;
    let samples_per_s = if end_s > 0.0 {
        steps_completed as f64 * f64::from(s.training.global_batch) / end_s
    } else {
        0.0
    };
    // Solo throughput at an equal share of the batch, fixed costs included (when there are
    // any: catalog devices have none, and their figure stays 1 ÷ seconds per sample).
    let share = f64::from(s.training.global_batch) / secs_per_sample.len().max(1) as f64;
    let solo: f64 = secs_per_sample
        .iter()
        .zip(fixed_s)
        .map(|(t, f)| {
            if *f > 0.0 {
                share / (f + share * t)
            } else {
                1.0 / t
            }
        })
        .sum();
    // Mean interval after a warm-up of two steps (the start-up's plan, measurement and first
    // fetches), so that a local-SGD averaging round is amortized as the plan amortizes it.
    let done = &log.step_done_ns;
    let warm = 2.min(done.len().saturating_sub(2));
    let steady_step_s = match (done.get(warm), done.last()) {
        (Some(&a), Some(&b)) if done.len() - 1 > warm => {
            (b - a) as f64 / 1e9 / (done.len() - 1 - warm) as f64
        }
        _ => 0.0,
    };
    let planned = log
        .events
        .iter()
        .find_map(|(_, e)| match e {
            Event::Planned {
                workers, stages, ..
            } => Some(ravnest_core::planner::split_line(workers.iter().map(
                |&(id, batch)| {
                    let layers = stages.iter().find(|s| s.0 == id).map(|s| s.1);
                    (s.cluster.node(id).name.as_str(), batch, layers)
                },
            ))),
            _ => None,
        })
        .unwrap_or_default();
    let checkpoints = checked_checkpoints(log, &mut violations);
    let local_sgd_steps = match first_plan.sync.method {
        ravnest_core::planner::sync::SyncMethod::LocalSgd { local_steps, .. } => Some(local_steps),
        _ => None,
    };
    let max_err = model_error(
        s,
        &toy,
        counters,
        steps_completed,
        local_sgd_steps.is_some(),
        &mut violations,
    );
    let nodes = node_reports(s, first_plan, counters, net, end_ns);
    let faults = s.faults.iter().map(|f| fault_report(s, log, f)).collect();
    SimReport {
        scenario: s.cluster.name.clone(),
        planner: opts.planner.as_str().to_string(),
        seed: opts.seed,
        steps_requested: opts.steps,
        steps_completed,
        sim_time_s: end_s,
        samples_per_s,
        steady_step_s,
        steady_samples_per_s: if steady_step_s > 0.0 {
            f64::from(s.training.global_batch) / steady_step_s
        } else {
            0.0
        },
        planned,
        capacity_efficiency: samples_per_s / solo,
        nodes,
        faults,
        plans: log
            .events
            .iter()
            .filter(|(_, e)| matches!(e, Event::Planned { .. }))
            .count(),
        dropped: net.dropped(),
        violations,
        max_model_error: max_err,
        local_sgd_steps,
        checkpoints,
        checkpoint_rounds_s: checkpoint_rounds(log),
        trace_len: trace.len(),
        trace_hash: dumped_hash(trace),
        timeline: timeline::Timeline::default(),
        updates_in_backward: 0,
    }
}

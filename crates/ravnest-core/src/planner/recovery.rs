//! What losing a node costs a plan, priced per step: the recovery term of the planner's
//! objective (docs/cost-model.md, "Recovery").
//!
//! Each working node is lost at the rate `1 / node_mtbf_h`; idle nodes hold nothing and cost
//! nothing when lost. A loss costs:
//! - when another working node holds every layer the lost one held (two or more data-parallel
//!   workers, two or more pipeline replicas): the detection and the step in flight, redone by
//!   the survivors from a surviving copy ([`RecoveryKind::Replan`]);
//! - otherwise the detection, the steps since the latest checkpoint (on average half the
//!   checkpoint interval) redone, and the checkpoint read back over the slowest access link of
//!   the plan's nodes ([`RecoveryKind::Restore`]).
//!
//! The expected cost per step is then `nodes × step ÷ MTBF × cost of a loss`.

use crate::cost::Costs;

use super::types::{Recovery, RecoveryKind};

/// Seconds before a lost node is noticed: `ravnest run`'s default heartbeat timeout
/// (`[run] heartbeat_timeout_ms` = 1500; a test keeps the two equal).
pub const DETECT_S: f64 = 1.5;

/// The bytes a checkpoint of the whole model holds: weights and optimizer state (the state
/// the planner counts for memory, less the gradients).
pub(super) fn checkpoint_bytes(costs: &Costs<'_>) -> f64 {
    let all = costs.all();
    costs.state_bytes(all).saturating_sub(costs.grad_bytes(all)) as f64
}

/// The recovery term of a plan whose layers have `copies` working copies each (data-parallel
/// workers or pipeline replicas) over `nodes` working nodes, the slowest of whose access links
/// has `slowest_gbps`, at `step_s` per step. `checkpoint` is [`checkpoint_bytes`].
pub(super) fn price(
    costs: &Costs<'_>,
    copies: usize,
    nodes: usize,
    slowest_gbps: f64,
    checkpoint: f64,
    step_s: f64,
) -> Recovery {
    let t = costs.training;
    let (kind, redo_s, read_s) = if copies >= 2 {
        (RecoveryKind::Replan, step_s, 0.0)
    } else {
        let age = t.checkpoint_every_steps as f64 / 2.0;
        let read = checkpoint * 8.0 / (slowest_gbps * 1e9);
        (RecoveryKind::Restore, age * step_s, read)
    };
    let per_loss_s = DETECT_S + redo_s + read_s;
    let mtbf_s = t.node_mtbf_h * 3600.0;
    let per_step_s = nodes as f64 * step_s / mtbf_s * per_loss_s;
    Recovery {
        kind,
        copies,
        nodes,
        per_loss_s,
        redo_s,
        read_s,
        per_step_s,
        charged: t.redundancy != crate::cluster::Redundancy::Never,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::{ClusterSpec, Redundancy, TrainingSpec};
    use crate::config::RunSettings;

    #[test]
    fn detection_is_the_runs_default_heartbeat_timeout() {
        let ms = RunSettings::default().heartbeat_timeout_ms as f64;
        assert_eq!(DETECT_S, ms / 1e3);
    }

    #[test]
    fn a_single_copy_pays_half_a_checkpoint_interval_and_the_read() {
        let cluster = ClusterSpec {
            name: "t".into(),
            nodes: vec![],
            pair_links: Default::default(),
        };
        let model = crate::model::preset("gpt2-small").unwrap().build();
        let training = TrainingSpec {
            node_mtbf_h: 1.0,
            checkpoint_every_steps: 100,
            ..TrainingSpec::default()
        };
        let costs = Costs::new(&cluster, &model, &training);
        let ck = checkpoint_bytes(&costs);
        // 12 bytes per parameter in fp32 with AdamW: weights and two moments.
        assert_eq!(ck, (model.params() * 12) as f64);
        let one = price(&costs, 1, 2, 8.0, ck, 2.0);
        assert_eq!(one.kind, RecoveryKind::Restore);
        assert!((one.redo_s - 100.0).abs() < 1e-12);
        assert!((one.read_s - ck / 1e9).abs() < 1e-12);
        let loss = DETECT_S + 100.0 + ck / 1e9;
        assert!((one.per_loss_s - loss).abs() < 1e-9);
        // Two nodes, each lost once an hour, a 2-second step: 2 × 2 / 3600 losses per step.
        assert!((one.per_step_s - 4.0 / 3600.0 * loss).abs() < 1e-12);
        assert!(one.charged);
        let two = price(&costs, 2, 2, 8.0, ck, 2.0);
        assert_eq!(two.kind, RecoveryKind::Replan);
        assert!((two.per_loss_s - (DETECT_S + 2.0)).abs() < 1e-12);
        assert!(two.per_step_s < one.per_step_s / 10.0);
        let never = TrainingSpec {
            redundancy: Redundancy::Never,
            ..training.clone()
        };
        let costs = Costs::new(&cluster, &model, &never);
        assert!(!price(&costs, 1, 2, 8.0, ck, 2.0).charged);
    }
}

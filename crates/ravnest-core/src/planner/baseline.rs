//! The equal-split baselines (`uniform`, `param-count`): what DDP, DeepSpeed and Ravnest's
//! Python prototype do.

use crate::cluster::NodeId;
use crate::cost::Costs;
use crate::units::bytes_u64;

use super::batch;
use super::eval::{Candidate, NoFit, Rejected, evaluate};
use super::layers;
use super::oracle::max_stages;
use super::sync::SyncFreedom;
use super::types::{Plan, PlanError, PlanOptions, PlannerKind};

pub(super) fn baseline(
    costs: &Costs<'_>,
    kind: PlannerKind,
    opts: PlanOptions,
) -> Result<Plan, PlanError> {
    let cluster = costs.cluster;
    let n = cluster.nodes.len();
    let ids: Vec<NodeId> = cluster.ids().collect();
    let b_total = u64::from(costs.training.global_batch);
    let dp = Candidate::Data {
        workers: ids.clone(),
        batch: batch::equal_split(b_total, n),
        note: None,
    };
    let dp_err = match evaluate(costs, &dp, SyncFreedom::Baseline, f64::INFINITY) {
        Ok(mut p) => {
            p.planner = kind;
            return Ok(p);
        }
        Err(Rejected::NotFaster) => unreachable!("no bound was given"),
        Err(Rejected::NoFit(NoFit(id, need, have))) => format!(
            "equal batches of {} need {} on `{}`, which has {}",
            b_total.div_ceil(n as u64),
            bytes_u64(need),
            cluster.node(id).name,
            bytes_u64(have)
        ),
    };
    let params: Vec<u64> = costs.model.layers.iter().map(|x| x.params).collect();
    let m = u64::from(costs.training.micro_batch);
    for s in 2..=max_stages(n, costs, opts) {
        let r = n / s;
        let grid: Vec<Vec<NodeId>> = (0..r)
            .map(|rep| (0..s).map(|k| ids[rep * s + k]).collect())
            .collect();
        let bounds = match kind {
            PlannerKind::ParamCount => layers::equal_params(&params, s),
            _ => layers::equal_layers(costs.layers(), s),
        };
        let samples = batch::equal_split(b_total, r);
        let micro: Vec<u64> = samples.iter().map(|b| b.div_ceil(m)).collect();
        let c = Candidate::Pipe {
            grid,
            bounds,
            micro,
            samples,
            note: None,
        };
        if let Ok(mut p) = evaluate(costs, &c, SyncFreedom::Baseline, f64::INFINITY) {
            p.planner = kind;
            return Ok(p);
        }
    }
    Err(PlanError::NoEqualSplit {
        planner: kind,
        detail: format!("{dp_err}; no pipeline of equal stages fits either"),
    })
}

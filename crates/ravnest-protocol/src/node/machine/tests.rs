//! The node's machine against a plain model: SGD on a host vector, the step's results in any
//! order, clipping, aborts, local steps, and the report each version makes.

use std::ops::Range;
use std::sync::Arc;

use proptest::prelude::*;
use ravnest_core::NodeId;
use ravnest_core::collective::CollId;
use ravnest_core::planner::sync::Outer;

use super::{Act, Begin, Machine, Sizes};
use crate::msg::{Addr, Envelope, StepMode, SyncPolicy, Work};
use crate::node::core::{Input, NodeCore};
use crate::node::values::{ComputeError, Values};

const ME: NodeId = NodeId(0);
const LR: f32 = 0.5;
const PARAMS: usize = 6;

/// SGD with rate [`LR`] on a host vector of [`PARAMS`] values, the gradient in three buckets
/// (the last parameters first, as backward makes them).
#[derive(Debug)]
struct Plain {
    max_norm: Option<f32>,
}

impl Values for Plain {
    type Model = Arc<Vec<f32>>;
    type StageGrad = Vec<f32>;

    fn model_len(&self) -> usize {
        PARAMS
    }

    fn params(&self) -> usize {
        PARAMS
    }

    fn initial(&self, _: Option<ravnest_core::LayerRange>) -> Self::Model {
        Arc::new((0..PARAMS).map(|i| i as f32).collect())
    }

    fn export(
        &self,
        model: &Self::Model,
        layers: Option<ravnest_core::LayerRange>,
    ) -> Option<Vec<f32>> {
        layers.is_none().then(|| model.to_vec())
    }

    fn import(
        &self,
        _: Option<&Self::Model>,
        _: Option<ravnest_core::LayerRange>,
        values: Vec<f32>,
    ) -> Result<Self::Model, ComputeError> {
        Ok(Arc::new(values))
    }

    fn buckets(&self) -> Vec<Range<usize>> {
        vec![4..6, 2..4, 0..2]
    }

    fn apply_update(
        &self,
        model: &mut Self::Model,
        range: Range<usize>,
        mean_gradient: &[f32],
    ) -> Result<(), ComputeError> {
        let w = Arc::make_mut(model);
        if range.end > w.len() || range.len() != mean_gradient.len() {
            return Err(ComputeError::Shape("out of the model".into()));
        }
        for (x, g) in w[range].iter_mut().zip(mean_gradient) {
            *x -= LR * g;
        }
        Ok(())
    }

    fn max_grad_norm(&self) -> Option<f32> {
        self.max_norm
    }
}

fn work(sync: SyncPolicy) -> Work {
    Work {
        sync,
        ..Work::for_test(1, 0, 10, vec![ME, NodeId(1)])
    }
}

/// A machine at version 0 running `w`, and the step it is told to run.
fn machine(w: &Work, max_norm: Option<f32>) -> (Machine<Plain>, u64) {
    let values = Arc::new(Plain { max_norm });
    let core = NodeCore::fresh(ME, 0, values.initial(None));
    let sizes = Sizes {
        grad_bytes: 4 * PARAMS as u64,
        model_bytes: 4 * PARAMS as u64,
        round_factor: 1.0,
    };
    let mut m = Machine::new(core, values, sizes);
    m.handle(Input::Work(Box::new(w.clone())));
    m.acts();
    let s = m.advance().expect("a step to run");
    m.acts();
    (m, s)
}

fn base(m: &Machine<Plain>, s: u64) -> Arc<Vec<f32>> {
    m.core().version(s).expect("version s").model.clone()
}

/// What the acts say: the versions made (their models), envelopes sent, aborts, norms.
#[derive(Debug, Default)]
struct Seen {
    made: Vec<(u64, Vec<f32>, bool)>,
    sent: Vec<(Addr, Envelope)>,
    aborted: usize,
    norms: Vec<f64>,
    collectives: Vec<CollId>,
}

/// Take the machine's acts, handing each version made back to it as the driver does.
fn drive(m: &mut Machine<Plain>, seen: &mut Seen) {
    loop {
        let acts = m.acts();
        if acts.is_empty() {
            return;
        }
        for act in acts {
            match act {
                Act::Made { made, .. } => {
                    seen.made
                        .push((made.step + 1, made.model.to_vec(), made.synced));
                    m.handle(Input::Made(made));
                }
                Act::Send(to, env) => seen.sent.push((to, env)),
                Act::Aborted => seen.aborted += 1,
                Act::GradNorm { norm, .. } => seen.norms.push(norm),
                Act::Collective(c) => seen.collectives.push(c.id),
                Act::Halt(_) | Act::WriteShard { .. } | Act::Batch(_) => {}
            }
        }
    }
}

fn id(step: u64, bucket: u32) -> CollId {
    CollId {
        epoch: 1,
        step,
        bucket,
    }
}

/// The group's sum of bucket `k` of step `s` (what comes back): a value per parameter.
fn sum(k: usize) -> Vec<f32> {
    let r = Plain { max_norm: None }.buckets()[k].clone();
    r.map(|i| 0.25 * (i as f32 + 1.0)).collect()
}

fn whole_gradient() -> Vec<f32> {
    (0..PARAMS).map(|i| 0.25 * (i as f32 + 1.0)).collect()
}

fn expected(factor: f32) -> Vec<f32> {
    let g = whole_gradient();
    (0..PARAMS).map(|i| i as f32 - LR * factor * g[i]).collect()
}

proptest! {
    /// However the buckets' results and the compute's end interleave (and whatever stale
    /// result of another step comes between), the step makes one version, once, with every
    /// bucket applied, and reports it.
    #[test]
    fn a_step_makes_its_version_once_whatever_the_order(
        order in Just(vec![0usize, 1, 2]).prop_shuffle(),
        computed_at in 0usize..=3,
        stale_at in 0usize..=3,
    ) {
        let w = work(SyncPolicy::EveryStep);
        let (mut m, s) = machine(&w, None);
        let Some(Begin::Sync { model, shard, .. }) = m.begin(s) else {
            panic!("a sync step");
        };
        prop_assert!(shard.is_none());
        prop_assert_eq!(model.to_vec(), base(&m, s).to_vec());
        let mut seen = Seen::default();
        for at in 0..=3 {
            if at == stale_at {
                m.outcome(id(s + 7, 0), Some(sum(0)));
            }
            if at == computed_at {
                m.computed(1, 5, Ok(()));
            }
            if let Some(&k) = order.get(at) {
                m.outcome(id(s, k as u32), Some(sum(k)));
            }
            drive(&mut m, &mut seen);
            let done = at >= computed_at && at >= 2;
            prop_assert_eq!(seen.made.len(), usize::from(done), "at {}", at);
        }
        prop_assert_eq!(&seen.made[0], &(s + 1, expected(1.0), true));
        prop_assert!(!m.busy());
        let reported = seen.sent.iter().any(|(to, e)| {
            *to == Addr::Coordinator && matches!(e, Envelope::StepDone { step, .. } if *step == s)
        });
        prop_assert!(reported, "{:?}", seen.sent);
        prop_assert_eq!(m.core().latest(), Some(s + 1));
    }

    /// Clipped, the buckets wait for each other and are scaled by one factor from the whole
    /// gradient's norm, as `clip_grad_norm_` does after DDP's averaging.
    #[test]
    fn a_clipped_step_applies_every_bucket_by_the_whole_norm(
        order in Just(vec![0usize, 1, 2]).prop_shuffle(),
        max in 0.1f32..4.0,
    ) {
        let w = Work {
            ring: vec![ME],
            ..work(SyncPolicy::EveryStep)
        };
        let (mut m, s) = machine(&w, Some(max));
        assert!(matches!(m.begin(s), Some(Begin::Sync { .. })));
        m.computed(1, 5, Ok(()));
        let mut seen = Seen::default();
        for (n, &k) in order.iter().enumerate() {
            m.outcome(id(s, k as u32), Some(sum(k)));
            drive(&mut m, &mut seen);
            prop_assert_eq!(seen.made.len(), usize::from(n == 2));
        }
        let sq: f64 = whole_gradient().iter().map(|g| f64::from(*g) * f64::from(*g)).sum();
        prop_assert_eq!(seen.norms.len(), 1);
        prop_assert!((seen.norms[0] - sq.sqrt()).abs() < 1e-9);
        let f = ravnest_core::recipe::clip_factor(sq, max);
        let (_, model, _) = &seen.made[0];
        for (a, b) in model.iter().zip(expected(f)) {
            prop_assert!((a - b).abs() < 1e-6, "{:?} against {:?}", model, expected(f));
        }
    }
}

#[test]
fn an_aborted_collective_fails_the_step_and_makes_nothing() {
    let w = work(SyncPolicy::EveryStep);
    let (mut m, s) = machine(&w, None);
    assert!(matches!(m.begin(s), Some(Begin::Sync { .. })));
    m.computed(1, 5, Ok(()));
    m.outcome(id(s, 0), Some(sum(0)));
    m.outcome(id(s, 1), None);
    let mut seen = Seen::default();
    drive(&mut m, &mut seen);
    assert!(seen.made.is_empty());
    assert_eq!(seen.aborted, 1);
    assert!(matches!(
        &seen.sent[..],
        [(Addr::Coordinator, Envelope::StepFailed { epoch: 1, reason })] if reason.contains("bucket 1")
    ));
    assert!(!m.busy(), "the step is dropped");
    // What comes back later for it is ignored.
    m.outcome(id(s, 2), Some(sum(2)));
    drive(&mut m, &mut seen);
    assert!(seen.made.is_empty());
}

#[test]
fn a_result_that_does_not_fit_its_bucket_fails_the_step() {
    let w = work(SyncPolicy::EveryStep);
    let (mut m, s) = machine(&w, None);
    assert!(matches!(m.begin(s), Some(Begin::Sync { .. })));
    m.outcome(id(s, 0), Some(vec![1.0; 5]));
    let mut seen = Seen::default();
    drive(&mut m, &mut seen);
    assert!(seen.made.is_empty());
    assert!(matches!(
        &seen.sent[..],
        [(Addr::Coordinator, Envelope::StepFailed { reason, .. })] if reason.contains("gave 5 values")
    ));
}

#[test]
fn a_failed_compute_fails_the_step() {
    let w = work(SyncPolicy::EveryStep);
    let (mut m, s) = machine(&w, None);
    assert!(matches!(m.begin(s), Some(Begin::Sync { .. })));
    m.computed(1, 5, Err(ComputeError::Backend("out of memory".into())));
    let mut seen = Seen::default();
    drive(&mut m, &mut seen);
    assert!(!m.busy());
    assert!(matches!(
        &seen.sent[..],
        [(Addr::Coordinator, Envelope::StepFailed { reason, .. })] if reason == "out of memory"
    ));
}

#[test]
fn a_local_step_applies_its_own_gradient_and_is_not_synchronized() {
    let w = work(SyncPolicy::LocalSgd {
        local_steps: 4,
        outer: Outer::AVERAGE,
    });
    let (mut m, s) = machine(&w, None);
    assert_eq!(w.mode(s), StepMode::Local);
    let mut mean = whole_gradient();
    let Some(Begin::Local { model, .. }) = m.begin(s) else {
        panic!("a local step");
    };
    let local = m.local_update(model, &mut mean).expect("applied");
    m.local_done(&w, s, local, StepMode::Local, 5);
    let mut seen = Seen::default();
    drive(&mut m, &mut seen);
    assert_eq!(seen.made, vec![(s + 1, expected(1.0), false)]);
    assert!(seen.collectives.is_empty(), "nothing travels");
}

#[test]
fn an_averaging_step_sends_its_weighted_model_and_takes_the_group_s() {
    let w = work(SyncPolicy::LocalSgd {
        local_steps: 1,
        outer: Outer::AVERAGE,
    });
    let (mut m, s) = machine(&w, None);
    assert_eq!(w.mode(s), StepMode::Average);
    let mut mean = whole_gradient();
    let Some(Begin::Local { model, .. }) = m.begin(s) else {
        panic!("a local step");
    };
    let local = m.local_update(model, &mut mean).expect("applied");
    m.local_done(&w, s, local, StepMode::Average, 5);
    let mut seen = Seen::default();
    drive(&mut m, &mut seen);
    assert_eq!(seen.collectives, vec![id(s, 0)]);
    assert!(seen.made.is_empty(), "the round is out");
    let group: Vec<f32> = (0..PARAMS).map(|i| 10.0 + i as f32).collect();
    m.outcome(id(s, 0), Some(group.clone()));
    drive(&mut m, &mut seen);
    assert_eq!(seen.made, vec![(s + 1, group, true)]);
}

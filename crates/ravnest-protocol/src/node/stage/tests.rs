use std::collections::VecDeque;

use proptest::prelude::*;
use ravnest_core::{LayerRange, NodeId};

use super::*;

/// Stage `k` of `stages`, node `k`, layer `k`; micro-batches of `micro` samples of a batch of
/// `batch`.
fn work(k: u32, stages: u32, batch: u64, micro: u64) -> (Work, StageWork) {
    let mut w = Work::for_test(3, 0, 100, vec![NodeId(k)]);
    w.batch = batch;
    w.global_batch = batch;
    let sw = StageWork {
        stage: k,
        stages,
        layers: LayerRange::new(k, k + 1),
        prev: k.checked_sub(1).map(NodeId),
        next: (k + 1 < stages).then_some(NodeId(k + 1)),
        micro_batch: micro,
        out_bytes_per_sample: 10,
        in_bytes_per_sample: 20,
        sync_bytes: 0,
        fetch: Vec::new(),
    };
    w.stage = Some(sw.clone());
    (w, sw)
}

fn start(k: u32, stages: u32, step: u64, batch: u64, micro: u64, early: &mut Early) -> Stage {
    let (w, sw) = work(k, stages, batch, micro);
    Stage::start(&w, sw, step, &(0..10), 10, early).unwrap()
}

/// A stage's "compute": a forward adds its stage number + 1 to each value (the first stage
/// starts from the samples' first index); a backward passes the gradient on, doubled (the last
/// stage starts from its output).
fn compute(k: u32, pass: &Pass) -> Vec<f32> {
    match pass {
        Pass::Forward { samples, input, .. } => match input {
            Some(x) => x.iter().map(|v| v + k as f32 + 1.0).collect(),
            None => vec![samples.start as f32 + 1.0; 2],
        },
        Pass::Backward { output, grad, .. } => match grad {
            Some(g) => g.iter().map(|v| 2.0 * v).collect(),
            None => output.clone(),
        },
    }
}

#[test]
fn a_malformed_stage_is_refused() {
    let (w, mut sw) = work(0, 2, 4, 2);
    sw.stage = 2;
    let e = Stage::start(&w, sw.clone(), 0, &(0..10), 10, &mut Early::default()).unwrap_err();
    assert!(e.contains("stage 2 of 2"), "{e}");
    sw.stage = 0;
    let e = Stage::start(&w, sw, 0, &(5..12), 10, &mut Early::default()).unwrap_err();
    assert!(e.contains("parameters 5..12 of a model of 10"), "{e}");
}

#[test]
fn void_inputs_are_not_kept() {
    let mut early = Early::default();
    let input = |epoch, step| StageInput {
        epoch,
        step,
        is_grad: false,
        micro: 0,
        data: vec![1.0],
    };
    assert!(!early.keep(input(2, 9), 3, None), "an older epoch");
    assert!(!early.keep(input(3, 4), 3, Some(5)), "a step already done");
    assert!(early.keep(input(3, 5), 3, Some(5)));
    assert!(early.keep(input(4, 9), 3, Some(5)), "the next epoch");
    assert_eq!(early.len(), 2);
}

#[test]
fn an_input_of_another_step_is_refused() {
    let mut s = start(1, 2, 4, 4, 2, &mut Early::default());
    let input = StageInput {
        epoch: 3,
        step: 5,
        is_grad: false,
        micro: 0,
        data: vec![1.0],
    };
    assert!(!s.feed(input.clone()));
    assert!(s.feed(StageInput {
        step: 4,
        ..input.clone()
    }));
    assert!(!s.feed(StageInput { step: 4, ..input }), "a duplicate");
}

/// Run `stages` stages over one step of `batch` samples in micro-batches of `micro`, the
/// network delivering in the order `picks` chooses, each stage starting its step only after
/// `late[k]` deliveries (its inputs until then wait in its `Early`). Every pass runs once, in
/// the stage's 1F1B order, each gradient reaching the first stage is the one the chain makes,
/// and every stage ends done.
fn pipeline(stages: u32, batch: u64, micro: u64, late: &[usize], picks: &[usize]) {
    let mut early: Vec<Early> = (0..stages).map(|_| Early::default()).collect();
    let mut live: Vec<Option<Stage>> = (0..stages).map(|_| None).collect();
    let mut net: VecDeque<(u32, StageInput)> = VecDeque::new();
    let mut ran: Vec<Vec<(bool, u32)>> = vec![Vec::new(); stages as usize];
    let mut first_grads = Vec::new();
    let (mut deliveries, mut pick) = (0usize, picks.iter().cycle());
    loop {
        for k in 0..stages {
            let slot = &mut live[k as usize];
            if slot.is_none() && deliveries >= late[k as usize] {
                *slot = Some(start(k, stages, 7, batch, micro, &mut early[k as usize]));
            }
            let Some(s) = slot.as_mut() else { continue };
            while let Some(pass) = s.next_pass() {
                ran[k as usize].push((matches!(pass, Pass::Forward { .. }), pass.micro()));
                let out = compute(k, &pass);
                if let (Pass::Backward { .. }, 0) = (&pass, k) {
                    first_grads.push((pass.micro(), out.clone()));
                }
                if let Some((Addr::Node(to), env)) = s.ran(pass, out) {
                    net.push_back((to.0, StageInput::of(env).unwrap()));
                }
            }
        }
        if net.is_empty() {
            if live.iter().all(Option::is_some) {
                break;
            }
            deliveries = usize::MAX;
            continue;
        }
        let i = pick.next().copied().unwrap_or(0) % net.len();
        let (to, input) = net.remove(i).unwrap();
        deliveries = deliveries.saturating_add(1);
        match live[to as usize].as_mut() {
            Some(s) => assert!(s.feed(input)),
            None => assert!(early[to as usize].keep(input, 3, None)),
        }
    }
    let micros = micro_batches(batch, micro).len() as u32;
    for (k, ops) in ran.iter().enumerate() {
        let s = live[k].as_ref().unwrap();
        assert!(s.done(), "stage {k} is not done");
        let expect: Vec<(bool, u32)> =
            ravnest_core::pipeline::one_f_one_b(stages as usize, k, micros)
                .into_iter()
                .map(|op| match op {
                    ravnest_core::pipeline::Op::Forward(i) => (true, i),
                    ravnest_core::pipeline::Op::Backward(i) => (false, i),
                })
                .collect();
        assert_eq!(ops, &expect, "stage {k} ran out of order");
    }
    // The first stage's gradient: the chain's output (1 + the first sample + every stage's
    // k + 1 past the first), doubled once per stage after the last.
    let micro_len = micro.max(1).min(batch);
    for (m, g) in first_grads {
        let first = 7 * batch + m as u64 * micro_len;
        let out = first as f32 + 1.0 + (1..stages).map(|k| k as f32 + 1.0).sum::<f32>();
        let want = out * 2f32.powi(stages as i32 - 1);
        assert_eq!(g, vec![want; 2], "micro-batch {m}");
    }
}

#[test]
fn a_late_stage_finds_its_early_inputs() {
    pipeline(3, 8, 2, &[0, 3, 6], &[0]);
    pipeline(2, 4, 1, &[0, usize::MAX], &[1, 0]);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Any delivery order, any stage starting late: every stage runs its schedule once, in
    /// order, and the gradients the chain makes reach the first stage.
    #[test]
    fn stages_run_their_schedule_in_any_delivery_order(
        stages in 1u32..5,
        batch in 1u64..10,
        micro in 1u64..4,
        late in proptest::collection::vec(0usize..12, 5),
        picks in proptest::collection::vec(0usize..8, 1..16),
    ) {
        pipeline(stages, batch, micro, &late, &picks);
    }
}

//! Pipeline execution as pure logic: the 1F1B (one forward, one backward) schedule of a stage,
//! and [`StageRun`], the state machine a stage node drives through one step.
//!
//! A replica's samples are cut into M micro-batches. Stage k of S runs `min(S − k − 1, M)`
//! warm-up forwards, then alternates one forward and one backward, then drains the remaining
//! backwards. Stage k therefore holds at most `min(S − k, M)` micro-batches of activations,
//! which is what the planner's memory model charges it. The runner does no I/O: activations
//! and gradients are handed in as they arrive, and it says which operation can run next.

use std::collections::BTreeMap;
use std::ops::Range;

/// One operation of a stage's schedule, on micro-batch `i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Op {
    /// Forward pass of micro-batch `i`.
    Forward(u32),
    /// Backward pass of micro-batch `i`.
    Backward(u32),
}

/// The 1F1B schedule of stage `stage` of `stages` over `micro` micro-batches.
pub fn one_f_one_b(stages: usize, stage: usize, micro: u32) -> Vec<Op> {
    assert!(stage < stages, "stage {stage} of {stages}");
    let warmup = ((stages - stage - 1) as u32).min(micro);
    let mut ops = Vec::with_capacity(2 * micro as usize);
    ops.extend((0..warmup).map(Op::Forward));
    let (mut f, mut b) = (warmup, 0);
    while f < micro {
        ops.push(Op::Forward(f));
        ops.push(Op::Backward(b));
        f += 1;
        b += 1;
    }
    ops.extend((b..micro).map(Op::Backward));
    ops
}

/// The most micro-batches whose activations a schedule holds at once (forward done, backward
/// not yet).
pub fn peak_in_flight(ops: &[Op]) -> u32 {
    let (mut live, mut peak) = (0u32, 0u32);
    for op in ops {
        match op {
            Op::Forward(_) => {
                live += 1;
                peak = peak.max(live);
            }
            Op::Backward(_) => live = live.saturating_sub(1),
        }
    }
    peak
}

/// The micro-batches of `batch` samples at `micro_batch` samples each (the last one smaller),
/// as sample ranges relative to the replica's first sample.
pub fn micro_batches(batch: u64, micro_batch: u64) -> Vec<Range<u64>> {
    let m = micro_batch.max(1);
    (0..batch.div_ceil(m))
        .map(|i| i * m..((i + 1) * m).min(batch))
        .collect()
}

/// What a stage can run now.
#[derive(Debug, Clone, PartialEq)]
pub enum Ready {
    /// Forward of micro-batch `micro`; `input` is the previous stage's output (`None` on the
    /// first stage, which reads the samples).
    Forward {
        /// Micro-batch.
        micro: u32,
        /// Input activations.
        input: Option<Vec<f32>>,
    },
    /// Backward of micro-batch `micro`; `grad` is the gradient of this stage's output from the
    /// next stage (`None` on the last stage, which starts from the loss).
    Backward {
        /// Micro-batch.
        micro: u32,
        /// Gradient of the output.
        grad: Option<Vec<f32>>,
    },
}

/// Why an arrival was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StageError {
    /// A micro-batch index outside the step.
    #[error("micro-batch {micro} is outside this step's {count} micro-batches")]
    OutOfRange {
        /// Index.
        micro: u32,
        /// Micro-batches in the step.
        count: u32,
    },
    /// The same input arrived twice.
    #[error("{what} of micro-batch {micro} arrived twice")]
    Duplicate {
        /// "activation" or "gradient".
        what: &'static str,
        /// Index.
        micro: u32,
    },
    /// An input this stage never takes (activations into the first stage, gradients into the
    /// last).
    #[error("stage {stage} of {stages} takes no {what}")]
    Unexpected {
        /// "activation" or "gradient".
        what: &'static str,
        /// This stage.
        stage: usize,
        /// Stages.
        stages: usize,
    },
}

/// One stage's progress through one step's schedule.
#[derive(Debug, Clone)]
pub struct StageRun {
    stage: usize,
    stages: usize,
    micro: u32,
    ops: Vec<Op>,
    next: usize,
    acts: BTreeMap<u32, Vec<f32>>,
    grads: BTreeMap<u32, Vec<f32>>,
    seen_acts: Vec<bool>,
    seen_grads: Vec<bool>,
}

impl StageRun {
    /// Stage `stage` of `stages`, over `micro` micro-batches, in 1F1B order.
    pub fn new(stages: usize, stage: usize, micro: u32) -> Self {
        StageRun {
            stage,
            stages,
            micro,
            ops: one_f_one_b(stages, stage, micro),
            next: 0,
            acts: BTreeMap::new(),
            grads: BTreeMap::new(),
            seen_acts: vec![false; micro as usize],
            seen_grads: vec![false; micro as usize],
        }
    }

    fn check(&self, what: &'static str, micro: u32, seen: &[bool]) -> Result<(), StageError> {
        let edge = if what == "activation" {
            self.stage == 0
        } else {
            self.stage + 1 == self.stages
        };
        if edge {
            return Err(StageError::Unexpected {
                what,
                stage: self.stage,
                stages: self.stages,
            });
        }
        if micro >= self.micro {
            return Err(StageError::OutOfRange {
                micro,
                count: self.micro,
            });
        }
        if seen[micro as usize] {
            return Err(StageError::Duplicate { what, micro });
        }
        Ok(())
    }

    /// The previous stage's output for micro-batch `micro` arrived.
    pub fn activation(&mut self, micro: u32, data: Vec<f32>) -> Result<(), StageError> {
        self.check("activation", micro, &self.seen_acts)?;
        self.seen_acts[micro as usize] = true;
        self.acts.insert(micro, data);
        Ok(())
    }

    /// The next stage's gradient for micro-batch `micro` arrived.
    pub fn gradient(&mut self, micro: u32, data: Vec<f32>) -> Result<(), StageError> {
        self.check("gradient", micro, &self.seen_grads)?;
        self.seen_grads[micro as usize] = true;
        self.grads.insert(micro, data);
        Ok(())
    }

    /// The next operation, when its input is here; `None` while it waits (or when done). The
    /// caller runs it before asking again: the schedule's order is kept.
    pub fn next_ready(&mut self) -> Option<Ready> {
        let op = *self.ops.get(self.next)?;
        let ready = match op {
            Op::Forward(i) if self.stage == 0 => Ready::Forward {
                micro: i,
                input: None,
            },
            Op::Forward(i) => Ready::Forward {
                micro: i,
                input: Some(self.acts.remove(&i)?),
            },
            Op::Backward(i) if self.stage + 1 == self.stages => Ready::Backward {
                micro: i,
                grad: None,
            },
            Op::Backward(i) => Ready::Backward {
                micro: i,
                grad: Some(self.grads.remove(&i)?),
            },
        };
        self.next += 1;
        Some(ready)
    }

    /// Whether every operation ran.
    pub fn done(&self) -> bool {
        self.next == self.ops.len()
    }

    /// Micro-batches in the step.
    pub fn micro_batches(&self) -> u32 {
        self.micro
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_last_stage_alternates_from_the_start() {
        use Op::*;
        assert_eq!(
            one_f_one_b(3, 2, 3),
            vec![
                Forward(0),
                Backward(0),
                Forward(1),
                Backward(1),
                Forward(2),
                Backward(2)
            ]
        );
        assert_eq!(
            one_f_one_b(3, 0, 3),
            vec![
                Forward(0),
                Forward(1),
                Forward(2),
                Backward(0),
                Backward(1),
                Backward(2)
            ]
        );
        assert_eq!(
            one_f_one_b(4, 1, 5),
            vec![
                Forward(0),
                Forward(1),
                Forward(2),
                Backward(0),
                Forward(3),
                Backward(1),
                Forward(4),
                Backward(2),
                Backward(3),
                Backward(4)
            ]
        );
    }

    #[test]
    fn arrivals_that_make_no_sense_are_refused() {
        let mut first = StageRun::new(3, 0, 2);
        assert!(matches!(
            first.activation(0, vec![]),
            Err(StageError::Unexpected { .. })
        ));
        let mut mid = StageRun::new(3, 1, 2);
        assert_eq!(
            mid.gradient(2, vec![]),
            Err(StageError::OutOfRange { micro: 2, count: 2 })
        );
        mid.activation(1, vec![1.0]).unwrap();
        assert_eq!(
            mid.activation(1, vec![1.0]),
            Err(StageError::Duplicate {
                what: "activation",
                micro: 1
            })
        );
        let mut last = StageRun::new(3, 2, 2);
        assert!(last.gradient(0, vec![]).is_err());
    }

    #[test]
    fn micro_batches_cover_the_batch() {
        assert_eq!(micro_batches(10, 4), vec![0..4, 4..8, 8..10]);
        assert_eq!(micro_batches(0, 4), Vec::<Range<u64>>::new());
        assert_eq!(micro_batches(3, 0), vec![0..1, 1..2, 2..3]);
    }

    /// Messages in flight between stages: (to stage, is gradient, micro, value).
    type Wire = Vec<(usize, bool, u32, Vec<f32>)>;

    proptest! {
        /// Every stage runs each forward and each backward exactly once, forward first, and
        /// holds no more than min(S − k, M) micro-batches of activations.
        #[test]
        fn schedules_are_complete_and_bounded(s in 1usize..9, m in 0u32..20) {
            for k in 0..s {
                let ops = one_f_one_b(s, k, m);
                prop_assert_eq!(ops.len(), 2 * m as usize);
                for i in 0..m {
                    let f = ops.iter().position(|&o| o == Op::Forward(i));
                    let b = ops.iter().position(|&o| o == Op::Backward(i));
                    prop_assert!(f.is_some() && b.is_some() && f < b, "stage {} micro {}", k, i);
                }
                prop_assert!(peak_in_flight(&ops) <= ((s - k) as u32).min(m));
            }
        }

        /// S stages exchanging activations and gradients in any delivery order finish the
        /// step (no deadlock), and each stage's backward of micro-batch i sees exactly the
        /// value the forward of micro-batch i produced, carried through every stage and back.
        #[test]
        fn stages_in_any_delivery_order_finish_with_the_right_values(
            s in 1usize..6,
            m in 1u32..9,
            picks in prop::collection::vec(any::<u32>(), 0..400),
        ) {
            let mut runs: Vec<StageRun> = (0..s).map(|k| StageRun::new(s, k, m)).collect();
            let mut wire: Wire = Vec::new();
            let mut picks = picks.into_iter();
            let mut guard = 0;
            while !runs.iter().all(StageRun::done) {
                guard += 1;
                prop_assert!(guard < 10_000, "no progress");
                // Run everything that is ready, then deliver one message chosen by the picks.
                let mut progressed = false;
                for (k, run) in runs.iter_mut().enumerate() {
                    while let Some(r) = run.next_ready() {
                        progressed = true;
                        match r {
                            // Forward: value = micro index + 1, plus one per stage passed.
                            Ready::Forward { micro, input } => {
                                let v = input.map_or(micro as f32 + 1.0, |x| x[0] + 1.0);
                                if k + 1 < s {
                                    wire.push((k + 1, false, micro, vec![v]));
                                } else {
                                    // The loss: the last stage turns the value around.
                                    prop_assert_eq!(v, micro as f32 + s as f32);
                                }
                            }
                            Ready::Backward { micro, grad } => {
                                let g = grad.map_or(micro as f32 + s as f32, |x| x[0]);
                                prop_assert_eq!(g, micro as f32 + s as f32, "stage {}", k);
                                if k > 0 {
                                    wire.push((k - 1, true, micro, vec![g]));
                                }
                            }
                        }
                    }
                }
                if !wire.is_empty() {
                    let i = picks.next().unwrap_or(0) as usize % wire.len();
                    let (to, is_grad, micro, v) = wire.remove(i);
                    if is_grad {
                        runs[to].gradient(micro, v).unwrap();
                    } else {
                        runs[to].activation(micro, v).unwrap();
                    }
                } else {
                    prop_assert!(progressed || runs.iter().all(StageRun::done), "deadlock");
                }
            }
            prop_assert!(wire.is_empty());
        }
    }
}

//! A pipeline stage's step as a machine: which forward or backward runs next (1F1B order, as
//! its inputs arrive), what each one sends to the neighbouring stages, and where an input that
//! came before its step started here waits.
//!
//! The driver (the runtime's node) runs each [`Pass`] that [`Stage::next_pass`] hands it on its
//! compute, gives the result back to [`Stage::ran`], and sends what that returns. The model, and
//! the gradient the passes accumulate, are the driver's: this machine holds the activations
//! and the order only. It reads no clock and does no I/O.

use std::collections::BTreeMap;
use std::ops::Range;

use ravnest_core::LayerRange;
use ravnest_core::pipeline::{Ready, StageRun, micro_batches};

use crate::digest::sample_range;
use crate::msg::{Addr, Envelope, StageWork, Work};

/// Inputs kept for steps that have not started here, at most (a neighbour far ahead, or an
/// epoch's work still on its way).
pub const EARLY_MAX: usize = 1 << 16;

/// An activation (or, `is_grad`, the gradient of one) from a neighbouring stage.
#[derive(Debug, Clone, PartialEq)]
pub struct StageInput {
    /// The epoch it belongs to.
    pub epoch: u64,
    /// The step.
    pub step: u64,
    /// A gradient from the next stage (else an activation from the previous one).
    pub is_grad: bool,
    /// The micro-batch.
    pub micro: u32,
    /// The values.
    pub data: Vec<f32>,
}

impl StageInput {
    /// The stage input `env` carries; any other envelope back.
    pub fn of(env: Envelope) -> Result<StageInput, Envelope> {
        let is_grad = matches!(env, Envelope::ActivationGrad { .. });
        match env {
            Envelope::Activation {
                epoch,
                step,
                micro,
                data,
                ..
            }
            | Envelope::ActivationGrad {
                epoch,
                step,
                micro,
                data,
                ..
            } => Ok(StageInput {
                epoch,
                step,
                is_grad,
                micro,
                data,
            }),
            env => Err(env),
        }
    }
}

/// Inputs that came before their step started here.
#[derive(Debug, Default)]
pub struct Early(Vec<StageInput>);

impl Early {
    /// Keep `input` for its step, unless it is void: of an epoch older than `running` (the
    /// epoch being run; not the newest one seen, since a node finishes its epoch's steps below
    /// the next epoch's start), of a step this node is past (`latest`: the newest version it
    /// holds), or beyond [`EARLY_MAX`]. Whether it was kept.
    pub fn keep(&mut self, input: StageInput, running: u64, latest: Option<u64>) -> bool {
        let behind = latest.is_some_and(|l| input.step < l);
        let keep = input.epoch >= running && !behind && self.0.len() < EARLY_MAX;
        if keep {
            self.0.push(input);
        }
        keep
    }

    /// Step `step` of `epoch` is the first this node runs of that epoch: inputs of earlier
    /// epochs, and of its earlier steps, are void.
    pub fn activated(&mut self, epoch: u64, step: u64) {
        self.0
            .retain(|e| e.epoch > epoch || (e.epoch == epoch && e.step >= step));
    }

    /// The inputs kept for step `step` of `epoch`, in the order they came.
    fn take(&mut self, epoch: u64, step: u64) -> Vec<StageInput> {
        let (mine, later) = std::mem::take(&mut self.0)
            .into_iter()
            .partition(|e| e.epoch == epoch && e.step == step);
        self.0 = later;
        mine
    }

    /// Inputs kept.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// One forward or backward of a micro-batch, for the driver to run.
#[derive(Debug, Clone, PartialEq)]
pub enum Pass {
    /// The forward of micro-batch `micro` over global samples `samples`; `input` is the
    /// previous stage's output (`None` on the first stage, which reads the samples).
    Forward {
        /// The micro-batch.
        micro: u32,
        /// Its global samples.
        samples: Range<u64>,
        /// The previous stage's output.
        input: Option<Vec<f32>>,
    },
    /// The backward of micro-batch `micro`: the forward's `input` and `output`, and the
    /// gradient of the output from the next stage (`None` on the last stage: from the loss).
    Backward {
        /// The micro-batch.
        micro: u32,
        /// Its global samples.
        samples: Range<u64>,
        /// The forward's input.
        input: Option<Vec<f32>>,
        /// The forward's output.
        output: Vec<f32>,
        /// The gradient of the output.
        grad: Option<Vec<f32>>,
    },
}

impl Pass {
    /// The pass's micro-batch.
    pub fn micro(&self) -> u32 {
        match self {
            Pass::Forward { micro, .. } | Pass::Backward { micro, .. } => *micro,
        }
    }

    /// Its global samples.
    pub fn samples(&self) -> Range<u64> {
        match self {
            Pass::Forward { samples, .. } | Pass::Backward { samples, .. } => samples.clone(),
        }
    }
}

/// One stage's step: step `step` of `epoch` on the layers of [`StageWork`].
#[derive(Debug)]
pub struct Stage {
    /// The epoch.
    pub epoch: u64,
    /// The step.
    pub step: u64,
    /// The step's global batch (a synchronized step's gradient is weighted by 1 / it).
    pub global_batch: u64,
    /// What this stage does.
    pub sw: StageWork,
    run: StageRun,
    /// Global sample ranges of the micro-batches.
    micros: Vec<Range<u64>>,
    /// Forward input and output per micro-batch awaiting its backward.
    saved: BTreeMap<u32, (Option<Vec<f32>>, Vec<f32>)>,
}

impl Stage {
    /// Step `step` of `w` on the stage `sw`, whose layers' parameters sit at `range` of a
    /// model of `params` values; the inputs `early` kept for it are fed. `Err`: the work is
    /// malformed (a stage out of range, no layers, parameters outside the model).
    pub fn start(
        w: &Work,
        sw: StageWork,
        step: u64,
        range: &Range<usize>,
        params: usize,
        early: &mut Early,
    ) -> Result<Stage, String> {
        let layers = sw.layers;
        if sw.stage >= sw.stages || layers.is_empty() || range.end > params || range.is_empty() {
            return Err(format!(
                "malformed stage work: stage {} of {}, layers {layers}, parameters {}..{} of a model of {params}",
                sw.stage, sw.stages, range.start, range.end,
            ));
        }
        let first = sample_range(step, w.global_batch, w.offset, w.batch).start;
        let micros: Vec<Range<u64>> = micro_batches(w.batch, sw.micro_batch)
            .into_iter()
            .map(|r| first + r.start..first + r.end)
            .collect();
        let run = StageRun::new(sw.stages as usize, sw.stage as usize, micros.len() as u32);
        let mut stage = Stage {
            epoch: w.epoch,
            step,
            global_batch: w.global_batch,
            sw,
            run,
            micros,
            saved: BTreeMap::new(),
        };
        for input in early.take(w.epoch, step) {
            // An input the schedule refuses (duplicate, out of range) is dropped: the step then
            // waits, and the coordinator's halt ends it.
            stage.feed(input);
        }
        Ok(stage)
    }

    /// This stage's layers.
    pub fn layers(&self) -> LayerRange {
        self.sw.layers
    }

    /// Whether `input` belongs to this step.
    pub fn takes(&self, input: &StageInput) -> bool {
        input.epoch == self.epoch && input.step == self.step
    }

    /// An input of this step arrived; whether the schedule took it (a duplicate, one out of
    /// range, or one of another step is refused).
    pub fn feed(&mut self, input: StageInput) -> bool {
        if !self.takes(&input) {
            return false;
        }
        let r = if input.is_grad {
            self.run.gradient(input.micro, input.data)
        } else {
            self.run.activation(input.micro, input.data)
        };
        r.is_ok()
    }

    /// The next pass, when its input is here; `None` while it waits, or when done. The driver
    /// runs it and hands it back to [`Stage::ran`] before asking again.
    pub fn next_pass(&mut self) -> Option<Pass> {
        let pass = match self.run.next_ready()? {
            Ready::Forward { micro, input } => Pass::Forward {
                micro,
                samples: self.micros[micro as usize].clone(),
                input,
            },
            Ready::Backward { micro, grad } => {
                let (input, output) = self.saved.remove(&micro).unwrap_or_default();
                Pass::Backward {
                    micro,
                    samples: self.micros[micro as usize].clone(),
                    input,
                    output,
                    grad,
                }
            }
        };
        Some(pass)
    }

    /// `pass` ran and gave `out` (a forward: its output; a backward: the gradient of its
    /// input): what goes to a neighbour (the output to the next stage, the gradient to the
    /// previous one; nothing past either end).
    pub fn ran(&mut self, pass: Pass, out: Vec<f32>) -> Option<(Addr, Envelope)> {
        let n = {
            let s = pass.samples();
            s.end - s.start
        };
        let (epoch, step) = (self.epoch, self.step);
        match pass {
            Pass::Forward { micro, input, .. } => {
                let send = self.sw.next.map(|next| {
                    let env = Envelope::Activation {
                        epoch,
                        step,
                        micro,
                        data: out.clone(),
                        virtual_bytes: self.sw.out_bytes_per_sample * n,
                    };
                    (Addr::Node(next), env)
                });
                self.saved.insert(micro, (input, out));
                send
            }
            Pass::Backward { micro, .. } => self.sw.prev.map(|prev| {
                let env = Envelope::ActivationGrad {
                    epoch,
                    step,
                    micro,
                    data: out,
                    virtual_bytes: self.sw.in_bytes_per_sample * n,
                };
                (Addr::Node(prev), env)
            }),
        }
    }

    /// Whether every pass ran.
    pub fn done(&self) -> bool {
        self.run.done()
    }
}

#[cfg(test)]
mod tests;

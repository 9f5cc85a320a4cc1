//! A pipeline stage's step on the machine: its passes' order ([`Stage`]), its early inputs,
//! and its layers' gradient when the passes are done: reduced with the stage's sync group, or
//! applied where it is (clipped by the norm over every stage first), or, under local SGD,
//! applied and averaged on a round's step.

use ravnest_core::LayerRange;
use ravnest_core::collective::CollId;

use super::{Machine, Pipe, Running};
use crate::msg::{StageWork, StepMode, Work};
use crate::node::stage::{Stage, StageInput};
use crate::node::step::Collect;
use crate::node::values::Values;

/// A stage step's identity, for the version it makes.
#[derive(Debug, Clone, Copy)]
pub(super) struct StageStep {
    pub(super) epoch: u64,
    pub(super) step: u64,
    pub(super) layers: LayerRange,
    pub(super) compute_ns: u64,
}

impl StageStep {
    pub(super) fn of<M, G>(p: &Pipe<M, G>) -> Self {
        StageStep {
            epoch: p.stage.epoch,
            step: p.stage.step,
            layers: p.stage.layers(),
            compute_ns: p.compute_ns,
        }
    }
}

impl<V: Values> Machine<V> {
    /// Begin a pipeline stage's step `s` of `w` on `model`: its passes run in 1F1B order as
    /// their inputs arrive (the driver runs them from [`Machine::pipe`]).
    pub(super) fn start_stage(&mut self, w: &Work, sw: StageWork, s: u64, model: V::Model) {
        let range = self.values.param_range(sw.layers);
        let params = self.values.params();
        match Stage::start(w, sw, s, &range, params, &mut self.early) {
            Ok(stage) => {
                self.pipe = Some(Pipe {
                    stage,
                    model,
                    range,
                    grad: None,
                    compute_ns: 0,
                    clip: None,
                })
            }
            Err(e) => self.fail(w.epoch, e),
        }
    }

    /// An activation or gradient from a neighbouring stage: fed to its step (true: the driver
    /// runs the passes now ready), or kept until that step starts here.
    pub(super) fn stage_input(&mut self, input: StageInput) -> bool {
        if let Some(p) = self.pipe.as_mut()
            && p.stage.takes(&input)
        {
            return p.stage.feed(input);
        }
        let running = self.core.work().map_or(0, |w| w.epoch);
        self.early.keep(input, running, self.core.latest());
        false
    }

    /// A stage's pass failed: the step cannot go on.
    pub fn pass_failed(&mut self, reason: String) {
        if let Some(p) = self.pipe.take() {
            self.fail(p.stage.epoch, reason);
        }
    }

    /// The driver ran every pass whose input is here: when the schedule is done, reduce the
    /// layers' gradient with the stage's sync group (a group of one applies it where it is:
    /// nothing travels), or, under local SGD, apply it and maybe average the layers. Clipped,
    /// a stage that applies its own gradient waits (in [`Machine::pipe`]) for the other stages'
    /// pieces of the norm ([`super::clip`]).
    pub fn passes_ran(&mut self) {
        if !self
            .pipe
            .as_ref()
            .is_some_and(|p| p.stage.done() && p.clip.is_none())
        {
            return;
        }
        let (Some(mut p), Some(w)) = (self.pipe.take(), self.core.work().cloned()) else {
            return;
        };
        let Some(grad) = p.grad.take() else {
            let reason = format!(
                "step {} of layers {} computed no gradient",
                p.stage.step,
                p.stage.layers()
            );
            return self.fail(p.stage.epoch, reason);
        };
        let layers = Some(p.stage.layers());
        let mode = w.mode(p.stage.step);
        let scale = match mode {
            StepMode::Sync => 1.0 / p.stage.global_batch.max(1) as f32,
            _ => 1.0 / w.batch.max(1) as f32,
        };
        if mode == StepMode::Sync && w.ring.len() > 1 {
            let contribution = self.values.stage_grad_values(grad, scale);
            let (epoch, step) = (p.stage.epoch, p.stage.step);
            let c = Collect::new(
                (epoch, step),
                StepMode::Sync,
                layers,
                vec![p.range.clone()],
                false,
            );
            let sync_bytes = p.stage.sw.sync_bytes;
            self.running = Some(Running::computed(c, p.model, p.compute_ns));
            let id = CollId {
                epoch,
                step,
                bucket: 0,
            };
            // A stage's gradient stands for its layers' bytes, not the whole model's.
            return self.collective(id, contribution, sync_bytes, None);
        }
        // Applied here: the only holder of these layers makes the next version from this one
        // in place of it (nobody can need version `step` once `step + 1` exists).
        if self.core.versions().keeps_one() {
            self.core.take(p.stage.step);
        }
        if self.values.max_grad_norm().is_some() {
            p.clip = Some(self.values.stage_grad_values(grad, scale));
            self.pipe = Some(p);
            return self.clip_stage();
        }
        let made = StageStep::of(&p);
        let mut next = p.model;
        if let Err(e) = self
            .values
            .apply_stage_grad(&mut next, made.layers, grad, scale)
        {
            return self.fail(made.epoch, e.to_string());
        }
        self.stage_applied(&w, made, next)
    }

    /// A stage applied its own gradient: make its next version, or, under local SGD, average
    /// the layers on a round's step.
    pub(super) fn stage_applied(&mut self, w: &Work, p: StageStep, next: V::Model) {
        let layers = Some(p.layers);
        let mode = w.mode(p.step);
        if matches!(mode, StepMode::Average | StepMode::Launch | StepMode::Merge) {
            self.round(w, p.step, next, layers, p.compute_ns, mode);
            return self.try_finish();
        }
        // A synchronized step's version is one every replica agreed on; a local one's is not.
        let synced = mode == StepMode::Sync;
        self.made((p.epoch, p.step), next, layers, synced, p.compute_ns, false);
    }
}

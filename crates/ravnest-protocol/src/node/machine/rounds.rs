//! Local SGD's outer rounds on a node: what a replica contributes, the outer step on the
//! group's sum, and overlapped rounds, whose bookkeeping (launched, merged, the values
//! carried after a merge) is [`Rounds`](crate::node::outer::Rounds); here the values move in
//! and out of the model and the exchanges start.

use ravnest_core::LayerRange;
use ravnest_core::collective::CollId;

use super::{Act, Machine, Running};
use crate::msg::{StepMode, SyncPolicy, Work};
use crate::node::outer::Anchor;
use crate::node::step::Collect;
use crate::node::values::Values;

impl<V: Values> Machine<V> {
    /// The round step `s` ends (`mode`: waited for, launched, or merged), from `local`, this
    /// node's model after the step's local update (`layers` of it, or the whole; its compute
    /// `ns`). The values travel: they are exported, and the round's values are imported back.
    /// Under an outer optimizer, or packed, what travels is the change since the round's
    /// anchor, weighted by this node's batch share.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn round(
        &mut self,
        w: &Work,
        s: u64,
        local: V::Model,
        layers: Option<LayerRange>,
        ns: u64,
        mode: StepMode,
    ) {
        if mode == StepMode::Merge {
            return self.merge(w, s, local, layers, ns);
        }
        let share = w.batch as f32 / w.global_batch.max(1) as f32;
        let Some(mut contribution) = self.values.export(&local, layers) else {
            let reason = format!("this node does not hold {layers:?} to average");
            return self.fail(w.epoch, reason);
        };
        let anchor = match self.anchor(w, s, layers) {
            Ok(a) => a,
            Err(e) => return self.fail(w.epoch, e),
        };
        let at = (mode == StepMode::Launch).then(|| contribution.clone());
        match &anchor {
            Some(a) => {
                if !ravnest_core::outer::contribution(&mut contribution, &a.values, share) {
                    let reason = format!("anchor {} has another length", a.version);
                    return self.fail(w.epoch, reason);
                }
            }
            None => contribution.iter_mut().for_each(|x| *x *= share),
        }
        let id = CollId {
            epoch: w.epoch,
            step: s,
            bucket: 0,
        };
        let virtual_bytes = self.round_bytes(contribution.len(), layers);
        // Launched, the replica goes on from its own values: nothing to wait for.
        let targets = match mode {
            StepMode::Launch => Vec::new(),
            _ => std::iter::once(0..contribution.len()).collect(),
        };
        let c = Collect::new((w.epoch, s), mode, layers, targets, false);
        let mut running = Running::computed(c, local, ns);
        match (mode, anchor, at) {
            (StepMode::Launch, Some(anchor), Some(at)) => {
                self.rounds.launch(w.epoch, s, layers, anchor, at);
            }
            (StepMode::Launch, ..) => {
                return self.fail(w.epoch, "an overlapped round without an anchor".into());
            }
            (_, anchor, _) => running.anchor = anchor,
        }
        self.running = Some(running);
        self.collective(id, contribution, virtual_bytes, None);
    }

    /// The bytes an outer round of `len` exchanged values of `layers` stands for: the
    /// gradient's bytes per parameter's worth of them.
    fn round_bytes(&self, len: usize, layers: Option<LayerRange>) -> u64 {
        let params = self.params_of(layers);
        let bytes = self.sizes.grad_bytes as f64 * len as f64 / params.max(1) as f64;
        (bytes * self.sizes.round_factor) as u64
    }

    /// How many parameters `layers` (`None`: the whole model) have: the first values of
    /// their export.
    fn params_of(&self, layers: Option<LayerRange>) -> usize {
        match layers {
            Some(l) => self.values.param_range(l).len(),
            None => self.values.params(),
        }
    }

    /// Step `s` merges the epoch's launched round (its sum may still be on its way).
    fn merge(&mut self, w: &Work, s: u64, local: V::Model, layers: Option<LayerRange>, ns: u64) {
        let (k, ready) = match self.rounds.to_merge(w.epoch, s) {
            Ok(m) => m,
            Err(e) => return self.fail(w.epoch, e),
        };
        let c = Collect::waiting((w.epoch, s), StepMode::Merge, layers, usize::from(!ready));
        self.running = Some(Running {
            merge: Some(k),
            ..Running::computed(c, local, ns)
        });
        if ready {
            self.apply_merge(w);
        }
    }

    /// The running merge step's round is in: its version becomes the round's outer step, and
    /// this replica's own values (its progress since the launch on top) wait for the next step.
    fn apply_merge(&mut self, w: &Work) {
        let values = self.values.clone();
        let Some(r) = self.running.as_mut() else {
            return;
        };
        let Some(k) = r.merge else { return };
        let merged = values
            .export(&r.next, r.c.layers)
            .ok_or_else(|| format!("this node does not hold {:?} to merge", r.c.layers))
            .and_then(|own| self.rounds.merge(k, w, r.c.step + 1, r.c.layers, own))
            .and_then(|sum| {
                let model = values.import(Some(&r.next), r.c.layers, sum);
                model.map_err(|e| e.to_string())
            });
        match merged {
            Ok(model) => r.next = model,
            Err(e) => self.fail_step(w.epoch, e),
        }
    }

    /// The model step `s` of `w` starts from: version `s` (`base`), or, right after a merge,
    /// this replica's own values in place of it.
    pub(super) fn start_from(
        &mut self,
        w: &Work,
        s: u64,
        base: V::Model,
    ) -> Result<V::Model, String> {
        match self.rounds.carry_for(w.epoch, s) {
            Some((layers, values)) => self
                .values
                .import(Some(&base), layers, values)
                .map_err(|e| e.to_string()),
            None => Ok(base),
        }
    }

    /// A collective ended (`sum`: its result; `None`: aborted). One of an overlapped round:
    /// its sum is kept for the step that merges it (which goes on if it was waiting for it);
    /// an abort fails the epoch (the merge would wait for ever); `None` is returned. Any
    /// other: `Some(sum)`, for the running step.
    pub(super) fn round_outcome(
        &mut self,
        id: CollId,
        sum: Option<Vec<f32>>,
    ) -> Option<Option<Vec<f32>>> {
        if !self.rounds.awaits(id.epoch, id.step) {
            return Some(sum);
        }
        let Some(sum) = sum else {
            // Its epoch's rounds are void. A halted or replaced epoch's rounds end so (their
            // outer steps are lost with the epoch); the running epoch's cannot go on.
            self.rounds.abort(id.epoch);
            if self.running.as_ref().is_some_and(|r| r.c.epoch == id.epoch) {
                self.running = None;
            }
            // (After a halt its collectives abort by order: nothing to report.)
            if !self.core.halted() && self.core.work().is_some_and(|w| w.epoch == id.epoch) {
                self.acts.push(Act::Aborted);
                let reason = format!("the outer round of step {} could not run", id.step);
                self.fail(id.epoch, reason);
            }
            return None;
        };
        self.rounds.sum_came(id.step, sum);
        let waiting = self
            .running
            .as_mut()
            .filter(|r| r.c.epoch == id.epoch && r.merge == Some(id.step) && !r.c.settled());
        if let Some(r) = waiting {
            r.c.landed();
            if let Some(w) = self.core.work().cloned() {
                self.apply_merge(&w);
            }
            self.try_finish();
        }
        None
    }

    /// The anchor of the outer round that step `s` ends: the newest version the schedule
    /// synchronized (the epoch's first, a waited round's, or a merge's), which every replica
    /// agreed on (`None`: a plain average of values).
    fn anchor(
        &self,
        w: &Work,
        s: u64,
        layers: Option<LayerRange>,
    ) -> Result<Option<Anchor>, String> {
        let SyncPolicy::LocalSgd { outer, .. } = w.sync else {
            return Ok(None);
        };
        if outer.is_plain_average() {
            return Ok(None);
        }
        let version = w.sync.last_synchronized(w.step, w.end, s);
        let values = self
            .core
            .version(version)
            .and_then(|v| self.values.export(&v.model, layers))
            .ok_or_else(|| {
                format!("this node no longer holds version {version}, the anchor of step {s}'s outer round")
            })?;
        Ok(Some(Anchor {
            version,
            values,
            params: self.params_of(layers),
        }))
    }
}

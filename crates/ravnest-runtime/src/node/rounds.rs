//! Local SGD's outer rounds on a node: what a replica contributes, the outer step on the
//! group's sum, and overlapped rounds, whose bookkeeping (launched, merged, the values
//! carried after a merge) is the protocol's [`ravnest_protocol::node::outer::Rounds`]; here
//! the values move in and out of the model and the exchanges run.

use ravnest_core::LayerRange;
use ravnest_core::collective::CollId;

use super::NodeActor;
use super::state::{NodeState, Running};
use crate::collective::Outcome;
use crate::counters::Count;
use crate::seams::{Compute, Transport};
use ravnest_protocol::msg::{StepMode, SyncPolicy, Work};
use ravnest_protocol::node::outer::Anchor;
use ravnest_protocol::node::step::Collect;

/// A node's state, as this backend's node holds it.
type State<C> = NodeState<<C as Compute>::Model, <C as Compute>::StageGrad>;

impl<T: Transport, C: Compute> NodeActor<T, C> {
    /// The round step `s` ends (`mode`: waited for, launched, or merged), from `local`, this
    /// node's model after the step's local update (`layers` of it, or the whole). The values
    /// travel: they are exported, and the round's values are imported back. Under an outer
    /// optimizer, or packed, what travels is the change since the round's anchor, weighted by
    /// this node's batch share.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn round(
        &self,
        st: &mut State<C>,
        w: &Work,
        s: u64,
        local: C::Model,
        layers: Option<LayerRange>,
        ns: u64,
        mode: StepMode,
    ) {
        if mode == StepMode::Merge {
            return self.merge(st, w, s, local, layers, ns);
        }
        let share = w.batch as f32 / w.global_batch.max(1) as f32;
        let Some(mut contribution) = self.compute.export(&local, layers) else {
            return self.fail(
                w.epoch,
                format!("this node does not hold {layers:?} to average"),
            );
        };
        let anchor = match self.anchor(st, w, s, layers) {
            Ok(a) => a,
            Err(e) => return self.fail(w.epoch, e),
        };
        let at = (mode == StepMode::Launch).then(|| contribution.clone());
        match &anchor {
            Some(a) => {
                if !ravnest_core::outer::contribution(&mut contribution, &a.values, share) {
                    return self.fail(w.epoch, format!("anchor {} has another length", a.version));
                }
            }
            None => {
                for x in &mut contribution {
                    *x *= share;
                }
            }
        }
        let group = self.group(st, w);
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
                st.rounds.launch(w.epoch, s, layers, anchor, at);
            }
            (StepMode::Launch, ..) => {
                return self.fail(w.epoch, "an overlapped round without an anchor".into());
            }
            (_, anchor, _) => running.anchor = anchor,
        }
        st.running = Some(running);
        self.start_collective(st, id, group, contribution, virtual_bytes, None);
    }

    /// The bytes an outer round of `len` exchanged values of `layers` stands for: the
    /// gradient's bytes per parameter's worth of them.
    fn round_bytes(&self, len: usize, layers: Option<LayerRange>) -> u64 {
        let params = self.params_of(layers);
        (self.grad_bytes as f64 * len as f64 / params.max(1) as f64 * self.round_factor) as u64
    }

    /// How many parameters `layers` (`None`: the whole model) have: the first values of
    /// their export.
    fn params_of(&self, layers: Option<LayerRange>) -> usize {
        match layers {
            Some(l) => self.compute.param_range(l).len(),
            None => self.compute.params(),
        }
    }

    /// Step `s` merges the epoch's launched round (its sum may still be on its way).
    fn merge(
        &self,
        st: &mut State<C>,
        w: &Work,
        s: u64,
        local: C::Model,
        layers: Option<LayerRange>,
        ns: u64,
    ) {
        let (k, ready) = match st.rounds.to_merge(w.epoch, s) {
            Ok(m) => m,
            Err(e) => return self.fail(w.epoch, e),
        };
        let c = Collect::waiting((w.epoch, s), StepMode::Merge, layers, usize::from(!ready));
        st.running = Some(Running {
            merge: Some(k),
            ..Running::computed(c, local, ns)
        });
        if ready {
            self.apply_merge(st, w);
        }
    }

    /// The running merge step's round is in: its version becomes the round's outer step, and
    /// this replica's own values (its progress since the launch on top) wait for the next step.
    fn apply_merge(&self, st: &mut State<C>, w: &Work) {
        let Some(r) = st.running.as_mut() else { return };
        let Some(k) = r.merge else { return };
        let merged = self
            .compute
            .export(&r.next, r.c.layers)
            .ok_or_else(|| format!("this node does not hold {:?} to merge", r.c.layers))
            .and_then(|own| st.rounds.merge(k, w, r.c.step + 1, r.c.layers, own))
            .and_then(|sum| {
                let model = self.compute.import(Some(&r.next), r.c.layers, sum);
                model.map_err(|e| e.to_string())
            });
        match merged {
            Ok(model) => r.next = model,
            Err(e) => {
                st.running = None;
                self.fail(w.epoch, e);
            }
        }
    }

    /// The model step `s` starts from: version `s`, or, right after a merge, this replica's
    /// own values in place of it.
    pub(super) fn start_from(
        &self,
        st: &mut State<C>,
        w: &Work,
        s: u64,
        base: C::Model,
    ) -> Result<C::Model, String> {
        match st.rounds.carry_for(w.epoch, s) {
            Some((layers, values)) => self
                .compute
                .import(Some(&base), layers, values)
                .map_err(|e| e.to_string()),
            None => Ok(base),
        }
    }

    /// A collective of an overlapped round ended: its sum is kept for the step that merges it
    /// (which goes on if it was waiting for it); an abort fails the epoch (the merge would wait
    /// for ever). `false`: not such a round.
    pub(super) async fn on_round_outcome(&self, st: &mut State<C>, outcome: &mut Outcome) -> bool {
        let id = match outcome {
            Outcome::Done { id, .. } | Outcome::Aborted { id } => *id,
        };
        if !st.rounds.awaits(id.epoch, id.step) {
            return false;
        }
        let Outcome::Done { sum, .. } = outcome else {
            // Its epoch's rounds are void. A halted or replaced epoch's rounds end so (their
            // outer steps are lost with the epoch); the running epoch's cannot go on.
            st.rounds.abort(id.epoch);
            if st.running.as_ref().is_some_and(|r| r.c.epoch == id.epoch) {
                st.running = None;
            }
            // (After a halt its collectives abort by order: nothing to report.)
            if !st.core.halted() && st.core.work().is_some_and(|w| w.epoch == id.epoch) {
                self.record(Count::Aborted);
                self.fail(
                    id.epoch,
                    format!("the outer round of step {} could not run", id.step),
                );
            }
            return true;
        };
        st.rounds.sum_came(id.step, std::mem::take(sum));
        let waiting = st
            .running
            .as_ref()
            .is_some_and(|r| r.c.epoch == id.epoch && r.merge == Some(id.step) && !r.c.settled());
        if waiting {
            if let Some(r) = st.running.as_mut() {
                r.c.landed();
            }
            if let Some(w) = st.core.work().cloned() {
                self.apply_merge(st, &w);
            }
            self.try_finish(st).await;
        }
        true
    }

    /// The anchor of the outer round that step `s` ends: the newest version the schedule
    /// synchronized (the epoch's first, a waited round's, or a merge's), which every replica
    /// agreed on (`None`: a plain average of values).
    fn anchor(
        &self,
        st: &State<C>,
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
        let values = st.core.version(version)
            .and_then(|v| self.compute.export(&v.model, layers))
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

//! A node's step in progress, as a machine: what it does with each result that comes back
//! (a bucket's reduced gradient, a sharded bucket's all-gather, an averaging round's sum, a
//! piece of the norm, a neighbouring stage's activations) and what it asks of its driver.
//!
//! The driver (the runtime's node actor) computes: a data-parallel step's forward and
//! backward, whose buckets it hands to their collectives itself as backward makes them, and a
//! pipeline stage's passes. Everything between is decided here, with the backend's values
//! ([`Values`]) and the node's decisions ([`NodeCore`]): which version a step starts from,
//! each result applied to the version being made (clipped by the global norm once every part
//! of it is in, a sharded owner's part updated and its all-gather started), local SGD's outer
//! rounds, a stage's gradient reduced with its sync group or applied where it is, and the new
//! version handed back once every result is in. What the driver must do comes out as
//! [`Act`]s ([`Machine::acts`]), in the order they were decided: envelopes, collectives to
//! start, what to count, and the version made.
//!
//! Reads no clock and does no I/O: the same inputs and values give the same acts.
//!
//! - Data parallel ([`Machine::begin`], [`Machine::computed`], [`Machine::outcome`]): the step
//!   is done when its compute ended and [`Collect`] is settled.
//! - Local SGD ([`Machine::local_update`], [`Machine::local_done`], [`rounds`]).
//! - Clipping ([`clip`]) and sharded steps ([`sharded`]).
//! - A pipeline stage ([`Begin::Stage`], [`Machine::on_envelope`], [`Machine::passes_ran`]):
//!   its passes run in 1F1B order ([`Stage`]) as their inputs arrive.

mod clip;
mod decisions;
mod rounds;
mod sharded;
mod stage;

use std::ops::Range;
use std::sync::Arc;

use ravnest_core::collective::{CollId, RingPart};
use ravnest_core::{LayerRange, NodeId};

use super::core::{Made, NodeCore};
use super::outer::{Anchor, Rounds, outer_step};
use super::shard::ShardLayout;
use super::stage::{Early, Stage};
use super::step::{Arrival, Collect};
use super::values::{ComputeError, Values};
use crate::msg::{Addr, Envelope, StepMode, Work};

/// What the driver does for a step.
#[derive(Debug)]
pub enum Act<M> {
    /// Send an envelope from this node.
    Send(Addr, Envelope),
    /// Start a collective with the epoch's sync group.
    Collective(Start),
    /// A step of `0` samples began.
    Batch(u64),
    /// A step was dropped before it made its version.
    Aborted,
    /// Collectives of epoch `0` and earlier end.
    Halt(u64),
    /// Write the checkpoint shard of `layers` of version `version` (this node's duty, due
    /// now; [`NodeCore::version`] holds it).
    WriteShard {
        /// The version.
        version: u64,
        /// The shard's layers.
        layers: LayerRange,
    },
    /// Step `step`'s global gradient norm before clipping.
    GradNorm {
        /// The step.
        step: u64,
        /// The norm.
        norm: f64,
    },
    /// A step made its version: the driver hands it back with [`Machine::handle`] (as
    /// [`Input::Made`](super::core::Input::Made)); `comm`: it waited for collectives after its compute (the driver
    /// measures how long, and fills in [`Made::comm_ns`]).
    Made {
        /// The version made.
        made: Made<M>,
        /// Whether it waited for collectives.
        comm: bool,
    },
}

/// The compute a step asks of the driver ([`Machine::begin`]).
#[derive(Debug)]
pub enum Begin<M> {
    /// A synchronous data-parallel step of `work` from `model`: each bucket of its gradient
    /// sum goes to its collective as backward makes it (sharded: reduce-scattered by
    /// `shard`'s layout), and comes back to [`Machine::outcome`]; the compute's end goes to
    /// [`Machine::computed`].
    Sync {
        /// The epoch's work.
        work: Work,
        /// The model to compute on.
        model: M,
        /// A sharded step's layout.
        shard: Option<Arc<ShardLayout>>,
    },
    /// A local-SGD step of `work` from `model`: the driver computes this node's mean gradient
    /// and hands it to [`Machine::local_update`], then [`Machine::local_done`].
    Local {
        /// The epoch's work.
        work: Work,
        /// The model to compute on.
        model: M,
        /// Whether the step ends a round, and how.
        mode: StepMode,
    },
    /// A pipeline stage's step: the driver runs its passes ([`Machine::pipe`]) as their
    /// inputs arrive, then calls [`Machine::passes_ran`].
    Stage,
}

/// What the driver does after an envelope was handled (and its acts carried out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Then {
    /// Nothing more.
    Nothing,
    /// Start the next step if idle ([`Machine::advance`]).
    Advance,
    /// Run the stage's passes whose inputs are now here ([`Machine::pipe`]).
    Pump,
}

/// A collective to start.
#[derive(Debug)]
pub struct Start {
    /// Its id.
    pub id: CollId,
    /// This node's values.
    pub data: Vec<f32>,
    /// The bytes they stand for on the wire.
    pub virtual_bytes: u64,
    /// A sharded step's part of the ring (`None`: an all-reduce).
    pub part: Option<RingPart>,
}

/// Bytes the values a node sends stand for.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    /// Bytes one full gradient stands for (buckets are charged their share).
    pub grad_bytes: u64,
    /// Bytes one model copy stands for.
    pub model_bytes: u64,
    /// Bytes a local-SGD round stands for per byte of gradient, where the backend's flat form
    /// does not say it (the simulator's toy has no optimizer state: the plan's figure); 1: the
    /// values exchanged, as many f32s as the gradient's bytes say per parameter.
    pub round_factor: f64,
}

/// A step whose collectives are running: their bookkeeping ([`Collect`]), and the version being
/// made.
#[derive(Debug)]
pub struct Running<M> {
    /// Which results are still to come, where each goes, the ones held for the norm.
    pub c: Collect,
    /// The version being made: version `step` (shared, not copied) with the results applied
    /// to it as they come back.
    pub next: M,
    /// Whether the compute ended (the collectives may still run).
    pub computed: bool,
    /// The compute's nanoseconds.
    pub compute_ns: u64,
    /// A sharded data-parallel step: its chunks (each bucket runs a reduce-scatter, then an
    /// all-gather).
    pub shard: Option<Arc<ShardLayout>>,
    /// An outer round that exchanges deltas: the anchor it started from.
    pub anchor: Option<Anchor>,
    /// A merge step: the step that launched the round it merges.
    pub merge: Option<u64>,
}

impl<M> Running<M> {
    /// The collectives `c` of a step whose compute just ended (`compute_ns` of it), making
    /// `next`.
    fn computed(c: Collect, next: M, compute_ns: u64) -> Self {
        Running {
            c,
            next,
            computed: true,
            compute_ns,
            shard: None,
            anchor: None,
            merge: None,
        }
    }
}

/// A pipeline stage's step in progress: its [`Stage`] (its order, its activations), and what
/// the backend holds for it.
#[derive(Debug)]
pub struct Pipe<M, G> {
    /// The stage's schedule.
    pub stage: Stage,
    /// Model version `step`.
    pub model: M,
    /// Where this stage's layers' parameters sit in the flat model.
    pub range: Range<usize>,
    /// Σ of the layers' parameter gradients so far (kept by the backend).
    pub grad: Option<G>,
    /// The passes' nanoseconds so far.
    pub compute_ns: u64,
    /// Clipped: the stage's mean gradient, done, waiting for the other stages' pieces of the
    /// norm before it is applied.
    clip: Option<Vec<f32>>,
}

/// A node's step in progress (`V`: its backend's values).
#[derive(Debug)]
pub struct Machine<V: Values> {
    /// The node's decisions: epochs, halts, the versions kept and fetched, peers' requests.
    core: NodeCore<V::Model>,
    values: Arc<V>,
    id: NodeId,
    sizes: Sizes,
    /// The data-parallel step (or a stage's synchronization, or an outer round) in progress.
    running: Option<Running<V::Model>>,
    /// The pipeline stage step in progress.
    pub pipe: Option<Pipe<V::Model, V::StageGrad>>,
    /// Activations and gradients that came before their stage step started here.
    early: Early,
    /// Local SGD's rounds: overlapped ones in flight, the carry after a merge, the outer
    /// momentum (DiLoCo).
    rounds: Rounds,
    /// Pieces of steps' gradient norms from the other parts of the model (clipping).
    norms: super::clip::Norms,
    acts: Vec<Act<V::Model>>,
}

/// What became of a collective's result.
enum Applied {
    /// Not one of the running step's buckets.
    Ignored,
    /// Applied to the version being made.
    Landed,
    /// Held for the norm.
    Held,
    /// A sharded owner's part updated: its all-gather starts with these values.
    Gather(Range<usize>, Vec<f32>, Arc<ShardLayout>),
}

impl<V: Values> Machine<V> {
    /// The machine of the node whose decisions are `core`, on `values`.
    pub fn new(core: NodeCore<V::Model>, values: Arc<V>, sizes: Sizes) -> Self {
        Machine {
            id: core.id(),
            core,
            values,
            sizes,
            running: None,
            pipe: None,
            early: Early::default(),
            rounds: Rounds::default(),
            norms: Default::default(),
            acts: Vec::new(),
        }
    }

    /// The node's decisions.
    pub fn core(&self) -> &NodeCore<V::Model> {
        &self.core
    }

    /// What the driver must do, in order (taken).
    pub fn acts(&mut self) -> Vec<Act<V::Model>> {
        std::mem::take(&mut self.acts)
    }

    /// Whether a step is in progress.
    pub fn busy(&self) -> bool {
        self.running.is_some() || self.pipe.is_some()
    }

    /// Drop the step in progress (its epoch is over); whether there was one.
    fn abandon(&mut self) -> bool {
        self.running.take().is_some() || self.pipe.take().is_some()
    }

    /// Epoch `epoch` cannot go on here: tell the coordinator why.
    pub fn fail(&mut self, epoch: u64, reason: String) {
        let env = Envelope::StepFailed { epoch, reason };
        self.acts.push(Act::Send(Addr::Coordinator, env));
    }

    fn fail_step(&mut self, epoch: u64, reason: String) {
        self.running = None;
        self.fail(epoch, reason);
    }

    fn collective(
        &mut self,
        id: CollId,
        data: Vec<f32>,
        virtual_bytes: u64,
        part: Option<RingPart>,
    ) {
        let start = Start {
            id,
            data,
            virtual_bytes,
            part,
        };
        self.acts.push(Act::Collective(start));
    }

    // ---- data parallel -------------------------------------------------------------------

    /// Step `s` of the epoch begins (the decisions said to run it, and this node holds version
    /// `s`): the compute it asks of the driver. `None`: nothing to compute (the coordinator was
    /// told why, where the step cannot run).
    pub fn begin(&mut self, s: u64) -> Option<Begin<V::Model>> {
        let w = self.core.work()?.clone();
        let base = self.core.version(s)?.model.clone();
        let base = match self.start_from(&w, s, base) {
            Ok(b) => b,
            Err(e) => {
                self.fail(w.epoch, e);
                return None;
            }
        };
        self.acts.push(Act::Batch(w.batch));
        if let Some(sw) = w.stage.clone() {
            self.start_stage(&w, sw, s, base);
            return Some(Begin::Stage);
        }
        match w.mode(s) {
            StepMode::Sync => {
                let (model, shard) = self.begin_sync(&w, s, base)?;
                Some(Begin::Sync {
                    work: w,
                    model,
                    shard,
                })
            }
            mode => Some(Begin::Local {
                work: w,
                model: base,
                mode,
            }),
        }
    }

    /// A synchronous data-parallel step `s` of `w` from `base` begins: the model its compute
    /// runs on, and, sharded, the layout its buckets are reduce-scattered by (see
    /// [`super::shard`]; this node keeps only its own part's optimizer state). `None`: the
    /// step cannot run (the coordinator is told).
    fn begin_sync(
        &mut self,
        w: &Work,
        s: u64,
        mut base: V::Model,
    ) -> Option<(V::Model, Option<Arc<ShardLayout>>)> {
        let values = self.values.clone();
        let mut shard = None;
        if let Some(sw) = &w.shard {
            let layout = ShardLayout::new(sw, &w.ring, self.id, values.params(), |l| {
                values.param_range(l)
            });
            match layout {
                Ok(l) => shard = Some(Arc::new(l)),
                Err(e) => {
                    self.fail(w.epoch, e);
                    return None;
                }
            }
            base = values.shard(&base, sw.owned);
        }
        // The next version starts as version s (shared, not copied); each reduced bucket is
        // applied to it as it comes back.
        let c = Collect::new(
            (w.epoch, s),
            StepMode::Sync,
            None,
            values.buckets(),
            shard.is_some(),
        );
        self.running = Some(Running {
            computed: false,
            shard: shard.clone(),
            ..Running::computed(c, base.clone(), 0)
        });
        Some((base, shard))
    }

    /// The running step's compute ended after `ns` (`Err`: it failed).
    pub fn computed(&mut self, epoch: u64, ns: u64, result: Result<(), ComputeError>) {
        if let Err(e) = result {
            return self.fail_step(epoch, e.to_string());
        }
        if let Some(r) = self.running.as_mut() {
            r.computed = true;
            r.compute_ns = ns;
        }
        self.try_finish();
    }

    /// A local-SGD step's update from this node's own mean gradient `mean` on `base`
    /// (clipped by its own norm first: DiLoCo's inner optimizer).
    pub fn local_update(
        &self,
        mut base: V::Model,
        mean: &mut [f32],
    ) -> Result<V::Model, ComputeError> {
        if let Some(max) = self.values.max_grad_norm() {
            ravnest_core::recipe::clip_global(&mut [mean], max);
        }
        self.values.apply_update(&mut base, 0..mean.len(), mean)?;
        self.values.end_update(&mut base);
        Ok(base)
    }

    /// A local-SGD step `s` of `w` made `local` (its compute `ns`): the version, or, on a
    /// round's step, the round.
    pub fn local_done(&mut self, w: &Work, s: u64, local: V::Model, mode: StepMode, ns: u64) {
        if mode == StepMode::Local {
            return self.made((w.epoch, s), local, None, false, ns, false);
        }
        self.round(w, s, local, None, ns, mode);
        // A merge may have all it needs already.
        self.try_finish();
    }

    /// A collective ended: `Some(sum)` its result, `None` it was aborted. Its result is applied
    /// to the version being made (clipped, held for the norm; sharded, this node's part updated
    /// and its all-gather started).
    pub fn outcome(&mut self, id: CollId, sum: Option<Vec<f32>>) {
        let Some(sum) = self.round_outcome(id, sum) else {
            return;
        };
        if !self.running.as_ref().is_some_and(|r| r.c.owns(id)) {
            return;
        }
        let Some(sum) = sum else {
            // A halt drops the running step before its collectives report their abort: this
            // one failed on its own (it could not start), and waiting would wait forever.
            self.acts.push(Act::Aborted);
            let reason = format!(
                "the collective of step {} bucket {} could not run",
                id.step, id.bucket
            );
            return self.fail_step(id.epoch, reason);
        };
        match self.apply(id, sum) {
            Err(reason) => return self.fail_step(id.epoch, reason),
            Ok(Applied::Ignored) => return,
            Ok(Applied::Held) => return self.clip_held(),
            Ok(Applied::Gather(target, values, layout)) => {
                self.start_gather(id, &target, values, &layout)
            }
            Ok(Applied::Landed) => {}
        }
        if let Some(r) = self.running.as_mut() {
            r.c.landed();
        }
        self.try_finish();
    }

    /// Apply result `sum` of collective `id` to the running step.
    fn apply(&mut self, id: CollId, sum: Vec<f32>) -> Result<Applied, String> {
        let values = self.values.clone();
        let Some(r) = self.running.as_mut() else {
            return Ok(Applied::Ignored);
        };
        match r.c.arrived(id, sum.len())? {
            None => Ok(Applied::Ignored),
            Some(Arrival::Gathered { target, .. }) => {
                sharded::gathered(&*values, r, &target, sum).map(|()| Applied::Landed)
            }
            Some(Arrival::Reduced { .. }) if r.c.mode == StepMode::Average => {
                let mut sum = sum;
                if let (Some(anchor), Some(w)) = (r.anchor.take(), self.core.work()) {
                    let made = (r.c.layers, id.step + 1);
                    outer_step(&mut self.rounds.momentum, w, made, &anchor, &mut sum)?;
                }
                r.next = values
                    .import(Some(&r.next), r.c.layers, sum)
                    .map_err(|e| e.to_string())?;
                Ok(Applied::Landed)
            }
            Some(Arrival::Reduced {
                bucket,
                target,
                first,
            }) => {
                if first {
                    // Every peer of this collective computed from version `step`: none will
                    // roll back past it, so what keeping version `step + 1` will forget is
                    // free now, and the update may write into its memory. Sharded, the only
                    // holder of its part makes the next version from this one in place of it
                    // (a lost peer's part comes back from the checkpoint, not from a version
                    // here).
                    if r.shard.is_some() && self.core.versions().keeps_one() {
                        drop(self.core.take(r.c.step));
                    }
                    for old in self.core.doomed_by(r.c.step + 1, true) {
                        values.retire(old);
                    }
                }
                if values.max_grad_norm().is_some() {
                    // Clipped, the buckets wait for each other: the norm is the whole
                    // gradient's.
                    r.c.hold(bucket, sum);
                    return Ok(Applied::Held);
                }
                match r.shard.clone() {
                    Some(l) => {
                        let owned = sharded::update_owned(&*values, &mut r.next, &target, sum, &l)?;
                        Ok(Applied::Gather(target, owned, l))
                    }
                    None => {
                        let applied = values.apply_update(&mut r.next, target, &sum);
                        values.recycle(sum);
                        applied.map_err(|e| e.to_string())?;
                        Ok(Applied::Landed)
                    }
                }
            }
        }
    }

    /// Finish the running step once its compute ended and every collective came back.
    fn try_finish(&mut self) {
        if !self
            .running
            .as_ref()
            .is_some_and(|r| r.c.settled() && r.computed)
        {
            return;
        }
        let Some(r) = self.running.take() else { return };
        let mut next = r.next;
        if r.c.mode == StepMode::Sync {
            self.values.end_update(&mut next);
        }
        let synced = r.c.mode.synchronized();
        self.made(
            (r.c.epoch, r.c.step),
            next,
            r.c.layers,
            synced,
            r.compute_ns,
            true,
        );
    }

    /// Step `step` of `epoch` made `model` (of `layers`): version `step + 1`, handed to the
    /// driver with its digest.
    #[allow(clippy::too_many_arguments)]
    fn made(
        &mut self,
        (epoch, step): (u64, u64),
        model: V::Model,
        layers: Option<LayerRange>,
        synced: bool,
        compute_ns: u64,
        comm: bool,
    ) {
        // A stage's new version holds its layers only (the others were not updated).
        let model = match layers {
            Some(l) => self.values.retain(&model, l),
            None => model,
        };
        // What this node holds whole (with optimizer state): a stage's layers, a sharded
        // worker's part (beside every weight), else the whole model.
        let layers = self.core.made_layers(layers);
        // A stage's digest covers what it holds of its layers (their optimizer state too), as
        // its checkpoint shard does. Only a synchronized version's digest is compared (replicas
        // differ between local SGD's rounds): the others are not hashed, and report 0.
        let digest = if synced {
            self.values.digest(&model, layers)
        } else {
            0
        };
        let made = Made {
            epoch,
            step,
            model,
            synced,
            layers,
            digest,
            compute_ns,
            comm_ns: 0,
        };
        self.acts.push(Act::Made { made, comm });
    }
}

#[cfg(test)]
mod tests;

//! One step of a node's epoch: compute, hand each gradient bucket to the collective actor as
//! backward finishes it, apply each reduced bucket as it comes back, and record the new version.
//!
//! Data parallel: the backend hands the gradient sum bucket by bucket (last layers first); each
//! bucket is weighted by b_i / B in place and starts its own collective at once, so the ring of
//! the last layers runs while backward computes the first ones. Each bucket's sum is applied to
//! its parameters as it arrives. A pipeline stage runs its micro-batches in 1F1B order as
//! activations and gradients arrive, then reduces its layers' gradient with its sync group.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use ravnest_core::LayerRange;
use ravnest_core::collective::{CollId, RingPart};
use ravnest_core::pack::Packing;
use ravnest_core::ring::RingMode;
use tokio::time::Instant;

use super::NodeActor;
use super::state::{NodeMsg, NodeState, Pipe, Running};
use crate::collective::{CollectiveMsg, Group, Outcome};
use crate::counters::{Count, MadeCount, Observed, Span, SpanKind};
use crate::seams::{BucketSink, Compute, ComputeError, StagePass, Transport, with_buckets};
use ravnest_protocol::digest::sample_range;
use ravnest_protocol::msg::{Addr, Envelope, StageWork, StepMode, SyncPolicy, Work};
use ravnest_protocol::node::core::{self, Input};
use ravnest_protocol::node::duty::{Next, ShardWriter};
use ravnest_protocol::node::outer::outer_step;
use ravnest_protocol::node::shard::ShardLayout;
use ravnest_protocol::node::stage::{Pass, Stage, StageInput};
use ravnest_protocol::node::step::{Arrival, Collect};

/// A node's state, as this backend's node holds it.
type State<C> = NodeState<<C as Compute>::Model, <C as Compute>::StageGrad>;

impl<T: Transport, C: Compute> NodeActor<T, C> {
    fn span(&self, since: Instant, kind: SpanKind) -> Span {
        Span {
            start_ns: since.duration_since(self.t0).as_nanos() as u64,
            end_ns: self.t0.elapsed().as_nanos() as u64,
            kind,
        }
    }

    /// Record compute since `since` (adjacent compute spans merge: a pipeline stage computes
    /// many short micro-batches). Returns its ns.
    fn computed(&self, since: Instant) -> u64 {
        let span = self.span(since, SpanKind::Compute);
        let ns = since.elapsed().as_nanos() as u64;
        self.record(Count::Compute { ns, span });
        ns
    }

    pub(super) fn fail(&self, epoch: u64, reason: String) {
        self.send(Addr::Coordinator, Envelope::StepFailed { epoch, reason });
    }

    /// The epoch's sync group (built once per epoch, shared by its collectives).
    pub(super) fn group(&self, st: &mut State<C>, w: &Work) -> Arc<Group> {
        match &st.group {
            Some((e, g)) if *e == w.epoch => g.clone(),
            _ => {
                let packing = match w.sync {
                    SyncPolicy::LocalSgd { outer, .. } => outer.packing,
                    SyncPolicy::EveryStep => Packing::Fp32,
                };
                let g = Arc::new(Group {
                    ring: w.ring.clone(),
                    collective: w.collective,
                    group_size: w.group_size,
                    packing,
                });
                st.group = Some((w.epoch, g.clone()));
                g
            }
        }
    }

    pub(super) fn start_collective(
        &self,
        st: &State<C>,
        id: CollId,
        group: Arc<Group>,
        data: Vec<f32>,
        virtual_bytes: u64,
        part: Option<RingPart>,
    ) {
        if let Some(c) = &st.collective {
            let _ = c.cast(CollectiveMsg::Start {
                id,
                group,
                data,
                virtual_bytes,
                part,
            });
        }
    }

    /// Run step `s` of the current epoch (this node holds version `s`).
    pub(super) async fn run_step(&self, st: &mut State<C>, s: u64) {
        let Some(w) = st.core.work().cloned() else {
            return;
        };
        let Some(base) = st.core.version(s).map(|v| v.model.clone()) else {
            return;
        };
        let base = match self.start_from(st, &w, s, base) {
            Ok(b) => b,
            Err(e) => return self.fail(w.epoch, e),
        };
        self.record(Count::Batch(w.batch));
        if let Some(sw) = w.stage.clone() {
            return self.start_stage(st, &w, sw, s, base).await;
        }
        match w.mode(s) {
            StepMode::Sync => self.sync_step(st, &w, s, base).await,
            mode => self.local_step(st, &w, s, base, mode).await,
        }
    }

    /// A synchronous data-parallel step: buckets enter their collectives as backward makes them.
    /// Sharded, each bucket is reduce-scattered to its parameters' owners instead (see
    /// [`ravnest_protocol::node::shard`]), and this node keeps only its own part's optimizer state.
    async fn sync_step(&self, st: &mut State<C>, w: &Work, s: u64, mut base: C::Model) {
        let params = self.compute.params();
        let buckets = self.compute.buckets();
        let mut shard = None;
        if let Some(sw) = &w.shard {
            let layout = ShardLayout::new(sw, &w.ring, self.id, params, |l| {
                self.compute.param_range(l)
            });
            match layout {
                Ok(l) => shard = Some(Arc::new(l)),
                Err(e) => return self.fail(w.epoch, e),
            }
            base = self.compute.shard(&base, sw.owned);
        }
        let group = self.group(st, w);
        let first_bucket = Arc::new(std::sync::OnceLock::new());
        // The next version starts as version s (shared, not copied); each reduced bucket is
        // applied to it as it comes back.
        let c = Collect::new(
            (w.epoch, s),
            StepMode::Sync,
            None,
            buckets.clone(),
            shard.is_some(),
        );
        st.running = Some(Running {
            computed: None,
            shard: shard.clone(),
            first_bucket: Some(first_bucket.clone()),
            ..Running::computed(c, base.clone(), 0)
        });
        // Weight b_i / B, applied once, in place: the group's sum is the mean gradient of the
        // whole global batch.
        let scale = 1.0 / w.global_batch.max(1) as f32;
        let (grad_bytes, coll, epoch) = (self.grad_bytes, st.collective.clone(), w.epoch);
        let sink: BucketSink = Arc::new(move |k: usize, mut data: Vec<f32>| {
            first_bucket.get_or_init(Instant::now);
            for x in &mut data {
                *x *= scale;
            }
            let virtual_bytes = grad_bytes * data.len() as u64 / params.max(1) as u64;
            let id = CollId {
                epoch,
                step: s,
                bucket: k as u32,
            };
            let part = shard
                .as_ref()
                .and_then(|l| Some(l.part(buckets.get(k)?, RingMode::ReduceScatter)));
            if let Some(c) = &coll {
                let _ = c.cast(CollectiveMsg::Start {
                    id,
                    group: group.clone(),
                    data,
                    virtual_bytes,
                    part,
                });
            }
        });
        let t = Instant::now();
        let samples = sample_range(s, w.global_batch, w.offset, w.batch);
        let result = self.gradient_sum(s, samples, w.chunk, base, sink).await;
        let ns = self.computed(t);
        self.after_compute(st, w.epoch, ns, result).await;
    }

    /// Forward and backward over `samples` of step `s` in micro-batches of `chunk` samples (0:
    /// all at once), their gradients accumulated: `ready` gets each bucket's sum over all of
    /// `samples` when the last micro-batch has made it (a worker whose memory does not hold its
    /// share at once).
    async fn gradient_sum(
        &self,
        s: u64,
        samples: Range<u64>,
        chunk: u64,
        model: C::Model,
        ready: BucketSink,
    ) -> Result<(), ComputeError> {
        if chunk == 0 || chunk >= samples.end - samples.start {
            return self
                .compute
                .gradient_sum(self.id, s, samples, model, ready)
                .await;
        }
        // The sums of the micro-batches so far, by bucket. Each micro-batch's buckets come from
        // the compute thread and are added in here as they come (this node's memory does not
        // hold two gradients); the last one's sink adds the sums into its buckets and hands
        // them on.
        let mut acc: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
        let mut start = samples.start;
        while start < samples.end {
            let end = (start + chunk).min(samples.end);
            if end == samples.end {
                let acc = Arc::new(acc);
                let sink: BucketSink = Arc::new(move |k: usize, mut data: Vec<f32>| {
                    if let Some(prev) = acc.get(&k) {
                        for (d, p) in data.iter_mut().zip(prev) {
                            *d += p;
                        }
                    }
                    ready(k, data);
                });
                return self
                    .compute
                    .gradient_sum(self.id, s, start..end, model, sink)
                    .await;
            }
            let pass = |sink| {
                self.compute
                    .gradient_sum(self.id, s, start..end, model.clone(), sink)
            };
            with_buckets(pass, |k, data| match acc.get_mut(&k) {
                Some(sum) => sum.iter_mut().zip(&data).for_each(|(s, d)| *s += d),
                None => {
                    acc.insert(k, data);
                }
            })
            .await?;
            start = end;
        }
        Ok(())
    }

    async fn after_compute(
        &self,
        st: &mut State<C>,
        epoch: u64,
        ns: u64,
        result: Result<(), ComputeError>,
    ) {
        if let Err(e) = result {
            st.running = None;
            return self.fail(epoch, e.to_string());
        }
        if let Some(r) = st.running.as_mut() {
            r.computed = Some(Instant::now());
            r.compute_ns = ns;
        }
        self.try_finish(st).await;
    }

    /// A local-SGD step: apply this node's own mean gradient; on an averaging step, then average
    /// the models (weighted by batch share) with the group.
    async fn local_step(
        &self,
        st: &mut State<C>,
        w: &Work,
        s: u64,
        base: C::Model,
        mode: StepMode,
    ) {
        let params = self.compute.params();
        let t = Instant::now();
        let samples = sample_range(s, w.global_batch, w.offset, w.batch);
        let buckets = self.compute.buckets();
        let mut mean = vec![0.0f32; params];
        let inv = 1.0 / w.batch.max(1) as f32;
        let pass = |sink| self.gradient_sum(s, samples, w.chunk, base.clone(), sink);
        let result = with_buckets(pass, |k, data| {
            if let Some(r) = buckets.get(k).filter(|r| r.len() == data.len()) {
                for (m, g) in mean[r.clone()].iter_mut().zip(&data) {
                    *m = g * inv;
                }
            }
        })
        .await;
        if let Err(e) = result {
            self.computed(t);
            return self.fail(w.epoch, e.to_string());
        }
        if let Some(max) = self.compute.max_grad_norm() {
            // Local SGD: each node clips its own gradient (DiLoCo's inner optimizer).
            ravnest_core::recipe::clip_global(&mut [&mut mean], max);
        }
        let mut local = base;
        if let Err(e) = self.compute.apply_update(&mut local, 0..params, &mean) {
            self.computed(t);
            return self.fail(w.epoch, e.to_string());
        }
        self.compute.end_update(&mut local);
        let ns = self.computed(t);
        if mode == StepMode::Local {
            return self
                .finish_step(st, w.epoch, s, local, None, false, Spent::compute(ns))
                .await;
        }
        self.round(st, w, s, local, None, ns, mode);
        // A merge may have all it needs already.
        self.try_finish(st).await;
    }

    /// A collective ended: its result is applied to the version being made (clipped, held
    /// for the norm; sharded, this node's part updated and its all-gather started).
    pub(super) async fn on_outcome(&self, st: &mut State<C>, mut outcome: Outcome) {
        if self.on_round_outcome(st, &mut outcome).await {
            return;
        }
        let id = match &outcome {
            Outcome::Done { id, .. } | Outcome::Aborted { id } => *id,
        };
        let Some(r) = st.running.as_mut().filter(|r| r.c.owns(id)) else {
            return;
        };
        let Outcome::Done { sum, .. } = outcome else {
            // A halt drops the running step before its collectives report their abort: this
            // one failed on its own (it could not start), and waiting would wait forever.
            st.running = None;
            self.record(Count::Aborted);
            return self.fail(
                id.epoch,
                format!(
                    "the collective of step {} bucket {} could not run",
                    id.step, id.bucket
                ),
            );
        };
        let applied = match r.c.arrived(id, sum.len()) {
            Ok(None) => return,
            Err(reason) => Err(reason),
            Ok(Some(Arrival::Gathered { target, .. })) => self.gathered(r, &target, sum),
            Ok(Some(Arrival::Reduced { .. })) if r.c.mode == StepMode::Average => {
                let mut sum = sum;
                let outer = match (r.anchor.take(), st.core.work()) {
                    (Some(anchor), Some(w)) => {
                        let made = (r.c.layers, id.step + 1);
                        outer_step(&mut st.rounds.momentum, w, made, &anchor, &mut sum)
                    }
                    _ => Ok(()),
                };
                outer.and_then(|()| {
                    self.compute
                        .import(Some(&r.next), r.c.layers, sum)
                        .map(|m| r.next = m)
                        .map_err(|e| e.to_string())
                })
            }
            Ok(Some(Arrival::Reduced {
                bucket,
                target,
                first,
            })) => {
                if first {
                    // Every peer of this collective computed from version `step`: none will
                    // roll back past it, so what keeping version `step + 1` will forget is
                    // free now, and the update may write into its memory. Sharded, the only
                    // holder of its part makes the next version from this one in place of it
                    // (a lost peer's part comes back from the checkpoint, not from a version
                    // here).
                    if r.shard.is_some() && st.core.versions().keeps_one() {
                        drop(st.core.take(r.c.step));
                    }
                    for old in st.core.doomed_by(r.c.step + 1, true) {
                        self.compute.retire(old);
                    }
                }
                if self.compute.max_grad_norm().is_some() {
                    // Clipped, the buckets wait for each other: the norm is the whole
                    // gradient's.
                    r.c.hold(bucket, sum);
                    return self.clip_held(st).await;
                }
                match r.shard.clone() {
                    Some(l) => self
                        .update_owned(&mut r.next, &target, sum, &l)
                        .map(|values| self.start_gather(st, id, &target, values, &l)),
                    None => {
                        let applied = self.compute.apply_update(&mut r.next, target, &sum);
                        self.compute.recycle(sum);
                        applied.map_err(|e| e.to_string())
                    }
                }
            }
        };
        if let Err(reason) = applied {
            st.running = None;
            return self.fail(id.epoch, reason);
        }
        if let Some(r) = st.running.as_mut() {
            r.c.landed();
        }
        self.try_finish(st).await;
    }

    /// Finish the running step once its compute ended and every collective came back.
    pub(super) async fn try_finish(&self, st: &mut State<C>) {
        if !st
            .running
            .as_ref()
            .is_some_and(|r| r.c.settled() && r.computed.is_some())
        {
            return;
        }
        let Some(r) = st.running.take() else { return };
        let mut next = r.next;
        if r.c.mode == StepMode::Sync {
            self.compute.end_update(&mut next);
        }
        let mut comm_ns = 0;
        if let Some(since) = r.computed {
            let span = self.span(since, SpanKind::Comm);
            comm_ns = since.elapsed().as_nanos() as u64;
            // From the first bucket handed over to the last one applied.
            let allreduce_ns = r
                .first_bucket
                .as_ref()
                .and_then(|f| f.get())
                .map_or(0, |t| t.elapsed().as_nanos() as u64);
            self.record(Count::Comm {
                comm_ns,
                allreduce_ns,
                span,
            });
        }
        self.finish_step(
            st,
            r.c.epoch,
            r.c.step,
            next,
            r.c.layers,
            r.c.mode.synchronized(),
            Spent {
                compute_ns: r.compute_ns,
                comm_ns,
            },
        )
        .await;
    }

    /// Record model version `step + 1`, report it, write a checkpoint shard when one is due,
    /// serve peers waiting for it, and go on.
    #[allow(clippy::too_many_arguments)]
    async fn finish_step(
        &self,
        st: &mut State<C>,
        epoch: u64,
        step: u64,
        model: C::Model,
        layers: Option<LayerRange>,
        synced: bool,
        spent: Spent,
    ) {
        let v = step + 1;
        // A stage's new version holds its layers only (the others were not updated).
        let model = match layers {
            Some(l) => self.compute.retain(&model, l),
            None => model,
        };
        // What this node holds whole (with optimizer state): a stage's layers, a sharded
        // worker's part (beside every weight), else the whole model.
        let layers = st.core.made_layers(layers);
        // A stage's digest covers what it holds of its layers (their optimizer state too), as
        // its checkpoint shard does. Only a synchronized version's digest is compared (replicas
        // differ between local SGD's rounds): the others are not hashed, and report 0.
        let d = if synced {
            self.compute.digest(&model, layers)
        } else {
            0
        };
        let observed = self.observe.then(|| {
            let slots = match layers {
                Some(l) => self.compute.layer_slots(l),
                None => std::iter::once(0..self.compute.model_len()).collect(),
            };
            let values = self.compute.export(&model, layers).unwrap_or_default();
            Observed {
                version: v,
                slots,
                values,
            }
        });
        let last = st.core.is_last(v);
        let final_model = (last && layers.is_none())
            .then(|| self.compute.export(&model, None))
            .flatten();
        self.record(Count::Made(Box::new(MadeCount {
            version: v,
            layers,
            observed,
            final_model,
            at_ns: self.t0.elapsed().as_nanos() as u64,
            phases: self.compute.phase_ns(),
        })));
        let made = core::Made {
            epoch,
            step,
            model,
            synced,
            layers,
            digest: d,
            compute_ns: spent.compute_ns,
            comm_ns: spent.comm_ns,
        };
        let effects = st.core.handle(Input::Made(made));
        self.perform(st, effects).await;
        if let Some(me) = &st.me {
            let _ = me.cast(NodeMsg::Advance);
        }
    }

    /// Send the shard of `layers` of checkpoint version `v` (this node's duty) in parts, each
    /// made when it may go ([`ShardWriter`]: paced by the host's acknowledgements).
    pub(super) async fn write_shard(&self, v: u64, layers: LayerRange, model: &C::Model) {
        let d = self.compute.digest(model, Some(layers));
        let slots = self.compute.layer_slots(layers);
        let total: usize = slots.iter().map(|r| r.len()).sum();
        let per_value = self.model_bytes as f64 / self.compute.model_len().max(1) as f64;
        let mut writer = ShardWriter::new(total, ravnest_protocol::msg::SHARD_PART);
        let (me, to) = (self.me(), Addr::Checkpoint);
        loop {
            // Armed before the count is read: no acknowledgement between the two is missed.
            let progress = self.transport.progress(me, to);
            let in_flight = progress.is_some().then(|| self.transport.in_flight(me, to));
            let now_ms = self.t0.elapsed().as_millis() as u64;
            let range = match writer.next(now_ms, in_flight) {
                Next::Done => return,
                Next::Wait => {
                    let patience = Duration::from_millis(writer.patience_ms());
                    if let Some(p) = progress {
                        let _ = tokio::time::timeout(patience, p).await;
                    }
                    continue;
                }
                Next::Part(r) => r,
            };
            let Some(part) = self
                .compute
                .export_range(model, Some(layers), range.clone())
            else {
                return;
            };
            self.send(
                to,
                Envelope::Shard {
                    step: v,
                    layers,
                    digest: d,
                    virtual_bytes: (per_value * part.len() as f64) as u64,
                    model: part,
                    offset: range.start as u64,
                    total: total as u64,
                },
            );
        }
    }

    // ---- pipeline stages ------------------------------------------------------------------

    /// Begin a pipeline stage's step: its micro-batches run in 1F1B order as their inputs
    /// arrive ([`NodeActor::pump`]).
    async fn start_stage(
        &self,
        st: &mut State<C>,
        w: &Work,
        sw: StageWork,
        s: u64,
        model: C::Model,
    ) {
        let range = self.compute.param_range(sw.layers);
        let params = self.compute.params();
        let stage = match Stage::start(w, sw, s, &range, params, &mut st.early_pipe) {
            Ok(stage) => stage,
            Err(e) => return self.fail(w.epoch, e),
        };
        st.pipe = Some(Pipe {
            stage,
            model,
            range,
            grad: None,
            compute_ns: 0,
            clip: None,
        });
        self.pump(st).await;
    }

    /// Run one pass of the stage's schedule; its output (a forward's activations, a
    /// backward's input gradient), or why the step cannot go on.
    async fn stage_pass(
        &self,
        p: &mut Pipe<C::Model, C::StageGrad>,
        pass: &Pass,
    ) -> Result<Vec<f32>, String> {
        let (step, layers) = (p.stage.step, p.stage.layers());
        let at = StagePass::of(self.id, step, layers, pass);
        let out = match pass {
            Pass::Forward { .. } => self.compute.stage_forward(at, &p.model).await,
            Pass::Backward { .. } => {
                let acc = p.grad.take();
                let backward = self.compute.stage_backward(at, &p.model, acc).await;
                backward.map(|(g, grad_in)| {
                    p.grad = Some(g);
                    grad_in
                })
            }
        };
        out.map_err(|e| e.to_string())
    }

    /// Run every operation of the stage's schedule whose input is here, in order; when the
    /// schedule is done, hand the layers' gradient to the stage's sync group.
    async fn pump(&self, st: &mut State<C>) {
        while let Some(p) = st.pipe.as_mut() {
            let Some(pass) = p.stage.next_pass() else {
                break;
            };
            let t = Instant::now();
            let result = self.stage_pass(p, &pass).await;
            p.compute_ns += self.computed(t);
            match result {
                Ok(out) => {
                    if let Some((to, env)) = p.stage.ran(pass, out) {
                        self.send(to, env);
                    }
                }
                Err(reason) => {
                    let epoch = p.stage.epoch;
                    st.pipe = None;
                    return self.fail(epoch, reason);
                }
            }
        }
        if st
            .pipe
            .as_ref()
            .is_some_and(|p| p.stage.done() && p.clip.is_none())
            && let Some(p) = st.pipe.take()
        {
            self.stage_done(st, p).await;
        }
    }

    /// The stage's schedule is done: reduce its layers' gradient with the stage's sync group
    /// (a group of one applies it where it is: nothing travels), or, under local SGD, apply it
    /// and maybe average the layers. Clipped, a stage that applies its own gradient waits here
    /// (in `st.pipe`) for the other stages' pieces of the norm ([`super::clip`]).
    async fn stage_done(&self, st: &mut State<C>, mut p: Pipe<C::Model, C::StageGrad>) {
        let Some(w) = st.core.work().cloned() else {
            return;
        };
        let Some(grad) = p.grad.take() else {
            return self.fail(
                p.stage.epoch,
                format!(
                    "step {} of layers {} computed no gradient",
                    p.stage.step,
                    p.stage.layers()
                ),
            );
        };
        let layers = Some(p.stage.layers());
        let mode = w.mode(p.stage.step);
        let alone = w.ring.len() <= 1;
        let scale = match mode {
            StepMode::Sync => 1.0 / p.stage.global_batch.max(1) as f32,
            _ => 1.0 / w.batch.max(1) as f32,
        };
        if mode == StepMode::Sync && !alone {
            let contribution = self.compute.stage_grad_values(grad, scale);
            let group = self.group(st, &w);
            let c = Collect::new(
                (p.stage.epoch, p.stage.step),
                StepMode::Sync,
                layers,
                vec![p.range.clone()],
                false,
            );
            st.running = Some(Running::computed(c, p.model, p.compute_ns));
            let id = CollId {
                epoch: p.stage.epoch,
                step: p.stage.step,
                bucket: 0,
            };
            // A stage's gradient stands for its layers' bytes, not the whole model's.
            return self.start_collective(st, id, group, contribution, p.stage.sw.sync_bytes, None);
        }
        // Applied here: the only holder of these layers makes the next version from this one
        // in place of it (nobody can need version `step` once `step + 1` exists).
        if st.core.versions().keeps_one() {
            st.core.take(p.stage.step);
        }
        if self.compute.max_grad_norm().is_some() {
            p.clip = Some(self.compute.stage_grad_values(grad, scale));
            st.pipe = Some(p);
            return self.clip_stage(st).await;
        }
        let made = Made::of(&p);
        let mut next = p.model;
        if let Err(e) = self
            .compute
            .apply_stage_grad(&mut next, made.layers, grad, scale)
        {
            return self.fail(made.epoch, e.to_string());
        }
        self.stage_applied(st, &w, made, next).await
    }

    /// A stage applied its own gradient: make its next version, or, under local SGD, average
    /// the layers on a round's step.
    pub(super) async fn stage_applied(&self, st: &mut State<C>, w: &Work, p: Made, next: C::Model) {
        let layers = Some(p.layers);
        let mode = w.mode(p.step);
        if matches!(mode, StepMode::Average | StepMode::Launch | StepMode::Merge) {
            self.round(st, w, p.step, next, layers, p.compute_ns, mode);
            return self.try_finish(st).await;
        }
        // A synchronized step's version is one every replica agreed on; a local one's is not.
        let synced = mode == StepMode::Sync;
        let spent = Spent::compute(p.compute_ns);
        self.finish_step(st, p.epoch, p.step, next, layers, synced, spent)
            .await
    }

    /// An activation or gradient from a neighbouring stage: fed to its step, or kept until
    /// that step starts here.
    pub(super) async fn on_stage_input(&self, st: &mut State<C>, input: StageInput) {
        if let Some(p) = st.pipe.as_mut()
            && p.stage.takes(&input)
        {
            if p.stage.feed(input) {
                self.pump(st).await;
            }
            return;
        }
        let running = st.core.work().map_or(0, |w| w.epoch);
        st.early_pipe.keep(input, running, st.core.latest());
    }
}

/// Which stage step a stage's new version comes from.
#[derive(Debug, Clone, Copy)]
pub(super) struct Made {
    pub(super) epoch: u64,
    pub(super) step: u64,
    pub(super) layers: LayerRange,
    pub(super) compute_ns: u64,
}

impl Made {
    pub(super) fn of<M, G>(p: &Pipe<M, G>) -> Made {
        Made {
            epoch: p.stage.epoch,
            step: p.stage.step,
            layers: p.stage.layers(),
            compute_ns: p.compute_ns,
        }
    }
}

/// What a step cost this node: nanoseconds computing its share, and nanoseconds from the end of
/// its compute until every collective came back (the communication the step exposed; 0 for a
/// step without one).
#[derive(Debug, Clone, Copy)]
struct Spent {
    compute_ns: u64,
    comm_ns: u64,
}

impl Spent {
    fn compute(compute_ns: u64) -> Self {
        Spent {
            compute_ns,
            comm_ns: 0,
        }
    }
}

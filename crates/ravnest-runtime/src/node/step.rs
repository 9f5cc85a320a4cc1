//! One step of a node's epoch, as the node's process runs it: the computes (a data-parallel
//! step's forward and backward, a local step's, a pipeline stage's passes), and what the node's
//! [`Machine`] (everything between the computes) decides, carried out: envelopes sent,
//! collectives started and halted, counts recorded, checkpoint shards written.
//!
//! Data parallel: the backend hands the gradient sum bucket by bucket (last layers first); each
//! bucket is weighted by b_i / B in place and starts its own collective at once, on the compute
//! thread, so the ring of the last layers runs while backward computes the first ones. Each
//! bucket's sum comes back to [`Machine::outcome`], which applies it to its parameters at once,
//! while backward still computes (the node's outcomes wait in a channel its step reads beside
//! the compute, not in its mailbox): only the last bucket's update is after the compute. (Not
//! sharded: a sharded node updates its part in place, after the compute.) A
//! pipeline stage runs its micro-batches in 1F1B order as activations and gradients arrive
//! ([`NodeActor::pump`]), then [`Machine::passes_ran`] reduces or applies its layers' gradient.
//!
//! [`Machine`]: ravnest_protocol::node::machine::Machine
//! [`Machine::outcome`]: ravnest_protocol::node::machine::Machine::outcome
//! [`Machine::passes_ran`]: ravnest_protocol::node::machine::Machine::passes_ran

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use ravnest_core::LayerRange;
use ravnest_core::collective::CollId;
use ravnest_core::ring::RingMode;
use tokio::time::Instant;

use super::NodeActor;
use super::state::{Clock, NodeMsg, NodeState};
use crate::collective::{CollectiveMsg, Group, Outcome};
use crate::counters::{Count, MadeCount, Span, SpanKind};
use crate::seams::{BucketSink, Compute, StagePass, Transport, gradient_sum, with_buckets};
use ravnest_protocol::digest::sample_range;
use ravnest_protocol::msg::{Addr, Envelope, StepMode, Work};
use ravnest_protocol::node::core::{Input, Made};
use ravnest_protocol::node::duty::{Next, ShardWriter};
use ravnest_protocol::node::machine::{Act, Begin, Pipe, Start};
use ravnest_protocol::node::shard::ShardLayout;
use ravnest_protocol::node::stage::Pass;

/// A node's state, as this backend's node holds it.
type State<C> = NodeState<C>;

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

    /// The sync group of epoch `epoch` (built once per epoch from its work, shared by its
    /// collectives).
    fn group(&self, st: &mut State<C>, epoch: u64) -> Option<Arc<Group>> {
        if let Some((e, g)) = &st.group
            && *e == epoch
        {
            return Some(g.clone());
        }
        let w = st.node.core().work().filter(|w| w.epoch == epoch)?;
        let g = Arc::new(Group::of(w));
        st.group = Some((epoch, g.clone()));
        Some(g)
    }

    /// Carry out what the node's machine decided, in order: what an act makes it decide is
    /// carried out before the acts after it.
    pub(super) async fn carry_out(&self, st: &mut State<C>) {
        let mut queue: VecDeque<_> = st.node.acts().into();
        while let Some(act) = queue.pop_front() {
            match act {
                Act::Send(to, env) => self.send(to, env),
                Act::Collective(start) => self.start_collective(st, start),
                Act::Batch(b) => self.record(Count::Batch(b)),
                Act::Aborted => self.record(Count::Aborted),
                Act::Halt(epoch) => {
                    if let Some(c) = &st.collective {
                        let _ = c.cast(CollectiveMsg::Halt(epoch));
                    }
                }
                Act::WriteShard { version, layers } => {
                    if let Some(v) = st.node.core().version(version) {
                        let model = v.model.clone();
                        self.write_shard(version, layers, &model).await;
                    }
                }
                Act::GradNorm { step, norm } => self.record(Count::GradNorm { step, norm }),
                Act::Made { made, comm } => self.made(st, made, comm),
            }
            for act in st.node.acts().into_iter().rev() {
                queue.push_front(act);
            }
        }
    }

    fn start_collective(&self, st: &mut State<C>, s: Start) {
        let Some(group) = self.group(st, s.id.epoch) else {
            return;
        };
        if let Some(c) = &st.collective {
            let _ = c.cast(CollectiveMsg::Start {
                id: s.id,
                group,
                data: s.data,
                virtual_bytes: s.virtual_bytes,
                part: s.part,
            });
        }
    }

    /// Run step `s` of the current epoch (this node holds version `s`): the compute its
    /// machine asks for.
    pub(super) async fn run_step(&self, st: &mut State<C>, s: u64) {
        st.clock = Clock::default();
        let begun = st.node.begin(s);
        self.carry_out(st).await;
        match begun {
            None => {}
            Some(Begin::Stage) => self.pump(st).await,
            Some(Begin::Sync { work, model, shard }) => {
                self.sync_step(st, &work, s, model, shard).await
            }
            Some(Begin::Local { work, model, mode }) => {
                self.local_step(st, &work, s, model, mode).await
            }
        }
    }

    /// A synchronous data-parallel step: buckets enter their collectives as backward makes them.
    /// Sharded, each bucket is reduce-scattered to its parameters' owners instead (see
    /// [`ravnest_protocol::node::shard`]).
    async fn sync_step(
        &self,
        st: &mut State<C>,
        w: &Work,
        s: u64,
        base: C::Model,
        shard: Option<Arc<ShardLayout>>,
    ) {
        let (params, buckets) = (self.compute.params(), self.compute.buckets());
        let group = self.group(st, w.epoch);
        let first_bucket = Arc::new(OnceLock::new());
        st.clock.first_bucket = Some(first_bucket.clone());
        // Weight b_i / B, applied once, in place: the group's sum is the mean gradient of the
        // whole global batch.
        let scale = 1.0 / w.global_batch.max(1) as f32;
        // A sharded node updates its part in place once the compute has let go of the version
        // it started from (it holds one copy of its part's state): its sums wait for the
        // compute's end. Otherwise each update writes the new version's own buffers.
        let overlap = shard.is_none();
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
            if let (Some(c), Some(group)) = (&coll, &group) {
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
        let pass = gradient_sum(&*self.compute, self.id, s, samples, w.chunk, base, sink);
        tokio::pin!(pass);
        // The buckets' outcomes are applied while backward computes the rest: each bucket's
        // optimizer update is off the step's critical path, but the last one's.
        let result = loop {
            let outcome = async {
                match st.outcomes.as_mut() {
                    Some(rx) => rx.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                r = &mut pass => break r,
                Some(o) = outcome, if overlap => self.on_outcome(st, o).await,
            }
        };
        let ns = self.computed(t);
        st.clock.computed = Some(Instant::now());
        st.node.computed(w.epoch, ns, result);
        self.carry_out(st).await;
    }

    /// A local-SGD step: this node's own mean gradient, applied by the step's machine (which
    /// on an averaging step then averages the models, weighted by batch share, with the group).
    async fn local_step(
        &self,
        st: &mut State<C>,
        w: &Work,
        s: u64,
        base: C::Model,
        mode: StepMode,
    ) {
        let t = Instant::now();
        let samples = sample_range(s, w.global_batch, w.offset, w.batch);
        let buckets = self.compute.buckets();
        let mut mean = vec![0.0f32; self.compute.params()];
        let inv = 1.0 / w.batch.max(1) as f32;
        let compute = &*self.compute;
        let pass = |sink| gradient_sum(compute, self.id, s, samples, w.chunk, base.clone(), sink);
        let result = with_buckets(pass, |k, data| {
            if let Some(r) = buckets.get(k).filter(|r| r.len() == data.len()) {
                for (m, g) in mean[r.clone()].iter_mut().zip(&data) {
                    *m = g * inv;
                }
            }
        })
        .await;
        let local = result.and_then(|()| st.node.local_update(base, &mut mean));
        let ns = self.computed(t);
        match local {
            Ok(local) => {
                st.clock.computed = Some(Instant::now());
                st.node.local_done(w, s, local, mode, ns);
            }
            Err(e) => st.node.fail(w.epoch, e.to_string()),
        }
        self.carry_out(st).await;
    }

    /// A collective ended: the step's machine applies its result.
    pub(super) async fn on_outcome(&self, st: &mut State<C>, outcome: Outcome) {
        let (id, sum) = match outcome {
            Outcome::Done { id, sum, .. } => (id, Some(sum)),
            Outcome::Aborted { id } => (id, None),
        };
        st.node.outcome(id, sum);
        self.carry_out(st).await;
    }

    /// Step `made.step` made version `made.step + 1`: count it (the communication it waited
    /// for after its compute, when `comm`), hand it to the node's decisions (which report it,
    /// write a checkpoint shard when one is due, serve peers waiting for it), and go on.
    fn made(&self, st: &mut State<C>, mut made: Made<C::Model>, comm: bool) {
        let clock = std::mem::take(&mut st.clock);
        if comm && let Some(since) = clock.computed {
            let span = self.span(since, SpanKind::Comm);
            made.comm_ns = since.elapsed().as_nanos() as u64;
            // From the first bucket handed over to the last one applied.
            let allreduce_ns = clock
                .first_bucket
                .as_ref()
                .and_then(|f| f.get())
                .map_or(0, |t| t.elapsed().as_nanos() as u64);
            self.record(Count::Comm {
                comm_ns: made.comm_ns,
                allreduce_ns,
                span,
            });
        }
        let last = st.node.core().is_last(made.step + 1);
        let at_ns = self.t0.elapsed().as_nanos() as u64;
        let phases = self.compute.phase_ns();
        let count = MadeCount::of(&*self.compute, &made, (self.observe, last), at_ns, phases);
        self.record(Count::Made(Box::new(count)));
        st.node.handle(Input::Made(made));
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

    /// Run every pass of the stage's schedule whose input is here, in order; then the step's
    /// machine goes on ([`Machine::passes_ran`](ravnest_protocol::node::machine::Machine::passes_ran)).
    pub(super) async fn pump(&self, st: &mut State<C>) {
        while let Some(p) = st.node.pipe.as_mut() {
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
                    st.node.pass_failed(reason);
                    return self.carry_out(st).await;
                }
            }
        }
        if st.node.pipe.as_ref().is_some_and(|p| p.stage.done()) {
            st.clock.computed = Some(Instant::now());
        }
        st.node.passes_ran();
        self.carry_out(st).await;
    }
}

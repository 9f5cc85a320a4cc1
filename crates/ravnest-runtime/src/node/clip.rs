//! Global gradient-norm clipping (`[run] max_grad_norm`) of a step's mean gradient, whatever
//! the layout: as `torch.nn.utils.clip_grad_norm_` after DDP's averaging, every parameter's
//! gradient is scaled by `min(1, max / (norm + 1e-6))`, `norm` over all of them.
//!
//! - Data parallel: a node holds the step's reduced buckets until all are in ([`Collect`]'s
//!   held buckets), and clips them by their own norm: it holds the whole gradient.
//! - Sharded: each owner holds its reduce-scatters' results the same way, sums the squares of
//!   the part it owns, and sends that piece to the rest of its ring
//!   ([`ravnest_protocol::msg::Envelope::GradNorm`]).
//! - A pipeline: each stage sums the squares of its layers' gradient (reduced with its sync
//!   group first, when it has one) and sends the piece to its neighbours in its replica, who
//!   pass each piece on away from where it came, so that every stage gets every piece.
//!
//! A node applies its held gradient once the pieces of every part are in ([`Norms`]): all
//! of them sum the same pieces in part order and clip by the same factor, so replicas still
//! agree bit for bit. A halt drops the held step with the running one; the pieces of older
//! steps are forgotten as steps are applied.
//!
//! [`Collect`]: ravnest_protocol::node::step::Collect
//! [`Norms`]: ravnest_protocol::node::clip::Norms

use ravnest_core::collective::CollId;
use ravnest_core::recipe::{clip_factor, scale, sum_sq};

use super::NodeActor;
use super::state::NodeState;
use super::step::Made;
use crate::counters::Count;
use crate::seams::{Compute, Transport};
use ravnest_protocol::msg::Addr;
use ravnest_protocol::node::clip::route;

/// A node's state, as this backend's node holds it.
type State<C> = NodeState<<C as Compute>::Model, <C as Compute>::StageGrad>;

impl<T: Transport, C: Compute> NodeActor<T, C> {
    /// The running step's reduced gradient may be complete: clip it by its own norm (a node
    /// that holds the whole gradient), or send this node's piece of the norm and apply it once
    /// the other parts' pieces are in.
    pub(super) async fn clip_held(&self, st: &mut State<C>) {
        let Some(max) = self.compute.max_grad_norm() else {
            return;
        };
        let Some(r) = st.running.as_ref().filter(|r| r.c.all_held()) else {
            return;
        };
        let piece: f64 =
            r.c.held()
                .map(|(target, g)| match &r.shard {
                    Some(l) => sum_sq(&g[l.mine_in(target)]),
                    None => sum_sq(g),
                })
                .sum();
        let at = (r.c.epoch, r.c.step);
        if st.core.work().and_then(|w| route(w, self.id)).is_none() {
            // The whole gradient is here: its own norm.
            return self.apply_held(st, piece, max).await;
        }
        self.tell(st, at, piece);
        self.try_clip(st).await;
    }

    /// A stage that applies its own gradient has it (`Pipe::clip`): send its piece of the norm.
    pub(super) async fn clip_stage(&self, st: &mut State<C>) {
        let Some(p) = st.pipe.as_ref() else { return };
        let Some(values) = p.clip.as_ref() else {
            return;
        };
        let (at, piece) = ((p.stage.epoch, p.stage.step), sum_sq(values));
        // A pipeline of one stage: the whole gradient is here, its piece the norm.
        self.tell(st, at, piece);
        self.try_clip(st).await;
    }

    /// Keep this node's piece of a step's norm and send it along its route.
    fn tell(&self, st: &mut State<C>, at: (u64, u64), sq: f64) {
        for (to, piece) in st.norms.mine(st.core.work(), self.id, at, sq) {
            self.send(Addr::Node(to), piece);
        }
    }

    /// A peer's piece of a step's norm: keep it, pass it on along the pipeline, and apply the
    /// held gradient if this completed its norm.
    pub(super) async fn on_grad_norm(
        &self,
        st: &mut State<C>,
        epoch: u64,
        step: u64,
        part: u32,
        sq: f64,
    ) {
        let seen = (st.core.work(), st.core.latest());
        let Some(on) = st.norms.theirs(seen, (epoch, step), part, sq) else {
            return;
        };
        if let Some((to, piece)) = on {
            self.send(Addr::Node(to), piece);
        }
        self.try_clip(st).await;
    }

    /// Apply what waits for its norm (the running step's held buckets, or a stage's own
    /// gradient) once every part's piece is in.
    async fn try_clip(&self, st: &mut State<C>) {
        let Some(max) = self.compute.max_grad_norm() else {
            return;
        };
        let (w, me) = (st.core.work(), self.id);
        if let Some(r) = st.running.as_ref()
            && r.c.all_held()
            && let Some(total) = st.norms.total(w, me, (r.c.epoch, r.c.step))
        {
            return self.apply_held(st, total, max).await;
        }
        let Some(p) = st.pipe.as_ref().filter(|p| p.clip.is_some()) else {
            return;
        };
        let Some(total) = st.norms.total(w, me, (p.stage.epoch, p.stage.step)) else {
            return;
        };
        st.norms.forget_through(p.stage.epoch, p.stage.step);
        let Some(mut p) = st.pipe.take() else { return };
        let Some(w) = st.core.work().cloned() else {
            return;
        };
        let mut values = p.clip.take().unwrap_or_default();
        scale(&mut values, clip_factor(total, max));
        self.record_norm(p.stage.step, total);
        let made = Made::of(&p);
        let mut next = p.model;
        let applied = self
            .compute
            .apply_update(&mut next, p.range.clone(), &values);
        if let Err(e) = applied {
            return self.fail(made.epoch, e.to_string());
        }
        self.compute.end_update(&mut next);
        self.stage_applied(st, &w, made, next).await
    }

    /// Clip the running step's held buckets by the norm whose square is `total`, and apply
    /// them (a sharded owner updates its part and starts the all-gathers).
    async fn apply_held(&self, st: &mut State<C>, total: f64, max: f32) {
        let f = clip_factor(total, max);
        let Some(r) = st.running.as_mut() else { return };
        st.norms.forget_through(r.c.epoch, r.c.step);
        self.record_norm(r.c.step, total);
        let held = r.c.take_held();
        let (epoch, step, layout) = (r.c.epoch, r.c.step, r.shard.clone());
        let mut gathers = Vec::new();
        let mut applied = Ok(());
        for (k, target, mut g) in held {
            if applied.is_err() {
                continue;
            }
            match &layout {
                Some(l) => {
                    scale(&mut g[l.mine_in(&target)], f);
                    applied = self
                        .update_owned(&mut r.next, &target, g, l)
                        .map(|values| gathers.push((k, target, values)));
                }
                None => {
                    scale(&mut g, f);
                    applied = self
                        .compute
                        .apply_update(&mut r.next, target, &g)
                        .map_err(|e| e.to_string());
                    self.compute.recycle(g);
                }
            }
        }
        if let Err(reason) = applied {
            st.running = None;
            return self.fail(epoch, reason);
        }
        if let Some(l) = &layout {
            for (k, target, values) in gathers {
                let id = CollId {
                    epoch,
                    step,
                    bucket: k,
                };
                self.start_gather(st, id, &target, values, l);
            }
        }
        self.try_finish(st).await;
    }

    /// The step's global gradient norm before clipping, for the events.
    fn record_norm(&self, step: u64, total: f64) {
        let norm = total.max(0.0).sqrt();
        self.record(Count::GradNorm { step, norm });
    }
}

//! Global gradient-norm clipping (`[run] max_grad_norm`) of a step's mean gradient, whatever
//! the layout: as `torch.nn.utils.clip_grad_norm_` after DDP's averaging, every parameter's
//! gradient is scaled by `min(1, max / (norm + 1e-6))`, `norm` over all of them.
//!
//! - Data parallel: a node holds the step's reduced buckets until all are in ([`Collect`]'s
//!   held buckets), and clips them by their own norm: it holds the whole gradient.
//! - Sharded: each owner holds its reduce-scatters' results the same way, sums the squares of
//!   the part it owns, and sends that piece to the rest of its ring
//!   ([`crate::msg::Envelope::GradNorm`]).
//! - A pipeline: each stage sums the squares of its layers' gradient (reduced with its sync
//!   group first, when it has one) and sends the piece to its neighbours in its replica, who
//!   pass each piece on away from where it came, so that every stage gets every piece.
//!
//! A node applies its held gradient once the pieces of every part are in ([`Norms`]): all
//! of them sum the same pieces in part order and clip by the same factor, so replicas still
//! agree bit for bit. A halt drops the held step with the running one; the pieces of older
//! steps are forgotten as steps are applied.
//!
//! [`Collect`]: crate::node::step::Collect
//! [`Norms`]: crate::node::clip::Norms

use ravnest_core::collective::CollId;
use ravnest_core::recipe::{clip_factor, scale, sum_sq};

use super::stage::StageStep;
use super::{Act, Machine};
use crate::msg::Addr;
use crate::node::clip::route;
use crate::node::values::Values;

impl<V: Values> Machine<V> {
    /// The running step's reduced gradient may be complete: clip it by its own norm (a node
    /// that holds the whole gradient), or send this node's piece of the norm and apply it once
    /// the other parts' pieces are in.
    pub(super) fn clip_held(&mut self) {
        let Some(max) = self.values.max_grad_norm() else {
            return;
        };
        let Some(r) = self.running.as_ref().filter(|r| r.c.all_held()) else {
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
        if self.core.work().and_then(|w| route(w, self.id)).is_none() {
            // The whole gradient is here: its own norm.
            return self.apply_held(piece, max);
        }
        self.tell(at, piece);
        self.try_clip();
    }

    /// A stage that applies its own gradient has it (`Pipe::clip`): send its piece of the norm.
    pub(super) fn clip_stage(&mut self) {
        let Some(p) = self.pipe.as_ref() else { return };
        let Some(values) = p.clip.as_ref() else {
            return;
        };
        let (at, piece) = ((p.stage.epoch, p.stage.step), sum_sq(values));
        // A pipeline of one stage: the whole gradient is here, its piece the norm.
        self.tell(at, piece);
        self.try_clip();
    }

    /// Keep this node's piece of a step's norm and send it along its route.
    fn tell(&mut self, at: (u64, u64), sq: f64) {
        for (to, piece) in self.norms.mine(self.core.work(), self.id, at, sq) {
            self.acts.push(Act::Send(Addr::Node(to), piece));
        }
    }

    /// A peer's piece `sq` of part `part` of step `step`'s norm: keep it, pass it on along the
    /// pipeline, and apply the held gradient if this completed its norm.
    pub(super) fn grad_norm(&mut self, (epoch, step): (u64, u64), part: u32, sq: f64) {
        let seen = (self.core.work(), self.core.latest());
        let Some(on) = self.norms.theirs(seen, (epoch, step), part, sq) else {
            return;
        };
        if let Some((to, piece)) = on {
            self.acts.push(Act::Send(Addr::Node(to), piece));
        }
        self.try_clip();
    }

    /// Apply what waits for its norm (the running step's held buckets, or a stage's own
    /// gradient) once every part's piece is in.
    fn try_clip(&mut self) {
        let Some(max) = self.values.max_grad_norm() else {
            return;
        };
        let (w, me) = (self.core.work(), self.id);
        if let Some(r) = self.running.as_ref()
            && r.c.all_held()
            && let Some(total) = self.norms.total(w, me, (r.c.epoch, r.c.step))
        {
            return self.apply_held(total, max);
        }
        let Some(p) = self.pipe.as_ref().filter(|p| p.clip.is_some()) else {
            return;
        };
        let Some(total) = self.norms.total(w, me, (p.stage.epoch, p.stage.step)) else {
            return;
        };
        self.norms.forget_through(p.stage.epoch, p.stage.step);
        let Some(mut p) = self.pipe.take() else {
            return;
        };
        let Some(w) = self.core.work().cloned() else {
            return;
        };
        let mut values = p.clip.take().unwrap_or_default();
        scale(&mut values, clip_factor(total, max));
        self.record_norm(p.stage.step, total);
        let made = StageStep::of(&p);
        let mut next = p.model;
        let applied = self
            .values
            .apply_update(&mut next, p.range.clone(), &values);
        if let Err(e) = applied {
            return self.fail(made.epoch, e.to_string());
        }
        self.values.end_update(&mut next);
        self.stage_applied(&w, made, next)
    }

    /// Clip the running step's held buckets by the norm whose square is `total`, and apply
    /// them (a sharded owner updates its part and starts the all-gathers).
    fn apply_held(&mut self, total: f64, max: f32) {
        let f = clip_factor(total, max);
        let values = self.values.clone();
        let Some(r) = self.running.as_mut() else {
            return;
        };
        self.norms.forget_through(r.c.epoch, r.c.step);
        let (epoch, step, layout) = (r.c.epoch, r.c.step, r.shard.clone());
        let held = r.c.take_held();
        let mut gathers = Vec::new();
        let mut applied = Ok(());
        for (k, target, mut g) in held {
            if applied.is_err() {
                continue;
            }
            match &layout {
                Some(l) => {
                    scale(&mut g[l.mine_in(&target)], f);
                    applied = super::sharded::update_owned(&*values, &mut r.next, &target, g, l)
                        .map(|owned| gathers.push((k, target, owned)));
                }
                None => {
                    scale(&mut g, f);
                    applied = values
                        .apply_update(&mut r.next, target, &g)
                        .map_err(|e| e.to_string());
                    values.recycle(g);
                }
            }
        }
        self.record_norm(step, total);
        if let Err(reason) = applied {
            return self.fail_step(epoch, reason);
        }
        if let Some(l) = &layout {
            for (k, target, owned) in gathers {
                let id = CollId {
                    epoch,
                    step,
                    bucket: k,
                };
                self.start_gather(id, &target, owned, l);
            }
        }
        self.try_finish();
    }

    /// The step's global gradient norm before clipping, for the events.
    fn record_norm(&mut self, step: u64, total: f64) {
        let norm = total.max(0.0).sqrt();
        self.acts.push(Act::GradNorm { step, norm });
    }
}

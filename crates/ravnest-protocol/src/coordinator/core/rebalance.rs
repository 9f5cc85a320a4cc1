//! Rebalancing: measured speeds and ring times against the plan's, and a new plan when one
//! predicts enough gain (or links are slower than assumed).

use super::{
    Assign, BTreeMap, Coordinator, Era, Event, NodeId, SpeedEstimate, StepCost, assignments,
    balanced_bound, compute_bound, configured,
};
impl Coordinator {
    /// Whether measurements say a re-plan is worth it (see the module's notes on noise), and
    /// whether a node left out for its measured speed is due another chance.
    pub(super) fn consider_replan(&mut self) {
        if self.halting.is_some() || self.eras.len() != 1 || self.finished || self.stop.is_some() {
            return;
        }
        let cur = self.eras[0].clone();
        if self.probation_due(&cur) {
            return self.switch();
        }
        let t = self.cfg.tuning;
        // Each re-plan in the last hundred steps makes the next wait longer: a node's new share
        // shows how the old figures were off, and chasing that error is what oscillates.
        let recent = self
            .rebalanced_at
            .iter()
            .filter(|&&at| at + t.replan_memory_steps > self.agreed)
            .count() as u64;
        // Each node's cost as measured: the plan's figures times its smoothed ratio; a node
        // never measured, its configured figures times the contention the workers show.
        let typical = self.typical_contention(&cur);
        let measured: BTreeMap<NodeId, StepCost> = self
            .assumed
            .iter()
            .map(|(n, &(per_sample, fixed))| match self.measured.get(n) {
                Some(m) => (*n, (per_sample * m.get(), fixed * m.get())),
                None if !cur.has(*n) && (per_sample, fixed) == configured(&self.cfg, *n) => {
                    (*n, (per_sample * typical, fixed * typical))
                }
                None => (*n, (per_sample, fixed)),
            })
            .collect();
        let cost = |n: NodeId| measured.get(&n).copied().unwrap_or((1.0, 0.0));
        let now = compute_bound(&cur.assigns, cost);
        if self.first_fit_due(&cur) {
            // Judged at each step until the figures fill their window (noisy first steps
            // may hide the gain at first), or once it re-plans.
            self.fitted = cur.workers().all(|n| {
                self.measured
                    .get(&n)
                    .is_some_and(|m| m.len() >= t.speed_window)
            });
            // What a figure's median of `fit_steps` may be off by: the noisiest worker's
            // step-to-step spread over the square root of the figures.
            let spread = cur
                .workers()
                .filter_map(|n| self.measured.get(&n))
                .map(|m| m.log_spread() / (m.len() as f64).sqrt())
                .fold(0.0, f64::max);
            // Only a new split between the same workers: whether a node pays for its place in
            // the ring is the drift rule's question, on figures of more steps.
            let (gain, same) = self.gain_on(&measured, &cost, now);
            if same && gain >= t.fit_gain && gain.ln_1p() >= t.noise_margin * spread {
                return self.rebalance(&cur, measured, gain);
            }
        }
        if self.agreed < cur.from + t.settle_steps {
            return;
        }
        let settled = self.agreed >= cur.from + t.settle_steps * (1 + 2 * recent);
        if self.calibrate_links(&cur) {
            return;
        }
        // Drifted: off by the margin, and by more than this node's own noise (on a shared
        // machine a step can take twice as long now and then; a median of nine still moves).
        let threshold = |n: NodeId, m: &SpeedEstimate| match self.on_probation.contains(&n) {
            true => t.drift.ln_1p(),
            false => t.drift.ln_1p().max(t.noise_margin * m.log_spread()),
        };
        let off = |n: NodeId| {
            self.measured
                .get(&n)
                .map_or(0.0, |m| m.get().ln().abs() / threshold(n, m))
        };
        let drifted = cur.workers().any(|n| off(n) >= 1.0);
        // Twice the margin on both counts (a node that turned 3x slower): no need to wait.
        let glaring = cur.workers().any(|n| off(n) >= 2.0);
        if !drifted || now <= balanced_bound(&cur.assigns, cost) * (1.0 + t.min_gain) {
            self.over = 0;
            return;
        }
        // The plan the measurements ask for, and what it would gain.
        let (gain, _) = self.gain_on(&measured, &cost, now);
        self.over = if gain >= t.min_gain { self.over + 1 } else { 0 };
        // A glaring drift does not wait for patience, nor for the longer settling that recent
        // re-plans ask of a smaller one.
        let sure = glaring && gain >= 2.0 * t.min_gain;
        if !sure && (self.over < t.patience || !settled) {
            return;
        }
        self.rebalance(&cur, measured, gain);
    }

    /// Whether the first fit is to be judged now: not judged for good yet, and every worker of
    /// `cur` measured for `fit_steps` steps of it (the plan's own figure aside).
    fn first_fit_due(&self, cur: &Era) -> bool {
        let k = self.cfg.tuning.fit_steps;
        !self.fitted
            && self.agreed >= cur.from + k
            && cur
                .workers()
                .all(|n| self.measured.get(&n).is_some_and(|m| m.len() as u64 > k))
    }

    /// How much shorter than `now` the slowest node's compute would be on the plan made from
    /// the `measured` figures (0 when none can be made), and whether that plan's workers are
    /// the current epoch's.
    fn gain_on(
        &mut self,
        measured: &BTreeMap<NodeId, StepCost>,
        cost: &dyn Fn(NodeId) -> StepCost,
        now: f64,
    ) -> (f64, bool) {
        let live = self.detector.alive();
        let saved = std::mem::replace(&mut self.assumed, measured.clone());
        let workers = |a: &[Assign]| -> Vec<NodeId> {
            a.iter().filter(|a| a.batch > 0).map(|a| a.node).collect()
        };
        let current = workers(&self.eras[0].assigns);
        let (gain, same) = self
            .plan_live(&live)
            .ok()
            .and_then(|(p, sub)| {
                let (assigns, _) =
                    assignments(&p, &live, &sub, &self.cfg.model, &self.cfg.training).ok()?;
                let gain = now / compute_bound(&assigns, cost).max(f64::MIN_POSITIVE);
                Some((gain, workers(&assigns) == current))
            })
            .unwrap_or((1.0, false));
        self.assumed = saved;
        (gain - 1.0, same)
    }

    /// Re-plan on the `measured` figures (they become the ones assumed), predicted to gain
    /// `gain`.
    fn rebalance(&mut self, cur: &Era, measured: BTreeMap<NodeId, StepCost>, gain: f64) {
        let saved = std::mem::replace(&mut self.assumed, measured);
        let speeds = cur
            .workers()
            .map(|n| {
                let before = saved.get(&n).map_or(0.0, |c| c.0);
                let after = self.assumed.get(&n).map_or(0.0, |c| c.0);
                (n, before, after)
            })
            .collect();
        self.measured.clear();
        self.on_probation.clear();
        self.fitted = true;
        self.rebalanced_at.push(self.agreed);
        self.emit(Event::Rebalanced {
            step: self.agreed,
            predicted_gain: gain,
            speeds,
        });
        self.switch();
    }

    /// The ring measured slower (or, after a scaling, faster) than the links the plan assumed:
    /// loopback probes see 15 Gbit/s, while a ring of encrypted, reduced chunks on busy CPUs
    /// moves far less. The links are scaled so that the cost model's ring takes what the ring
    /// took (as a run's profile scales them for `plan` and `sim`), and the live nodes are
    /// re-planned when that changes the plan: a node whose share does not pay for what it adds
    /// to the all-reduce is left out on what the ring costs, not on what the probes promised.
    /// Whether it switched.
    pub(super) fn calibrate_links(&mut self, cur: &Era) -> bool {
        let min_steps = 2 * self.cfg.tuning.settle_steps.max(1) as usize;
        let Some((n, ring_s)) = self.ring.get(min_steps) else {
            return false;
        };
        // The ring's own links, each member to the next (not every pair: this runs every step).
        let ring = cur.assigns.first().map_or(&[][..], |a| &a.ring[..]);
        let links: Vec<_> = ring
            .iter()
            .zip(ring.iter().cycle().skip(1))
            .map(|(&a, &b)| self.cfg.cluster.link(a, b))
            .collect();
        let costs =
            ravnest_core::cost::Costs::new(&self.cfg.cluster, &self.cfg.model, &self.cfg.training);
        let bytes = costs.grad_bytes(costs.all()) as f64;
        let scale = ravnest_core::profile::ring_bandwidth_scale(&links, n, bytes, ring_s);
        // Noise is not a change: a quarter slower, or half faster (and on a ring as large)
        // before anything moves.
        let ratio = scale / self.link_scale;
        let t = self.cfg.tuning;
        if (ratio < 1.0 && ratio > 1.0 / t.links_slower)
            || (ratio >= 1.0 && (ratio < t.links_faster || n < self.link_scale_ring))
        {
            return false;
        }
        (self.link_scale, self.link_scale_ring) = (scale, n);
        self.ring.clear();
        let replan = self.plan_changes(cur);
        self.emit(Event::LinksScaled {
            step: self.agreed,
            ring_s,
            ring_nodes: n,
            scale,
            replanned: replan,
        });
        if replan {
            self.switch();
        }
        replan
    }

    /// How much slower than their configured figures the workers of `cur` run (the least of
    /// their measured ratios, so that one straggler does not count for all): what a node not
    /// measured yet would show beside them (on a shared machine, the same contention; with a
    /// biased calibration, the same bias). 1 with nothing measured.
    pub(super) fn typical_contention(&self, cur: &Era) -> f64 {
        cur.workers()
            .filter_map(|n| {
                let k = self.measured.get(&n)?.get();
                let assumed = self.assumed.get(&n)?.0;
                let configured = configured(&self.cfg, n).0;
                (configured > 0.0).then(|| assumed * k / configured)
            })
            .filter(|k| k.is_finite() && *k > 0.0)
            .reduce(f64::min)
            .unwrap_or(1.0)
    }

    /// Nodes left out for their measured speed for long enough are planned as if they had
    /// recovered (their configured figures times the workers' contention) and re-measured,
    /// so a straggler that recovered comes back; each try waits twice as long as the last.
    /// Whether that changes the plan (a node that would not pay even recovered stays out,
    /// without a new epoch).
    pub(super) fn probation_due(&mut self, cur: &Era) -> bool {
        let typical = self.typical_contention(cur);
        let recovered = |n: NodeId| {
            let (per_sample, fixed) = configured(&self.cfg, n);
            (per_sample * typical, fixed * typical)
        };
        let margin = 1.0 + self.cfg.tuning.drift;
        let due: Vec<NodeId> = self
            .left_out
            .iter()
            .filter(|(n, since)| {
                let wait = self.probation_wait.get(n).copied();
                self.agreed >= **since + wait.unwrap_or(self.cfg.tuning.probation_steps)
                    && self.detector.is_alive(**n)
                    && self
                        .assumed
                        .get(n)
                        .is_some_and(|a| a.0 > recovered(**n).0 * margin)
            })
            .map(|(n, _)| *n)
            .collect();
        for n in &due {
            self.assumed.insert(*n, recovered(*n));
            self.measured.remove(n);
            self.left_out.insert(*n, self.agreed);
            let wait = self.probation_wait.entry(*n);
            *wait.or_insert(self.cfg.tuning.probation_steps) *= 2;
            self.on_probation.insert(*n);
        }
        let changes = !due.is_empty() && self.plan_changes(cur);
        if changes {
            self.emit(Event::Probation {
                step: self.agreed,
                nodes: due,
            });
        }
        changes
    }

    /// Whether planning the live nodes now gives `cur` other batches or workers.
    pub(super) fn plan_changes(&mut self, cur: &Era) -> bool {
        let live = self.detector.alive();
        let shape =
            |a: &[Assign]| -> Vec<(NodeId, u64)> { a.iter().map(|a| (a.node, a.batch)).collect() };
        self.plan_live(&live)
            .ok()
            .and_then(|(p, sub)| {
                assignments(&p, &live, &sub, &self.cfg.model, &self.cfg.training).ok()
            })
            .is_some_and(|(a, _)| shape(&a) != shape(&cur.assigns))
    }
}

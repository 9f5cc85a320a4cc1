//! Epochs: planning the live nodes, staffing a plan from what holders have, waiting when
//! none fits, and sending each node its work; a switch to the next epoch at a boundary no node
//! has passed.

use super::{
    Assign, BTreeMap, CheckpointDuty, ClusterSpec, Collective, Coordinator, Envelope, Era, Event,
    Holders, LayerRange, NodeId, Plan, Staffing, SyncMethod, SyncPolicy, Unstaffed, Waiting, Work,
    assignments, median,
};
impl Coordinator {
    /// The plan for the live nodes at the speeds the planner is given (cached: planning is a
    /// pure function of the live set and the speeds).
    pub(super) fn plan_live(&mut self, live: &[NodeId]) -> Result<(Plan, ClusterSpec), String> {
        let mut sub = self.cfg.cluster.subset(live);
        for n in &mut sub.nodes {
            n.link.bandwidth_gbps *= self.link_scale;
        }
        for l in sub.pair_links.values_mut() {
            l.bandwidth_gbps *= self.link_scale;
        }
        // A node whose noise was not measured: the median of the others' (on one machine, or
        // one kind of cluster, noise is alike); 0 with none measured.
        let typical_noise = median(self.noise.values().copied().collect());
        for (k, id) in live.iter().enumerate() {
            if let Some(&(per_sample, fixed)) = self.assumed.get(id) {
                sub.nodes[k].flops = self.cfg.train_flops / per_sample;
                sub.nodes[k].step_overhead_s = fixed;
            }
            sub.nodes[k].compute_spread = self.noise.get(id).copied().unwrap_or(typical_noise);
        }
        let key: Vec<u64> = sub
            .nodes
            .iter()
            .flat_map(|n| {
                [
                    n.flops.to_bits(),
                    n.step_overhead_s.to_bits(),
                    n.compute_spread.to_bits(),
                ]
            })
            .chain([self.link_scale.to_bits()])
            .collect();
        if let Some((k, l, p)) = &self.plan_cache
            && *k == key
            && l == live
        {
            return Ok((p.clone(), sub));
        }
        // The one policy (`ravnest_core::policy`), with this backend's stages.
        let (cfg, model, training) = (&self.cfg, &self.cfg.model, &self.cfg.training);
        let p = ravnest_core::policy(cfg.planner, &sub, model, training, cfg.allow_pipeline)
            .map_err(|e| {
                let names: Vec<&str> = sub.nodes.iter().map(|n| n.name.as_str()).collect();
                format!(
                    "no plan for the live nodes ({}) at global batch {}: {e}",
                    names.join(", "),
                    training.global_batch
                )
            })?;
        self.plan_cache = Some((key, live.to_vec(), p.clone()));
        Ok((p, sub))
    }

    /// Plan the live nodes and start a new epoch at step `from`, where `holders` hold version
    /// `from`. Nodes that do not hold it fetch it (whole, or the layers they lack).
    pub(super) fn begin_epoch(
        &mut self,
        from: u64,
        holders: &Holders,
        switched_from: Option<&Era>,
    ) {
        let s = match self.staff(from, holders) {
            Ok(s) => s,
            Err(Unstaffed::Lost(why)) => {
                self.waiting = None;
                if self.restore(&why) {
                    return;
                }
                return self.finish(Event::Stalled(why));
            }
            // A resumption (no epoch runs): wait for nodes. A switch (the running epoch goes
            // on) or the start cannot wait on a plan that never came.
            Err(Unstaffed::Short(why)) if self.eras.is_empty() && self.epoch > 0 => {
                return self.wait(from, holders, why);
            }
            Err(Unstaffed::CutOff(why)) => {
                self.wait(from, holders, why);
                if let Some(w) = &mut self.waiting {
                    w.cut_off = true;
                }
                return;
            }
            Err(Unstaffed::Short(why)) => return self.finish(Event::Stalled(why)),
        };
        self.waiting = None;
        self.quorum = s.live.len();
        let (policy, collective) = match s.plan.sync.method {
            SyncMethod::LocalSgd {
                local_steps,
                collective,
                outer,
            } => {
                self.local_sgd = true;
                (SyncPolicy::LocalSgd { local_steps, outer }, collective)
            }
            SyncMethod::EveryStep { collective } => (SyncPolicy::EveryStep, collective),
            SyncMethod::None => (SyncPolicy::EveryStep, Collective::Ring),
        };
        for &n in &s.live {
            if s.assigns.iter().any(|a| a.node == n) {
                self.left_out.remove(&n);
            } else {
                self.left_out.entry(n).or_insert(from);
            }
        }
        self.epoch += 1;
        // Who owns which part from here: what a later sharded epoch may keep without a fetch.
        self.shard_parts = s
            .assigns
            .iter()
            .filter_map(|a| Some((a.node, a.shard.as_ref()?.owned)))
            .collect();
        self.say_planned(from, &s.assigns);
        let until = (from + policy.window(self.cfg.tuning.window)).min(self.cfg.steps);
        let group_size = s.plan.sync.groups.first().map_or(0, |g| g.group_size);
        // A switch at a round between local-SGD epochs of the same groups: every replica made
        // that round, so every one holds the same outer momentum, and it goes on.
        let outer_from = switched_from
            .filter(|e| e.groups == s.groups)
            .filter(|e| matches!(e.policy, SyncPolicy::LocalSgd { .. }))
            .filter(|_| matches!(policy, SyncPolicy::LocalSgd { .. }))
            .map(|e| e.epoch);
        self.send_work(
            &s,
            (from, until),
            policy,
            collective,
            group_size,
            outer_from,
        );
        let sources = s.sources();
        self.eras.push(Era {
            epoch: self.epoch,
            from,
            assigns: s.assigns,
            groups: s.groups,
            policy,
            collective,
            sources,
        });
        self.until = until;
        self.over = 0;
        // Under local SGD the nodes synchronize once a period: that is the step to wait for.
        let period = match policy {
            SyncPolicy::LocalSgd { local_steps, .. } => f64::from(local_steps.max(1)),
            SyncPolicy::EveryStep => 1.0,
        };
        self.predicted_step_ms = s.plan.step.step_s * 1e3 * period;
        self.last_progress_ms = self.now_ms;
        self.last_agreed_ms = self.now_ms;
        self.replicate(true);
    }

    /// Who does what from step `from`: the plan of the live nodes, their assignments (each
    /// stage with the layers it fetches), and where a data-parallel node that lacks the version
    /// fetches it. Or why training cannot go on.
    pub(super) fn staff(&mut self, from: u64, holders: &Holders) -> Result<Staffing, Unstaffed> {
        let mut live = self.detector.alive();
        live.retain(|n| !self.leaving.contains(n));
        if live.is_empty() {
            return Err(Unstaffed::Lost("no live nodes".into()));
        }
        // (Only when resuming after losses: no epoch runs.)
        if self.cfg.host.is_some() && self.eras.is_empty() && live.len() * 2 < self.quorum {
            return Err(Unstaffed::CutOff(format!(
                "only {} of the {} members are reachable: this coordinator may be cut off while the others take over; waiting for them",
                live.len(),
                self.quorum
            )));
        }
        if !holders.keys().any(|h| self.detector.is_alive(*h)) {
            return Err(Unstaffed::Lost(
                "no live node holds the latest model".into(),
            ));
        }
        let holders: Holders = holders
            .iter()
            .filter(|(h, _)| self.detector.is_alive(**h))
            .map(|(h, l)| (*h, *l))
            .collect();
        let (plan, sub) = self.plan_live(&live).map_err(Unstaffed::Short)?;
        let (mut assigns, groups) =
            assignments(&plan, &live, &sub, &self.cfg.model, &self.cfg.training)
                .map_err(Unstaffed::Short)?;
        let all = LayerRange::new(0, self.cfg.model.layers.len() as u32);
        for a in &mut assigns {
            if let Some(sw) = &mut a.stage {
                sw.fetch = super::super::assign::fetch_plan(&holders, a.node, sw.layers, from)
                    .map_err(Unstaffed::Lost)?;
            }
            if let Some(sw) = &mut a.shard {
                let prior = self.shard_parts.get(&a.node).copied();
                sw.fetch =
                    super::super::assign::shard_fetch(&holders, prior, a.node, sw.owned, all, from)
                        .map_err(Unstaffed::Lost)?;
            }
        }
        // A node that lacks the version fetches it from a holder the new epoch keeps (a holder
        // left out could go away unnoticed), else from any holder.
        let whole: Vec<NodeId> = holders
            .iter()
            .filter(|(_, l)| l.is_none())
            .map(|(h, _)| *h)
            .collect();
        let whole_holder = whole
            .iter()
            .copied()
            .find(|h| assigns.iter().any(|a| a.node == *h))
            .or_else(|| whole.first().copied());
        let s = Staffing {
            live,
            plan,
            assigns,
            groups,
            holders,
            whole_holder,
        };
        if s.assigns.iter().any(|a| s.lacks_model(a)) && s.whole_holder.is_none() {
            return Err(Unstaffed::Lost(
                "no live node holds the whole latest model for a data-parallel plan".into(),
            ));
        }
        Ok(s)
    }

    /// No plan fits the live nodes after a loss: training waits (no epoch runs; the live
    /// nodes stay halted and keep version `from`) until a node comes back, for at most
    /// `wait_for_nodes_ms` from the first such plan failure. Said once per reason.
    pub(super) fn wait(&mut self, from: u64, holders: &Holders, why: String) {
        let since_ms = self.waiting.as_ref().map_or(self.now_ms, |w| w.since_ms);
        if self.waiting.as_ref().is_none_or(|w| w.why != why) {
            self.emit(Event::Waiting {
                step: from,
                why: why.clone(),
            });
        }
        self.floor = from;
        self.waiting = Some(Waiting {
            from,
            holders: holders.clone(),
            why,
            since_ms,
            cut_off: false,
        });
        self.replicate(true);
    }

    /// A node came back while training waits: plan again with it.
    pub(super) fn stop_waiting(&mut self) {
        let Some(w) = self.waiting.clone() else {
            return;
        };
        self.joiners.clear();
        self.begin_epoch(w.from, &w.holders, None);
    }

    /// Training waited for nodes for longer than it may: the run stops, saying why.
    pub(super) fn give_up_waiting(&mut self) {
        let Some(w) = &self.waiting else { return };
        let waited = self.now_ms.saturating_sub(w.since_ms);
        // A successor that took over while cut off from most of the members (a node frozen
        // or partitioned alone suspected the coordinator like the others) gives its term up
        // after three silences: the coordinator it replaced may well be training on with them.
        if w.cut_off && self.term > 0 && waited > 9 * self.cfg.heartbeat_timeout_ms {
            let (step, why) = (w.from, w.why.clone());
            self.waiting = None;
            return self.finish(Event::CutOff { step, why });
        }
        if waited <= self.cfg.wait_for_nodes_ms {
            return;
        }
        let why = format!(
            "{} (training waited {:.0} s at step {} for lost nodes to come back)",
            w.why,
            waited as f64 / 1e3,
            w.from
        );
        self.waiting = None;
        self.finish(Event::Stalled(why));
    }

    /// Say the plan when its split (workers, batches, layers) differs from the last one said.
    pub(super) fn say_planned(&mut self, from: u64, assigns: &[Assign]) {
        let planned: Vec<(NodeId, u64)> = assigns.iter().map(|a| (a.node, a.batch)).collect();
        let layers: Vec<Option<LayerRange>> = assigns
            .iter()
            .map(|a| a.stage.as_ref().map(|s| s.layers))
            .collect();
        if self.last_planned.as_ref() != Some(&(planned.clone(), layers.clone())) {
            let mut stages: Vec<(u32, NodeId, LayerRange)> = assigns
                .iter()
                .filter_map(|a| a.stage.as_ref().map(|s| (s.stage, a.node, s.layers)))
                .collect();
            stages.sort_by_key(|s| (s.0, s.2));
            let samples = assigns
                .iter()
                .filter(|a| a.batch > 0 && a.stage.as_ref().is_none_or(|s| s.stage == 0))
                .map(|a| (a.node, a.offset..a.offset + a.batch))
                .collect();
            self.emit(Event::Planned {
                step: from,
                workers: planned.clone(),
                stages: stages.into_iter().map(|(_, n, l)| (n, l)).collect(),
                samples,
            });
            self.last_planned = Some((planned, layers));
        }
    }

    /// Every assigned node's work for the new epoch (the first member of each layer group
    /// writes its checkpoint shard).
    pub(super) fn send_work(
        &mut self,
        s: &Staffing,
        (from, until): (u64, u64),
        sync: SyncPolicy,
        collective: Collective,
        group_size: u32,
        outer_from: Option<u64>,
    ) {
        let writers: BTreeMap<NodeId, LayerRange> = s
            .groups
            .iter()
            .filter_map(|(layers, members)| Some((*members.first()?, *layers)))
            .collect();
        for a in &s.assigns {
            let work = Work {
                epoch: self.epoch,
                step: from,
                until,
                end: self.cfg.steps,
                offset: a.offset,
                batch: a.batch,
                global_batch: u64::from(self.cfg.training.global_batch),
                chunk: a.chunk,
                ring: a.ring.clone(),
                state_from: s.lacks_model(a).then_some(s.whole_holder).flatten(),
                sync,
                collective,
                group_size,
                stage: a.stage.clone(),
                checkpoint: writers.get(&a.node).map(|&layers| CheckpointDuty {
                    layers,
                    every: self.cfg.checkpoint_every,
                    catch_up: self.catch_up,
                    at_end: self.cfg.checkpoint_at_end,
                    last: from,
                }),
                shard: a.shard.clone(),
                outer_from,
            };
            self.send(a.node, Envelope::Work(Box::new(work)));
        }
    }

    /// Re-plan at the next step no node can have started yet (the current horizon; under
    /// local SGD, the next averaging step from there), without stopping anyone.
    pub(super) fn switch(&mut self) {
        let Some(cur) = self.eras.last().cloned() else {
            return;
        };
        let at =
            cur.policy
                .next_synchronized(cur.from, self.cfg.steps, self.until.max(cur.from + 1));
        if at >= self.cfg.steps {
            return;
        }
        // A sharded epoch's parts move by fetches; a plan whose state some node could not
        // fetch from a live holder waits (a halt restores it from the checkpoint) rather than
        // stopping a running epoch for it.
        if cur.assigns.iter().any(|a| a.shard.is_some()) && self.staff(at, &cur.holders()).is_err()
        {
            return;
        }
        if at > self.until {
            // The old epoch runs to the averaging step first.
            for w in cur.workers() {
                self.send(
                    w,
                    Envelope::Grant {
                        epoch: cur.epoch,
                        until: at,
                    },
                );
            }
        }
        self.begin_epoch(at, &cur.holders(), Some(&cur));
    }
}

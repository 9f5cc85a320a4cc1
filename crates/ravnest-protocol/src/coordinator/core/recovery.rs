//! Recovery: a lost node halts the running epochs; the survivors say what they hold, and
//! training resumes from the newest version every replica can make (or from a checkpoint, when
//! a model part is lost); the watchdog redoes steps that no node completes.

use super::{
    BTreeMap, BTreeSet, Coordinator, Effect, Envelope, Era, Event, Halting, HeldVersion, Holders,
    NodeId,
};
impl Coordinator {
    pub(super) fn on_dead(&mut self, node: NodeId, silent_ms: u64) {
        self.emit(Event::Detected { node, silent_ms });
        // A writer lost before its shard arrived: that round cannot complete; the next
        // checkpoint is due at the next synchronized version.
        if let Some((version, writers)) = &self.pending_checkpoint
            && writers.contains(&node)
        {
            let version = *version;
            self.out
                .push(Effect::Checkpoint(Envelope::CheckpointAbandon {
                    step: version,
                }));
            self.pending_checkpoint = None;
            self.catch_up = self.catch_up.min(version);
        }
        self.initial.remove(&node);
        self.replicate(true);
        self.lost_worker(node);
    }

    /// A worker of a running epoch is gone (dead, or restarted without its state): halt.
    pub(super) fn lost_worker(&mut self, node: NodeId) {
        if let Some(h) = &mut self.halting {
            h.waiting.remove(&node);
            h.held.remove(&node);
            return self.try_resume();
        }
        if !self.involved().contains(&node) {
            return;
        }
        self.emit(Event::Aborted { step: self.agreed });
        self.halt(Some(node));
    }

    /// Halt every live node of the running epochs (but `lost`); they answer with what they hold.
    pub(super) fn halt(&mut self, lost: Option<NodeId>) {
        let involved = if self.taking_over.is_some() {
            self.detector.alive().into_iter().collect()
        } else {
            self.involved()
        };
        let waiting: BTreeSet<NodeId> = involved
            .into_iter()
            .filter(|&n| Some(n) != lost && self.detector.is_alive(n))
            .collect();
        let epoch = self.epoch;
        for &n in &waiting {
            self.send(n, Envelope::Halt { epoch });
        }
        self.halting = Some(Halting {
            epoch,
            waiting,
            held: BTreeMap::new(),
        });
        self.last_progress_ms = self.now_ms;
        self.try_resume();
    }

    /// Nothing moved for much longer than a step takes: some message was lost on a live link
    /// (a connection reset drops what it had in flight). Halt and resume from what every node
    /// holds, which redoes the step in flight consistently everywhere; during a halt, ask the
    /// nodes that have not answered again.
    pub(super) fn watchdog(&mut self) {
        // Ten times the longest recent interval between agreed steps (or the plan's time between
        // synchronizations), at least twice the heartbeat timeout, doubled after each resync
        // that did not help (a slow step is not a lost message).
        let step = self.step_ms.max().max(self.predicted_step_ms);
        let limit = (2 * self.cfg.heartbeat_timeout_ms)
            .max((self.cfg.tuning.watchdog_steps * step) as u64)
            << self.resyncs.min(8);
        // Nothing runs before the first epoch, but a successor's halt does (it has no epoch of
        // its own yet): one of its halts lost is asked again as any other.
        let idle = self.eras.is_empty() && self.halting.is_none();
        if idle || self.now_ms.saturating_sub(self.last_progress_ms) <= limit {
            return;
        }
        self.last_progress_ms = self.now_ms;
        if let Some(h) = &self.halting {
            let (epoch, waiting): (u64, Vec<NodeId>) =
                (h.epoch, h.waiting.iter().copied().collect());
            for n in waiting {
                self.send(n, Envelope::Halt { epoch });
            }
            return;
        }
        if self.resyncs >= self.cfg.tuning.max_resyncs {
            let why = format!(
                "no step agreed after {} resyncs at step {} though every node is alive: some nodes cannot exchange data with each other (a firewall or a one-way partition between two of them?); check that every node reaches every other at its address",
                self.resyncs, self.agreed
            );
            return self.finish(Event::Stalled(why));
        }
        self.resyncs += 1;
        self.emit(Event::Resync {
            step: self.agreed,
            silent_ms: limit,
        });
        self.halt(None);
    }

    pub(super) fn on_halted(&mut self, from: NodeId, epoch: u64, held: Vec<HeldVersion>) {
        let Some(h) = &mut self.halting else { return };
        if h.epoch != epoch || !h.waiting.remove(&from) {
            return;
        }
        h.held.insert(from, held);
        self.last_progress_ms = self.now_ms;
        self.try_resume();
    }

    /// Every halted worker answered: continue from the newest synchronized version all of
    /// them hold.
    pub(super) fn try_resume(&mut self) {
        let Some(h) = &self.halting else { return };
        if !h.waiting.is_empty() {
            return;
        }
        let h = self.halting.take().expect("checked");
        if let Some((to, why)) = self.restoring.take() {
            return self.resume_restored(to, &why, &h);
        }
        let newest_synced =
            |vs: &[HeldVersion]| vs.iter().filter(|v| v.synced).map(|v| v.version).max();
        // A node that had not reached the running epochs' start (it was still fetching it)
        // holds only older versions: it does not drag the others back.
        let start = self.eras.first().map_or(self.floor, |e| e.from);
        // A successor counts the nodes its predecessor's epochs counted on (when one answered).
        let from = self
            .resume_from
            .take()
            .filter(|f| h.held.keys().any(|n| f.contains(n)));
        // A node that does not work in the running epochs (left out, or only a source of their
        // start's layers) holds their start at best: it does not drag the workers back to a
        // version they no longer hold (a lone stage keeps only its newest).
        let workers: BTreeSet<NodeId> = self.eras.iter().flat_map(Era::workers).collect();
        let Some(v) = h
            .held
            .iter()
            .filter(|(n, _)| from.as_ref().is_none_or(|f| f.contains(n)))
            .filter(|(n, _)| workers.is_empty() || workers.contains(n))
            .filter_map(|(_, vs)| newest_synced(vs))
            .filter(|&v| v >= start)
            .min()
        else {
            // The only copy of the latest model was lost (a lone data-parallel worker): restore
            // the latest checkpoint, as for a lone pipeline stage's layers.
            let why = "no live node holds the latest model";
            if self.restore(why) {
                return;
            }
            return self.finish(Event::Stalled(why.into()));
        };
        if let Some((from, term)) = self.taking_over.take() {
            let node = self.cfg.host.unwrap_or(from);
            self.emit(Event::TookOver {
                node,
                from,
                step: v,
                term,
            });
            // Steps the predecessor could not agree any more: every survivor finished them.
            while self.agreed < v {
                self.out.push(Effect::Agreed {
                    step: self.agreed,
                    digest: None,
                });
                self.agreed += 1;
            }
        }
        // Steps below v were finished by every survivor (their reports came before their
        // answers); the lost node's reports will not come.
        while self.agreed < v && !self.finished {
            self.agree_partial(self.agreed);
        }
        if self.finished {
            return;
        }
        if v >= self.cfg.steps {
            // (A successor whose members all hold the last version.)
            return self.finish(Event::Finished);
        }
        let holders: Holders = h
            .held
            .iter()
            .filter_map(|(n, vs)| {
                let hv = vs.iter().find(|x| x.version == v)?;
                Some((*n, hv.layers))
            })
            .collect();
        self.restart_from(v, &holders);
    }

    /// Training goes on from version `v`, held by `holders`: back to it when it is older than
    /// the agreed step (a loss inside a local-SGD period, or a restored checkpoint); the
    /// versions after it are made again, and the checkpoint rule goes on from it.
    pub(super) fn restart_from(&mut self, v: u64, holders: &Holders) {
        if v < self.agreed {
            self.agreed = v;
            self.out.push(Effect::RolledBack { to: v });
        }
        self.last_synced = v;
        self.reports.clear();
        self.eras.clear();
        self.joiners.clear();
        self.begin_epoch(v, holders, None);
    }

    /// No live node holds some layers of the version to resume from (their only holders were
    /// lost): restore the latest checkpoint on one live node, which then serves it to the
    /// others, and go back to it. Whether a restore started (once per loss; only with
    /// checkpoints, and not while taking over).
    pub(super) fn restore(&mut self, why: &str) -> bool {
        if self.restoring.is_some()
            || self.cfg.checkpoint_every == 0
            || self.taking_over.is_some()
            || self.restored_at == Some(self.agreed)
        {
            return false;
        }
        let live: Vec<NodeId> = self
            .detector
            .alive()
            .into_iter()
            .filter(|n| !self.leaving.contains(n))
            .collect();
        // The host's own node where it has one (the checkpoint is read there), else the lowest.
        let Some(to) = self
            .cfg
            .host
            .filter(|h| live.contains(h))
            .or_else(|| live.first().copied())
        else {
            return false;
        };
        self.emit(Event::Restoring {
            node: to,
            why: why.to_string(),
        });
        self.restoring = Some((to, why.to_string()));
        self.eras.clear();
        self.halting = Some(Halting {
            epoch: self.epoch,
            waiting: BTreeSet::from([to]),
            held: BTreeMap::new(),
        });
        self.last_progress_ms = self.now_ms;
        self.out.push(Effect::Checkpoint(Envelope::Restore {
            to,
            epoch: self.epoch,
        }));
        true
    }

    /// The node `to` answered with the restored checkpoint among its versions: training goes
    /// back to that version, every other node fetching its layers from `to`.
    pub(super) fn resume_restored(&mut self, to: NodeId, why: &str, h: &Halting) {
        let restored = h
            .held
            .get(&to)
            .into_iter()
            .flatten()
            .filter(|v| v.synced && v.layers.is_none())
            .map(|v| v.version)
            .max();
        let Some(v) = restored else {
            return self.finish(Event::Stalled(format!(
                "{why}, and there is no checkpoint to restore them from; restart the run"
            )));
        };
        self.restored_at = Some(v);
        self.restart_from(v, &BTreeMap::from([(to, None)]));
    }

    /// Agree step `s` with the reports that came (the lost node's are missing): the epoch's
    /// groups shrink to the members that reported.
    pub(super) fn agree_partial(&mut self, s: u64) {
        let Some(e) = self.eras.iter_mut().rev().find(|e| e.from <= s) else {
            self.agreed = s + 1;
            return;
        };
        let reported = self.reports.get(&s).cloned().unwrap_or_default();
        for (_, members) in &mut e.groups {
            members.retain(|m| reported.contains_key(m));
        }
        e.assigns.retain(|a| reported.contains_key(&a.node));
        self.agree(s);
    }
}

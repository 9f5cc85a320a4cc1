//! A stop the user asked for (Ctrl-C, SIGTERM): the run ends early, at the first version no
//! node has started a step past, checkpointed there, so that `--resume` continues from it.

use super::{Coordinator, Envelope, Event, NodeId, SyncPolicy};
impl Coordinator {
    /// End the run early, cleanly. While an epoch runs, its steps in flight finish: the run's
    /// last version becomes the current grant's horizon (under local SGD, the first version
    /// from there whose schedule the nodes already following it keep, see [`stop_point`]); the
    /// workers are told ([`Envelope::StopAt`]) and checkpoint it as the run's last. With an
    /// epoch switch in flight, the choice waits for the old epoch to end (a window at most).
    /// With no epoch running (halted for a loss, waiting for nodes, restoring), the run ends
    /// now at the last agreed version; the latest checkpoint is what resumes.
    pub(super) fn stop_early(&mut self) {
        if self.finished || matches!(self.stop, Some(Some(_))) {
            return;
        }
        let running = self.halting.is_none()
            && self.waiting.is_none()
            && self.restoring.is_none()
            && self.taking_over.is_none();
        let Some(cur) = self.eras.last().cloned().filter(|_| running) else {
            self.stop = Some(Some(self.agreed));
            self.emit(Event::Stopping {
                at: self.agreed,
                checkpoint: false,
            });
            return self.finish(Event::Finished);
        };
        if self.eras.len() > 1 {
            self.stop = Some(None);
            return;
        }
        let at = stop_point(
            &cur.policy,
            cur.from,
            self.cfg.steps,
            self.until.max(self.agreed + 1),
        );
        self.stop = Some(Some(at));
        let checkpoint = self.cfg.checkpoint_at_end;
        self.emit(Event::Stopping { at, checkpoint });
        if at >= self.cfg.steps {
            return;
        }
        self.cfg.steps = at;
        let workers: Vec<NodeId> = cur.workers().collect();
        for &w in &workers {
            self.send(w, Envelope::StopAt { at, checkpoint });
        }
        if at > self.until {
            self.until = at;
            for w in workers {
                self.send(
                    w,
                    Envelope::Grant {
                        epoch: cur.epoch,
                        until: at,
                    },
                );
            }
        }
    }
}

/// The earliest version at or after `lo` (and at most `end`) at which an epoch of `policy`
/// that began at `from` can end instead of at `end`: every step before `lo` (which nodes may
/// have started under the old end) is synchronized the same way under either end. Every-step
/// synchronization ends anywhere; under local SGD a round launched before `lo` must merge
/// first (a few steps at most). `end` when none is found within a round and its delay.
pub fn stop_point(policy: &SyncPolicy, from: u64, end: u64, lo: u64) -> u64 {
    let lo = lo.max(from + 1);
    if lo >= end {
        return end;
    }
    let span = match policy {
        SyncPolicy::EveryStep => 0,
        SyncPolicy::LocalSgd { local_steps, .. } => 2 * u64::from(*local_steps) + 2,
    };
    (lo..=(lo + span).min(end))
        .find(|&at| (from..lo).all(|s| policy.mode(from, end, s) == policy.mode(from, at, s)))
        .unwrap_or(end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use ravnest_core::planner::sync::Outer;

    /// A stop point keeps the mode of every step that may have started, and nothing earlier
    /// does: checked against every candidate, for every-step and local-SGD schedules with and
    /// without overlap.
    #[test]
    fn a_stop_point_keeps_every_started_step_and_is_the_earliest() {
        proptest!(ProptestConfig::with_cases(512), |(local in 1u32..9, delay in 0u32..4, from in 0u64..20, len in 1u64..60, past in 1u64..40, every in any::<bool>())| {
            let policy = if every {
                SyncPolicy::EveryStep
            } else {
                SyncPolicy::LocalSgd { local_steps: local, outer: Outer { overlap: delay > 0, delay, ..Outer::AVERAGE } }
            };
            let end = from + len;
            let lo = from + past.min(len);
            let at = stop_point(&policy, from, end, lo);
            prop_assert!(at >= lo.min(end) && at <= end, "{at} outside {lo}..={end}");
            let keeps = |at: u64| (from..lo.min(at)).all(|s| policy.mode(from, end, s) == policy.mode(from, at, s));
            prop_assert!(keeps(at), "{policy:?}: stop at {at} changes a started step (lo {lo}, end {end})");
            prop_assert!((lo.max(from + 1)..at).all(|a| !keeps(a)), "{policy:?}: an earlier stop than {at} keeps them (lo {lo})");
            if every {
                prop_assert_eq!(at, lo.max(from + 1).min(end));
            }
        });
    }
}

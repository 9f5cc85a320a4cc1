//! Local SGD's outer rounds, the parts every replica decides alike: the anchor a round starts
//! from, the outer momentum a round makes, whether the next round goes on from it, and the
//! outer step itself ([`ravnest_core::outer`] on the group's sum); and a replica's overlapped
//! rounds ([`Rounds`]): launched, their sums kept until the step that merges them, and the
//! values the replica goes on from after a merge. The runtime's node runs the rounds'
//! exchanges and moves values in and out of its model (`ravnest_runtime::node::rounds`).
//!
//! An overlapped round is launched ([`crate::msg::StepMode::Launch`]): its exchange starts,
//! and the replica goes on with its inner steps from its own values. `delay` steps later the
//! round is merged ([`crate::msg::StepMode::Merge`]): the version that step makes is the
//! round's outer step on its anchor, the same on every replica (checkpoints, restarts and the
//! next round's anchor take it), while the replica goes on from it with its inner progress
//! since the launch carried over ([`ravnest_core::outer::carry_onto`]).

use std::collections::BTreeMap;

use ravnest_core::LayerRange;

use crate::msg::{SyncPolicy, Work};

/// The anchor of an outer round: the version every replica agreed on at the round's start.
#[derive(Debug)]
pub struct Anchor {
    /// Its version.
    pub version: u64,
    /// Its exported values (parameters first).
    pub values: Vec<f32>,
    /// How many of them are parameters.
    pub params: usize,
}

/// The momentum an outer round made (the same on every replica of the group). It carries over
/// to the next round of the same epoch, and into the next epoch where the coordinator says
/// every replica holds it ([`Work::outer_from`]: a switch between epochs of the
/// same sync groups, at the round that made it). Otherwise an epoch starts it again at zero,
/// on every replica alike (a node that joins, or a restore, has none to bring).
#[derive(Debug)]
pub struct OuterMomentum {
    /// The epoch of the round that made it.
    pub epoch: u64,
    /// The version its round made.
    pub version: u64,
    /// The layers it is over (`None`: the whole model).
    pub layers: Option<LayerRange>,
    /// Its values.
    pub values: Vec<f32>,
}

impl OuterMomentum {
    /// Whether the next round of `w` over `layers` goes on from this momentum.
    pub fn goes_on(&self, w: &Work, layers: Option<LayerRange>) -> bool {
        self.layers == layers
            && (self.epoch == w.epoch
                || (w.outer_from == Some(self.epoch) && self.version == w.step))
    }
}

/// An outer round's step, in place in `sum` (the group's sum becomes the new values), from
/// the round's anchor, with the momentum of the epoch's round before (see
/// [`ravnest_core::outer`]), which it replaces.
pub fn outer_step(
    momentum: &mut Option<OuterMomentum>,
    w: &Work,
    (layers, made): (Option<LayerRange>, u64),
    anchor: &Anchor,
    sum: &mut [f32],
) -> Result<(), String> {
    let SyncPolicy::LocalSgd { outer, .. } = w.sync else {
        return Err("an outer round outside local SGD".into());
    };
    let before = momentum.take().filter(|m| m.goes_on(w, layers));
    let m = ravnest_core::outer::step(
        &outer,
        &anchor.values,
        sum,
        anchor.params,
        before.as_ref().map(|m| m.values.as_slice()),
    )
    .ok_or_else(|| {
        format!(
            "the outer round from version {} does not fit it",
            anchor.version
        )
    })?;
    *momentum = Some(OuterMomentum {
        epoch: w.epoch,
        version: made,
        layers,
        values: m,
    });
    Ok(())
}

/// An overlapped round: its exchange runs during the inner steps after it, until the step
/// that merges it.
#[derive(Debug)]
struct Launched {
    epoch: u64,
    layers: Option<LayerRange>,
    anchor: Anchor,
    /// This replica's values when it launched the round (its inner progress after them is
    /// carried over onto the merged values).
    at: Vec<f32>,
    /// The group's sum, once it came back.
    sum: Option<Vec<f32>>,
}

/// The values a replica goes on from at step `version` of `epoch` in place of that version
/// (the merged one, which every replica agrees on): its own progress since the round on top.
#[derive(Debug)]
struct Carry {
    epoch: u64,
    version: u64,
    layers: Option<LayerRange>,
    values: Vec<f32>,
}

/// A replica's local-SGD rounds: the overlapped ones launched and not merged yet (by the step
/// that launched them), the values it goes on from after a merge, and the outer momentum.
#[derive(Debug, Default)]
pub struct Rounds {
    launched: BTreeMap<u64, Launched>,
    carry: Option<Carry>,
    /// The outer momentum of the last round ([`outer_step`]).
    pub momentum: Option<OuterMomentum>,
}

impl Rounds {
    /// Step `step` of `epoch` launched a round over `layers` from `anchor`, this replica's
    /// values being `at`. Rounds of other epochs are void.
    pub fn launch(
        &mut self,
        epoch: u64,
        step: u64,
        layers: Option<LayerRange>,
        anchor: Anchor,
        at: Vec<f32>,
    ) {
        self.launched.retain(|_, r| r.epoch == epoch);
        let round = Launched {
            epoch,
            layers,
            anchor,
            at,
            sum: None,
        };
        self.launched.insert(step, round);
    }

    /// The round step `step` of `epoch` merges: the step that launched it (the newest before),
    /// and whether its sum came. `Err` when this replica launched none.
    pub fn to_merge(&mut self, epoch: u64, step: u64) -> Result<(u64, bool), String> {
        self.launched.retain(|_, r| r.epoch == epoch);
        let (&k, round) = self.launched.range(..step).next_back().ok_or_else(|| {
            format!("step {step} merges an outer round that this node never launched")
        })?;
        Ok((k, round.sum.is_some()))
    }

    /// Whether a collective of step `step` of `epoch` is a launched round's exchange, its sum
    /// still to come.
    pub fn awaits(&self, epoch: u64, step: u64) -> bool {
        self.launched
            .get(&step)
            .is_some_and(|r| r.epoch == epoch && r.sum.is_none())
    }

    /// The sum of the round launched at `step` came.
    pub fn sum_came(&mut self, step: u64, sum: Vec<f32>) {
        if let Some(r) = self.launched.get_mut(&step) {
            r.sum = Some(sum);
        }
    }

    /// A round of `epoch` could not run: that epoch's rounds are void (their outer steps are
    /// lost with it).
    pub fn abort(&mut self, epoch: u64) {
        self.launched.retain(|_, r| r.epoch != epoch);
    }

    /// Merge the round launched at step `k` for version `made` of `w`'s epoch over `layers`:
    /// the merged values (the outer step on the group's sum, from the round's anchor); `own`,
    /// this replica's values now, becomes what it goes on from at `made` (its progress since
    /// the launch on top of the merged values; [`Rounds::carry_for`]).
    pub fn merge(
        &mut self,
        k: u64,
        w: &Work,
        made: u64,
        layers: Option<LayerRange>,
        mut own: Vec<f32>,
    ) -> Result<Vec<f32>, String> {
        let round = self
            .launched
            .remove(&k)
            .ok_or_else(|| format!("the outer round of step {k} is gone"))?;
        let mut sum = round
            .sum
            .ok_or("an outer round merged before its sum came")?;
        outer_step(
            &mut self.momentum,
            w,
            (round.layers, made),
            &round.anchor,
            &mut sum,
        )?;
        if !ravnest_core::outer::carry_onto(&sum, &round.at, &mut own, round.anchor.params) {
            return Err(format!(
                "the outer round from version {} does not fit this node's values",
                round.anchor.version
            ));
        }
        self.carry = Some(Carry {
            epoch: w.epoch,
            version: made,
            layers,
            values: own,
        });
        Ok(sum)
    }

    /// What step `step` of `epoch` goes on from in place of its version, right after a merge:
    /// this replica's own values (of `layers`). Taken: a later step goes on from its version.
    pub fn carry_for(&mut self, epoch: u64, step: u64) -> Option<(Option<LayerRange>, Vec<f32>)> {
        match self.carry.take() {
            Some(c) if c.epoch == epoch && c.version == step => Some((c.layers, c.values)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node's work of `epoch` from `step`, its outer momentum from `outer_from`.
    fn work(epoch: u64, step: u64, outer_from: Option<u64>) -> Work {
        Work {
            outer_from,
            ..Work::for_test(epoch, step, step + 4, Vec::new())
        }
    }

    #[test]
    fn the_outer_momentum_goes_on_only_where_every_replica_holds_it() {
        let m = OuterMomentum {
            epoch: 3,
            version: 40,
            layers: None,
            values: vec![0.5],
        };
        // Its own epoch's next round.
        assert!(m.goes_on(&work(3, 20, None), None));
        // A switch at the round that made it, between epochs of the same groups.
        assert!(m.goes_on(&work(4, 40, Some(3)), None));
        // A restore to another version, a switch from another epoch, a plain new epoch, or
        // other layers: it starts again at zero.
        assert!(!m.goes_on(&work(4, 30, Some(3)), None));
        assert!(!m.goes_on(&work(5, 40, Some(4)), None));
        assert!(!m.goes_on(&work(4, 40, None), None));
        let layers = Some(LayerRange::new(0, 2));
        assert!(!m.goes_on(&work(3, 20, None), layers));
    }

    /// Local SGD with an overlapped round every 4 steps, lr 1 and no momentum (a plain
    /// average of the replicas' values).
    fn overlapped(epoch: u64) -> Work {
        let outer = ravnest_core::planner::sync::Outer {
            lr: 1.0,
            momentum: 0.0,
            packing: ravnest_core::pack::Packing::Fp32,
            overlap: true,
            delay: 1,
        };
        Work {
            sync: SyncPolicy::LocalSgd {
                local_steps: 4,
                outer,
            },
            ..Work::for_test(epoch, 0, 100, Vec::new())
        }
    }

    #[test]
    fn an_overlapped_round_merges_its_sum_and_carries_the_replicas_progress() {
        let mut r = Rounds::default();
        let anchor = Anchor {
            version: 4,
            values: vec![1.0, 1.0, 9.0],
            params: 2,
        };
        // Launched at step 7 from values [2, 2, 9]; its sum is on its way.
        r.launch(3, 7, None, anchor, vec![2.0, 2.0, 9.0]);
        assert_eq!(r.to_merge(3, 9), Ok((7, false)));
        assert!(r.awaits(3, 7));
        assert!(!r.awaits(2, 7) && !r.awaits(3, 8));
        // The group's sum of share x (anchor - values): the replicas' mean is 1.5.
        r.sum_came(7, vec![-0.5, -0.5, 0.0]);
        assert!(!r.awaits(3, 7));
        assert_eq!(r.to_merge(3, 9), Ok((7, true)));
        // Merged at step 9 (version 10), the replica having gone on to [2.5, 3, 8].
        let merged = r.merge(7, &overlapped(3), 10, None, vec![2.5, 3.0, 8.0]);
        assert_eq!(merged, Ok(vec![1.5, 1.5, 9.0]));
        assert_eq!(r.momentum.as_ref().map(|m| m.version), Some(10));
        // It goes on from the merged parameters with its progress since the launch on top
        // (its optimizer state its own), at step 10 only.
        assert_eq!(r.carry_for(3, 10), Some((None, vec![2.0, 2.5, 8.0])));
        assert_eq!(r.carry_for(3, 10), None, "taken");
        assert!(r.to_merge(3, 13).is_err(), "merged once");
    }

    #[test]
    fn rounds_of_another_epoch_or_an_aborted_one_are_void() {
        let mut r = Rounds::default();
        let anchor = || Anchor {
            version: 0,
            values: vec![0.0],
            params: 1,
        };
        let e = r.to_merge(3, 9).unwrap_err();
        assert!(e.contains("never launched"), "{e}");
        r.launch(3, 7, None, anchor(), vec![0.0]);
        r.launch(4, 8, None, anchor(), vec![0.0]);
        assert!(
            !r.awaits(3, 7),
            "the next epoch's launch voids the last one's rounds"
        );
        assert!(
            r.merge(8, &overlapped(4), 10, None, vec![0.0]).is_err(),
            "no sum yet"
        );
        r.launch(4, 12, None, anchor(), vec![0.0]);
        r.abort(4);
        assert!(!r.awaits(4, 12));
        assert!(r.to_merge(4, 13).is_err());
        // A carry of another epoch or step is not taken up (and is gone).
        r.launch(5, 1, None, anchor(), vec![0.0]);
        r.sum_came(1, vec![0.0]);
        assert!(r.merge(1, &overlapped(5), 3, None, vec![0.0]).is_ok());
        assert_eq!(r.carry_for(5, 4), None);
        assert_eq!(r.carry_for(5, 3), None);
    }
}

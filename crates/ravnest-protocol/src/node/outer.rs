//! Local SGD's outer rounds, the parts every replica decides alike: the anchor a round starts
//! from, the outer momentum a round makes, whether the next round goes on from it, and the
//! outer step itself ([`ravnest_core::outer`] on the group's sum). The runtime's node runs
//! the rounds' exchanges (`ravnest_runtime::node::rounds`).

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
}

//! The model versions a node keeps: the last two it made, and the last two every replica
//! agreed on. Two of each are enough: when a node is lost mid-step, the survivors are at most
//! one step (or one averaging period) apart, so the newest synchronized version that every one
//! of them holds is among each one's last two.
//!
//! A node that is the only holder of its layers (a stage of a single pipeline) keeps one: no
//! peer can be a step behind it on those layers, and a loss of any stage restores the latest
//! checkpoint anyway. A version is the backend's handle (the runtime's `Compute::Model`):
//! keeping one shares its values, it never copies them.

use std::collections::BTreeMap;

use ravnest_core::LayerRange;

use crate::msg::HeldVersion;

/// One version of the model.
#[derive(Debug, Clone)]
pub struct Version<M> {
    /// The values (the backend's handle).
    pub model: M,
    /// Whether every replica agreed on it.
    pub synced: bool,
    /// The layers it is current for (`None`: the whole model).
    pub layers: Option<LayerRange>,
}

/// How many versions a node keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Keep {
    /// The two newest and the two newest synchronized ones (replicas may be a step apart).
    #[default]
    Two,
    /// The newest only (the node is the only holder of what it runs).
    One,
}

/// Versions kept, by number (version k: the model after k steps).
#[derive(Debug, Clone)]
pub struct Versions<M>(BTreeMap<u64, Version<M>>, Keep);

impl<M> Default for Versions<M> {
    fn default() -> Self {
        Versions(BTreeMap::new(), Keep::default())
    }
}

impl<M> Versions<M> {
    /// The newest version.
    pub fn latest(&self) -> Option<u64> {
        self.0.keys().next_back().copied()
    }

    /// Version `v`, if kept.
    pub fn get(&self, v: u64) -> Option<&Version<M>> {
        self.0.get(&v)
    }

    /// How many to keep from now on (older ones go at the next insertion).
    pub fn keep(&mut self, keep: Keep) {
        self.1 = keep;
    }

    /// Whether only the newest version is kept.
    pub fn keeps_one(&self) -> bool {
        self.1 == Keep::One
    }

    /// Take version `v` out (to make the next one from it in place, where only one is kept).
    pub fn take(&mut self, v: u64) -> Option<Version<M>> {
        self.0.remove(&v)
    }

    /// Keep version `v` (replacing one of the same number); forget all but the two newest and
    /// the two newest synchronized ones (or all but the newest, under [`Keep::One`]).
    pub fn insert(&mut self, v: u64, version: Version<M>) {
        self.0.insert(v, version);
        let kept = kept(self.0.iter().map(|(k, x)| (*k, x.synced)), self.1);
        self.0.retain(|k, _| kept.contains(k));
    }

    /// Take out now the versions that keeping version `v` (`synced` or not) will forget, so
    /// that the step making `v` can reuse their memory.
    pub fn doomed_by(&mut self, v: u64, synced: bool) -> Vec<M> {
        let all = self
            .0
            .iter()
            .filter(|(k, _)| **k != v)
            .map(|(k, x)| (*k, x.synced));
        let kept = kept(all.chain([(v, synced)]), self.1);
        let gone: Vec<u64> = self
            .0
            .keys()
            .filter(|k| !kept.contains(k))
            .copied()
            .collect();
        gone.iter()
            .filter_map(|k| self.0.remove(k))
            .map(|x| x.model)
            .collect()
    }

    /// Forget every version newer than `v` (steps that will be redone).
    pub fn truncate_after(&mut self, v: u64) {
        self.0.retain(|k, _| *k <= v);
    }

    /// What a halted node reports.
    pub fn held(&self) -> Vec<HeldVersion> {
        self.0
            .iter()
            .map(|(k, x)| HeldVersion {
                version: *k,
                synced: x.synced,
                layers: x.layers,
            })
            .collect()
    }
}

/// Of versions `(number, synced)`, the numbers kept under `keep`: the newest and the newest
/// synchronized ones.
fn kept(versions: impl Iterator<Item = (u64, bool)>, keep: Keep) -> Vec<u64> {
    let (newest_n, synced_n) = match keep {
        Keep::Two => (2, 2),
        Keep::One => (1, 0),
    };
    let mut all: Vec<(u64, bool)> = versions.collect();
    all.sort_unstable();
    all.dedup_by_key(|x| x.0);
    let mut out: Vec<u64> = all.iter().rev().take(newest_n).map(|x| x.0).collect();
    out.extend(all.iter().rev().filter(|x| x.1).take(synced_n).map(|x| x.0));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn v(synced: bool) -> Version<()> {
        Version {
            model: (),
            synced,
            layers: None,
        }
    }

    proptest! {
        /// After any sequence of new versions, the two newest and the two newest synchronized
        /// ones are kept, and nothing else.
        #[test]
        fn keeps_the_two_newest_of_each_kind(synced in prop::collection::vec(any::<bool>(), 1..30)) {
            let mut vs = Versions::default();
            for (k, s) in synced.iter().enumerate() {
                vs.insert(k as u64, v(*s));
            }
            let n = synced.len() as u64;
            let mut want: Vec<u64> = (n.saturating_sub(2)..n).collect();
            want.extend(synced.iter().enumerate().rev().filter(|(_, s)| **s).take(2).map(|(k, _)| k as u64));
            want.sort_unstable();
            want.dedup();
            let held: Vec<u64> = vs.held().iter().map(|h| h.version).collect();
            prop_assert_eq!(held, want);
        }
    }

    proptest! {
        /// Taking out first what a new version will forget, then keeping it, leaves what
        /// keeping it alone leaves; what was taken out is exactly what that forgets.
        #[test]
        fn doomed_versions_are_the_ones_an_insert_forgets(
            synced in prop::collection::vec(any::<bool>(), 1..30),
            one in any::<bool>(),
        ) {
            let (mut plain, mut early) = (Versions::default(), Versions::default());
            let keep = if one { Keep::One } else { Keep::Two };
            plain.keep(keep);
            early.keep(keep);
            for (k, s) in synced.iter().enumerate() {
                let k = k as u64;
                let before: Vec<u64> = plain.held().iter().map(|h| h.version).collect();
                plain.insert(k, Version { model: k, synced: *s, layers: None });
                let mut gone = early.doomed_by(k, *s);
                early.insert(k, Version { model: k, synced: *s, layers: None });
                let after: Vec<u64> = plain.held().iter().map(|h| h.version).collect();
                prop_assert_eq!(&after, &early.held().iter().map(|h| h.version).collect::<Vec<_>>());
                let mut want: Vec<u64> = before.into_iter().filter(|b| !after.contains(b)).collect();
                gone.sort_unstable();
                want.sort_unstable();
                prop_assert_eq!(gone, want);
            }
        }
    }

    #[test]
    fn truncation_forgets_newer_versions() {
        let mut vs = Versions::default();
        for k in 0..4 {
            vs.insert(k, v(true));
        }
        vs.truncate_after(2);
        assert_eq!(vs.latest(), Some(2));
        assert!(vs.get(3).is_none());
    }
}

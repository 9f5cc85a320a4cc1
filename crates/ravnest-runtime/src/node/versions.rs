//! The model versions a node keeps: the last two it made, and the last two every replica
//! agreed on. Two of each are enough: when a node is lost mid-step, the survivors are at most
//! one step (or one averaging period) apart, so the newest synchronized version that every one
//! of them holds is among each one's last two.

use std::collections::BTreeMap;
use std::sync::Arc;

use ravnest_core::LayerRange;

use crate::msg::HeldVersion;

/// One version of the model.
#[derive(Debug, Clone)]
pub struct Version {
    /// The values (parameters, then optimizer state).
    pub model: Arc<Vec<f32>>,
    /// Whether every replica agreed on it.
    pub synced: bool,
    /// The layers it is current for (`None`: the whole model).
    pub layers: Option<LayerRange>,
}

/// Versions kept, by number (version k: the model after k steps), and the buffers of retired
/// ones for the next version to be written into: a step then reuses memory that is already
/// mapped instead of faulting in a fresh model's worth of pages (a few percent of a small
/// model's step).
#[derive(Debug, Clone, Default)]
pub struct Versions(BTreeMap<u64, Version>, Vec<Vec<f32>>);

/// Retired buffers kept for reuse.
const SPARE: usize = 2;

impl Versions {
    /// The newest version.
    pub fn latest(&self) -> Option<u64> {
        self.0.keys().next_back().copied()
    }

    /// Version `v`, if kept.
    pub fn get(&self, v: u64) -> Option<&Version> {
        self.0.get(&v)
    }

    /// Keep version `v` (replacing one of the same number); forget all but the two newest and
    /// the two newest synchronized ones.
    pub fn insert(&mut self, v: u64, version: Version) {
        self.0.insert(v, version);
        let newest: Vec<u64> = self.0.keys().rev().take(2).copied().collect();
        let synced: Vec<u64> = self
            .0
            .iter()
            .rev()
            .filter(|(_, x)| x.synced)
            .take(2)
            .map(|(k, _)| *k)
            .collect();
        let retired: Vec<u64> = self
            .0
            .keys()
            .filter(|k| !newest.contains(k) && !synced.contains(k))
            .copied()
            .collect();
        for k in retired {
            if let Some(old) = self.0.remove(&k) {
                self.recycle(old.model);
            }
        }
    }

    /// Keep a model buffer for reuse if nothing else holds it.
    fn recycle(&mut self, model: Arc<Vec<f32>>) {
        if self.1.len() < SPARE
            && let Ok(buf) = Arc::try_unwrap(model)
        {
            self.1.push(buf);
        }
    }

    /// A retired buffer (or an empty one) to write a new version into.
    pub fn spare(&mut self) -> Vec<f32> {
        self.1.pop().unwrap_or_default()
    }

    /// A copy of `model`, written into a retired buffer when there is one.
    pub fn copy_of(&mut self, model: &[f32]) -> Vec<f32> {
        match self.1.pop() {
            Some(mut buf) => {
                buf.clear();
                buf.extend_from_slice(model);
                buf
            }
            None => model.to_vec(),
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn v(synced: bool) -> Version {
        Version {
            model: Arc::new(vec![]),
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

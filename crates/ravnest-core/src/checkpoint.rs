//! Checkpoint aggregation as a pure state machine: which shards a checkpoint needs, which have
//! arrived, and when it is complete. A checkpoint completes only with every shard it was begun
//! with; a round whose shard holder is lost is abandoned, never completed partially.
//!
//! A shard covers a contiguous layer range (data parallel: one shard with every layer, written
//! by one replica; pipeline: one per stage). The actor that drives this writes the shards it is
//! given (files in `run`, memory in `sim`) and commits the manifest only on completion.

use std::collections::BTreeMap;

use crate::cluster::NodeId;
use crate::layers::LayerRange;

/// What one shard is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardMeta {
    /// Who wrote it.
    pub node: NodeId,
    /// Layers it covers.
    pub layers: LayerRange,
    /// Digest of its contents.
    pub digest: u64,
    /// Size in bytes.
    pub bytes: u64,
}

/// A complete checkpoint: the model after `step` steps, one entry per shard in layer order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Manifest {
    /// Model version.
    pub step: u64,
    /// Shards in layer order.
    pub shards: Vec<ShardMeta>,
}

/// Why a shard was refused (the state is unchanged).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CheckpointError {
    /// No round open for that step.
    #[error("no checkpoint in progress for step {0}")]
    UnknownStep(u64),
    /// The shard's layers are not one the round expects.
    #[error("checkpoint {step}: unexpected shard for layers {layers}")]
    UnexpectedShard {
        /// Step.
        step: u64,
        /// Layers offered.
        layers: LayerRange,
    },
    /// The shard's digest is not the one every replica agreed on (corrupted, or of another
    /// model): refused, the round stays open and the previous checkpoint stays the latest.
    #[error(
        "checkpoint {step}: the shard for layers {layers} has digest {got:016x}, the replicas agreed on {want:016x}"
    )]
    DigestMismatch {
        /// Step.
        step: u64,
        /// Layers.
        layers: LayerRange,
        /// The shard's digest.
        got: u64,
        /// The agreed digest.
        want: u64,
    },
}

#[derive(Debug, Clone)]
struct Round {
    /// Layer range → the digest its shard must have.
    expected: BTreeMap<LayerRange, u64>,
    got: BTreeMap<LayerRange, ShardMeta>,
}

/// Open checkpoint rounds.
#[derive(Debug, Clone, Default)]
pub struct Aggregator {
    rounds: BTreeMap<u64, Round>,
    last_complete: Option<u64>,
}

impl Aggregator {
    /// An aggregator with nothing open.
    pub fn new() -> Self {
        Aggregator::default()
    }

    /// Open a round for `step` expecting one shard per layer range, each with the digest the
    /// replicas agreed on.
    pub fn begin(&mut self, step: u64, shards: &[(LayerRange, u64)]) {
        self.rounds.insert(
            step,
            Round {
                expected: shards.iter().copied().collect(),
                got: BTreeMap::new(),
            },
        );
    }

    /// Drop the round for `step` (a shard holder was lost before writing).
    pub fn abandon(&mut self, step: u64) {
        self.rounds.remove(&step);
    }

    /// A shard of `step` was written. Returns the manifest when this completes the round.
    pub fn shard(
        &mut self,
        step: u64,
        meta: ShardMeta,
    ) -> Result<Option<Manifest>, CheckpointError> {
        let round = self
            .rounds
            .get_mut(&step)
            .ok_or(CheckpointError::UnknownStep(step))?;
        let key = meta.layers;
        let Some(&want) = round.expected.get(&key) else {
            return Err(CheckpointError::UnexpectedShard {
                step,
                layers: meta.layers,
            });
        };
        if meta.digest != want {
            return Err(CheckpointError::DigestMismatch {
                step,
                layers: meta.layers,
                got: meta.digest,
                want,
            });
        }
        if round.got.contains_key(&key) {
            return Ok(None);
        }
        round.got.insert(key, meta);
        if round.got.len() < round.expected.len() {
            return Ok(None);
        }
        let round = self.rounds.remove(&step).expect("present");
        // Older open rounds can never be the latest any more.
        self.rounds.retain(|&s, _| s > step);
        self.last_complete = Some(step);
        Ok(Some(Manifest {
            step,
            shards: round.got.into_values().collect(),
        }))
    }

    /// The step of the latest complete checkpoint.
    pub fn last_complete(&self) -> Option<u64> {
        self.last_complete
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Begin(u64, usize, u64),
        Shard(u64, usize, u64),
        Abandon(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..4, 1usize..4, 0u64..2).prop_map(|(s, n, d)| Op::Begin(s, n, d)),
            (0u64..4, 0usize..4, 0u64..2).prop_map(|(s, k, d)| Op::Shard(s, k, d)),
            (0u64..4).prop_map(Op::Abandon),
        ]
    }

    proptest! {
        /// Against an oracle of (expected, received) sets: a manifest appears exactly when the
        /// last missing shard of an open round arrives, holds every shard once, and never
        /// appears for an abandoned round; a shard whose digest is not the agreed one is
        /// refused and changes nothing.
        #[test]
        fn completes_only_with_every_shard(ops in prop::collection::vec(op(), 0..60)) {
            let mut a = Aggregator::new();
            let mut oracle: BTreeMap<u64, (usize, u64, BTreeMap<usize, u64>)> = BTreeMap::new();
            for o in ops {
                match o {
                    Op::Begin(s, n, want) => {
                        let shards: Vec<(LayerRange, u64)> = (0..n).map(|k| (LayerRange::from(k * 10..k * 10 + 10), want)).collect();
                        a.begin(s, &shards);
                        oracle.insert(s, (n, want, BTreeMap::new()));
                    }
                    Op::Abandon(s) => { a.abandon(s); oracle.remove(&s); }
                    Op::Shard(s, k, d) => {
                        let meta = ShardMeta { node: NodeId(k as u32), layers: LayerRange::from(k * 10..k * 10 + 10), digest: d, bytes: 1 };
                        let got = a.shard(s, meta);
                        match oracle.get_mut(&s) {
                            None => prop_assert_eq!(got, Err(CheckpointError::UnknownStep(s))),
                            Some((n, _, _)) if k >= *n => prop_assert!(matches!(got, Err(CheckpointError::UnexpectedShard { .. })), "expected UnexpectedShard"),
                            Some((_, want, _)) if d != *want => prop_assert!(matches!(got, Err(CheckpointError::DigestMismatch { .. })), "expected DigestMismatch"),
                            Some((n, _, rec)) => {
                                let n = *n;
                                match rec.get(&k) {
                                    Some(_) => prop_assert_eq!(got, Ok(None)),
                                    None => {
                                        rec.insert(k, d);
                                        if rec.len() == n {
                                            let m = got.unwrap().expect("complete");
                                            prop_assert_eq!(m.step, s);
                                            prop_assert_eq!(m.shards.len(), n);
                                            oracle.retain(|&x, _| x > s);
                                        } else {
                                            prop_assert_eq!(got, Ok(None));
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

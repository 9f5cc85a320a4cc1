//! In-memory checkpoint stores for simulated runs: every checkpoint kept, and the folder's
//! term (a write from an older term refused, as on disk).

use super::{Arc, Mutex, Store, StoreError};
/// The simulator's checkpoint store: the latest complete checkpoint, in memory, read back when
/// the only copy of some layers is lost (a lone pipeline's stage): the restore the planner's
/// recovery term prices.
#[derive(Debug, Default)]
pub struct MemStore(
    Mutex<Option<(ravnest_core::checkpoint::Manifest, Vec<f32>)>>,
    ravnest_runtime::checkpoint::ShardParts,
    /// The newest coordinator term that wrote here, and every commit: (version, term).
    Mutex<(u32, Vec<(u64, u32)>)>,
);

impl MemStore {
    /// Every commit in order: (model version, the writer's coordinator term).
    pub fn commits(&self) -> Vec<(u64, u32)> {
        self.2.lock().unwrap().1.clone()
    }
}

/// The store as the checkpoint actor of coordinator term `term` sees it: as a checkpoint
/// folder does, it refuses a write, or a restore, of an older term than the newest that wrote
/// to it.
#[derive(Debug)]
pub struct TermStore {
    /// The shared store.
    pub store: Arc<MemStore>,
    /// This writer's term.
    pub term: u32,
}

impl Store for TermStore {
    fn put(
        &self,
        step: u64,
        layers: ravnest_core::LayerRange,
        offset: u64,
        values: &[f32],
    ) -> Result<(), StoreError> {
        self.store.put(step, layers, offset, values)
    }

    fn forget(&self, step: u64, layers: Option<ravnest_core::LayerRange>) {
        self.store.forget(step, layers);
    }

    fn commit(&self, manifest: &ravnest_core::checkpoint::Manifest) -> Result<(), StoreError> {
        {
            let mut t = self.store.2.lock().unwrap();
            if t.0 > self.term {
                return Err(StoreError::Superseded {
                    folder: t.0,
                    ours: self.term,
                });
            }
            t.0 = self.term;
            t.1.push((manifest.step, self.term));
        }
        self.store.commit(manifest)
    }

    fn latest(&self) -> Option<(u64, Vec<f32>)> {
        self.store.latest()
    }

    fn superseded(&self) -> Option<u32> {
        Some(self.store.2.lock().unwrap().0).filter(|f| *f > self.term)
    }
}

impl Store for MemStore {
    fn put(
        &self,
        step: u64,
        layers: ravnest_core::LayerRange,
        offset: u64,
        values: &[f32],
    ) -> Result<(), StoreError> {
        self.1.put(step, layers, offset, values);
        Ok(())
    }

    fn forget(&self, step: u64, layers: Option<ravnest_core::LayerRange>) {
        self.1.forget(step, layers);
    }

    /// Merge shards in layer order into one model (data parallel: one shard). The checkpoint
    /// actor has checked each shard's digest already.
    fn commit(&self, manifest: &ravnest_core::checkpoint::Manifest) -> Result<(), StoreError> {
        let merged: Vec<f32> = self.1.take(manifest).concat();
        *self.0.lock().unwrap() = Some((manifest.clone(), merged));
        Ok(())
    }

    /// The latest complete checkpoint: what a lost only copy of some layers is restored from.
    fn latest(&self) -> Option<(u64, Vec<f32>)> {
        let held = self.0.lock().unwrap();
        held.as_ref().map(|(m, values)| (m.step, values.clone()))
    }
}

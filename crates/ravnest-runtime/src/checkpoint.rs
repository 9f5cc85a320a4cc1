//! The checkpoint actor: a thin shell over [`ravnest_core::checkpoint::Aggregator`]. Writers
//! send their shard when they reach a checkpoint version; the coordinator opens the round once
//! every replica reported that version, with the digest they agreed on. Shards that arrive
//! first wait here for their round. A shard is checked twice: its values must have the digest it
//! claims (recomputed here: a shard corrupted on the way, or by its writer, is refused), and
//! that digest must be the one the replicas agreed on. A refused shard changes nothing (the
//! previous checkpoint stays the latest); on completion the merged model goes to a [`Store`]
//! (files in `ravnest run`, memory in the simulator) and the completion is logged.
//!
//! A shard arrives in parts ([`ravnest_protocol::msg::SHARD_PART`] values each, in order); each part goes
//! to the store as it comes ([`Store::put`]: a file on disk in `ravnest run`), its digest is
//! folded in as it passes, and the store merges the parts into the checkpoint's files when the
//! round completes. So the process hosting the checkpoint actor never holds the model whole.

use std::collections::BTreeMap;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use ravnest_core::LayerRange;
use ravnest_core::checkpoint::{Aggregator, Manifest, ShardMeta};
use tokio::time::Instant;

use crate::coordinator::SharedLog;
use crate::seams::Transport;
use crate::trace::Trace;
use ravnest_protocol::coordinator::Event;
use ravnest_protocol::msg::{Addr, Envelope};

/// Why a complete checkpoint could not be stored.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The shards do not add up to the model the store expects.
    #[error("the shards hold {got} values; the model and optimizer state have {want}")]
    Size {
        /// Values in the shards.
        got: usize,
        /// Values expected.
        want: usize,
    },
    /// A coordinator of a newer term wrote to this checkpoint folder: this writer's term is
    /// stale (its coordinator was cut off or frozen while another node took over).
    #[error(
        "refused: a coordinator of term {folder} writes to this checkpoint folder, and this one's term ({ours}) is older"
    )]
    Superseded {
        /// The newest term that wrote to the folder.
        folder: u32,
        /// This writer's term.
        ours: u32,
    },
    /// Writing failed.
    #[error("{}: {source}", path.display())]
    Write {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Where complete checkpoints go.
pub trait Store: Send + Sync + 'static {
    /// Keep `values`, which start at `offset` of the shard of `layers` for checkpoint `step`
    /// (parts come in order; offset 0 starts the shard afresh).
    fn put(
        &self,
        step: u64,
        layers: LayerRange,
        offset: u64,
        values: &[f32],
    ) -> Result<(), StoreError>;

    /// Forget the shards put for `step` (`layers`: that one only): a refused shard, an
    /// abandoned round, or rounds older than a completed one.
    fn forget(&self, step: u64, layers: Option<LayerRange>);

    /// Commit a complete checkpoint from the shards put for it, one per `manifest.shards`.
    fn commit(&self, manifest: &Manifest) -> Result<(), StoreError>;

    /// The latest complete checkpoint, read back: (version, the whole model). What layers held
    /// only by lost nodes are restored from.
    fn latest(&self) -> Option<(u64, Vec<f32>)> {
        None
    }

    /// The newer coordinator term that wrote to this store, if one did (this writer's
    /// coordinator is then stale: it must neither write nor restore from here).
    fn superseded(&self) -> Option<u32> {
        None
    }
}

/// The checkpoint actor's configuration.
pub struct CheckpointActor<T> {
    /// The network.
    pub transport: T,
    /// Where checkpoints go.
    pub store: Arc<dyn Store>,
    /// Log for completions and failures.
    pub log: SharedLog,
    /// Trace.
    pub trace: Trace,
    /// Start of time.
    pub t0: Instant,
    /// Bytes per model element (for the manifest's sizes).
    pub bytes_per_elem: u64,
    /// The term of the coordinator it serves: stale once a newer one starts on the journal
    /// (it then records nothing there).
    pub term: u32,
}

impl<T> std::fmt::Debug for CheckpointActor<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CheckpointActor")
    }
}

/// Messages: envelopes from the network.
#[derive(Debug)]
pub enum CkMsg {
    /// An envelope.
    Net(Addr, Envelope),
}

/// Checkpoint versions whose shards are kept before their round opens, at most.
pub const EARLY_VERSIONS: usize = 8;

/// A shard whose parts are coming in: values received, the digest so far, the whole's length.
#[derive(Debug)]
struct Incoming {
    received: u64,
    digest: ravnest_protocol::digest::Digest,
    total: u64,
}

/// Open rounds, shards whose parts are coming in, and shards that came before their round.
#[derive(Debug, Default)]
pub struct CkState {
    agg: Aggregator,
    incoming: BTreeMap<(u64, LayerRange), Incoming>,
    early: BTreeMap<u64, Vec<ShardMeta>>,
    open: std::collections::BTreeSet<u64>,
}

/// The shards of the steps put to it, kept in memory (a simulated or test [`Store`]'s).
#[derive(Debug, Default)]
pub struct ShardParts(std::sync::Mutex<BTreeMap<(u64, LayerRange), Vec<f32>>>);

impl ShardParts {
    /// [`Store::put`].
    pub fn put(&self, step: u64, layers: LayerRange, offset: u64, values: &[f32]) {
        let mut m = self.0.lock().unwrap();
        let v = m.entry((step, layers)).or_default();
        if offset == 0 {
            v.clear();
        }
        v.extend_from_slice(values);
    }

    /// [`Store::forget`].
    pub fn forget(&self, step: u64, layers: Option<LayerRange>) {
        self.0
            .lock()
            .unwrap()
            .retain(|k, _| k.0 != step || layers.is_some_and(|l| l != k.1));
    }

    /// The shards of `manifest`, in its order, taken out (and every older step's forgotten).
    pub fn take(&self, manifest: &Manifest) -> Vec<Vec<f32>> {
        let mut m = self.0.lock().unwrap();
        let out = manifest
            .shards
            .iter()
            .map(|s| m.remove(&(manifest.step, s.layers)).unwrap_or_default())
            .collect();
        m.retain(|k, _| k.0 > manifest.step);
        out
    }
}

impl<T: Transport> CheckpointActor<T> {
    fn record(&self, now: u64, what: &str, from: Option<Addr>, step: u64, event: Option<Event>) {
        self.trace
            .record(now, what, from, Some(Addr::Checkpoint), step);
        if let Some(e) = event
            && !self.log.fenced(self.term)
        {
            self.log.event(now, e);
        }
    }

    /// A whole shard (its parts in the store) for an open round: refused, kept, or the last
    /// one (then commit).
    fn offer(&self, st: &mut CkState, now: u64, step: u64, meta: ShardMeta) {
        let from = Some(Addr::Node(meta.node));
        let layers = meta.layers;
        match st.agg.shard(step, meta) {
            Ok(None) => {}
            Ok(Some(manifest)) => {
                st.early.retain(|s, _| *s > step);
                st.open.retain(|s| *s > step);
                st.incoming.retain(|k, _| k.0 > step);
                let event = match self.store.commit(&manifest) {
                    Ok(()) => Event::CheckpointComplete {
                        step,
                        digest: manifest.shards.first().map_or(0, |m| m.digest),
                    },
                    Err(StoreError::Superseded { folder, .. }) => Event::Superseded {
                        step,
                        newer: folder,
                    },
                    Err(e) => Event::CheckpointFailed {
                        step,
                        why: e.to_string(),
                    },
                };
                self.record(now, "checkpoint-complete", None, step, Some(event));
            }
            // A stale, unexpected or corrupted shard: refused and traced; nothing changes.
            Err(e) => {
                self.store.forget(step, Some(layers));
                self.record(
                    now,
                    "shard-refused",
                    from,
                    step,
                    Some(Event::Refused(e.to_string())),
                )
            }
        }
    }

    /// A part of a shard: to the store, its digest folded in; when it completes the shard,
    /// the whole is checked against the digest it claims and offered.
    #[allow(clippy::too_many_arguments)]
    fn part(
        &self,
        st: &mut CkState,
        now: u64,
        node: ravnest_core::NodeId,
        step: u64,
        layers: LayerRange,
        digest: u64,
        part: &[f32],
        offset: u64,
        total: u64,
    ) {
        let key = (step, layers);
        let refuse = |st: &mut CkState, why: String| {
            st.incoming.remove(&key);
            self.store.forget(step, Some(layers));
            self.record(
                now,
                "shard-refused",
                Some(Addr::Node(node)),
                step,
                Some(Event::Refused(format!(
                    "step {step}, layers {layers} from node {}: {why}",
                    node.0
                ))),
            );
        };
        if offset == 0 {
            st.incoming.insert(
                key,
                Incoming {
                    received: 0,
                    digest: ravnest_protocol::digest::Digest::default(),
                    total,
                },
            );
        }
        let Some(inc) = st.incoming.get_mut(&key) else {
            return refuse(
                st,
                format!("a part at {offset} of a shard that never started"),
            );
        };
        if inc.received != offset || inc.total != total || offset + part.len() as u64 > total {
            let why = format!(
                "a part at {offset} of {total} values after {} of {}",
                inc.received, inc.total
            );
            return refuse(st, why);
        }
        inc.digest.update(part);
        inc.received += part.len() as u64;
        if let Err(e) = self.store.put(step, layers, offset, part) {
            return refuse(st, format!("could not be kept: {e}"));
        }
        if inc.received < total {
            return;
        }
        let actual = inc.digest.finish();
        st.incoming.remove(&key);
        // The values must be what their digest says, whatever round they are for.
        if actual != digest {
            return refuse(
                st,
                format!(
                    "its values have digest {actual:016x}, not the {digest:016x} it claims (corrupted)"
                ),
            );
        }
        let meta = ShardMeta {
            node,
            layers,
            digest,
            bytes: total * self.bytes_per_elem,
        };
        if st.open.contains(&step) {
            self.offer(st, now, step, meta);
        } else if st.agg.last_complete().is_none_or(|c| step > c) {
            // Before its round: kept for when the replicas have agreed on the version.
            st.early.entry(step).or_default().push(meta);
            // Too many waiting: the newest goes (the oldest opens next).
            while st.early.len() > EARLY_VERSIONS {
                if let Some((s, _)) = st.early.pop_last() {
                    self.store.forget(s, None);
                }
            }
        } else {
            self.store.forget(step, Some(layers));
        }
    }
}

impl<T: Transport> Actor for CheckpointActor<T> {
    type Msg = CkMsg;
    type State = CkState;
    type Arguments = ();

    async fn pre_start(
        &self,
        myself: ActorRef<CkMsg>,
        _: (),
    ) -> Result<CkState, ActorProcessingErr> {
        self.transport.register(
            Addr::Checkpoint,
            crate::seams::mailbox(myself.clone(), CkMsg::Net),
        );
        Ok(CkState::default())
    }

    async fn handle(
        &self,
        _myself: ActorRef<CkMsg>,
        msg: CkMsg,
        st: &mut CkState,
    ) -> Result<(), ActorProcessingErr> {
        let CkMsg::Net(from, env) = msg;
        let now = self.t0.elapsed().as_nanos() as u64;
        match env {
            Envelope::CheckpointBegin { step, shards } => {
                st.agg.begin(step, &shards);
                st.open.insert(step);
                for meta in st.early.remove(&step).unwrap_or_default() {
                    self.offer(st, now, step, meta);
                }
            }
            Envelope::Restore { to, epoch } => {
                if let Some(newer) = self.store.superseded() {
                    // A newer term's checkpoints are not this stale coordinator's to restore.
                    let event = Event::Superseded { step: 0, newer };
                    self.record(now, "restore", Some(from), 0, Some(event));
                    return Ok(());
                }
                let checkpoint = self.store.latest();
                self.record(
                    now,
                    "restore",
                    Some(from),
                    checkpoint.as_ref().map_or(0, |c| c.0),
                    None,
                );
                let _ = self.transport.send(
                    Addr::Checkpoint,
                    Addr::Node(to),
                    Envelope::Restored { epoch, checkpoint },
                );
            }
            Envelope::CheckpointAbandon { step } => {
                st.agg.abandon(step);
                st.open.remove(&step);
                st.incoming.retain(|k, _| k.0 != step);
                st.early.remove(&step);
                self.store.forget(step, None);
            }
            Envelope::Shard {
                step,
                layers,
                digest,
                model,
                offset,
                total,
                ..
            } => {
                if let Addr::Node(node) = from {
                    self.part(st, now, node, step, layers, digest, &model, offset, total);
                }
                drop(model);
                self.transport.stored();
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use ravnest_core::NodeId;

    use super::*;
    use crate::seams::{Inbox, TransportError};
    use ravnest_protocol::digest::digest;

    /// Delivers nothing anywhere; keeps the checkpoint actor's inbox for the test to call.
    #[derive(Clone, Default)]
    struct Net(Arc<Mutex<Option<Inbox>>>);

    impl Transport for Net {
        fn register(&self, _: Addr, inbox: Inbox) {
            *self.0.lock().unwrap() = Some(inbox);
        }
        fn send(&self, _: Addr, _: Addr, _: Envelope) -> Result<(), TransportError> {
            Ok(())
        }
    }

    /// Keeps the steps committed.
    #[derive(Default)]
    struct Mem(Mutex<Vec<(u64, Vec<f32>)>>, ShardParts);

    impl Store for Mem {
        fn put(&self, step: u64, l: LayerRange, at: u64, v: &[f32]) -> Result<(), StoreError> {
            self.1.put(step, l, at, v);
            Ok(())
        }
        fn forget(&self, step: u64, layers: Option<LayerRange>) {
            self.1.forget(step, layers);
        }
        fn commit(&self, m: &Manifest) -> Result<(), StoreError> {
            self.0
                .lock()
                .unwrap()
                .push((m.step, self.1.take(m).concat()));
            Ok(())
        }
    }

    #[tokio::test]
    async fn a_corrupted_shard_is_refused_and_the_previous_checkpoint_stays() {
        let net = Net::default();
        let store = Arc::new(Mem::default());
        let launch = crate::Launch::new(net.clone());
        let log = launch.journal();
        let me = launch.checkpoints(store.clone(), 4).await.unwrap();
        let inbox = net.0.lock().unwrap().clone().unwrap();
        let node = Addr::Node(NodeId(1));
        let round = |step: u64, good: &[f32], sent: Vec<f32>| {
            inbox(
                Addr::Coordinator,
                Envelope::CheckpointBegin {
                    step,
                    shards: vec![(LayerRange::new(0, 2), digest(good))],
                },
            );
            // In two parts.
            let total = sent.len() as u64;
            for (k, part) in sent.chunks(3).enumerate() {
                inbox(
                    node,
                    Envelope::Shard {
                        step,
                        layers: LayerRange::new(0, 2),
                        digest: digest(good),
                        virtual_bytes: 4 * part.len() as u64,
                        model: part.to_vec(),
                        offset: 3 * k as u64,
                        total,
                    },
                );
            }
        };
        let v10: Vec<f32> = vec![1.0, 2.0, 3.0, 4.0];
        round(10, &v10, v10.clone());
        let v20: Vec<f32> = vec![1.5, 2.5, 3.5, 4.5];
        let mut bad = v20.clone();
        bad[2] = f32::from_bits(bad[2].to_bits() ^ 1);
        round(20, &v20, bad);
        // The actor stops once it has handled what is in its mailbox.
        me.drain_and_wait(None).await.unwrap();
        assert_eq!(*store.0.lock().unwrap(), vec![(10, v10)]);
        let events = &log.lock().unwrap().events;
        assert!(
            events.iter().any(|(_, e)| matches!(
                e,
                Event::Refused(w) if w.contains("step 20") && w.contains("corrupted")
            )),
            "{events:?}"
        );
        assert!(
            !events
                .iter()
                .any(|(_, e)| matches!(e, Event::CheckpointComplete { step: 20, .. })),
            "{events:?}"
        );
    }
}

//! The checkpoint actor: a thin shell over [`ravnest_core::checkpoint::Aggregator`]. The
//! coordinator opens a round when it hands out a step that ends in a checkpoint; writers report
//! their shards; on completion the merged model goes to a [`Store`] (files in `ravnest run`,
//! memory in the simulator) and the completion is logged.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use ravnest_core::checkpoint::{Aggregator, Manifest, ShardMeta};
use tokio::time::Instant;

use crate::coordinator::{Event, SharedLog};
use crate::msg::{Addr, Envelope};
use crate::seams::Transport;
use crate::trace::Trace;

/// Where complete checkpoints go.
pub trait Store: Send + Sync + 'static {
    /// Commit a complete checkpoint: `shards[i]` holds the values of `manifest.shards[i]`.
    fn commit(&self, manifest: &Manifest, shards: &[Vec<f32>]) -> Result<(), String>;
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

/// Open rounds and the shard values received so far.
#[derive(Debug, Default)]
pub struct CkState {
    agg: Aggregator,
    data: BTreeMap<(u64, u32, u32), Vec<f32>>,
    /// Expected digest of each shard of each open round.
    expected: BTreeMap<(u64, u32, u32), u64>,
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
                let ranges: Vec<Range<usize>> = shards
                    .iter()
                    .map(|&(a, b, _)| a as usize..b as usize)
                    .collect();
                st.agg.begin(step, &ranges);
                st.data.retain(|k, _| k.0 != step);
                for (a, b, d) in shards {
                    st.expected.insert((step, a, b), d);
                }
            }
            Envelope::CheckpointAbandon { step } => {
                st.agg.abandon(step);
                st.data.retain(|k, _| k.0 != step);
                st.expected.retain(|k, _| k.0 != step);
            }
            Envelope::Shard {
                step,
                layers,
                digest,
                model,
            } => {
                let Addr::Node(node) = from else {
                    return Ok(());
                };
                let meta = ShardMeta {
                    node,
                    layers: layers.0 as usize..layers.1 as usize,
                    digest,
                    bytes: model.len() as u64 * self.bytes_per_elem,
                };
                st.data.insert((step, layers.0, layers.1), model);
                match st.agg.shard(step, meta) {
                    Ok(None) => {}
                    Ok(Some(manifest)) => {
                        let shards: Vec<Vec<f32>> = manifest
                            .shards
                            .iter()
                            .map(|m| {
                                st.data
                                    .remove(&(step, m.layers.start as u32, m.layers.end as u32))
                                    .unwrap_or_default()
                            })
                            .collect();
                        st.data.retain(|k, _| k.0 > step);
                        st.expected.retain(|k, _| k.0 > step);
                        let event = match self.store.commit(&manifest, &shards) {
                            Ok(()) => Event::CheckpointComplete {
                                step,
                                digest: manifest.shards.first().map_or(0, |m| m.digest),
                            },
                            Err(e) => Event::Violation(format!(
                                "checkpoint {step} could not be stored: {e}"
                            )),
                        };
                        self.trace.record(
                            now,
                            "checkpoint-complete",
                            Some(Addr::Checkpoint),
                            None,
                            step,
                        );
                        self.log.lock().unwrap().events.push((now, event));
                    }
                    Err(_) => {
                        // A stale or malformed shard: refused and traced; nothing changes.
                        self.trace.record(
                            now,
                            "shard-refused",
                            Some(from),
                            Some(Addr::Checkpoint),
                            step,
                        );
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
}

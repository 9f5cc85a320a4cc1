//! The transport conformance suite: written once, run against every [`Transport`]
//! (`SimNet` now, TCP next). Each check returns `Err(description)` on a violation.
//!
//! The contract: envelopes between two addresses arrive in send order within each class (bulk
//! data, control: see [`Envelope::is_bulk`]); large envelopes arrive whole; sending to an address outside the cluster is an immediate error; a crashed node's
//! envelopes are not delivered and it cannot send.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ravnest_core::NodeId;
use ravnest_core::collective::{CollId, CollMsg};
use ravnest_core::ring::{Phase, RingChunk};

use crate::seams::{Transport, TransportError};
use ravnest_protocol::msg::{Addr, Envelope};

/// A transport under test, with a way to crash one of its nodes.
pub trait TestNet: Transport {
    /// Make `node` crash: it stops sending and receiving.
    fn crash_node(&self, node: NodeId);
}

type Got = Arc<Mutex<Vec<(Addr, Envelope)>>>;

fn listen<T: Transport>(net: &T, at: Addr) -> Got {
    let got: Got = Arc::default();
    let g = got.clone();
    net.register(
        at,
        Arc::new(move |from, env| g.lock().unwrap().push((from, env))),
    );
    got
}

fn chunk(i: usize, len: usize) -> Envelope {
    Envelope::Coll {
        msg: CollMsg::Chunk(RingChunk {
            id: CollId::epoch(1),
            level: 0,
            phase: Phase::ReduceScatter,
            step: 0,
            chunk: i,
            seg: 0,
            data: vec![i as f32; len],
        }),
        virtual_bytes: 4 * len as u64,
        packing: ravnest_core::pack::Packing::Fp32,
    }
}

/// 200 envelopes of mixed kinds and sizes from node 0 to node 1 arrive, each class in order.
pub async fn ordering_per_link<T: Transport>(net: &T, settle: Duration) -> Result<(), String> {
    let got = listen(net, Addr::Node(NodeId(1)));
    for i in 0..200 {
        let env = if i % 3 == 0 {
            chunk(i, 1 + i % 17)
        } else {
            Envelope::Halt { epoch: i as u64 }
        };
        net.send(Addr::Node(NodeId(0)), Addr::Node(NodeId(1)), env)
            .map_err(|e| e.to_string())?;
    }
    tokio::time::sleep(settle).await;
    let got = got.lock().unwrap();
    if got.len() != 200 {
        return Err(format!("{} of 200 envelopes arrived", got.len()));
    }
    let (mut next_bulk, mut next_control) = (0usize, 1usize);
    for (from, env) in got.iter() {
        if *from != Addr::Node(NodeId(0)) {
            return Err(format!("wrong sender {from:?}"));
        }
        let ok = match env {
            Envelope::Coll {
                msg: CollMsg::Chunk(chunk),
                ..
            } => {
                let ok = chunk.chunk == next_bulk;
                next_bulk += 3;
                ok
            }
            Envelope::Halt { epoch } => {
                let ok = *epoch == next_control as u64;
                next_control += if next_control % 3 == 2 { 2 } else { 1 };
                ok
            }
            _ => false,
        };
        if !ok {
            return Err(format!(
                "an envelope arrived out of order within its class or changed: {env:?}"
            ));
        }
    }
    Ok(())
}

/// A 4-million-element chunk arrives whole and unchanged.
pub async fn large_messages<T: Transport>(net: &T, settle: Duration) -> Result<(), String> {
    let got = listen(net, Addr::Node(NodeId(2)));
    net.send(
        Addr::Node(NodeId(0)),
        Addr::Node(NodeId(2)),
        chunk(7, 4 << 20),
    )
    .map_err(|e| e.to_string())?;
    tokio::time::sleep(settle).await;
    let got = got.lock().unwrap();
    match got.as_slice() {
        [
            (
                _,
                Envelope::Coll {
                    msg: CollMsg::Chunk(chunk),
                    ..
                },
            ),
        ] if chunk.data.len() == 4 << 20 && chunk.data.iter().all(|&x| x == 7.0) => Ok(()),
        other => Err(format!(
            "expected one intact large chunk, got {} envelopes",
            other.len()
        )),
    }
}

/// Sending to (or from) an address outside the cluster is an immediate error.
pub fn unknown_address<T: Transport>(net: &T) -> Result<(), String> {
    let far = Addr::Node(NodeId(9999));
    match net.send(Addr::Node(NodeId(0)), far, Envelope::Heartbeat) {
        Err(TransportError::Unknown(a)) if a == far => {}
        other => return Err(format!("send to an unknown node: {other:?}")),
    }
    match net.send(far, Addr::Node(NodeId(0)), Envelope::Heartbeat) {
        Err(TransportError::Unknown(_)) => Ok(()),
        other => Err(format!("send from an unknown node: {other:?}")),
    }
}

/// After a crash, nothing reaches the crashed node and it cannot send.
pub async fn peer_down<T: TestNet>(net: &T, settle: Duration) -> Result<(), String> {
    let got = listen(net, Addr::Node(NodeId(2)));
    net.crash_node(NodeId(2));
    net.send(
        Addr::Node(NodeId(0)),
        Addr::Node(NodeId(2)),
        Envelope::Heartbeat,
    )
    .map_err(|e| e.to_string())?;
    tokio::time::sleep(settle).await;
    if !got.lock().unwrap().is_empty() {
        return Err("a crashed node received an envelope".into());
    }
    match net.send(
        Addr::Node(NodeId(2)),
        Addr::Node(NodeId(0)),
        Envelope::Heartbeat,
    ) {
        Err(TransportError::SenderDown(_)) => Ok(()),
        other => Err(format!("a crashed node could send: {other:?}")),
    }
}

//! The listener's side: accepting a connection (handshake, one live connection per node) and
//! delivering what arrives on it, acknowledging the session's count.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::conn::Conn;
use ravnest_core::NodeId;
use tokio::io::AsyncWriteExt;

use crate::wire;
use ravnest_protocol::msg::Addr;

use super::channel::{self, RECORD_SPAN};
use super::config::*;
use super::handshake::*;
use super::state::*;

impl TcpTransport {
    /// Whether an authenticated `peer` (as `incarnation`) may connect now: not while a live
    /// connection from it is open (a second one claiming it is not the node that is talking to
    /// us). If admitted, its connection becomes the current one; returns the connection's
    /// number and how many frames of that incarnation's session were already delivered.
    pub(super) fn admit(&self, peer: NodeId, incarnation: u64) -> Option<(u64, u64)> {
        let mut incoming = self.inner.incoming.lock().unwrap();
        let now = self.now_ms();
        if let Some(s) = incoming.get(&peer)
            && s.open
            && now.saturating_sub(s.last.load(Ordering::Relaxed)) <= LIVE_MS
        {
            return None;
        }
        let conn = self.inner.next_conn.fetch_add(1, Ordering::Relaxed);
        let kept = incoming
            .remove(&peer)
            .map_or_else(Vec::new, |s| s.delivered);
        let mut state = InState {
            conn,
            open: true,
            last: Arc::new(AtomicU64::new(now)),
            incarnation,
            delivered: kept,
        };
        let delivered = *state.count();
        incoming.insert(peer, state);
        Some((conn, delivered))
    }

    /// What a joiner asking for the cluster file is answered.
    fn share_answer(&self, r: &JoinRequest) -> Option<ShareReply> {
        let sharer = self.inner.sharer.lock().unwrap().clone();
        match sharer {
            Some(f) => Some(f(r)),
            None => self
                .inner
                .share
                .lock()
                .unwrap()
                .as_ref()
                .map(|d| ShareReply::File(d.to_string())),
        }
    }

    /// An accepted connection: authenticate, then read frames until it ends, acknowledging
    /// what was delivered. Its end is not a peer's death (the failure detector decides that on
    /// heartbeats): the peer dials again and sends what we had not delivered.
    pub(super) async fn serve(&self, mut stream: Conn, remote: String) {
        let accepted = handshake_accept(
            &mut stream,
            &self.inner.cfg,
            &remote,
            self.inner.incarnation,
            |r| self.share_answer(r),
            |p, inc| self.admit(p, inc),
        )
        .await;
        let (peer, conn, transcript) = match accepted {
            Ok(Accepted::Node(p, conn, t)) => {
                self.saw_incarnation(p, t.dialer_incarnation);
                (p, conn, t)
            }
            Ok(Accepted::ClusterFileSent) => {
                self.log(format!("sent the cluster file to a joiner at {remote}"));
                return;
            }
            Err(e) => {
                self.log(format!("refused {e}"));
                return;
            }
        };
        let last = match self.inner.incoming.lock().unwrap().get(&peer) {
            Some(s) if s.conn == conn => s.last.clone(),
            _ => return,
        };
        let keys = if self.inner.cfg.encrypt {
            let who = format!("node {} at {remote}", peer.0);
            match channel::establish(
                &mut stream,
                &self.inner.cfg.secret,
                &transcript,
                false,
                &who,
            )
            .await
            {
                Ok(k) => Some(k),
                Err(e) => {
                    self.log(format!("refused {e}"));
                    self.close_incoming(peer, conn);
                    return;
                }
            }
        } else {
            None
        };
        // Frames come in bulk; only acknowledgements go back.
        let (mut read, mut write) =
            channel::split(stream, keys, (1 << 16, 64), (4 * RECORD_SPAN, RECORD_SPAN));
        let reason = loop {
            match wire::read_envelope(&mut read, self.inner.cfg.max_frame).await {
                Ok(None) => break None,
                Err(_) if read.auth_failed() => {
                    self.auth_failure(peer);
                    break None;
                }
                Err(e) => break Some(e.to_string()),
                Ok(Some((from, to, env))) => {
                    last.store(self.now_ms(), Ordering::Relaxed);
                    self.count_bytes(peer, 1, env.wire_bytes());
                    // The header must not lie about who sent it or where it goes.
                    // (A node that joined is known by its authenticated connection before its
                    // address arrives.)
                    let hosts = (self.host(from), self.host(to));
                    let void = match judge_header(hosts, peer, self.inner.cfg.me, (from, to), &env)
                    {
                        Ok(void) => void,
                        Err(why) => break Some(why),
                    };
                    let Some(delivered) = self.count_delivered(peer, conn) else {
                        break Some("replaced by a newer connection".into());
                    };
                    if let Some(why) = void {
                        self.log(format!("dropped a frame from node {}: {why}", peer.0));
                    } else {
                        let part = matches!(env, ravnest_protocol::msg::Envelope::Shard { .. });
                        self.deliver(from, to, env);
                        if part {
                            self.parts_settle().await;
                        }
                    }
                    // Acknowledge once what has arrived so far is delivered.
                    if read.is_drained()
                        && (write.write_all(&delivered.to_le_bytes()).await.is_err()
                            || write.flush().await.is_err())
                    {
                        break None;
                    }
                }
            }
        };
        if let Some(r) = reason {
            self.log(format!("dropped the connection from node {}: {r}", peer.0));
        }
        self.close_incoming(peer, conn);
    }

    /// Count a frame from `peer` on connection `conn`: the session's count of delivered
    /// frames, or `None` if a newer connection from the peer took over.
    fn count_delivered(&self, peer: NodeId, conn: u64) -> Option<u64> {
        let mut incoming = self.inner.incoming.lock().unwrap();
        match incoming.get_mut(&peer) {
            Some(s) if s.conn == conn => {
                *s.count() += 1;
                Some(*s.count())
            }
            _ => None,
        }
    }

    /// Connection `conn` from `peer` is over (if it is still the current one).
    fn close_incoming(&self, peer: NodeId, conn: u64) {
        if let Some(s) = self.inner.incoming.lock().unwrap().get_mut(&peer)
            && s.conn == conn
        {
            s.open = false;
        }
    }
}

/// A frame's header (`from`, `to`) on a connection from `peer` to `me`, where `sender` hosts
/// `from` and `receiver` hosts `to` as this process knows: `Err` when the header lies (the
/// connection is dropped), `Ok(Some(why))` when the frame is void (acknowledged and dropped:
/// what a node sends to a coordinator that is not here, or what a coordinator this node does
/// not follow sends, is of a term that is over or not yet known), `Ok(None)` to deliver. A
/// coordinator's replica and lease are delivered whoever hosts it: the node's watch judges
/// them by their term (a successor's first replica comes before this node follows it; a
/// stale coordinator's lease is answered with the newer term).
fn judge_header(
    (sender, receiver): (Option<NodeId>, Option<NodeId>),
    peer: NodeId,
    me: NodeId,
    (from, to): (Addr, Addr),
    env: &ravnest_protocol::msg::Envelope,
) -> Result<Option<String>, String> {
    use ravnest_protocol::msg::Envelope;
    let succession = matches!(env, Envelope::Succession(_) | Envelope::Lease { .. });
    match from {
        Addr::Node(n) if n != peer => return Err(format!("claimed to send as {from:?}")),
        Addr::Node(_) => {}
        Addr::Coordinator if sender == Some(peer) || succession => {}
        Addr::Coordinator => {
            return Ok(Some(format!(
                "it sent as the coordinator, which this node follows elsewhere ({})",
                env.kind()
            )));
        }
        _ if sender == Some(peer) => {}
        _ => return Err(format!("claimed to send as {from:?}")),
    }
    match to {
        _ if receiver == Some(me) => Ok(None),
        Addr::Coordinator => Ok(Some(format!(
            "sent to the coordinator, which is not here ({})",
            env.kind()
        ))),
        _ => Err(format!("sent to {to:?}, which is not here")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ravnest_protocol::msg::Envelope;

    #[test]
    fn a_lying_header_drops_the_connection_and_a_void_frame_only_itself() {
        let (n0, n1, n2) = (NodeId(0), NodeId(1), NodeId(2));
        let lease = Envelope::Lease { term: 0, host: n0 };
        let beat = Envelope::Heartbeat;
        let me = n2;
        // Node 1 claiming to be node 0: a lie.
        let judge = |hosts, peer, hdr, env: &Envelope| judge_header(hosts, peer, me, hdr, env);
        let to_me = (Addr::Node(n0), Addr::Node(me));
        assert!(judge((Some(n0), Some(me)), n1, to_me, &beat).is_err());
        // The coordinator followed here is node 1: node 0's lease still reaches the watch (it
        // is judged by its term); its other frames are void, and so is a frame for a
        // coordinator that is not here.
        let from_coord = (Addr::Coordinator, Addr::Node(me));
        assert_eq!(
            judge((Some(n1), Some(me)), n0, from_coord, &lease),
            Ok(None)
        );
        assert!(matches!(
            judge((Some(n1), Some(me)), n0, from_coord, &Envelope::Finish),
            Ok(Some(_))
        ));
        assert_eq!(
            judge((Some(n1), Some(me)), n1, from_coord, &Envelope::Finish),
            Ok(None)
        );
        let to_coord = (Addr::Node(n1), Addr::Coordinator);
        assert!(matches!(
            judge((Some(n1), Some(n0)), n1, to_coord, &beat),
            Ok(Some(_))
        ));
        assert_eq!(judge((Some(n1), Some(me)), n1, to_coord, &beat), Ok(None));
        // A frame for another node than this one is a lie.
        let elsewhere = (Addr::Node(n1), Addr::Node(n0));
        assert!(judge((Some(n1), Some(n0)), n1, elsewhere, &beat).is_err());
    }
}

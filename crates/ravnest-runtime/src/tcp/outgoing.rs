//! The dialer's side: one outgoing connection per peer fed by a queue, the session that
//! survives connections (unacknowledged frames are sent again), redialing and giving up.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use ravnest_core::NodeId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use crate::wire;

use super::agreed::*;
use super::channel::{self, AUTH_FAILED, RECORD_SPAN, Rx, Tx};
use super::conn::Conn;
use super::handshake::*;
use super::state::*;

impl TcpTransport {
    pub(super) fn link(&self, peer: NodeId) -> Link {
        let mut links = self.inner.links.lock().unwrap();
        if let Some(l) = links.get(&peer)
            && !l.1.is_closed()
        {
            return l.clone();
        }
        let (tx, rx) = mpsc::unbounded_channel();
        let generation = self.inner.next_link.fetch_add(1, Ordering::Relaxed);
        links.insert(peer, (generation, tx.clone()));
        let me = self.clone();
        let h = tokio::spawn(async move { me.write_loop(peer, generation, rx).await });
        self.inner.tasks.lock().unwrap().push(h.abort_handle());
        (generation, tx)
    }

    pub(super) fn unlink(&self, peer: NodeId, generation: u64) {
        let mut links = self.inner.links.lock().unwrap();
        if links.get(&peer).is_some_and(|l| l.0 == generation) {
            links.remove(&peer);
        }
    }

    /// Connect and authenticate to `peer` and set up the connection's channel; its ends, its
    /// incarnation and how many frames of our session it has delivered.
    pub(super) async fn dial(&self, peer: NodeId) -> Option<(Rx, Tx, u64, u64)> {
        let deadline = tokio::time::Instant::now() + self.inner.cfg.connect_window;
        let mut backoff = Duration::from_millis(20);
        loop {
            if self.inner.gone.lock().unwrap().contains(&peer) {
                return None;
            }
            let (addr, conn) = match &self.inner.p2p {
                Some(net) => (
                    format!("{}", net.peer_of(peer)),
                    net.open(peer).await.map(Conn::P2p),
                ),
                None => {
                    let addr = self.dial_addr(peer)?;
                    let s = TcpStream::connect(addr).await.map(|s| {
                        let _ = s.set_nodelay(true);
                        Conn::Tcp(s)
                    });
                    (addr.to_string(), s.map_err(|e| e.to_string()))
                }
            };
            match conn {
                Ok(mut s) => {
                    match self.handshake(&mut s, peer).await {
                        Ok((keys, t)) => {
                            self.saw_incarnation_dialed(peer, t.listener_incarnation);
                            // Frames go out in bulk; only acknowledgements come back.
                            let (rx, tx) = channel::split(
                                s,
                                keys,
                                (64, 1 << 16),
                                (RECORD_SPAN, 4 * RECORD_SPAN),
                            );
                            return Some((rx, tx, t.listener_incarnation, t.delivered));
                        }
                        Err(
                            e @ (HandshakeError::Secret(_)
                            | HandshakeError::Version { .. }
                            | HandshakeError::Unknown(_)
                            | HandshakeError::Encryption(_)),
                        ) => {
                            self.log(format!("refused by {e}"));
                            self.inner.refusals.lock().unwrap().insert(peer, e);
                            return None;
                        }
                        Err(e) => self.log(format!("handshake failed: {e}")),
                    }
                }
                Err(_) if tokio::time::Instant::now() < deadline => {}
                Err(e) => {
                    self.log(format!("cannot reach node {} at {addr}: {e}", peer.0));
                    return None;
                }
            }
            if tokio::time::Instant::now() >= deadline || self.inner.down.load(Ordering::SeqCst) {
                return None;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    /// The dialer's handshake on `s`, then the channel's when we encrypt.
    async fn handshake(
        &self,
        s: &mut Conn,
        peer: NodeId,
    ) -> Result<(Option<channel::Keys>, Transcript), HandshakeError> {
        let cfg = &self.inner.cfg;
        let t = handshake_dial(s, cfg, peer, self.inner.incarnation).await?;
        if !cfg.encrypt {
            return Ok((None, t));
        }
        let who = format!("node {}", peer.0);
        let keys = channel::establish(s, &cfg.secret, &t, true, &who).await?;
        Ok((Some(keys), t))
    }

    /// Start (or resume) our session with `peer` on a new connection: frames it delivered are
    /// done; the rest are to be written again, in order. A restarted peer (another
    /// incarnation) starts a new session: what was meant for the old process is dropped.
    pub(super) fn resume_session(
        &self,
        peer: NodeId,
        incarnation: u64,
        delivered: u64,
    ) -> Vec<Arc<wire::Frame>> {
        let mut sessions = self.inner.sessions.lock().unwrap();
        let s = sessions.entry(peer).or_default();
        let same = s.incarnation == Some(incarnation);
        if !same || delivered < s.acked || delivered - s.acked > s.unacked.len() as u64 {
            if same {
                self.log(format!(
                    "node {} reports {delivered} frames delivered of {}: session restarted",
                    peer.0,
                    s.acked + s.unacked.len() as u64
                ));
            }
            s.unacked.clear();
            s.incarnation = Some(incarnation);
            s.acked = delivered;
            s.connected = true;
            self.inner.settled.notify_waiters();
            return Vec::new();
        }
        s.trim(delivered);
        s.connected = true;
        self.inner.settled.notify_waiters();
        s.unacked.iter().cloned().collect()
    }

    pub(super) async fn write_loop(
        &self,
        peer: NodeId,
        generation: u64,
        mut rx: mpsc::UnboundedReceiver<wire::Frame>,
    ) {
        let Some((mut read, mut w, incarnation, delivered)) = self.dial(peer).await else {
            return self.give_up(peer, generation, rx);
        };
        let again = self.resume_session(peer, incarnation, delivered);
        let mut failed = false;
        for f in &again {
            if w.write_all(&f.head).await.is_err() || w.write_all(f.payload_bytes()).await.is_err()
            {
                failed = true;
                break;
            }
        }
        failed = failed || w.flush().await.is_err();
        let mut ack = [0u8; 8];
        let mut have = 0;
        while !failed {
            // The listener writes only acknowledgements on this connection: the count of our
            // frames it has delivered. Its end means the connection closed. (`read` keeps
            // what it has if the other branch wins; `read_exact` would drop it.)
            let frame = tokio::select! {
                biased;
                r = read.read(&mut ack[have..]) => {
                    match r {
                        Ok(0) => break,
                        Ok(n) => have += n,
                        Err(_) => {
                            if read.auth_failed() {
                                self.auth_failure(peer);
                            }
                            break;
                        }
                    }
                    if have < ack.len() {
                        continue;
                    }
                    have = 0;
                    let n = u64::from_le_bytes(ack);
                    self.inner.sessions.lock().unwrap().entry(peer).or_default().trim(n);
                    self.inner.settled.notify_waiters();
                    continue;
                }
                f = rx.recv() => match f {
                    Some(f) => f,
                    None => break,
                },
            };
            let mut next = Some(frame);
            let mut taken = 0;
            // Write what is queued, then flush once.
            while let Some(f) = next {
                taken += 1;
                let f = Arc::new(f);
                self.inner
                    .sessions
                    .lock()
                    .unwrap()
                    .entry(peer)
                    .or_default()
                    .unacked
                    .push_back(f.clone());
                if w.write_all(&f.head).await.is_err()
                    || w.write_all(f.payload_bytes()).await.is_err()
                {
                    failed = true;
                }
                self.inner
                    .bytes_sent
                    .fetch_add(f.len() as u64, Ordering::Relaxed);
                self.count_bytes(peer, 0, f.len() as u64);
                if f.sync {
                    self.inner
                        .sync_bytes_sent
                        .fetch_add(f.len() as u64, Ordering::Relaxed);
                }
                next = if failed { None } else { rx.try_recv().ok() };
            }
            failed = failed || w.flush().await.is_err();
            self.inner.unsent.sub(peer, taken);
            self.inner.settled.notify_waiters();
        }
        self.closed(peer, generation, rx).await;
    }

    /// A record from `peer` failed authentication: the connection is closed (the session
    /// sends again, on a new one, what was not acknowledged).
    pub(super) fn auth_failure(&self, peer: NodeId) {
        self.inner.auth_failures.fetch_add(1, Ordering::Relaxed);
        self.log(format!(
            "{AUTH_FAILED}: closing the connection to node {}",
            peer.0
        ));
    }

    /// `peer` was unreachable for the whole connect window: what was queued for it is lost,
    /// and it is reported down.
    pub(super) fn give_up(
        &self,
        peer: NodeId,
        generation: u64,
        mut rx: mpsc::UnboundedReceiver<wire::Frame>,
    ) {
        self.unlink(peer, generation);
        rx.close();
        self.forget_queued(peer, &mut rx);
        let dropped = self.inner.sessions.lock().unwrap().remove(&peer);
        if let Some(d) = dropped
            && !d.unacked.is_empty()
        {
            self.log(format!(
                "gave up {} frames for node {}",
                d.unacked.len(),
                peer.0
            ));
        }
        self.peer_down(peer);
    }

    /// The connection to `peer` ended (its writer's queue is `rx`).
    pub(super) async fn closed(
        &self,
        peer: NodeId,
        generation: u64,
        mut rx: mpsc::UnboundedReceiver<wire::Frame>,
    ) {
        // A connection that closes is not a dead peer (a reset on the path, a proxy, a peer
        // that restarted). What was queued joins the session's unacknowledged frames, and a new
        // connection sends them again: nothing is lost. Closed by us (shutdown, or the link was
        // replaced): nothing to do.
        let closed_by_peer = !rx.is_closed();
        let pending = {
            let mut sessions = self.inner.sessions.lock().unwrap();
            rx.close();
            let s = sessions.entry(peer).or_default();
            s.connected = false;
            while let Ok(f) = rx.try_recv() {
                self.inner.unsent.sub(peer, 1);
                s.unacked.push_back(Arc::new(f));
            }
            self.inner.settled.notify_waiters();
            !s.unacked.is_empty()
        };
        self.unlink(peer, generation);
        // With nothing in flight, the next envelope dials again (a peer that finished and
        // exited is not news).
        if closed_by_peer && !self.inner.down.load(Ordering::SeqCst) {
            if pending {
                self.log(format!(
                    "the connection to node {} closed; dialing again (frames in flight)",
                    peer.0
                ));
                tokio::time::sleep(Duration::from_millis(20)).await;
                self.link(peer);
            } else {
                self.record(format!(
                    "node {}: the connection to node {} closed; dialing again at the next envelope",
                    self.inner.cfg.me.0, peer.0
                ));
            }
        }
    }

    /// Frames left in a closed link's queue are lost with it.
    pub(super) fn forget_queued(
        &self,
        peer: NodeId,
        rx: &mut mpsc::UnboundedReceiver<wire::Frame>,
    ) {
        while rx.try_recv().is_ok() {
            self.inner.unsent.sub(peer, 1);
        }
        self.inner.settled.notify_waiters();
    }
}

//! The real side of the [`Transport`] seam: TCP between processes.
//!
//! One transport per process (one node, plus the coordinator and checkpoint actors on the
//! coordinator's host). Each process listens on its node's address; for every peer it sends to,
//! it dials one outgoing connection, fed by a queue, so envelopes to one peer keep their order.
//! Frames are [`crate::wire`] frames.
//!
//! **Handshake** (before any frame is read): the dialer sends its protocol version, node id and
//! a random nonce; the listener answers with its own id and nonce and an HMAC-SHA256 over both
//! nonces and ids, keyed by the cluster secret; the dialer checks it and answers with its own
//! HMAC. The secret never crosses the wire, both sides prove they hold it, and a replayed answer
//! does not fit a fresh nonce. A wrong secret or version is refused with a message naming the
//! peer, on both sides.
//!
//! **Channel** (`TcpConfig::encrypt`, on by default): then a Noise
//! [`NOISE_PROTOCOL`] handshake on the same socket, keyed by a PSK derived from the secret and
//! bound to the handshake's transcript; every byte after it (frames, acknowledgements) travels
//! in sealed records. A record that fails authentication (altered, replayed, dropped in flight)
//! closes that connection with a logged reason and is counted
//! ([`TcpTransport::auth_failures`]); the session sends again what was not acknowledged, so
//! nothing altered is delivered and nothing is lost.
//!
//! **Failure**: a connection that closes or sends a bad frame is dropped with a logged reason;
//! the process keeps running, and the peer-down hooks fire (the coordinator feeds them to its
//! failure detector). Envelopes queued for a peer that cannot be reached within the connect
//! window are lost, as on any network; the detector and the coordinator's aborts deal with it.

mod agreed;
mod channel;
mod config;
mod conn;
mod handshake;
mod incoming;
mod loopback;
mod outgoing;
mod ports;
mod state;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ravnest_core::NodeId;
use tokio::net::TcpListener;

use crate::p2p::P2pNet;
use crate::seams::{Inbox, Transport, TransportError};
use crate::wire;
use conn::Conn;
use ravnest_protocol::msg::{Addr, Envelope};

pub use agreed::HandshakeError;
pub use channel::{Channel, NOISE_PROTOCOL};
pub use config::{JoinRequest, LIVE_MS, PeerDownHook, ShareReply, Sharer, TcpConfig};
pub use handshake::{Fetched, dial_as, fetch_cluster_file, fetch_cluster_file_p2p};
pub use loopback::LoopbackCluster;
pub use ports::spare_ports;
pub use state::TcpTransport;
use state::*;

/// Wire protocol version; peers with another version are refused (10: packed collective
/// pieces and the outer step of local SGD; 11: the merge delay of overlapped rounds; 12: the
/// outer momentum going on across a switch, `Work::outer_from`; 13: the coordinator's lease
/// carries its term, `Envelope::Lease`; 14: a joiner's request names it, and the coordinator's
/// host gives a new node its id, `Envelope::Reserve`; 15: a successor's pre-vote,
/// `Envelope::PreVote`; 16: the replica names the nodes given a place, `Replica::reserved`).
pub const PROTOCOL_VERSION: u32 = 16;

/// Checkpoint parts waiting to be stored in this process before its readers wait.
const SHARD_PARTS_WAITING: u64 = 4;
/// The longest a reader waits for them after one part (a checkpoint actor that stopped
/// storing must not stall a peer's connection for good).
const PART_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

impl TcpTransport {
    /// Bind this node's address and start accepting peers.
    pub async fn bind(cfg: TcpConfig, verbose: bool) -> std::io::Result<TcpTransport> {
        let addr = match cfg.listen {
            Some(a) => a,
            None => *cfg.peers.get(&cfg.me).ok_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("node {} has no address", cfg.me.0),
                )
            })?,
        };
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))?;
        TcpTransport::on(cfg, listener, verbose)
    }

    /// Start accepting peers on a listener already bound (one that was never let go, so no
    /// other socket can take its port between choosing it and listening on it).
    pub fn on(
        cfg: TcpConfig,
        listener: TcpListener,
        verbose: bool,
    ) -> std::io::Result<TcpTransport> {
        let t = TcpTransport::with(cfg, listener.local_addr()?, verbose, None);
        let me = t.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, remote)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let me2 = me.clone();
                let h = tokio::spawn(async move {
                    // A connection closed before its first byte is a reachability check (a
                    // starting node seeing whether its coordinator listens; a port scan), not
                    // a peer: nothing to say.
                    let mut first = [0u8; 1];
                    let peeked =
                        tokio::time::timeout(Duration::from_secs(10), stream.peek(&mut first));
                    if matches!(peeked.await, Ok(Ok(0))) {
                        return;
                    }
                    me2.serve(Conn::Tcp(stream), remote.to_string()).await
                });
                me.inner.tasks.lock().unwrap().push(h.abort_handle());
            }
        });
        t.inner.tasks.lock().unwrap().push(task.abort_handle());
        Ok(t)
    }

    /// The same transport over libp2p ([`crate::p2p`]): peers are dialled by their `PeerId`,
    /// directly or through a relay, and ravnest's handshake, sessions and frames run on a
    /// libp2p stream per ordered pair, sealed by the same channel (`cfg.encrypt`): libp2p's
    /// own layer between nodes is plaintext ([`crate::p2p`]).
    pub fn over_p2p(cfg: TcpConfig, net: P2pNet, local: SocketAddr, verbose: bool) -> TcpTransport {
        let mut incoming = net.incoming();
        let mut heard = net.hear();
        let t = TcpTransport::with(cfg, local, verbose, Some(net));
        let me = t.clone();
        let task = tokio::spawn(async move {
            // Every line with RAVNEST_LOG_NET (the paths matter when a run goes wrong);
            // otherwise as the transport's own lines.
            let all = std::env::var_os("RAVNEST_LOG_NET").is_some();
            while let Some(line) = heard.recv().await {
                if all {
                    eprintln!("ravnest: node {}: {line}", me.inner.cfg.me.0);
                    me.record(line);
                } else {
                    me.log(line);
                }
            }
        });
        t.inner.tasks.lock().unwrap().push(task.abort_handle());
        let me = t.clone();
        let task = tokio::spawn(async move {
            while let Some((node, peer, stream)) = incoming.recv().await {
                let me2 = me.clone();
                let remote = match node {
                    Some(n) => format!("node {} ({peer})", n.0),
                    None => format!("{peer}"),
                };
                let h = tokio::spawn(async move { me2.serve(Conn::P2p(stream), remote).await });
                me.inner.tasks.lock().unwrap().push(h.abort_handle());
            }
        });
        t.inner.tasks.lock().unwrap().push(task.abort_handle());
        t
    }

    /// The libp2p side, when this transport runs over it.
    pub fn p2p(&self) -> Option<&P2pNet> {
        self.inner.p2p.as_ref()
    }

    fn with(cfg: TcpConfig, local: SocketAddr, verbose: bool, p2p: Option<P2pNet>) -> TcpTransport {
        TcpTransport {
            inner: Arc::new(Inner {
                local,
                p2p,
                inboxes: Mutex::default(),
                early: Mutex::default(),
                links: Mutex::default(),
                next_link: AtomicU64::new(0),
                hooks: Mutex::default(),
                tasks: Mutex::default(),
                down: AtomicBool::new(false),
                bytes_sent: AtomicU64::new(0),
                sync_bytes_sent: AtomicU64::new(0),
                peer_bytes: Mutex::new(std::collections::BTreeMap::new()),
                auth_failures: AtomicU64::new(0),
                unsent: Default::default(),
                settled: tokio::sync::Notify::new(),
                parts_waiting: AtomicU64::new(0),
                part_stored: tokio::sync::Notify::new(),
                log: Mutex::default(),
                printed: Mutex::default(),
                verbose,
                incarnation: rand::random(),
                incarnations: Mutex::default(),
                incoming: Mutex::default(),
                sessions: Mutex::default(),
                next_conn: AtomicU64::new(0),
                started: std::time::Instant::now(),
                dial_addrs: Mutex::new(cfg.peers.clone()),
                coordinator: std::sync::atomic::AtomicU32::new(cfg.coordinator.0),
                share: Mutex::new(cfg.cluster_file.clone()),
                sharer: Mutex::new(None),
                refusals: Mutex::new(std::collections::BTreeMap::new()),
                gone: Mutex::default(),
                cfg,
            }),
        }
    }

    /// The address this transport listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local
    }

    /// Call `hook` when a peer cannot be reached: no connection to it within the connect window
    /// (a connection that merely closes is not that; the next envelope dials again).
    pub fn on_peer_down(&self, hook: PeerDownHook) {
        self.inner.hooks.lock().unwrap().push(hook);
    }

    /// Bytes written to sockets so far (frames, with headers).
    pub fn bytes_sent(&self) -> u64 {
        self.inner.bytes_sent.load(Ordering::Relaxed)
    }

    /// Count `n` bytes sent to (`way` 0) or received from (1) `peer`.
    fn count_bytes(&self, peer: NodeId, way: usize, n: u64) {
        self.inner
            .peer_bytes
            .lock()
            .unwrap()
            .entry(peer)
            .or_default()[way] += n;
    }

    /// Bytes sent to and received from each peer so far: (peer, sent, received).
    pub fn peer_bytes(&self) -> Vec<(NodeId, u64, u64)> {
        let b = self.inner.peer_bytes.lock().unwrap();
        b.iter().map(|(p, [s, r])| (*p, *s, *r)).collect()
    }

    /// Of [`TcpTransport::bytes_sent`], the bytes of collective frames: what synchronizing
    /// gradients or models cost, without measurement, control and checkpoint traffic.
    pub fn sync_bytes_sent(&self) -> u64 {
        self.inner.sync_bytes_sent.load(Ordering::Relaxed)
    }

    /// Connections closed because a record arriving on them failed authentication (tampered
    /// with or corrupted in flight), on either end: frames this node received, or
    /// acknowledgements of the frames it sent.
    pub fn auth_failures(&self) -> u64 {
        self.inner.auth_failures.load(Ordering::Relaxed)
    }

    /// Wait until every queued frame has been written and every peer we are connected to has
    /// acknowledged what we sent it (frames for an unreachable peer are not waited for), at
    /// most `limit`. Returns whether everything went out. A process that is about to
    /// exit calls this so its last words (`Finish`) are not lost with it.
    pub async fn drain(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        let pending = || {
            self.inner.unsent.total() > 0
                || self
                    .inner
                    .sessions
                    .lock()
                    .unwrap()
                    .values()
                    .any(|s| s.connected && !s.unacked.is_empty())
        };
        loop {
            // Listen before looking, so that a change in between is not missed.
            let settled = self.inner.settled.notified();
            tokio::pin!(settled);
            settled.as_mut().enable();
            if !pending() {
                return true;
            }
            if tokio::time::timeout_at(deadline, settled).await.is_err() {
                return !pending();
            }
        }
    }

    /// What the transport logged (refused handshakes, dropped connections).
    pub fn log_lines(&self) -> Vec<String> {
        self.inner.log.lock().unwrap().clone()
    }

    /// Stop: no more sending or receiving; connections close (peers see them go down).
    pub fn shutdown(&self) {
        self.inner.down.store(true, Ordering::SeqCst);
        self.inner.links.lock().unwrap().clear();
        self.inner.sessions.lock().unwrap().clear();
        for t in self.inner.tasks.lock().unwrap().drain(..) {
            t.abort();
        }
        if let Some(net) = &self.inner.p2p {
            net.shutdown();
        }
    }

    /// Keep a line in the log without printing it.
    fn record(&self, line: String) {
        let mut log = self.inner.log.lock().unwrap();
        if log.len() < 10_000 {
            log.push(line);
        }
    }

    fn log(&self, line: String) {
        let line = format!("node {}: {line}", self.inner.cfg.me.0);
        if self.inner.verbose {
            // A line that repeats (a peer dialing again and again) prints once, then with a
            // count at the 10th, 100th, ... time.
            let shape: String = line.chars().filter(|c| !c.is_ascii_digit()).collect();
            let n = {
                let mut printed = self.inner.printed.lock().unwrap();
                let n = printed.entry(shape).or_insert(0);
                *n += 1;
                *n
            };
            // Console lines stay under 300 characters.
            let short: String = line.chars().take(240).collect();
            if n == 1 {
                tracing::warn!(target: "ravnest::net", "ravnest: {short}");
            } else if [10, 100, 1000, 10_000].contains(&n) {
                tracing::warn!(target: "ravnest::net", "ravnest: {short} ({n} times so far)");
            }
        }
        self.record(line);
    }

    fn peer_down(&self, peer: NodeId) {
        if self.inner.down.load(Ordering::SeqCst) {
            return;
        }
        let hooks: Vec<PeerDownHook> = self.inner.hooks.lock().unwrap().clone();
        for h in hooks {
            h(peer);
        }
    }

    /// A peer connected to us as `incarnation`. If it is a new one, the peer restarted: our
    /// own connection to it leads to the dead process, where envelopes would vanish; drop it so
    /// the next envelope dials the new one.
    fn saw_incarnation(&self, peer: NodeId, incarnation: u64) {
        let old = self
            .inner
            .incarnations
            .lock()
            .unwrap()
            .insert(peer, incarnation);
        if old.is_some_and(|o| o != incarnation) {
            self.inner.links.lock().unwrap().remove(&peer);
            self.log(format!("node {} restarted: reconnecting", peer.0));
        }
    }

    /// We dialed `peer` and met `incarnation` (our link is to it, so only record it).
    fn saw_incarnation_dialed(&self, peer: NodeId, incarnation: u64) {
        self.inner
            .incarnations
            .lock()
            .unwrap()
            .insert(peer, incarnation);
    }

    fn host(&self, a: Addr) -> Option<NodeId> {
        match a {
            Addr::Coordinator | Addr::Checkpoint => Some(self.coordinator()),
            Addr::Node(n) => (n == self.inner.cfg.me
                || self.inner.dial_addrs.lock().unwrap().contains_key(&n))
            .then_some(n),
        }
    }

    fn deliver(&self, from: Addr, to: Addr, env: Envelope) {
        if self.inner.down.load(Ordering::SeqCst) {
            return;
        }
        if let Envelope::Address { node, addr } = env {
            self.advertised(from, node, &addr);
            return;
        }
        // A node given its place (`run --join`) is reached at the address it asked with: a
        // successor that takes over before the node says it itself can still dial it.
        if let Envelope::Member { id, address, .. } = &env {
            self.advertised(from, *id, address);
        }
        let inbox = {
            let inboxes = self.inner.inboxes.lock().unwrap();
            match inboxes.get(&to) {
                Some(i) => i.clone(),
                None => {
                    // Not registered yet (a peer can be faster than this process's start):
                    // kept for the inbox, in order, instead of lost.
                    let mut early = self.inner.early.lock().unwrap();
                    let q = early.entry(to).or_default();
                    if q.len() < EARLY_MAIL {
                        q.push((from, env));
                    }
                    return;
                }
            }
        };
        if matches!(env, Envelope::Shard { .. }) {
            self.inner.parts_waiting.fetch_add(1, Ordering::SeqCst);
        }
        inbox(from, env);
    }

    /// Wait (at most `PART_WAIT`) while more than `SHARD_PARTS_WAITING` checkpoint parts
    /// wait to be stored here: a reader calls it after delivering one, so that a fast sender
    /// is slowed by TCP's own flow control instead of filling this process's memory.
    pub(crate) async fn parts_settle(&self) {
        let deadline = tokio::time::Instant::now() + PART_WAIT;
        while self.inner.parts_waiting.load(Ordering::SeqCst) > SHARD_PARTS_WAITING {
            let stored = self.inner.part_stored.notified();
            if tokio::time::timeout_at(deadline, stored).await.is_err() {
                return;
            }
        }
    }

    /// Where a peer is dialed now.
    pub fn dial_addr(&self, peer: NodeId) -> Option<SocketAddr> {
        self.inner.dial_addrs.lock().unwrap().get(&peer).copied()
    }

    /// `node` is reached at `addr` (said by the node itself, or passed on by the coordinator's
    /// host): dial it there from now on. The coordinator's host passes what a node says of
    /// itself on to every other peer, and tells it where every other peer is.
    fn advertised(&self, from: Addr, node: NodeId, addr: &str) {
        let cfg = &self.inner.cfg;
        let trusted = from == Addr::Node(node) || from == Addr::Coordinator;
        // A node not in the file (it joined) is known from the address it says for itself, or
        // that the coordinator's host passes on (a node that joined after this one did).
        let known = cfg.peers.contains_key(&node) || trusted;
        if !trusted || node == cfg.me || !known {
            self.log(format!(
                "ignored an address for node {} from {from:?}",
                node.0
            ));
            return;
        }
        let Some(sa) = std::net::ToSocketAddrs::to_socket_addrs(addr)
            .ok()
            .and_then(|mut it| it.next())
        else {
            self.log(format!(
                "node {} advertised `{addr}`, which does not resolve",
                node.0
            ));
            return;
        };
        let old = self.inner.dial_addrs.lock().unwrap().insert(node, sa);
        if let Some(net) = &self.inner.p2p {
            net.learn(node, sa);
        }
        if old != Some(sa) {
            self.log(format!("node {} is reached at {sa}", node.0));
            // A link dialed to the old address leads nowhere: the next envelope dials again.
            self.inner.links.lock().unwrap().remove(&node);
        }
        if from == Addr::Node(node) && self.coordinator() == cfg.me {
            let peers: Vec<(NodeId, SocketAddr)> = self
                .inner
                .dial_addrs
                .lock()
                .unwrap()
                .iter()
                .map(|(&p, &a)| (p, a))
                .collect();
            let tell = |to: NodeId, of: NodeId, a: SocketAddr| {
                let env = Envelope::Address {
                    node: of,
                    addr: a.to_string(),
                };
                let _ = self.send(Addr::Coordinator, Addr::Node(to), env);
            };
            for (p, at) in peers.into_iter().filter(|&(p, _)| p != cfg.me && p != node) {
                tell(p, node, sa);
                // And the other way: a node that joined earlier may be missing from the file
                // this one fetched, or this one from its (two joiners at once).
                tell(node, p, at);
            }
        }
    }

    /// Why `peer` refused our latest handshake with it, if it did (a wrong secret, another
    /// protocol version, an unknown node, a mismatch of encryption).
    pub fn refusal(&self, peer: NodeId) -> Option<HandshakeError> {
        self.inner.refusals.lock().unwrap().get(&peer).cloned()
    }

    /// How joiners are answered from now on (instead of the cluster file as it is).
    pub fn set_sharer(&self, sharer: Sharer) {
        *self.inner.sharer.lock().unwrap() = Some(sharer);
    }

    /// `peer` is gone for good (a lost node, as this process finishes): what is queued for it is
    /// dropped at its writer's next dial attempt and nothing more is sent to it, so that
    /// [`TcpTransport::drain`] does not wait for it.
    pub fn forget(&self, peer: NodeId) {
        self.inner.gone.lock().unwrap().insert(peer);
    }

    /// This process's node.
    pub fn me(&self) -> NodeId {
        self.inner.cfg.me
    }

    /// The node hosting the coordinator now.
    pub fn coordinator(&self) -> NodeId {
        NodeId(self.inner.coordinator.load(Ordering::SeqCst))
    }

    fn now_ms(&self) -> u64 {
        self.inner.started.elapsed().as_millis() as u64
    }
}

impl Transport for TcpTransport {
    fn set_coordinator(&self, host: NodeId) {
        if self.inner.coordinator.swap(host.0, Ordering::SeqCst) != host.0 {
            self.log(format!("the coordinator is hosted by node {} now", host.0));
        }
    }

    fn register(&self, addr: Addr, inbox: Inbox) {
        let mut inboxes = self.inner.inboxes.lock().unwrap();
        let early = self.inner.early.lock().unwrap().remove(&addr);
        for (from, env) in early.unwrap_or_default() {
            inbox(from, env);
        }
        inboxes.insert(addr, inbox);
    }

    fn stored(&self) {
        let _ = self
            .inner
            .parts_waiting
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
        self.inner.part_stored.notify_waiters();
    }

    fn progress(&self, _from: Addr, _to: Addr) -> Option<crate::seams::Progress<'_>> {
        // Acknowledgments and frames leaving the queues tell `settled`; a part stored here
        // tells `part_stored`. Both are armed before the caller reads the count.
        let mut settled = Box::pin(self.inner.settled.notified());
        let mut stored = Box::pin(self.inner.part_stored.notified());
        settled.as_mut().enable();
        stored.as_mut().enable();
        Some(Box::pin(async move {
            tokio::select! {
                _ = settled => {}
                _ = stored => {}
            }
        }))
    }

    fn in_flight(&self, _from: Addr, to: Addr) -> usize {
        let Some(host) = self.host(to) else { return 0 };
        if host == self.inner.cfg.me {
            return match to {
                Addr::Checkpoint => self.inner.parts_waiting.load(Ordering::SeqCst) as usize,
                _ => 0,
            };
        }
        // Frames queued for the host only: a peer being dialed (a lost one) holds its own.
        let queued = self.inner.unsent.to(host) as usize;
        let unacked = self
            .inner
            .sessions
            .lock()
            .unwrap()
            .get(&host)
            .map_or(0, |s| s.unacked.len());
        queued + unacked
    }

    fn send(&self, from: Addr, to: Addr, env: Envelope) -> Result<(), TransportError> {
        if self.inner.down.load(Ordering::SeqCst) {
            return Err(TransportError::SenderDown(from));
        }
        if self.host(from) != Some(self.inner.cfg.me) {
            return Err(TransportError::Unknown(from));
        }
        let host = self.host(to).ok_or(TransportError::Unknown(to))?;
        if self.inner.gone.lock().unwrap().contains(&host) {
            return Ok(());
        }
        if host == self.inner.cfg.me {
            self.deliver(from, to, env);
            return Ok(());
        }
        let mut frame = wire::Frame::new(from, to, env);
        // A link that ends between lookup and send is replaced: its writer has moved what it
        // held into the session, and this frame follows it on the next connection.
        for _ in 0..3 {
            let (generation, tx) = self.link(host);
            // Counted before it is queued, so the writer never takes away what was not added.
            self.inner.unsent.add(host, 1);
            match tx.send(frame) {
                Ok(()) => return Ok(()),
                Err(back) => {
                    self.inner.unsent.sub(host, 1);
                    self.inner.settled.notify_waiters();
                    self.unlink(host, generation);
                    frame = back.0;
                }
            }
        }
        Ok(())
    }
}

//! What a TCP transport holds: its handle, the shared state behind it, each peer's accepted
//! connection and our outgoing session with it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex};

use ravnest_core::NodeId;
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use crate::seams::Inbox;
use crate::wire;
use ravnest_protocol::msg::{Addr, Envelope};

use super::config::*;

/// TCP transport (cheap to clone: a handle).
#[derive(Clone)]
pub struct TcpTransport {
    pub(super) inner: Arc<Inner>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("me", &self.inner.cfg.me)
            .finish()
    }
}

/// An outgoing queue and its generation.
pub(super) type Link = (u64, mpsc::UnboundedSender<wire::Frame>);

pub(super) struct Inner {
    pub(super) cfg: TcpConfig,
    pub(super) local: SocketAddr,
    /// The libp2p side peers are reached through, when not plain TCP.
    pub(super) p2p: Option<crate::p2p::P2pNet>,
    pub(super) inboxes: Mutex<BTreeMap<Addr, Inbox>>,
    /// Envelopes that came for an address before its inbox was registered.
    pub(super) early: Mutex<BTreeMap<Addr, Vec<(Addr, Envelope)>>>,
    /// Outgoing queue per peer, with a generation number (a replaced link does not remove its
    /// successor when it ends).
    pub(super) links: Mutex<BTreeMap<NodeId, Link>>,
    pub(super) next_link: AtomicU64,
    pub(super) hooks: Mutex<Vec<PeerDownHook>>,
    pub(super) tasks: Mutex<Vec<AbortHandle>>,
    pub(super) down: AtomicBool,
    pub(super) bytes_sent: AtomicU64,
    /// Of them, bytes of collective frames (gradient and model synchronization).
    pub(super) sync_bytes_sent: AtomicU64,
    /// Bytes per peer: [sent (frames written), received (frames read)].
    pub(super) peer_bytes: Mutex<BTreeMap<NodeId, [u64; 2]>>,
    /// Connections closed because a record failed authentication.
    pub(super) auth_failures: AtomicU64,
    /// Frames queued on links and not yet written and flushed (or dropped with their link).
    pub(super) unsent: Unsent,
    /// Told whenever frames leave the queues or are acknowledged (what `drain` waits on).
    pub(super) settled: tokio::sync::Notify,
    /// Checkpoint shard parts handed to this process's checkpoint inbox and not yet stored
    /// (what paces their senders: a local writer directly, a remote one through the reader
    /// that waits before reading on).
    pub(super) parts_waiting: AtomicU64,
    /// Told when one of them is stored.
    pub(super) part_stored: tokio::sync::Notify,
    pub(super) log: Mutex<Vec<String>>,
    /// Lines printed so far by shape (digits left out), for printing a repeated one once.
    pub(super) printed: Mutex<BTreeMap<String, u64>>,
    pub(super) verbose: bool,
    /// This process's incarnation (random per start), exchanged in the handshake.
    pub(super) incarnation: u64,
    /// The latest incarnation seen of each peer.
    pub(super) incarnations: Mutex<BTreeMap<NodeId, u64>>,
    /// Per peer, its current accepted connection and what of its session was delivered.
    pub(super) incoming: Mutex<BTreeMap<NodeId, InState>>,
    /// Per peer, our outgoing session: frames written and not yet acknowledged.
    pub(super) sessions: Mutex<BTreeMap<NodeId, Session>>,
    pub(super) next_conn: AtomicU64,
    pub(super) started: std::time::Instant,
    /// Where each peer is dialed: its address in the config, until it advertises another
    /// ([`Envelope::Address`]).
    pub(super) dial_addrs: Mutex<BTreeMap<NodeId, SocketAddr>>,
    /// The node hosting the coordinator now (the config's, until a fail-over moves it).
    pub(super) coordinator: std::sync::atomic::AtomicU32,
    /// What a joiner is handed (`run --join`): the cluster file, kept current as nodes join.
    pub(super) share: Mutex<Option<Arc<str>>>,
    /// How joiners are answered, when the process says (see [`TcpTransport::set_sharer`]).
    pub(super) sharer: Mutex<Option<Sharer>>,
    /// Why each peer that refused our handshake did (its latest refusal).
    pub(super) refusals: Mutex<BTreeMap<NodeId, super::agreed::HandshakeError>>,
    /// Peers forgotten for good (`TcpTransport::forget`): nothing more is sent to them.
    pub(super) gone: Mutex<std::collections::BTreeSet<NodeId>>,
}

/// A peer's current accepted connection.
pub(super) struct InState {
    /// Connection number (a newer connection from the peer replaces it).
    pub(super) conn: u64,
    /// Whether it is still open.
    pub(super) open: bool,
    /// When something last arrived on it (ms since `started`).
    pub(super) last: Arc<AtomicU64>,
    /// The peer's incarnation on it.
    pub(super) incarnation: u64,
    /// Frames delivered so far of the sessions of the peer's latest incarnations (over all
    /// their connections): one that claims the id with another incarnation does not reset the
    /// real one's count.
    pub(super) delivered: Vec<(u64, u64)>,
}

/// Envelopes kept per address not yet registered.
pub(super) const EARLY_MAIL: usize = 4096;

/// Incarnations per peer whose delivered counts are kept.
pub(super) const KEPT_INCARNATIONS: usize = 4;

impl InState {
    pub(super) fn count(&mut self) -> &mut u64 {
        let inc = self.incarnation;
        let i = match self.delivered.iter().position(|&(x, _)| x == inc) {
            Some(i) => i,
            None => {
                if self.delivered.len() >= KEPT_INCARNATIONS {
                    self.delivered.remove(0);
                }
                self.delivered.push((inc, 0));
                self.delivered.len() - 1
            }
        };
        &mut self.delivered[i].1
    }
}

/// Our side of the session with one peer: a peer's process keeps one session with us across
/// connections, so a connection that closes loses nothing: frames are numbered by their place
/// in the session, the peer acknowledges how many it delivered, and a new connection starts
/// with what came after.
#[derive(Default)]
pub(super) struct Session {
    /// The peer's incarnation the session is with.
    pub(super) incarnation: Option<u64>,
    /// Frames the peer acknowledged.
    pub(super) acked: u64,
    /// Frames after those, in order (written or not).
    pub(super) unacked: std::collections::VecDeque<Arc<wire::Frame>>,
    /// Whether a connection carries the session now.
    pub(super) connected: bool,
}

impl Session {
    /// The peer has delivered `n` frames in all.
    pub(super) fn trim(&mut self, n: u64) {
        while self.acked < n && self.unacked.pop_front().is_some() {
            self.acked += 1;
        }
    }
}

/// Frames queued on links and not yet written and flushed (or dropped with their link), in all
/// and per peer: what waits for a peer being dialed (one lost, say) does not pace what goes to
/// another.
#[derive(Debug, Default)]
pub(super) struct Unsent {
    total: AtomicU64,
    per_peer: Mutex<BTreeMap<NodeId, u64>>,
}

impl Unsent {
    /// `n` frames for `peer` were queued.
    pub(super) fn add(&self, peer: NodeId, n: u64) {
        self.total.fetch_add(n, std::sync::atomic::Ordering::SeqCst);
        *self.per_peer.lock().unwrap().entry(peer).or_default() += n;
    }

    /// `n` frames for `peer` left the queue (written, or dropped).
    pub(super) fn sub(&self, peer: NodeId, n: u64) {
        let _ = self.total.fetch_update(
            std::sync::atomic::Ordering::SeqCst,
            std::sync::atomic::Ordering::SeqCst,
            |t| Some(t.saturating_sub(n)),
        );
        let mut per = self.per_peer.lock().unwrap();
        if let Some(q) = per.get_mut(&peer) {
            *q = q.saturating_sub(n);
            if *q == 0 {
                per.remove(&peer);
            }
        }
    }

    /// Frames queued for any peer.
    pub(super) fn total(&self) -> u64 {
        self.total.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Frames queued for `peer`.
    pub(super) fn to(&self, peer: NodeId) -> u64 {
        self.per_peer
            .lock()
            .unwrap()
            .get(&peer)
            .copied()
            .unwrap_or(0)
    }
}

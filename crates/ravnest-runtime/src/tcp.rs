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
//! **Failure**: a connection that closes or sends a bad frame is dropped with a logged reason;
//! the process keeps running, and the peer-down hooks fire (the coordinator feeds them to its
//! failure detector). Envelopes queued for a peer that cannot be reached within the connect
//! window are lost, as on any network; the detector and the coordinator's aborts deal with it.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hmac::{Hmac, Mac};
use ravnest_core::NodeId;
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::AbortHandle;

use crate::msg::{Addr, Envelope};
use crate::seams::{Inbox, Transport, TransportError};
use crate::wire;

/// Wire protocol version; peers with another version are refused.
pub const PROTOCOL_VERSION: u32 = 5;

const MAGIC: &[u8; 4] = b"RVN1";
/// A joiner asking for the cluster file (`ravnest run --join HOST:PORT`).
const CONFIG_MAGIC: &[u8; 4] = b"RVCF";
/// Largest cluster file handed out.
const MAX_CLUSTER_FILE: u32 = 4 << 20;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Handshake status bytes (listener → dialer).
const OK: u8 = 0;
const BAD_VERSION: u8 = 1;
const UNKNOWN_NODE: u8 = 2;
const BAD_SECRET: u8 = 3;
const DUPLICATE: u8 = 4;

/// A connection from a node is live while something arrived on it this recently: a second
/// connection claiming the same node is then refused (it cannot be the node: that one is
/// talking to us). A restarted node's old connection is closed by its kernel at once; a silent
/// one is let go after this long.
pub const LIVE_MS: u64 = 3000;

/// A process's view of the cluster's network.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// This process's node.
    pub me: NodeId,
    /// Every node's address, the one peers dial (this node's included).
    pub peers: BTreeMap<NodeId, SocketAddr>,
    /// Where this node binds, if not its address in `peers` (behind NAT or a proxy).
    pub listen: Option<SocketAddr>,
    /// The node whose process hosts the coordinator and the checkpoint actor.
    pub coordinator: NodeId,
    /// The cluster secret (HMAC key).
    pub secret: Vec<u8>,
    /// Largest frame accepted.
    pub max_frame: u32,
    /// How long a dial is retried before queued envelopes are given up.
    pub connect_window: Duration,
    /// The cluster file this node hands to an authenticated joiner (`--join HOST:PORT`),
    /// if it shares one.
    pub cluster_file: Option<Arc<str>>,
}

/// Called with a peer that could not be reached within the connect window.
pub type PeerDownHook = Arc<dyn Fn(NodeId) + Send + Sync>;

/// TCP transport (cheap to clone: a handle).
#[derive(Clone)]
pub struct TcpTransport {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("me", &self.inner.cfg.me)
            .finish()
    }
}

/// An outgoing queue and its generation.
type Link = (u64, mpsc::UnboundedSender<wire::Frame>);

struct Inner {
    cfg: TcpConfig,
    local: SocketAddr,
    inboxes: Mutex<BTreeMap<Addr, Inbox>>,
    /// Envelopes that came for an address before its inbox was registered.
    early: Mutex<BTreeMap<Addr, Vec<(Addr, Envelope)>>>,
    /// Outgoing queue per peer, with a generation number (a replaced link does not remove its
    /// successor when it ends).
    links: Mutex<BTreeMap<NodeId, Link>>,
    next_link: AtomicU64,
    hooks: Mutex<Vec<PeerDownHook>>,
    tasks: Mutex<Vec<AbortHandle>>,
    down: AtomicBool,
    bytes_sent: AtomicU64,
    /// Frames queued on links and not yet written and flushed (or dropped with their link).
    unsent: AtomicU64,
    /// Told whenever frames leave the queues or are acknowledged (what `drain` waits on).
    settled: tokio::sync::Notify,
    log: Mutex<Vec<String>>,
    /// Lines printed so far by shape (digits left out), for printing a repeated one once.
    printed: Mutex<BTreeMap<String, u64>>,
    verbose: bool,
    /// This process's incarnation (random per start), exchanged in the handshake.
    incarnation: u64,
    /// The latest incarnation seen of each peer.
    incarnations: Mutex<BTreeMap<NodeId, u64>>,
    /// Per peer, its current accepted connection and what of its session was delivered.
    incoming: Mutex<BTreeMap<NodeId, InState>>,
    /// Per peer, our outgoing session: frames written and not yet acknowledged.
    sessions: Mutex<BTreeMap<NodeId, Session>>,
    next_conn: AtomicU64,
    started: std::time::Instant,
    /// Where each peer is dialed: its address in the config, until it advertises another
    /// ([`Envelope::Address`]).
    dial_addrs: Mutex<BTreeMap<NodeId, SocketAddr>>,
}

/// A peer's current accepted connection.
struct InState {
    /// Connection number (a newer connection from the peer replaces it).
    conn: u64,
    /// Whether it is still open.
    open: bool,
    /// When something last arrived on it (ms since `started`).
    last: Arc<AtomicU64>,
    /// The peer's incarnation on it.
    incarnation: u64,
    /// Frames delivered so far of the sessions of the peer's latest incarnations (over all
    /// their connections): one that claims the id with another incarnation does not reset the
    /// real one's count.
    delivered: Vec<(u64, u64)>,
}

/// Envelopes kept per address not yet registered.
const EARLY_MAIL: usize = 4096;

/// Incarnations per peer whose delivered counts are kept.
const KEPT_INCARNATIONS: usize = 4;

impl InState {
    fn count(&mut self) -> &mut u64 {
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
struct Session {
    /// The peer's incarnation the session is with.
    incarnation: Option<u64>,
    /// Frames the peer acknowledged.
    acked: u64,
    /// Frames after those, in order (written or not).
    unacked: std::collections::VecDeque<Arc<wire::Frame>>,
    /// Whether a connection carries the session now.
    connected: bool,
}

impl Session {
    /// The peer has delivered `n` frames in all.
    fn trim(&mut self, n: u64) {
        while self.acked < n && self.unacked.pop_front().is_some() {
            self.acked += 1;
        }
    }
}

type HmacSha256 = Hmac<Sha256>;

/// HMAC-SHA256 keyed by the secret over (role, both nonces, both ids).
fn keyed(secret: &[u8], role: &[u8], a: &[u8; 32], b: &[u8; 32], ids: (u32, u32)) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(role);
    m.update(a);
    m.update(b);
    m.update(&ids.0.to_le_bytes());
    m.update(&ids.1.to_le_bytes());
    m
}

fn mac(secret: &[u8], role: &[u8], a: &[u8; 32], b: &[u8; 32], ids: (u32, u32)) -> [u8; 32] {
    keyed(secret, role, a, b, ids)
        .finalize()
        .into_bytes()
        .into()
}

/// Constant-time check of a peer's tag.
fn verify(
    secret: &[u8],
    role: &[u8],
    a: &[u8; 32],
    b: &[u8; 32],
    ids: (u32, u32),
    tag: &[u8],
) -> bool {
    keyed(secret, role, a, b, ids).verify_slice(tag).is_ok()
}

/// Why a handshake failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HandshakeError {
    /// The other side does not hold the same cluster secret.
    #[error(
        "{0}: wrong cluster secret (check RAVNEST_SECRET or `[cluster] secret` on both sides; or another cluster owns that port)"
    )]
    Secret(String),
    /// Protocol versions differ.
    #[error("{peer}: protocol version {theirs}, this node speaks {ours}")]
    Version {
        /// Who.
        peer: String,
        /// Their version.
        theirs: u32,
        /// Ours.
        ours: u32,
    },
    /// The peer is not a node of this cluster.
    #[error("{0}: not a node of this cluster")]
    Unknown(String),
    /// A connection from that node is already open and live.
    #[error("{0}: that node is already connected (a second connection claiming it is refused)")]
    Duplicate(String),
    /// Not a ravnest peer, or the connection failed.
    #[error("{0}")]
    Io(String),
}

async fn timed<T>(
    f: impl std::future::Future<Output = std::io::Result<T>>,
    who: &str,
) -> Result<T, HandshakeError> {
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(HandshakeError::Io(format!("{who}: {e}"))),
        Err(_) => Err(HandshakeError::Io(format!("{who}: handshake timed out"))),
    }
}

fn nonce() -> [u8; 32] {
    rand::random()
}

/// Send a dialer's hello (magic, our version, an id, a fresh nonce) and read the listener's
/// first status byte; a version refusal comes back as the error naming both versions.
async fn hello(
    s: &mut TcpStream,
    magic: &[u8; 4],
    id: u32,
    who: &str,
) -> Result<([u8; 32], u8), HandshakeError> {
    let nc = nonce();
    let mut hello = Vec::with_capacity(44);
    hello.extend_from_slice(magic);
    hello.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    hello.extend_from_slice(&id.to_le_bytes());
    hello.extend_from_slice(&nc);
    timed(s.write_all(&hello), who).await?;
    let mut status = [0u8; 1];
    timed(s.read_exact(&mut status), who).await?;
    if status[0] == BAD_VERSION {
        let mut v = [0u8; 4];
        timed(s.read_exact(&mut v), who).await?;
        return Err(HandshakeError::Version {
            peer: who.to_string(),
            theirs: u32::from_le_bytes(v),
            ours: PROTOCOL_VERSION,
        });
    }
    Ok((nc, status[0]))
}

/// The dialer's side. Returns, once the listener has accepted us, its incarnation and how many
/// frames of our session with it it has delivered.
async fn handshake_dial(
    s: &mut TcpStream,
    cfg: &TcpConfig,
    peer: NodeId,
    incarnation: u64,
) -> Result<(u64, u64), HandshakeError> {
    let who = match s.peer_addr() {
        Ok(a) => format!("node {} at {a}", peer.0),
        Err(_) => format!("node {}", peer.0),
    };
    let (nc, status) = hello(s, MAGIC, cfg.me.0, &who).await?;
    match status {
        OK => {}
        UNKNOWN_NODE => {
            return Err(HandshakeError::Unknown(format!(
                "{who} does not know node {}",
                cfg.me.0
            )));
        }
        _ => return Err(HandshakeError::Io(format!("{who}: not a ravnest peer"))),
    }
    let mut rest = [0u8; 4 + 32 + 32];
    timed(s.read_exact(&mut rest), &who).await?;
    let server_id = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
    let ns: [u8; 32] = rest[4..36].try_into().expect("32 bytes");
    if server_id != peer.0 {
        return Err(HandshakeError::Unknown(format!(
            "{who} answered as node {server_id}"
        )));
    }
    let ids = (cfg.me.0, server_id);
    if !verify(&cfg.secret, b"ravnest-listener", &nc, &ns, ids, &rest[36..]) {
        // Tell the listener too, so both sides log the reason.
        let _ = s.write_all(&[0u8; 40]).await;
        return Err(HandshakeError::Secret(who));
    }
    let mut answer = mac(&cfg.secret, b"ravnest-dialer", &ns, &nc, ids).to_vec();
    answer.extend_from_slice(&incarnation.to_le_bytes());
    timed(s.write_all(&answer), &who).await?;
    let mut status = [0u8; 1];
    timed(s.read_exact(&mut status), &who).await?;
    match status[0] {
        OK => {
            let mut theirs = [0u8; 16];
            timed(s.read_exact(&mut theirs), &who).await?;
            Ok((
                u64::from_le_bytes(theirs[..8].try_into().expect("8 bytes")),
                u64::from_le_bytes(theirs[8..].try_into().expect("8 bytes")),
            ))
        }
        BAD_SECRET => Err(HandshakeError::Secret(who)),
        DUPLICATE => Err(HandshakeError::Duplicate(who)),
        _ => Err(HandshakeError::Io(format!("{who}: not a ravnest peer"))),
    }
}

/// What an accepted connection turned out to be.
enum Accepted {
    /// An authenticated peer node, its incarnation, and the connection's number.
    Node(NodeId, u64, u64),
    /// A joiner that was handed the cluster file (the connection is done).
    ClusterFileSent,
}

/// The listener's side. Returns the authenticated peer; `admit` says whether an
/// authenticated node may connect now (not while its live connection is open).
async fn handshake_accept(
    s: &mut TcpStream,
    cfg: &TcpConfig,
    remote: SocketAddr,
    incarnation: u64,
    admit: impl Fn(NodeId, u64) -> Option<(u64, u64)>,
) -> Result<Accepted, HandshakeError> {
    let who = format!("connection from {remote}");
    let mut hello = [0u8; 44];
    timed(s.read_exact(&mut hello), &who).await?;
    if &hello[..4] == CONFIG_MAGIC {
        let version = u32::from_le_bytes(hello[4..8].try_into().expect("4 bytes"));
        let nc: [u8; 32] = hello[12..44].try_into().expect("32 bytes");
        let who = format!("joiner at {remote}");
        send_cluster_file(s, cfg, version, nc, &who).await?;
        return Ok(Accepted::ClusterFileSent);
    }
    if &hello[..4] != MAGIC {
        return Err(HandshakeError::Io(format!("{who}: not a ravnest peer")));
    }
    let version = u32::from_le_bytes(hello[4..8].try_into().expect("4 bytes"));
    let id = u32::from_le_bytes(hello[8..12].try_into().expect("4 bytes"));
    let nc: [u8; 32] = hello[12..44].try_into().expect("32 bytes");
    let who = format!("{who} claiming node {id}");
    if version != PROTOCOL_VERSION {
        let mut m = vec![BAD_VERSION];
        m.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        let _ = s.write_all(&m).await;
        return Err(HandshakeError::Version {
            peer: who,
            theirs: version,
            ours: PROTOCOL_VERSION,
        });
    }
    if !cfg.peers.contains_key(&NodeId(id)) || id == cfg.me.0 {
        let _ = s.write_all(&[UNKNOWN_NODE]).await;
        return Err(HandshakeError::Unknown(who));
    }
    let ns = nonce();
    let ids = (id, cfg.me.0);
    let mut challenge = vec![OK];
    challenge.extend_from_slice(&cfg.me.0.to_le_bytes());
    challenge.extend_from_slice(&ns);
    challenge.extend_from_slice(&mac(&cfg.secret, b"ravnest-listener", &nc, &ns, ids));
    timed(s.write_all(&challenge), &who).await?;
    let mut answer = [0u8; 32 + 8];
    timed(s.read_exact(&mut answer), &who).await?;
    if !verify(&cfg.secret, b"ravnest-dialer", &ns, &nc, ids, &answer[..32]) {
        let _ = s.write_all(&[BAD_SECRET]).await;
        return Err(HandshakeError::Secret(who));
    }
    let theirs = u64::from_le_bytes(answer[32..].try_into().expect("8 bytes"));
    let Some((conn, delivered)) = admit(NodeId(id), theirs) else {
        let _ = s.write_all(&[DUPLICATE]).await;
        return Err(HandshakeError::Duplicate(who));
    };
    // OK, our incarnation, and how many frames of this dialer's session we have delivered
    // (it sends again what came after).
    let mut ok = vec![OK];
    ok.extend_from_slice(&incarnation.to_le_bytes());
    ok.extend_from_slice(&delivered.to_le_bytes());
    timed(s.write_all(&ok), &who).await?;
    Ok(Accepted::Node(NodeId(id), theirs, conn))
}

/// MAC over the cluster file, bound to both nonces.
fn file_mac(secret: &[u8], a: &[u8; 32], b: &[u8; 32], doc: &[u8]) -> HmacSha256 {
    let mut m = keyed(secret, b"ravnest-cluster-file", a, b, (0, 0));
    m.update(doc);
    m
}

/// The listener's side of `--join HOST:PORT`: prove we hold the secret, check that the
/// joiner does, then send the cluster file with a MAC over it.
async fn send_cluster_file(
    s: &mut TcpStream,
    cfg: &TcpConfig,
    version: u32,
    nc: [u8; 32],
    who: &str,
) -> Result<(), HandshakeError> {
    if version != PROTOCOL_VERSION {
        let mut m = vec![BAD_VERSION];
        m.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        let _ = s.write_all(&m).await;
        return Err(HandshakeError::Version {
            peer: who.to_string(),
            theirs: version,
            ours: PROTOCOL_VERSION,
        });
    }
    let Some(doc) = cfg.cluster_file.clone() else {
        let _ = s.write_all(&[UNKNOWN_NODE]).await;
        return Err(HandshakeError::Unknown(format!(
            "{who} asked for the cluster file, which this node does not share"
        )));
    };
    let ns = nonce();
    let mut challenge = vec![OK];
    challenge.extend_from_slice(&ns);
    challenge.extend_from_slice(&mac(&cfg.secret, b"ravnest-file-server", &nc, &ns, (0, 0)));
    timed(s.write_all(&challenge), who).await?;
    let mut answer = [0u8; 32];
    timed(s.read_exact(&mut answer), who).await?;
    if !verify(
        &cfg.secret,
        b"ravnest-file-joiner",
        &ns,
        &nc,
        (0, 0),
        &answer,
    ) {
        let _ = s.write_all(&[BAD_SECRET]).await;
        return Err(HandshakeError::Secret(who.to_string()));
    }
    let mut reply = vec![OK];
    reply.extend_from_slice(&(doc.len() as u32).to_le_bytes());
    reply.extend_from_slice(doc.as_bytes());
    reply.extend_from_slice(
        &file_mac(&cfg.secret, &nc, &ns, doc.as_bytes())
            .finalize()
            .into_bytes(),
    );
    timed(s.write_all(&reply), who).await?;
    Ok(())
}

/// `ravnest run --join HOST:PORT`: fetch the cluster file from a running node, both sides
/// proving they hold `secret` (HMAC over fresh nonces, as between nodes) and the file
/// arriving under a MAC.
pub async fn fetch_cluster_file(addr: SocketAddr, secret: &[u8]) -> Result<String, HandshakeError> {
    let who = format!("node at {addr}");
    let mut s = timed(TcpStream::connect(addr), &who).await?;
    let (nc, status) = hello(&mut s, CONFIG_MAGIC, 0, &who).await?;
    match status {
        OK => {}
        UNKNOWN_NODE => {
            return Err(HandshakeError::Unknown(format!(
                "{who} does not share its cluster file"
            )));
        }
        _ => return Err(HandshakeError::Io(format!("{who}: not a ravnest node"))),
    }
    let mut rest = [0u8; 64];
    timed(s.read_exact(&mut rest), &who).await?;
    let ns: [u8; 32] = rest[..32].try_into().expect("32 bytes");
    if !verify(
        secret,
        b"ravnest-file-server",
        &nc,
        &ns,
        (0, 0),
        &rest[32..],
    ) {
        let _ = s.write_all(&[0u8; 32]).await;
        return Err(HandshakeError::Secret(who));
    }
    timed(
        s.write_all(&mac(secret, b"ravnest-file-joiner", &ns, &nc, (0, 0))),
        &who,
    )
    .await?;
    let mut status = [0u8; 1];
    timed(s.read_exact(&mut status), &who).await?;
    match status[0] {
        OK => {}
        BAD_SECRET => return Err(HandshakeError::Secret(who)),
        _ => return Err(HandshakeError::Io(format!("{who}: not a ravnest node"))),
    }
    let mut len = [0u8; 4];
    timed(s.read_exact(&mut len), &who).await?;
    let len = u32::from_le_bytes(len);
    if len > MAX_CLUSTER_FILE {
        return Err(HandshakeError::Io(format!(
            "{who}: a cluster file of {len} bytes (at most {MAX_CLUSTER_FILE})"
        )));
    }
    let mut doc = vec![0u8; len as usize];
    timed(s.read_exact(&mut doc), &who).await?;
    let mut tag = [0u8; 32];
    timed(s.read_exact(&mut tag), &who).await?;
    if file_mac(secret, &nc, &ns, &doc).verify_slice(&tag).is_err() {
        return Err(HandshakeError::Io(format!(
            "{who}: the cluster file arrived altered"
        )));
    }
    String::from_utf8(doc)
        .map_err(|_| HandshakeError::Io(format!("{who}: the cluster file is not UTF-8")))
}

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
        let local = listener.local_addr()?;
        let t = TcpTransport {
            inner: Arc::new(Inner {
                local,
                inboxes: Mutex::default(),
                early: Mutex::default(),
                links: Mutex::default(),
                next_link: AtomicU64::new(0),
                hooks: Mutex::default(),
                tasks: Mutex::default(),
                down: AtomicBool::new(false),
                bytes_sent: AtomicU64::new(0),
                unsent: AtomicU64::new(0),
                settled: tokio::sync::Notify::new(),
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
                cfg,
            }),
        };
        let me = t.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, remote)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let me2 = me.clone();
                let h = tokio::spawn(async move { me2.serve(stream, remote).await });
                me.inner.tasks.lock().unwrap().push(h.abort_handle());
            }
        });
        t.inner.tasks.lock().unwrap().push(task.abort_handle());
        Ok(t)
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

    /// Wait until every queued frame has been written and every peer we are connected to has
    /// acknowledged what we sent it (frames for an unreachable peer are not waited for), at
    /// most `limit`. Returns whether everything went out. A process that is about to
    /// exit calls this so its last words (`Finish`) are not lost with it.
    pub async fn drain(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        let pending = || {
            self.inner.unsent.load(Ordering::SeqCst) > 0
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
            Addr::Coordinator | Addr::Checkpoint => Some(self.inner.cfg.coordinator),
            Addr::Node(n) => self.inner.cfg.peers.contains_key(&n).then_some(n),
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
        inbox(from, env);
    }

    /// Where a peer is dialed now.
    pub fn dial_addr(&self, peer: NodeId) -> Option<SocketAddr> {
        self.inner.dial_addrs.lock().unwrap().get(&peer).copied()
    }

    /// `node` is reached at `addr` (said by the node itself, or passed on by the coordinator's
    /// host): dial it there from now on. The coordinator's host passes what a node says of
    /// itself on to every other peer.
    fn advertised(&self, from: Addr, node: NodeId, addr: &str) {
        let cfg = &self.inner.cfg;
        let trusted = from == Addr::Node(node) || from == Addr::Coordinator;
        if !trusted || node == cfg.me || !cfg.peers.contains_key(&node) {
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
        if old != Some(sa) {
            self.log(format!("node {} is reached at {sa}", node.0));
            // A link dialed to the old address leads nowhere: the next envelope dials again.
            self.inner.links.lock().unwrap().remove(&node);
        }
        if from == Addr::Node(node) && cfg.coordinator == cfg.me {
            for &p in cfg.peers.keys() {
                if p != cfg.me && p != node {
                    let _ = self.send(
                        Addr::Coordinator,
                        Addr::Node(p),
                        Envelope::Address {
                            node,
                            addr: sa.to_string(),
                        },
                    );
                }
            }
        }
    }

    fn now_ms(&self) -> u64 {
        self.inner.started.elapsed().as_millis() as u64
    }

    /// Whether an authenticated `peer` (as `incarnation`) may connect now: not while a live
    /// connection from it is open (a second one claiming it is not the node that is talking to
    /// us). If admitted, its connection becomes the current one; returns the connection's
    /// number and how many frames of that incarnation's session were already delivered.
    fn admit(&self, peer: NodeId, incarnation: u64) -> Option<(u64, u64)> {
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

    /// An accepted connection: authenticate, then read frames until it ends, acknowledging
    /// what was delivered. Its end is not a peer's death (the failure detector decides that on
    /// heartbeats): the peer dials again and sends what we had not delivered.
    async fn serve(&self, mut stream: TcpStream, remote: SocketAddr) {
        let accepted = handshake_accept(
            &mut stream,
            &self.inner.cfg,
            remote,
            self.inner.incarnation,
            |p, inc| self.admit(p, inc),
        )
        .await;
        let (peer, conn) = match accepted {
            Ok(Accepted::Node(p, incarnation, conn)) => {
                self.saw_incarnation(p, incarnation);
                (p, conn)
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
        let (read, mut write) = stream.into_split();
        let mut read = BufReader::with_capacity(1 << 16, read);
        let reason = loop {
            match wire::read_envelope(&mut read, self.inner.cfg.max_frame).await {
                Ok(None) => break None,
                Err(e) => break Some(e.to_string()),
                Ok(Some((from, to, env))) => {
                    last.store(self.now_ms(), Ordering::Relaxed);
                    // The header must not lie about who sent it or where it goes.
                    if self.host(from) != Some(peer) {
                        break Some(format!("claimed to send as {from:?}"));
                    }
                    if self.host(to) != Some(self.inner.cfg.me) {
                        break Some(format!("sent to {to:?}, which is not here"));
                    }
                    // Count it, unless a newer connection from the peer took over.
                    let delivered = {
                        let mut incoming = self.inner.incoming.lock().unwrap();
                        match incoming.get_mut(&peer) {
                            Some(s) if s.conn == conn => {
                                *s.count() += 1;
                                *s.count()
                            }
                            _ => break Some("replaced by a newer connection".into()),
                        }
                    };
                    self.deliver(from, to, env);
                    // Acknowledge once what has arrived so far is delivered.
                    if read.buffer().is_empty()
                        && write.write_all(&delivered.to_le_bytes()).await.is_err()
                    {
                        break None;
                    }
                }
            }
        };
        if let Some(r) = reason {
            self.log(format!("dropped the connection from node {}: {r}", peer.0));
        }
        if let Some(s) = self.inner.incoming.lock().unwrap().get_mut(&peer)
            && s.conn == conn
        {
            s.open = false;
        }
    }

    fn link(&self, peer: NodeId) -> Link {
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

    fn unlink(&self, peer: NodeId, generation: u64) {
        let mut links = self.inner.links.lock().unwrap();
        if links.get(&peer).is_some_and(|l| l.0 == generation) {
            links.remove(&peer);
        }
    }

    /// Connect and authenticate to `peer`; its incarnation and how many frames of our session
    /// it has delivered.
    async fn dial(&self, peer: NodeId) -> Option<(TcpStream, u64, u64)> {
        let deadline = tokio::time::Instant::now() + self.inner.cfg.connect_window;
        let mut backoff = Duration::from_millis(20);
        loop {
            let addr = self.dial_addr(peer)?;
            match TcpStream::connect(addr).await {
                Ok(mut s) => {
                    let _ = s.set_nodelay(true);
                    match handshake_dial(&mut s, &self.inner.cfg, peer, self.inner.incarnation)
                        .await
                    {
                        Ok((incarnation, delivered)) => {
                            self.saw_incarnation_dialed(peer, incarnation);
                            return Some((s, incarnation, delivered));
                        }
                        Err(
                            e @ (HandshakeError::Secret(_)
                            | HandshakeError::Version { .. }
                            | HandshakeError::Unknown(_)),
                        ) => {
                            self.log(format!("refused by {e}"));
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

    /// Start (or resume) our session with `peer` on a new connection: frames it delivered are
    /// done; the rest are to be written again, in order. A restarted peer (another
    /// incarnation) starts a new session: what was meant for the old process is dropped.
    fn resume_session(
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

    async fn write_loop(
        &self,
        peer: NodeId,
        generation: u64,
        mut rx: mpsc::UnboundedReceiver<wire::Frame>,
    ) {
        let Some((stream, incarnation, delivered)) = self.dial(peer).await else {
            return self.give_up(peer, generation, rx);
        };
        let again = self.resume_session(peer, incarnation, delivered);
        let (read, write) = stream.into_split();
        let mut read = BufReader::with_capacity(64, read);
        let mut w = BufWriter::with_capacity(1 << 16, write);
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
        while !failed {
            // The listener writes only acknowledgements on this connection: the count of our
            // frames it has delivered. Its end means the connection closed.
            let frame = tokio::select! {
                biased;
                r = read.read_exact(&mut ack) => {
                    if r.is_err() {
                        break;
                    }
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
                next = if failed { None } else { rx.try_recv().ok() };
            }
            failed = failed || w.flush().await.is_err();
            self.inner.unsent.fetch_sub(taken, Ordering::SeqCst);
            self.inner.settled.notify_waiters();
        }
        self.closed(peer, generation, rx).await;
    }

    /// `peer` was unreachable for the whole connect window: what was queued for it is lost,
    /// and it is reported down.
    fn give_up(&self, peer: NodeId, generation: u64, mut rx: mpsc::UnboundedReceiver<wire::Frame>) {
        self.unlink(peer, generation);
        rx.close();
        self.forget_queued(&mut rx);
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
    async fn closed(
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
                self.inner.unsent.fetch_sub(1, Ordering::SeqCst);
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
}

impl TcpTransport {
    /// Frames left in a closed link's queue are lost with it.
    fn forget_queued(&self, rx: &mut mpsc::UnboundedReceiver<wire::Frame>) {
        while rx.try_recv().is_ok() {
            self.inner.unsent.fetch_sub(1, Ordering::SeqCst);
        }
        self.inner.settled.notify_waiters();
    }
}

impl Transport for TcpTransport {
    fn register(&self, addr: Addr, inbox: Inbox) {
        let mut inboxes = self.inner.inboxes.lock().unwrap();
        let early = self.inner.early.lock().unwrap().remove(&addr);
        for (from, env) in early.unwrap_or_default() {
            inbox(from, env);
        }
        inboxes.insert(addr, inbox);
    }

    fn send(&self, from: Addr, to: Addr, env: Envelope) -> Result<(), TransportError> {
        if self.inner.down.load(Ordering::SeqCst) {
            return Err(TransportError::SenderDown(from));
        }
        if self.host(from) != Some(self.inner.cfg.me) {
            return Err(TransportError::Unknown(from));
        }
        let host = self.host(to).ok_or(TransportError::Unknown(to))?;
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
            self.inner.unsent.fetch_add(1, Ordering::SeqCst);
            match tx.send(frame) {
                Ok(()) => return Ok(()),
                Err(back) => {
                    self.inner.unsent.fetch_sub(1, Ordering::SeqCst);
                    self.inner.settled.notify_waiters();
                    self.unlink(host, generation);
                    frame = back.0;
                }
            }
        }
        Ok(())
    }
}

/// Several TCP transports in one process (one per node, on loopback), seen as one transport:
/// for the conformance suite and tests. `send` goes out through the sender's own transport.
#[derive(Debug, Clone)]
pub struct LoopbackCluster {
    /// One transport per node.
    pub nodes: BTreeMap<NodeId, TcpTransport>,
}

impl LoopbackCluster {
    /// Start `n` nodes on free loopback ports; node 0 hosts the coordinator.
    pub async fn start(n: u32, secret: &[u8]) -> std::io::Result<LoopbackCluster> {
        let mut peers = BTreeMap::new();
        for i in 0..n {
            // Reserve a free port by binding and releasing it.
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            peers.insert(NodeId(i), l.local_addr()?);
        }
        let mut nodes = BTreeMap::new();
        for i in 0..n {
            let cfg = TcpConfig {
                me: NodeId(i),
                peers: peers.clone(),
                listen: None,
                coordinator: NodeId(0),
                secret: secret.to_vec(),
                max_frame: wire::MAX_FRAME,
                connect_window: Duration::from_secs(2),
                cluster_file: None,
            };
            nodes.insert(NodeId(i), TcpTransport::bind(cfg, false).await?);
        }
        Ok(LoopbackCluster { nodes })
    }

    fn host(&self, a: Addr) -> Option<&TcpTransport> {
        match a {
            Addr::Coordinator | Addr::Checkpoint => self.nodes.get(&NodeId(0)),
            Addr::Node(n) => self.nodes.get(&n),
        }
    }
}

impl Transport for LoopbackCluster {
    fn register(&self, addr: Addr, inbox: Inbox) {
        if let Some(t) = self.host(addr) {
            t.register(addr, inbox);
        }
    }

    fn send(&self, from: Addr, to: Addr, env: Envelope) -> Result<(), TransportError> {
        self.host(from)
            .ok_or(TransportError::Unknown(from))?
            .send(from, to, env)
    }
}

impl crate::conformance::TestNet for LoopbackCluster {
    fn crash_node(&self, node: NodeId) {
        if let Some(t) = self.nodes.get(&node) {
            t.shutdown();
        }
    }
}

/// Dial the node `listener` at `addr` claiming to be node `claim`, as any holder of the cluster
/// `secret` can, and return the authenticated connection (or why it was refused). The chaos
/// suite's forged peer: what it then writes must never disturb the real node `claim`.
pub async fn dial_as(
    addr: SocketAddr,
    listener: NodeId,
    claim: NodeId,
    secret: &[u8],
) -> Result<TcpStream, HandshakeError> {
    let cfg = TcpConfig {
        me: claim,
        peers: BTreeMap::from([(listener, addr)]),
        listen: None,
        coordinator: listener,
        secret: secret.to_vec(),
        max_frame: wire::MAX_FRAME,
        connect_window: Duration::ZERO,
        cluster_file: None,
    };
    let who = format!("node {} at {addr}", listener.0);
    let mut s = timed(TcpStream::connect(addr), &who).await?;
    handshake_dial(&mut s, &cfg, listener, rand::random()).await?;
    Ok(s)
}

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
pub const PROTOCOL_VERSION: u32 = 3;

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

/// A process's view of the cluster's network.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// This process's node.
    pub me: NodeId,
    /// Every node's listening address (this node's included).
    pub peers: BTreeMap<NodeId, SocketAddr>,
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

/// Called with the peer whose connection was lost.
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
    log: Mutex<Vec<String>>,
    verbose: bool,
    /// This process's incarnation (random per start), exchanged in the handshake.
    incarnation: u64,
    /// The latest incarnation seen of each peer.
    incarnations: Mutex<BTreeMap<NodeId, u64>>,
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
    #[error("{0}: wrong cluster secret (the two sides' secrets differ)")]
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

/// The dialer's side. Returns when the listener has accepted us.
async fn handshake_dial(
    s: &mut TcpStream,
    cfg: &TcpConfig,
    peer: NodeId,
    incarnation: u64,
) -> Result<u64, HandshakeError> {
    let who = format!("node {} at {}", peer.0, cfg.peers[&peer]);
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
            let mut theirs = [0u8; 8];
            timed(s.read_exact(&mut theirs), &who).await?;
            Ok(u64::from_le_bytes(theirs))
        }
        BAD_SECRET => Err(HandshakeError::Secret(who)),
        _ => Err(HandshakeError::Io(format!("{who}: not a ravnest peer"))),
    }
}

/// What an accepted connection turned out to be.
enum Accepted {
    /// An authenticated peer node and its incarnation.
    Node(NodeId, u64),
    /// A joiner that was handed the cluster file (the connection is done).
    ClusterFileSent,
}

/// The listener's side. Returns the authenticated peer.
async fn handshake_accept(
    s: &mut TcpStream,
    cfg: &TcpConfig,
    remote: SocketAddr,
    incarnation: u64,
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
    let mut ok = vec![OK];
    ok.extend_from_slice(&incarnation.to_le_bytes());
    timed(s.write_all(&ok), &who).await?;
    let theirs = u64::from_le_bytes(answer[32..].try_into().expect("8 bytes"));
    Ok(Accepted::Node(NodeId(id), theirs))
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
        let addr = *cfg.peers.get(&cfg.me).ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("node {} has no address", cfg.me.0),
            )
        })?;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| std::io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}")))?;
        let local = listener.local_addr()?;
        let t = TcpTransport {
            inner: Arc::new(Inner {
                cfg,
                local,
                inboxes: Mutex::default(),
                links: Mutex::default(),
                next_link: AtomicU64::new(0),
                hooks: Mutex::default(),
                tasks: Mutex::default(),
                down: AtomicBool::new(false),
                bytes_sent: AtomicU64::new(0),
                unsent: AtomicU64::new(0),
                log: Mutex::default(),
                verbose,
                incarnation: rand::random(),
                incarnations: Mutex::default(),
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

    /// Call `hook` whenever a connection to or from a peer is lost.
    pub fn on_peer_down(&self, hook: PeerDownHook) {
        self.inner.hooks.lock().unwrap().push(hook);
    }

    /// Bytes written to sockets so far (frames, with headers).
    pub fn bytes_sent(&self) -> u64 {
        self.inner.bytes_sent.load(Ordering::Relaxed)
    }

    /// Wait until every queued frame has been written to its socket (or dropped with a lost
    /// link), at most `limit`. Returns whether everything went out. A process that is about to
    /// exit calls this so its last words (`Finish`) are not lost with it.
    pub async fn drain(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        while self.inner.unsent.load(Ordering::SeqCst) > 0 {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        true
    }

    /// What the transport logged (refused handshakes, dropped connections).
    pub fn log_lines(&self) -> Vec<String> {
        self.inner.log.lock().unwrap().clone()
    }

    /// Stop: no more sending or receiving; connections close (peers see them go down).
    pub fn shutdown(&self) {
        self.inner.down.store(true, Ordering::SeqCst);
        self.inner.links.lock().unwrap().clear();
        for t in self.inner.tasks.lock().unwrap().drain(..) {
            t.abort();
        }
    }

    fn log(&self, line: String) {
        let line = format!("node {}: {line}", self.inner.cfg.me.0);
        if self.inner.verbose {
            eprintln!("ravnest: {line}");
        }
        self.inner.log.lock().unwrap().push(line);
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
        let inbox = self.inner.inboxes.lock().unwrap().get(&to).cloned();
        if let Some(inbox) = inbox {
            inbox(from, env);
        }
    }

    /// An accepted connection: authenticate, then read frames until it ends.
    async fn serve(&self, mut stream: TcpStream, remote: SocketAddr) {
        let peer =
            match handshake_accept(&mut stream, &self.inner.cfg, remote, self.inner.incarnation)
                .await
            {
                Ok(Accepted::Node(p, incarnation)) => {
                    self.saw_incarnation(p, incarnation);
                    p
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
        let mut stream = BufReader::with_capacity(1 << 16, stream);
        let reason = loop {
            match wire::read_envelope(&mut stream, self.inner.cfg.max_frame).await {
                Ok(None) => break None,
                Err(e) => break Some(e.to_string()),
                Ok(Some((from, to, env))) => {
                    // The header must not lie about who sent it or where it goes.
                    if self.host(from) != Some(peer) {
                        break Some(format!("claimed to send as {from:?}"));
                    }
                    if self.host(to) != Some(self.inner.cfg.me) {
                        break Some(format!("sent to {to:?}, which is not here"));
                    }
                    self.deliver(from, to, env);
                }
            }
        };
        if let Some(r) = reason {
            self.log(format!("dropped the connection from node {}: {r}", peer.0));
        }
        // The peer's process is gone or restarting: our connection to it is stale too. Drop it,
        // so the next envelope dials afresh instead of vanishing into a dead socket.
        self.inner.links.lock().unwrap().remove(&peer);
        self.peer_down(peer);
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

    async fn dial(&self, peer: NodeId) -> Option<TcpStream> {
        let addr = self.inner.cfg.peers[&peer];
        let deadline = tokio::time::Instant::now() + self.inner.cfg.connect_window;
        let mut backoff = Duration::from_millis(20);
        loop {
            match TcpStream::connect(addr).await {
                Ok(mut s) => {
                    let _ = s.set_nodelay(true);
                    match handshake_dial(&mut s, &self.inner.cfg, peer, self.inner.incarnation)
                        .await
                    {
                        Ok(incarnation) => {
                            self.saw_incarnation_dialed(peer, incarnation);
                            return Some(s);
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
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(500));
        }
    }

    async fn write_loop(
        &self,
        peer: NodeId,
        generation: u64,
        mut rx: mpsc::UnboundedReceiver<wire::Frame>,
    ) {
        let Some(stream) = self.dial(peer).await else {
            self.unlink(peer, generation);
            rx.close();
            self.forget_queued(&mut rx);
            self.peer_down(peer);
            return;
        };
        let (mut read, write) = stream.into_split();
        let mut w = BufWriter::with_capacity(1 << 16, write);
        let mut probe = [0u8; 1];
        loop {
            // The listener never writes on this connection after the handshake: a readable
            // end means the peer's process closed it (killed, or gone), and we know at once
            // instead of losing the next envelopes into a dead socket.
            let frame = tokio::select! {
                biased;
                _ = read.read(&mut probe) => break,
                f = rx.recv() => match f {
                    Some(f) => f,
                    None => break,
                },
            };
            let mut next = Some(frame);
            let mut failed = false;
            let mut taken = 0;
            // Write what is queued, then flush once.
            while let Some(f) = next {
                taken += 1;
                if w.write_all(&f.head).await.is_err()
                    || w.write_all(f.payload_bytes()).await.is_err()
                {
                    failed = true;
                    break;
                }
                self.inner
                    .bytes_sent
                    .fetch_add(f.len() as u64, Ordering::Relaxed);
                next = rx.try_recv().ok();
            }
            let flushed = !failed && w.flush().await.is_ok();
            self.inner.unsent.fetch_sub(taken, Ordering::SeqCst);
            if !flushed {
                break;
            }
        }
        // Closed by us (shutdown, or the link was replaced) is not a loss.
        let lost = !rx.is_closed();
        rx.close();
        self.forget_queued(&mut rx);
        self.unlink(peer, generation);
        if lost {
            self.log(format!("lost the connection to node {}", peer.0));
            self.peer_down(peer);
        }
    }
}

impl TcpTransport {
    /// Frames left in a closed link's queue are lost with it.
    fn forget_queued(&self, rx: &mut mpsc::UnboundedReceiver<wire::Frame>) {
        while rx.try_recv().is_ok() {
            self.inner.unsent.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

impl Transport for TcpTransport {
    fn register(&self, addr: Addr, inbox: Inbox) {
        self.inner.inboxes.lock().unwrap().insert(addr, inbox);
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
        let frame = wire::Frame::new(from, to, env);
        let (generation, tx) = self.link(host);
        // Counted before it is queued, so the writer never takes away what was not added.
        self.inner.unsent.fetch_add(1, Ordering::SeqCst);
        if tx.send(frame).is_err() {
            self.inner.unsent.fetch_sub(1, Ordering::SeqCst);
            // The link ended between lookup and send: the envelope is lost, as on a network.
            self.unlink(host, generation);
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

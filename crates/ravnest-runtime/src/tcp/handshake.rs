//! The handshake on a fresh connection (mutual HMAC proof of the cluster secret, versions,
//! incarnations, the session's delivered count, whether the channel is encrypted), the cluster
//! file handed to a joiner, and `dial_as`, the chaos suite's forged peer.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use hmac::Mac;
use ravnest_core::NodeId;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::conn::{Conn, Io};

use crate::wire;

use super::PROTOCOL_VERSION;
use super::agreed::{HandshakeError, HmacSha256, Transcript};
use super::channel::{Channel, RECORD_SPAN, establish, split};
use super::config::*;

/// HMAC-SHA256 keyed by the secret over (role, both nonces, both ids).
pub(super) fn keyed(
    secret: &[u8],
    role: &[u8],
    a: &[u8; 32],
    b: &[u8; 32],
    ids: (u32, u32),
) -> HmacSha256 {
    let mut m = HmacSha256::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(role);
    m.update(a);
    m.update(b);
    m.update(&ids.0.to_le_bytes());
    m.update(&ids.1.to_le_bytes());
    m
}

pub(super) fn mac(
    secret: &[u8],
    role: &[u8],
    a: &[u8; 32],
    b: &[u8; 32],
    ids: (u32, u32),
) -> [u8; 32] {
    keyed(secret, role, a, b, ids)
        .finalize()
        .into_bytes()
        .into()
}

/// Constant-time check of a peer's tag.
pub(super) fn verify(
    secret: &[u8],
    role: &[u8],
    a: &[u8; 32],
    b: &[u8; 32],
    ids: (u32, u32),
    tag: &[u8],
) -> bool {
    keyed(secret, role, a, b, ids).verify_slice(tag).is_ok()
}

pub(super) async fn timed<T>(
    f: impl std::future::Future<Output = std::io::Result<T>>,
    who: &str,
) -> Result<T, HandshakeError> {
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, f).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(HandshakeError::Io(format!("{who}: {e}"))),
        Err(_) => Err(HandshakeError::Io(format!("{who}: handshake timed out"))),
    }
}

pub(super) fn nonce() -> [u8; 32] {
    rand::random()
}

/// Send a dialer's hello (magic, our version, an id, a fresh nonce) and read the listener's
/// first status byte; a version refusal comes back as the error naming both versions.
pub(super) async fn hello<S: Io>(
    s: &mut S,
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

/// The dialer's side. Returns, once the listener has accepted us, what was agreed: its
/// incarnation and how many frames of our session with it it has delivered, among others.
pub(super) async fn handshake_dial<S: Io>(
    s: &mut S,
    cfg: &TcpConfig,
    peer: NodeId,
    incarnation: u64,
) -> Result<Transcript, HandshakeError> {
    let who = match s.peer() {
        Some(a) => format!("node {} at {a}", peer.0),
        None => format!("node {}", peer.0),
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
        let _ = s.write_all(&[0u8; ANSWER]).await;
        return Err(HandshakeError::Secret(who));
    }
    let mut answer = mac(&cfg.secret, b"ravnest-dialer", &ns, &nc, ids).to_vec();
    answer.extend_from_slice(&incarnation.to_le_bytes());
    answer.push(u8::from(cfg.encrypt));
    timed(s.write_all(&answer), &who).await?;
    let mut status = [0u8; 1];
    timed(s.read_exact(&mut status), &who).await?;
    match status[0] {
        OK => {
            let mut theirs = [0u8; 16];
            timed(s.read_exact(&mut theirs), &who).await?;
            Ok(Transcript {
                dialer: cfg.me.0,
                listener: server_id,
                nc,
                ns,
                dialer_incarnation: incarnation,
                listener_incarnation: u64::from_le_bytes(theirs[..8].try_into().expect("8 bytes")),
                delivered: u64::from_le_bytes(theirs[8..].try_into().expect("8 bytes")),
            })
        }
        BAD_SECRET => Err(HandshakeError::Secret(who)),
        DUPLICATE => Err(HandshakeError::Duplicate(who)),
        ENCRYPTION => Err(HandshakeError::Encryption(who)),
        _ => Err(HandshakeError::Io(format!("{who}: not a ravnest peer"))),
    }
}

/// How many nodes beyond the file's may join a running cluster.
pub const MAX_NEWCOMERS: usize = 1024;

/// What an accepted connection turned out to be.
pub(super) enum Accepted {
    /// An authenticated peer node, the connection's number, and what was agreed.
    Node(NodeId, u64, Transcript),
    /// A joiner that was handed the cluster file (the connection is done).
    ClusterFileSent,
}

/// The listener's side. Returns the authenticated peer; `admit` says whether an
/// authenticated node may connect now (not while its live connection is open).
pub(super) async fn handshake_accept<S: Io>(
    s: &mut S,
    cfg: &TcpConfig,
    remote: &str,
    incarnation: u64,
    answer: impl FnOnce(&JoinRequest) -> Option<ShareReply>,
    admit: impl Fn(NodeId, u64) -> Option<(u64, u64)>,
) -> Result<Accepted, HandshakeError> {
    let who = format!("connection from {remote}");
    let mut hello = [0u8; 44];
    timed(s.read_exact(&mut hello), &who).await?;
    if &hello[..4] == CONFIG_MAGIC {
        let version = u32::from_le_bytes(hello[4..8].try_into().expect("4 bytes"));
        let nc: [u8; 32] = hello[12..44].try_into().expect("32 bytes");
        let who = format!("joiner at {remote}");
        send_cluster_file(s, cfg, answer, version, nc, &who).await?;
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
    // A node not in the file may join (it proves the secret next); ids stay near the file's.
    if id == cfg.me.0 || id as usize >= cfg.peers.len() + MAX_NEWCOMERS {
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
    let mut answer = [0u8; ANSWER];
    timed(s.read_exact(&mut answer), &who).await?;
    if !verify(&cfg.secret, b"ravnest-dialer", &ns, &nc, ids, &answer[..32]) {
        let _ = s.write_all(&[BAD_SECRET]).await;
        return Err(HandshakeError::Secret(who));
    }
    let theirs = u64::from_le_bytes(answer[32..40].try_into().expect("8 bytes"));
    if answer[40] != u8::from(cfg.encrypt) {
        let _ = s.write_all(&[ENCRYPTION]).await;
        return Err(HandshakeError::Encryption(who));
    }
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
    Ok(Accepted::Node(
        NodeId(id),
        conn,
        Transcript {
            dialer: id,
            listener: cfg.me.0,
            nc,
            ns,
            dialer_incarnation: theirs,
            listener_incarnation: incarnation,
            delivered,
        },
    ))
}

/// MAC over the cluster file, bound to both nonces.
pub(super) fn file_mac(secret: &[u8], a: &[u8; 32], b: &[u8; 32], doc: &[u8]) -> HmacSha256 {
    let mut m = keyed(secret, b"ravnest-cluster-file", a, b, (0, 0));
    m.update(doc);
    m
}

/// A joiner's request on the wire: its name and its address, each a u16 length and the bytes.
fn encode_request(r: &JoinRequest) -> Vec<u8> {
    let mut out = Vec::new();
    for part in [&r.name, &r.address] {
        let b = &part.as_bytes()[..part.len().min(MAX_JOIN_REQUEST)];
        out.extend_from_slice(&(b.len() as u16).to_le_bytes());
        out.extend_from_slice(b);
    }
    out
}

/// Read a joiner's request (its bytes too, which its MAC covers).
async fn read_request<S: Io>(
    s: &mut S,
    who: &str,
) -> Result<(JoinRequest, Vec<u8>), HandshakeError> {
    let mut raw = Vec::new();
    let mut parts = Vec::new();
    for _ in 0..2 {
        let mut len = [0u8; 2];
        timed(s.read_exact(&mut len), who).await?;
        let n = u16::from_le_bytes(len) as usize;
        if n > MAX_JOIN_REQUEST {
            return Err(HandshakeError::Io(format!("{who}: a request of {n} bytes")));
        }
        let mut b = vec![0u8; n];
        timed(s.read_exact(&mut b), who).await?;
        raw.extend_from_slice(&len);
        raw.extend_from_slice(&b);
        parts.push(
            String::from_utf8(b)
                .map_err(|_| HandshakeError::Io(format!("{who}: a request that is not UTF-8")))?,
        );
    }
    let address = parts.pop().unwrap_or_default();
    let name = parts.pop().unwrap_or_default();
    Ok((JoinRequest { name, address }, raw))
}

/// The listener's side of `--join HOST:PORT`: prove we hold the secret, check that the
/// joiner does (its MAC covers its request), then answer the request (`answer`): the cluster
/// file, or where to ask, or why not, under a MAC.
pub(super) async fn send_cluster_file<S: Io>(
    s: &mut S,
    cfg: &TcpConfig,
    answer: impl FnOnce(&JoinRequest) -> Option<ShareReply>,
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
    let ns = nonce();
    let mut challenge = vec![OK];
    challenge.extend_from_slice(&ns);
    challenge.extend_from_slice(&mac(&cfg.secret, b"ravnest-file-server", &nc, &ns, (0, 0)));
    timed(s.write_all(&challenge), who).await?;
    let (request, raw) = read_request(s, who).await?;
    let mut tag = [0u8; 32];
    timed(s.read_exact(&mut tag), who).await?;
    let mut joiner = keyed(&cfg.secret, b"ravnest-file-joiner", &ns, &nc, (0, 0));
    joiner.update(&raw);
    if joiner.verify_slice(&tag).is_err() {
        let _ = s.write_all(&[BAD_SECRET]).await;
        return Err(HandshakeError::Secret(who.to_string()));
    }
    let Some(reply) = answer(&request) else {
        let _ = s.write_all(&[UNKNOWN_NODE]).await;
        return Err(HandshakeError::Unknown(format!(
            "{who} asked for the cluster file, which this node does not share"
        )));
    };
    let (status, body) = match &reply {
        ShareReply::File(doc) => (OK, doc.as_str()),
        ShareReply::Elsewhere(addr) => (MOVED, addr.as_str()),
        ShareReply::Refused(why) => (REFUSED, why.as_str()),
    };
    let mut out = vec![status];
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body.as_bytes());
    let mut m = file_mac(&cfg.secret, &nc, &ns, body.as_bytes());
    m.update(&[status]);
    out.extend_from_slice(&m.finalize().into_bytes());
    timed(s.write_all(&out), who).await?;
    Ok(())
}

/// What a joiner hears back from a node: the cluster file's document, or the address of the
/// node to ask instead (the coordinator's host), or the node's reason for refusing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fetched {
    /// The cluster file's document.
    File(String),
    /// Ask the node at this address.
    Elsewhere(String),
}

/// `ravnest run --join HOST:PORT`: ask a running node for the cluster file, both sides
/// proving they hold `secret` (HMAC over fresh nonces, as between nodes; the joiner's covers its
/// `request`), and the answer arriving under a MAC: the file, or the address to ask instead (a
/// new node's place is given by the coordinator's host). A refusal is an error with the node's
/// reason.
pub async fn fetch_cluster_file(
    addr: SocketAddr,
    secret: &[u8],
    request: &JoinRequest,
) -> Result<Fetched, HandshakeError> {
    let who = format!("node at {addr}");
    let mut s = timed(TcpStream::connect(addr), &who).await?;
    fetch_on(&mut s, &who, secret, request).await
}

/// The same through libp2p: the node at `addr` (a relay's circuit to it, or its own address,
/// ending in its `/p2p/` peer id; [`crate::p2p::ticket`]).
pub async fn fetch_cluster_file_p2p(
    addr: &libp2p::Multiaddr,
    secret: &[u8],
    request: &JoinRequest,
) -> Result<Fetched, HandshakeError> {
    let who = format!("node at {addr}");
    let (s, swarm) = crate::p2p::dial_node(addr)
        .await
        .map_err(|e| HandshakeError::Io(format!("{who}: {e}")))?;
    let r = fetch_on(&mut Conn::P2p(s), &who, secret, request).await;
    swarm.abort();
    r
}

/// The joiner's side of the cluster-file exchange on a connection to `who`.
async fn fetch_on<S: Io>(
    s: &mut S,
    who: &str,
    secret: &[u8],
    request: &JoinRequest,
) -> Result<Fetched, HandshakeError> {
    let who = who.to_string();
    let s = &mut *s;
    let (nc, status) = hello(s, CONFIG_MAGIC, 0, &who).await?;
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
        // An empty request and a tag that fails: the listener says why too.
        let _ = s.write_all(&[0u8; 4 + 32]).await;
        return Err(HandshakeError::Secret(who));
    }
    let raw = encode_request(request);
    let mut tag = keyed(secret, b"ravnest-file-joiner", &ns, &nc, (0, 0));
    tag.update(&raw);
    let mut out = raw;
    out.extend_from_slice(&tag.finalize().into_bytes());
    timed(s.write_all(&out), &who).await?;
    let mut status = [0u8; 1];
    timed(s.read_exact(&mut status), &who).await?;
    let status = status[0];
    match status {
        OK | MOVED | REFUSED => {}
        BAD_SECRET => return Err(HandshakeError::Secret(who)),
        UNKNOWN_NODE => {
            return Err(HandshakeError::Unknown(format!(
                "{who} does not share its cluster file"
            )));
        }
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
    let mut body = vec![0u8; len as usize];
    timed(s.read_exact(&mut body), &who).await?;
    let mut tag = [0u8; 32];
    timed(s.read_exact(&mut tag), &who).await?;
    let mut m = file_mac(secret, &nc, &ns, &body);
    m.update(&[status]);
    if m.verify_slice(&tag).is_err() {
        return Err(HandshakeError::Io(format!(
            "{who}: the cluster file arrived altered"
        )));
    }
    let body = String::from_utf8(body)
        .map_err(|_| HandshakeError::Io(format!("{who}: the cluster file is not UTF-8")))?;
    match status {
        OK => Ok(Fetched::File(body)),
        MOVED => Ok(Fetched::Elsewhere(body)),
        _ => Err(HandshakeError::Unknown(format!("{who} refused: {body}"))),
    }
}

/// Dial the node `listener` at `addr` claiming to be node `claim`, as any holder of the cluster
/// `secret` can, and return the authenticated connection, its encrypted channel established
/// (or why it was refused). The chaos suite's forged peer: what it then writes must never
/// disturb the real node `claim`.
pub async fn dial_as(
    addr: SocketAddr,
    listener: NodeId,
    claim: NodeId,
    secret: &[u8],
) -> Result<Channel, HandshakeError> {
    let cfg = TcpConfig {
        me: claim,
        peers: BTreeMap::from([(listener, addr)]),
        listen: None,
        coordinator: listener,
        secret: secret.to_vec(),
        max_frame: wire::MAX_FRAME,
        connect_window: Duration::ZERO,
        cluster_file: None,
        encrypt: true,
    };
    let who = format!("node {} at {addr}", listener.0);
    let mut s = timed(TcpStream::connect(addr), &who).await?;
    let t = handshake_dial(&mut s, &cfg, listener, rand::random()).await?;
    let keys = establish(&mut s, secret, &t, true, &who).await?;
    let (rx, tx) = split(
        Conn::Tcp(s),
        Some(keys),
        (64, 64),
        (RECORD_SPAN, RECORD_SPAN),
    );
    Ok(Channel::new(rx, tx))
}

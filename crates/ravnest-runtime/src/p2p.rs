//! Peers behind NATs: libp2p under the TCP transport's sessions.
//!
//! libp2p gives *reachability*: every node listens on its own TCP address and, through each
//! relay of `[cluster] relays`, on a circuit address (circuit relay v2), so a node behind a
//! home router is dialled through the relay; DCUtR then punches a direct connection where both
//! NATs allow it, and the relayed one is closed. Each connection is authenticated (Noise XX on
//! the node's key) and encrypted end to end: a relay forwards ciphertext only.
//!
//! What runs *on* that connection is the TCP transport's own: one long-lived stream
//! ([`PROTOCOL`]) per ordered pair of nodes, with ravnest's handshake (the cluster secret
//! proved both ways by HMAC), numbered frames and acknowledgements, so a stream that dies with
//! its connection (a relay that goes, a NAT mapping that expires, the switch from relayed to
//! direct) loses nothing: the session resends what was not acknowledged on the next stream.
//!
//! **Identities come from the secret.** Node `i`'s key pair is an Ed25519 key whose seed is an
//! HMAC of the cluster secret ([`node_key`]); every holder of the secret knows every node's
//! `PeerId`, so nothing but the relay's address needs to be written down, and a dialled peer
//! is checked by libp2p to be the node it was dialled as. Ordinary relays hold no secret.

mod frames;
mod mux;
mod relay;
mod swarm;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hmac::Mac;
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId, StreamProtocol};
use ravnest_core::NodeId;
use tokio::sync::{mpsc, oneshot};
use tokio_util::compat::{Compat, FuturesAsyncReadCompatExt};

pub use relay::{RelayServer, fresh_relay_key, relay_key};

/// The stream protocol a node's frames travel on (its version is the wire protocol's).
pub const PROTOCOL: StreamProtocol = StreamProtocol::new("/ravnest/frames/16");

/// A libp2p stream as tokio reads and writes it (failing at once if its connection is given
/// up).
pub type P2pStream = Compat<frames::Doomed>;

/// How long opening a stream may take (connecting included) before it is tried again.
const OPEN_WINDOW: Duration = Duration::from_secs(10);

/// Node `node`'s key pair in the cluster whose secret is `secret`.
pub fn node_key(secret: &[u8], node: NodeId) -> Keypair {
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).expect("any key length");
    mac.update(b"ravnest/p2p/node/v1/");
    mac.update(&node.0.to_le_bytes());
    let seed: [u8; 32] = mac.finalize().into_bytes().into();
    Keypair::ed25519_from_bytes(seed).expect("32 bytes are an ed25519 seed")
}

/// Node `node`'s `PeerId` in the cluster whose secret is `secret`.
pub fn node_peer(secret: &[u8], node: NodeId) -> PeerId {
    node_key(secret, node).public().to_peer_id()
}

/// A relay's address as a user pastes it (`/ip4/A/tcp/P/p2p/ID`), checked: it must name the
/// relay's `PeerId` (a relay is authenticated like any peer).
pub fn relay_addr(text: &str) -> Result<Multiaddr, String> {
    peer_addr(text, "the relay's", "`ravnest relay` prints it")
}

/// A node's address as a joiner pastes it (`.../p2p/PEER_ID`, through a relay's circuit or
/// not), checked.
pub fn node_addr(text: &str) -> Result<Multiaddr, String> {
    let hint = "its coordinator's host prints the line to paste at its start";
    peer_addr(text, "the node's", hint)
}

/// A multiaddr that ends in `whose` `/p2p/<peer id>`; `hint` says where to find one.
fn peer_addr(text: &str, whose: &str, hint: &str) -> Result<Multiaddr, String> {
    let addr: Multiaddr = text
        .trim()
        .parse()
        .map_err(|e| format!("`{text}` is not a multiaddr ({e})"))?;
    if !matches!(addr.iter().last(), Some(Protocol::P2p(_))) {
        return Err(format!(
            "`{text}` does not end in {whose} /p2p/<peer id> ({hint})"
        ));
    }
    Ok(addr)
}

/// `host:port` as a TCP multiaddr.
pub fn tcp_addr(a: SocketAddr) -> Multiaddr {
    let ip = match a.ip() {
        std::net::IpAddr::V4(v) => Protocol::Ip4(v),
        std::net::IpAddr::V6(v) => Protocol::Ip6(v),
    };
    Multiaddr::empty().with(ip).with(Protocol::Tcp(a.port()))
}

/// How this node reaches a peer now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Path {
    /// A direct connection, never relayed.
    Direct,
    /// A direct connection that hole punching made after the pair met through a relay.
    Punched,
    /// Through a relay only.
    Relayed,
}

impl std::fmt::Display for Path {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Path::Direct => "direct",
            Path::Punched => "direct (hole punched)",
            Path::Relayed => "relayed",
        })
    }
}

/// What a node's libp2p side needs: who it is, where it listens, its relays, and where the
/// file says each peer is (an address that may not be reachable from here: a NAT'd peer's).
#[derive(Debug, Clone)]
pub struct P2pConfig {
    /// This node.
    pub me: NodeId,
    /// The cluster secret (the nodes' keys derive from it).
    pub secret: Vec<u8>,
    /// Where this node listens (TCP).
    pub listen: SocketAddr,
    /// The relays, each `/ip4/A/tcp/P/p2p/ID`.
    pub relays: Vec<Multiaddr>,
    /// Each peer's address in the file.
    pub peers: BTreeMap<NodeId, SocketAddr>,
}

/// A node's libp2p side: a task that drives the swarm, and this handle to it.
#[derive(Clone)]
pub struct P2pNet {
    me: NodeId,
    secret: Arc<[u8]>,
    cmds: mpsc::UnboundedSender<swarm::Cmd>,
    state: Arc<Mutex<swarm::Shared>>,
    task: Arc<tokio::task::AbortHandle>,
}

impl std::fmt::Debug for P2pNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("P2pNet").field("me", &self.me).finish()
    }
}

impl P2pNet {
    /// Start listening on `cfg.listen` and through every relay. Fails when the address cannot
    /// be bound (in use, not this machine's).
    pub async fn start(cfg: P2pConfig) -> Result<P2pNet, String> {
        let key = node_key(&cfg.secret, cfg.me);
        let mut peers = BTreeMap::new();
        for (&n, &a) in &cfg.peers {
            peers.insert(node_peer(&cfg.secret, n), (n, a));
        }
        let (cmds, state, task) = swarm::spawn(key, &cfg, peers).await?;
        Ok(P2pNet {
            me: cfg.me,
            secret: cfg.secret.into(),
            cmds,
            state,
            task: Arc::new(task),
        })
    }

    /// This node's `PeerId`.
    pub fn peer_id(&self) -> PeerId {
        node_peer(&self.secret, self.me)
    }

    /// Node `node`'s `PeerId`.
    pub fn peer_of(&self, node: NodeId) -> PeerId {
        node_peer(&self.secret, node)
    }

    /// Hear each line the network task logs from now on.
    pub fn hear(&self) -> mpsc::UnboundedReceiver<String> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.state.lock().unwrap().hear = Some(tx);
        rx
    }

    /// What the network task logged (reservations lost, holes punched or not).
    pub fn log_lines(&self) -> Vec<String> {
        self.state.lock().unwrap().log.clone()
    }

    /// Wait until every relay has given this node a reservation (it can be dialled through
    /// them), at most `limit`. Returns the relays that did not.
    pub async fn reserved(&self, limit: Duration) -> Vec<Multiaddr> {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let missing = self.state.lock().unwrap().unreserved();
            if missing.is_empty() || tokio::time::Instant::now() >= deadline {
                return missing;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Open a stream to `peer` on the best connection to it (directly, or through a relay),
    /// connecting if there is none.
    pub async fn open(&self, peer: NodeId) -> Result<P2pStream, String> {
        let id = node_peer(&self.secret, peer);
        let (done, rx) = oneshot::channel();
        self.cmds
            .send(swarm::Cmd::Open { node: peer, done })
            .map_err(|_| "the network task stopped".to_string())?;
        let who = format!("node {} ({id})", peer.0);
        match tokio::time::timeout(OPEN_WINDOW, rx).await {
            Ok(Ok(Ok(s))) => Ok(s.compat()),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) => Err(format!("{who}: its connection went while a stream opened")),
            Err(_) => Err(format!("{who}: no stream opened within {OPEN_WINDOW:?}")),
        }
    }

    /// Streams opened by peers, with the node each claims to be by its `PeerId` (`None`: not a
    /// node of this cluster; ravnest's handshake decides).
    pub fn incoming(&self) -> mpsc::UnboundedReceiver<(Option<NodeId>, PeerId, P2pStream)> {
        let (tx, rx) = mpsc::unbounded_channel();
        let state = self.state.clone();
        let Some(mut streams) = self.state.lock().unwrap().inbound.take() else {
            return rx;
        };
        let h = tokio::spawn(async move {
            while let Some((peer, s)) = streams.recv().await {
                let node = state.lock().unwrap().node_of(&peer);
                if tx.send((node, peer, s.compat())).is_err() {
                    return;
                }
            }
        });
        self.state.lock().unwrap().tasks.push(h.abort_handle());
        rx
    }

    /// Node `node` (one that joined after this node started) listens at `at`.
    pub fn learn(&self, node: NodeId, at: SocketAddr) {
        let peer = node_peer(&self.secret, node);
        let _ = self.cmds.send(swarm::Cmd::Learn(node, peer, at));
    }

    /// Give up every connection to `peer` now (a test's NAT that forgets its mapping); the
    /// sessions on them go on over the next.
    pub fn disconnect(&self, peer: NodeId) {
        let _ = self.cmds.send(swarm::Cmd::Disconnect(peer));
    }

    /// How this node reaches each peer it is connected to now.
    pub fn paths(&self) -> BTreeMap<NodeId, Path> {
        self.state.lock().unwrap().paths()
    }

    /// Stop the network task (connections close).
    pub fn shutdown(&self) {
        for t in self.state.lock().unwrap().tasks.drain(..) {
            t.abort();
        }
        self.task.abort();
    }
}

/// A stream to the node at `addr` (`/ip4/R/tcp/P/p2p/RELAY/p2p-circuit/p2p/NODE` through a
/// relay, or `/ip4/H/tcp/P/p2p/NODE` directly) for a process that is not a node yet: what
/// `run --join` fetches the cluster file on. The swarm behind it stops with the handle.
pub async fn dial_node(addr: &Multiaddr) -> Result<(P2pStream, tokio::task::AbortHandle), String> {
    let (s, task) = tokio::time::timeout(OPEN_WINDOW, swarm::dial_once(addr.clone()))
        .await
        .map_err(|_| format!("no connection to {addr} within {OPEN_WINDOW:?}"))??;
    Ok((s.compat(), task))
}

/// The address a joiner pastes after `run --join` to reach node `node` of the cluster whose
/// secret is `secret` through `relay`.
pub fn ticket(relay: &Multiaddr, secret: &[u8], node: NodeId) -> Multiaddr {
    relay
        .clone()
        .with(Protocol::P2pCircuit)
        .with(Protocol::P2p(node_peer(secret, node)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_holder_of_the_secret_derives_the_same_peer_ids_and_another_secret_others() {
        let a = node_peer(b"s", NodeId(1));
        assert_eq!(a, node_peer(b"s", NodeId(1)));
        assert_ne!(a, node_peer(b"s", NodeId(2)));
        assert_ne!(a, node_peer(b"t", NodeId(1)));
    }

    #[test]
    fn a_relay_address_must_name_the_relay() {
        let id = node_peer(b"s", NodeId(0));
        assert!(relay_addr(&format!("/ip4/10.0.0.1/tcp/4001/p2p/{id}")).is_ok());
        let e = relay_addr("/ip4/10.0.0.1/tcp/4001").unwrap_err();
        assert!(e.contains("/p2p/"), "{e}");
        let e = relay_addr("10.0.0.1:4001").unwrap_err();
        assert!(e.contains("not a multiaddr"), "{e}");
    }
}

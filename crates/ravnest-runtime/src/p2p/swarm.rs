//! The task that drives a node's libp2p swarm: listens, keeps a reservation on every relay,
//! opens the frames' streams on the best live connection to a peer (connecting when there is
//! none: at the peer's own address, and by a circuit through each relay), and gives a
//! connection up when a better or newer one makes it stale (hole punched past a relay; the
//! peer at a new address) or when it stops answering pings: its streams fail at once and
//! their sessions go on over the next.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use libp2p::core::transport::ListenerId;
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{ConnectionId, DialError, NetworkBehaviour, SwarmEvent};
use libp2p::{Multiaddr, PeerId, Swarm, dcutr, identify, noise, ping, relay, tcp};
use ravnest_core::NodeId;
use tokio::sync::mpsc;

use super::frames::{Doomed, Frames, Opener};
use super::mux::Yamux;
use super::{P2pConfig, Path, tcp_addr};

/// How often each connection is pinged, and how long an answer may take before the
/// connection is given up (a relayed link's queue under a round of bulk: well under a second
/// at 20 Mbit/s).
const PING_EVERY: Duration = Duration::from_secs(1);
const PING_PATIENCE: Duration = Duration::from_secs(5);

/// How often a relay without a reservation is asked again (one that restarted, or another).
const RESERVE_AGAIN: Duration = Duration::from_secs(2);

#[derive(NetworkBehaviour)]
pub(super) struct Behaviour {
    relay: relay::client::Behaviour,
    identify: identify::Behaviour,
    ping: ping::Behaviour,
    dcutr: dcutr::Behaviour,
    frames: Frames,
}

/// What the handle asks of the task.
pub(super) enum Cmd {
    /// Open a frames' stream to this node (connecting if need be).
    Open { node: NodeId, done: Opener },
    /// This node (one that joined) is at this address.
    Learn(NodeId, PeerId, SocketAddr),
    /// Give up every connection to this node (what a NAT that forgets a mapping, or a peer
    /// whose address changes, does to them).
    Disconnect(NodeId),
}

/// What the task and the handle share: the connections, the relays' reservations, the log.
#[derive(Default)]
pub(super) struct Shared {
    nodes: BTreeMap<PeerId, (NodeId, SocketAddr)>,
    /// Each peer's live connections: relayed or not, and the peer's address on it.
    conns: BTreeMap<PeerId, BTreeMap<ConnectionId, (bool, Multiaddr)>>,
    /// The streams peers opened, until the transport takes them.
    pub(super) inbound: Option<mpsc::UnboundedReceiver<(PeerId, Doomed)>>,
    met_relayed: BTreeSet<PeerId>,
    relays: BTreeMap<PeerId, (Multiaddr, bool)>,
    pub(super) tasks: Vec<tokio::task::AbortHandle>,
    pub(super) log: Vec<String>,
    /// Who hears each line as it is logged.
    pub(super) hear: Option<mpsc::UnboundedSender<String>>,
}

impl Shared {
    pub(super) fn node_of(&self, peer: &PeerId) -> Option<NodeId> {
        self.nodes.get(peer).map(|n| n.0)
    }

    pub(super) fn unreserved(&self) -> Vec<Multiaddr> {
        let open = self.relays.values().filter(|(_, r)| !r);
        open.map(|(a, _)| a.clone()).collect()
    }

    pub(super) fn paths(&self) -> BTreeMap<NodeId, Path> {
        let mut out = BTreeMap::new();
        for (peer, conns) in &self.conns {
            let Some(node) = self.node_of(peer) else {
                continue;
            };
            let direct = conns.values().any(|(r, _)| !r);
            let path = match (direct, self.met_relayed.contains(peer)) {
                (true, false) => Path::Direct,
                (true, true) => Path::Punched,
                (false, _) if conns.is_empty() => continue,
                (false, _) => Path::Relayed,
            };
            out.insert(node, path);
        }
        out
    }
}

/// The connections to close now that `new` is up among a peer's `conns`: with a direct one
/// up, every relayed one (their streams' sessions resend on the direct one); and a direct one
/// that reaches the peer at another address than the newest (its address changed: the old
/// one is dead or dying). Also whether the latter happened.
fn stale(
    conns: &BTreeMap<ConnectionId, (bool, Multiaddr)>,
    new: ConnectionId,
) -> (Vec<ConnectionId>, Vec<ConnectionId>) {
    let direct = conns.values().any(|(r, _)| !r);
    let relayed = conns
        .iter()
        .filter(|(_, (r, _))| *r && direct)
        .map(|(c, _)| *c)
        .collect();
    let mut moved = Vec::new();
    if let Some((false, at)) = conns.get(&new) {
        for (c, (r, a)) in conns {
            if *c != new && !r && place(a) != place(at) {
                moved.push(*c);
            }
        }
    }
    (relayed, moved)
}

/// An address's host and port (without the `/p2p/` a dialled one ends in).
fn place(a: &Multiaddr) -> Vec<Protocol<'_>> {
    a.iter()
        .filter(|p| matches!(p, Protocol::Ip4(_) | Protocol::Ip6(_) | Protocol::Tcp(_)))
        .collect()
}

/// The connection to open a stream on: the newest direct one, else the newest relayed one.
fn best(conns: &BTreeMap<ConnectionId, (bool, Multiaddr)>) -> Option<ConnectionId> {
    let direct = conns.iter().rev().find(|(_, (r, _))| !r);
    direct.or_else(|| conns.iter().next_back()).map(|(c, _)| *c)
}

type Started = (
    mpsc::UnboundedSender<Cmd>,
    Arc<Mutex<Shared>>,
    tokio::task::AbortHandle,
);

/// Between two nodes, libp2p's own layer runs in the clear (its plaintext protocol: keys
/// exchanged, not proved): what it carries that matters, ravnest's frames, is sealed by the
/// transport's own channel (AES-256-GCM, keyed from the cluster secret and bound to the
/// handshake), which proves the secret too. With a relay (which knows no secret) Noise is
/// negotiated instead, the second choice. Sealing the frames once, with AES-GCM, is what keeps
/// a libp2p link near TCP's bandwidth (`ravnest bench allreduce`): libp2p's Noise and TLS both
/// seal with ChaCha20-Poly1305, 2.9x the CPU per byte of AES-GCM on this machine's CPUs.
fn clear(key: &Keypair) -> Result<libp2p::plaintext::Config, std::convert::Infallible> {
    Ok(libp2p::plaintext::Config::new(key))
}

/// A node's swarm: TCP (its plaintext between nodes, Noise with relays), yamux, the relay
/// client, identify, ping, DCUtR, and the frames' streams (what peers open goes to `inbound`).
fn build(
    key: Keypair,
    inbound_tx: mpsc::UnboundedSender<(PeerId, Doomed)>,
) -> Result<Swarm<Behaviour>, String> {
    let swarm = libp2p::SwarmBuilder::with_existing_identity(key)
        .with_tokio()
        .with_tcp(
            tcp::Config::default().nodelay(true),
            (clear, noise::Config::new),
            Yamux::new,
        )
        .map_err(|e| format!("libp2p's TCP transport: {e}"))?
        .with_relay_client((clear, noise::Config::new), Yamux::new)
        .map_err(|e| format!("libp2p's relay client: {e}"))?
        .with_behaviour(|key, relay| Behaviour {
            relay,
            identify: identify::Behaviour::new(identify::Config::new(
                "/ravnest/id/1".into(),
                key.public(),
            )),
            ping: ping::Behaviour::new(
                ping::Config::new()
                    .with_interval(PING_EVERY)
                    .with_timeout(PING_PATIENCE),
            ),
            dcutr: dcutr::Behaviour::new(key.public().to_peer_id()),
            frames: Frames::new(inbound_tx),
        })
        .map_err(|e| format!("libp2p's behaviour: {e}"))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(60)))
        .build();
    Ok(swarm)
}

/// A stream to the node at `addr` (`.../p2p/PEER`, through a relay's circuit or not) from a
/// swarm of a key of its own, for a process that is not a node yet (`run --join` through a
/// relay). The swarm lives as long as the returned task runs.
pub(super) async fn dial_once(
    addr: libp2p::Multiaddr,
) -> Result<(Doomed, tokio::task::AbortHandle), String> {
    let Some(Protocol::P2p(peer)) = addr.iter().last() else {
        return Err(format!(
            "`{addr}` does not end in the node's /p2p/<peer id>"
        ));
    };
    let (inbound_tx, _inbound) = mpsc::unbounded_channel();
    let mut swarm = build(Keypair::generate_ed25519(), inbound_tx)?;
    swarm
        .dial(addr.clone())
        .map_err(|e| format!("cannot dial {addr}: {e}"))?;
    let conn = loop {
        match swarm.select_next_some().await {
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                ..
            } if peer_id == peer => break connection_id,
            SwarmEvent::OutgoingConnectionError { error, .. } => {
                return Err(format!("cannot reach {addr}: {error}"));
            }
            _ => {}
        }
    };
    let (done, rx) = tokio::sync::oneshot::channel();
    swarm.behaviour_mut().frames.open(peer, conn, done);
    let task = tokio::spawn(async move {
        loop {
            swarm.select_next_some().await;
        }
    });
    match rx.await {
        Ok(Ok(s)) => Ok((s, task.abort_handle())),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(format!("{addr}: the connection went while a stream opened")),
    }
}

/// Build the swarm, listen, and start its task.
pub(super) async fn spawn(
    key: Keypair,
    cfg: &P2pConfig,
    nodes: BTreeMap<PeerId, (NodeId, SocketAddr)>,
) -> Result<Started, String> {
    let (inbound_tx, inbound) = mpsc::unbounded_channel();
    let mut swarm = build(key, inbound_tx)?;
    swarm
        .listen_on(tcp_addr(cfg.listen))
        .map_err(|e| format!("cannot listen on {}: {e}", cfg.listen))?;
    let mut shared = Shared {
        nodes,
        inbound: Some(inbound),
        ..Shared::default()
    };
    for r in &cfg.relays {
        if let Some(Protocol::P2p(id)) = r.iter().last() {
            shared.relays.insert(id, (r.clone(), false));
        }
    }
    let state = Arc::new(Mutex::new(shared));
    let (tx, rx) = mpsc::unbounded_channel();
    let driver = Driver {
        swarm,
        state: state.clone(),
        relays: cfg.relays.clone(),
        listeners: std::collections::HashMap::new(),
        waiters: BTreeMap::new(),
        dialing: BTreeSet::new(),
        by_node: state
            .lock()
            .unwrap()
            .nodes
            .iter()
            .map(|(p, (n, a))| (*n, (*p, *a)))
            .collect(),
    };
    let task = tokio::spawn(driver.run(rx));
    Ok((tx, state, task.abort_handle()))
}

struct Driver {
    swarm: Swarm<Behaviour>,
    state: Arc<Mutex<Shared>>,
    relays: Vec<Multiaddr>,
    /// The circuit listener on each relay (its reservation), while it lives.
    listeners: std::collections::HashMap<ListenerId, PeerId>,
    /// Streams asked for, waiting for a connection.
    waiters: BTreeMap<PeerId, Vec<Opener>>,
    /// Peers being dialled.
    dialing: BTreeSet<PeerId>,
    by_node: BTreeMap<NodeId, (PeerId, SocketAddr)>,
}

impl Driver {
    async fn run(mut self, mut cmds: mpsc::UnboundedReceiver<Cmd>) {
        let mut reserve = tokio::time::interval(RESERVE_AGAIN);
        loop {
            tokio::select! {
                cmd = cmds.recv() => match cmd {
                    Some(Cmd::Open { node, done }) => self.open(node, done),
                    Some(Cmd::Learn(node, peer, at)) => {
                        self.by_node.insert(node, (peer, at));
                        self.state.lock().unwrap().nodes.insert(peer, (node, at));
                    }
                    Some(Cmd::Disconnect(node)) => {
                        if let Some(&(peer, _)) = self.by_node.get(&node) {
                            let conns = self.state.lock().unwrap().conns.get(&peer).cloned();
                            for c in conns.unwrap_or_default().into_keys() {
                                self.give_up(peer, c);
                            }
                        }
                    }
                    None => return,
                },
                ev = self.swarm.select_next_some() => self.on_event(ev),
                _ = reserve.tick() => self.reserve(),
            }
        }
    }

    fn log(&self, line: String) {
        let mut s = self.state.lock().unwrap();
        if let Some(h) = &s.hear {
            let _ = h.send(line.clone());
        }
        if s.log.len() < 10_000 {
            s.log.push(line);
        }
    }

    /// The node a peer is, for the log.
    fn who(&self, peer: PeerId) -> String {
        match self.state.lock().unwrap().node_of(&peer) {
            Some(n) => format!("node {}", n.0),
            None => format!("{peer}"),
        }
    }

    /// Listen through every relay that has no circuit listener (the first time, and after a
    /// relay's connection went).
    fn reserve(&mut self) {
        let held: BTreeSet<PeerId> = self.listeners.values().copied().collect();
        for r in self.relays.clone() {
            let Some(Protocol::P2p(id)) = r.iter().last() else {
                continue;
            };
            if held.contains(&id) {
                continue;
            }
            match self.swarm.listen_on(r.clone().with(Protocol::P2pCircuit)) {
                Ok(l) => {
                    self.listeners.insert(l, id);
                }
                Err(e) => self.log(format!("cannot listen through relay {r}: {e}")),
            }
        }
    }

    fn open(&mut self, node: NodeId, done: Opener) {
        let Some(&(peer, direct)) = self.by_node.get(&node) else {
            let _ = done.send(Err(format!("node {} is not in the cluster file", node.0)));
            return;
        };
        let conn = self.state.lock().unwrap().conns.get(&peer).and_then(best);
        if let Some(c) = conn {
            self.swarm.behaviour_mut().frames.open(peer, c, done);
            return;
        }
        self.waiters.entry(peer).or_default().push(done);
        if !self.dialing.insert(peer) {
            return;
        }
        let mut addrs = vec![tcp_addr(direct)];
        for r in &self.relays {
            addrs.push(r.clone().with(Protocol::P2pCircuit));
        }
        // `Always`: connections given up may still be closing.
        let opts = DialOpts::peer_id(peer)
            .addresses(addrs)
            .condition(PeerCondition::Always)
            .build();
        if let Err(e) = self.swarm.dial(opts) {
            self.dialing.remove(&peer);
            self.fail(peer, format!("cannot dial node {} ({peer}): {e}", node.0));
        }
    }

    /// Stop using connection `conn` to `peer`: its streams fail now (their sessions go on over
    /// another), and it closes.
    fn give_up(&mut self, peer: PeerId, conn: ConnectionId) {
        if let Some(c) = self.state.lock().unwrap().conns.get_mut(&peer) {
            c.remove(&conn);
        }
        self.swarm.behaviour_mut().frames.give_up(conn);
        self.swarm.close_connection(conn);
    }

    /// A peer reached through a relay: dial its own address too (a public peer's answers,
    /// whatever hole punching does; a NAT'd one's fails, harmlessly).
    fn try_direct(&mut self, peer: PeerId) {
        let Some(addr) = self.state.lock().unwrap().nodes.get(&peer).map(|n| n.1) else {
            return;
        };
        let opts = DialOpts::peer_id(peer)
            .addresses(vec![tcp_addr(addr)])
            .condition(PeerCondition::Always)
            .build();
        let _ = self.swarm.dial(opts);
    }

    fn fail(&mut self, peer: PeerId, why: String) {
        self.dialing.remove(&peer);
        for w in self.waiters.remove(&peer).unwrap_or_default() {
            let _ = w.send(Err(why.clone()));
        }
    }

    /// A connection to `peer_id` is up: give up what it makes stale, open the streams waiting
    /// for one, and, if it is relayed, dial the peer's own address too.
    fn on_connected(
        &mut self,
        peer_id: PeerId,
        connection_id: ConnectionId,
        endpoint: &libp2p::core::ConnectedPoint,
    ) {
        let relayed = endpoint.is_relayed();
        let remote = endpoint.get_remote_address().clone();
        let (close, moved) = {
            let mut s = self.state.lock().unwrap();
            if relayed {
                s.met_relayed.insert(peer_id);
            }
            let conns = s.conns.entry(peer_id).or_default();
            conns.insert(connection_id, (relayed, remote.clone()));
            stale(conns, connection_id)
        };
        if !moved.is_empty() {
            let who = self.who(peer_id);
            self.log(format!("{who}: now at {remote}; its old connection closes"));
        }
        if !close.is_empty() {
            let who = self.who(peer_id);
            self.log(format!("{who}: direct now; its relayed connection closes"));
        }
        if relayed && close.is_empty() {
            self.log(format!("{}: connected through a relay", self.who(peer_id)));
            self.try_direct(peer_id);
        }
        for c in close.into_iter().chain(moved) {
            self.give_up(peer_id, c);
        }
        self.dialing.remove(&peer_id);
        let conn = self
            .state
            .lock()
            .unwrap()
            .conns
            .get(&peer_id)
            .and_then(best);
        for w in self.waiters.remove(&peer_id).unwrap_or_default() {
            match conn {
                Some(c) => self.swarm.behaviour_mut().frames.open(peer_id, c, w),
                None => drop(w),
            }
        }
    }

    fn on_event(&mut self, ev: SwarmEvent<BehaviourEvent>) {
        match ev {
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                ..
            } => self.on_connected(peer_id, connection_id, &endpoint),
            SwarmEvent::ConnectionClosed {
                peer_id,
                connection_id,
                ..
            } => {
                let mut s = self.state.lock().unwrap();
                if let Some(c) = s.conns.get_mut(&peer_id) {
                    c.remove(&connection_id);
                }
            }
            SwarmEvent::OutgoingConnectionError {
                peer_id: Some(peer),
                error,
                ..
            } => {
                let live = self.state.lock().unwrap().conns.get(&peer).and_then(best);
                if live.is_none() {
                    let node = self.state.lock().unwrap().node_of(&peer);
                    let who = node.map_or(format!("{peer}"), |n| format!("node {} ({peer})", n.0));
                    let why = match error {
                        DialError::WrongPeerId { obtained, .. } => format!(
                            "the peer at {who}'s address is {obtained}, not {who}: another \
                             cluster, or a node with another secret"
                        ),
                        e => format!("cannot connect to {who}: {e}"),
                    };
                    self.fail(peer, why);
                }
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                reason,
                ..
            } => {
                if let Some(relay) = self.listeners.remove(&listener_id) {
                    let mut s = self.state.lock().unwrap();
                    if let Some(r) = s.relays.get_mut(&relay) {
                        r.1 = false;
                    }
                    drop(s);
                    self.log(format!("lost the reservation on relay {relay}: {reason:?}"));
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Relay(
                relay::client::Event::ReservationReqAccepted { relay_peer_id, .. },
            )) => {
                let mut s = self.state.lock().unwrap();
                if let Some(r) = s.relays.get_mut(&relay_peer_id) {
                    r.1 = true;
                }
            }
            SwarmEvent::Behaviour(BehaviourEvent::Ping(ping::Event {
                peer,
                connection,
                result: Err(e),
            })) => {
                // A connection that stopped answering (a NAT that forgot it, a peer gone from
                // its address) goes: its streams' sessions go on over the next one.
                self.log(format!(
                    "{}: a connection stopped answering ({e})",
                    self.who(peer)
                ));
                self.give_up(peer, connection);
            }
            SwarmEvent::Behaviour(BehaviourEvent::Dcutr(dcutr::Event {
                remote_peer_id,
                result,
            })) => match result {
                Ok(_) => self.log(format!("{}: hole punched", self.who(remote_peer_id))),
                Err(e) => self.log(format!(
                    "{}: no hole punched ({e})",
                    self.who(remote_peer_id)
                )),
            },
            _ => {}
        }
    }
}

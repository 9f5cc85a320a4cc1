//! Several TCP transports in one process, on loopback, seen as one transport (the conformance
//! suite and tests).

use std::collections::BTreeMap;
use std::time::Duration;

use ravnest_core::NodeId;

use crate::seams::{Inbox, Transport, TransportError};
use crate::wire;
use ravnest_protocol::msg::{Addr, Envelope};

use super::config::*;
use super::state::*;

/// Node `me`'s view of a loopback cluster at `peers`: node 0 hosts the coordinator, a dial is
/// given 2 s.
fn member(
    me: NodeId,
    peers: &BTreeMap<NodeId, std::net::SocketAddr>,
    secret: &[u8],
    encrypt: bool,
) -> TcpConfig {
    TcpConfig {
        me,
        peers: peers.clone(),
        listen: None,
        coordinator: NodeId(0),
        secret: secret.to_vec(),
        max_frame: wire::MAX_FRAME,
        connect_window: Duration::from_secs(2),
        cluster_file: None,
        encrypt,
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
    /// Start `n` nodes on free loopback ports; node 0 hosts the coordinator. Their connections
    /// are encrypted, as a real run's are.
    pub async fn start(n: u32, secret: &[u8]) -> std::io::Result<LoopbackCluster> {
        LoopbackCluster::start_with(n, secret, true).await
    }

    /// The same, with encryption on or off (`TcpConfig::encrypt`).
    pub async fn start_with(
        n: u32,
        secret: &[u8],
        encrypt: bool,
    ) -> std::io::Result<LoopbackCluster> {
        let mut peers = BTreeMap::new();
        let mut listeners = Vec::new();
        for i in 0..n {
            // Each port is held from the start: a port bound and let go can be taken by any
            // socket (another cluster's outgoing connection) before it is bound again.
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            peers.insert(NodeId(i), l.local_addr()?);
            listeners.push(l);
        }
        let mut nodes = BTreeMap::new();
        for (i, listener) in (0..n).zip(listeners) {
            let cfg = member(NodeId(i), &peers, secret, encrypt);
            nodes.insert(NodeId(i), TcpTransport::on(cfg, listener, false)?);
        }
        Ok(LoopbackCluster { nodes })
    }

    /// `n` nodes over libp2p ([`crate::p2p`]) on free loopback ports, no relay: the same
    /// sessions, sealed by the same channel, on libp2p streams.
    pub async fn start_p2p(n: u32, secret: &[u8]) -> Result<LoopbackCluster, String> {
        let ports = super::spare_ports(n as usize).map_err(|e| e.to_string())?;
        let peers: BTreeMap<NodeId, std::net::SocketAddr> = (0..n)
            .zip(&ports)
            .map(|(i, p)| (NodeId(i), std::net::SocketAddr::from(([127, 0, 0, 1], *p))))
            .collect();
        let mut nodes = BTreeMap::new();
        for i in 0..n {
            let me = NodeId(i);
            let net = crate::p2p::P2pNet::start(crate::p2p::P2pConfig {
                me,
                secret: secret.to_vec(),
                listen: peers[&me],
                relays: Vec::new(),
                peers: peers.clone(),
            })
            .await?;
            let cfg = member(me, &peers, secret, true);
            nodes.insert(me, TcpTransport::over_p2p(cfg, net, peers[&me], false));
        }
        Ok(LoopbackCluster { nodes })
    }

    fn host(&self, a: Addr) -> Option<&TcpTransport> {
        match a {
            Addr::Coordinator | Addr::Checkpoint => self
                .nodes
                .values()
                .next()
                .and_then(|t| self.nodes.get(&t.coordinator())),
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

    fn in_flight(&self, from: Addr, to: Addr) -> usize {
        self.host(from).map_or(0, |t| t.in_flight(from, to))
    }

    fn progress(&self, from: Addr, to: Addr) -> Option<crate::seams::Progress<'_>> {
        self.host(from).and_then(|t| t.progress(from, to))
    }

    fn stored(&self) {
        if let Some(t) = self.host(Addr::Checkpoint) {
            t.stored();
        }
    }

    fn set_coordinator(&self, host: NodeId) {
        for t in self.nodes.values() {
            t.set_coordinator(host);
        }
    }
}

impl crate::conformance::TestNet for LoopbackCluster {
    fn crash_node(&self, node: NodeId) {
        if let Some(t) = self.nodes.get(&node) {
            t.shutdown();
        }
    }
}

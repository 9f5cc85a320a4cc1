//! `ravnest relay`: a circuit relay (v2) that nodes behind NATs reserve a slot on and are
//! dialled through, and that lets pairs of them punch a direct connection (it carries the
//! DCUtR exchange). It holds no cluster secret: every connection through it is encrypted end
//! to end between the two nodes, so it forwards ciphertext only.

use std::net::SocketAddr;
use std::time::Duration;

use futures::StreamExt;
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{Multiaddr, PeerId, Swarm, identify, noise, ping, relay, tcp};

use super::mux::Yamux;
use super::tcp_addr;

/// A relay's key pair from a seed (a file's bytes, a phrase): the same seed gives the same
/// `PeerId`, so its address stays the same across restarts.
pub fn relay_key(seed: &[u8]) -> Keypair {
    use sha2::Digest;
    let d: [u8; 32] =
        sha2::Sha256::digest([b"ravnest/p2p/relay/v1/".as_slice(), seed].concat()).into();
    Keypair::ed25519_from_bytes(d).expect("32 bytes are an ed25519 seed")
}

/// A new relay identity (another `PeerId` every start).
pub fn fresh_relay_key() -> Keypair {
    Keypair::generate_ed25519()
}

#[derive(NetworkBehaviour)]
struct Behaviour {
    relay: relay::Behaviour,
    identify: identify::Behaviour,
    ping: ping::Behaviour,
}

/// A relay listening on one address.
pub struct RelayServer {
    swarm: Swarm<Behaviour>,
    addr: Multiaddr,
}

impl std::fmt::Debug for RelayServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl RelayServer {
    /// Listen on `listen` (an address peers can reach: it is what the relay tells them to
    /// dial), with no limit on a circuit's bytes or length: ravnest's traffic is gradients, not
    /// signalling.
    pub fn bind(key: Keypair, listen: SocketAddr) -> Result<RelayServer, String> {
        if listen.ip().is_unspecified() {
            return Err(format!(
                "`{listen}`: a relay listens on the address peers reach it at (its public one), \
                 not on every interface"
            ));
        }
        let me = key.public().to_peer_id();
        let mut swarm = libp2p::SwarmBuilder::with_existing_identity(key)
            .with_tokio()
            .with_tcp(
                tcp::Config::default().nodelay(true),
                noise::Config::new,
                Yamux::new,
            )
            .map_err(|e| format!("libp2p's TCP transport: {e}"))?
            .with_behaviour(|key| Behaviour {
                relay: relay::Behaviour::new(me, limits()),
                identify: identify::Behaviour::new(identify::Config::new(
                    "/ravnest/id/1".into(),
                    key.public(),
                )),
                ping: ping::Behaviour::new(ping::Config::new()),
            })
            .map_err(|e| format!("libp2p's behaviour: {e}"))?
            .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(60)))
            .build();
        let addr = tcp_addr(listen);
        swarm
            .listen_on(addr.clone())
            .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        swarm.add_external_address(addr.clone());
        Ok(RelayServer {
            swarm,
            addr: addr.with(Protocol::P2p(me)),
        })
    }

    /// What nodes put in `[cluster] relays`: `/ip4/A/tcp/P/p2p/ID`.
    pub fn addr(&self) -> &Multiaddr {
        &self.addr
    }

    /// This relay's `PeerId`.
    pub fn peer_id(&self) -> PeerId {
        *self.swarm.local_peer_id()
    }

    /// Serve until the task is dropped; `say` hears reservations and circuits.
    pub async fn serve(mut self, say: impl Fn(String)) {
        loop {
            if let SwarmEvent::Behaviour(BehaviourEvent::Relay(e)) =
                self.swarm.select_next_some().await
            {
                match e {
                    relay::Event::ReservationReqAccepted { src_peer_id, .. } => {
                        say(format!("reservation for {src_peer_id}"))
                    }
                    relay::Event::CircuitReqAccepted {
                        src_peer_id,
                        dst_peer_id,
                    } => say(format!("circuit {src_peer_id} -> {dst_peer_id}")),
                    relay::Event::CircuitClosed {
                        src_peer_id,
                        dst_peer_id,
                        ..
                    } => say(format!("circuit {src_peer_id} -> {dst_peer_id} closed")),
                    _ => {}
                }
            }
        }
    }
}

/// No rate limits, no byte or time limit per circuit, room for a cluster's pairs.
fn limits() -> relay::Config {
    relay::Config {
        max_reservations: 1024,
        max_reservations_per_peer: 8,
        reservation_duration: Duration::from_secs(60 * 60),
        reservation_rate_limiters: Vec::new(),
        max_circuits: 4096,
        max_circuits_per_peer: 256,
        max_circuit_duration: Duration::from_secs(30 * 24 * 60 * 60),
        max_circuit_bytes: 0,
        circuit_src_rate_limiters: Vec::new(),
    }
}

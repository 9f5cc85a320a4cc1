//! The transport conformance suite over libp2p (loopback, no relay): the same contract as TCP
//! and SimNet, plus what libp2p changes: a node of another secret is another peer id (refused,
//! named), and sessions survive their connections being cut.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ravnest_core::NodeId;
use ravnest_protocol::msg::{Addr, Envelope};
use ravnest_runtime::Transport;
use ravnest_runtime::conformance;
use ravnest_runtime::p2p::{P2pConfig, P2pNet};
use ravnest_runtime::tcp::{LoopbackCluster, TcpConfig, TcpTransport, spare_ports};

const SETTLE: Duration = Duration::from_secs(3);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn check(f: impl AsyncFnOnce(LoopbackCluster) -> Result<(), String>) {
    rt().block_on(async {
        let net = LoopbackCluster::start_p2p(3, b"conformance").await.unwrap();
        let r = f(net.clone()).await;
        for t in net.nodes.values() {
            t.shutdown();
        }
        r.unwrap();
    });
}

#[test]
fn ordering_per_link() {
    check(async |n| conformance::ordering_per_link(&n, SETTLE).await);
}

#[test]
fn large_messages() {
    check(async |n| conformance::large_messages(&n, SETTLE).await);
}

#[test]
fn unknown_address() {
    check(async |n| conformance::unknown_address(&n));
}

#[test]
fn peer_down() {
    check(async |n| conformance::peer_down(&n, SETTLE).await);
}

/// Halts numbered 0..n from node 0 to node 1 while node 0's connections to node 1 are cut
/// every few sends: every one arrives, once, in order (the session resends what the cut
/// connection had not delivered).
#[test]
fn a_session_survives_its_connections_being_cut() {
    check(async |net| {
        let got: Arc<Mutex<Vec<u64>>> = Arc::default();
        let g = got.clone();
        net.register(
            Addr::Node(NodeId(1)),
            Arc::new(move |_, env| {
                if let Envelope::Halt { epoch } = env {
                    g.lock().unwrap().push(epoch);
                }
            }),
        );
        let p2p = net.nodes[&NodeId(0)].p2p().unwrap().clone();
        let n = 300u64;
        for i in 0..n {
            net.send(
                Addr::Node(NodeId(0)),
                Addr::Node(NodeId(1)),
                Envelope::Halt { epoch: i },
            )
            .map_err(|e| e.to_string())?;
            if i % 50 == 25 {
                p2p.disconnect(NodeId(1));
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        }
        let deadline = Instant::now() + Duration::from_secs(20);
        while got.lock().unwrap().len() < n as usize && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let got = got.lock().unwrap().clone();
        if got != (0..n).collect::<Vec<_>>() {
            return Err(format!(
                "{} of {n} arrived, in this order: {got:?}",
                got.len()
            ));
        }
        Ok(())
    });
}

/// A node started with another secret has other peer ids: the dial fails on libp2p's check
/// of the peer id, with a message that says so, and nothing is delivered.
#[test]
fn a_node_with_another_secret_is_refused_by_name() {
    rt().block_on(async {
        let b = LoopbackCluster::start_p2p(2, b"another").await.unwrap();
        let b1 = b.nodes[&NodeId(1)].clone();
        let got = Arc::new(Mutex::new(0));
        let g = got.clone();
        b1.register(
            Addr::Node(NodeId(1)),
            Arc::new(move |_, _| *g.lock().unwrap() += 1),
        );
        // Node 0 of a cluster with another secret, told that node 1 is at b1's address.
        let port = spare_ports(1).unwrap()[0];
        let me: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let peers: BTreeMap<NodeId, std::net::SocketAddr> =
            [(NodeId(0), me), (NodeId(1), b1.local_addr())].into();
        let net = P2pNet::start(P2pConfig {
            me: NodeId(0),
            secret: b"one secret".to_vec(),
            listen: me,
            relays: Vec::new(),
            peers: peers.clone(),
        })
        .await
        .unwrap();
        let cfg = TcpConfig {
            me: NodeId(0),
            peers,
            listen: None,
            coordinator: NodeId(0),
            secret: b"one secret".to_vec(),
            max_frame: ravnest_runtime::wire::MAX_FRAME,
            connect_window: Duration::from_secs(1),
            cluster_file: None,
            encrypt: true,
        };
        let a0 = TcpTransport::over_p2p(cfg, net, me, false);
        a0.send(
            Addr::Node(NodeId(0)),
            Addr::Node(NodeId(1)),
            Envelope::Heartbeat,
        )
        .unwrap();
        tokio::time::sleep(SETTLE).await;
        let log = a0.log_lines().join("\n");
        a0.shutdown();
        for t in b.nodes.values() {
            t.shutdown();
        }
        assert_eq!(*got.lock().unwrap(), 0);
        assert!(log.contains("another secret"), "{log}");
    });
}

//! The transport conformance suite on real TCP (loopback), plus what only TCP has: the
//! handshake (a wrong secret is refused on both sides), peer-down events, and hostile bytes.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ravnest_core::NodeId;
use ravnest_protocol::msg::{Addr, Envelope};
use ravnest_runtime::Transport;
use ravnest_runtime::conformance;
use ravnest_runtime::tcp::{self, LoopbackCluster, TcpConfig, TcpTransport};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SETTLE: Duration = Duration::from_secs(2);

fn check(f: impl AsyncFnOnce(LoopbackCluster) -> Result<(), String>) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let net = LoopbackCluster::start(3, b"conformance").await.unwrap();
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

async fn pair(secret_a: &[u8], secret_b: &[u8]) -> (TcpTransport, TcpTransport) {
    pair_with((secret_a, true), (secret_b, true)).await
}

/// Two transports, each with its secret and whether it encrypts.
async fn pair_with(a: (&[u8], bool), b: (&[u8], bool)) -> (TcpTransport, TcpTransport) {
    let mut peers = BTreeMap::new();
    for (i, port) in (0..2).zip(ravnest_runtime::tcp::spare_ports(2).unwrap()) {
        peers.insert(NodeId(i), SocketAddr::from(([127, 0, 0, 1], port)));
    }
    let cfg = |me: u32, (secret, encrypt): (&[u8], bool)| TcpConfig {
        me: NodeId(me),
        peers: peers.clone(),
        listen: None,
        coordinator: NodeId(0),
        secret: secret.to_vec(),
        max_frame: 1 << 20,
        connect_window: Duration::from_secs(1),
        cluster_file: None,
        encrypt,
    };
    let a = TcpTransport::bind(cfg(0, a), false).await.unwrap();
    let b = TcpTransport::bind(cfg(1, b), false).await.unwrap();
    (a, b)
}

type Got = Arc<Mutex<Vec<(Addr, Envelope)>>>;

fn listen(t: &TcpTransport, at: Addr) -> Got {
    let got: Got = Arc::default();
    let g = got.clone();
    t.register(
        at,
        Arc::new(move |from, env| g.lock().unwrap().push((from, env))),
    );
    got
}

/// The ids of the probes `got` so far, in the order they arrived.
fn probe_ids(got: &Got) -> Vec<u64> {
    got.lock()
        .unwrap()
        .iter()
        .filter_map(|(_, e)| match e {
            Envelope::Probe { id, .. } => Some(*id),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_secret_is_refused_on_both_sides() {
    let (a, b) = pair(b"right", b"wrong").await;
    let got = listen(&a, Addr::Coordinator);
    b.send(
        Addr::Node(NodeId(1)),
        Addr::Coordinator,
        Envelope::Heartbeat,
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        got.lock().unwrap().is_empty(),
        "an unauthenticated envelope arrived"
    );
    let (la, lb) = (a.log_lines().join("\n"), b.log_lines().join("\n"));
    assert!(la.contains("wrong cluster secret"), "listener log: {la}");
    assert!(lb.contains("wrong cluster secret"), "dialer log: {lb}");
    assert!(
        lb.contains("node 0 at 127.0.0.1:"),
        "the dialer names the peer: {lb}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn right_secret_delivers_and_an_unreachable_peer_is_a_peer_down_event() {
    let (a, b) = pair(b"same", b"same").await;
    let got = listen(&a, Addr::Coordinator);
    let downs: Arc<Mutex<Vec<NodeId>>> = Arc::default();
    let d = downs.clone();
    a.on_peer_down(Arc::new(move |n| d.lock().unwrap().push(n)));
    b.send(
        Addr::Node(NodeId(1)),
        Addr::Coordinator,
        Envelope::Heartbeat,
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(got.lock().unwrap().len(), 1);
    b.shutdown();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        downs.lock().unwrap().is_empty(),
        "a closed connection is not a dead peer"
    );
    // Nobody listens at b's address any more: after the connect window, b is unreachable.
    a.send(
        Addr::Coordinator,
        Addr::Node(NodeId(1)),
        Envelope::Heartbeat,
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(downs.lock().unwrap().as_slice(), &[NodeId(1)]);
}

/// Two transports whose node 0 is reached through a fault-injecting proxy.
async fn proxied_pair() -> (TcpTransport, TcpTransport, ravnest_runtime::chaos::Proxy) {
    let ports = ravnest_runtime::tcp::spare_ports(2).unwrap();
    let real = SocketAddr::from(([127, 0, 0, 1], ports[0]));
    let proxy = ravnest_runtime::chaos::Proxy::start("127.0.0.1:0".parse().unwrap(), real)
        .await
        .unwrap();
    let b_addr = SocketAddr::from(([127, 0, 0, 1], ports[1]));
    let peers = BTreeMap::from([(NodeId(0), proxy.addr()), (NodeId(1), b_addr)]);
    let cfg = |me: u32, listen: Option<SocketAddr>| TcpConfig {
        me: NodeId(me),
        peers: peers.clone(),
        listen,
        coordinator: NodeId(0),
        secret: b"s".to_vec(),
        max_frame: 1 << 20,
        connect_window: Duration::from_secs(2),
        cluster_file: None,
        encrypt: true,
    };
    let a = TcpTransport::bind(cfg(0, Some(real)), false).await.unwrap();
    let b = TcpTransport::bind(cfg(1, None), false).await.unwrap();
    (a, b, proxy)
}

/// A connection reset on the path (here by a proxy) loses what was in flight on it, but the
/// peer is not declared down: the next envelope dials again and arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_connection_is_dialed_again_and_is_not_a_death() {
    let (a, b, proxy) = proxied_pair().await;
    assert_ne!(
        a.local_addr(),
        proxy.addr(),
        "a binds `listen`, not its address"
    );
    let got = listen(&a, Addr::Coordinator);
    let downs: Arc<Mutex<Vec<NodeId>>> = Arc::default();
    for t in [&a, &b] {
        let d = downs.clone();
        t.on_peer_down(Arc::new(move |n| d.lock().unwrap().push(n)));
    }
    let beat = || {
        b.send(
            Addr::Node(NodeId(1)),
            Addr::Coordinator,
            Envelope::Heartbeat,
        )
        .unwrap()
    };
    beat();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(got.lock().unwrap().len(), 1);
    for round in 0..3 {
        proxy.reset();
        tokio::time::sleep(Duration::from_millis(100)).await;
        beat();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(got.lock().unwrap().len(), 2 + round, "after reset {round}");
    }
    proxy.set_delay(Duration::from_millis(50));
    beat();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        got.lock().unwrap().len(),
        5,
        "a delayed link still delivers"
    );
    assert!(
        downs.lock().unwrap().is_empty(),
        "{:?}",
        downs.lock().unwrap()
    );
    let log = b.log_lines().join("\n");
    assert!(log.contains("closed; dialing again"), "{log}");
    // Frames sent while connections are being reset all arrive, once each, in order.
    proxy.set_delay(Duration::ZERO);
    for i in 0..400u64 {
        b.send(
            Addr::Node(NodeId(1)),
            Addr::Coordinator,
            Envelope::Probe {
                id: i,
                data: vec![i as f32; 1000],
                echo: false,
            },
        )
        .unwrap();
        if i % 50 == 25 {
            proxy.reset();
        }
        if i % 10 == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    assert!(
        b.drain(Duration::from_secs(5)).await,
        "everything acknowledged"
    );
    let seqs = probe_ids(&got);
    assert_eq!(seqs, (0..400).collect::<Vec<_>>());
    assert!(downs.lock().unwrap().is_empty());
}

/// A node cut off by its proxy (or its connections refused by dialer id) gets nothing while
/// the cut lasts; once healed, what was sent meanwhile arrives, once each, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_node_gets_nothing_until_healed_and_then_everything_in_order() {
    for by_dialer in [false, true] {
        let (a, b, proxy) = proxied_pair().await;
        let got = listen(&a, Addr::Coordinator);
        let send = |i: u64| {
            b.send(
                Addr::Node(NodeId(1)),
                Addr::Coordinator,
                Envelope::Probe {
                    id: i,
                    data: vec![0.5; 10],
                    echo: false,
                },
            )
            .unwrap()
        };
        send(0);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(got.lock().unwrap().len(), 1);
        if by_dialer {
            proxy.refuse_dialer(Some(1));
        } else {
            proxy.isolate(true);
        }
        for i in 1..4 {
            send(i);
            tokio::time::sleep(Duration::from_millis(150)).await;
        }
        assert_eq!(
            got.lock().unwrap().len(),
            1,
            "nothing passes the cut (by dialer: {by_dialer})"
        );
        proxy.isolate(false);
        proxy.refuse_dialer(None);
        assert!(b.drain(Duration::from_secs(3)).await, "healed: delivered");
        let ids = probe_ids(&got);
        assert_eq!(ids, vec![0, 1, 2, 3]);
    }
}

/// The handshake binds a node id to a connection: while node 1 talks to node 0, a second
/// connection that claims to be node 1 (its dialer holds the secret) is refused, and what it
/// would have sent never disturbs the real node 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_connection_claiming_a_live_node_is_refused() {
    let (a, b) = pair(b"s", b"s").await;
    let got = listen(&a, Addr::Coordinator);
    let beat = || {
        b.send(
            Addr::Node(NodeId(1)),
            Addr::Coordinator,
            Envelope::Heartbeat,
        )
        .unwrap()
    };
    beat();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let forged = tcp::dial_as(a.local_addr(), NodeId(0), NodeId(1), b"s").await;
    match forged {
        Err(tcp::HandshakeError::Duplicate(_)) => {}
        other => panic!("a forged second connection as node 1: {other:?}"),
    }
    beat();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        got.lock().unwrap().len(),
        2,
        "the real node still gets through"
    );
    let log = a.log_lines().join("\n");
    assert!(log.contains("already connected"), "{log}");
    // Silent for longer than a live connection is, the id is free again (a node that
    // restarted behind a half-open connection is not locked out).
    tokio::time::sleep(Duration::from_millis(tcp::LIVE_MS + 200)).await;
    let mut s = tcp::dial_as(a.local_addr(), NodeId(0), NodeId(1), b"s")
        .await
        .expect("admitted once the old connection went quiet");
    // It then sends a well-formed header with a huge payload length: that connection is
    // dropped, nothing else.
    s.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
    s.write_all(&[0u8; 16]).await.unwrap();
    s.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    beat();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(got.lock().unwrap().len(), 3);
}

/// A peer that authenticates and then sends garbage, or a frame that lies about its length,
/// loses its connection with a logged reason; the node keeps serving others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_after_handshake_drops_only_that_connection() {
    let (a, b) = pair(b"s", b"s").await;
    let got = listen(&a, Addr::Coordinator);
    // A hand-rolled dialer that claims to be node 1 but cannot authenticate.
    let mut raw = tokio::net::TcpStream::connect(a.local_addr())
        .await
        .unwrap();
    raw.write_all(b"RVN1").await.unwrap();
    raw.write_all(&ravnest_runtime::tcp::PROTOCOL_VERSION.to_le_bytes())
        .await
        .unwrap();
    raw.write_all(&1u32.to_le_bytes()).await.unwrap();
    raw.write_all(&[7u8; 32]).await.unwrap();
    let mut challenge = [0u8; 1 + 4 + 32 + 32];
    raw.read_exact(&mut challenge).await.unwrap();
    raw.write_all(&[0u8; 41]).await.unwrap();
    let mut status = [0u8; 1];
    raw.read_exact(&mut status).await.unwrap();
    assert_ne!(status[0], 0, "a forged answer was accepted");
    // Garbage from a stranger that is not even a ravnest peer.
    let mut junk = tokio::net::TcpStream::connect(a.local_addr())
        .await
        .unwrap();
    junk.write_all(&[0xff; 64]).await.unwrap();
    // The real node still gets through.
    b.send(
        Addr::Node(NodeId(1)),
        Addr::Coordinator,
        Envelope::Heartbeat,
    )
    .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(got.lock().unwrap().len(), 1);
    let log = a.log_lines().join("\n");
    assert!(log.contains("wrong cluster secret"), "{log}");
    assert!(log.contains("not a ravnest peer"), "{log}");
}

async fn sharing(file: Option<&str>) -> TcpTransport {
    let mut peers = BTreeMap::new();
    let port = ravnest_runtime::tcp::spare_ports(1).unwrap()[0];
    peers.insert(NodeId(0), SocketAddr::from(([127, 0, 0, 1], port)));
    TcpTransport::bind(
        TcpConfig {
            me: NodeId(0),
            peers,
            listen: None,
            coordinator: NodeId(0),
            secret: b"right".to_vec(),
            max_frame: 1 << 20,
            connect_window: Duration::from_secs(1),
            cluster_file: file.map(Arc::from),
            encrypt: true,
        },
        false,
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_with_the_secret_gets_the_cluster_file() {
    let text = "[cluster]\nname = \"x\" # ünïcode\n".repeat(1000);
    let a = sharing(Some(&text)).await;
    let got =
        ravnest_runtime::tcp::fetch_cluster_file(a.local_addr(), b"right", &Default::default())
            .await
            .unwrap();
    assert_eq!(got, ravnest_runtime::tcp::Fetched::File(text));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        a.log_lines().join("\n").contains("sent the cluster file"),
        "{:?}",
        a.log_lines()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_with_another_secret_gets_nothing_and_both_sides_say_why() {
    use ravnest_runtime::tcp::HandshakeError;
    let a = sharing(Some("secret stuff")).await;
    let e = ravnest_runtime::tcp::fetch_cluster_file(a.local_addr(), b"wrong", &Default::default())
        .await
        .unwrap_err();
    assert!(matches!(e, HandshakeError::Secret(_)), "{e}");
    assert!(e.to_string().contains("wrong cluster secret"), "{e}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let log = a.log_lines().join("\n");
    assert!(log.contains("wrong cluster secret"), "listener log: {log}");
    assert!(!log.contains("sent the cluster file"), "{log}");

    let quiet = sharing(None).await;
    let e =
        ravnest_runtime::tcp::fetch_cluster_file(quiet.local_addr(), b"right", &Default::default())
            .await
            .unwrap_err();
    assert!(
        e.to_string().contains("does not share its cluster file"),
        "{e}"
    );
}

/// A node's process answers joiners itself (`set_sharer`): the request (name, address) reaches
/// it intact, and its answer comes back: the file, the node to ask instead, or its refusal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joiner_names_itself_and_hears_the_file_or_where_to_ask_or_why_not() {
    use ravnest_runtime::tcp::{Fetched, JoinRequest, ShareReply};
    let a = sharing(Some("plain")).await;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    a.set_sharer(Arc::new(move |r: &JoinRequest| {
        log.lock().unwrap().push(r.clone());
        match r.name.as_str() {
            "elsewhere" => ShareReply::Elsewhere("10.0.0.9:47701".into()),
            "busy" => ShareReply::Refused("not training yet".into()),
            n => ShareReply::File(format!("file for {n} at {}", r.address)),
        }
    }));
    let ask = |name: &str| JoinRequest {
        name: name.to_string(),
        address: "127.0.0.1:9".into(),
    };
    let at = a.local_addr();
    let fetch = |r: JoinRequest| async move {
        ravnest_runtime::tcp::fetch_cluster_file(at, b"right", &r).await
    };
    assert_eq!(
        fetch(ask("ünï")).await.unwrap(),
        Fetched::File("file for ünï at 127.0.0.1:9".into())
    );
    assert_eq!(
        fetch(ask("elsewhere")).await.unwrap(),
        Fetched::Elsewhere("10.0.0.9:47701".into())
    );
    let e = fetch(ask("busy")).await.unwrap_err();
    assert!(e.to_string().contains("refused: not training yet"), "{e}");
    let names: Vec<String> = seen
        .lock()
        .unwrap()
        .iter()
        .map(|r| r.name.clone())
        .collect();
    assert_eq!(names, ["ünï", "elsewhere", "busy"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_returns_once_the_last_frames_are_written_or_given_up() {
    let (a, b) = pair(b"right", b"right").await;
    let got = listen(&a, Addr::Coordinator);
    for _ in 0..50 {
        b.send(Addr::Node(NodeId(1)), Addr::Coordinator, Envelope::Finish)
            .unwrap();
    }
    assert!(b.drain(Duration::from_secs(5)).await, "frames still queued");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(got.lock().unwrap().len(), 50);
    // A peer that is gone: the frames are given up after the dial window, not waited on forever.
    a.shutdown();
    tokio::time::sleep(Duration::from_millis(100)).await;
    b.send(Addr::Node(NodeId(1)), Addr::Coordinator, Envelope::Finish)
        .unwrap();
    assert!(
        b.drain(Duration::from_secs(5)).await,
        "a dead link's frames were not given up"
    );
}

/// What waits for a peer being dialed (one that is lost) does not count as in flight to
/// another: a node pacing its checkpoint parts to the coordinator's host is not held by the
/// frames it still has for the host a fail-over replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_for_a_peer_being_dialed_are_in_flight_to_it_alone() {
    let mut peers = BTreeMap::new();
    for (i, port) in (0..3).zip(ravnest_runtime::tcp::spare_ports(3).unwrap()) {
        peers.insert(NodeId(i), SocketAddr::from(([127, 0, 0, 1], port)));
    }
    let cfg = |me: u32| TcpConfig {
        me: NodeId(me),
        peers: peers.clone(),
        listen: None,
        coordinator: NodeId(1),
        secret: b"s".to_vec(),
        max_frame: 1 << 20,
        connect_window: Duration::from_secs(5),
        cluster_file: None,
        encrypt: true,
    };
    // Node 2 never listens: its frames wait while it is dialed.
    let a = TcpTransport::bind(cfg(0), false).await.unwrap();
    let b = TcpTransport::bind(cfg(1), false).await.unwrap();
    let got = listen(&b, Addr::Coordinator);
    let me = Addr::Node(NodeId(0));
    for _ in 0..20 {
        a.send(me, Addr::Node(NodeId(2)), Envelope::Heartbeat)
            .unwrap();
    }
    a.send(me, Addr::Coordinator, Envelope::Heartbeat).unwrap();
    assert!(eventually(SETTLE, || got.lock().unwrap().len() == 1).await);
    assert!(
        eventually(SETTLE, || a.in_flight(me, Addr::Checkpoint) == 0).await,
        "in flight to the host: {}",
        a.in_flight(me, Addr::Checkpoint)
    );
    assert_eq!(a.in_flight(me, Addr::Node(NodeId(2))), 20);
    a.shutdown();
    b.shutdown();
}

/// A sender pacing itself is woken by the transport, not by polling: a wait armed before
/// frames go out ends once the peer acknowledges them, and by then nothing is in flight; the
/// same wait armed on a quiet link does not end by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pacing_sender_is_woken_when_its_peer_acknowledges() {
    let (a, b) = pair(b"s", b"s").await;
    let got = listen(&a, Addr::Node(NodeId(0)));
    let (me, to) = (Addr::Node(NodeId(1)), Addr::Node(NodeId(0)));
    // Connected and settled first.
    b.send(me, to, Envelope::Heartbeat).unwrap();
    assert!(eventually(SETTLE, || got.lock().unwrap().len() == 1).await);
    assert!(eventually(SETTLE, || b.in_flight(me, to) == 0).await);
    let quiet = b
        .progress(me, to)
        .expect("TCP says when frames are acknowledged");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), quiet)
            .await
            .is_err(),
        "a wait on a quiet link ended by itself"
    );
    let mut woken = 0;
    for _ in 0..5 {
        let wait = b.progress(me, to).unwrap();
        b.send(me, to, Envelope::Heartbeat).unwrap();
        if tokio::time::timeout(SETTLE, wait).await.is_ok() {
            woken += 1;
        }
    }
    assert_eq!(
        woken, 5,
        "a wait armed before its frame went out missed its acknowledgment"
    );
    assert!(eventually(SETTLE, || b.in_flight(me, to) == 0).await);
    assert!(eventually(SETTLE, || got.lock().unwrap().len() == 6).await);
    a.shutdown();
    b.shutdown();
}

/// A peer of another protocol version is told ours and refused; both can say why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_protocol_version_is_refused_with_both_versions_named() {
    use ravnest_runtime::tcp::PROTOCOL_VERSION;
    let (a, _b) = pair(b"s", b"s").await;
    let mut raw = tokio::net::TcpStream::connect(a.local_addr())
        .await
        .unwrap();
    raw.write_all(b"RVN1").await.unwrap();
    raw.write_all(&(PROTOCOL_VERSION + 7).to_le_bytes())
        .await
        .unwrap();
    raw.write_all(&1u32.to_le_bytes()).await.unwrap();
    raw.write_all(&[7u8; 32]).await.unwrap();
    let mut answer = [0u8; 5];
    raw.read_exact(&mut answer).await.unwrap();
    assert_eq!(answer[0], 1, "status: another version");
    assert_eq!(
        u32::from_le_bytes(answer[1..].try_into().unwrap()),
        PROTOCOL_VERSION
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = a.log_lines().join("\n");
    assert!(
        log.contains(&format!(
            "protocol version {}, this node speaks {PROTOCOL_VERSION}",
            PROTOCOL_VERSION + 7
        )),
        "{log}"
    );
}

/// Until `done` holds, at most `limit`; whether it does.
async fn eventually(limit: Duration, done: impl Fn() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while !done() {
        if tokio::time::Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

fn tensor(i: u64) -> Vec<f32> {
    (0..2000u64)
        .map(|j| (i * 10_000 + j) as f32 * 0.5)
        .collect()
}

/// Every probe that arrived, in order: its id, and whether its tensor is the one sent.
fn probes(got: &Got) -> Vec<(u64, bool)> {
    got.lock()
        .unwrap()
        .iter()
        .filter_map(|(_, e)| match e {
            Envelope::Probe { id, data, .. } => Some((*id, *data == tensor(*id))),
            _ => None,
        })
        .collect()
}

/// Frames travel sealed: a byte altered in flight (by the proxy, in the middle of a burst of
/// tensors) fails authentication, the listener closes that connection saying why, and the
/// session sends again on a new connection what was not acknowledged. Every envelope arrives
/// once, in order, with the tensor that was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_byte_altered_in_flight_is_caught_and_nothing_is_lost_or_corrupted() {
    let (a, b, proxy) = proxied_pair().await;
    let got = listen(&a, Addr::Coordinator);
    let send = |i: u64| {
        b.send(
            Addr::Node(NodeId(1)),
            Addr::Coordinator,
            Envelope::Probe {
                id: i,
                data: tensor(i),
                echo: false,
            },
        )
        .unwrap()
    };
    for i in 0..100 {
        send(i);
    }
    assert!(b.drain(Duration::from_secs(5)).await);
    // About three tensors into the next burst.
    proxy.corrupt_next(25_000);
    for i in 100..300 {
        send(i);
        if i % 20 == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    assert!(
        eventually(Duration::from_secs(10), || probes(&got).len() >= 300).await,
        "{} of 300 arrived",
        probes(&got).len()
    );
    assert!(!proxy.corruption_pending(), "the byte was altered");
    let want: Vec<(u64, bool)> = (0..300).map(|i| (i, true)).collect();
    assert_eq!(probes(&got), want);
    assert_eq!(a.auth_failures(), 1);
    let log = a.log_lines().join("\n");
    assert!(
        log.contains(
            "frame failed authentication (tampered or corrupted in flight): closing the connection to node 1"
        ),
        "{log}"
    );
    let log = b.log_lines().join("\n");
    assert!(log.contains("closed; dialing again"), "{log}");
}

/// Acknowledgements travel sealed too: one altered on its way back closes the connection at
/// the sender, which dials again; the listener's count keeps every envelope delivered once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_altered_acknowledgement_is_caught_too() {
    let (a, b, proxy) = proxied_pair().await;
    let got = listen(&a, Addr::Coordinator);
    let send = |i: u64| {
        b.send(
            Addr::Node(NodeId(1)),
            Addr::Coordinator,
            Envelope::Probe {
                id: i,
                data: tensor(i),
                echo: false,
            },
        )
        .unwrap()
    };
    for i in 0..50 {
        send(i);
    }
    assert!(b.drain(Duration::from_secs(5)).await);
    // Inside the next acknowledgement's sealed bytes (past its 2-byte length).
    proxy.corrupt_next_back(5);
    for i in 50..150 {
        send(i);
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    assert!(
        eventually(Duration::from_secs(10), || probes(&got).len() >= 150).await,
        "{} of 150 arrived",
        probes(&got).len()
    );
    assert!(b.drain(Duration::from_secs(5)).await);
    assert_eq!(
        probes(&got),
        (0..150).map(|i| (i, true)).collect::<Vec<_>>()
    );
    assert_eq!(b.auth_failures(), 1);
    let log = b.log_lines().join("\n");
    assert!(
        log.contains("failed authentication (tampered or corrupted in flight): closing the connection to node 0"),
        "{log}"
    );
}

/// One end encrypting and the other not is refused, and both ends say why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encryption_on_at_one_end_only_is_refused_on_both_sides() {
    for (ea, eb) in [(true, false), (false, true)] {
        let (a, b) = pair_with((b"s", ea), (b"s", eb)).await;
        let got = listen(&a, Addr::Coordinator);
        b.send(
            Addr::Node(NodeId(1)),
            Addr::Coordinator,
            Envelope::Heartbeat,
        )
        .unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(got.lock().unwrap().is_empty());
        for t in [&a, &b] {
            let log = t.log_lines().join("\n");
            assert!(
                log.contains("encryption is on at one end and off at the other"),
                "{log}"
            );
        }
        a.shutdown();
        b.shutdown();
    }
}

/// With encryption off (a trusted network), frames travel plain and all the rest holds.
#[test]
fn plain_connections_keep_the_contract() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let net = LoopbackCluster::start_with(3, b"plain", false)
            .await
            .unwrap();
        let r = async {
            conformance::ordering_per_link(&net, SETTLE).await?;
            conformance::large_messages(&net, SETTLE).await
        }
        .await;
        for t in net.nodes.values() {
            t.shutdown();
        }
        r.unwrap();
    });
}

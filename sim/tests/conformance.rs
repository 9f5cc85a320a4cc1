//! The transport conformance suite (`ravnest_runtime::conformance`) on SimNet.

use std::time::Duration;

use ravnest_core::NodeId;
use ravnest_core::collective::{CollId, CollMsg};
use ravnest_runtime::Trace;
use ravnest_runtime::conformance::{self, TestNet};
use ravnest_sim::net::SimNet;

#[derive(Clone, Debug)]
struct Net(SimNet);

impl ravnest_runtime::Transport for Net {
    fn register(&self, addr: ravnest_protocol::msg::Addr, inbox: ravnest_runtime::Inbox) {
        self.0.register(addr, inbox)
    }
    fn send(
        &self,
        from: ravnest_protocol::msg::Addr,
        to: ravnest_protocol::msg::Addr,
        env: ravnest_protocol::msg::Envelope,
    ) -> Result<(), ravnest_runtime::TransportError> {
        self.0.send(from, to, env)
    }
}

impl TestNet for Net {
    fn crash_node(&self, node: NodeId) {
        self.0.crash(node)
    }
}

fn check(f: impl AsyncFnOnce(Net) -> Result<(), String>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let text = "[[node]]\nname = \"n\"\ndevice = \"rtx3090\"\ncount = 3\nbandwidth_gbps = 1.0\n[model]\npreset = \"mlp-digits\"\n";
        let s = ravnest_core::parse(text, "conformance").unwrap();
        let net = SimNet::new(s.cluster, NodeId(0), 1, tokio::time::Instant::now(), Trace::default());
        let task = tokio::spawn(net.clone().run());
        let r = f(Net(net)).await;
        task.abort();
        r.unwrap();
    });
}

const SETTLE: Duration = Duration::from_secs(60);

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

/// Arrival times (ms after the start) of 1 MB pushes sent at t = 0 along `flows` on 4 nodes
/// with 1 Gbit/s interfaces.
fn arrivals(flows: &[(u32, u32)]) -> Vec<f64> {
    use ravnest_protocol::msg::{Addr, Envelope};
    use ravnest_runtime::Transport;
    use std::sync::{Arc, Mutex};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(async {
        let text = "[[node]]\nname = \"n\"\ndevice = \"rtx3090\"\ncount = 4\nbandwidth_gbps = 1.0\nlatency_ms = 0.01\n[model]\npreset = \"mlp-digits\"\n";
        let s = ravnest_core::parse(text, "nic").unwrap();
        let t0 = tokio::time::Instant::now();
        let net = SimNet::new(s.cluster, NodeId(0), 1, t0, Trace::default());
        let task = tokio::spawn(net.clone().run());
        let got: Arc<Mutex<Vec<f64>>> = Arc::default();
        for n in 0..4 {
            let g = got.clone();
            net.register(
                Addr::Node(NodeId(n)),
                Arc::new(move |_, _| {
                    g.lock()
                        .unwrap()
                        .push(t0.elapsed().as_secs_f64() * 1e3);
                }),
            );
        }
        for &(a, b) in flows {
            let push = Envelope::Coll {
                msg: CollMsg::Push {
                    id: CollId::epoch(1),
                    rank: a,
                    data: vec![],
                },
                virtual_bytes: 1_000_000,
                packing: ravnest_core::pack::Packing::Fp32,
            };
            net.send(Addr::Node(NodeId(a)), Addr::Node(NodeId(b)), push)
                .unwrap();
        }
        tokio::time::sleep(SETTLE).await;
        task.abort();
        let mut v = got.lock().unwrap().clone();
        v.sort_by(f64::total_cmp);
        v
    })
}

/// Three workers pushing to one server share the server's interface: the pushes arrive one
/// after another (8 ms apart at 1 Gbit/s), as a parameter server's do; three pushes around a
/// ring use three different interfaces and all arrive together.
#[test]
fn a_servers_interface_is_shared_by_everything_sent_to_it() {
    let fan_in = arrivals(&[(1, 0), (2, 0), (3, 0)]);
    let ring = arrivals(&[(0, 1), (1, 2), (2, 0)]);
    let near = |x: f64, want: f64| (x - want).abs() < 0.5;
    // One transfer: 8 ms of serialization plus the link's latency.
    let one = fan_in[0];
    assert!(one >= 8.0, "fan-in arrivals {fan_in:?}");
    assert!(
        fan_in.len() == 3 && near(fan_in[1], one + 8.0) && near(fan_in[2], one + 16.0),
        "fan-in arrivals {fan_in:?}"
    );
    assert!(
        ring.len() == 3 && ring.iter().all(|&t| near(t, one)),
        "ring arrivals {ring:?}"
    );
}

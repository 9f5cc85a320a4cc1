//! The transport conformance suite (`ravnest_runtime::conformance`) on SimNet.

use std::time::Duration;

use ravnest_core::NodeId;
use ravnest_runtime::Trace;
use ravnest_runtime::conformance::{self, TestNet};
use ravnest_sim::net::SimNet;

#[derive(Clone, Debug)]
struct Net(SimNet);

impl ravnest_runtime::Transport for Net {
    fn register(&self, addr: ravnest_runtime::Addr, inbox: ravnest_runtime::Inbox) {
        self.0.register(addr, inbox)
    }
    fn send(
        &self,
        from: ravnest_runtime::Addr,
        to: ravnest_runtime::Addr,
        env: ravnest_runtime::Envelope,
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

//! A node that joined (`run --join`) and hears nothing from the coordinator's host it was sent
//! to: that host may have died or frozen between handing out the file and this node's hello,
//! and a successor taken over meanwhile. Every `silence` it asks the other nodes of its file,
//! in order, which node hosts the coordinator now (as a joiner asks for the file, with no
//! address: a question, not a second request for a place), and says its hello again there.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ravnest_core::NodeId;
use ravnest_runtime::tcp::{Fetched, JoinRequest, TcpTransport};
use ravnest_runtime::{Addr, Envelope, Transport};
use tokio::time::Instant;

use super::console::Say;
use super::options::{AbortOnDrop, Options};
use super::setup::Setup;
use super::tap::Tap;

/// Ask around for the coordinator's host every `silence` while nothing was heard from it
/// (`net.heard`: ms since `t0` of its last word, `u64::MAX` for none), and say hello there
/// again (a known node's `Join`; a new one registers first).
pub(super) fn spawn(
    opts: &Options,
    say: &Say,
    tcp: &TcpTransport,
    net: &Tap,
    su: &Setup,
    t0: Instant,
) -> AbortOnDrop {
    let mut hello = Vec::new();
    if opts.newcomer {
        hello.push(Envelope::Register(su.caps.clone()));
    }
    hello.push(Envelope::Join);
    let heard: Arc<AtomicU64> = net.heard.clone();
    let s = &opts.scenario;
    let silence = Duration::from_millis((3 * s.run.heartbeat_timeout_ms).max(1000));
    let secret = super::secret(s);
    let me = tcp.me();
    let name = opts.node.clone();
    let nodes: Vec<(NodeId, String, String)> = s
        .cluster
        .nodes
        .iter()
        .enumerate()
        .filter_map(|(i, n)| Some((NodeId(i as u32), n.name.clone(), n.address.clone()?)))
        .filter(|(id, _, _)| *id != me)
        .collect();
    let (tcp, say) = (tcp.clone(), say.clone());
    AbortOnDrop(tokio::spawn(async move {
        let mut next = t0 + silence;
        loop {
            tokio::time::sleep_until(next).await;
            next += silence;
            if heard.load(Ordering::Relaxed) != u64::MAX {
                return;
            }
            let host = tcp.coordinator();
            let question = JoinRequest {
                name: name.clone(),
                address: String::new(),
            };
            for (id, peer, address) in nodes.iter().filter(|(id, _, _)| *id != host) {
                let Ok(at) = address.parse() else { continue };
                let answer =
                    ravnest_runtime::tcp::fetch_cluster_file(at, secret.as_bytes(), &question);
                let got = tokio::time::timeout(silence, answer).await;
                let Ok(Ok(Fetched::File(doc))) = got else {
                    continue;
                };
                let Some(now) = super::share_coordinator(&doc).filter(|&h| h != host && h != me)
                else {
                    continue;
                };
                say.waiting(format!(
                    "no word from the coordinator's host (node {}) since this node joined: `{peer}` (node {}) says node {} hosts it now; saying hello there",
                    host.0, id.0, now.0
                ));
                tcp.set_coordinator(now);
                for env in &hello {
                    let _ = tcp.send(Addr::Node(me), Addr::Coordinator, env.clone());
                }
                break;
            }
        }
    }))
}

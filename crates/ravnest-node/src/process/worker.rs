//! A worker's side of the run's end: it waits for `Finish` while watching that the coordinator
//! is still there.

use std::time::Duration;

use ravnest_core::NodeId;
use ravnest_core::stall::{StallClock, credited};
use ravnest_protocol::coordinator::succession::Verdict;
use ravnest_protocol::msg::{Addr, Envelope, Replica};
use ravnest_runtime::Transport;
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

use super::options::{Options, RunError, coordinator_of};
use super::tap::Tap;

/// How a worker's wait ends well.
pub(super) enum Ending {
    /// `Finish` came.
    Finished,
    /// The coordinator was lost and this node succeeds it (fail-over): the new term's replica,
    /// and the lost coordinator's node.
    TakeOver(Replica, NodeId),
    /// Stopped with Ctrl-C: the coordinator planned this node out and let it go (the run goes
    /// on without it).
    Left,
}

/// Wait for `Finish`, following the coordinator when another node takes over, or taking over
/// when this node is the successor. A coordinator lost before fail-over is possible (no replica
/// came yet), or with no successor left, is an error that names it and suggests why.
pub(super) async fn wait_for_finish(
    h: &super::coordinate::Host<'_>,
    net: &Tap,
    verdicts: &mut mpsc::UnboundedReceiver<(NodeId, Verdict)>,
    stops: &mut super::stops::Stops,
) -> Result<Ending, RunError> {
    let (opts, say, tcp) = (h.opts, h.say, h.tcp);
    let hello = super::hello(h.opts, h.su);
    stops.enter(super::stops::Phase::Training);
    let s = &opts.scenario;
    let name = |n: NodeId| {
        s.cluster
            .nodes
            .get(n.index())
            .map_or("?", |x| x.name.as_str())
    };
    let mut host = coordinator_of(s);
    let watch = watch_coordinator(opts, &net.finish, &net.heard, &net.armed, net.t0);
    tokio::pin!(watch);
    let mut leaving = false;
    let mut canvassing = false;
    let why = loop {
        tokio::select! {
            end = &mut watch => match end {
                Ok(()) if leaving => return Ok(Ending::Left),
                Ok(()) => return Ok(Ending::Finished),
                Err(why) => break why,
            },
            // A second request exits at once (see `Stops`); the launcher's word is for the
            // coordinator, which ends the run.
            launcher = stops.requested(), if !leaving => {
                if launcher {
                    continue;
                }
                leaving = true;
                let _ = tcp.send(Addr::Node(tcp.me()), Addr::Coordinator, Envelope::Leave);
                say.cluster(
                    "stop requested (Ctrl-C or SIGTERM): leaving the cluster; this node finishes the steps the running epoch counts on it for (Ctrl-C again to stop at once)",
                );
            },
            Some((_, v)) = verdicts.recv() => match v {
                Verdict::Follow(next) => {
                    say.cluster(format!(
                        "`{}` took the coordinator over from `{}`: following it",
                        name(next),
                        name(host)
                    ));
                    host = next;
                    canvassing = false;
                    // Not let in yet (no replica came): what this node said to the lost host
                    // to join, it says again to its successor.
                    if !net.armed.load(std::sync::atomic::Ordering::Relaxed) {
                        for env in &hello {
                            let _ = tcp.send(Addr::Node(tcp.me()), Addr::Coordinator, env.clone());
                        }
                    }
                }
                Verdict::Awaits(next) => say.cluster(format!(
                    "the coordinator on `{}` is silent: waiting for `{}` to take over",
                    name(host),
                    name(next)
                )),
                Verdict::TakeOver(r) => return Ok(Ending::TakeOver(r, host)),
                Verdict::Canvass { .. } if !canvassing => {
                    canvassing = true;
                    say.cluster(format!(
                        "the coordinator on `{}` is silent: this node would take over, once most of the other members confirm they lost it too",
                        name(host)
                    ));
                }
                Verdict::Canvass { .. } => {}
                Verdict::Resumed(back) => {
                    canvassing = false;
                    say.cluster(format!("the coordinator on `{}` is heard again", name(back)));
                    host = back;
                }
                Verdict::CutOff(why) => {
                    let me = name(tcp.me());
                    return Err(RunError::SteppedDown(format!(
                        "{why}; this node leaves the run, which goes on without it if the others still hold a majority (`ravnest run --join HOST:PORT --node {me}` brings it back)"
                    )));
                }
                Verdict::Lost(why) => break Silence::Judged(why),
            },
        }
    };
    let c = &s.cluster.nodes[host.index()];
    let help = if matches!(
        tcp.refusal(host),
        Some(ravnest_runtime::tcp::HandshakeError::Secret(_))
    ) {
        "\n  help: its port answered with another cluster secret: check RAVNEST_SECRET or `[cluster] secret`; another cluster's node may own that port"
    } else if matches!(why, Silence::NeverHeard { .. }) {
        "\n  help: is it started, and is its port reachable from here? (wait longer with `[run] register_timeout_s` or --wait SECS)"
    } else {
        ""
    };
    Err(RunError::CoordinatorLost(format!(
        "{why}: coordinator `{}` at {}; training cannot go on without it{help}",
        c.name,
        c.address.as_deref().unwrap_or("?"),
    )))
}

/// Why a worker gave the coordinator up.
#[derive(Debug, Clone, PartialEq)]
enum Silence {
    /// It never heard from it within the registration window.
    NeverHeard { wait_s: u64 },
    /// It heard from it, then nothing for this long (before fail-over was armed).
    Lost { silent_ms: u64 },
    /// The node's watch judged it lost (fail-over found no successor), and why.
    Judged(String),
}

impl std::fmt::Display for Silence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Silence::NeverHeard { wait_s } => {
                write!(f, "no word from the coordinator within {wait_s} s")
            }
            Silence::Lost { silent_ms } => write!(
                f,
                "lost the coordinator: silent for {:.1} s",
                *silent_ms as f64 / 1e3
            ),
            Silence::Judged(why) => f.write_str(why),
        }
    }
}

/// A worker waits for `Finish`, watching that the coordinator is there: it must be heard from
/// within the registration window, and then at least every few heartbeat timeouts (its
/// process sends heartbeats to every node). A closed connection alone is not a loss: peers
/// reconnect.
async fn watch_coordinator(
    opts: &Options,
    finish: &Notify,
    heard: &std::sync::atomic::AtomicU64,
    armed: &std::sync::atomic::AtomicBool,
    t0: Instant,
) -> Result<(), Silence> {
    let s = &opts.scenario;
    let silence_ms = (3 * s.run.heartbeat_timeout_ms).max(1000);
    let period = s.run.heartbeat_ms.max(10);
    let mut tick = tokio::time::interval(Duration::from_millis(period));
    // Time this process spent not running (frozen, swapped out) is nobody's silence: the
    // last word, as counted, moves later by such a stall.
    let mut stall = StallClock::new(Some((silence_ms / 3).max(4 * period)));
    stall.start(0);
    let mut counted_from = 0u64;
    loop {
        tokio::select! {
            biased;
            _ = finish.notified() => return Ok(()),
            _ = tick.tick() => {}
        }
        let now = t0.elapsed().as_millis() as u64;
        let stalled = stall.tick(now);
        match heard.load(std::sync::atomic::Ordering::Relaxed) {
            u64::MAX if now > opts.register_timeout.as_millis() as u64 => {
                return Err(Silence::NeverHeard {
                    wait_s: opts.register_timeout.as_secs(),
                });
            }
            u64::MAX => {}
            last => {
                counted_from = credited(counted_from.max(last), stalled, now);
                let silent = now.saturating_sub(counted_from);
                // Once a replica came, a silent coordinator is the node's watch's to handle
                // (fail-over).
                if silent > silence_ms && !armed.load(std::sync::atomic::Ordering::Relaxed) {
                    return Err(Silence::Lost { silent_ms: silent });
                }
            }
        }
    }
}

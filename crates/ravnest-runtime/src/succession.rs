//! Fail-over, as a node's process runs it: how it watches the coordinator ([`Succession`]),
//! and the watch itself ([`Watcher`]: the pure [`Watch`] behind a lock). The watch is not the
//! node actor's: it is fed from the node's inbox before its mailbox, on the transport's thread
//! (a node busy with a long step still hears the coordinator, follows a successor, and tells a
//! stale coordinator of the newer term at once), and ticked by the node.
//!
//! The watch acts inside the transport's callback, before the node's mailbox gets the next
//! envelope: the transport is redirected to a successor before the node answers anything that
//! successor sent after its replica (its first halt). The one lock is the price of that order:
//! the transport judges each frame that claims to come from the coordinator by the host this
//! node follows (`tcp::incoming::judge_header`), so the redirect must be done before the
//! transport reads the successor's next frame, on the thread that delivers. A task that owns
//! the watch was tried twice (beside the node's mailbox, and in front of it with every envelope
//! passing through it in order): either way the successor's first halt came in before the
//! redirect and was dropped as a stale coordinator's, and the chaos suite's seed 14 stalled
//! after `peer` took over.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ravnest_core::NodeId;
use tokio::time::Instant;

use crate::seams::Transport;
use ravnest_protocol::coordinator::succession::{Verdict, Watch};
use ravnest_protocol::msg::{Addr, Envelope};

/// Fail-over on a node: it watches the coordinator (hosted by `host` at the start) and
/// suspects it after `silence` without a word; [`ravnest_protocol::coordinator::succession::Watch`]
/// decides. The node redirects its transport itself; `on_verdict` is told every verdict (the
/// process starts a coordinator on [`Verdict::TakeOver`]). It must not block.
#[derive(Clone)]
pub struct Succession {
    /// The coordinator's host at the start.
    pub host: NodeId,
    /// Silence after which the coordinator is suspected.
    pub silence: Duration,
    /// Told each verdict.
    pub on_verdict: Arc<dyn Fn(NodeId, Verdict) + Send + Sync>,
}

impl std::fmt::Debug for Succession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Succession")
            .field("host", &self.host)
            .field("silence", &self.silence)
            .finish()
    }
}

/// The watch of node `id`, shared by its inbox and its actor.
#[derive(Clone)]
pub(crate) struct Watcher<T> {
    id: NodeId,
    transport: T,
    succession: Succession,
    watch: Arc<Mutex<Watch>>,
    t0: Instant,
}

impl<T: Transport> Watcher<T> {
    pub(crate) fn new(id: NodeId, transport: T, succession: Succession, t0: Instant) -> Self {
        let silence_ms = succession.silence.as_millis() as u64;
        let now_ms = t0.elapsed().as_millis() as u64;
        Watcher {
            watch: Arc::new(Mutex::new(Watch::new(
                id,
                succession.host,
                silence_ms,
                now_ms,
            ))),
            id,
            transport,
            succession,
            t0,
        }
    }

    fn now_ms(&self) -> u64 {
        self.t0.elapsed().as_millis() as u64
    }

    /// How often the node ticks it: a tenth of the silence.
    pub(crate) fn period(&self) -> std::time::Duration {
        (self.succession.silence / 10).max(std::time::Duration::from_millis(10))
    }

    /// An envelope for this node, before its mailbox: the watch's part of it. Anything from
    /// the coordinator is a sign of life; a replica, a lease or a pre-vote is the watch's alone
    /// (true: consumed here).
    pub(crate) fn on_envelope(&self, from: Addr, env: &Envelope) -> bool {
        let now = self.now_ms();
        let heard = self
            .watch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .on_envelope(from, env, now);
        let Some(heard) = heard else {
            return false;
        };
        if let Some((to, env)) = heard.reply {
            let _ = self
                .transport
                .send(Addr::Node(self.id), Addr::Node(to), env);
        }
        self.act(heard.verdict);
        true
    }

    /// Time passed (the node's ticker).
    pub(crate) fn tick(&self) {
        let now = self.now_ms();
        let v = self
            .watch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .tick(now);
        self.act(v);
    }

    /// Act on what the watch decided: the transport is redirected here; the process is told
    /// (it starts a coordinator on a take-over, steps a stale one down on a follow).
    fn act(&self, v: Option<Verdict>) {
        let Some(v) = v else { return };
        match &v {
            Verdict::Follow(host) | Verdict::Resumed(host) => self.transport.set_coordinator(*host),
            Verdict::TakeOver(_) => self.transport.set_coordinator(self.id),
            Verdict::Canvass { term, voters } => {
                for v in voters {
                    let _ = self.transport.send(
                        Addr::Node(self.id),
                        Addr::Node(*v),
                        Envelope::PreVote { term: *term },
                    );
                }
            }
            Verdict::Awaits(_) | Verdict::CutOff(_) | Verdict::Lost(_) => {}
        }
        (self.succession.on_verdict)(self.id, v);
    }
}

/// The node's handle on its watcher's tick (the actor's state does not name the transport).
pub(crate) struct Tick(pub(crate) Box<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for Tick {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tick")
    }
}

//! The node's view of the transport: `Finish` and the run's summary are taken out of its stream,
//! and the coordinator's last word is timed (its liveness, as this node sees it).

use std::sync::Arc;

use ravnest_protocol::msg::{Addr, Envelope};
use ravnest_runtime::tcp::TcpTransport;
use ravnest_runtime::{Inbox, Transport, TransportError};
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;

/// The transport, with `Finish` for this process's node taken out of the node's stream, and
/// the time anything last came from the coordinator (its liveness, as this node sees it).
#[derive(Clone, Debug)]
pub(super) struct Tap {
    pub inner: TcpTransport,
    pub finish: Arc<Notify>,
    /// ms since `t0` of the coordinator's last envelope; `u64::MAX` before the first.
    pub heard: Arc<std::sync::atomic::AtomicU64>,
    pub t0: Instant,
    /// Set when the first work arrives: training started here.
    pub started: Arc<std::sync::OnceLock<std::time::Instant>>,
    /// The run's final report, when the coordinator's host sends it.
    pub summary: mpsc::UnboundedSender<String>,
    /// Set when the coordinator's first replica arrives: fail-over is possible from then on
    /// (the node's watch decides; see `worker`).
    pub armed: Arc<std::sync::atomic::AtomicBool>,
    /// What a joiner is handed (origin, text, steps), with the nodes that joined since appended
    /// as they are announced (`Member`).
    pub share: super::admission::Shared,
}

impl Transport for Tap {
    fn register(&self, addr: Addr, inbox: Inbox) {
        let (finish, heard, t0) = (self.finish.clone(), self.heard.clone(), self.t0);
        let started = self.started.clone();
        let summary = self.summary.clone();
        let armed = self.armed.clone();
        let share = self.share.clone();
        self.inner.register(
            addr,
            Arc::new(move |from, env| {
                if from == Addr::Coordinator {
                    let ms = t0.elapsed().as_millis() as u64;
                    heard.store(ms, std::sync::atomic::Ordering::Relaxed);
                }
                match env {
                    Envelope::Finish => finish.notify_one(),
                    Envelope::Member { name, address, .. } => {
                        super::admission::learn_member(&share, &name, &address);
                    }
                    Envelope::Summary(text) => {
                        let _ = summary.send(text);
                    }
                    env => {
                        if matches!(env, Envelope::Succession(_)) {
                            armed.store(true, std::sync::atomic::Ordering::Relaxed);
                        }
                        if matches!(env, Envelope::Work(_)) {
                            let _ = started.set(std::time::Instant::now());
                        }
                        inbox(from, env)
                    }
                }
            }),
        );
    }

    fn send(&self, from: Addr, to: Addr, env: Envelope) -> Result<(), TransportError> {
        self.inner.send(from, to, env)
    }

    fn set_coordinator(&self, host: ravnest_core::NodeId) {
        self.inner.set_coordinator(host);
    }

    fn in_flight(&self, from: Addr, to: Addr) -> usize {
        self.inner.in_flight(from, to)
    }

    fn progress(&self, from: Addr, to: Addr) -> Option<ravnest_runtime::seams::Progress<'_>> {
        self.inner.progress(from, to)
    }

    fn stored(&self) {
        self.inner.stored();
    }
}

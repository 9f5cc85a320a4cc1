//! Joiners (`ravnest run --join`): what this process answers a node that asks for the cluster
//! file. A node the file names gets the file. A new node (a name the file lacks, with an
//! address) gets its id from the coordinator's host only: the next one, its section appended to
//! the file handed out and the coordinator told in the same breath, so that two joiners never
//! share an id; any other node sends it to the coordinator's host.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use ravnest_core::{NodeId, Scenario};
use ravnest_protocol::msg::{Addr, Envelope};
use ravnest_runtime::Transport;
use ravnest_runtime::tcp::{JoinRequest, ShareReply, TcpTransport};

use super::{member_section, newcomer_document, share_document, with_coordinator};

/// What a process hands joiners: (origin, cluster file text, steps).
pub(super) type Shared = Arc<Mutex<Option<(String, String, u64)>>>;

/// How this process answers joiners.
#[derive(Clone)]
pub(super) struct Admission {
    /// The cluster file as handed out, kept current as nodes join.
    pub share: Shared,
    /// Whether this process hosts the running coordinator now, and whether it is current.
    pub hosting: Arc<Hosted>,
    pub tcp: TcpTransport,
    pub me: NodeId,
}

impl Admission {
    /// Answer the joiners of `tcp` from now on (for node `me`, with the file `share`); returns
    /// the flag that says whether this process hosts the coordinator (see [`Hosting`]).
    pub fn install(share: &Shared, tcp: &TcpTransport, me: NodeId, silence_ms: u64) -> Arc<Hosted> {
        let hosting = Arc::new(Hosted::new(silence_ms));
        let admission = Admission {
            share: share.clone(),
            hosting: hosting.clone(),
            tcp: tcp.clone(),
            me,
        };
        tcp.set_sharer(Arc::new(move |r| admission.answer(r)));
        hosting
    }

    /// The answer to `r`.
    pub fn answer(&self, r: &JoinRequest) -> ShareReply {
        let mut share = self.share.lock().unwrap_or_else(|e| e.into_inner());
        let Some((origin, text, steps)) = share.as_mut() else {
            return ShareReply::Refused("this node does not share its cluster file".into());
        };
        let scenario = match ravnest_train::folder::parse_scenario(text, origin) {
            Ok(s) => s,
            Err(e) => return ShareReply::Refused(format!("its cluster file does not parse: {e}")),
        };
        let known = scenario.cluster.nodes.iter().any(|n| n.name == r.name);
        let hosting = self.hosting.is_on();
        if hosting && !self.hosting.current() {
            // This process was frozen or cut off past the failure timeout: a successor may be
            // taking over, so it gives no file and no place until it knows. Sent back here,
            // the joiner asks again a moment later.
            return match self.tcp.dial_addr(self.me) {
                Some(a) => ShareReply::Elsewhere(a.to_string()),
                None => ShareReply::Refused("the coordinator is out of touch: try again".into()),
            };
        }
        let host = if hosting {
            self.me
        } else {
            self.tcp.coordinator()
        };
        if known || r.name.is_empty() || r.address.is_empty() {
            let doc = share_document(origin, text, *steps);
            return ShareReply::File(with_coordinator(doc, host));
        }
        if !hosting {
            // This node's own address when it is to host but does not yet (training has not
            // started, or it is taking over right now): the joiner asks again a moment later.
            return match self.tcp.dial_addr(host) {
                Some(a) => ShareReply::Elsewhere(a.to_string()),
                None => ShareReply::Refused(
                    "the cluster does not train yet, so it admits no new node: try again once it does"
                        .into(),
                ),
            };
        }
        let id = NodeId(scenario.cluster.nodes.len() as u32);
        append_member(&scenario, text, &r.name, &r.address);
        // Under the lock: the coordinator hears of ids in the order they were given.
        let _ = self.tcp.send(
            Addr::Node(self.me),
            Addr::Coordinator,
            Envelope::Reserve {
                id,
                name: r.name.clone(),
                address: r.address.clone(),
            },
        );
        let doc = newcomer_document(origin, text, *steps, &r.name);
        ShareReply::File(with_coordinator(doc, self.me))
    }
}

/// Append node `name` (reached at `address`) to the cluster file `text` (whose parsed form is
/// `parsed`), like the file's first node: the section every process adds for a node that
/// joined, in id order, so that every process numbers the nodes alike.
fn append_member(parsed: &Scenario, text: &mut String, name: &str, address: &str) {
    let device = parsed
        .cluster
        .nodes
        .first()
        .map_or("cpu", |n| n.device.as_str());
    text.push_str(&member_section(name, device, address));
}

/// A node that joined (`Member`, from the coordinator): appended to the file this process
/// hands out, unless the file has it already (this process gave it its place).
pub(super) fn learn_member(share: &Shared, name: &str, address: &str) {
    let mut share = share.lock().unwrap_or_else(|e| e.into_inner());
    let Some((origin, text, _)) = share.as_mut() else {
        return;
    };
    if let Ok(parsed) = ravnest_train::folder::parse_scenario(text, origin)
        && !parsed.cluster.nodes.iter().any(|n| n.name == name)
    {
        append_member(&parsed, text, name, address);
    }
}

/// Whether the coordinator runs in this process, and when it last proved current: the
/// moment a step was last agreed (every node that computed it answered), beside the usual time
/// between two.
#[derive(Debug)]
pub(super) struct Hosted {
    on: AtomicBool,
    t0: Instant,
    /// ms since `t0` of the last agreed step (`u64::MAX`: none since hosting began).
    last_ms: AtomicU64,
    /// The usual ms between two agreed steps (a moving average).
    gap_ms: AtomicU64,
    /// The silence after which nodes suspect the coordinator, ms.
    silence_ms: u64,
}

impl Hosted {
    pub fn new(silence_ms: u64) -> Hosted {
        Hosted {
            on: AtomicBool::new(false),
            t0: Instant::now(),
            last_ms: AtomicU64::new(u64::MAX),
            gap_ms: AtomicU64::new(0),
            silence_ms,
        }
    }

    /// Whether the coordinator runs here.
    pub fn is_on(&self) -> bool {
        self.on.load(Ordering::SeqCst)
    }

    /// A step was agreed.
    pub fn beat(&self) {
        let now = self.t0.elapsed().as_millis() as u64;
        let last = self.last_ms.swap(now, Ordering::SeqCst);
        if last != u64::MAX {
            let gap = self.gap_ms.load(Ordering::SeqCst);
            let next = (gap * 7 + now.saturating_sub(last)) / 8;
            self.gap_ms.store(next, Ordering::SeqCst);
        }
    }

    /// Whether the coordinator hosted here is current ([`is_current`]), now.
    pub fn current(&self) -> bool {
        let now = self.t0.elapsed().as_millis() as u64;
        is_current(
            now,
            self.last_ms.load(Ordering::SeqCst),
            self.gap_ms.load(Ordering::SeqCst),
            self.silence_ms,
        )
    }
}

/// Whether a coordinator whose last step was agreed at `last_ms` (`u64::MAX`: none yet) is
/// current at `now_ms`: within the nodes' silence, or four of its usual gaps between steps when
/// its steps are slower than that. One that was frozen or cut off past it may have been taken
/// over, and must not admit nodes until it knows.
pub(super) fn is_current(now_ms: u64, last_ms: u64, gap_ms: u64, silence_ms: u64) -> bool {
    last_ms == u64::MAX || now_ms.saturating_sub(last_ms) <= silence_ms.max(4 * gap_ms)
}

/// Set while the coordinator runs in this process (cleared when dropped, by any way out).
pub(super) struct Hosting(pub Arc<Hosted>);

impl Hosting {
    pub fn start(flag: &Arc<Hosted>) -> Hosting {
        flag.last_ms.store(u64::MAX, Ordering::SeqCst);
        flag.gap_ms.store(0, Ordering::SeqCst);
        flag.on.store(true, Ordering::SeqCst);
        Hosting(flag.clone())
    }
}

impl Drop for Hosting {
    fn drop(&mut self) {
        self.0.on.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::is_current;

    /// Current within the silence, or four usual gaps when steps are slower; out of touch past
    /// it (a host frozen 6.7 s with steps every 50 ms); current before any step is agreed.
    #[test]
    fn a_host_out_of_touch_is_not_current() {
        assert!(is_current(10_000, u64::MAX, 0, 3000));
        assert!(is_current(10_000, 9_950, 50, 3000));
        assert!(is_current(10_000, 7_000, 50, 3000));
        assert!(!is_current(10_000, 3_300, 50, 3000));
        assert!(is_current(100_000, 10_000, 30_000, 3000));
        assert!(!is_current(200_000, 10_000, 30_000, 3000));
    }
}

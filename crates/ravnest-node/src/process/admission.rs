//! Joiners (`ravnest run --join`): what this process answers a node that asks for the cluster
//! file. A node the file names gets the file. A new node (a name the file lacks, with an
//! address) gets its id from the coordinator's host only: the next one, its section appended to
//! the file handed out and the coordinator told in the same breath, so that two joiners never
//! share an id; any other node sends it to the coordinator's host.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use ravnest_core::{NodeId, Scenario};
use ravnest_runtime::tcp::{JoinRequest, ShareReply, TcpTransport};
use ravnest_runtime::{Addr, Envelope, Transport};

use super::{member_section, newcomer_document, share_document};

/// What a process hands joiners: (origin, cluster file text, steps).
pub(super) type Shared = Arc<Mutex<Option<(String, String, u64)>>>;

/// How this process answers joiners.
#[derive(Clone)]
pub(super) struct Admission {
    /// The cluster file as handed out, kept current as nodes join.
    pub share: Shared,
    /// Whether this process hosts the running coordinator now.
    pub hosting: Arc<AtomicBool>,
    pub tcp: TcpTransport,
    pub me: NodeId,
}

impl Admission {
    /// Answer the joiners of `tcp` from now on (for node `me`, with the file `share`); returns
    /// the flag that says whether this process hosts the coordinator (see [`Hosting`]).
    pub fn install(share: &Shared, tcp: &TcpTransport, me: NodeId) -> Arc<AtomicBool> {
        let hosting = Arc::new(AtomicBool::new(false));
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
        if known || r.name.is_empty() || r.address.is_empty() {
            return ShareReply::File(share_document(origin, text, *steps));
        }
        if !self.hosting.load(Ordering::SeqCst) {
            let host = self.tcp.coordinator();
            return match self.tcp.dial_addr(host).filter(|_| host != self.me) {
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
        ShareReply::File(newcomer_document(origin, text, *steps, &r.name))
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

/// Set while the coordinator runs in this process (cleared when dropped, by any way out).
pub(super) struct Hosting(pub Arc<AtomicBool>);

impl Hosting {
    pub fn start(flag: &Arc<AtomicBool>) -> Hosting {
        flag.store(true, Ordering::SeqCst);
        Hosting(flag.clone())
    }
}

impl Drop for Hosting {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

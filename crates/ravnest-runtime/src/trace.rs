//! The trace: every delivered message and every event, with its virtual time, folded into one
//! hash. Same seed, same hash.

use std::sync::{Arc, Mutex};

use ravnest_protocol::digest::Fnv;
use ravnest_protocol::msg::Addr;

/// One trace line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceEntry {
    /// Virtual time, ns since the start.
    pub t_ns: u64,
    /// What happened (`deliver chunk`, `dead`, `crash`, ...).
    pub what: String,
    /// Sender / subject.
    pub from: Option<Addr>,
    /// Receiver.
    pub to: Option<Addr>,
    /// Payload digest.
    pub digest: u64,
}

#[derive(Debug, Default)]
struct Inner {
    hash: Fnv,
    count: u64,
    kept: Vec<TraceEntry>,
    keep: bool,
}

/// A shared, append-only trace.
#[derive(Debug, Clone, Default)]
pub struct Trace(Arc<Mutex<Inner>>);

fn addr_code(a: Option<Addr>) -> u64 {
    match a {
        None => u64::MAX,
        Some(Addr::Coordinator) => u64::MAX - 1,
        Some(Addr::Checkpoint) => u64::MAX - 2,
        Some(Addr::Node(n)) => u64::from(n.0),
    }
}

impl Trace {
    /// A trace that keeps every entry (for printing); the default keeps only the hash.
    pub fn keeping() -> Self {
        let t = Trace::default();
        t.0.lock().unwrap().keep = true;
        t
    }

    /// Record one entry.
    pub fn record(&self, t_ns: u64, what: &str, from: Option<Addr>, to: Option<Addr>, digest: u64) {
        let mut g = self.0.lock().unwrap();
        g.hash.u64(t_ns);
        g.hash.bytes(what.as_bytes());
        g.hash.u64(addr_code(from));
        g.hash.u64(addr_code(to));
        g.hash.u64(digest);
        g.count += 1;
        if g.keep {
            g.kept.push(TraceEntry {
                t_ns,
                what: what.to_string(),
                from,
                to,
                digest,
            });
        }
    }

    /// The hash of everything recorded so far.
    pub fn hash(&self) -> u64 {
        self.0.lock().unwrap().hash.finish()
    }

    /// Entries recorded.
    pub fn len(&self) -> u64 {
        self.0.lock().unwrap().count
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Kept entries (empty unless made with [`Trace::keeping`]).
    pub fn entries(&self) -> Vec<TraceEntry> {
        self.0.lock().unwrap().kept.clone()
    }
}

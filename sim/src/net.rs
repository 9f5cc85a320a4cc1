//! SimNet: the simulated side of the [`Transport`] seam.
//!
//! Each directed link is a FIFO pipe (two, in fact: control messages have their own): a message waits until the link is free, occupies it for
//! bytes ÷ bandwidth (serialization), then arrives after the link's latency plus seeded jitter
//! (never before an earlier message on the same link). Bulk messages also share each node's
//! network interface: a transfer starts only when the sender's egress and the receiver's
//! ingress are free, and holds each for bytes ÷ that node's own access bandwidth. So a
//! parameter server that receives every worker's gradient at once takes them one after
//! another at its NIC's rate, instead of all in parallel. Crashed nodes and partitions drop
//! messages, at send time and again at delivery. One task delivers everything in (time,
//! sequence) order on tokio's paused clock, so a run is a pure function of its seed.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex};

use ravnest_core::{ClusterSpec, Link, NodeId};
use ravnest_protocol::msg::{Addr, Envelope};
use ravnest_runtime::{Inbox, Trace, Transport, TransportError};
use tokio::sync::Notify;
use tokio::time::{Duration, Instant};

use crate::rng::Rng;

/// Fraction of a link's latency added as uniform jitter.
pub const JITTER: f64 = 0.1;

/// An envelope on its way: (from, to, the envelope, the sending and receiving nodes). The
/// nodes are resolved when it is sent: the coordinator's address means the host the sender's
/// process believes in then (as a connection to that host would carry it).
type Queued = (Addr, Addr, Envelope, NodeId, NodeId);

/// A fast hasher for the pipe map's small integer keys (multiply-rotate; SipHash's DoS
/// resistance buys nothing here). Deterministic, and nothing iterates the map.
#[derive(Default)]
struct PipeHasher(u64);

impl Hasher for PipeHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(23) ^ x).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// Messages in flight, delivered in (arrival time, send sequence) order. The heap holds small
/// keys; the envelopes stay put in a slab until delivered (moving them on every heap step
/// was a tenth of the simulator's time).
#[derive(Default)]
struct Queue {
    heap: BinaryHeap<Reverse<(u64, u64, u32)>>,
    slab: Vec<Option<Queued>>,
    free: Vec<u32>,
}

impl Queue {
    fn push(&mut self, at: u64, seq: u64, q: Queued) {
        let i = match self.free.pop() {
            Some(i) => {
                self.slab[i as usize] = Some(q);
                i
            }
            None => {
                self.slab.push(Some(q));
                (self.slab.len() - 1) as u32
            }
        };
        self.heap.push(Reverse((at, seq, i)));
    }

    /// The earliest arrival time.
    fn next_at(&self) -> Option<u64> {
        self.heap.peek().map(|r| r.0.0)
    }

    /// The earliest message, if it arrives by `now`.
    fn pop_due(&mut self, now: u64) -> Option<(u64, u64, Queued)> {
        let &Reverse((t, seq, i)) = self.heap.peek()?;
        if t > now {
            return None;
        }
        self.heap.pop();
        self.free.push(i);
        let q = self.slab[i as usize].take().expect("queued");
        Some((t, seq, q))
    }
}

#[derive(Debug)]
struct Pipe {
    free_at: u64,
    last_at: u64,
    /// The last arrival on a whole millisecond, and what arrivals were put off by so far.
    last_tick: u64,
    carry_ns: i64,
    rng: Rng,
    /// The link, as of `State::link_gen` = `link_gen` (looked up once, not per message).
    link: Link,
    link_gen: u64,
}

struct State {
    cluster: ClusterSpec,
    /// The node whose process hosts the coordinator.
    host: NodeId,
    seed: u64,
    t0: Instant,
    trace: Trace,
    /// Per (address, the node whose process registered it): a coordinator of an older term
    /// may still run on one node while its successor runs on another.
    inboxes: BTreeMap<(Addr, NodeId), Inbox>,
    /// Per node: where its process believes the coordinator is (it follows a successor when
    /// its watch decides; a stale host believes in itself until told of the newer term).
    views: BTreeMap<NodeId, NodeId>,
    down: BTreeSet<NodeId>,
    /// Active partitions: a message crosses only if both ends are in the same group (or one end
    /// is in no group).
    partitions: Vec<Vec<Vec<NodeId>>>,
    /// Degraded links (both directions), stacked: the last one applies.
    degraded: BTreeMap<(NodeId, NodeId), Vec<Link>>,
    /// Bumped whenever a link changes (pipes re-read their link).
    link_gen: u64,
    /// Per directed pipe (from, to, class): when it is next free, the last arrival (FIFO),
    /// and its jitter stream. Hash maps for O(1) look-ups only: nothing iterates them, so
    /// their order cannot leak into the run.
    pipes: HashMap<(NodeId, NodeId, u64), Pipe, BuildHasherDefault<PipeHasher>>,
    /// Per node: when its interface is next free to send, and to receive, bulk data (ns).
    egress_free: Vec<u64>,
    ingress_free: Vec<u64>,
    queue: Queue,
    /// The arrival time the delivery loop sleeps until (`u64::MAX`: it waits for any send). A
    /// send that arrives later needs no wake-up: the loop will see it when it wakes.
    armed_at: u64,
    seq: u64,
    bytes_sent: Vec<u64>,
    dropped: u64,
    /// Connection resets: (lower end, higher end, first sequence number sent after it).
    resets: Vec<(NodeId, NodeId, u64)>,
}

/// `exact_ns` on a whole millisecond, no earlier than `floor_ns`. Tokio's timer wakes on whole
/// milliseconds and rounds every deadline up, which made each message hop and each compute
/// phase half a millisecond longer on average: a 2-node ring of a 12 ms step took 2.0 ms where
/// its links say 1.5. Rounded to the nearest instead, with the running remainder (`carry_ns`,
/// kept within a millisecond either way) added to the next time, the times stay on the timer's
/// grid and their mean is exact.
pub fn on_tick(exact_ns: u64, carry_ns: &mut i64, floor_ns: u64) -> u64 {
    const MS: i64 = 1_000_000;
    let want = exact_ns as i64 + *carry_ns;
    let tick = ((want + MS / 2).div_euclid(MS) * MS)
        .max(floor_ns as i64)
        .max(0);
    *carry_ns = (want - tick).clamp(-MS, MS);
    tick as u64
}

/// The simulated network (cheap to clone: a handle).
#[derive(Clone)]
pub struct SimNet {
    state: Arc<Mutex<State>>,
    wake: Arc<Notify>,
    /// The process this handle is used by ([`Transport::at`]), if one: its coordinator's
    /// envelopes leave from there, and its node follows a new coordinator on its own.
    me: Option<NodeId>,
}

impl std::fmt::Debug for SimNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SimNet")
    }
}

impl State {
    fn now_ns(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }

    fn known(&self, a: Addr) -> bool {
        match a {
            Addr::Coordinator | Addr::Checkpoint => true,
            Addr::Node(n) => n.index() < self.cluster.nodes.len(),
        }
    }

    fn reachable(&self, a: NodeId, b: NodeId) -> bool {
        if self.down.contains(&a) || self.down.contains(&b) {
            return false;
        }
        self.partitions.iter().all(|groups| {
            let ga = groups.iter().position(|g| g.contains(&a));
            let gb = groups.iter().position(|g| g.contains(&b));
            ga.is_none() || gb.is_none() || ga == gb
        })
    }

    fn link(&self, a: NodeId, b: NodeId) -> Link {
        let key = (a.min(b), a.max(b));
        match self.degraded.get(&key).and_then(|v| v.last()) {
            Some(l) => *l,
            None => self.cluster.link(a, b),
        }
    }
}

impl SimNet {
    /// The node hosting the coordinator now.
    pub fn host(&self) -> NodeId {
        self.state.lock().unwrap().host
    }

    /// A network over `cluster`, the coordinator hosted on `host`.
    pub fn new(cluster: ClusterSpec, host: NodeId, seed: u64, t0: Instant, trace: Trace) -> Self {
        let views = cluster.ids().map(|n| (n, host)).collect();
        SimNet {
            state: Arc::new(Mutex::new(State {
                bytes_sent: vec![0; cluster.nodes.len()],
                egress_free: vec![0; cluster.nodes.len()],
                ingress_free: vec![0; cluster.nodes.len()],
                cluster,
                host,
                seed,
                t0,
                trace,
                inboxes: BTreeMap::new(),
                views,
                down: BTreeSet::new(),
                partitions: Vec::new(),
                degraded: BTreeMap::new(),
                link_gen: 0,
                pipes: HashMap::default(),
                queue: Queue::default(),
                armed_at: u64::MAX,
                seq: 0,
                dropped: 0,
                resets: Vec::new(),
            })),
            wake: Arc::new(Notify::new()),
            me: None,
        }
    }

    /// The delivery loop; run it as a task for the whole simulation.
    pub async fn run(self) {
        let t0 = self.state.lock().unwrap().t0;
        // One timer, re-armed for each next arrival (not a new one per message).
        let sleep = tokio::time::sleep_until(t0);
        tokio::pin!(sleep);
        loop {
            let next = {
                let mut s = self.state.lock().unwrap();
                let next = s.queue.next_at();
                s.armed_at = next.unwrap_or(u64::MAX);
                next
            };
            match next {
                None => self.wake.notified().await,
                Some(t_ns) => {
                    sleep.as_mut().reset(t0 + Duration::from_nanos(t_ns));
                    tokio::select! {
                        biased;
                        _ = &mut sleep => self.deliver_due(),
                        _ = self.wake.notified() => {}
                    }
                }
            }
        }
    }

    fn deliver_due(&self) {
        let mut out: Vec<(Inbox, Addr, Envelope)> = Vec::new();
        {
            let mut s = self.state.lock().unwrap();
            let now = s.now_ns();
            while let Some((t, seq, (from, to, env, a, b))) = s.queue.pop_due(now) {
                let inbox = s.inboxes.get(&(to, b)).cloned();
                let key = (a.min(b), a.max(b));
                let cut = s
                    .resets
                    .iter()
                    .any(|&(x, y, bound)| (x, y) == key && seq < bound);
                if a != b && (!s.reachable(a, b) || cut) || inbox.is_none() {
                    s.dropped += 1;
                    s.trace
                        .record(t, "drop", Some(from), Some(to), env.digest());
                    continue;
                }
                s.trace
                    .record(t, env.kind(), Some(from), Some(to), env.digest());
                out.push((inbox.expect("checked"), from, env));
            }
        }
        for (inbox, from, env) in out {
            inbox(from, env);
        }
    }

    /// Crash a node: it sends and receives nothing until [`restart`](Self::restart).
    pub fn crash(&self, node: NodeId) {
        let mut s = self.state.lock().unwrap();
        s.down.insert(node);
        s.inboxes.remove(&(Addr::Node(node), node));
    }

    /// Bring a crashed node's links back (its process re-registers its inbox).
    pub fn restart(&self, node: NodeId) {
        let mut s = self.state.lock().unwrap();
        s.down.remove(&node);
        // The restarted process finds the coordinator that runs now.
        let host = s.host;
        s.views.insert(node, host);
    }

    /// Reset the connection between `a` and `b`: what is in flight between them, either way,
    /// is lost (a transport without sessions, or a session that had to restart).
    pub fn reset(&self, a: NodeId, b: NodeId) {
        let mut s = self.state.lock().unwrap();
        let bound = s.seq;
        s.resets.push((a.min(b), a.max(b), bound));
    }

    /// Start a partition (groups of nodes that cannot reach each other).
    pub fn partition(&self, groups: Vec<Vec<NodeId>>) {
        self.state.lock().unwrap().partitions.push(groups);
    }

    /// End the oldest partition with these groups.
    pub fn heal(&self, groups: &[Vec<NodeId>]) {
        let mut s = self.state.lock().unwrap();
        if let Some(i) = s.partitions.iter().position(|g| g == groups) {
            s.partitions.remove(i);
        }
    }

    /// Degrade the link a–b (both directions) until [`restore`](Self::restore).
    pub fn degrade(&self, a: NodeId, b: NodeId, link: Link) {
        let mut s = self.state.lock().unwrap();
        s.link_gen += 1;
        s.degraded
            .entry((a.min(b), a.max(b)))
            .or_default()
            .push(link);
    }

    /// Undo the oldest degradation of a–b.
    pub fn restore(&self, a: NodeId, b: NodeId) {
        let mut s = self.state.lock().unwrap();
        s.link_gen += 1;
        if let Some(v) = s.degraded.get_mut(&(a.min(b), a.max(b)))
            && !v.is_empty()
        {
            v.remove(0);
        }
    }

    /// Bytes each node put on the wire.
    pub fn bytes_sent(&self) -> BTreeMap<NodeId, u64> {
        let s = self.state.lock().unwrap();
        s.bytes_sent
            .iter()
            .enumerate()
            .map(|(i, &b)| (NodeId(i as u32), b))
            .collect()
    }

    /// Messages dropped (to or from a down node, across a partition).
    pub fn dropped(&self) -> u64 {
        self.state.lock().unwrap().dropped
    }
}

impl Transport for SimNet {
    fn register(&self, addr: Addr, inbox: Inbox) {
        let mut s = self.state.lock().unwrap();
        let owner = match addr {
            Addr::Node(n) => n,
            Addr::Coordinator | Addr::Checkpoint => self.me.unwrap_or(s.host),
        };
        s.inboxes.insert((addr, owner), inbox);
    }

    /// A node's process follows a new coordinator (its own view); the simulator's own handle
    /// moves the coordinator the simulation considers current (a successor started).
    fn set_coordinator(&self, host: NodeId) {
        let mut s = self.state.lock().unwrap();
        match self.me {
            Some(n) => {
                s.views.insert(n, host);
            }
            None => s.host = host,
        }
    }

    fn at(&self, node: NodeId) -> Self {
        SimNet {
            me: Some(node),
            ..self.clone()
        }
    }

    fn send(&self, from: Addr, to: Addr, env: Envelope) -> Result<(), TransportError> {
        let mut s = self.state.lock().unwrap();
        if !s.known(to) {
            return Err(TransportError::Unknown(to));
        }
        if !s.known(from) {
            return Err(TransportError::Unknown(from));
        }
        let a = match from {
            Addr::Node(n) => n,
            Addr::Coordinator | Addr::Checkpoint => self.me.unwrap_or(s.host),
        };
        let b = match (to, from) {
            (Addr::Node(n), _) => n,
            (_, Addr::Node(n)) => s.views.get(&n).copied().unwrap_or(s.host),
            // The coordinator to its checkpoint actor: the same process.
            _ => a,
        };
        if s.down.contains(&a) {
            return Err(TransportError::SenderDown(from));
        }
        let now = s.now_ns();
        let arrive = if a == b {
            now // same process: no network
        } else {
            let bytes = env.wire_bytes();
            s.bytes_sent[a.index()] += bytes;
            // Control messages travel on their own connection: a heartbeat does not wait behind
            // a gradient (pipe 1 is bulk data, pipe 0 control).
            let class = u64::from(env.is_bulk());
            let (seed, generation) = (s.seed, s.link_gen);
            let link = match s.pipes.get(&(a, b, class)) {
                Some(p) if p.link_gen == generation => p.link,
                _ => s.link(a, b),
            };
            let ser_ns = (bytes as f64 * 8.0 / (link.bandwidth_gbps * 1e9) * 1e9) as u64;
            let pipe = s.pipes.entry((a, b, class)).or_insert_with(|| Pipe {
                free_at: 0,
                last_at: 0,
                last_tick: 0,
                carry_ns: 0,
                rng: Rng::derive(seed, &[1, u64::from(a.0), u64::from(b.0), class]),
                link,
                link_gen: generation,
            });
            pipe.link = link;
            pipe.link_gen = generation;
            let mut start = now.max(pipe.free_at);
            if class == 1 {
                start = start
                    .max(s.egress_free[a.index()])
                    .max(s.ingress_free[b.index()]);
            }
            let pipe = s.pipes.get_mut(&(a, b, class)).expect("just made");
            pipe.free_at = start + ser_ns;
            let lat_ns = (link.latency_ms * 1e6 * (1.0 + JITTER * pipe.rng.unit())) as u64;
            pipe.last_at = (pipe.free_at + lat_ns).max(pipe.last_at);
            // In order on the pipe, never before the send.
            let floor = now.max(pipe.last_tick);
            pipe.last_tick = on_tick(pipe.last_at, &mut pipe.carry_ns, floor);
            let arrive = pipe.last_tick;
            if class == 1 {
                // Each interface is busy for the bytes at its own rate (a slow pair link holds
                // the transfer longer, not the faster end's interface).
                let nic_ns = |bw_gbps: f64| (bytes as f64 * 8.0 / (bw_gbps * 1e9) * 1e9) as u64;
                let (bw_a, bw_b) = (
                    s.cluster.nodes[a.index()].link.bandwidth_gbps,
                    s.cluster.nodes[b.index()].link.bandwidth_gbps,
                );
                s.egress_free[a.index()] = start + nic_ns(bw_a).min(ser_ns);
                s.ingress_free[b.index()] = start + nic_ns(bw_b).min(ser_ns);
            }
            arrive
        };
        let seq = s.seq;
        s.seq += 1;
        s.queue.push(arrive, seq, (from, to, env, a, b));
        let wake = arrive < s.armed_at;
        if wake {
            s.armed_at = arrive;
        }
        drop(s);
        if wake {
            self.wake.notify_one();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tick_tests {
    use super::on_tick;
    use crate::rng::Rng;

    /// Times land on whole milliseconds, never before their floor, and their sum stays within
    /// a millisecond of the exact sum (the timer's rounding up added half a millisecond per
    /// time). Seeded: a failure names its seed.
    #[test]
    fn ticks_are_whole_milliseconds_and_exact_on_average() {
        for seed in 0..200 {
            let mut rng = Rng::derive(seed, &[9]);
            let (mut carry, mut floor, mut exact, mut ticked) = (0i64, 0u64, 0u64, 0u64);
            for _ in 0..(1 + rng.next_u64() % 300) {
                let t = rng.next_u64() % 5_000_000;
                let tick = on_tick(floor + t, &mut carry, floor);
                assert_eq!(tick % 1_000_000, 0, "seed {seed}");
                assert!(tick >= floor, "seed {seed}");
                exact += t;
                ticked += tick - floor;
                floor = tick;
            }
            let off = exact as i64 - ticked as i64;
            assert!(off.abs() <= 1_000_000, "seed {seed}: {exact} vs {ticked}");
        }
    }
}

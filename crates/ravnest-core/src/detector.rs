//! A heartbeat failure detector as a pure state machine.
//!
//! Time is passed in (milliseconds on whatever clock the driver uses: tokio's paused clock in
//! the simulator, the real one in `run`). Any message from a peer counts as a heartbeat. A peer
//! silent for longer than the timeout, or whose connection the transport reports lost, is
//! declared dead exactly once; it comes back only through [`FailureDetector::watch`] (a rejoin
//! is a new incarnation, not a late heartbeat).

use std::collections::BTreeMap;

use crate::cluster::NodeId;
use crate::stall::{StallClock, credited};

/// What the detector concluded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DetectorEvent {
    /// The peer is considered gone.
    Dead {
        /// The peer.
        node: NodeId,
        /// How long it had been silent when declared, ms.
        silent_ms: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Peer {
    last_heard_ms: u64,
    dead: bool,
}

/// Heartbeat failure detector over a set of peers.
#[derive(Debug, Clone)]
pub struct FailureDetector {
    timeout_ms: u64,
    peers: BTreeMap<NodeId, Peer>,
    /// Ticks further apart than this mean the detector itself was not running (its process
    /// frozen, swapped out, suspended): nobody could be heard meanwhile, so that time is not
    /// counted as anyone's silence. `None`: every gap counts.
    stall: StallClock,
}

impl FailureDetector {
    /// A detector that declares a peer dead after `timeout_ms` of silence.
    pub fn new(timeout_ms: u64) -> Self {
        assert!(timeout_ms > 0, "a zero timeout would declare everyone dead");
        FailureDetector {
            timeout_ms,
            peers: BTreeMap::new(),
            stall: StallClock::new(None),
        }
    }

    /// The same, for a driver that ticks at least every `stall_ms`: a longer gap between two
    /// ticks is the detector's own stall, and is not counted as silence of the peers.
    pub fn with_stall_limit(mut self, stall_ms: u64) -> Self {
        self.stall = StallClock::new(Some(stall_ms));
        self
    }

    /// The timeout.
    pub fn timeout_ms(&self) -> u64 {
        self.timeout_ms
    }

    /// Start (or restart, after a rejoin) watching `node`, as if just heard. The first watch
    /// also starts the clock of the stall rule: a stall before the first tick (a coordinator
    /// frozen right after it started) is the detector's own too.
    pub fn watch(&mut self, node: NodeId, now_ms: u64) {
        self.stall.start(now_ms);
        self.peers.insert(
            node,
            Peer {
                last_heard_ms: now_ms,
                dead: false,
            },
        );
    }

    /// Stop watching `node` (it left cleanly).
    pub fn unwatch(&mut self, node: NodeId) {
        self.peers.remove(&node);
    }

    /// Any message from `node` arrived. Ignored for unknown or dead peers.
    pub fn heard(&mut self, node: NodeId, now_ms: u64) {
        if let Some(p) = self.peers.get_mut(&node)
            && !p.dead
        {
            p.last_heard_ms = p.last_heard_ms.max(now_ms);
        }
    }

    /// The transport lost the connection to `node`: dead now, without waiting for the timeout.
    pub fn peer_down(&mut self, node: NodeId, now_ms: u64) -> Option<DetectorEvent> {
        let p = self.peers.get_mut(&node)?;
        if p.dead {
            return None;
        }
        p.dead = true;
        Some(DetectorEvent::Dead {
            node,
            silent_ms: now_ms.saturating_sub(p.last_heard_ms),
        })
    }

    /// Declare every peer silent for more than the timeout dead (in node order).
    pub fn tick(&mut self, now_ms: u64) -> Vec<DetectorEvent> {
        let stalled = self.stall.tick(now_ms);
        for p in self.peers.values_mut() {
            p.last_heard_ms = credited(p.last_heard_ms, stalled, now_ms);
        }
        let mut out = Vec::new();
        for (&node, p) in &mut self.peers {
            let silent = now_ms.saturating_sub(p.last_heard_ms);
            if !p.dead && silent > self.timeout_ms {
                p.dead = true;
                out.push(DetectorEvent::Dead {
                    node,
                    silent_ms: silent,
                });
            }
        }
        out
    }

    /// The earliest time at which [`tick`](Self::tick) could declare someone dead.
    pub fn next_deadline_ms(&self) -> Option<u64> {
        self.peers
            .values()
            .filter(|p| !p.dead)
            .map(|p| p.last_heard_ms + self.timeout_ms + 1)
            .min()
    }

    /// Peers currently alive, in order.
    pub fn alive(&self) -> Vec<NodeId> {
        self.peers
            .iter()
            .filter(|(_, p)| !p.dead)
            .map(|(&n, _)| n)
            .collect()
    }

    /// Whether `node` is watched and alive.
    pub fn is_alive(&self, node: NodeId) -> bool {
        self.peers.get(&node).is_some_and(|p| !p.dead)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Advance(u64),
        Heard(u32),
        Tick,
        Down(u32),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1u64..400).prop_map(Op::Advance),
            (0u32..4).prop_map(Op::Heard),
            Just(Op::Tick),
            (0u32..4).prop_map(Op::Down),
        ]
    }

    proptest! {
        /// Against a simple oracle (last heard time per peer): a peer is declared dead exactly
        /// once, never while its silence is within the timeout, and always at the first tick
        /// after the timeout passes.
        #[test]
        fn detector_matches_the_oracle(ops in prop::collection::vec(op(), 0..200)) {
            let timeout = 300;
            let mut d = FailureDetector::new(timeout);
            let mut now = 0u64;
            let mut last = [0u64; 4];
            let mut dead = [false; 4];
            for i in 0..4 { d.watch(NodeId(i), 0); }
            for o in ops {
                match o {
                    Op::Advance(dt) => now += dt,
                    Op::Heard(i) => { d.heard(NodeId(i), now); if !dead[i as usize] { last[i as usize] = now; } }
                    Op::Down(i) => {
                        let e = d.peer_down(NodeId(i), now);
                        prop_assert_eq!(e.is_some(), !dead[i as usize]);
                        dead[i as usize] = true;
                    }
                    Op::Tick => {
                        let events = d.tick(now);
                        for i in 0..4usize {
                            let should = !dead[i] && now - last[i] > timeout;
                            let did = events.iter().any(|e| matches!(e, DetectorEvent::Dead { node, .. } if node.0 as usize == i));
                            prop_assert_eq!(should, did, "peer {} at {} (last heard {})", i, now, last[i]);
                            if did { dead[i] = true; }
                        }
                    }
                }
                for i in 0..4u32 { prop_assert_eq!(d.is_alive(NodeId(i)), !dead[i as usize]); }
            }
        }
    }

    proptest! {
        /// With a stall limit, a gap between two ticks longer than the limit is credited to
        /// every peer (the detector was not running; nobody could be heard): a peer is dead
        /// once its silence, less those gaps, passes the timeout.
        #[test]
        fn the_detectors_own_stall_is_not_silence(
            ops in prop::collection::vec(op(), 0..200),
        ) {
            let (timeout, limit) = (300, 150);
            let mut d = FailureDetector::new(timeout).with_stall_limit(limit);
            let mut now = 0u64;
            let mut last_tick = 0u64;
            // Oracle: when each peer was last heard, moved later by the stalls since.
            let mut last = [0u64; 4];
            let mut dead = [false; 4];
            for i in 0..4 { d.watch(NodeId(i), 0); }
            d.tick(0);
            for o in ops {
                match o {
                    Op::Advance(dt) => now += dt,
                    Op::Heard(i) => last[i as usize] = now,
                    Op::Down(_) => continue,
                    Op::Tick => {}
                }
                if let Op::Heard(i) = o { d.heard(NodeId(i), now); continue; }
                if !matches!(o, Op::Tick) { continue; }
                let gap = now - last_tick;
                last_tick = now;
                if gap > limit {
                    for l in &mut last { *l = (*l + gap).min(now); }
                }
                let events = d.tick(now);
                for i in 0..4usize {
                    let should = !dead[i] && now - last[i] > timeout;
                    let did = events.iter().any(|e| matches!(e, DetectorEvent::Dead { node, .. } if node.0 as usize == i));
                    prop_assert_eq!(should, did, "peer {} at {}", i, now);
                    if did { dead[i] = true; }
                }
            }
        }
    }

    #[test]
    fn a_detector_frozen_before_its_first_tick_does_not_declare_everyone_dead() {
        let mut d = FailureDetector::new(300).with_stall_limit(150);
        d.watch(NodeId(1), 10);
        assert!(d.tick(5000).is_empty(), "a stall before the first tick");
        let dead: usize = (5100..=5400).step_by(100).map(|t| d.tick(t).len()).sum();
        assert_eq!(dead, 1, "then silence counts again");
    }

    #[test]
    fn a_frozen_detector_does_not_declare_everyone_dead_when_it_wakes() {
        let mut d = FailureDetector::new(300).with_stall_limit(150);
        d.watch(NodeId(1), 0);
        d.watch(NodeId(2), 0);
        for t in (0..=200).step_by(50) {
            d.heard(NodeId(1), t);
            assert!(d.tick(t).is_empty());
        }
        // Node 2 has been silent 200 ms when this process freezes for 2 s.
        assert!(d.tick(2200).is_empty(), "a stall is nobody's silence");
        d.heard(NodeId(1), 2210);
        // Node 2's silence before the freeze still counts: 200 + 101 > 300.
        assert_eq!(
            d.tick(2301),
            vec![DetectorEvent::Dead {
                node: NodeId(2),
                silent_ms: 301
            }]
        );
        // Without the limit, the same wake-up declares both.
        let mut plain = FailureDetector::new(300);
        plain.watch(NodeId(1), 0);
        plain.watch(NodeId(2), 0);
        plain.heard(NodeId(1), 200);
        assert_eq!(plain.tick(2200).len(), 2);
    }

    #[test]
    fn rejoin_is_a_new_incarnation() {
        let mut d = FailureDetector::new(100);
        d.watch(NodeId(1), 0);
        assert_eq!(
            d.tick(101),
            vec![DetectorEvent::Dead {
                node: NodeId(1),
                silent_ms: 101
            }]
        );
        d.heard(NodeId(1), 150); // a late message does not resurrect it
        assert!(!d.is_alive(NodeId(1)));
        d.watch(NodeId(1), 200);
        assert!(d.is_alive(NodeId(1)));
        assert_eq!(d.next_deadline_ms(), Some(301));
    }
}

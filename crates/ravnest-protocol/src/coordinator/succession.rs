//! Coordinator fail-over, the pure part: what the coordinator replicates ([`Replica`]), who
//! succeeds it ([`successor`]), and each node's watch over it ([`Watch`]).
//!
//! The coordinator sends every live node a [`Replica`] when membership or the plan's epoch
//! changes, and its designated successor a fresh one after every agreed step. Its leases are
//! heartbeats from [`crate::msg::Addr::Coordinator`]. A node that hears nothing from the coordinator
//! for `silence_ms` suspects it and turns to the successor: the lowest live member of its latest
//! replica that is neither the coordinator nor suspected. Every node holding the same replica
//! picks the same successor; a successor that is dead too is suspected in turn after another
//! silence. The successor starts a coordinator of the next *term*
//! ([`crate::coordinator::core::Coordinator::take_over`]), whose epochs are numbered from
//! [`term_epoch`] on, above any epoch of an earlier term: what an older coordinator sent is void.
//! It halts every member, and resumes from the newest synchronized version all of them hold,
//! exactly as after a worker's loss: at most the steps since that version are redone.

use std::collections::BTreeSet;

use ravnest_core::NodeId;
use ravnest_core::stall::{StallClock, credited};

pub use crate::msg::Replica;

/// The first epoch of coordinator term `term`: terms own disjoint, increasing epoch ranges.
pub fn term_epoch(term: u32) -> u64 {
    u64::from(term) << 40
}

/// The successor of `r.host`: the lowest member that is neither the host nor in `suspects`.
pub fn successor(r: &Replica, suspects: &BTreeSet<NodeId>) -> Option<NodeId> {
    r.members
        .iter()
        .copied()
        .filter(|n| *n != r.host && !suspects.contains(n))
        .min()
}

/// What a node's watch decides.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// The coordinator is now hosted by this node: send to it from now on.
    Follow(NodeId),
    /// This node is the successor: start a coordinator of the replica's term (already the new
    /// one: `term` incremented, `host` this node).
    TakeOver(Replica),
    /// No successor is left (every member is suspected): training cannot go on.
    Lost(String),
}

/// A node's watch over the coordinator.
#[derive(Debug, Clone)]
pub struct Watch {
    me: NodeId,
    silence_ms: u64,
    host: NodeId,
    replica: Option<Replica>,
    last_heard_ms: u64,
    stall: StallClock,
    suspects: BTreeSet<NodeId>,
}

impl Watch {
    /// Node `me` watching the coordinator hosted by `host` from `now_ms`; it is suspected after
    /// `silence_ms` without a word.
    pub fn new(me: NodeId, host: NodeId, silence_ms: u64, now_ms: u64) -> Watch {
        Watch {
            me,
            silence_ms: silence_ms.max(1),
            host,
            replica: None,
            last_heard_ms: now_ms,
            stall: StallClock::new(Some(silence_ms.max(1) / 3)),
            suspects: BTreeSet::new(),
        }
    }

    /// The node hosting the coordinator, as this watch believes.
    pub fn host(&self) -> NodeId {
        self.host
    }

    /// Whether a replica came (so that fail-over is possible).
    pub fn armed(&self) -> bool {
        self.replica.is_some()
    }

    /// The term of the newest replica this watch holds (0 before the first).
    pub fn term(&self) -> u32 {
        self.replica.as_ref().map_or(0, |r| r.term)
    }

    /// A coordinator of `term` hosted by `host` is heard from (its lease, or its replica): if
    /// this watch holds a newer term's replica, that coordinator is stale (cut off or frozen
    /// past the silence while another node took over), and the replica is what tells it to
    /// step down. `None` when it is current, or hosted here.
    pub fn answer(&self, term: u32, host: NodeId) -> Option<Replica> {
        self.replica
            .as_ref()
            .filter(|r| r.term > term && host != self.me)
            .cloned()
    }

    /// Something came from the coordinator.
    pub fn heard(&mut self, now_ms: u64) {
        self.last_heard_ms = self.last_heard_ms.max(now_ms);
    }

    /// A replica came from the coordinator. One of a newer term names a new host: follow it.
    pub fn replica(&mut self, r: Replica, now_ms: u64) -> Option<Verdict> {
        let term = self.replica.as_ref().map_or(0, |o| o.term);
        if self.replica.is_some() && r.term < term {
            return None;
        }
        self.heard(now_ms);
        let moved = r.host != self.host;
        self.host = r.host;
        self.suspects.remove(&r.host);
        self.replica = Some(r);
        moved.then_some(Verdict::Follow(self.host))
    }

    /// Time passed. A gap between two ticks longer than a third of the silence is this
    /// process's own stall (frozen, swapped out): nobody's silence.
    pub fn tick(&mut self, now_ms: u64) -> Option<Verdict> {
        let stalled = self.stall.tick(now_ms);
        self.last_heard_ms = credited(self.last_heard_ms, stalled, now_ms);
        if self.host == self.me {
            // This process hosts the coordinator: while it runs, so does the coordinator.
            self.last_heard_ms = now_ms;
            return None;
        }
        if now_ms.saturating_sub(self.last_heard_ms) <= self.silence_ms {
            return None;
        }
        let r = self.replica.as_ref()?;
        self.suspects.insert(self.host);
        self.last_heard_ms = now_ms;
        let Some(next) = successor(r, &self.suspects) else {
            return Some(Verdict::Lost(format!(
                "the coordinator and every possible successor are silent ({} members)",
                r.members.len()
            )));
        };
        self.host = next;
        if next != self.me {
            return Some(Verdict::Follow(next));
        }
        let mut r = r.clone();
        r.term += 1;
        r.host = self.me;
        r.members.retain(|m| !self.suspects.contains(m));
        self.replica = Some(r.clone());
        Some(Verdict::TakeOver(r))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use ravnest_core::ClusterSpec;

    fn replica(members: &[u32], host: u32) -> Replica {
        Replica {
            term: 0,
            host: NodeId(host),
            epoch: 3,
            floor: 10,
            agreed: 12,
            members: members.iter().map(|&m| NodeId(m)).collect(),
            involved: members.iter().map(|&m| NodeId(m)).collect(),
            cluster: ClusterSpec {
                name: "t".into(),
                nodes: Vec::new(),
                pair_links: Default::default(),
            },
        }
    }

    #[test]
    fn silence_turns_every_node_to_the_same_successor_and_it_takes_over() {
        let r = replica(&[0, 1, 2, 3], 0);
        let mut watches: Vec<Watch> = (1..4)
            .map(|m| {
                let mut w = Watch::new(NodeId(m), NodeId(0), 300, 0);
                w.replica(r.clone(), 0);
                w
            })
            .collect();
        for w in &mut watches {
            assert_eq!(w.tick(100), None);
            assert_eq!(w.tick(200), None);
            assert_eq!(w.tick(300), None);
        }
        let verdicts: Vec<Option<Verdict>> = watches.iter_mut().map(|w| w.tick(400)).collect();
        match &verdicts[0] {
            Some(Verdict::TakeOver(n)) => {
                assert_eq!((n.term, n.host), (1, NodeId(1)));
                assert!(!n.members.contains(&NodeId(0)));
            }
            v => panic!("node 1 should take over: {v:?}"),
        }
        assert_eq!(verdicts[1], Some(Verdict::Follow(NodeId(1))));
        assert_eq!(verdicts[2], Some(Verdict::Follow(NodeId(1))));
    }

    #[test]
    fn a_dead_successor_is_passed_over_after_another_silence() {
        let mut w = Watch::new(NodeId(2), NodeId(0), 300, 0);
        w.replica(replica(&[0, 1, 2], 0), 0);
        for t in (100..=400).step_by(100) {
            let v = w.tick(t);
            if t == 400 {
                assert_eq!(v, Some(Verdict::Follow(NodeId(1))));
            }
        }
        let mut last = None;
        for t in (500..=800).step_by(100) {
            last = w.tick(t).or(last);
        }
        assert!(
            matches!(last, Some(Verdict::TakeOver(ref r)) if r.host == NodeId(2) && r.term == 1)
        );
    }

    #[test]
    fn a_replica_of_a_newer_term_is_followed_at_once_and_an_older_one_ignored() {
        let mut w = Watch::new(NodeId(3), NodeId(0), 300, 0);
        w.replica(replica(&[0, 1, 2, 3], 0), 0);
        let mut newer = replica(&[1, 2, 3], 2);
        newer.term = 1;
        assert_eq!(w.replica(newer, 10), Some(Verdict::Follow(NodeId(2))));
        assert_eq!(w.replica(replica(&[0, 1, 2, 3], 0), 20), None);
        assert_eq!(w.host(), NodeId(2));
    }

    #[test]
    fn a_stale_coordinator_is_answered_with_the_newer_replica_and_follows_it() {
        // Node 3 follows node 1, which took over (term 1) from node 0.
        let mut w = Watch::new(NodeId(3), NodeId(0), 300, 0);
        let mut newer = replica(&[1, 2, 3], 1);
        newer.term = 1;
        w.replica(newer.clone(), 0);
        assert_eq!(w.term(), 1);
        // Node 0's lease (term 0) comes back: it is answered with term 1's replica.
        assert_eq!(w.answer(0, NodeId(0)), Some(newer.clone()));
        // The current coordinator's lease is not answered, nor a newer one's.
        assert_eq!(w.answer(1, NodeId(1)), None);
        assert_eq!(w.answer(2, NodeId(2)), None);
        // Node 0's own watch (it hosted term 0) follows the new host once it has the replica.
        let mut stale = Watch::new(NodeId(0), NodeId(0), 300, 0);
        stale.replica(replica(&[0, 1, 2, 3], 0), 0);
        assert_eq!(
            stale.answer(0, NodeId(0)),
            None,
            "a host never answers itself"
        );
        assert_eq!(stale.replica(newer, 5000), Some(Verdict::Follow(NodeId(1))));
        assert_eq!(stale.host(), NodeId(1));
    }

    #[test]
    fn no_replica_no_verdict_and_a_stall_is_nobodys_silence() {
        let mut w = Watch::new(NodeId(1), NodeId(0), 300, 0);
        assert_eq!(
            w.tick(1000),
            None,
            "without a replica fail-over is not possible"
        );
        w.replica(replica(&[0, 1], 0), 1000);
        w.tick(1100);
        // Frozen for 5 s, then ticking again: not a silence of the coordinator.
        assert_eq!(w.tick(6100), None);
        assert_eq!(w.tick(6200), None);
    }

    proptest! {
        /// Oracle: the successor is the smallest member that is neither the host nor suspected;
        /// every watcher with the same replica and suspicions agrees.
        #[test]
        fn successor_is_the_lowest_unsuspected_member(
            members in proptest::collection::btree_set(0u32..12, 1..8),
            suspects in proptest::collection::btree_set(0u32..12, 0..6),
            host_pick in 0usize..8,
        ) {
            let members: Vec<u32> = members.into_iter().collect();
            let host = members[host_pick % members.len()];
            let r = replica(&members, host);
            let sus: BTreeSet<NodeId> = suspects.iter().map(|&s| NodeId(s)).collect();
            let oracle = members.iter().copied()
                .filter(|m| *m != host && !suspects.contains(m)).min().map(NodeId);
            prop_assert_eq!(successor(&r, &sus), oracle);
            let mut shuffled = r.clone();
            shuffled.members.reverse();
            prop_assert_eq!(successor(&shuffled, &sus), oracle);
        }
    }
}

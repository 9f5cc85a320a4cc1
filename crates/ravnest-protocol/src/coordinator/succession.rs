//! Coordinator fail-over, the pure part: what the coordinator replicates ([`Replica`]), who
//! succeeds it ([`successor`]), and each node's watch over it ([`Watch`]).
//!
//! The coordinator sends every live node a [`Replica`] when membership or the plan's epoch
//! changes, and its designated successor a fresh one after every agreed step. Its leases are
//! heartbeats from [`crate::msg::Addr::Coordinator`]. A node that hears nothing from the coordinator
//! for `silence_ms` suspects it and awaits the successor: the lowest live member of its latest
//! replica that is neither the coordinator nor suspected. Every node holding the same replica
//! picks the same successor; a successor that is dead too is suspected in turn after another
//! silence. The successor takes over only once a majority of the replica's [`voters`] say
//! they lost the coordinator too (a pre-vote, [`quorum`]): a node cut off alone never does.
//! The successor starts a coordinator of the next *term*
//! ([`crate::coordinator::core::Coordinator::take_over`]), whose epochs are numbered from
//! [`term_epoch`] on, above any epoch of an earlier term: what an older coordinator sent is void.
//! It halts every member, and resumes from the newest synchronized version all of them hold,
//! exactly as after a worker's loss: at most the steps since that version are redone.

use std::collections::BTreeSet;

use ravnest_core::NodeId;
use ravnest_core::stall::{StallClock, credited};

pub use crate::msg::Replica;
use crate::msg::{Addr, Envelope};

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

/// The members who vote on `r.host`'s succession: every member but the host.
pub fn voters(r: &Replica) -> Vec<NodeId> {
    let mut v: Vec<NodeId> = r.members.iter().copied().filter(|n| *n != r.host).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// How many voters must say they lost the coordinator before its successor takes over: a
/// majority of [`voters`] (the successor counts itself). Two groups cut off from each other
/// cannot both hold one, so at most one side of a partition takes over.
pub fn quorum(r: &Replica) -> usize {
    voters(r).len() / 2 + 1
}

/// What a node's watch decides.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// The coordinator is now hosted by this node (a replica or a lease of a newer term
    /// says so): send to it from now on.
    Follow(NodeId),
    /// The coordinator is silent: this node waits for this one, its successor, to take over
    /// (and says yes to its pre-vote). Nothing is redirected until its replica comes.
    Awaits(NodeId),
    /// This node is the successor: start a coordinator of the replica's term (already the new
    /// one: `term` incremented, `host` this node).
    TakeOver(Replica),
    /// This node is the successor but takes over only with a quorum: ask these voters
    /// ([`crate::msg::Envelope::PreVote`] of `term`) whether they lost the coordinator too.
    Canvass {
        /// The term this node would start.
        term: u32,
        /// Whom to ask (this node left out).
        voters: Vec<NodeId>,
    },
    /// The coordinator this watch had given up on (it awaited a successor that never took
    /// over, or canvassed in vain) is heard again.
    Resumed(NodeId),
    /// This node is cut off: it canvassed for [`CUT_OFF_SILENCES`] silences and no quorum of
    /// the members answered, nor the coordinator. It leaves the run, which goes on without it.
    CutOff(String),
    /// No successor is left (every member is suspected): training cannot go on.
    Lost(String),
}

/// What a watch made of an envelope that was its own ([`Watch::on_envelope`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Heard {
    /// An envelope for another node: (to, what).
    pub reply: Option<(NodeId, Envelope)>,
    /// What the watch decided.
    pub verdict: Option<Verdict>,
}

/// Silences a successor canvasses in vain before it judges itself cut off.
pub const CUT_OFF_SILENCES: u64 = 3;

/// A successor's pre-vote in progress.
#[derive(Debug, Clone)]
struct Canvass {
    term: u32,
    votes: BTreeSet<NodeId>,
    since_ms: u64,
    asked_ms: u64,
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
    /// Since when this node has given its coordinator up (a silence passed), until it hears
    /// from a coordinator of its term or a newer one.
    lost_since: Option<u64>,
    /// The successor this node waits for (after a silence).
    awaited: Option<NodeId>,
    canvass: Option<Canvass>,
    /// The newest term heard of (a lease may come before its replica).
    newest: u32,
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
            lost_since: None,
            awaited: None,
            canvass: None,
            newest: 0,
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

    /// An envelope for this node from `from`, before its decisions see it: anything from the
    /// coordinator is a sign of life; a replica, a lease or a pre-vote is the watch's alone.
    /// `None`: not the watch's (the node's decisions take it). Else what goes back to another
    /// node (the newer replica to a stale coordinator's host, whose node follows it and whose
    /// process steps down; the answer to a pre-vote), and what the watch decided.
    pub fn on_envelope(&mut self, from: Addr, env: &Envelope, now_ms: u64) -> Option<Heard> {
        if from == Addr::Coordinator {
            self.heard(now_ms);
        }
        let stale = |w: &Watch, term, host: NodeId| {
            w.answer(term, host)
                .map(|a| (host, Envelope::Succession(Box::new(a))))
        };
        let (reply, verdict) = match (env, from) {
            (Envelope::Succession(r), _) => {
                let reply = stale(self, r.term, r.host);
                (reply, self.replica((**r).clone(), now_ms))
            }
            (Envelope::Lease { term, host }, _) => {
                let reply = stale(self, *term, *host);
                (reply, self.lease(*term, *host, now_ms))
            }
            // A successor's pre-vote: did this node lose the coordinator too?
            (Envelope::PreVote { term }, Addr::Node(candidate)) => {
                let granted = self.grant(*term, now_ms);
                let answer = Envelope::PreVoted {
                    term: *term,
                    granted,
                };
                (Some((candidate, answer)), None)
            }
            (Envelope::PreVoted { term, granted }, Addr::Node(voter)) => {
                (None, self.voted(voter, *term, *granted))
            }
            _ => return None,
        };
        Some(Heard { reply, verdict })
    }

    /// Something came from the coordinator.
    pub fn heard(&mut self, now_ms: u64) {
        self.last_heard_ms = self.last_heard_ms.max(now_ms);
    }

    /// The coordinator's lease: it is there, of `term`, on `host`. One of this watch's term
    /// (or a newer one) ends whatever this node had given it up for: it is followed again.
    ///
    /// A node that holds no replica yet (one that joins, not yet admitted) follows a lease of
    /// a newer term than it knows to its host: its predecessor was lost before the node was let
    /// in, and the successor is where it registers.
    pub fn lease(&mut self, term: u32, host: NodeId, now_ms: u64) -> Option<Verdict> {
        if self.replica.is_none() {
            if term <= self.newest || host == self.host {
                self.newest = self.newest.max(term);
                return None;
            }
            self.newest = term;
            self.heard(now_ms);
            self.host = host;
            return Some(Verdict::Follow(host));
        }
        if term < self.term().max(self.newest) {
            return None;
        }
        self.newest = term;
        self.heard(now_ms);
        let gave_up = self.lost_since.is_some() || self.canvass.is_some();
        self.forgive();
        if host != self.host {
            self.host = host;
            return Some(if term > self.term() {
                Verdict::Follow(host)
            } else {
                Verdict::Resumed(host)
            });
        }
        gave_up.then_some(Verdict::Resumed(host))
    }

    /// The coordinator is heard from: whatever this node suspected, awaited or canvassed for
    /// is over.
    fn forgive(&mut self) {
        self.lost_since = None;
        self.awaited = None;
        self.canvass = None;
        self.suspects.clear();
    }

    /// A replica came from the coordinator. One of a newer term names a new host: follow it.
    pub fn replica(&mut self, r: Replica, now_ms: u64) -> Option<Verdict> {
        let term = self.replica.as_ref().map_or(0, |o| o.term);
        if self.replica.is_some() && r.term < term {
            return None;
        }
        self.heard(now_ms);
        self.newest = self.newest.max(r.term);
        self.forgive();
        let moved = r.host != self.host;
        self.host = r.host;
        self.replica = Some(r);
        moved.then_some(Verdict::Follow(self.host))
    }

    /// A successor asks whether this node lost the coordinator too, to start `term`: yes when
    /// it knows no such term yet, does not host the coordinator, and has heard nothing from it
    /// for half a silence (or gave it up already).
    pub fn grant(&self, term: u32, now_ms: u64) -> bool {
        self.replica.is_some()
            && term > self.term().max(self.newest)
            && self.host != self.me
            && (self.lost_since.is_some()
                || now_ms.saturating_sub(self.last_heard_ms) >= self.silence_ms / 2)
    }

    /// `from` answered this node's pre-vote of `term`: with a quorum of yeses, take over.
    pub fn voted(&mut self, from: NodeId, term: u32, granted: bool) -> Option<Verdict> {
        let c = self.canvass.as_mut().filter(|c| c.term == term)?;
        if granted {
            c.votes.insert(from);
        }
        self.elect()
    }

    /// Take over if the canvass holds a quorum of the replica's voters.
    fn elect(&mut self) -> Option<Verdict> {
        let r = self.replica.as_ref()?;
        let c = self.canvass.as_ref()?;
        let voters = voters(r);
        let yes = c.votes.iter().filter(|v| voters.contains(v)).count();
        if yes < quorum(r) {
            return None;
        }
        let mut r = r.clone();
        r.term = c.term;
        r.host = self.me;
        r.members.retain(|m| !self.suspects.contains(m));
        self.host = self.me;
        self.newest = self.newest.max(r.term);
        self.forgive();
        self.replica = Some(r.clone());
        Some(Verdict::TakeOver(r))
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
        if let Some(c) = &mut self.canvass {
            c.since_ms = credited(c.since_ms, stalled, now_ms);
            if now_ms.saturating_sub(c.since_ms) > CUT_OFF_SILENCES * self.silence_ms {
                let silent_s = (now_ms - c.since_ms) as f64 / 1e3;
                let asked = voters(self.replica.as_ref()?).len().saturating_sub(1);
                self.canvass = None;
                return Some(Verdict::CutOff(format!(
                    "cut off from the cluster: neither the coordinator nor a majority of the {asked} other members answered for {silent_s:.1} s"
                )));
            }
            // Ask again a few times a silence (an answer may have been lost on the way).
            if now_ms.saturating_sub(c.asked_ms) >= self.silence_ms / 3 {
                c.asked_ms = now_ms;
                let term = c.term;
                return Some(self.canvass_verdict(term));
            }
            return None;
        }
        if now_ms.saturating_sub(self.last_heard_ms) <= self.silence_ms {
            return None;
        }
        let r = self.replica.as_ref()?;
        self.suspects.insert(self.awaited.unwrap_or(self.host));
        self.last_heard_ms = now_ms;
        self.lost_since.get_or_insert(now_ms);
        let Some(next) = successor(r, &self.suspects) else {
            return Some(Verdict::Lost(format!(
                "the coordinator and every possible successor are silent ({} members)",
                r.members.len()
            )));
        };
        if next != self.me {
            self.awaited = Some(next);
            return Some(Verdict::Awaits(next));
        }
        let term = r.term + 1;
        self.canvass = Some(Canvass {
            term,
            votes: BTreeSet::from([self.me]),
            since_ms: now_ms,
            asked_ms: now_ms,
        });
        self.elect().or_else(|| Some(self.canvass_verdict(term)))
    }

    fn canvass_verdict(&self, term: u32) -> Verdict {
        let voters = self
            .replica
            .as_ref()
            .map(voters)
            .unwrap_or_default()
            .into_iter()
            .filter(|v| *v != self.me && !self.suspects.contains(v))
            .collect();
        Verdict::Canvass { term, voters }
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
            reserved: Vec::new(),
            cluster: ClusterSpec {
                name: "t".into(),
                nodes: Vec::new(),
                pair_links: Default::default(),
            },
        }
    }

    /// Watches of `members` but the host 0, each holding replica `r`, ticked to `t`.
    fn watches(r: &Replica, until: u64) -> Vec<(Watch, Option<Verdict>)> {
        r.members
            .iter()
            .filter(|m| **m != r.host)
            .map(|m| {
                let mut w = Watch::new(*m, r.host, 300, 0);
                w.replica(r.clone(), 0);
                let mut last = None;
                for t in (100..=until).step_by(100) {
                    last = w.tick(t).or(last);
                }
                (w, last)
            })
            .collect()
    }

    #[test]
    fn silence_turns_every_node_to_the_same_successor_which_takes_over_with_a_quorum() {
        let r = replica(&[0, 1, 2, 3], 0);
        let mut ws = watches(&r, 300);
        assert!(
            ws.iter().all(|(_, v)| v.is_none()),
            "no verdict within the silence"
        );
        let verdicts: Vec<Option<Verdict>> = ws.iter_mut().map(|(w, _)| w.tick(400)).collect();
        assert_eq!(
            verdicts[0],
            Some(Verdict::Canvass {
                term: 1,
                voters: vec![NodeId(2), NodeId(3)]
            }),
            "node 1 asks the other voters first"
        );
        assert_eq!(verdicts[1], Some(Verdict::Awaits(NodeId(1))));
        assert_eq!(verdicts[2], Some(Verdict::Awaits(NodeId(1))));
        // Node 2 lost the coordinator too: it says yes, and two of three voters is a quorum.
        assert!(ws[1].0.grant(1, 400));
        match ws[0].0.voted(NodeId(2), 1, true) {
            Some(Verdict::TakeOver(n)) => {
                assert_eq!((n.term, n.host), (1, NodeId(1)));
                assert!(!n.members.contains(&NodeId(0)));
            }
            v => panic!("node 1 should take over: {v:?}"),
        }
        // A late yes changes nothing.
        assert_eq!(ws[0].0.voted(NodeId(3), 1, true), None);
    }

    #[test]
    fn a_successor_cut_off_alone_never_takes_over_and_follows_the_coordinator_when_healed() {
        let r = replica(&[0, 1, 2], 0);
        // Node 1 hears nothing (cut off); node 2 hears the coordinator's leases.
        let mut one = Watch::new(NodeId(1), NodeId(0), 300, 0);
        let mut two = Watch::new(NodeId(2), NodeId(0), 300, 0);
        one.replica(r.clone(), 0);
        two.replica(r.clone(), 0);
        let mut asked = 0;
        for t in (100..=900).step_by(100) {
            two.lease(0, NodeId(0), t);
            two.tick(t);
            match one.tick(t) {
                Some(Verdict::Canvass { term: 1, voters }) => {
                    assert_eq!(voters, vec![NodeId(2)]);
                    asked += 1;
                    // Node 2 still hears the coordinator: no.
                    assert!(!two.grant(1, t));
                    assert_eq!(one.voted(NodeId(2), 1, false), None);
                }
                None => {}
                v => panic!("unexpected {v:?} at {t}"),
            }
        }
        assert!(asked >= 2, "it asks again while cut off ({asked})");
        assert_eq!(one.host(), NodeId(0));
        // Healed: the coordinator's lease ends the canvass (nothing was redirected).
        assert_eq!(
            one.lease(0, NodeId(0), 1000),
            Some(Verdict::Resumed(NodeId(0)))
        );
        assert_eq!(one.voted(NodeId(2), 1, true), None, "the canvass is over");
        for t in (1100..=1300).step_by(100) {
            one.lease(0, NodeId(0), t);
            assert_eq!(one.tick(t), None);
        }
    }

    #[test]
    fn a_canvass_in_vain_for_three_silences_is_a_cut_off() {
        let r = replica(&[0, 1, 2], 0);
        let (mut w, _) = watches(&r, 400).swap_remove(0);
        let mut end = None;
        for t in (500..=2000).step_by(100) {
            if let Some(v @ Verdict::CutOff(_)) = w.tick(t) {
                end = Some((t, v));
                break;
            }
        }
        let (t, v) = end.expect("a cut-off");
        assert!(t > 400 + 3 * 300, "not before three silences ({t})");
        assert!(matches!(v, Verdict::CutOff(why) if why.contains("cut off")));
    }

    #[test]
    fn a_follower_that_gave_the_coordinator_up_resumes_it_on_its_lease() {
        let r = replica(&[0, 1, 2], 0);
        let (mut w, v) = watches(&r, 400).swap_remove(1);
        assert_eq!(v, Some(Verdict::Awaits(NodeId(1))));
        assert!(
            w.grant(1, 450),
            "it lost the coordinator: yes to the successor"
        );
        assert_eq!(
            w.lease(0, NodeId(0), 500),
            Some(Verdict::Resumed(NodeId(0)))
        );
        assert_eq!(w.host(), NodeId(0));
        assert!(!w.grant(1, 550), "it hears the coordinator again: no");
        // A newer term's lease is followed (its replica comes after).
        assert_eq!(w.lease(1, NodeId(2), 600), Some(Verdict::Follow(NodeId(2))));
        assert_eq!(
            w.lease(0, NodeId(0), 700),
            None,
            "an older term is not followed"
        );
    }

    /// A node not yet let in (a joiner: no replica) follows a newer term's lease to its
    /// host, where it registers; the same term or an older one, or its own host's, is no news.
    #[test]
    fn a_joiner_without_a_replica_follows_a_newer_terms_lease() {
        let mut w = Watch::new(NodeId(3), NodeId(0), 300, 0);
        assert_eq!(
            w.lease(0, NodeId(0), 10),
            None,
            "its host, of the term it knows"
        );
        assert_eq!(w.lease(1, NodeId(1), 20), Some(Verdict::Follow(NodeId(1))));
        assert_eq!(w.host(), NodeId(1));
        assert_eq!(w.lease(1, NodeId(1), 30), None, "followed already");
        assert_eq!(
            w.lease(0, NodeId(0), 40),
            None,
            "the lost host, of an older term"
        );
        assert_eq!(w.host(), NodeId(1));
        assert!(!w.armed(), "a lease is not a replica: fail-over needs one");
        assert_eq!(
            w.tick(5_000),
            None,
            "no replica: nothing to decide on a silence"
        );
        // Let in: the replica of the term it follows arms it as any member.
        let mut r = replica(&[1, 2, 3], 1);
        r.term = 1;
        assert_eq!(w.replica(r, 5_100), None, "the host it follows already");
        assert!(w.armed());
    }

    #[test]
    fn with_one_voter_the_successor_takes_over_alone() {
        let r = replica(&[0, 1], 0);
        let (_, v) = watches(&r, 400).swap_remove(0);
        assert!(matches!(v, Some(Verdict::TakeOver(ref n)) if n.host == NodeId(1) && n.term == 1));
    }

    #[test]
    fn a_dead_successor_is_passed_over_after_another_silence() {
        // Node 0 (the host) and node 1 die; nodes 2 and 3 are two of three voters.
        let r = replica(&[0, 1, 2, 3], 0);
        let mut ws = watches(&r, 400);
        assert_eq!(ws[1].1, Some(Verdict::Awaits(NodeId(1))));
        let mut last = None;
        for t in (500..=800).step_by(100) {
            last = ws[1].0.tick(t).or(last);
            ws[2].0.tick(t);
        }
        assert_eq!(
            last,
            Some(Verdict::Canvass {
                term: 1,
                voters: vec![NodeId(3)]
            })
        );
        assert!(ws[2].0.grant(1, 800));
        let v = ws[1].0.voted(NodeId(3), 1, true);
        assert!(
            matches!(v, Some(Verdict::TakeOver(ref r)) if r.host == NodeId(2) && r.term == 1 && !r.members.contains(&NodeId(1)))
        );
        // Three members with the host and its successor dead: one of two voters is no quorum.
        let r = replica(&[0, 1, 2], 0);
        let (mut w, _) = watches(&r, 400).swap_remove(1);
        let mut seen = Vec::new();
        for t in (500..=900).step_by(100) {
            seen.extend(w.tick(t));
        }
        assert!(
            seen.iter().all(|v| matches!(v, Verdict::Canvass { .. })),
            "{seen:?}"
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
    fn an_envelope_is_the_watchs_when_it_is_about_succession() {
        let mut w = Watch::new(NodeId(3), NodeId(0), 300, 0);
        let mut newer = replica(&[1, 2, 3], 1);
        newer.term = 1;
        // A node's own work is not the watch's; from the coordinator it is a sign of life.
        let halt = Envelope::Halt { epoch: 7 };
        assert_eq!(w.on_envelope(Addr::Coordinator, &halt, 250), None);
        assert_eq!(w.tick(500), None, "heard at 250: not silent at 500");
        // The newer replica is the watch's: it follows node 1.
        let heard = w.on_envelope(
            Addr::Coordinator,
            &Envelope::Succession(Box::new(newer.clone())),
            600,
        );
        assert_eq!(
            heard.map(|h| h.verdict),
            Some(Some(Verdict::Follow(NodeId(1))))
        );
        // The old host's lease is answered with that replica, to the old host.
        let lease = Envelope::Lease {
            term: 0,
            host: NodeId(0),
        };
        let heard = w.on_envelope(Addr::Coordinator, &lease, 700).unwrap();
        assert_eq!(
            heard.reply,
            Some((NodeId(0), Envelope::Succession(Box::new(newer))))
        );
        // A pre-vote is answered to the candidate; a vote is taken from a node only.
        let heard = w
            .on_envelope(Addr::Node(NodeId(2)), &Envelope::PreVote { term: 2 }, 800)
            .unwrap();
        assert!(matches!(
            heard.reply,
            Some((NodeId(2), Envelope::PreVoted { term: 2, .. }))
        ));
        let vote = Envelope::PreVoted {
            term: 2,
            granted: true,
        };
        assert_eq!(w.on_envelope(Addr::Coordinator, &vote, 900), None);
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
        /// Two disjoint groups of voters never both hold a quorum.
        #[test]
        fn two_sides_of_a_partition_never_both_hold_a_quorum(
            members in proptest::collection::btree_set(0u32..12, 2..9),
            side in proptest::collection::btree_set(0u32..12, 0..12),
        ) {
            let members: Vec<u32> = members.into_iter().collect();
            let r = replica(&members, members[0]);
            let v = voters(&r);
            let a = v.iter().filter(|n| side.contains(&n.0)).count();
            let b = v.len() - a;
            prop_assert!(!(a >= quorum(&r) && b >= quorum(&r)), "{a} and {b} of {}", v.len());
        }

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

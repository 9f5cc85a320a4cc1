//! The coordinator's state machine driven without actors: a model of the nodes (each follows
//! its epoch, its grant and halts by the node actor's own rules, `node::epochs`; a step completes when every member
//! of its group has entered it, as a collective does), under interleavings and deaths chosen
//! by proptest. Checked: the run finishes; steps are agreed in order, each once (but after a
//! roll-back); no node ever runs a step of an epoch at or past the first step of the next one;
//! the coordinator sends a handful of messages per node per step, not one per step.

use std::collections::{BTreeMap, VecDeque};

use proptest::prelude::*;
use ravnest_core::NodeId;

use super::Event;
use super::core::{Config, Coordinator, Effect, Input};
use crate::epochs;
use crate::msg::{Envelope, HeldVersion, Work};

const STEPS: u64 = 30;
const TIMEOUT_MS: u64 = 1000;

fn config(nodes: usize) -> Config {
    let mut text = String::from("[links]\nbandwidth_gbps = 100.0\nlatency_ms = 0.01\n");
    text += &format!("[[node]]\nname = \"n\"\ndevice = \"cpu\"\ncount = {nodes}\n");
    text += "[model]\nkind = \"mlp\"\ndims = [64, 256, 10]\n[training]\nglobal_batch = 2400\nsync = \"ring\"\n";
    let s = ravnest_core::parse(&text, "model-test").unwrap();
    let costs = ravnest_core::cost::Costs::new(&s.cluster, &s.model, &s.training);
    Config {
        train_flops: costs.train_flops(costs.all()),
        heartbeat_timeout_ms: TIMEOUT_MS,
        checkpoint_every: 10,
        checkpoint_at_end: true,
        ..Config::new(s.cluster, s.model, s.training, STEPS)
    }
}

/// Two 3090s training GPT-2 small on a global batch of 24: both hold 12 samples, and one
/// alone cannot hold the 24 (no data-parallel plan fits one node), as the coordinator's side
/// of a partition that cut off half the cluster.
fn tight_config() -> Config {
    let text = "[links]\nbandwidth_gbps = 10.0\nlatency_ms = 0.2\n\
        [[node]]\nname = \"g\"\ndevice = \"rtx3090\"\ncount = 2\n\
        [model]\npreset = \"gpt2-small\"\n\
        [training]\nglobal_batch = 24\nmicro_batch = 4\noptimizer = \"adamw\"\nprecision = \"fp16\"\n\
        accumulate = false\n";
    let s = ravnest_core::parse(text, "tight-test").unwrap();
    let costs = ravnest_core::cost::Costs::new(&s.cluster, &s.model, &s.training);
    Config {
        train_flops: costs.train_flops(costs.all()),
        heartbeat_timeout_ms: TIMEOUT_MS,
        checkpoint_every: 10,
        checkpoint_at_end: true,
        ..Config::new(s.cluster, s.model, s.training, STEPS)
    }
}

/// A node as the coordinator sees it behave.
#[derive(Debug, Default)]
struct Node {
    alive: bool,
    epoch: u64,
    work: Option<Work>,
    next: Option<Work>,
    halted: bool,
    /// Version → synchronized (every step is, in this model).
    held: BTreeMap<u64, bool>,
    /// The step it is in (entered its collective), with its epoch.
    entered: Option<(u64, u64)>,
    /// Waiting for this version from a peer.
    fetching: Option<(u64, NodeId)>,
    inbox: VecDeque<Envelope>,
    outbox: VecDeque<Envelope>,
}

impl Node {
    fn latest(&self) -> Option<u64> {
        self.held.keys().next_back().copied()
    }

    fn keep(&mut self, v: u64) {
        self.held.insert(v, true);
        while self.held.len() > 2 {
            self.held.pop_first();
        }
    }

    fn activate(&mut self, w: Work) {
        self.held.retain(|k, _| *k <= w.step);
        if !self.held.contains_key(&w.step)
            && let Some(peer) = w.state_from
        {
            self.held.clear();
            self.fetching = Some((w.step, peer));
        }
        self.work = Some(w);
    }

    fn on(&mut self, env: Envelope) {
        match env {
            Envelope::Work(w) => {
                let w = *w;
                if w.epoch <= self.epoch {
                    return;
                }
                self.epoch = w.epoch;
                let headed = self.fetching.map(|f| f.0).or(self.latest());
                if epochs::queues(self.work.as_ref(), self.halted, headed, &w) {
                    self.next = Some(w);
                } else {
                    self.entered = None;
                    self.next = None;
                    self.halted = false;
                    self.activate(w);
                }
            }
            Envelope::Grant { epoch, until } => {
                for w in [&mut self.work, &mut self.next].into_iter().flatten() {
                    if w.epoch == epoch {
                        w.until = w.until.max(until);
                    }
                }
            }
            Envelope::Halt { epoch } => {
                self.entered = None;
                self.halted = true;
                self.next = None;
                self.fetching = None;
                let held = self
                    .held
                    .iter()
                    .map(|(v, s)| HeldVersion {
                        version: *v,
                        synced: *s,
                        layers: None,
                    })
                    .collect();
                self.outbox.push_back(Envelope::Halted { epoch, held });
            }
            _ => {}
        }
    }

    /// Enter the next step if the epoch allows it. Returns a violation, if any.
    fn advance(&mut self) -> Result<(), String> {
        if self.entered.is_some() || self.fetching.is_some() || self.halted {
            return Ok(());
        }
        let Some(latest) = self.latest() else {
            return Ok(());
        };
        if self
            .next
            .as_ref()
            .is_some_and(|n| epochs::starts(n, latest))
        {
            let w = self.next.take().expect("checked");
            if latest > w.step {
                return Err(format!(
                    "a node at {latest} passed epoch {}'s start {}",
                    w.epoch, w.step
                ));
            }
            self.activate(w);
        }
        let Some(w) = &self.work else { return Ok(()) };
        if let Some(n) = &self.next
            && latest >= n.step
        {
            return Err(format!("a node ran epoch {} past {}", w.epoch, n.step));
        }
        if epochs::runs(w, latest) {
            self.entered = Some((w.epoch, latest));
        }
        Ok(())
    }
}

/// What happens to one node during a run.
#[derive(Debug, Clone, Copy)]
struct Cut {
    /// After this many actions the node is cut off (as if dead: what it sends and what is sent
    /// to it is lost).
    at: usize,
    who: usize,
    /// After this many more actions it is back, with whatever state it had.
    back_after: Option<usize>,
}

/// Run the model: `choices` picks each next action; `cut` cuts a node off (and maybe brings it
/// back). Returns the coordinator's effects in order.
fn drive(nodes: usize, choices: &[usize], cut: Option<Cut>) -> Result<Vec<Effect>, String> {
    drive_with(config(nodes), choices, cut)
}

/// [`drive`] with a given configuration.
fn drive_with(cfg: Config, choices: &[usize], cut: Option<Cut>) -> Result<Vec<Effect>, String> {
    let nodes = cfg.cluster.nodes.len();
    let mut c = Coordinator::new(cfg, 0);
    let mut ns: Vec<Node> = (0..nodes)
        .map(|_| Node {
            alive: true,
            held: BTreeMap::from([(0, true)]),
            ..Node::default()
        })
        .collect();
    let mut now = 0u64;
    let mut log = Vec::new();
    let route = |effects: Vec<Effect>, ns: &mut Vec<Node>, log: &mut Vec<Effect>| {
        for e in effects {
            if let Effect::Send(to, env) = &e {
                ns[to.index()].inbox.push_back(env.clone());
            }
            log.push(e);
        }
    };
    let first = c.start();
    route(first, &mut ns, &mut log);
    for k in 0..200_000usize {
        if c.is_finished() {
            return Ok(log);
        }
        if let Some(c) = cut {
            if k == c.at {
                let n = &mut ns[c.who];
                n.alive = false;
                n.inbox.clear();
                n.outbox.clear();
            }
            if c.back_after.is_some_and(|d| k == c.at + d) {
                ns[c.who].alive = true;
            }
        }
        // Actions: 0..n deliver to node i; n..2n deliver from node i; 2n: a step completes
        // where it can; 2n+1: time passes.
        let pick = choices.get(k).copied().unwrap_or(k) % (2 * nodes + 2);
        if pick < nodes {
            let n = &mut ns[pick];
            if let Some(env) = n.inbox.pop_front()
                && n.alive
            {
                n.on(env);
            }
        } else if pick < 2 * nodes {
            let i = pick - nodes;
            if let Some(env) = ns[i].outbox.pop_front()
                && ns[i].alive
            {
                let e = c.handle(now, Input::Net(NodeId(i as u32), env));
                route(e, &mut ns, &mut log);
            }
        } else if pick == 2 * nodes {
            complete_steps(&mut ns);
        } else {
            now += 100;
            for i in 0..nodes {
                if ns[i].alive {
                    let e = c.handle(now, Input::Net(NodeId(i as u32), Envelope::Heartbeat));
                    route(e, &mut ns, &mut log);
                }
            }
            let e = c.handle(now, Input::Tick);
            route(e, &mut ns, &mut log);
        }
        for n in ns.iter_mut().filter(|n| n.alive) {
            n.advance()?;
        }
        serve_fetches(&mut ns);
    }
    if std::env::var_os("MODEL_DEBUG").is_some() {
        for e in &log {
            if !matches!(e, Effect::Send(_, Envelope::Grant { .. })) {
                eprintln!("{e:?}");
            }
        }
        for (i, n) in ns.iter().enumerate() {
            eprintln!(
                "node {i}: alive {} epoch {} work {:?} next {:?} halted {} held {:?} entered {:?} fetching {:?} inbox {} outbox {}",
                n.alive,
                n.epoch,
                n.work
                    .as_ref()
                    .map(|w| (w.epoch, w.step, w.until, w.ring.clone(), w.state_from)),
                n.next.as_ref().map(|w| (w.epoch, w.step, w.until)),
                n.halted,
                n.held,
                n.entered,
                n.fetching,
                n.inbox.len(),
                n.outbox.len()
            );
        }
    }
    Err("the run did not finish".into())
}

/// The reasons of every `Stalled` event in `log`.
fn stalled(log: &[Effect]) -> Vec<&String> {
    log.iter()
        .filter_map(|e| match e {
            Effect::Event(Event::Stalled(why)) => Some(why),
            _ => None,
        })
        .collect()
}

/// A step completes on every member of its group once all of them entered it (the
/// collective's barrier); a dead member blocks it.
fn complete_steps(ns: &mut [Node]) {
    let entered: Vec<(usize, (u64, u64), Vec<NodeId>)> = ns
        .iter()
        .enumerate()
        .filter(|(_, n)| n.alive)
        .filter_map(|(i, n)| Some((i, n.entered?, n.work.as_ref()?.ring.clone())))
        .collect();
    for (i, at, ring) in &entered {
        let all = ring.iter().all(|m| {
            let n = &ns[m.index()];
            n.alive && n.entered == Some(*at)
        });
        if all && ns[*i].entered == Some(*at) {
            for m in ring {
                let n = &mut ns[m.index()];
                n.entered = None;
                n.keep(at.1 + 1);
                n.outbox.push_back(Envelope::StepDone {
                    epoch: at.0,
                    step: at.1,
                    digest: 7,
                    compute_ns: 1_000_000,
                    comm_ns: 0,
                });
            }
        }
    }
}

/// A node fetching a version gets it once its holder has it.
fn serve_fetches(ns: &mut [Node]) {
    for i in 0..ns.len() {
        if let Some((v, from)) = ns[i].fetching
            && ns[from.index()].held.contains_key(&v)
        {
            ns[i].fetching = None;
            ns[i].keep(v);
        }
    }
}

fn agreed_steps(log: &[Effect]) -> Result<Vec<u64>, String> {
    let mut agreed: Vec<u64> = Vec::new();
    for e in log {
        match e {
            Effect::Agreed { step, .. } => {
                if agreed.last().is_some_and(|l| *step != l + 1)
                    || (agreed.is_empty() && *step != 0)
                {
                    return Err(format!("step {step} agreed after {:?}", agreed.last()));
                }
                agreed.push(*step);
            }
            Effect::RolledBack { to } => agreed.truncate(*to as usize),
            Effect::Event(Event::Violation(v) | Event::Stalled(v)) => return Err(v.clone()),
            _ => {}
        }
    }
    Ok(agreed)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any interleaving: every step is agreed, in order, once; the coordinator sends each
    /// node its epoch and a grant every couple of steps, not a message per step.
    #[test]
    fn finishes_in_order_off_the_step_path(
        nodes in 1usize..5,
        choices in prop::collection::vec(0usize..64, 0..3000),
    ) {
        let log = drive(nodes, &choices, None).map_err(TestCaseError::fail)?;
        let agreed = agreed_steps(&log).map_err(TestCaseError::fail)?;
        prop_assert_eq!(agreed, (0..STEPS).collect::<Vec<_>>());
        let sent = log.iter().filter(|e| matches!(e, Effect::Send(..))).count();
        // One Work per node per epoch (a rebalance may add one) and a grant per two steps.
        prop_assert!(sent <= nodes * (2 + STEPS as usize / 2 + 2), "{sent} messages for {nodes} nodes");
    }

    /// A node dies at any moment: the survivors are halted, resume from a version they all
    /// hold, and finish; steps are agreed in order, once.
    #[test]
    fn a_death_at_any_moment_is_survived(
        nodes in 2usize..5,
        who in 0usize..5,
        at in 0usize..400,
        choices in prop::collection::vec(0usize..64, 0..3000),
    ) {
        let cut = Cut { at, who: who % nodes, back_after: None };
        let log = drive(nodes, &choices, Some(cut)).map_err(TestCaseError::fail)?;
        let agreed = agreed_steps(&log).map_err(TestCaseError::fail)?;
        prop_assert_eq!(agreed, (0..STEPS).collect::<Vec<_>>());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A node cut off and back (a partition that heals) at any moment: it is declared dead,
    /// halted when heard again, fetches the version of the epoch that takes it back, and the
    /// run finishes with every step agreed in order, once.
    #[test]
    fn a_node_cut_off_and_back_rejoins(
        nodes in 2usize..5,
        who in 0usize..5,
        at in 0usize..400,
        back in 80usize..600,
        choices in prop::collection::vec(0usize..64, 0..3000),
    ) {
        let cut = Cut { at, who: who % nodes, back_after: Some(back) };
        let log = drive(nodes, &choices, Some(cut)).map_err(TestCaseError::fail)?;
        let agreed = agreed_steps(&log).map_err(TestCaseError::fail)?;
        prop_assert_eq!(agreed, (0..STEPS).collect::<Vec<_>>());
    }
}

#[test]
fn a_lost_worker_halts_the_epoch_and_the_survivors_resume_where_they_all_are() {
    let cut = Cut {
        at: 40,
        who: 2,
        back_after: None,
    };
    let log = drive(3, &[], Some(cut)).unwrap();
    let halted = log
        .iter()
        .filter(|e| matches!(e, Effect::Send(_, Envelope::Halt { .. })))
        .count();
    assert_eq!(halted, 2, "both survivors are halted");
    assert!(
        log.iter().any(
            |e| matches!(e, Effect::Event(Event::Detected { node, .. }) if *node == NodeId(2))
        )
    );
    // After the halt, a new epoch without node 2.
    let last_work: Vec<&Work> = log
        .iter()
        .filter_map(|e| match e {
            Effect::Send(_, Envelope::Work(w)) => Some(w.as_ref()),
            _ => None,
        })
        .collect();
    let w = last_work.last().unwrap();
    assert_eq!(w.ring, vec![NodeId(0), NodeId(1)]);
    assert_eq!(agreed_steps(&log).unwrap().len() as u64, STEPS);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// Half of a cluster where the other half alone cannot hold the global batch is cut off
    /// and back (a partition that heals) at any moment: training waits for it at the version
    /// the survivor holds (no checkpoint restore, which cannot help), plans it back in when it
    /// is heard again, and finishes with every step agreed in order, once.
    #[test]
    fn a_survivor_that_cannot_train_alone_waits_for_the_cut_off_node(
        who in 0usize..2,
        at in 0usize..400,
        back in 80usize..600,
        choices in prop::collection::vec(0usize..64, 0..3000),
    ) {
        let cut = Cut { at, who, back_after: Some(back) };
        let log = drive_with(tight_config(), &choices, Some(cut)).map_err(TestCaseError::fail)?;
        let agreed = agreed_steps(&log).map_err(TestCaseError::fail)?;
        prop_assert_eq!(agreed, (0..STEPS).collect::<Vec<_>>());
        let restores = log
            .iter()
            .filter(|e| matches!(e, Effect::Checkpoint(Envelope::Restore { .. })))
            .count();
        prop_assert_eq!(restores, 0);
    }
}

/// The livelock of `ravnest sim` after a partition (global batch 72 on the partition
/// scenario): the survivors could not be planned, the coordinator restored the checkpoint,
/// failed to plan again and restored again, forever at one virtual instant. Now it waits, once,
/// and the cut-off node's return resumes training.
#[test]
fn a_partition_the_survivor_cannot_train_through_waits_then_resumes() {
    let cut = Cut {
        at: 40,
        who: 1,
        back_after: Some(300),
    };
    let log = drive_with(tight_config(), &[], Some(cut)).unwrap();
    let waited: Vec<&String> = log
        .iter()
        .filter_map(|e| match e {
            Effect::Event(Event::Waiting { why, .. }) => Some(why),
            _ => None,
        })
        .collect();
    assert_eq!(waited.len(), 1, "said once: {waited:?}");
    assert!(
        waited[0].contains("no plan for the live nodes"),
        "{}",
        waited[0]
    );
    assert!(
        !log.iter()
            .any(|e| matches!(e, Effect::Event(Event::Restoring { .. }))),
        "a restore cannot give the survivor memory"
    );
    assert_eq!(agreed_steps(&log).unwrap(), (0..STEPS).collect::<Vec<_>>());
    // The last epoch has both nodes again.
    let w = log
        .iter()
        .filter_map(|e| match e {
            Effect::Send(_, Envelope::Work(w)) => Some(w.as_ref()),
            _ => None,
        })
        .next_back()
        .unwrap();
    assert_eq!(w.ring.len(), 2);
}

/// The cut-off node never comes back: after `wait_for_nodes_ms` the run stops with the
/// planner's reason, and a handful of effects on the way (no loop).
#[test]
fn a_partition_that_never_heals_stops_with_the_reason() {
    let cut = Cut {
        at: 40,
        who: 1,
        back_after: None,
    };
    let cfg = Config {
        wait_for_nodes_ms: 30_000,
        ..tight_config()
    };
    let log = drive_with(cfg, &[], Some(cut)).unwrap();
    let stalled = stalled(&log);
    assert_eq!(stalled.len(), 1);
    assert!(
        stalled[0].contains("no plan for the live nodes"),
        "{}",
        stalled[0]
    );
    assert!(stalled[0].contains("waited 30 s"), "{}", stalled[0]);
    assert!(log.len() < 1000, "{} effects", log.len());
    assert_eq!(log.last(), Some(&Effect::Finished));
}

/// Every node is alive (heartbeats come) but no step ever completes (two workers cannot
/// reach each other): the watchdog resyncs, waiting longer each time, and after
/// `max_resyncs` in a row the run stops, saying why, instead of redoing the step for ever.
#[test]
fn steps_that_never_complete_among_live_nodes_stop_after_the_resyncs() {
    // Deliver to and from every node and let time pass; never complete a step.
    let nodes = 3;
    let choices: Vec<usize> = (0..200_000).map(|k| [0, 1, 2, 3, 4, 5, 7][k % 7]).collect();
    let log = drive(nodes, &choices, None).unwrap();
    let resyncs = log
        .iter()
        .filter(|e| matches!(e, Effect::Event(Event::Resync { .. })))
        .count();
    let stalled = stalled(&log);
    assert_eq!(resyncs, 5);
    assert_eq!(stalled.len(), 1);
    assert!(
        stalled[0].contains("cannot exchange data"),
        "{}",
        stalled[0]
    );
    assert_eq!(log.last(), Some(&Effect::Finished));
}

/// What a node not in the cluster file registers: `flops` measured, 1 GiB.
fn caps(name: &str, flops: f64) -> crate::msg::Capabilities {
    crate::msg::Capabilities {
        flops,
        memory_bytes: 1 << 30,
        device: "cpu (measured)".into(),
        name: name.into(),
        address: None,
    }
}

/// Two nodes not in the cluster file given ids by the coordinator's host (`Reserve`, in order)
/// register out of order: each is admitted at its own id with what it measured, every node is
/// told of both in id order, and a reservation out of order or of a taken name is ignored.
#[test]
fn joiners_given_ids_in_order_may_register_out_of_order() {
    let cfg = Config {
        host: Some(NodeId(0)),
        ..config(2)
    };
    let mut c = Coordinator::new(cfg, 0);
    let _ = c.start();
    let reserve = |id: u32, name: &str| {
        Input::Net(
            NodeId(0),
            Envelope::Reserve {
                id: NodeId(id),
                name: name.into(),
                address: format!("127.0.0.1:{}", 9000 + id),
            },
        )
    };
    let members = |effects: &[Effect]| -> Vec<(u32, String)> {
        let mut m: Vec<(u32, String)> = effects
            .iter()
            .filter_map(|e| match e {
                Effect::Send(NodeId(0), Envelope::Member { id, name, .. }) => {
                    Some((id.0, name.clone()))
                }
                _ => None,
            })
            .collect();
        m.dedup();
        m
    };
    let mut told = members(&c.handle(10, reserve(2, "p")));
    told.extend(members(&c.handle(11, reserve(3, "q"))));
    assert_eq!(told, [(2, "p".to_string()), (3, "q".to_string())]);
    // Out of order, a taken name, or from a node that does not host: ignored.
    assert!(members(&c.handle(12, reserve(5, "r"))).is_empty());
    assert!(members(&c.handle(12, reserve(4, "p"))).is_empty());
    let stray = Input::Net(
        NodeId(1),
        Envelope::Reserve {
            id: NodeId(4),
            name: "s".into(),
            address: "127.0.0.1:1".into(),
        },
    );
    assert!(members(&c.handle(12, stray)).is_empty());
    // `q` registers first, then `p`; a register under another's id changes nothing.
    let admitted = |effects: Vec<Effect>| -> Vec<(u32, String)> {
        effects
            .into_iter()
            .filter_map(|e| match e {
                Effect::Event(Event::Admitted { node, name, .. }) => Some((node.0, name)),
                _ => None,
            })
            .collect()
    };
    let mut seen = admitted(c.handle(
        20,
        Input::Net(NodeId(3), Envelope::Register(caps("q", 2e9))),
    ));
    seen.extend(admitted(c.handle(
        21,
        Input::Net(NodeId(2), Envelope::Register(caps("q", 2e9))),
    )));
    seen.extend(admitted(c.handle(
        22,
        Input::Net(NodeId(2), Envelope::Register(caps("p", 3e9))),
    )));
    assert_eq!(seen, [(3, "q".to_string()), (2, "p".to_string())]);
}

/// A node given its place by a host that is lost before the node registered: the replica the
/// members hold names it reserved, and the successor admits it when it registers there.
#[test]
fn a_successor_admits_a_node_its_predecessor_gave_a_place() {
    let cfg = Config {
        host: Some(NodeId(0)),
        ..config(2)
    };
    let mut c = Coordinator::new(cfg, 0);
    let _ = c.start();
    let reserve = Envelope::Reserve {
        id: NodeId(2),
        name: "p".into(),
        address: "127.0.0.1:9002".into(),
    };
    let replica = c
        .handle(10, Input::Net(NodeId(0), reserve))
        .into_iter()
        .find_map(|e| match e {
            Effect::Send(NodeId(1), Envelope::Succession(r)) => Some(*r),
            _ => None,
        })
        .expect("the reservation is replicated to the other member");
    assert_eq!(replica.reserved, [NodeId(2)]);
    assert!(!replica.members.contains(&NodeId(2)), "not a member yet");
    assert_eq!(replica.cluster.nodes.len(), 3);
    // Node 1 takes over (term 1) from that replica.
    let successor = super::succession::Replica {
        term: 1,
        host: NodeId(1),
        ..replica
    };
    let cfg = Config {
        host: Some(NodeId(1)),
        ..config(2)
    };
    let mut s = Coordinator::take_over(cfg, &successor, NodeId(0), 5_000);
    let _ = s.start();
    let admitted: Vec<_> = s
        .handle(
            5_100,
            Input::Net(NodeId(2), Envelope::Register(caps("p", 2e9))),
        )
        .into_iter()
        .filter_map(|e| match e {
            Effect::Event(Event::Admitted { node, name, .. }) => Some((node, name)),
            _ => None,
        })
        .collect();
    assert_eq!(admitted, [(NodeId(2), "p".to_string())]);
}

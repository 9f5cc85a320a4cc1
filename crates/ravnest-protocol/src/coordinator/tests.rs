//! The coordinator's state machine driven without actors, with the real nodes' decisions
//! ([`crate::node::core::NodeCore`], in [`crate::harness`]'s deterministic cluster: a step
//! completes when every member of its group has entered it, as a collective does), under
//! interleavings and deaths chosen by proptest. Checked: the run finishes; steps are agreed in
//! order, each once (but after a roll-back); no node ever runs a step of an epoch at or past
//! the first step of the next one, nor applies a step twice; the coordinator sends a handful of
//! messages per node per step, not one per step.

use proptest::prelude::*;
use ravnest_core::NodeId;

use super::Event;
use super::core::{Config, Coordinator, Effect, Input};
use crate::harness::{Cluster, Cut};
use crate::msg::{Envelope, Work};

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

/// Run the cluster of `nodes` on [`config`]: `choices` picks each next action; `cut` cuts a
/// node off (and maybe brings it back). Returns the coordinator's effects in order.
fn drive(nodes: usize, choices: &[usize], cut: Option<Cut>) -> Result<Vec<Effect>, String> {
    drive_with(config(nodes), choices, cut)
}

/// [`drive`] with a given configuration, on the real nodes' decisions ([`Cluster`]); also
/// checks, by [`Cluster`]'s counter model, that no step was applied twice or skipped: every
/// agreed version's digest is its number of steps, and so is every version a node holds at
/// the end; and that every sample of the agreed steps was trained once.
fn drive_with(cfg: Config, choices: &[usize], cut: Option<Cut>) -> Result<Vec<Effect>, String> {
    let mut c = Cluster::new(cfg);
    c.drive(choices, cut)?;
    checked(&c)?;
    Ok(c.log)
}

/// [`drive`] with fail-over: the coordinator lives in node 0's process ([`Cluster::hosted`]).
/// Returns the cluster at the end; checked as [`drive_with`] does.
fn drive_hosted(nodes: usize, choices: &[usize], cut: Option<Cut>) -> Result<Cluster, String> {
    let mut c = Cluster::hosted(config(nodes), NodeId(0));
    c.drive(choices, cut)?;
    checked(&c)?;
    Ok(c)
}

/// The counter model's checks of a run: every agreed version's digest is its number of steps,
/// and so is every version a node holds at the end; every sample of the agreed steps trained
/// once.
fn checked(c: &Cluster) -> Result<(), String> {
    for e in &c.log {
        if let Effect::Agreed {
            step,
            digest: Some(d),
        } = e
            && *d != Cluster::digest(step + 1)
        {
            return Err(format!("step {step} agreed on digest {d}"));
        }
    }
    // (A run that stalled or broke a rule says so to the test, which checks it.)
    if let Ok(agreed) = agreed_across(&c.log, &c.take_overs) {
        c.trained_once(&agreed)?;
    }
    for (i, n) in c.nodes.iter().enumerate() {
        for h in n.core.versions().held() {
            let model = n.core.version(h.version).map(|v| v.model);
            if model != Some(h.version) {
                return Err(format!(
                    "node {i} holds version {} as {model:?} steps",
                    h.version
                ));
            }
        }
    }
    Ok(())
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

fn agreed_steps(log: &[Effect]) -> Result<Vec<u64>, String> {
    agreed_across(log, &[])
}

/// The steps agreed, in order, across the coordinators of a run: at each take-over (where the
/// log stood, the steps the successor's replica held agreed) what the predecessor agreed
/// after its last replica is made again by the successor.
fn agreed_across(log: &[Effect], take_overs: &[(usize, u64)]) -> Result<Vec<u64>, String> {
    let mut agreed: Vec<u64> = Vec::new();
    for (i, e) in log.iter().enumerate() {
        for (_, from) in take_overs.iter().filter(|(at, _)| *at == i) {
            agreed.truncate(*from as usize);
        }
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Fail-over: the node whose process hosts the coordinator dies at any moment, and the
    /// coordinator with it. The successor (node 1) takes over on its pre-vote, halts the
    /// survivors, resumes from a version they all hold, and finishes; steps are agreed in
    /// order, none applied twice, every sample trained once.
    #[test]
    fn the_coordinators_host_dying_at_any_moment_is_survived(
        nodes in 2usize..5,
        at in 0usize..600,
        choices in prop::collection::vec(0usize..64, 0..3000),
    ) {
        let cut = Cut { at, who: 0, back_after: None };
        let c = drive_hosted(nodes, &choices, Some(cut)).map_err(TestCaseError::fail)?;
        let agreed = agreed_across(&c.log, &c.take_overs).map_err(TestCaseError::fail)?;
        prop_assert_eq!(agreed, (0..STEPS).collect::<Vec<_>>());
        if !c.nodes[0].alive {
            // (Unless the run finished before the cut.)
            prop_assert_eq!(c.take_overs.len(), 1);
            prop_assert_eq!(c.coordinators.last().and_then(|h| h.host), Some(NodeId(1)));
        }
    }

    /// The host is cut off and comes back (a partition that heals) at any moment: if a
    /// successor took over meanwhile, the old host hears of the newer term, steps down and its
    /// process exits, and the successor finishes the run; if not, the host goes on. Either way
    /// steps are agreed in order, none applied twice, and at most one successor starts.
    #[test]
    fn a_host_cut_off_and_back_steps_down_or_goes_on(
        nodes in 2usize..5,
        at in 0usize..400,
        back in 20usize..600,
        choices in prop::collection::vec(0usize..64, 0..3000),
    ) {
        let cut = Cut { at, who: 0, back_after: Some(back) };
        let c = drive_hosted(nodes, &choices, Some(cut)).map_err(TestCaseError::fail)?;
        let agreed = agreed_across(&c.log, &c.take_overs).map_err(TestCaseError::fail)?;
        prop_assert_eq!(agreed, (0..STEPS).collect::<Vec<_>>());
        prop_assert!(c.take_overs.len() <= 1, "{} take-overs", c.take_overs.len());
        if !c.take_overs.is_empty() && c.now > 0 {
            prop_assert_eq!(c.coordinators.last().and_then(|h| h.host), Some(NodeId(1)));
        }
    }
}

/// A host that dies mid-run, one interleaving, its story checked step by step: the successor
/// canvasses the other members, takes over in term 1, halts every survivor, and the new
/// epoch (numbered in term 1's range) finishes the run without node 0.
#[test]
fn a_successor_takes_over_from_a_dead_host_and_finishes() {
    let cut = Cut {
        at: 300,
        who: 0,
        back_after: None,
    };
    let c = drive_hosted(3, &[], Some(cut)).unwrap();
    assert_eq!(c.take_overs.len(), 1, "one take-over");
    let (at, _) = c.take_overs[0];
    let after = &c.log[at..];
    let halted: Vec<NodeId> = after
        .iter()
        .filter_map(|e| match e {
            Effect::Send(n, Envelope::Halt { .. }) => Some(*n),
            _ => None,
        })
        .collect();
    assert!(
        halted.contains(&NodeId(1)) && halted.contains(&NodeId(2)),
        "{halted:?}"
    );
    let last = after
        .iter()
        .rev()
        .find_map(|e| match e {
            Effect::Send(_, Envelope::Work(w)) => Some(w.as_ref()),
            _ => None,
        })
        .expect("the successor hands out work");
    assert!(
        last.epoch >= super::succession::term_epoch(1),
        "epoch {}",
        last.epoch
    );
    assert_eq!(last.ring, vec![NodeId(1), NodeId(2)]);
    let agreed = agreed_across(&c.log, &c.take_overs).unwrap();
    assert_eq!(agreed, (0..STEPS).collect::<Vec<_>>());
    assert!(c.coordinator().is_finished());
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

/// A successor's halt that is lost (a connection reset as it takes over, or a node that still
/// followed the old host when it came) is asked again, as in any halt: the watchdog sends it
/// again to the members that have not answered, and the successor resumes once they do.
#[test]
fn a_successor_asks_again_for_a_halt_that_was_lost() {
    let cfg = config(3);
    let replica = crate::msg::Replica {
        term: 1,
        host: NodeId(1),
        epoch: 0,
        floor: 0,
        agreed: 4,
        members: vec![NodeId(1), NodeId(2)],
        involved: vec![NodeId(0), NodeId(1), NodeId(2)],
        reserved: Vec::new(),
        cluster: cfg.cluster.clone(),
    };
    let cfg = Config {
        host: Some(NodeId(1)),
        ..cfg
    };
    let mut s = Coordinator::take_over(cfg, &replica, NodeId(0), 10_000);
    let halts = |effects: &[Effect]| -> Vec<NodeId> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::Send(n, Envelope::Halt { .. }) => Some(*n),
                _ => None,
            })
            .collect()
    };
    let first = s.start();
    assert_eq!(halts(&first), [NodeId(1), NodeId(2)]);
    let epoch = first
        .iter()
        .find_map(|e| match e {
            Effect::Send(_, Envelope::Halt { epoch }) => Some(*epoch),
            _ => None,
        })
        .unwrap();
    let held = vec![crate::msg::HeldVersion {
        version: 4,
        synced: true,
        layers: None,
    }];
    // Node 1 answers; node 2's halt was lost. Both stay alive (heartbeats).
    let _ = s.handle(
        10_010,
        Input::Net(
            NodeId(1),
            Envelope::Halted {
                epoch,
                held: held.clone(),
            },
        ),
    );
    let mut again = Vec::new();
    for t in (10_100..20_000).step_by(100) {
        for n in [1, 2] {
            let _ = s.handle(t, Input::Net(NodeId(n), Envelope::Heartbeat));
        }
        again.extend(halts(&s.handle(t, Input::Tick)));
        if !again.is_empty() {
            break;
        }
    }
    assert_eq!(
        again,
        [NodeId(2)],
        "the lost halt is sent again, only to node 2"
    );
    let resumed = s.handle(
        20_000,
        Input::Net(NodeId(2), Envelope::Halted { epoch, held }),
    );
    assert!(
        resumed
            .iter()
            .any(|e| matches!(e, Effect::Send(_, Envelope::Work(w)) if w.step == 4)),
        "the successor resumes from step 4: {resumed:?}"
    );
}

/// Two nodes of the same device, so planned 1200 / 1200; node 1 computes `slower` times as
/// long per sample as node 0. Returns the run's re-plans (step, predicted gain) and node 1's
/// (epoch, batch) in order.
/// (step, predicted gain) of each re-plan; node 1's (epoch, batch) in order.
type FitRun = (Vec<(u64, f64)>, Vec<(u64, u64)>);

fn first_fit_run(slower: f64) -> FitRun {
    let mut c = Cluster::new(config(2));
    c.ns_per_sample = vec![1_000_000, (1_000_000.0 * slower) as u64];
    c.drive(&[], None).unwrap();
    checked(&c).unwrap();
    let replans = c
        .log
        .iter()
        .filter_map(|e| match e {
            Effect::Event(Event::Rebalanced {
                step,
                predicted_gain,
                ..
            }) => Some((*step, *predicted_gain)),
            _ => None,
        })
        .collect();
    // Node 1's batch in each epoch it was given work in, in order.
    let mut batches: Vec<(u64, u64)> = Vec::new();
    for e in &c.log {
        if let Effect::Send(NodeId(1), Envelope::Work(w)) = e
            && batches.last().is_none_or(|&(epoch, _)| epoch != w.epoch)
        {
            batches.push((w.epoch, w.batch));
        }
    }
    (replans, batches)
}

/// The calibration put a node 20% slower than it is on the same figures as the other (inside
/// the drift margin, so the drift rule would never move it): after `fit_steps` steps of its own
/// share the first fit re-splits once, giving it fewer samples; a node as fast as planned is
/// left alone.
#[test]
fn the_first_fit_resplits_a_share_the_calibration_got_wrong_once() {
    let fit = super::core::Tuning::default().fit_steps;
    let (replans, batches) = first_fit_run(1.2);
    assert_eq!(replans.len(), 1, "{replans:?}");
    // 2400 in proportion to speed: 1309 / 1091.
    assert_eq!(batches.len(), 2, "{batches:?}");
    assert_eq!(batches[0].1, 1200);
    assert!((1080..1100).contains(&batches[1].1), "{batches:?}");
    let (step, gain) = replans[0];
    assert!(
        step >= fit && step < fit + 3,
        "re-planned after step {step}"
    );
    assert!((0.05..0.15).contains(&gain), "predicted gain {gain}");
    let (replans, _) = first_fit_run(1.0);
    assert!(replans.is_empty(), "{replans:?}");
    // 2% off: less than the first fit's threshold.
    let (replans, _) = first_fit_run(1.02);
    assert!(replans.is_empty(), "{replans:?}");
}

use proptest::prelude::*;
use ravnest_core::{LayerRange, NodeId};

use super::*;
use crate::msg::{CheckpointDuty, ShardWork, StageWork};

const ME: NodeId = NodeId(0);

/// Epoch `epoch` from `step`, granted to `until`, the run ending at 100.
fn work(epoch: u64, step: u64, until: u64) -> Work {
    Work::for_test(epoch, step, until, vec![ME, NodeId(1)])
}

/// The counter model's version `step + 1`.
fn made(epoch: u64, step: u64) -> Input<u64> {
    Input::Made(Made {
        epoch,
        step,
        model: step + 1,
        synced: true,
        layers: None,
        digest: 1,
        compute_ns: 1,
        comm_ns: 0,
    })
}

fn runs(effects: &[Effect]) -> Vec<u64> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Run { step } => Some(*step),
            _ => None,
        })
        .collect()
}

fn sent(effects: &[Effect]) -> Vec<&Envelope> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Send(_, env) => Some(env),
            _ => None,
        })
        .collect()
}

#[test]
fn a_node_runs_its_epoch_step_after_step_up_to_its_grant() {
    let mut n = NodeCore::fresh(ME, 0, 0u64);
    assert!(runs(&n.handle(Input::Advance)).is_empty(), "no work yet");
    n.handle(Input::Work(Box::new(work(1, 0, 2))));
    assert_eq!(runs(&n.handle(Input::Advance)), [0]);
    let done = n.handle(made(1, 0));
    assert!(matches!(
        sent(&done)[..],
        [Envelope::StepDone {
            epoch: 1,
            step: 0,
            ..
        }]
    ));
    assert_eq!(runs(&n.handle(Input::Advance)), [1]);
    n.handle(made(1, 1));
    assert!(
        runs(&n.handle(Input::Advance)).is_empty(),
        "the grant ends at 2"
    );
    n.handle(Input::Grant { epoch: 1, until: 3 });
    assert_eq!(runs(&n.handle(Input::Advance)), [2]);
    // A grant of an older epoch changes nothing.
    n.handle(made(1, 2));
    n.handle(Input::Grant { epoch: 0, until: 9 });
    assert!(runs(&n.handle(Input::Advance)).is_empty());
}

#[test]
fn a_new_epoch_waits_for_the_running_one_to_reach_its_first_step() {
    let mut n = NodeCore::fresh(ME, 0, 0u64);
    n.handle(Input::Work(Box::new(work(1, 0, 10))));
    n.handle(Input::Advance);
    // Epoch 2 from step 2: the node finishes steps 0 and 1 of epoch 1 first.
    let e = n.handle(Input::Work(Box::new(work(2, 2, 10))));
    assert!(e.is_empty(), "queued: {e:?}");
    assert_eq!(n.next_work().map(|w| w.epoch), Some(2));
    n.handle(made(1, 0));
    assert_eq!(runs(&n.handle(Input::Advance)), [1]);
    assert_eq!(n.work().map(|w| w.epoch), Some(1));
    n.handle(made(1, 1));
    let e = n.handle(Input::Advance);
    assert_eq!(e[0], Effect::Activated { epoch: 2, step: 2 });
    assert_eq!(runs(&e), [2]);
    assert_eq!(n.work().map(|w| w.epoch), Some(2));
    // An epoch already seen is ignored.
    assert!(n.handle(Input::Work(Box::new(work(2, 0, 10)))).is_empty());
}

#[test]
fn a_new_epoch_from_a_step_already_passed_switches_now_and_drops_the_step() {
    let mut n = NodeCore::fresh(ME, 0, 0u64);
    n.handle(Input::Work(Box::new(work(1, 0, 10))));
    n.handle(Input::Advance);
    n.handle(made(1, 0));
    n.handle(made(1, 1));
    // The node holds 2; epoch 2 goes back to 1 (it holds it): the newer version goes.
    let e = n.handle(Input::Work(Box::new(work(2, 1, 10))));
    assert_eq!(
        e,
        [Effect::Abandon, Effect::Activated { epoch: 2, step: 1 }]
    );
    assert_eq!(n.latest(), Some(1));
    assert_eq!(runs(&n.handle(Input::Advance)), [1]);
}

#[test]
fn a_halt_stops_the_node_and_reports_what_it_holds() {
    let mut n = NodeCore::fresh(ME, 0, 0u64);
    n.handle(Input::Work(Box::new(work(1, 0, 10))));
    n.handle(made(1, 0));
    let e = n.handle(Input::Halt { epoch: 1 });
    assert_eq!(e[..2], [Effect::Abandon, Effect::Halted { epoch: 1 }]);
    match sent(&e)[..] {
        [Envelope::Halted { epoch: 1, held }] => {
            let vs: Vec<u64> = held.iter().map(|h| h.version).collect();
            assert_eq!(vs, [0, 1]);
        }
        _ => panic!("{e:?}"),
    }
    assert!(n.halted());
    assert!(runs(&n.handle(Input::Advance)).is_empty());
    // The next epoch ends the halt.
    n.handle(Input::Work(Box::new(work(2, 1, 10))));
    assert!(!n.halted());
    assert_eq!(runs(&n.handle(Input::Advance)), [1]);
}

#[test]
fn a_restored_checkpoint_is_kept_whole_and_synchronized_and_the_halt_answered() {
    let mut n = NodeCore::fresh(ME, 0, 0u64);
    n.handle(Input::Work(Box::new(work(1, 0, 10))));
    for s in 0..4 {
        n.handle(made(1, s));
    }
    let e = n.handle(Input::Restored {
        epoch: 1,
        restored: Some((2, 2)),
    });
    assert_eq!(n.latest(), Some(2), "newer versions go: training goes back");
    let v = n.version(2).unwrap();
    assert!(v.synced && v.layers.is_none());
    assert!(matches!(sent(&e)[..], [Envelope::Halted { epoch: 1, .. }]));
}

#[test]
fn requests_for_versions_not_made_yet_are_served_when_made() {
    let mut n = NodeCore::fresh(ME, 0, 0u64);
    n.handle(Input::Work(Box::new(work(1, 0, 10))));
    let ask = |version| Input::StateRequest {
        version,
        to: NodeId(1),
        layers: None,
    };
    assert_eq!(
        n.handle(ask(0)),
        [Effect::Serve {
            version: 0,
            to: NodeId(1),
            layers: None
        }]
    );
    assert!(n.handle(ask(2)).is_empty(), "kept");
    let e = n.handle(made(1, 0));
    assert!(!e.iter().any(|e| matches!(e, Effect::Serve { .. })));
    let e = n.handle(made(1, 1));
    assert!(e.contains(&Effect::Serve {
        version: 2,
        to: NodeId(1),
        layers: None
    }));
    // Served once.
    let e = n.handle(made(1, 2));
    assert!(!e.iter().any(|e| matches!(e, Effect::Serve { .. })));
    // An old version no longer held: nothing to send, nothing kept.
    assert!(n.handle(ask(0)).is_empty());
    // At most REQUESTS_MAX wait.
    for _ in 0..REQUESTS_MAX + 5 {
        n.handle(ask(50));
    }
    for s in 3..49 {
        n.handle(made(1, s));
    }
    let served = n
        .handle(made(1, 49))
        .iter()
        .filter(|e| matches!(e, Effect::Serve { .. }))
        .count();
    assert_eq!(served, REQUESTS_MAX);
}

#[test]
fn a_node_without_the_epochs_version_fetches_it_whole_before_it_runs() {
    let mut n = NodeCore::new(ME);
    let w = Work {
        state_from: Some(NodeId(1)),
        ..work(1, 5, 10)
    };
    let e = n.handle(Input::Work(Box::new(w)));
    assert!(matches!(
        sent(&e)[..],
        [Envelope::StateRequest {
            version: 5,
            to: ME,
            layers: None
        }]
    ));
    assert!(n.fetching());
    assert!(runs(&n.handle(Input::Advance)).is_empty());
    assert!(n.fetch_base(4, None).is_none(), "another version");
    assert!(
        n.fetch_base(5, Some(LayerRange::new(0, 1))).is_none(),
        "a part"
    );
    assert_eq!(n.fetch_base(5, None), Some(None));
    n.handle(Input::Fetched {
        version: 5,
        layers: None,
        model: 5,
    });
    assert!(!n.fetching());
    assert_eq!(n.version(5).map(|v| v.model), Some(5));
    assert_eq!(runs(&n.handle(Input::Advance)), [5]);
}

#[test]
fn a_stage_fetches_its_layers_piece_by_piece_and_narrows_the_model_to_them() {
    let mut n = NodeCore::new(ME);
    let (a, b) = (LayerRange::new(0, 2), LayerRange::new(2, 4));
    let w = Work {
        stage: Some(StageWork {
            stage: 0,
            stages: 1,
            layers: LayerRange::new(0, 4),
            prev: None,
            next: None,
            micro_batch: 4,
            out_bytes_per_sample: 0,
            in_bytes_per_sample: 0,
            sync_bytes: 0,
            fetch: vec![(NodeId(1), a), (NodeId(2), b)],
        }),
        ..work(1, 0, 10)
    };
    let e = n.handle(Input::Work(Box::new(w)));
    assert_eq!(sent(&e).len(), 2);
    assert_eq!(
        n.fetch_base(0, Some(a)),
        Some(None),
        "it holds nothing of version 0"
    );
    assert!(n.fetch_base(0, None).is_none());
    let e = n.handle(Input::Fetched {
        version: 0,
        layers: Some(a),
        model: 10,
    });
    assert!(e.is_empty() && n.fetching());
    assert_eq!(
        n.fetch_base(0, Some(b)),
        Some(Some(&10)),
        "on top of the first"
    );
    assert!(n.fetch_base(0, Some(a)).is_none(), "already here");
    let e = n.handle(Input::Fetched {
        version: 0,
        layers: Some(b),
        model: 20,
    });
    assert_eq!(
        e,
        [Effect::Narrow {
            version: 0,
            layers: LayerRange::new(0, 4)
        }]
    );
    assert_eq!(n.version(0).map(|v| v.model), Some(20));
    n.set_model(0, 21);
    assert_eq!(n.version(0).map(|v| v.model), Some(21));
}

#[test]
fn a_sharded_worker_keeps_one_version_and_says_it_holds_its_part() {
    let mut n = NodeCore::fresh(ME, 0, 0u64);
    let part = LayerRange::new(0, 2);
    let w = Work {
        shard: Some(ShardWork {
            owned: part,
            parts: vec![part, LayerRange::new(2, 4)],
            fetch: Vec::new(),
        }),
        ..work(1, 0, 10)
    };
    n.handle(Input::Work(Box::new(w)));
    assert!(n.versions().keeps_one());
    assert_eq!(n.made_layers(None), Some(part));
    assert_eq!(
        n.made_layers(Some(LayerRange::new(1, 2))),
        Some(LayerRange::new(1, 2))
    );
}

#[test]
fn the_checkpoint_writer_writes_due_synchronized_versions_and_the_stopped_end() {
    let mut n = NodeCore::fresh(ME, 0, 0u64);
    let layers = LayerRange::new(0, 3);
    let w = Work {
        checkpoint: Some(CheckpointDuty {
            layers,
            every: 3,
            catch_up: u64::MAX,
            at_end: false,
            last: 0,
        }),
        ..work(1, 0, 100)
    };
    n.handle(Input::Work(Box::new(w)));
    let mut written = Vec::new();
    for s in 0..7 {
        if s == 5 {
            // The user stops the run at 7, checkpointed there.
            n.handle(Input::StopAt {
                at: 7,
                checkpoint: true,
            });
        }
        for e in n.handle(made(1, s)) {
            if let Effect::WriteShard { version, layers: l } = e {
                assert_eq!(l, layers);
                written.push(version);
            }
        }
    }
    assert_eq!(written, [3, 6, 7]);
    assert!(n.is_last(7));
    assert!(
        runs(&n.handle(Input::Advance)).is_empty(),
        "the run ended at 7"
    );
}

/// An input the property below sends: a new epoch from `from` steps back (or ahead) of the
/// latest version, a grant, a halt, a step's end, a stop, or idleness.
#[derive(Debug, Clone)]
enum Act {
    Work { back: u64, until: u64 },
    Grant(u64),
    Halt,
    Done,
    Stop(u64),
    Advance,
}

fn act() -> impl Strategy<Value = Act> {
    prop_oneof![
        (0u64..4, 1u64..12).prop_map(|(back, until)| Act::Work { back, until }),
        (0u64..30).prop_map(Act::Grant),
        Just(Act::Halt),
        Just(Act::Done),
        (0u64..30).prop_map(Act::Stop),
        Just(Act::Advance),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Any sequence of epochs, grants, halts, stops and step ends: a step runs only from a
    /// held version equal to its number (counter model), within its epoch (at or past its
    /// first step, below its grant and its end, below the queued epoch's first step), never
    /// while halted or fetching, and every version kept holds as many steps as its number. (The driver asks for a step only while none of its runs: the node's
    /// decisions leave that to it.)
    #[test]
    fn steps_run_only_where_the_epoch_allows_and_never_twice(
        acts in prop::collection::vec(act(), 0..120),
    ) {
        let mut n = NodeCore::fresh(ME, 0, 0u64);
        let mut epoch = 0;
        let mut running: Option<(u64, u64)> = None;
        for a in acts {
            let input = match a {
                Act::Work { back, until } => {
                    epoch += 1;
                    let latest = n.latest().unwrap_or(0);
                    let step = latest.saturating_sub(back).max(if back == 0 { latest + 1 } else { 0 });
                    // Where the node lacks the step's version it fetches it from a peer.
                    Input::Work(Box::new(Work { state_from: Some(NodeId(1)), ..work(epoch, step, step + until) }))
                }
                Act::Grant(until) => Input::Grant { epoch, until },
                Act::Halt => Input::Halt { epoch },
                Act::Done => match running.take() {
                    Some((e, s)) => made(e, s),
                    None => continue,
                },
                Act::Stop(at) => Input::StopAt { at, checkpoint: false },
                // The driver asks only while no step of its runs.
                Act::Advance if running.is_some() => continue,
                Act::Advance => Input::Advance,
            };
            let advance = matches!(input, Input::Advance);
            let effects = n.handle(input);
            for e in &effects {
                match e {
                    Effect::Abandon => running = None,
                    Effect::Run { step } => {
                        prop_assert!(advance, "ran {step} unasked: {effects:?}");
                        prop_assert!(!n.halted() && !n.fetching());
                        let w = n.work().expect("a step runs within an epoch");
                        prop_assert!(*step >= w.step && *step < w.until.min(w.end), "{step} outside {w:?}");
                        if let Some(next) = n.next_work() {
                            prop_assert!(*step < next.step, "{step} at or past the next epoch's {}", next.step);
                        }
                        prop_assert_eq!(n.version(*step).map(|v| v.model), Some(*step));
                        running = Some((w.epoch, *step));
                    }
                    Effect::Send(_, Envelope::StateRequest { version, .. }) => {
                        // The peer answers with its version at once.
                        let v = *version;
                        if n.fetch_base(v, None).is_some() {
                            n.handle(Input::Fetched { version: v, layers: None, model: v });
                        }
                    }
                    _ => {}
                }
            }
            // A step made between an epoch's switch and its report is dropped, not kept.
            if !advance && running.is_some() && n.halted() {
                running = None;
            }
            for h in n.versions().held() {
                prop_assert_eq!(n.version(h.version).map(|v| v.model), Some(h.version));
            }
        }
    }
}

use super::*;

fn progress(node: &str, step: u64, compute_s: f64, comm_s: f64, applied: u64) -> RunEvent {
    RunEvent::Progress {
        node: node.into(),
        step,
        steps: 10,
        loss: Some(1.0 / (1.0 + step as f64)),
        samples_per_s: 100.0,
        own: Some(NodeFigures {
            compute_s,
            comm_s,
            steps_applied: applied,
            batch: 8,
            peers: vec![("b".into(), 1000 * applied, 500 * applied)],
        }),
    }
}

fn cluster(node: &str, what: &str) -> RunEvent {
    said(node, what, None)
}

/// A relayed coordinator event, in words and as what it is.
fn said(node: &str, what: &str, fact: Option<Fact>) -> RunEvent {
    RunEvent::Cluster {
        node: node.into(),
        what: what.into(),
        t_s: None,
        fact,
    }
}

fn lost(node: &str) -> Option<Fact> {
    Some(Fact::Lost { node: node.into() })
}

fn joined(node: &str) -> Option<Fact> {
    Some(Fact::Joined { node: node.into() })
}

fn planned(step: u64, nodes: &[&str]) -> Option<Fact> {
    Some(Fact::Planned {
        step,
        nodes: nodes.iter().map(|n| n.to_string()).collect(),
    })
}

fn board() -> Board {
    Board::new("c", &["a".into(), "b".into()], "a", 10)
}

#[test]
fn a_node_trains_goes_down_and_comes_back() {
    let mut b = board();
    b.apply(0.0, &progress("b", 0, 0.0, 0.0, 0));
    b.apply(1.0, &progress("b", 2, 0.5, 0.25, 2));
    assert_eq!(b.nodes[1].state, NodeState::Training);
    assert_eq!(b.nodes[1].samples_per_s, 16.0);
    assert_eq!(b.nodes[1].segments, vec![(0.0, 1.0, 0.5, 0.25)]);
    b.apply(2.0, &said("a", "node `b` lost (silent 900 ms)", lost("b")));
    assert_eq!(b.nodes[1].state, NodeState::Down);
    assert_eq!(b.events[0].kind, EventKind::Fault);
    b.apply(3.0, &said("a", "node `b` joined", joined("b")));
    assert_eq!(b.nodes[1].down, vec![(2.0, Some(3.0))]);
    b.apply(4.0, &progress("b", 5, 1.0, 0.3, 3));
    assert_eq!(b.nodes[1].state, NodeState::Training);
    b.apply(
        5.0,
        &said(
            "a",
            "`b` took over as coordinator (term 1) from `a`: training goes on from step 5",
            Some(Fact::TookOver {
                node: "b".into(),
                from: "a".into(),
            }),
        ),
    );
    assert_eq!(b.host, "b");
    assert_eq!(b.nodes[0].state, NodeState::Down);
    // A joiner not in the file gets a row.
    b.apply(6.0, &said("b", "node `c` (not in the cluster file) joins the running cluster: cpu; it gets work at the next epoch", joined("c")));
    assert_eq!(b.nodes.len(), 3);
}

#[test]
fn a_step_loss_is_over_every_node_and_a_redone_range_replaces_its_first_figure() {
    let mut b = board();
    let loss = |node: &str, first: u64, samples: u64, sum: f64| RunEvent::Loss {
        node: node.into(),
        step: 4,
        first_sample: first,
        samples,
        loss_sum: sum,
    };
    b.apply(0.0, &loss("a", 0, 6, 6.0));
    b.apply(0.0, &loss("b", 6, 2, 4.0));
    assert_eq!(b.step_losses(), vec![(4, 10.0 / 8.0, 8)]);
    b.apply(0.0, &loss("a", 6, 2, 2.0));
    assert_eq!(b.step_losses(), vec![(4, 1.0, 8)]);
}

#[test]
fn re_plans_name_what_led_to_them_and_the_first_plan_counts_once() {
    let mut b = board();
    b.apply(
        0.5,
        &RunEvent::Plan {
            node: "a".into(),
            text: "  a batch 8".into(),
            nodes: Vec::new(),
            sync: "ring".into(),
        },
    );
    b.apply(
        1.0,
        &said("a", "step 0: planned a=8, b=8", planned(0, &["a", "b"])),
    );
    assert_eq!(b.replans(), 0);
    b.apply(
        2.0,
        &said(
            "a",
            "checkpoint of step 4 written",
            Some(Fact::Checkpoint { step: 4 }),
        ),
    );
    b.apply(3.0, &said("a", "node `b` lost (silent 900 ms)", lost("b")));
    b.apply(3.1, &said("a", "step 5: planned a=16", planned(5, &["a"])));
    assert_eq!(b.replans(), 1);
    assert_eq!(b.plans[1].reason, "node `b` lost (silent 900 ms)");
}

#[test]
fn the_timeline_splits_time_into_compute_comm_idle_and_down_that_sum_to_at_most_one() {
    let mut b = board();
    b.apply(0.0, &progress("a", 0, 0.0, 0.0, 0));
    b.apply(2.0, &progress("a", 2, 1.0, 0.5, 2));
    b.apply(2.0, &cluster("b", "x"));
    b.apply(3.0, &said("a", "node `a` lost (silent 1 ms)", lost("a")));
    b.apply(4.0, &cluster("a", "x"));
    let t = b.timeline(4);
    let a = &t[0];
    assert!(
        (a[0][0] - 0.5).abs() < 1e-6 && (a[0][1] - 0.25).abs() < 1e-6,
        "{a:?}"
    );
    assert!((a[3][3] - 1.0).abs() < 1e-6, "{a:?}");
    for lane in &t {
        for slot in lane {
            assert!(slot.iter().sum::<f32>() <= 1.0 + 1e-5, "{slot:?}");
        }
    }
}

#[test]
fn thinning_keeps_the_ends_and_at_most_n() {
    let xs: Vec<u32> = (0..1000).collect();
    let t = thin(&xs, 7);
    assert_eq!(t.len(), 7);
    assert_eq!((t[0], t[6]), (0, 999));
    assert_eq!(thin(&xs[..3], 7), vec![0, 1, 2]);
}

#[test]
fn metrics_have_a_sample_per_node_and_parse_as_prometheus_text() {
    let mut b = board();
    b.apply(0.0, &progress("a", 0, 0.0, 0.0, 0));
    b.apply(1.0, &progress("a", 1, 0.5, 0.1, 1));
    let text = crate::metrics::render(&b);
    for node in ["a", "b"] {
        assert!(
            text.contains(&format!("ravnest_step{{node=\"{node}\"}}")),
            "{text}"
        );
    }
    assert!(text.contains("ravnest_bytes_sent_total{node=\"a\",peer=\"b\"} 1000"));
    // Every line: a comment, or `name{labels} value` with a number Prometheus reads.
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let (name, value) = line.rsplit_once(' ').unwrap();
        assert!(name.starts_with("ravnest_"), "{line}");
        assert!(
            value.parse::<f64>().is_ok() || ["NaN", "+Inf", "-Inf"].contains(&value),
            "{line}"
        );
    }
}

#[test]
fn a_redone_step_split_another_way_replaces_the_ranges_it_overlaps() {
    let mut b = board();
    let loss = |first: u64, samples: u64, sum: f64| RunEvent::Loss {
        node: "a".into(),
        step: 2,
        first_sample: first,
        samples,
        loss_sum: sum,
    };
    b.apply(0.0, &loss(0, 32, 32.0));
    b.apply(0.0, &loss(32, 32, 32.0));
    // Redone on one node: the same 64 samples, once.
    b.apply(1.0, &loss(0, 64, 32.0));
    assert_eq!(b.step_losses(), vec![(2, 0.5, 64)]);
}

#[test]
fn a_leave_is_not_a_re_plan_a_re_plan_puts_the_left_out_on_standby_and_done_stays_done() {
    let mut b = board();
    b.apply(0.0, &progress("a", 1, 0.1, 0.0, 1));
    b.apply(0.0, &progress("b", 1, 0.1, 0.0, 1));
    b.apply(
        0.5,
        &said("a", "step 0: planned a=8 b=8", planned(0, &["a", "b"])),
    );
    b.apply(
        1.0,
        &cluster(
            "a",
            "node `b` asked to leave: planned out at the next epoch (no re-plan for a loss)",
        ),
    );
    b.apply(1.5, &said("a", "step 3: planned a=16", planned(3, &["a"])));
    assert_eq!(b.replans(), 1, "{:?}", b.plans);
    assert_eq!(b.nodes[1].state, NodeState::Standby);
    let report = ravnest_node::summary::NodeReport {
        node: "a".into(),
        ..Default::default()
    };
    b.apply(2.0, &RunEvent::Report(report));
    b.apply(2.5, &said("a", "node `a` lost (silent 900 ms)", lost("a")));
    assert_eq!(b.nodes[0].state, NodeState::Done);
}

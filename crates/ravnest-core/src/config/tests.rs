//! Figures a user can write: each class of bad figure is refused with its field and line.

use super::parse;

const BASE: &str = r#"[links]
bandwidth_gbps = 10

[[node]]
name = "a"
device = "rtx3090"

[[node]]
name = "b"
device = "rtx3060"
#EXTRA

[model]
preset = "mlp-digits"

[training]
global_batch = 64

[run]
learning_rate = 0.05

[sim]
steps = 10

[[fault]]
kind = "crash"
node = "b"
at_s = 5
"#;

/// The error of BASE with `from` replaced by `to`; asserts its line and that it names `what`.
fn refused(from: &str, to: &str, line: usize, needles: &[&str]) {
    let text = BASE.replacen(from, to, 1);
    assert_ne!(text, BASE, "`{from}` is not in BASE");
    let e = parse(&text, "t.toml").expect_err(to);
    let shown = e.to_string();
    assert_eq!(e.at.map(|a| a.0), Some(line), "{to}: {shown}");
    for n in needles {
        assert!(shown.contains(n), "{to}: expected `{n}` in {shown}");
    }
    // No figure prints in 300 digits or in exponent form.
    assert!(shown.len() < 300, "{shown}");
    assert!(!shown.contains("e300") && !shown.contains("e+"), "{shown}");
}

#[test]
fn base_parses() {
    parse(BASE, "t.toml").unwrap();
}

#[test]
fn non_finite_figures_are_refused() {
    refused(
        "#EXTRA",
        "tflops = inf",
        11,
        &["`tflops` must be a finite number, got inf"],
    );
    refused(
        "#EXTRA",
        "tflops = nan",
        11,
        &["`tflops` must be greater than 0, got nan"],
    );
    refused(
        "bandwidth_gbps = 10",
        "bandwidth_gbps = inf",
        2,
        &["`bandwidth_gbps`", "finite"],
    );
    refused(
        "#EXTRA",
        "latency_ms = nan",
        11,
        &["`latency_ms` must be 0 or more, got nan"],
    );
    refused(
        "at_s = 5",
        "at_s = inf",
        28,
        &["`at_s` must be a finite number"],
    );
    refused(
        "learning_rate = 0.05",
        "learning_rate = inf",
        20,
        &["`learning_rate`"],
    );
}

#[test]
fn negative_and_zero_figures_are_refused() {
    refused(
        "#EXTRA",
        "memory_gib = -4",
        11,
        &["`memory_gib` must be greater than 0, got -4"],
    );
    refused(
        "#EXTRA",
        "tflops = 0",
        11,
        &["`tflops` must be greater than 0"],
    );
    refused(
        "bandwidth_gbps = 10",
        "bandwidth_gbps = 0",
        2,
        &["`bandwidth_gbps` must be greater than 0"],
    );
    refused("at_s = 5", "at_s = -1", 28, &["`at_s` must be 0 or more"]);
    refused(
        "global_batch = 64",
        "global_batch = 0",
        17,
        &["`global_batch` must be greater than 0"],
    );
}

#[test]
fn figures_beyond_any_real_cluster_are_refused() {
    refused(
        "#EXTRA",
        "tflops = 1e300",
        11,
        &[
            "`tflops` = about 10^300 is beyond any real cluster",
            "at most 10k",
        ],
    );
    refused(
        "#EXTRA",
        "tflops = 20000",
        11,
        &["`tflops` = 20k is beyond"],
    );
    refused(
        "#EXTRA",
        "memory_gib = 1e6",
        11,
        &["`memory_gib` = 1M is beyond", "check its unit"],
    );
    refused(
        "bandwidth_gbps = 10",
        "bandwidth_gbps = 1e5",
        2,
        &["`bandwidth_gbps` = 100k is beyond"],
    );
    refused(
        "#EXTRA",
        "latency_ms = 1e9",
        11,
        &["`latency_ms`", "a minute"],
    );
    refused("#EXTRA", "count = 1000000", 11, &["`count` = 1M is beyond"]);
    refused("at_s = 5", "at_s = 1e12", 28, &["`at_s`", "a year"]);
}

#[test]
fn figures_below_any_real_cluster_are_refused() {
    refused(
        "#EXTRA",
        "tflops = 1e-300",
        11,
        &[
            "`tflops` = about 10^-300 is below any real cluster",
            "at least 0.001",
        ],
    );
    refused(
        "bandwidth_gbps = 10",
        "bandwidth_gbps = 1e-9",
        2,
        &["`bandwidth_gbps`", "below"],
    );
}

#[test]
fn absurd_model_sizes_are_refused() {
    let gpt =
        "kind = \"gpt\"\nlayers = 2\nhidden = 1000000000\nheads = 8\nseq_len = 64\nvocab = 100";
    refused(
        "preset = \"mlp-digits\"",
        gpt,
        16,
        &["`hidden` = 1G is beyond"],
    );
    let custom = "kind = \"custom\"\n[[model.layer]]\nname = \"x\"\nparams = 100000000000000000\n\
                  fwd_flops_per_sample = 1.0\nactivation_elems_per_sample = 1\noutput_elems_per_sample = 1";
    refused(
        "preset = \"mlp-digits\"",
        custom,
        17,
        &["`params`", "is beyond"],
    );
}

/// A node with no more memory than the reserve is kept, with nothing usable: the planner
/// leaves it out with the reason instead of the whole file failing.
#[test]
fn a_node_smaller_than_the_reserve_is_kept_with_nothing_usable() {
    let s = parse(&BASE.replacen("#EXTRA", "memory_gib = 1", 1), "t.toml").unwrap();
    assert_eq!(s.cluster.nodes[1].memory_bytes, 0);
}

/// The recovery keys of `[training]`: a typo in a key or a value names the line and the nearest
/// valid name; a failure rate no node has is refused; the checkpoint interval a restore is
/// priced with is `[run]`'s (its run's steps when it writes only the final one).
#[test]
fn the_recovery_keys_are_checked_like_every_other() {
    use crate::cluster::Redundancy;
    // (Its message lists every valid key, longer than `refused` allows.)
    let typo = BASE.replace("global_batch = 64", "global_batch = 64\nnode_mtbf = 100");
    let e = parse(&typo, "t.toml").unwrap_err();
    assert_eq!(e.at, Some((18, 1)), "{e}");
    let shown = e.to_string();
    assert!(shown.contains("unknown field `node_mtbf`"), "{shown}");
    assert!(shown.contains("did you mean `node_mtbf_h`?"), "{shown}");
    refused(
        "global_batch = 64",
        "global_batch = 64\nredundancy = \"alway\"",
        18,
        &[
            "unknown variant `alway`",
            "did you mean `always`?",
            "auto, always, never",
        ],
    );
    refused(
        "global_batch = 64",
        "global_batch = 64\nnode_mtbf_h = 0",
        18,
        &["`node_mtbf_h` must be greater than 0"],
    );
    refused(
        "global_batch = 64",
        "global_batch = 64\nnode_mtbf_h = 1e9",
        18,
        &["`node_mtbf_h`", "beyond any real cluster"],
    );
    let s = parse(
        &BASE.replace(
            "global_batch = 64",
            "global_batch = 64\nnode_mtbf_h = 250\nredundancy = \"never\"",
        ),
        "t.toml",
    )
    .unwrap();
    assert_eq!(s.training.node_mtbf_h, 250.0);
    assert_eq!(s.training.redundancy, Redundancy::Never);
    assert_eq!(s.training.checkpoint_every_steps, 100);
    let d = parse(BASE, "t.toml").unwrap();
    assert_eq!(d.training.node_mtbf_h, crate::cluster::DEFAULT_NODE_MTBF_H);
    assert_eq!(d.training.redundancy, Redundancy::Auto);
    let only_final = BASE.replace(
        "learning_rate = 0.05",
        "learning_rate = 0.05\nsteps = 400\ncheckpoint_every_steps = 0",
    );
    assert_eq!(
        parse(&only_final, "t.toml")
            .unwrap()
            .training
            .checkpoint_every_steps,
        400
    );
}

#[test]
fn adamw_with_lossy_outer_rounds_is_refused_and_auto_rounds_stay_exact() {
    refused(
        "global_batch = 64",
        "global_batch = 64\noptimizer = \"adamw\"\nouter_precision = \"int8\"",
        19,
        &["outer_precision", "second moments", "fp32"],
    );
    let text = BASE.replacen(
        "global_batch = 64",
        "global_batch = 64\noptimizer = \"adamw\"\nouter_optimizer = \"nesterov\"",
        1,
    );
    let s = parse(&text, "t.toml").unwrap();
    let adamw = crate::planner::sync::Outer::of(&s.training.outer, s.training.optimizer);
    assert_eq!(adamw.packing, crate::pack::Packing::Fp32);
    let sgd =
        crate::planner::sync::Outer::of(&s.training.outer, crate::model::Optimizer::SgdMomentum);
    assert_eq!(sgd.packing, crate::pack::Packing::Int8);
    // A model from a folder needs a reader: the plain parse says so, naming the folder.
    let e = parse(
        &BASE.replacen("preset = \"mlp-digits\"", "from = \"models/x\"", 1),
        "t.toml",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("models/x") && e.contains("t.toml:14"), "{e}");
}

/// `[cluster] relays` and `transport`: relays imply libp2p; a relay that is not a multiaddr
/// with its peer id, relays with `transport = "tcp"`, and an unknown transport are refused at
/// their line.
#[test]
fn relays_and_the_transport_are_checked() {
    let with =
        |cluster: &str| BASE.replacen("[links]", &format!("[cluster]\n{cluster}\n\n[links]"), 1);
    let relay = "/ip4/203.0.113.7/tcp/4001/p2p/12D3KooWabc";
    let s = parse(&with(&format!("relays = [\"{relay}\"]")), "t.toml").unwrap();
    assert!(s.run.p2p);
    assert_eq!(s.run.relays, vec![relay.to_string()]);
    let s = parse(&with("transport = \"p2p\""), "t.toml").unwrap();
    assert!(s.run.p2p && s.run.relays.is_empty());
    assert!(!parse(BASE, "t.toml").unwrap().run.p2p);
    let cases = [
        ("relays = [\"203.0.113.7:4001\"]", "not a relay's multiaddr"),
        (
            &*format!("transport = \"tcp\"\nrelays = [\"{relay}\"]"),
            "cannot use `relays`",
        ),
        ("transport = \"quic\"", "unknown `quic`"),
    ];
    for (cluster, needle) in cases {
        let e = parse(&with(cluster), "t.toml").expect_err(cluster);
        let shown = e.to_string();
        assert!(shown.contains(needle), "{cluster}: {shown}");
        assert_eq!(e.at.map(|a| a.0), Some(2), "{cluster}: {shown}");
    }
}

//! End-to-end tests of the `ravnest` binary: golden plans for the shipped scenarios, one test per
//! user-facing error, and the JSON output.
//!
//! Golden files live in `tests/golden/`; regenerate them with `UPDATE_GOLDEN=1 cargo test`.

use std::path::PathBuf;
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn ravnest(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ravnest"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("run ravnest")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Write `text` to a fresh file in the target directory and return its path.
fn temp_file(name: &str, text: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn scenario_names() -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(root().join("scenarios"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "toml"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn golden_plans_for_every_shipped_scenario() {
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    let mut failures = Vec::new();
    for name in scenario_names() {
        let file = format!("scenarios/{name}.toml");
        let out = ravnest(&["plan", &file]);
        assert!(out.status.success(), "{file}: {}", stderr(&out));
        let got = stdout(&out);
        let golden: PathBuf = root().join("tests/golden").join(format!("{name}.txt"));
        if update {
            std::fs::write(&golden, &got).unwrap();
            continue;
        }
        let want = std::fs::read_to_string(&golden).unwrap_or_else(|_| {
            panic!(
                "missing {}: run UPDATE_GOLDEN=1 cargo test",
                golden.display()
            )
        });
        if got != want {
            failures.push(format!("--- {}\n+++ got\n{got}", golden.display()));
        }
    }
    assert!(
        failures.is_empty(),
        "plans changed (UPDATE_GOLDEN=1 to accept):\n{}",
        failures.join("\n")
    );
}

#[test]
fn every_shipped_scenario_is_embedded_and_benchmarked() {
    let out = ravnest(&["bench", "planners"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    for name in scenario_names() {
        assert!(
            table.lines().any(|l| l.starts_with(&name)),
            "{name} missing from:\n{table}"
        );
    }
    // exhaustive is an oracle for small clusters only, and says so for the large one.
    assert!(table.contains("n/a (more than 8 nodes)"), "{table}");
}

#[test]
fn the_default_plan_needs_no_file_and_follows_device_speed() {
    let out = ravnest(&["plan", "--json"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let nodes = v["plan"]["nodes"].as_array().unwrap();
    let batch = |name: &str| {
        nodes.iter().find(|n| n["name"] == name).unwrap()["batch"]
            .as_u64()
            .unwrap()
    };
    // The samples of a step: every worker's in data parallel, every first stage's in a
    // pipeline (a stage's batch is its replica's), each weighted by its share.
    let first = |n: &&serde_json::Value| {
        n["role"]["kind"] == "worker" || (n["role"]["kind"] == "stage" && n["role"]["stage"] == 0)
    };
    let total: u64 = nodes
        .iter()
        .filter(first)
        .map(|n| n["batch"].as_u64().unwrap())
        .sum();
    assert_eq!(total, v["training"]["global_batch"].as_u64().unwrap());
    let w: f64 = nodes
        .iter()
        .filter(first)
        .map(|n| n["grad_weight"].as_f64().unwrap())
        .sum();
    assert!((w - 1.0).abs() < 1e-9);
    // A 4090 is about four times a 3060: given work in proportion (a larger batch share, or
    // more layers), both compute about as long per step.
    assert!(batch("rtx4090-0") >= batch("rtx3060-0"));
    let compute = |name: &str| {
        nodes.iter().find(|n| n["name"] == name).unwrap()["compute_s"]
            .as_f64()
            .unwrap()
    };
    let (fast, slow) = (compute("rtx4090-0"), compute("rtx3060-0"));
    assert!(
        (fast - slow).abs() < 0.2 * fast.max(slow),
        "4090 computes {fast} s, 3060 {slow} s"
    );
    assert!(v["uniform"]["speedup"].as_f64().unwrap() > 1.5);
}

#[test]
fn every_planner_runs_on_a_small_scenario() {
    for planner in ["ravnest", "uniform", "param-count", "exhaustive"] {
        let out = ravnest(&[
            "plan",
            "scenarios/mixed-4090-3060.toml",
            "--planner",
            planner,
        ]);
        assert!(out.status.success(), "{planner}: {}", stderr(&out));
        assert!(stdout(&out).contains(&format!("planner {planner}:")));
    }
}

#[test]
fn catalog_lists_devices_and_presets() {
    let out = ravnest(&["catalog"]);
    let text = stdout(&out);
    for id in [
        "rtx3060",
        "rtx4090",
        "a100-80",
        "h100",
        "cpu",
        "gpt-7b",
        "mlp-digits",
    ] {
        assert!(text.contains(id), "{id}");
    }
}

// ---------------------------------------------------------------------------------------------
// Errors: each names the problem and where, exits with status 2, never panics.

fn expect_error(args: &[&str], needles: &[&str]) {
    let out = ravnest(args);
    let err = stderr(&out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "args {args:?}: stdout {}\nstderr {err}",
        stdout(&out)
    );
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "expected `{n}` in:\n{err}");
    }
}

const GOOD: &str = r#"
[[node]]
name = "a"
device = "rtx3090"

[[node]]
name = "b"
device = "rtx3060"

[model]
preset = "mlp-digits"

[training]
global_batch = 64
"#;

fn plan_text(name: &str, text: &str, needles: &[&str]) {
    let p = temp_file(name, text);
    expect_error(&["plan", p.to_str().unwrap()], needles);
}

/// Issue 34's second case as a file: one H100 holds a 1.3B GPT (bf16, SGD, batch 512) alone;
/// the only other card that holds it, an RTX 4090, is behind a 0.66 Gbit/s link. Under the
/// default (`auto`) the H100 trains alone and the plan prints what the second copy would cost
/// per step; under `redundancy = "always"` both train, and the plan prints what the single
/// copy would have saved.
#[test]
fn a_second_copy_behind_a_slow_link_is_printed_with_its_price() {
    let text = |redundancy: &str| {
        format!(
            "[links]\nbandwidth_gbps = 100.0\nlatency_ms = 0.1\n\
             [[node]]\nname = \"h100\"\ndevice = \"h100\"\n\
             [[node]]\nname = \"rtx4090\"\ndevice = \"rtx4090\"\nbandwidth_gbps = 0.66\nlatency_ms = 5.0\n\
             [[node]]\nname = \"rtx3060\"\ndevice = \"rtx3060\"\n\
             [model]\npreset = \"gpt-1.3b\"\n\
             [training]\nglobal_batch = 512\nmicro_batch = 4\nprecision = \"bf16\"\noptimizer = \"sgd\"\n\
             redundancy = \"{redundancy}\"\n"
        )
    };
    let plan = |redundancy: &str| {
        let p = temp_file(&format!("second-copy-{redundancy}.toml"), &text(redundancy));
        let out = ravnest(&["plan", p.to_str().unwrap()]);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    let auto = plan("auto");
    for needle in [
        "split: data parallel: h100 512\n",
        "recovery (1 copy of every layer): a lost node means restoring the latest checkpoint",
        "expected 8.0 ms per step (1 node(s), one loss per 1000 h each); step + recovery 24.05 s",
        "  data parallel over 2 nodes (2 copies): 55.01 s + 1.7 ms = 55.02 s: 30.97 s more per step",
    ] {
        assert!(auto.contains(needle), "expected `{needle}` in:\n{auto}");
    }
    let always = plan("always");
    for needle in [
        "split: data parallel: h100 439, rtx4090 73\n",
        "recovery (2 copies of every layer): a lost node is re-planned from a surviving copy",
        "  one worker (1 copy): 24.04 s + 8.0 ms = 24.05 s: one copy: `redundancy = \"always\"`",
    ] {
        assert!(always.contains(needle), "expected `{needle}` in:\n{always}");
    }
}

#[test]
fn the_good_file_plans() {
    let p = temp_file("good.toml", GOOD);
    let out = ravnest(&["plan", p.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
}

#[test]
fn error_typo_in_a_key_names_the_line_and_the_nearest_key() {
    let text = GOOD.replace("global_batch", "globl_batch");
    plan_text(
        "typo-key.toml",
        &text,
        &[
            "typo-key.toml:14:1",
            "unknown field `globl_batch`",
            "did you mean `global_batch`?",
        ],
    );
}

#[test]
fn error_unknown_device_suggests_the_nearest() {
    let text = GOOD.replace("\"rtx3060\"", "\"rtx3600\"");
    plan_text(
        "bad-device.toml",
        &text,
        &[
            "bad-device.toml:8:10",
            "unknown device `rtx3600`",
            "did you mean `rtx3060`?",
        ],
    );
}

#[test]
fn error_unknown_preset_and_optimizer_suggest_the_nearest() {
    let text = GOOD.replace("mlp-digits", "mlp-digit");
    plan_text(
        "bad-preset.toml",
        &text,
        &[
            "unknown model preset `mlp-digit`",
            "did you mean `mlp-digits`?",
        ],
    );
    let text = format!("{GOOD}optimizer = \"adam\"\n");
    plan_text(
        "bad-opt.toml",
        &text,
        &["unknown variant `adam`", "did you mean `adamw`?"],
    );
}

#[test]
fn error_model_that_fits_nowhere_says_what_it_needs() {
    let text = GOOD.replace("mlp-digits", "gpt-7b");
    plan_text(
        "too-big.toml",
        &text,
        &[
            "fits nowhere",
            "needs 117.6 GiB",
            "the largest node `a` has 23.0 GiB",
        ],
    );
}

#[test]
fn error_empty_cluster() {
    plan_text(
        "empty.toml",
        "[model]\npreset = \"mlp-digits\"\n",
        &["the cluster has no nodes", "add at least one [[node]]"],
    );
}

#[test]
fn error_zero_and_negative_figures() {
    let text = GOOD.replace("global_batch = 64", "global_batch = 0");
    plan_text(
        "zero-batch.toml",
        &text,
        &[
            "zero-batch.toml:14:16",
            "`global_batch` must be greater than 0",
        ],
    );
    let text = GOOD.replace(
        "device = \"rtx3060\"",
        "device = \"rtx3060\"\nmemory_gib = -12",
    );
    plan_text(
        "neg-mem.toml",
        &text,
        &[
            "neg-mem.toml:9:14",
            "`memory_gib` must be greater than 0, got -12",
        ],
    );
    let text = GOOD.replace("global_batch = 64", "global_batch = -64");
    plan_text(
        "neg-batch.toml",
        &text,
        &["neg-batch.toml:14:16", "invalid value"],
    );
}

/// Infinite, not-a-number and absurd figures are refused with their field and line, and
/// numbers print in human units (no 300-digit numbers).
#[test]
fn error_non_finite_and_absurd_figures() {
    let with = |extra: &str| {
        GOOD.replace(
            "device = \"rtx3060\"",
            &format!("device = \"rtx3060\"\n{extra}"),
        )
    };
    plan_text(
        "inf-tflops.toml",
        &with("tflops = inf"),
        &["inf-tflops.toml:9:10", "`tflops` must be a finite number"],
    );
    plan_text(
        "nan-latency.toml",
        &with("latency_ms = nan"),
        &[
            "nan-latency.toml:9:14",
            "`latency_ms` must be 0 or more, got nan",
        ],
    );
    let text = with("tflops = 1e300");
    let p = temp_file("huge-tflops.toml", &text);
    let out = ravnest(&["plan", p.to_str().unwrap()]);
    let e = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{e}");
    assert!(
        e.contains("huge-tflops.toml:9:10")
            && e.contains("`tflops` = about 10^300 is beyond any real cluster"),
        "{e}"
    );
    assert!(e.lines().all(|l| l.len() < 300), "{e}");
    plan_text(
        "huge-mem.toml",
        &with("memory_gib = 1e12"),
        &["`memory_gib` = 1T is beyond any real cluster (at most 100k"],
    );
    plan_text(
        "tiny-tflops.toml",
        &with("tflops = 1e-300"),
        &[
            "tiny-tflops.toml:9:10",
            "`tflops` = about 10^-300 is below any real cluster",
        ],
    );
}

/// A node too small for any part of the model is left out with the reason; the rest of the
/// cluster plans and simulates as before.
#[test]
fn a_node_too_small_for_anything_is_left_out_with_the_reason() {
    let text = GOOD.replace("mlp-digits", "gpt2-small").replace(
        "device = \"rtx3060\"",
        "device = \"rtx3060\"\n\n[[node]]\nname = \"tiny\"\ndevice = \"rtx3060\"\nmemory_gib = 1",
    ) + "\n[sim]\nsteps = 5\n";
    let p = temp_file("tiny-node.toml", &text);
    let out = ravnest(&["plan", p.to_str().unwrap()]);
    let o = stdout(&out);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        o.contains("idle (1: tiny): left out, too small for any part of the model")
            && o.contains("the node has 0 B usable"),
        "{o}"
    );
    let out = ravnest(&["sim", p.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("5/5 steps"), "{}", stdout(&out));
}

#[test]
fn error_missing_file() {
    expect_error(
        &["plan", "no/such/cluster.toml"],
        &["cannot read `no/such/cluster.toml`", "No such file"],
    );
}

#[test]
fn error_not_toml_at_all() {
    plan_text(
        "garbage.toml",
        "\u{0}\u{1}[[[ not toml",
        &["garbage.toml:1:"],
    );
}

#[test]
fn error_unknown_planner_suggests_the_nearest() {
    expect_error(
        &["plan", "--planner", "uniforn"],
        &["unknown planner `uniforn`", "did you mean `uniform`?"],
    );
}

#[test]
fn error_exhaustive_on_a_large_cluster() {
    expect_error(
        &[
            "plan",
            "scenarios/large-1000.toml",
            "--planner",
            "exhaustive",
        ],
        &["limited to 8 nodes", "this cluster has 1000"],
    );
}

#[test]
fn error_fault_naming_an_unknown_node() {
    let text = format!("{GOOD}\n[[fault]]\nkind = \"crash\"\nnode = \"c\"\nat_s = 3\n");
    plan_text("bad-fault.toml", &text, &["unknown node `c`"]);
    let text = format!("{GOOD}\n[[fault]]\nkind = \"crahs\"\nnode = \"a\"\nat_s = 3\n");
    plan_text(
        "bad-fault-kind.toml",
        &text,
        &["unknown fault kind `crahs`", "did you mean `crash`?"],
    );
}

#[test]
fn error_unsupported_precision_names_the_node() {
    let text = GOOD
        .replace("device = \"rtx3060\"", "device = \"v100-16\"")
        .replace(
            "global_batch = 64",
            "global_batch = 64\nprecision = \"bf16\"",
        );
    plan_text(
        "bf16.toml",
        &text,
        &["device `v100-16` has no bf16 support"],
    );
}

#[test]
fn sim_default_detects_the_crash_and_all_checkers_hold() {
    let out = ravnest(&["sim"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("300/300 steps"), "{text}");
    assert!(text.contains("crash rtx3090-1: detected after"), "{text}");
    assert!(text.contains("checkers: all held"), "{text}");
    // Same seed, same hash, across processes.
    let again = stdout(&ravnest(&["sim"]));
    let hash = |t: &str| {
        t.lines()
            .find(|l| l.starts_with("trace:"))
            .unwrap()
            .to_string()
    };
    assert_eq!(hash(&text), hash(&again));
}

#[test]
fn sim_json_and_compare() {
    let out = ravnest(&[
        "sim",
        "scenarios/mixed-4090-3060.toml",
        "--steps",
        "10",
        "--compare",
        "uniform",
        "--json",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let runs = v.as_array().unwrap();
    assert_eq!(runs.len(), 2);
    assert_eq!(runs[0]["planner"], "ravnest");
    assert_eq!(runs[1]["planner"], "uniform");
    assert!(
        runs[0]["samples_per_s"].as_f64().unwrap() > runs[1]["samples_per_s"].as_f64().unwrap()
    );
}

#[test]
fn sim_runs_a_model_that_fits_no_node_as_a_pipeline() {
    let out = ravnest(&["sim", "scenarios/memory-limited.toml", "--steps", "4"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(text.contains("4/4 steps"), "{text}");
    assert!(text.contains("checkers: all held"), "{text}");
}

#[test]
fn sim_writes_a_timeline_picture() {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("flaky.svg");
    let out = ravnest(&["sim", "--timeline", path.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    for lane in ["rtx3090-0", "rtx3090-1", "rtx4090", "rtx3060"] {
        assert!(svg.contains(&format!(">{lane}</text>")), "lane {lane}");
    }
    assert!(svg.contains("crash rtx3090-1") && svg.contains("rtx3090-1 declared dead"));
    assert!(
        svg.contains("#444444"),
        "the crashed node's down time is drawn"
    );
}

#[test]
fn bench_sim_compares_planners_in_simulation() {
    let out = ravnest(&["bench", "sim", "--steps", "5"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = stdout(&out);
    assert!(table.contains("mixed-4090-3060"), "{table}");
    // The pipeline scenario runs under every planner.
    let rows: Vec<&str> = table
        .lines()
        .skip_while(|l| !l.starts_with("memory-limited"))
        .take(3)
        .collect();
    assert_eq!(rows.len(), 3, "{table}");
    assert!(rows.iter().all(|r| r.contains(" s ")), "{table}");
    assert!(!table.contains("CHECKER FAILED"), "{table}");
}

#[test]
fn error_run_needs_an_address_per_node() {
    let out = ravnest(&["run", "scenarios/mixed-4090-3060.toml"]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("node `rtx4090-0` has no `address`"),
        "unexpected error: {e}"
    );
}

#[test]
fn error_run_unknown_node_lists_the_nodes() {
    let out = ravnest(&["run", "--node", "fast-c", "--out", "target/none"]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("no node named `fast-c` (nodes: fast, slow)"),
        "unexpected error: {e}"
    );
}

#[test]
fn error_run_unreadable_dataset_is_named() {
    let text = std::fs::read_to_string(root().join("scenarios/local-digits.toml"))
        .unwrap()
        .replace(
            "dataset = \"digits\"",
            "dataset = \"/nonexistent/train.csv\"",
        );
    let f = temp_file("bad-dataset.toml", &text);
    let out = ravnest(&["run", f.to_str().unwrap(), "--node", "fast"]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("/nonexistent/train.csv: cannot read the dataset"),
        "unexpected error: {e}"
    );
}

#[test]
fn error_run_char_model_needs_a_text_file() {
    let text = std::fs::read_to_string(root().join("scenarios/local-digits.toml"))
        .unwrap()
        .replace("seed = 1\n", "seed = 1\nnetwork = \"char\"\n");
    let f = temp_file("char-on-digits.toml", &text);
    let out = ravnest(&["run", f.to_str().unwrap(), "--node", "fast"]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains(
            "[run] network = \"char\" trains on text: set [run] dataset to a text file's path"
        ),
        "unexpected error: {e}"
    );
    let text = text.replace(
        "dataset = \"digits\"",
        "dataset = \"/nonexistent/book.txt\"",
    );
    let f = temp_file("char-missing.toml", &text);
    let out = ravnest(&["run", f.to_str().unwrap(), "--node", "fast"]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("/nonexistent/book.txt: cannot read the text"),
        "unexpected error: {e}"
    );
}

#[test]
fn error_unknown_network_suggests_the_nearest() {
    let text = std::fs::read_to_string(root().join("scenarios/local-digits.toml"))
        .unwrap()
        .replace("seed = 1\n", "seed = 1\nnetwork = \"chr\"\n");
    let f = temp_file("chr.toml", &text);
    let out = ravnest(&["run", f.to_str().unwrap(), "--node", "fast"]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("unknown network `chr`") && e.contains("char"),
        "unexpected error: {e}"
    );
}

#[test]
fn error_run_join_address_problems_are_named() {
    let out = ravnest(&["run", "--join", "127.0.0.1:1"]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(e.contains("--join 127.0.0.1:1: name the node"), "{e}");

    let out = ravnest(&["run", "--join", "127.0.0.1:1", "--node", "b"]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("--join 127.0.0.1:1: node at 127.0.0.1:1"),
        "unexpected error: {e}"
    );

    let out = ravnest(&["run", "--join", "not-an-address", "--node", "b"]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("--join not-an-address: `not-an-address` is not a reachable host:port"),
        "{e}"
    );

    let out = ravnest(&[
        "run",
        "scenarios/local-digits.toml",
        "--join",
        "127.0.0.1:1",
        "--node",
        "b",
    ]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("give a cluster file or --join 127.0.0.1:1, not both"),
        "{e}"
    );
}

#[test]
fn error_run_out_of_range_numbers_are_refused_when_read() {
    for args in [
        &["run", "--steps", "0", "--out", "target/none"][..],
        &["sim", "--steps", "0"][..],
    ] {
        let out = ravnest(args);
        let e = stderr(&out);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {e}");
        assert!(!e.contains("panicked"), "{e}");
        assert!(e.contains("--steps"), "{e}");
    }
}

#[test]
fn error_two_nodes_at_one_address_and_listen_without_address() {
    let two = "[[node]]\nname = \"a\"\ndevice = \"cpu\"\naddress = \"127.0.0.1:7000\"\n[[node]]\nname = \"b\"\ndevice = \"cpu\"\naddress = \"127.0.0.1:7000\"\n[model]\npreset = \"mlp-digits\"\n[training]\nglobal_batch = 64\n";
    let p = temp_file("same-address.toml", two);
    expect_error(
        &["plan", p.to_str().unwrap()],
        &[
            "same-address.toml:",
            "node `b` has the same address as node `a`",
        ],
    );
    let listen = "[[node]]\nname = \"a\"\ndevice = \"cpu\"\nlisten = \"0.0.0.0:7000\"\n[model]\npreset = \"mlp-digits\"\n[training]\nglobal_batch = 64\n";
    let p = temp_file("listen-alone.toml", listen);
    expect_error(&["plan", p.to_str().unwrap()], &["`listen`", "`address`"]);
}

/// Another program holds a node's port: the run stops at once with a non-zero exit and names
/// the port, instead of waiting for the node and training without it.
#[test]
fn a_port_in_use_fails_the_run_fast_and_names_the_port() {
    let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let text = std::fs::read_to_string(root().join("scenarios/local-digits.toml"))
        .unwrap()
        .replace("127.0.0.1:47702", &format!("127.0.0.1:{port}"))
        .replace("47701", "47731");
    let p = temp_file("port-in-use.toml", &text);
    let t0 = std::time::Instant::now();
    let out = ravnest(&["run", p.to_str().unwrap(), "--out", "target/port-in-use"]);
    let e = stderr(&out);
    assert!(!out.status.success(), "{e}");
    assert!(e.contains(&port.to_string()), "{e}");
    assert!(!e.contains("panicked"), "{e}");
    // Generous for a shared machine; by hand it takes well under a second.
    assert!(t0.elapsed().as_secs() < 30, "{:?}", t0.elapsed());
}

/// `kill -9` of the local launcher takes its node processes with it.
#[test]
#[cfg(target_os = "linux")]
fn the_nodes_die_with_their_launcher() {
    use std::io::BufRead;
    let text = std::fs::read_to_string(root().join("scenarios/local-digits.toml"))
        .unwrap()
        .replace("477", "478");
    let p = temp_file("launcher.toml", &text);
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ravnest"))
        .args(["run", p.to_str().unwrap(), "--json", "--steps", "100000"])
        .args(["--out", "target/launcher-kill", "--overwrite"])
        .current_dir(root())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut pids = Vec::new();
    for line in std::io::BufReader::new(child.stdout.take().unwrap()).lines() {
        let v: serde_json::Value = serde_json::from_str(&line.unwrap()).unwrap_or_default();
        if let Some(p) = v["pid"].as_u64() {
            pids.push(p);
        }
        if v["event"] == "progress" && v["step"].as_u64() > Some(0) {
            break;
        }
    }
    assert_eq!(pids.len(), 2);
    child.kill().unwrap();
    child.wait().unwrap();
    let alive = |pid: u64| {
        std::path::Path::new(&format!("/proc/{pid}")).exists()
            && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .unwrap_or_default()
                .contains(") Z ")
    };
    let t0 = std::time::Instant::now();
    while pids.iter().any(|&p| alive(p)) && t0.elapsed().as_secs() < 5 {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let left: Vec<u64> = pids.iter().copied().filter(|&p| alive(p)).collect();
    assert!(
        left.is_empty(),
        "still running 5 s after the launcher: {left:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// `ravnest generate`.

/// A small GPT's checkpoints (AdamW, two steps) in a fresh folder under the target directory.
/// Its head is made to give every byte outside printable ASCII a logit about 60 lower, so the
/// sampled text is one character per token.
fn gpt_checkpoints(name: &str) -> PathBuf {
    use ravnest_train::net::Network;
    let g = ravnest_train::gpt::Gpt::gpt2(2, 32, 4, 16, 256);
    let net = Network::Gpt(g);
    let mut params = g.init(5);
    let layout = net.layout();
    let at = |n: &str| layout.iter().find(|p| p.name == n).unwrap().offset;
    // ln_f's first output is the constant 10; the head reads it as -6 per unprintable byte.
    params[at("transformer.ln_f.weight")] = 0.0;
    params[at("transformer.ln_f.bias")] = 10.0;
    let head = at("lm_head.weight");
    for t in (0..32).chain(127..256) {
        params[head + t * g.hidden] = -6.0;
    }
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let _ = std::fs::remove_dir_all(&dir);
    let files = ravnest_train::store::CheckpointFiles {
        hf_source: None,
        term: 0,
        dir: dir.join("checkpoints"),
        net,
        optim: ravnest_train::optim::Optim {
            kind: ravnest_core::Optimizer::Adamw,
            lr: 1e-3,
            momentum: 0.9,
            weight_decay: 0.0,
            schedule: ravnest_core::recipe::Schedule::CONSTANT,
        },
        meta: Default::default(),
    };
    let p = files.net.params();
    let mut flat = params;
    flat.resize(p + files.optim.state_len(p), 0.0);
    files.write(1, &flat, "{}").unwrap();
    files.write(2, &flat, "{}").unwrap();
    dir
}

#[test]
fn generate_continues_a_prompt_reproducibly_with_a_seed() {
    let dir = gpt_checkpoints("generate-gpt");
    let folder = dir.join("checkpoints");
    let folder = folder.to_str().unwrap();
    let run = |what: &str, seed: &str| {
        let out = ravnest(&[
            "generate", what, "--prompt", "Hello, ", "--tokens", "40", "--seed", seed,
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    let a = run(folder, "3");
    assert!(a.starts_with("Hello, ") && a.ends_with('\n'), "{a:?}");
    let body = a
        .strip_prefix("Hello, ")
        .unwrap()
        .strip_suffix('\n')
        .unwrap();
    assert_eq!(body.chars().count(), 40, "{a:?}");
    assert!(
        body.chars().all(|c| c.is_ascii() && !c.is_ascii_control()),
        "{a:?}"
    );
    assert_eq!(run(folder, "3"), a, "the same seed gives the same text");
    assert_ne!(run(folder, "4"), a, "another seed, another text");
    // The same weights through a step's file, and through the run's folder.
    let step = dir.join("checkpoints/step-00000002.safetensors");
    assert_eq!(run(step.to_str().unwrap(), "3"), a);
    assert_eq!(run(dir.to_str().unwrap(), "3"), a);
    // The defaults: 200 tokens.
    let out = ravnest(&["generate", folder, "--prompt", "x"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim_end_matches('\n').chars().count(), 201);
}

#[test]
fn error_generate_missing_checkpoint_is_named() {
    let missing = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("no-such-checkpoints");
    let m = missing.to_str().unwrap();
    expect_error(
        &["generate", m, "--prompt", "a"],
        &[&format!("{m}: no such file or folder")],
    );
    let dir = gpt_checkpoints("generate-gpt-bad");
    expect_error(
        &[
            "generate",
            dir.to_str().unwrap(),
            "--prompt",
            "a",
            "--temperature",
            "-1",
        ],
        &["--temperature -1: a temperature is 0 or more"],
    );
}

#[test]
fn error_generate_refuses_an_mlp_checkpoint_and_a_wrong_tensor() {
    use ravnest_train::net::Network;
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("generate-mlp");
    let _ = std::fs::remove_dir_all(&dir);
    let files = ravnest_train::store::CheckpointFiles {
        hf_source: None,
        term: 0,
        dir: dir.clone(),
        net: Network::Mlp {
            dims: vec![4, 8, 3],
        },
        optim: ravnest_train::optim::Optim {
            kind: ravnest_core::Optimizer::Sgd,
            lr: 0.1,
            momentum: 0.0,
            weight_decay: 0.0,
            schedule: ravnest_core::recipe::Schedule::CONSTANT,
        },
        meta: Default::default(),
    };
    let path = files
        .write(3, &vec![0.1; files.net.params()], "{}")
        .unwrap();
    let d = dir.to_str().unwrap();
    expect_error(
        &["generate", d, "--prompt", "a"],
        &[
            &path.display().to_string(),
            "is the checkpoint of a `mlp` network, not of a GPT",
        ],
    );
    // A GPT's folder whose config.json says another width than its weights have, and whose
    // weights carry no metadata (as if saved by transformers).
    let gdir = gpt_checkpoints("generate-gpt-shape");
    let folder = gdir.join("checkpoints");
    let model = folder.join("model.safetensors");
    let bytes = std::fs::read(&model).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header.as_object_mut().unwrap().remove("__metadata__");
    let header = header.to_string();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header.as_bytes());
    out.extend(&bytes[8 + n..]);
    std::fs::remove_file(&model).unwrap();
    std::fs::write(&model, out).unwrap();
    let config = folder.join("config.json");
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace("\"n_positions\": 16", "\"n_positions\": 32");
    std::fs::write(&config, text).unwrap();
    expect_error(
        &["generate", folder.to_str().unwrap(), "--prompt", "a"],
        &[
            &model.display().to_string(),
            "`transformer.wpe.weight` is [16, 32], but config.json makes it [32, 32]",
        ],
    );
}

/// One policy: `plan`, `sim` and `run --dry-run` print the same split for every shipped
/// scenario (the 1,000-node one is compared in-process by the simulator's table test).
#[test]
fn plan_sim_and_run_dry_run_show_the_same_split_on_every_scenario() {
    let split = |o: &Output| {
        stdout(o)
            .lines()
            .find(|l| l.starts_with("split: "))
            .map(str::to_string)
    };
    for name in scenario_names().iter().filter(|n| *n != "large-1000") {
        let file = format!("scenarios/{name}.toml");
        let p = ravnest(&["plan", &file]);
        let s = ravnest(&["sim", &file, "--steps", "3"]);
        let d = ravnest(&["run", &file, "--dry-run"]);
        for o in [&p, &s] {
            assert!(o.status.success(), "{name}: {}", stderr(o));
        }
        // A file `run` would refuse here (GPUs on a CPU build, no addresses) prints its plan,
        // then why, and fails.
        assert!(
            d.status.success() || stderr(&d).contains("`ravnest run` would refuse this file"),
            "{name}: {}",
            stderr(&d)
        );
        if name == "mixed-4090-3060" && !d.status.success() {
            assert!(stderr(&d).contains("built without CUDA"), "{}", stderr(&d));
        }
        let (p, s, d) = (split(&p), split(&s), split(&d));
        assert!(p.is_some(), "{name}: plan prints no split");
        assert_eq!(p, s, "{name}: plan vs sim");
        assert_eq!(p, d, "{name}: plan vs run --dry-run");
    }
}

/// Global gradient clipping holds for every layout: a file that asks for it with a pipeline
/// plans that pipeline, and under `auto` on nodes that hold no whole replica the plan is still
/// made (its stages exchange their pieces of the norm); a bound of 0 is refused at the key.
#[test]
fn max_grad_norm_plans_every_layout() {
    let base = std::fs::read_to_string(root().join("scenarios/local-gpt.toml")).unwrap();
    let text = base.replace("seed = 1\n", "seed = 1\nmax_grad_norm = 1.0\n");
    for (name, text) in [
        ("clip-pipeline.toml", text.clone()),
        (
            "clip-small.toml",
            text.replace("layout = \"pipeline\"", "layout = \"auto\""),
        ),
    ] {
        let f = temp_file(name, &text);
        let out = ravnest(&["plan", f.to_str().unwrap()]);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        assert!(stdout(&out).contains("stage"), "{name}: {}", stdout(&out));
    }
    let bad = base.replace("seed = 1\n", "seed = 1\nmax_grad_norm = 0\n");
    plan_text("clip-zero.toml", &bad, &["max_grad_norm"]);
}

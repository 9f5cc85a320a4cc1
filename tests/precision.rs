//! `[training] precision = "bf16"` in `run`, end to end: a GPT on a CPU node trains in mixed
//! precision (bf16 products, fp32 master weights and optimizer), and its loss curve follows the
//! fp32 run's of the same data and seed, step by step, without being the same numbers.

mod common;
use common::free_ports;
use std::path::{Path, PathBuf};
use std::process::Command;

fn exe() -> &'static str {
    env!("CARGO_BIN_EXE_ravnest")
}

/// A one-node gpt-tiny run of `steps` in `precision`; its per-step losses and its `--json`.
fn run(dir: &Path, precision: &str, steps: u64) -> (Vec<f64>, String) {
    let port = free_ports(1)[0];
    let data = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/eighty-days.txt");
    let file = dir.join(format!("{precision}.toml"));
    std::fs::write(
        &file,
        format!(
            r#"[cluster]
name = "precision-{precision}"
secret = "precision"
[[node]]
name = "a"
device = "cpu"
address = "127.0.0.1:{port}"
[model]
preset = "gpt-tiny"
[training]
global_batch = 8
optimizer = "adamw"
precision = "{precision}"
memory_reserve_gib = 0
[run]
network = "gpt"
dataset = "{}"
steps = {steps}
learning_rate = 0.002
lr_schedule = "cosine"
warmup_steps = 10
max_grad_norm = 1.0
seed = 3
checkpoint_every_steps = 0
"#,
            data.display()
        ),
    )
    .unwrap();
    let out = Command::new(exe())
        .args(["run", file.to_str().unwrap(), "--json", "--out"])
        .arg(dir.join(format!("out-{precision}")))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{precision}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut losses = vec![(0.0, 0u64); steps as usize];
    for line in stdout.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if v["event"] == "loss" {
            let k = v["step"].as_u64().unwrap() as usize;
            losses[k].0 += v["loss_sum"].as_f64().unwrap();
            losses[k].1 += v["samples"].as_u64().unwrap();
        }
    }
    let losses = losses.iter().map(|(l, n)| l / *n as f64).collect();
    (losses, stdout)
}

#[test]
fn bf16_on_a_cpu_follows_the_fp32_loss_curve() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("precision");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let steps = 60;
    let (fp32, _) = run(&dir, "fp32", steps);
    let (bf16, said) = run(&dir, "bf16", steps);
    assert!(
        said.contains("bf16 mixed precision"),
        "the run says how it computes: {said}"
    );
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs();
    let mut apart: Vec<f64> = bf16.iter().zip(&fp32).map(|(a, b)| rel(*a, *b)).collect();
    for (k, (a, b)) in bf16.iter().zip(&fp32).enumerate() {
        eprintln!("step {k}: bf16 {a:.6}, fp32 {b:.6}");
    }
    // Step by step the same curve to bf16's precision: under this recipe (warm-up, cosine,
    // clipping) the median step is about 1e-4 apart on seeds 3 to 6, the last ten steps within
    // 0.1%; a constant 3e-3 without warm-up is chaotic (a step's loss here and there 8% apart,
    // the last ten steps up to 4% on seed 5).
    apart.sort_by(f64::total_cmp);
    let median = apart[apart.len() / 2];
    assert!(median < 0.01, "half the steps apart by more than {median}");
    // The rounding is real: the curves are not the same numbers.
    assert!(bf16 != fp32, "bf16 computed exactly what fp32 did");
    // Both learned, about as much: the mean of the last ten steps within 2%.
    let tail = |v: &[f64]| v[v.len() - 10..].iter().sum::<f64>() / 10.0;
    let (a, b) = (tail(&bf16), tail(&fp32));
    assert!(b < fp32[0] - 0.5, "fp32 learned: {fp32:?}");
    assert!(rel(a, b) < 0.02, "the last ten steps: bf16 {a} vs fp32 {b}");
}

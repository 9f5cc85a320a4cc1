//! A pipeline stage reads only its own layers from a Hugging Face folder: its resident memory
//! while it makes its layers stays within what those layers hold + 64 MiB, far below the
//! whole folder. The folder (a Llama of 84 MiB in two shards with an index, written here as
//! `save_pretrained` lays it out) is loaded by a child process of this test, so that its peak
//! resident memory (`VmHWM`) counts that load alone.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use ravnest_core::{LayerRange, Optimizer};
use ravnest_protocol::node::values::Values;
use ravnest_runtime::Compute;
use ravnest_train::compute::CandleCompute;
use ravnest_train::gpt::Gpt;
use ravnest_train::net::Network;
use ravnest_train::optim::Optim;

const CHILD: &str = "RAVNEST_LOAD_STAGE";

fn model() -> Gpt {
    Gpt::llama(8, 256, 8, 4, 704, 64, 32_000)
}

/// (resident MiB now, peak resident MiB) of this process.
fn rss_mib() -> (f64, f64) {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let get = |k: &str| {
        s.lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    };
    (get("VmRSS:"), get("VmHWM:"))
}

/// Write `g` as transformers' `save_pretrained` would: config.json, two shards, the index.
fn write_folder(g: &Gpt, dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    let config = serde_json::to_string_pretty(&g.hf_config()).unwrap();
    std::fs::write(dir.join("config.json"), config).unwrap();
    let params = g.params_in_order();
    let half = params.len() / 2;
    let mut map = serde_json::Map::new();
    for (k, part) in [&params[..half], &params[half..]].iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", k + 1);
        let data: Vec<(String, Vec<u8>, Vec<usize>)> = part
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let n: usize = p.shape.iter().product();
                let bytes = (0..n)
                    .flat_map(|j| (((i * 31 + j * 7) % 101) as f32 * 1e-3).to_le_bytes())
                    .collect();
                map.insert(p.name.clone(), file.clone().into());
                (p.name.clone(), bytes, p.shape.clone())
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = data
            .iter()
            .map(|(n, b, s)| {
                let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                    .unwrap();
                (n.clone(), v)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join(&file)).unwrap();
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

/// In the child: make layers `lo..hi` from the folder as a stage does; print what it took.
fn load_stage(dir: &Path, lo: u32, hi: u32) {
    let g = model();
    let before = rss_mib().0;
    let folder = ravnest_train::folder::HfFolder::open(dir).unwrap();
    folder.check(&g).unwrap();
    let optim = Optim {
        kind: Optimizer::Adamw,
        lr: 1e-3,
        momentum: 0.9,
        weight_decay: 0.0,
        schedule: ravnest_core::recipe::Schedule::CONSTANT,
    };
    let ids: Vec<u32> = (0..2_000).map(|i| i % 300).collect();
    let data = ravnest_train::data::Dataset::tokens(&ids, "t", g.seq, g.vocab).unwrap();
    let compute = CandleCompute::new(Network::Gpt(g), Arc::new(data), optim, 1, 1.0)
        .with_pretrained(Arc::new(folder));
    let layers = LayerRange::new(lo, hi);
    let model = compute.initial(Some(layers));
    let state = compute.model_state();
    let idx = state.layout.indices(Some(layers)).unwrap();
    let vars = state.vars(&model, idx, &candle_core::Device::Cpu).unwrap();
    let held = compute.state_stats().held_bytes as f64 / (1 << 20) as f64;
    let peak = rss_mib().1;
    println!("LOADED before={before:.1} peak={peak:.1} held={held:.1}");
    drop(vars);
}

#[test]
fn a_stage_reads_its_layers_only() {
    if let Ok(job) = std::env::var(CHILD) {
        let mut it = job.split(':');
        let dir = PathBuf::from(it.next().unwrap());
        let lo = it.next().unwrap().parse().unwrap();
        let hi = it.next().unwrap().parse().unwrap();
        load_stage(&dir, lo, hi);
        return;
    }
    let g = model();
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("folder-load");
    write_folder(&g, &dir);
    let whole_mib = 4.0 * g.params() as f64 / (1 << 20) as f64;
    for (lo, hi) in [(0, 3), (3, 7), (7, 10)] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["a_stage_reads_its_layers_only", "--exact", "--nocapture"])
            .env(CHILD, format!("{}:{lo}:{hi}", dir.display()))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find(|l| l.starts_with("LOADED"))
            .unwrap_or_else(|| {
                panic!(
                    "the child said: {text} {}",
                    String::from_utf8_lossy(&out.stderr)
                )
            });
        let fig = |k: &str| -> f64 {
            line.split_whitespace()
                .find_map(|w| w.strip_prefix(&format!("{k}=")))
                .unwrap()
                .parse()
                .unwrap()
        };
        let (before, peak, held) = (fig("before"), fig("peak"), fig("held"));
        eprintln!(
            "layers {lo}..{hi}: peak {peak:.0} MiB, before {before:.0} MiB, held {held:.0} MiB (whole model's weights {whole_mib:.0} MiB)"
        );
        assert!(
            peak <= before + held + 64.0,
            "layers {lo}..{hi}: peak {peak:.0} MiB > {before:.0} + held {held:.0} + 64"
        );
        // The layers' weights, not the folder's: the blocks alone are a fraction of it.
        let weights = held / 3.0;
        assert!(
            peak - before < weights + 0.5 * (whole_mib - weights),
            "layers {lo}..{hi} grew {:.0} MiB; their weights are {weights:.0} of {whole_mib:.0} MiB",
            peak - before
        );
    }
}

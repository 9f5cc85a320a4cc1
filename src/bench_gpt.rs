//! `ravnest bench gpt`: one node training a transformer through ravnest's compute (the step a
//! node runs: forward, backward, AdamW on its model state) against PyTorch's
//! `GPT2LMHeadModel` or `LlamaForCausalLM` of the same shape, batch, data and optimizer, on
//! the same number of threads each (one unless `--threads`), in interleaved rounds.

use std::time::Instant;

use anyhow::{Result, bail};

/// A GPT shape and batch to compare at.
#[derive(Debug, Clone, Copy)]
pub struct Case {
    /// The name printed.
    pub name: &'static str,
    /// The shape.
    pub gpt: ravnest_train::gpt::Gpt,
    /// Samples per step.
    pub batch: u64,
}

/// gpt-small (6 blocks, hidden 384, 6 heads, 128 tokens) at batch 16, gpt2-small's shape (12
/// blocks, hidden 768, 12 heads, 256 tokens) at batch 4, and SmolLM-135M's Llama block (hidden
/// 576, 9 heads over 3 key/value heads, SwiGLU 1536 wide) 6 times of its 30 (the whole model
/// takes 15 s a step on one core: a round of both sides would take minutes), 128 tokens, batch
/// 8; all over bytes (a vocabulary of 256).
pub const CASES: [Case; 3] = [
    Case {
        name: "gpt-small",
        gpt: ravnest_train::gpt::Gpt::gpt2(6, 384, 6, 128, 256),
        batch: 16,
    },
    Case {
        name: "gpt2-small shape",
        gpt: ravnest_train::gpt::Gpt::gpt2(12, 768, 12, 256, 256),
        batch: 4,
    },
    Case {
        name: "smollm block x6",
        gpt: ravnest_train::gpt::Gpt::llama(6, 576, 9, 3, 1536, 128, 256),
        batch: 8,
    },
];

const LR: f32 = 1e-3;
const WEIGHT_DECAY: f32 = 0.01;

/// The PyTorch side: `GPT2LMHeadModel` of the shape (GELU tanh, no dropout, LM head not tied,
/// as ravnest's), AdamW, the threads it is given, the same kind of data; prints seconds per step of `steps`
/// timed steps after two untimed ones.
const TORCH_GPT: &str = r#"
import sys, time, torch
from transformers import GPT2Config, GPT2LMHeadModel
layers, hidden, heads, seq, vocab, batch, steps, threads = map(int, sys.argv[1:9])
torch.set_num_threads(threads)
torch.manual_seed(1)
cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers, n_head=heads,
                 n_inner=4 * hidden, activation_function="gelu_new", resid_pdrop=0.0,
                 embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False)
model = GPT2LMHeadModel(cfg)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
g = torch.Generator().manual_seed(2)
def step():
    x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    out = model(input_ids=x[:, :seq], labels=None)
    logits = out.logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
for _ in range(2):
    step()
t = time.perf_counter()
for _ in range(steps):
    step()
print((time.perf_counter() - t) / steps)
"#;

/// The PyTorch side of a Llama case: `LlamaForCausalLM` (RMSNorm ε 1e-5, θ 10000, untied, no
/// biases, as ravnest's), the same steps as [`TORCH_GPT`].
const TORCH_LLAMA: &str = r#"
import sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
layers, hidden, heads, kv, inner, seq, vocab, batch, steps, threads = map(int, sys.argv[1:11])
torch.set_num_threads(threads)
torch.manual_seed(1)
cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inner,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                  max_position_embeddings=seq, rms_norm_eps=1e-5, tie_word_embeddings=False)
model = LlamaForCausalLM(cfg)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
g = torch.Generator().manual_seed(2)
def step():
    x = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    logits = model(input_ids=x[:, :seq]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
for _ in range(2):
    step()
t = time.perf_counter()
for _ in range(steps):
    step()
print((time.perf_counter() - t) / steps)
"#;

/// Seconds per PyTorch step at `case` on `threads` threads, or why it could not run.
fn torch_step_s(python: &str, case: &Case, steps: u64, threads: usize) -> Result<f64, String> {
    let g = case.gpt;
    let (script, sizes) = if g.is_llama() {
        (
            TORCH_LLAMA,
            vec![
                g.layers,
                g.hidden,
                g.heads,
                g.arch.kv_heads,
                g.arch.intermediate,
                g.seq,
                g.vocab,
            ],
        )
    } else {
        (TORCH_GPT, vec![g.layers, g.hidden, g.heads, g.seq, g.vocab])
    };
    let args: Vec<String> = sizes
        .iter()
        .map(|x| x.to_string())
        .chain([
            case.batch.to_string(),
            steps.to_string(),
            threads.to_string(),
        ])
        .collect();
    let out = std::process::Command::new(python)
        .args(["-c", script])
        .args(&args)
        .env("OMP_NUM_THREADS", threads.to_string())
        .env("MKL_NUM_THREADS", threads.to_string())
        .output()
        .map_err(|e| format!("cannot start {python}: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    match text.split_whitespace().next().map(str::parse::<f64>) {
        Some(Ok(s)) => Ok(s),
        _ => {
            let err = String::from_utf8_lossy(&out.stderr);
            Err(err.lines().last().unwrap_or("no output").to_string())
        }
    }
}

/// Seconds per ravnest step at `case`: the node's step (the gradient of the batch, the
/// optimizer on its model state) on this process's device, `steps` timed after two untimed.
fn ravnest_step_s(case: &Case, steps: u64) -> Result<f64> {
    let g = case.gpt;
    let text: Vec<u8> = {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        (0..(g.seq + 1) * (case.batch as usize) * (steps as usize + 3) * 2)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % g.vocab as u64) as u8
            })
            .collect()
    };
    let data = ravnest_train::data::Dataset::bytes(&text, "random bytes", g.seq)?;
    let optim = ravnest_train::optim::Optim {
        kind: ravnest_core::Optimizer::Adamw,
        lr: LR,
        momentum: 0.9,
        weight_decay: WEIGHT_DECAY,
        schedule: ravnest_core::recipe::Schedule::CONSTANT,
    };
    let net = ravnest_train::net::Network::Gpt(g);
    let c =
        ravnest_train::compute::CandleCompute::new(net, std::sync::Arc::new(data), optim, 1, 1.0);
    let mut model = ravnest_protocol::node::values::Values::initial(&c, None);
    let b = case.batch;
    for k in 0..2 {
        c.train_step(&mut model, k * b..(k + 1) * b)?;
    }
    let t = Instant::now();
    for k in 2..2 + steps {
        c.train_step(&mut model, k * b..(k + 1) * b)?;
    }
    Ok(t.elapsed().as_secs_f64() / steps as f64)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The table: per case, ravnest's and PyTorch's samples/s (medians of `rounds` interleaved
/// rounds of `steps` steps) and their ratio, both on `threads` threads (ravnest's are rayon's,
/// `RAYON_NUM_THREADS`, which the caller set to the same number).
pub fn gpt(python: Option<String>, steps: u64, rounds: usize, threads: usize) -> Result<String> {
    if steps == 0 || rounds == 0 {
        bail!("--steps and --rounds must be at least 1");
    }
    let python = python
        .or_else(|| std::env::var("RAVNEST_PYTHON").ok())
        .unwrap_or_else(|| "python3".into());
    let mut out = format!(
        "one node, {threads} thread{} each, AdamW, byte vocabulary (PyTorch: GPT2LMHeadModel, LlamaForCausalLM); samples/s, median of {rounds} interleaved rounds of {steps} steps\n\n{:<18} {:>6} {:>14} {:>14} {:>8}\n",
        if threads == 1 { "" } else { "s" },
        "shape",
        "batch",
        "ravnest",
        "PyTorch",
        "ratio"
    );
    let mut skipped = None;
    for case in &CASES {
        let (mut ours, mut theirs) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            ours.push(case.batch as f64 / ravnest_step_s(case, steps)?);
            if skipped.is_none() {
                match torch_step_s(&python, case, steps, threads) {
                    Ok(s) => theirs.push(case.batch as f64 / s),
                    Err(why) => skipped = Some(why),
                }
            }
        }
        let ours = median(ours);
        let (t, ratio) = if theirs.is_empty() {
            ("skipped".to_string(), "-".to_string())
        } else {
            let t = median(theirs);
            (format!("{t:.2}"), format!("{:.2}x", ours / t))
        };
        out += &format!(
            "{:<18} {:>6} {:>14.2} {:>14} {:>8}\n",
            case.name, case.batch, ours, t, ratio
        );
    }
    if let Some(why) = skipped {
        out += &format!(
            "\nPyTorch side skipped: {why} (install torch and transformers into a virtualenv and point RAVNEST_PYTHON at its python)\n"
        );
    }
    Ok(out)
}

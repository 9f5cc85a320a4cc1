#!/usr/bin/env bash
# The GPU checks of ravnest, in two halves, so that the build can happen where the GPU is not.
#
#   bash scripts/gpu-check.sh pack   # any Linux machine, no GPU needed: build with CUDA (the
#                                    # toolkit from PyPI, scripts/cuda-env.sh) into target/cuda and
#                                    # put the binary and the CPU/GPU comparison test, gzipped
#                                    # (about 27 MB), in target/gpu-kit/
#   bash scripts/gpu-check.sh run    # on the machine with the GPU: run them
#   bash scripts/gpu-check.sh        # both, on a machine with a GPU and a Rust toolchain
#
# `run` needs an NVIDIA driver for CUDA 13.0 or later and CUDA 13 libraries (cudart, cublas,
# cublasLt, curand, nvrtc) on LD_LIBRARY_PATH; it finds PyTorch's (pip's nvidia/cu13/lib) or
# /usr/local/cuda's by itself. It prints the CPU/GPU comparison of every network and
# `ravnest bench gpu` (ravnest vs PyTorch on the same GPU), then a GPT (gpt-small) on one node
# and in three pipeline stages on the GPU (real runs). CUDA_COMPUTE_CAP picks the GPU
# generation the kernels are built for (default 90: H100/H200; 86 for RTX 30xx, 89 for 40xx).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
kit=target/gpu-kit

pack() {
    # shellcheck source=/dev/null
    source scripts/cuda-env.sh
    # Its own target folder: the CPU build in target/release stays as it is.
    export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$PWD/target/cuda}"
    cargo build --release --features cuda
    local test
    test=$(cargo test --release --features cuda -p ravnest-train --test cuda --no-run \
        --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda":
        print(m["executable"])' | tail -1)
    mkdir -p "$kit"
    cp "$CARGO_TARGET_DIR/release/ravnest" "$kit/ravnest"
    cp "$test" "$kit/cuda-test"
    strip "$kit/ravnest" "$kit/cuda-test" 2>/dev/null || true
    # Compressed (the kernels' PTX compresses 4x): what a remote GPU machine is sent.
    gzip -9 -f "$kit/ravnest" "$kit/cuda-test"
    ls -la "$kit"
}

run() {
    local lib f
    for f in ravnest cuda-test; do
        if [ -e "$kit/$f.gz" ] && [ ! -x "$kit/$f" ]; then
            gunzip -c "$kit/$f.gz" > "$kit/$f" && chmod +x "$kit/$f"
        fi
    done
    for lib in \
        "$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null || true)" \
        /usr/local/cuda/lib64; do
        if [ -n "$lib" ] && [ -d "$lib" ]; then
            export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        fi
    done
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    echo "== every network on the GPU against the CPU (tests/cuda.rs)"
    "$kit/cuda-test" --nocapture --test-threads 1
    echo "== ravnest vs PyTorch on the same GPU"
    RAVNEST_PYTHON="${RAVNEST_PYTHON:-python3}" "$kit/ravnest" bench gpu "$@"
    gpt
    llama
}

# A Llama from a Hugging Face folder on the GPU against PyTorch's LlamaForCausalLM on the same
# GPU: SmolLM-135M's block (hidden 576, 9 heads over 3 key/value heads, SwiGLU 1536) 6 times,
# saved in bf16 with a BPE tokenizer trained on the shipped text (tests/py/tiny_models.py's),
# trained 40 steps of batch 16 x 256 tokens by each. ravnest computes in fp32 on the device
# (`[training] precision = "bf16"` in run is not built yet); PyTorch in bf16 autocast and in
# fp32, so that both ratios are seen.
llama() {
    local out py
    out=$(mktemp -d)
    py="${RAVNEST_PYTHON:-python3}"
    "$py" - "$out" <<'PY'
import json, sys, torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
out = sys.argv[1]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train(["data/eighty-days.txt"], trainers.BpeTrainer(vocab_size=2048, special_tokens=["<|endoftext|>"],
          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
cfg = LlamaConfig(vocab_size=len(fast), hidden_size=576, intermediate_size=1536, num_hidden_layers=6,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=256,
                  tie_word_embeddings=False)
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out + "/model")
fast.save_pretrained(out + "/model")
PY
    cat > "$out/llama.toml" <<TOML
[cluster]
name = "gpu-llama"
secret = "gpu-check"
[[node]]
name = "solo"
device = "cuda:0"
address = "127.0.0.1:47842"
[model]
from = "$out/model"
seq_len = 256
[training]
global_batch = 16
micro_batch = 16
optimizer = "adamw"
[run]
dataset = "$root/data/eighty-days.txt"
steps = 40
learning_rate = 0.0003
seed = 1
checkpoint_every_steps = 0
TOML
    echo "== a Llama (SmolLM-135M's block x6) from a bf16 folder, one node on the GPU (fp32 compute)"
    "$kit/ravnest" run "$out/llama.toml" --out "$out/run" | grep -E "trained|loss on|memory|solo "
    echo "== the same model in PyTorch on the same GPU (40 steps of 16 x 256 tokens)"
    "$py" - "$out/model" <<'PY'
import sys, time, torch
from transformers import AutoModelForCausalLM
for name, dtype in (("bf16 autocast", torch.bfloat16), ("fp32", None)):
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    x = torch.randint(0, model.config.vocab_size, (16, 257), device="cuda")
    def step():
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            logits = model(x[:, :256]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(); loss.backward(); opt.step()
    for _ in range(3): step()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(40): step()
    torch.cuda.synchronize()
    print(f"PyTorch {name}: {40 * 16 / (time.perf_counter() - t):.1f} samples/s")
PY
    rm -rf "$out"
}

# A GPT on the GPU through real runs: gpt-small on one node (data parallel: its model state on
# the device, the optimizer there), then split into three stage processes sharing the GPU
# (pipeline), each a short run; the reports' samples/s, bits per byte and memory tables.
gpt() {
    local out
    out=$(mktemp -d)
    cat > "$out/solo.toml" <<TOML
[cluster]
name = "gpu-gpt-solo"
secret = "gpu-check"
[[node]]
name = "solo"
device = "cuda:0"
address = "127.0.0.1:47841"
[model]
preset = "gpt-small"
[training]
global_batch = 16
micro_batch = 16
optimizer = "adamw"
precision = "fp32"
sync = "ring"
[run]
network = "gpt"
dataset = "$root/data/eighty-days.txt"
steps = 60
learning_rate = 0.001
seed = 1
checkpoint_every_steps = 0
TOML
    echo "== gpt-small, one node on the GPU (data parallel)"
    "$kit/ravnest" run "$out/solo.toml" --out "$out/solo" | grep -E "trained|bits per byte|memory|solo "
    echo "== gpt-small in three pipeline stages on the GPU"
    "$kit/ravnest" run scenarios/pipeline-gpt-small.toml --device cuda --steps 60 --out "$out/pipe" \
        | grep -E "trained|bits per byte|pipeline:|memory|stage-"
    rm -rf "$out"
}

case "${1:-all}" in
    pack) pack ;;
    run) shift; run "$@" ;;
    all) pack; run ;;
    *) echo "usage: $0 [pack|run [bench gpu options]]" >&2; exit 2 ;;
esac

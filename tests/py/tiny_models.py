"""Tiny Hugging Face models for ravnest's tests, made here (no hub, no download), and
transformers' own figures on them.

    python3 tiny_models.py make OUT TEXT        BPE tokenizer trained on TEXT; OUT/{gpt2,llama,
                                                qwen2,mistral}: random tiny models saved by
                                                save_pretrained with that tokenizer
    python3 tiny_models.py eval DIR TEXT SEQ    {"loss", "tokens"}: the mean next-token
                                                cross-entropy over TEXT's windows of SEQ, as
                                                `ravnest eval` defines them
    python3 tiny_models.py train CASE.json      one process, plain PyTorch: AdamW (Trainer's
                                                groups: no decay on 1-D tensors) and the case's
                                                transformers schedule over the batches it lists,
                                                from its folder's weights; each step's loss
    python3 tiny_models.py schedules CASE.json  each step's learning rate under transformers'
                                                schedules, as LambdaLR applies them

Everything is float32 on the CPU, seeded.
"""

import json
import os
import sys

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

torch.set_num_threads(1)


def tokenizer(text_path, out):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([text_path], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    os.makedirs(out, exist_ok=True)
    fast.save_pretrained(out)
    return fast


def make(out, text_path):
    tok = tokenizer(text_path, os.path.join(out, "tokenizer"))
    vocab = len(tok)
    eos = tok.eos_token_id
    common = dict(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos)
    llama = dict(
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        **common,
    )
    configs = {
        "gpt2": GPT2LMHeadModel(
            GPT2Config(n_embd=48, n_layer=3, n_head=4, n_positions=64, **common)
        ),
        "llama": LlamaForCausalLM(
            LlamaConfig(
                rope_theta=50000.0,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 4.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
                **llama,
            )
        ),
        "qwen2": Qwen2ForCausalLM(Qwen2Config(rope_theta=10000.0, **llama)),
        "mistral": MistralForCausalLM(
            MistralConfig(rope_theta=10000.0, sliding_window=64, **llama)
        ),
    }
    for i, (name, model) in enumerate(configs.items()):
        torch.manual_seed(1000 + i)
        # Every parameter away from its initial constant (norms at 1, biases at 0), so that a
        # misplaced or transposed tensor shows in the loss.
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.15)
        folder = os.path.join(out, name)
        model.save_pretrained(folder, safe_serialization=True)
        tok.save_pretrained(folder)
    print(json.dumps({"vocab": vocab, "eos": eos}))


def windows(tok, text, seq):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = (len(ids) - 1) // seq
    return [ids[i * seq : i * seq + seq + 1] for i in range(n)]


def evaluate(folder, text_path, seq):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(folder)
    text = open(text_path, encoding="utf-8").read()
    rows = windows(tok, text, seq)
    total, count = 0.0, 0
    with torch.no_grad():
        for k in range(0, len(rows), 8):
            batch = torch.tensor(rows[k : k + 8], dtype=torch.long)
            logits = model(batch[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                batch[:, 1:].reshape(-1),
                reduction="sum",
            )
            total += loss.item()
            count += batch[:, 1:].numel()
    print(
        json.dumps(
            {
                "loss": total / count,
                "tokens": count,
                "class": type(model).__name__,
                "tied": model.config.tie_word_embeddings,
            }
        )
    )


def scheduler(opt, s):
    """transformers' own schedule for the case's `schedule` (None: constant)."""
    from transformers import optimization as o

    if s is None:
        return None
    kind, w, n, min_lr = s["kind"], s["warmup"], s["total"], s.get("min_lr", 0.0)
    if kind == "constant":
        return o.get_constant_schedule_with_warmup(opt, w)
    if kind == "linear":
        return o.get_linear_schedule_with_warmup(opt, w, n)
    if kind == "cosine":
        return o.get_cosine_with_min_lr_schedule_with_warmup(opt, w, n, min_lr=min_lr)
    if kind == "wsd":
        base = opt.defaults["lr"]
        return o.get_wsd_schedule(opt, w, s["decay"], n, min_lr_ratio=min_lr / base)
    raise SystemExit(f"unknown schedule {kind}")


def schedules(case_path):
    """Each step's learning rate under each schedule the case lists, as LambdaLR gives it."""
    case = json.load(open(case_path))
    out = []
    for s in case["schedules"]:
        p = torch.nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=case["lr"])
        sched = scheduler(opt, s)
        lrs = []
        for _ in range(s["total"]):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        out.append(lrs)
    print(json.dumps({"lrs": out}))


def train(case_path):
    case = json.load(open(case_path))
    model = AutoModelForCausalLM.from_pretrained(case["folder"], dtype=torch.float32)
    model.train()
    # Hugging Face Trainer's groups: no weight decay on biases and norm gains (1-D).
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": case.get("weight_decay", 0.0)},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=case["lr"], betas=(case["beta1"], 0.999), eps=1e-8)
    sched = scheduler(opt, case.get("schedule"))
    losses, norms = [], []
    max_norm = case.get("max_grad_norm")
    for batch in case["batches"]:
        batch = torch.tensor(batch, dtype=torch.long)
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        if max_norm is not None:
            # The global norm before clipping, as clip_grad_norm_ returns it.
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    print(json.dumps({"losses": losses, "norms": norms}))


def clip(case_path):
    # clip_grad_norm_ over parameters whose gradients are each case's tensors.
    out = []
    for case in json.load(open(case_path))["cases"]:
        params = []
        for t in case["tensors"]:
            p = torch.nn.Parameter(torch.zeros(len(t), dtype=torch.float32))
            p.grad = torch.tensor(t, dtype=torch.float32)
            params.append(p)
        norm = torch.nn.utils.clip_grad_norm_(params, case["max"]).item()
        out.append({"norm": norm, "clipped": [p.grad.tolist() for p in params]})
    print(json.dumps({"cases": out}))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "make":
        make(sys.argv[2], sys.argv[3])
    elif cmd == "eval":
        evaluate(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif cmd == "train":
        train(sys.argv[2])
    elif cmd == "schedules":
        schedules(sys.argv[2])
    elif cmd == "clip":
        clip(sys.argv[2])
    else:
        sys.exit(f"unknown command {cmd}")

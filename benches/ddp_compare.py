#!/usr/bin/env python3
"""PyTorch DDP (gloo, CPU) baseline for a side-by-side run against ravnest.

    python3 benches/ddp_compare.py --world 2 --split 96,32 --slowdown 1,3 --steps 300

It trains what the Rust side trains: an MLP of widths --dims (Linear, ReLU between
layers, none after the last), cross-entropy, SGD with momentum, on Fashion-MNIST IDX
files; or, with --gpt LAYERS,HIDDEN,HEADS,SEQ,VOCAB, transformers' GPT2LMHeadModel of
that shape (GELU tanh, no dropout, LM head not tied, as ravnest's gpt presets), AdamW,
on windows of SEQ + 1 bytes of the text file --data (a sample's loss: the mean over its
tokens). It is its own launcher: it spawns --world processes on 127.0.0.1 (gloo) and
prints ONE JSON line on stdout; diagnostics go to stderr. Without torch it prints
{"skipped": "..."} and exits 0; bad arguments or data exit 2.

Data: step s uses rows s*B .. (s+1)*B (B = --global-batch) of a permutation of the
training rows, np.random.default_rng(seed + pass), a new one each pass; rank r takes
its slice [offset_r, offset_r + b_r) of that global batch, offsets following --split.
GPT: step s's B windows start at np.random.default_rng(seed + s)'s draws.

Exact mean gradient: DDP averages gradients over ranks (sum / world). For the update to
be the mean over the GLOBAL batch even when ranks hold unequal batches, each rank's loss
is sum over its own samples / B * world. --check-exact verifies this against one
process trained on the whole global batch.

Straggler emulation (same rule as ravnest's compute.rs): a rank with factor k > 1 hands
each gradient bucket to the all-reduce (k-1) x later than it computed it. A DDP comm
hook runs when a bucket's gradient is ready, before its all-reduce starts; it measures
the compute since the forward began (first bucket) or since the previous bucket, and
sleeps (k-1) x that on the backward thread, delaying this rank's contribution exactly
as a k-times slower device would, with compute/all-reduce overlap kept. The optimizer
step is not slowed (the Rust side does not slow it either). As on the Rust side, the compute
measured is the thread's CPU time when it runs on one thread (a device k times slower takes
k times the work, not k times the moments the scheduler gave its core to another process),
else wall time.

Per-rank time over the timed steps (fractions of that rank's wall time, sum to 1):
  busy = batch gather + forward + backward compute + emulated sleep + optimizer step
  comm = per step, the wait in the all-reduce that even the least-waiting rank pays
         (min over ranks of wall - busy): transfer not hidden behind compute
  idle = the rest of this rank's wait: time spent waiting for slower peers
Solo throughput ("in situ"): before training all ranks start together and run
--calib-steps of forward+backward+SGD on a plain (non-DDP) copy of the model at their
own batch size (--calib-batch global: the global batch, as ravnest's own measurement
does), slowdown included, with no synchronization; capacity efficiency =
achieved samples/s / sum of the ranks' solo samples/s.
"""
import argparse
import threading
import copy
import gzip
import json
import os
import queue
import socket
import struct
import sys
import time


_what = "torch"  # torch first: without it, numpy is usually missing too
try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    import torch.nn.functional as F
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    _what = "numpy"
    import numpy as np
except Exception as e:  # noqa: BLE001 - any failure to import (missing, broken libs) skips
    print(json.dumps({"skipped": f"{_what} is not importable: {e}"}))
    sys.exit(0)

NOTES = ("fractions of each rank's wall time: busy = batch gather + forward + backward "
         "compute + emulated slowdown sleep + optimizer step; comm = per step, the all-reduce "
         "wait even the least-waiting rank pays (min over ranks of wall - busy); idle = the "
         "rest, waiting for slower peers. Slowdown: (k-1) x each gradient bucket's compute is "
         "slept before it goes to the all-reduce. solo = a plain model at calib_batch (the "
         "rank's own batch, or the global one), all ranks at once, no sync. first_loss: the "
         "global-batch mean loss of step 0; final_loss: the mean over the last 10 timed steps.")


def fail(msg):
    print(f"ddp_compare: error: {msg}", file=sys.stderr)
    sys.exit(2)


# ---------------------------------------------------------------- data

def read_idx(path, magic):
    """An IDX file (gzip or raw) as a 2-D (images) or 1-D (labels) uint8 array."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    got, n = struct.unpack(">II", raw[:8])
    if got != magic:
        raise ValueError(f"{path}: magic {got:#010x}, expected {magic:#010x}")
    if magic == 0x803:  # images: n x rows x cols, flattened to n x (rows * cols)
        rows, cols = struct.unpack(">II", raw[8:16])
        arr, shape = np.frombuffer(raw, np.uint8, offset=16), (n, rows * cols)
    else:  # labels: n bytes
        arr, shape = np.frombuffer(raw, np.uint8, offset=8), (n,)
    if arr.size != int(np.prod(shape)):
        raise ValueError(f"{path}: {arr.size} values, header says {shape}")
    return arr.reshape(shape)


def labels_path(images):
    d, name = os.path.split(images)
    return os.path.join(d, name.replace("images-idx3", "labels-idx1"))


def load_text(path, seq):
    """The text's bytes as (int64 [N] tensor, None): windows of seq + 1 are cut per step."""
    with open(path, "rb") as f:
        raw = np.frombuffer(f.read(), np.uint8)
    if raw.size < seq + 2:
        raise ValueError(f"{path}: {raw.size} bytes, fewer than a window of {seq + 1}")
    return torch.from_numpy(raw.astype(np.int64)), None


class Windows:
    """GPT: the global batch of step s as (inputs, targets) [B, seq], windows of the text at
    np.random.default_rng(seed + s)'s starts."""

    def __init__(self, text, batch, seq, seed):
        self.text, self.batch, self.seq, self.seed = text, batch, seq, seed

    def get(self, step, off, b):
        starts = np.random.default_rng(self.seed + step).integers(
            0, self.text.numel() - self.seq - 1, self.batch)[off:off + b]
        w = torch.stack([self.text[s:s + self.seq + 1] for s in starts.tolist()])
        return w[:, :-1], w[:, 1:]


class Rows:
    """MLP: the global batch of step s as (images, labels), rank slice [off, off + b)."""

    def __init__(self, x, y, batch, seed):
        self.x, self.y, self.batches = x, y, Batches(len(x), batch, seed)

    def get(self, step, off, b):
        idx = self.batches.indices(step)[off:off + b]
        return self.x[idx], self.y[idx]


def load_data(images):
    """The whole training set as (float32 [N, D] in [0, 1], int64 [N]) tensors."""
    x, y = read_idx(images, 0x803), read_idx(labels_path(images), 0x801)  # checked in main
    return torch.from_numpy(x.astype(np.float32) / 255.0), torch.from_numpy(y.astype(np.int64))


class Batches:
    """Global batch of step s: rows s*B..(s+1)*B of the permutation of its pass."""

    def __init__(self, n, batch, seed):
        self.n, self.batch, self.seed = n, batch, seed
        self.per_pass = n // batch  # the tail of a pass is dropped
        self.cached = (None, None)

    def indices(self, step):
        p, s = divmod(step, self.per_pass)
        if self.cached[0] != p:
            perm = np.random.default_rng(self.seed + p).permutation(self.n)
            self.cached = (p, torch.from_numpy(perm))
        return self.cached[1][s * self.batch:(s + 1) * self.batch]


# ---------------------------------------------------------------- model and timing

def build_model(a):
    torch.manual_seed(a.seed)  # identical initial weights on every rank
    if a.gpt:
        from transformers import GPT2Config, GPT2LMHeadModel
        layers, hidden, heads, seq, vocab = a.gpt
        cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=hidden, n_layer=layers,
                         n_head=heads, n_inner=4 * hidden, activation_function="gelu_new",
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         tie_word_embeddings=False)
        return GPT2LMHeadModel(cfg)
    dims = a.dims
    layers = []
    for i in range(len(dims) - 1):
        layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def loss_sum(model, a, xb, yb):
    """The sum over the batch of each sample's loss (a GPT sample's: the mean over its tokens)."""
    if a.gpt:
        logits = model(input_ids=xb).logits
        vocab, seq = a.gpt[4], a.gpt[3]
        return F.cross_entropy(logits.reshape(-1, vocab), yb.reshape(-1), reduction="sum") / seq
    return F.cross_entropy(model(xb), yb, reduction="sum")


def optimizer(params, a):
    if a.gpt:
        return torch.optim.AdamW(params, lr=a.lr, betas=(a.momentum, 0.999), eps=1e-8,
                                 weight_decay=a.weight_decay)
    return torch.optim.SGD(params, lr=a.lr, momentum=a.momentum)


class Work:
    """The work since a moment, for the straggler emulation: this thread's CPU time since
    then when the compute runs on one thread (and on this thread), else the wall time."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.thread_time()
        self.thread = threading.get_ident()

    def took(self):
        wall = time.perf_counter() - self.wall
        if torch.get_num_threads() > 1 or threading.get_ident() != self.thread:
            return wall
        return min(time.thread_time() - self.cpu, wall)


class HookTimer:
    """DDP comm-hook state: this rank's compute and emulated sleep within one step."""

    def __init__(self, factor):
        self.extra = max(factor, 1.0) - 1.0
        self.begin()

    def begin(self):
        self.since = Work()
        self.compute = self.slept = 0.0
        self.buckets = 0


def timed_allreduce(st, bucket):
    # Runs on the backward thread when a bucket's gradient is complete: the time since the
    # forward began (or the previous bucket) is this rank's compute for it.
    wall = time.perf_counter() - st.since.wall
    st.compute += wall
    st.buckets += 1
    if st.extra > 0:
        t = time.perf_counter()
        time.sleep(st.since.took() * st.extra)
        st.slept += time.perf_counter() - t
    st.since = Work()
    return allreduce_hook(None, bucket)  # DDP's default: divide by world, all-reduce


def calibrate(model, a, data, off, b, factor):
    """Solo samples/s at this rank's batch (or the global one, as ravnest measures it with
    --calib-batch global): plain model, no synchronization."""
    if a.calib_batch == "global":
        off, b = 0, a.global_batch
    opt = optimizer(model.parameters(), a)

    def step(s):
        xb, yb = data.get(s, off, b)
        t = Work()
        loss_sum(model, a, xb, yb).div(b).backward()
        if factor > 1:
            time.sleep(t.took() * (factor - 1))
        opt.step()
        opt.zero_grad(set_to_none=True)

    warm = 3
    dist.barrier()  # all ranks start together: "solo in situ", sharing the CPUs
    for s in range(warm + a.calib_steps):
        if s == warm:
            t0 = time.perf_counter()
        step(s)
    solo = a.calib_steps * b / (time.perf_counter() - t0)
    # Keep loading the machine (untimed) until every rank has its measurement, so that a
    # slower rank is measured under the same contention as in training.
    done, s = dist.barrier(async_op=True), warm + a.calib_steps
    while not done.is_completed():
        step(s)
        s += 1
    done.wait()
    return solo


# ---------------------------------------------------------------- one rank

def worker(rank, a, port, out):
    torch.set_num_threads(a.threads)
    torch.set_num_interop_threads(a.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=a.world)
    B, world = a.global_batch, a.world
    if a.gpt:
        data = Windows(load_text(a.data, a.gpt[3])[0], B, a.gpt[3], a.seed)
    else:
        data = Rows(*load_data(a.data), B, a.seed)
    b, off, factor = a.split[rank], sum(a.split[:rank]), a.slowdown[rank]
    model = build_model(a)
    ref = copy.deepcopy(model)  # plain copy: calibration, or the --check-exact reference
    solo = None if a.check_exact else calibrate(ref, a, data, off, b, factor)

    ddp = DDP(model)
    st = HookTimer(factor)
    ddp.register_comm_hook(st, timed_allreduce)
    opt = optimizer(ddp.parameters(), a)
    if a.check_exact:
        ref_opt = optimizer(ref.parameters(), a)
    total = 3 if a.check_exact else a.warmup + a.steps
    warm = 0 if a.check_exact else a.warmup
    losses, busy, wall, diffs = [], [], [], []
    for g in range(total):
        if g == warm:
            dist.barrier()
            t_prev = t0 = time.perf_counter()
        t_start = time.perf_counter()
        xb, yb = data.get(g, off, b)
        st.begin()
        t_fwd = st.since.wall
        ls = loss_sum(ddp, a, xb, yb)
        losses.append(ls.item())
        # DDP divides the all-reduced gradient by world: scale by world / B so that the
        # result is the mean over the global batch whatever the split.
        (ls * (world / B)).backward()
        t_opt = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t_end = time.perf_counter()
        if g >= warm:
            # Whatever backward spent outside the hooks' compute segments is waiting for
            # the all-reduce (DDP's end-of-backward wait); it is not busy.
            busy.append((t_fwd - t_start) + st.compute + st.slept + (t_end - t_opt))
            wall.append(t_end - t_prev)
            t_prev = t_end
        if a.check_exact:
            gx, gy = data.get(g, 0, B)
            (loss_sum(ref, a, gx, gy) / B).backward()  # mean over the global batch
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            diffs.append(max((p - q).abs().max().item()
                             for p, q in zip(model.parameters(), ref.parameters())))
    train_s = time.perf_counter() - t0
    dist.barrier()
    dist.destroy_process_group()
    out.put({"rank": rank, "batch": b, "solo": solo, "busy": busy, "wall": wall,
             "losses": losses, "train_s": train_s, "diffs": diffs, "buckets": st.buckets})


# ---------------------------------------------------------------- launcher

def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dims", default="784,512,512,10")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--global-batch", type=int, default=128)
    ap.add_argument("--split", default="equal", help="'equal' or per-rank batches, e.g. 96,32")
    ap.add_argument("--slowdown", default=None, help="per-rank factor, e.g. 1,3 (default 1s)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum, AdamW's beta1")
    ap.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's (GPT)")
    ap.add_argument("--gpt", default=None,
                    help="LAYERS,HIDDEN,HEADS,SEQ,VOCAB: a GPT on the bytes of --data (a text)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--calib-steps", type=int, default=30)
    ap.add_argument("--calib-batch", choices=["own", "global"], default="own",
                    help="batch of the solo measurement: the rank's own, or the global one")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--data", help="images; labels: the name with images-idx3 -> labels-idx1",
                    default="/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")
    ap.add_argument("--check-exact", action="store_true",
                    help="3 steps: compare the DDP model with one process on the global batch")
    a = ap.parse_args()

    def nums(text, what, cast=int):
        try:
            return [cast(v) for v in text.split(",")]
        except ValueError:
            fail(f"{what}: expected comma-separated numbers, got {text!r}")

    a.dims = nums(a.dims, "--dims")
    a.gpt = nums(a.gpt, "--gpt") if a.gpt else None
    if a.gpt and (len(a.gpt) != 5 or min(a.gpt) < 1 or a.gpt[1] % a.gpt[2]):
        fail(f"--gpt {a.gpt}: needs LAYERS,HIDDEN,HEADS,SEQ,VOCAB, HIDDEN a multiple of HEADS")
    if len(a.dims) < 2 or min(a.dims) < 1:
        fail("--dims needs at least two positive widths")
    if a.world < 1 or a.threads < 1 or a.steps < 1 or a.warmup < 0 or a.calib_steps < 1:
        fail("--world, --threads, --steps and --calib-steps must be >= 1, --warmup >= 0")
    B = a.global_batch
    if a.split == "equal":
        if B < a.world:
            fail(f"--global-batch {B} is smaller than --world {a.world}")
        a.split = [B // a.world + (r < B % a.world) for r in range(a.world)]
    else:
        a.split = nums(a.split, "--split")
        if len(a.split) != a.world or min(a.split) < 1 or sum(a.split) != B:
            fail(f"--split {a.split}: needs {a.world} positive batches summing to {B}")
    a.slowdown = nums(a.slowdown or ",".join(["1"] * a.world), "--slowdown", float)
    if len(a.slowdown) != a.world or min(a.slowdown) < 1.0:
        fail(f"--slowdown {a.slowdown}: needs {a.world} factors >= 1")
    if a.gpt:
        try:  # read the text now, for a clear error before any process starts
            load_text(a.data, a.gpt[3])
            import transformers  # noqa: F401
        except ImportError as e:
            print(json.dumps({"skipped": f"transformers is not importable: {e}"}))
            sys.exit(0)
        except Exception as e:  # noqa: BLE001 - missing, too short
            fail(f"data {a.data}: {e}")
        return a
    try:  # read the data now, for a clear error before any process starts
        x, y = read_idx(a.data, 0x803), read_idx(labels_path(a.data), 0x801)
    except Exception as e:  # noqa: BLE001 - missing, truncated, not gzip, bad header
        fail(f"data {a.data}: {e}")
    if len(x) != len(y) or x.shape[1] != a.dims[0] or len(x) < B:
        fail(f"data: {len(x)} images of {x.shape[1]} values and {len(y)} labels do not fit "
             f"--dims {a.dims} and --global-batch {B}")
    return a


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(a):
    """Spawn the ranks, collect one result each; raises if a rank fails."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = mp.spawn(worker, args=(a, free_port(), q), nprocs=a.world, join=False)
    results = {}
    while len(results) < a.world:
        try:
            r = q.get(timeout=0.5)
            results[r["rank"]] = r
        except queue.Empty:
            if procs.join(timeout=0):  # every rank ended without reporting
                break
    while not procs.join():
        pass
    if len(results) < a.world:
        raise RuntimeError(f"only {len(results)} of {a.world} ranks reported")
    return [results[r] for r in range(a.world)]


def main():
    a = parse_args()
    # Children inherit these: one compute thread each, gloo on the loopback interface.
    os.environ["OMP_NUM_THREADS"] = str(a.threads)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    print(f"ddp_compare: torch {torch.__version__}, world {a.world}, split {a.split}, "
          f"slowdown {a.slowdown}", file=sys.stderr, flush=True)
    try:
        res = run_ranks(a)
    except Exception as e:  # noqa: BLE001 - a rank's traceback is already on stderr
        print(f"ddp_compare: a rank failed: {e}", file=sys.stderr)
        sys.exit(1)
    B = a.global_batch
    if a.check_exact:
        diffs = res[0]["diffs"]
        ok = max(diffs) < 1e-5
        print(json.dumps({"framework": "pytorch-ddp", "check_exact": {
            "split": a.split, "max_abs_diff": diffs, "ok": ok,
            "notes": "max |param_ddp - param_single| after each step; the single-process "
                     "model trains on the whole global batch with mean cross-entropy"}}))
        sys.exit(0 if ok else 1)

    steps = a.steps
    # Per step: each rank's wait = wall - busy; the least of these is the all-reduce cost
    # every rank pays (comm); the rest of a rank's wait is waiting for slower peers (idle).
    waits = [[w - b for w, b in zip(r["wall"], r["busy"])] for r in res]
    comm_step = [max(0.0, min(col)) for col in zip(*waits)]
    nodes = []
    for r in res:
        wall = sum(r["wall"])
        busy, comm = sum(r["busy"]), sum(comm_step)
        nodes.append({"rank": r["rank"], "batch": r["batch"], "slowdown": a.slowdown[r["rank"]],
                      "busy": round(busy / wall, 4), "comm": round(comm / wall, 4),
                      "idle": round(max(0.0, wall - busy - comm) / wall, 4),
                      "solo_samples_per_s": round(r["solo"], 1)})
    # The global-batch mean loss of each step: sum over ranks of their loss sums / B.
    loss = [sum(v) / B for v in zip(*(r["losses"] for r in res))]
    tail = loss[-min(10, steps):]
    train_s = max(r["train_s"] for r in res)
    sps = steps * B / train_s
    solo = [r["solo"] for r in res]
    print(json.dumps({
        "framework": "pytorch-ddp", "torch": torch.__version__, "dims": a.dims, "gpt": a.gpt,
        "world": a.world, "threads": a.threads, "split": a.split, "slowdown": a.slowdown,
        "global_batch": B, "calib_batch": a.calib_batch, "steps": steps, "warmup": a.warmup,
        "train_s": round(train_s, 4), "samples_per_s": round(sps, 1),
        "solo_samples_per_s": [round(s, 1) for s in solo],
        "capacity_efficiency": round(sps / sum(solo), 4),
        "first_loss": round(loss[0], 4), "final_loss": round(sum(tail) / len(tail), 4),
        "buckets": res[0]["buckets"], "nodes": nodes,
        "notes": NOTES}))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""PyTorch gloo all-reduce on loopback, the same sizes and rank counts as
`ravnest bench allreduce`, for a side-by-side figure. Optional: needs `torch` (pip install
torch). Prints n, size, median time, algbw and busbw (= algbw * 2(n-1)/n), GB/s.

    python3 benches/gloo_allreduce.py --nodes 2,3,4 --sizes 1,16,64 --reps 5
"""
import argparse
import os
import statistics
import time

try:
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
except ImportError:  # pragma: no cover
    raise SystemExit("torch is not installed: pip install torch")


def worker(rank, n, sizes, reps, port, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n)
    for mib in sizes:
        t = torch.ones(mib * (1 << 20) // 4)
        dist.all_reduce(t)  # warm-up
        times = []
        for _ in range(reps):
            dist.barrier()
            s = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - s)
        if rank == 0:
            out.put((n, mib, statistics.median(times)))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", default="2,3,4")
    ap.add_argument("--sizes", default="1,16,64")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    print("  n     size      time    algbw GB/s   busbw GB/s")
    ctx = mp.get_context("spawn")
    for i, n in enumerate(int(x) for x in a.nodes.split(",")):
        q = ctx.SimpleQueue()
        mp.spawn(worker, args=(n, sizes, a.reps, 29500 + i, q), nprocs=n, join=True)
        while not q.empty():
            n_, mib, secs = q.get()
            algbw = mib * (1 << 20) / secs / 1e9
            print(f"{n_:>3} {mib:>6} MiB {secs * 1e3:>8.1f} ms {algbw:>12.3f} {algbw * 2 * (n_ - 1) / n_:>12.3f}")


if __name__ == "__main__":
    main()

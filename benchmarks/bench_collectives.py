"""Latency of the collectives a tensor-parallel step makes, on the CPU (gloo), between spawned processes.

    python benchmarks/bench_collectives.py --ranks 2 --hidden 576 --iters 1000

One all-reduce of a decode row ``[1, hidden]`` float32 (2 per layer and one for the embedding, each step), one of 8
rows, and one broadcast of a step buffer of `--step-entries` int64 (one per step). Each rank uses one torch thread.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from machine import cpu_name  # benchmarks/machine.py


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    row, rows = torch.randn(1, args.hidden), torch.randn(8, args.hidden)
    step = torch.zeros(args.step_entries, dtype=torch.long)
    tests = {
        f"all_reduce [1, {args.hidden}] float32": lambda: dist.all_reduce(row),
        f"all_reduce [8, {args.hidden}] float32": lambda: dist.all_reduce(rows),
        f"broadcast [{args.step_entries}] int64": lambda: dist.broadcast(step, 0),
    }
    results = {}
    for name, call in tests.items():
        for _ in range(50):
            call()
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(args.iters // 5):
                call()
            samples.append((time.perf_counter() - start) / (args.iters // 5) * 1e6)
        results[name] = samples
    if rank == 0:
        out.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    """Spawn the ranks, time each collective, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--step-entries", type=int, default=41222, help="SmolLM2's step buffer at its defaults")
    parser.add_argument("--iters", type=int, default=1000)
    args = parser.parse_args()
    store = dist.TCPStore("127.0.0.1", 0, args.ranks, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.ranks, store.port, args, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    results = out.get()
    for p in procs:
        p.join()
    print(f"\n{args.ranks} gloo ranks, 1 thread each; {cpu_name()}, {os.cpu_count()} logical cores; "
          f"{datetime.date.today()}; median (min-max) of 5 x {args.iters // 5} calls\n")
    print("| collective | µs per call |\n| --- | ---: |")
    for name, samples in results.items():
        print(f"| {name} | {statistics.median(samples):.0f} ({min(samples):.0f}-{max(samples):.0f}) |")


if __name__ == "__main__":
    main()

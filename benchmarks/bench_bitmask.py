"""Applying a token bitmask to CPU logits: gpullama's numpy and torch paths (and xgrammar's kernel if installed).

    python benchmarks/bench_bitmask.py --vocab 49152 --batch 1,16 --repeats 200

Every row of the bitmask allows about half the tokens at random (the cost does not depend on how many). "rows" is
the engine's case: the constrained rows given as a list; "all" masks every row. Median milliseconds per call.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
from machine import cpu_name  # benchmarks/machine.py

from gpullama.structured.bitmask import apply_bitmask_numpy, apply_bitmask_torch, bitmask_width


def timed(fn, repeats: int) -> float:
    """Median milliseconds of `fn()` over `repeats` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    paths = {"numpy": apply_bitmask_numpy, "torch": apply_bitmask_torch}
    try:
        import xgrammar

        paths["xgrammar"] = lambda logits, mask, rows: xgrammar.apply_token_bitmask_inplace(
            logits, mask, vocab_size=logits.shape[-1], indices=None if rows is None else list(rows))
    except ImportError:
        pass
    gen = torch.Generator().manual_seed(0)
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; vocabulary "
          f"{args.vocab}; {datetime.date.today()}\n")
    print("| batch | rows | " + " | ".join(f"{p} ms" for p in paths) + " |")
    print("|---:|---|" + "---:|" * len(paths))
    for batch in (int(b) for b in args.batch.split(",")):
        logits = torch.randn(batch, args.vocab, generator=gen)
        mask = torch.randint(-2**31, 2**31 - 1, (batch, bitmask_width(args.vocab)), dtype=torch.int32, generator=gen)
        for rows_name, rows in (("all", None), ("rows", list(range(batch)))):
            cells = [timed(lambda f=f, lg=logits, m=mask, r=rows: f(lg, m, r), args.repeats) for f in paths.values()]
            print(f"| {batch} | {rows_name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()

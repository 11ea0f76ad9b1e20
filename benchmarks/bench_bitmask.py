"""Applying a token bitmask to CPU logits: gpullama's CPU and portable torch paths (and xgrammar's kernel if
installed, as in a checkout from before issue 20).

    python benchmarks/bench_bitmask.py --vocab 49152 --batch 1,16 --repeats 200

Three kinds of masks: every token allowed or not at random ("half"), 5% of the tokens at random ("5%"), and a
handful of tokens ("few", as inside JSON punctuation). The constrained rows are given as a list of rows, as the
engine does. Median milliseconds per call, float32 logits.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
from machine import cpu_name  # benchmarks/machine.py

from gpullama.structured import allow_only, bitmask_width

try:
    from gpullama.structured.bitmask import apply_bitmask_cpu, apply_bitmask_torch
except ImportError:  # a checkout from before issue 20: apply_bitmask was the torch path
    from gpullama.structured.bitmask import apply_bitmask as apply_bitmask_torch
    apply_bitmask_cpu = None


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
    paths = {"torch": apply_bitmask_torch}
    if apply_bitmask_cpu is not None:
        paths["cpu"] = apply_bitmask_cpu
    try:
        import xgrammar

        paths["xgrammar"] = lambda logits, mask, rows: xgrammar.apply_token_bitmask_inplace(
            logits, mask, vocab_size=logits.shape[-1], indices=None if rows is None else list(rows))
    except ImportError:
        pass
    gen = torch.Generator().manual_seed(0)
    print(f"machine: {cpu_name()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}; vocabulary "
          f"{args.vocab}; {datetime.date.today()}\n")
    print("| batch | mask | " + " | ".join(f"{p} ms" for p in paths) + " |")
    print("|---:|---|" + "---:|" * len(paths))
    for batch in (int(b) for b in args.batch.split(",")):
        logits = torch.randn(batch, args.vocab, generator=gen)
        width = bitmask_width(args.vocab)
        for kind in ("half", "5%", "few"):
            mask = torch.zeros(batch, width, dtype=torch.int32)
            for r in range(batch):
                if kind == "few":
                    allow_only(mask, r, [int(t) for t in torch.randint(args.vocab, (8,), generator=gen)])
                else:
                    share = 0.5 if kind == "half" else 0.05
                    ids = torch.nonzero(torch.rand(args.vocab, generator=gen) < share).flatten().tolist()
                    allow_only(mask, r, ids)
            rows = list(range(batch))
            cells = [timed(lambda f=f, lg=logits, m=mask, r=rows: f(lg, m, r), args.repeats) for f in paths.values()]
            print(f"| {batch} | {kind} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")

if __name__ == "__main__":
    main()

"""Tensor parallelism on the CPU: one model at several `tensor_parallel_size`s, side by side, tokens/s.

    python benchmarks/bench_tp.py --model /tmp/smollm2-shaped-q4_1.gguf --sizes 1,2 --dtype float32

Every size is loaded once, in this process (a size N > 1 starts its N - 1 worker processes), then the rounds
alternate the sizes, so all see the same machine load. Each size's ranks share the cores (``cores / N`` threads
each; torch's thread count is set again before each size's turn, since rank 0 runs in this process). Tests: pp
(prefill `--n-prompt` tokens, sample one), tg (generate `--n-gen` tokens after a one-token prompt) and a batch
(`--batch` sequences of `--n-gen` tokens at once, one-token prompts); greedy, EOS ignored, prefix caching off. The
table gives the median tokens/s over the rounds, its min-max, and the ratio to the first size.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch
from machine import cpu_name  # benchmarks/machine.py

from gpullama import LLM, SamplingParams
from gpullama.engine.model_spec import threads_per_rank
from gpullama.hub import resolve_model


class Size:
    """One model loaded at one tensor-parallel size, and its three timed tests."""

    def __init__(self, path: str, size: int, dtype: str, n_prompt: int, n_gen: int, batch: int):
        self.size = size
        self.threads = threads_per_rank(size)
        self.llm = LLM(path, device="cpu", dtype=dtype, threads=self.threads, tensor_parallel_size=size,
                       max_model_len=n_prompt + n_gen + 16, max_num_seqs=max(batch, 1),
                       max_num_batched_tokens=max(512, n_prompt), enable_prefix_caching=False)
        vocab = self.llm.config.vocab_size
        self.prompt = torch.randint(100, vocab, (n_prompt,), generator=torch.Generator().manual_seed(0)).tolist()

    def timed(self, test: str, n: int, batch: int) -> float:
        """Tokens/s of one run of `test`."""
        torch.set_num_threads(self.threads)
        if test == "pp":
            prompts, params = [self.prompt[:n]], SamplingParams(max_tokens=1, temperature=0)
            tokens = n
        else:
            rows = batch if test == "batch" else 1
            prompts = [[self.prompt[i]] for i in range(rows)]
            params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            tokens = n * rows
        start = time.perf_counter()
        self.llm.generate(prompts, params)
        return tokens / (time.perf_counter() - start)


def main() -> None:
    """Load every size, alternate them over the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="GGUF path or alias")
    parser.add_argument("--sizes", default="1,2", help="tensor_parallel_size values, comma-separated")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--n-prompt", type=int, default=128)
    parser.add_argument("--n-gen", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    path = resolve_model(args.model)
    sizes = [Size(path, int(s), args.dtype, args.n_prompt, args.n_gen, args.batch) for s in args.sizes.split(",")]
    tests = [("pp", args.n_prompt), ("tg", args.n_gen), ("batch", args.n_gen)]
    speeds: dict[tuple[int, str], list[float]] = {(s.size, t): [] for s in sizes for t, _ in tests}
    for s in sizes:  # warm-up
        s.timed("pp", args.n_prompt, args.batch)
        s.timed("tg", 8, args.batch)
    for _ in range(args.rounds):
        for s in sizes:
            for test, n in tests:
                speeds[s.size, test].append(s.timed(test, n, args.batch))
    for s in sizes:
        s.llm.shutdown()
    names = {"pp": f"pp{args.n_prompt}", "tg": f"tg{args.n_gen}", "batch": f"{args.batch} x tg{args.n_gen}"}
    print(f"\nmodel: {os.path.basename(path)}; dtype {args.dtype}; {cpu_name()}, {os.cpu_count()} logical cores; "
          f"{datetime.date.today()}; median of {args.rounds} rounds (min-max)\n")
    print("| test | " + " | ".join(f"TP={s.size} ({s.threads} thread{'s' if s.threads > 1 else ''}/rank) t/s"
                                   for s in sizes) + " |")
    print("| --- |" + " ---: |" * len(sizes))
    first = sizes[0].size
    for test, _ in tests:
        cells = []
        for s in sizes:
            values = speeds[s.size, test]
            cell = f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"
            if s.size != first:
                cell += f", x{statistics.median(values) / statistics.median(speeds[first, test]):.2f}"
            cells.append(cell)
        print(f"| {names[test]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

"""Prefill and decode speed in the style of llama.cpp's llama-bench: pp512 and tg128 rows, tokens/s, mean ± stddev.

    python benchmarks/bench_decode.py --model smollm2-135m --dtypes float32,bfloat16 --transformers

Runs gpullama (one row pair per dtype) and, with --transformers, the HF transformers reference loading the very
same GGUF, in one process one after the other, and prints one markdown table.
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
from gpullama.hub import resolve_model


def timed(fn, repeats: int) -> list[float]:
    """Seconds of each of `repeats` runs after one warm-up run."""
    fn()
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def rate(tokens: int, seconds: list[float]) -> str:
    """tokens/s as mean ± stddev over the runs."""
    speeds = [tokens / s for s in seconds]
    std = statistics.stdev(speeds) if len(speeds) > 1 else 0.0
    return f"{statistics.mean(speeds):.2f} ± {std:.2f}"


def bench_gpullama(path: str, dtype: str, device: str, n_prompt: int, n_gen: int, repeats: int) -> list[tuple]:
    """pp and tg rows for gpullama at one dtype."""
    llm = LLM(path, device=device, dtype=dtype, max_num_batched_tokens=max(512, n_prompt), enable_prefix_caching=False)
    prompt = torch.randint(100, llm.config.vocab_size, (n_prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    pp = timed(lambda: llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0)), repeats)
    tg_params = SamplingParams(max_tokens=n_gen, temperature=0, ignore_eos=True)
    tg = timed(lambda: llm.generate([prompt[:1]], tg_params), repeats)
    name = f"gpullama {dtype} ({llm.model.ops.name} ops)"
    return [(name, f"pp{n_prompt}", rate(n_prompt, pp)), (name, f"tg{n_gen}", rate(n_gen, tg))]


def bench_transformers(path: str, n_prompt: int, n_gen: int, repeats: int) -> list[tuple]:
    """pp and tg rows for HF transformers (float32) loading the same GGUF."""
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    prompt = torch.randint(100, vocab, (1, n_prompt), generator=torch.Generator().manual_seed(0))

    def prefill():
        with torch.inference_mode():
            model(prompt)

    def decode():
        with torch.inference_mode():
            model.generate(prompt[:, :1], max_new_tokens=n_gen, min_new_tokens=n_gen, do_sample=False)

    label = "transformers float32"
    return [(label, f"pp{n_prompt}", rate(n_prompt, timed(prefill, repeats))),
            (label, f"tg{n_gen}", rate(n_gen, timed(decode, repeats)))]


def main() -> None:
    """Parse arguments, run every engine asked for, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--n-prompt", type=int, default=512)
    parser.add_argument("--n-gen", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--transformers", action="store_true", help="also run the HF transformers reference")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    rows = []
    for dtype in args.dtypes.split(","):
        rows += bench_gpullama(path, dtype, args.device, args.n_prompt, args.n_gen, args.repeats)
    if args.transformers:
        rows += bench_transformers(path, args.n_prompt, args.n_gen, args.repeats)
    print(f"\nmodel: {os.path.basename(path)}; device: {args.device} ({cpu_name()}), torch threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}; {datetime.date.today()}; repeats {args.repeats}\n")
    print("| engine | test | tokens/s |")
    print("| --- | --- | ---: |")
    for engine, test, value in rows:
        print(f"| {engine} | {test} | {value} |")


if __name__ == "__main__":
    main()

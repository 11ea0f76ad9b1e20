"""Aggregate generation throughput of the continuous-batching engine at several concurrency levels.

    python benchmarks/bench_throughput.py --model smollm2-135m --concurrency 1,4,16,64 --num-requests 64

One fixed set of requests (prompt lengths drawn from a seeded RNG, each prompt a window of real English text) runs
through `LLM.generate` as one batch per concurrency level, with `max_num_seqs` = the level; every request decodes
exactly `--output-len` tokens (greedy, EOS ignored). Prints machine info and a markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import random
import time

import torch
from machine import cpu_name  # benchmarks/machine.py

from gpullama import LLM, SamplingParams
from gpullama.gguf_file import read_gguf
from gpullama.hub import resolve_model
from gpullama.tokenizer import Tokenizer

# Plain English written for this benchmark: the prompts are windows of its tokens, so ids look like real text.
CORPUS = """\
The river town woke slowly in autumn. Before dawn the bakers lit their ovens, and the smell of bread drifted down \
the narrow streets toward the water, where the ferrymen were already checking their ropes. By seven the market \
square was full of carts: apples from the hill farms, cheese wrapped in cloth, baskets of late mushrooms that the \
children had gathered in the woods the day before. Old Mrs. Halloran sold honey from a table by the fountain, as her \
mother had done, and she knew the name of every customer and most of their troubles.

The town had grown up around a bridge. For centuries it was the only crossing for thirty miles in either direction, \
and every traveller, merchant and soldier heading north had to pass through. The toll paid for the walls, the \
church and the long stone warehouses by the quay. When the railway arrived, the trains crossed the river on an iron \
viaduct a mile upstream, and within a generation the old bridge carried nothing heavier than bicycles and the \
occasional delivery van. The warehouses were turned into flats, a library and a small theatre that put on three \
plays a year, one of them always a comedy.

Teachers at the school liked to set the history of the bridge as a project. Students measured the arches, copied \
the inscriptions on the keystones and interviewed their grandparents about the great flood, when the water rose \
over the parapet and the whole lower town had to be evacuated by boat. The best projects were kept in the library, \
and a visitor who asked could read forty years of careful handwriting about the same few hundred stones, each \
student noticing something the others had missed: a mason's mark, a repaired crack, a date scratched by a bored \
sentry in the winter of a forgotten war.

Engineers who inspected the bridge last spring found it in better condition than the viaduct. The old builders, \
they said, had overdesigned everything because they could not calculate the loads precisely, and the extra stone \
had bought the structure an extra five hundred years. The viaduct, built to exact figures by a confident company, \
needs new steel every few decades. There is a lesson in that, the mayor said at the ceremony, although he did not \
say exactly what it was, and the crowd, who had come mostly for the music and the fireworks, did not ask.
"""


def make_prompts(tokenizer: Tokenizer, num_requests: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    """`num_requests` prompts of seeded random lengths in [min_len, max_len] tokens, each a window of the corpus
    tokens (the corpus repeats when a window runs past its end), starting with BOS when the model uses one."""
    corpus = tokenizer.encode(CORPUS, add_special_tokens=False)
    repeats = -(-2 * max_len // len(corpus)) + 1
    corpus = corpus * repeats
    bos = tokenizer.encode("", add_special_tokens=True)  # [BOS] or []
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_requests):
        length = rng.randint(min_len, max_len) - len(bos)
        start = rng.randrange(0, len(corpus) - length)
        prompts.append(bos + corpus[start : start + length])
    return prompts


def run_level(
    args: argparse.Namespace, path: str, concurrency: int, prompts: list[list[int]], max_model_len: int
) -> tuple[int, float, str]:
    """Generated tokens and seconds of the whole request set at one concurrency level (model load not timed)."""
    llm = LLM(
        path,
        device=args.device,
        dtype=args.dtype,
        max_model_len=max_model_len,
        max_num_seqs=concurrency,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.prefix_caching,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[: min(concurrency, 4)], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    completions = llm.generate(prompts, params)
    if llm.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    generated = sum(len(c.token_ids) for c in completions)
    described = f"{llm.device} {str(llm.dtype).removeprefix('torch.')} ({llm.model.ops.mode})"
    del llm, completions
    gc.collect()
    return generated, seconds, described


def parse_levels(text: str) -> list[int]:
    """'1,4,16,64' -> [1, 4, 16, 64], each a positive integer."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--concurrency must be comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise SystemExit(f"--concurrency levels must be >= 1, got {text!r}")
    return levels


def main() -> None:
    """Parse arguments, run every concurrency level, print machine info and the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="GGUF path or model alias")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma-separated max_num_seqs levels")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--prefix-caching", action="store_true", help="enable the prefix cache (off by default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    levels = parse_levels(args.concurrency)
    if args.num_requests < 1 or args.output_len < 1 or not 1 <= args.min_prompt_len <= args.max_prompt_len:
        raise SystemExit("--num-requests and --output-len must be >= 1, and 1 <= --min-prompt-len <= --max-prompt-len")
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    max_model_len = args.max_prompt_len + args.output_len + 1

    tokenizer = Tokenizer.from_metadata(read_gguf(path).metadata)
    prompts = make_prompts(tokenizer, args.num_requests, args.min_prompt_len, args.max_prompt_len, args.seed)

    rows = []
    described = ""
    for level in levels:
        generated, seconds, described = run_level(args, path, level, prompts, max_model_len)
        rows.append((level, generated, seconds))
        print(f"concurrency {level}: {generated} tokens in {seconds:.1f}s", flush=True)

    base_level = 1 if 1 in levels else min(levels)
    base = next(g / s for level, g, s in rows if level == base_level)
    gpu = f", GPU {torch.cuda.get_device_name()}" if torch.cuda.is_available() and "cuda" in described else ""
    print(
        f"\nmodel: {os.path.basename(path)} on {described}; CPU {cpu_name()} ({os.cpu_count()} logical cores, "
        f"torch threads {torch.get_num_threads()}){gpu}; torch {torch.__version__}; "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}"
    )
    print(
        f"requests: {args.num_requests}, prompt lengths {args.min_prompt_len}-{args.max_prompt_len} tokens "
        f"(seed {args.seed}, {sum(len(p) for p in prompts)} in all), {args.output_len} generated tokens each, "
        f"greedy; prefix caching {'on' if args.prefix_caching else 'off'}\n"
    )
    print(f"| concurrency | requests | generated tokens | seconds | generated tokens/s | speed-up vs {base_level} |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for level, generated, seconds in rows:
        speed = generated / seconds
        print(f"| {level} | {args.num_requests} | {generated} | {seconds:.2f} | {speed:.1f} | {speed / base:.2f}x |")


if __name__ == "__main__":
    main()

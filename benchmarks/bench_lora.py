"""Decode speed with a LoRA adapter against the base model at batch 1 (issue 36: within 10% on the CPU fast path).

    python benchmarks/bench_lora.py --model smollm2-135m --make-adapter /tmp/r16.gguf --rank 16
    python benchmarks/bench_lora.py --model smollm2-135m --adapter /tmp/r16.gguf --threads 2 --rounds 5

`--make-adapter` writes a random adapter in llama.cpp's GGUF layout (`general.type` adapter, `adapter.type` lora,
`adapter.lora.alpha`, `blk.N.<name>.weight.lora_a` [r, K] and `.lora_b` [N, r], float32) for every attention and
MLP matrix of every layer of the model (`--targets attn_q,attn_v`: those only), with the `gguf` package. Timing: one process loads the model with the
adapter, then alternates requests with and without it (base, adapter, base, ...) `--rounds` times, the same prompt
each time (the prefix cache serves the prompt; each adapter has its own cache keys). Decode tokens/s is (tokens -
1) / (time of a `--tokens` request - time of a one-token request), greedy with EOS ignored. Prints the median of
each and the median of the per-round ratios. `--only base|lora` times one of them alone (for whole-process
pairing).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import numpy as np
from machine import cpu_name  # benchmarks/machine.py

from gpullama import LLM
from gpullama.sampling_params import SamplingParams

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def make_adapter(model: str, out: str, rank: int, alpha: float, targets: tuple[str, ...] = TARGETS) -> None:
    """A random rank-`rank` adapter for the `targets` matrices (default: every attention and MLP matrix) of every
    layer of `model`, in llama.cpp's layout."""
    import gguf

    from gpullama.gguf_file import read_header
    from gpullama.hub import resolve_model

    header = read_header(resolve_model(model))
    shapes = {t.name: tuple(t.shape) for t in header.tensors}
    writer = gguf.GGUFWriter(out, header.config.architecture)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    rng = np.random.default_rng(0)
    for i in range(header.config.num_layers):
        for target in targets:
            name = f"blk.{i}.{target}.weight"
            n, k = shapes[name]
            writer.add_tensor(f"{name}.lora_a", (rng.standard_normal((rank, k)) * 0.02).astype(np.float32))
            writer.add_tensor(f"{name}.lora_b", (rng.standard_normal((n, rank)) * 0.02).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def decode_rate(llm: LLM, prompt: list[int], tokens: int, lora) -> float:
    """Decode tokens/s of one request of `tokens` tokens after `prompt` (its prefill timed apart and left out)."""
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([prompt], one, lora=lora)
    first = time.perf_counter() - start
    start = time.perf_counter()
    llm.generate([prompt], many, lora=lora)
    return (tokens - 1) / (time.perf_counter() - start - first)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--make-adapter", metavar="PATH")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--targets", default=",".join(TARGETS), help="the matrices --make-adapter adapts (default: all)")
    p.add_argument("--adapter", metavar="PATH")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", choices=("base", "lora"))
    args = p.parse_args()
    if args.make_adapter:
        make_adapter(args.model, args.make_adapter, args.rank, args.alpha, tuple(args.targets.split(",")))
        print(f"wrote {args.make_adapter} (rank {args.rank}, alpha {args.alpha:g})")
        return
    llm = LLM(args.model, device=args.device, threads=args.threads, lora={"bench": args.adapter},
              max_model_len=512, max_num_seqs=4)
    prompt = llm.tokenizer.encode("Write a short story about a lighthouse keeper who finds a map.",
                                  add_special_tokens=True)
    for lora in (None, "bench"):  # warm-up: compiles, caches the prompt under each key
        decode_rate(llm, prompt, 16, lora)
    if args.only:
        rate = decode_rate(llm, prompt, args.tokens, "bench" if args.only == "lora" else None)
        print(f"{args.only} decode tok/s {rate:.2f}")
        return
    base, lora, ratios = [], [], []
    for _ in range(args.rounds):
        b = decode_rate(llm, prompt, args.tokens, None)
        a = decode_rate(llm, prompt, args.tokens, "bench")
        base.append(b)
        lora.append(a)
        ratios.append(a / b)
    adapter = llm.lora_adapters["bench"]
    rank = next(p.a.shape[0] for layer in adapter.layers for pairs in layer.values() for p in pairs)
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {cpu_name()}, "
          f"{os.cpu_count()} cpus, load {os.getloadavg()[0]:.2f}; {llm.model_name}, ops {llm.model.ops.name} "
          f"({llm.model.ops.mode}), threads {args.threads}; adapter rank {rank} on {adapter.targets} matrices")
    print(f"base   decode tok/s median {statistics.median(base):.2f} (min {min(base):.2f}, max {max(base):.2f})")
    print(f"lora   decode tok/s median {statistics.median(lora):.2f} (min {min(lora):.2f}, max {max(lora):.2f})")
    print(f"lora/base per round: median {statistics.median(ratios):.3f} ({', '.join(f'{r:.3f}' for r in ratios)})")


if __name__ == "__main__":
    main()

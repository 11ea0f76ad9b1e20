"""MoE decode speed beside llama.cpp's llama-bench on the same file, and the weight bytes a token reads.

    /work/bin/cpu-bench python benchmarks/bench_moe.py --model /tmp/qwen3moe-random.gguf --threads 2 \\
        --llama-bench /work/bench/llama.cpp/build/bin/llama-bench --n-gen 32 --rounds 5

gpullama (CPU fast path, dtype auto) is loaded once in this process; each round times its tg (generate `--n-gen`
tokens after a one-token prompt, greedy, EOS ignored) and then runs ``llama-bench -p 0 -n N -r 1`` on the same file
with the same thread count (its own process, its tg time only), so both see the same machine load. The table gives
the median tokens/s over the rounds, their min-max and the ratio to llama.cpp.

Bytes a token reads on gpullama's side: the experts' bytes the MoE kernel read (its own counter: every block of each
active expert's gate|up and down) over the tokens, plus every other matrix the step multiplies by (attention,
routers, output head) and one embedding row; set beside the GGUF bytes of the active experts (k of E per layer) and
of everything a token uses (`gpullama.gguf_file.model_size`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

import gguf
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402  (benchmarks/machine.py)

from gpullama.bench import PpTg  # noqa: E402
from gpullama.gguf_file import model_size, read_header  # noqa: E402
from gpullama.kernels import cpu_native  # noqa: E402


def llama_bench(binary: str, model: str, n_gen: int, threads: int) -> tuple[float, str]:
    """(tokens/s of one tg run, build string) from llama-bench's JSON."""
    out = subprocess.run([binary, "-m", model, "-p", "0", "-n", str(n_gen), "-r", "1", "-t", str(threads),
                          "-o", "json"], capture_output=True, text=True, check=True).stdout
    row = json.loads(out)[0]
    return float(row["avg_ts"]), f"{row.get('build_commit', '?')} ({row.get('build_number', '?')})"


def active_expert_bytes(path: str) -> tuple[int, int]:
    """(GGUF bytes of the experts one token uses, k of E in every MoE layer; the bytes of all a token uses)."""
    header = read_header(path)
    c = header.config
    experts = 0
    for t in header.tensors:
        if "_exps." in t.name:
            block, size = gguf.GGML_QUANT_SIZES[t.qtype]
            count = 1
            for d in t.shape:
                count *= d
            experts += count // block * size
    return experts * c.num_experts_used // c.num_experts, model_size(header).active_bytes


def dense_bytes(decoder) -> int:
    """Bytes of the prepared matrices a decode step multiplies by besides the experts, and one embedding row."""
    total = decoder.output.nbytes
    for layer in decoder.layers:
        total += sum(w.nbytes for w in (*layer.qkv, layer.o))
        if layer.moe is not None:
            total += layer.moe.router.nbytes
        else:
            total += sum(w.nbytes for w in (*layer.gate_up, layer.down))
    return total + decoder.embedding.nbytes // decoder.vocab_rows


def main(argv: list[str] | None = None) -> int:
    """Run the rounds and print the table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--llama-bench", default="/work/bench/llama.cpp/build/bin/llama-bench")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-gen", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bench = PpTg(args.model, "auto", "cpu", 1, args.n_gen, args.threads)
    bench.tg(args.n_gen)  # warm-up
    ours, theirs, read = [], [], []
    build = "?"
    for _ in range(args.rounds):
        before = cpu_native.moe_bytes_read()
        seconds = bench.tg(args.n_gen)
        read.append((cpu_native.moe_bytes_read() - before) / args.n_gen)
        ours.append(args.n_gen / seconds)
        tokens_s, build = llama_bench(args.llama_bench, args.model, args.n_gen, args.threads)
        theirs.append(tokens_s)
        print(f"round: gpullama {ours[-1]:.2f} tokens/s, llama.cpp {tokens_s:.2f}", file=sys.stderr, flush=True)
    active, used = active_expert_bytes(args.model)
    experts_read = statistics.median(read)
    total_read = experts_read + dense_bytes(bench.llm.model)
    cfg = bench.llm.config

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    ratio = statistics.median(ours) / statistics.median(theirs)
    print(f"\n{datetime.date.today()}, {cpu_name()}, {args.threads} threads, {Path(args.model).name} "
          f"({cfg.num_layers} layers, {cfg.num_experts} experts, {cfg.num_experts_used} a token), tg{args.n_gen}, "
          f"{args.rounds} rounds alternating; llama.cpp build {build}\n")
    print(f"| engine | tg{args.n_gen} tokens/s | vs llama.cpp |\n| --- | ---: | ---: |")
    print(f"| gpullama fast ({cpu_native.isa()}) | {cell(ours)} | {ratio:.2f}x |")
    print(f"| llama.cpp llama-bench | {cell(theirs)} | 1.00x |\n")
    print("| bytes a token reads (gpullama) | MB | GGUF bytes of the same | MB | ratio |\n| --- | ---: | --- | ---: | ---: |")
    print(f"| experts (the kernel's counter) | {experts_read / 1e6:.1f} | the active experts (k of E a layer) | "
          f"{active / 1e6:.1f} | {experts_read / active:.3f} |")
    print(f"| everything (experts + other matrices + an embedding row) | {total_read / 1e6:.1f} | all a token uses | "
          f"{used / 1e6:.1f} | {total_read / used:.3f} |")
    print(f"\nresident memory the gpullama load added: {bench.loaded_bytes / 2**20:.0f} MiB (file "
          f"{Path(args.model).stat().st_size / 2**20:.0f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

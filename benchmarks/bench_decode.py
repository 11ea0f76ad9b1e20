"""Prefill and decode speed in the style of llama.cpp's llama-bench: pp512 and tg128 rows, tokens/s, side by side.

    python benchmarks/bench_decode.py --model smollm2-135m --dtypes bfloat16,float32 --threads 2 \\
        --llama-cpp /work/venv-llamacpp/bin/python [--transformers]
    python benchmarks/bench_decode.py --dtypes auto --n-prompt 0 --n-depth 0,2048,8192 \\
        --llama-bench /work/bench/llama.cpp/build/bin/llama-bench

Every engine is loaded once, in this process (llama.cpp in a worker process, `llama_cpp_worker.py`, run by the
Python given to --llama-cpp, a virtualenv with llama-cpp-python built from source; never a dependency of
gpullama), except llama.cpp's own `llama-bench` binary (--llama-bench: one run of it per test and round, one
repetition after its warm-up, its own t/s; never a dependency either). With --n-depth each test also runs after that
many tokens of context (llama-bench's -d; the python llama.cpp and transformers take depth 0 only). The rounds
alternate the engines (engine A pp and tg, engine B pp and tg, ..., then again), so
all see the same machine load; the table gives the median over the rounds, its min-max, and the ratio to
llama.cpp. Prefix caching is off, greedy, EOS ignored; same prompt length and same thread count for all. The
gpullama rows also give the resident memory their load added (RSS after minus before) and the KV pool size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

import gguf
import torch
from machine import cpu_name  # benchmarks/machine.py

from gpullama.bench import PpTg as Gpullama  # the rows of `gpullama bench`
from gpullama.hub import resolve_model

WORKER = Path(__file__).resolve().parent / "llama_cpp_worker.py"


class LlamaCpp:
    """llama.cpp (llama-cpp-python) in a worker process run by another Python."""

    def __init__(self, python: str, path: str, threads: int, n_ctx: int):
        self.proc = subprocess.Popen([python, str(WORKER), path, str(threads), str(n_ctx)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        if not ready.startswith("ready"):
            raise SystemExit(f"llama.cpp worker did not start (got {ready!r})")
        version = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                                 capture_output=True, text=True).stdout.strip()
        self.label = f"llama.cpp (llama-cpp-python {version})"

    def _ask(self, test: str, n: int) -> float:
        self.proc.stdin.write(f"{test} {n}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def pp(self, n: int) -> float:
        """Seconds to evaluate `n` prompt tokens in one batch."""
        return self._ask("pp", n)

    def tg(self, n: int) -> float:
        """Seconds to generate `n` tokens after a one-token prompt."""
        return self._ask("tg", n)


class LlamaBench:
    """llama.cpp's own `llama-bench` binary: one run per test (-r 1 after its warm-up), its tokens/s."""

    def __init__(self, binary: str, path: str, threads: int, kv_cache_type: str = "f16", flash_attn: str = "auto"):
        self.binary, self.path, self.threads, self.kv, self.fa = binary, path, threads, kv_cache_type, flash_attn
        version = subprocess.run([binary, "--version"], capture_output=True, text=True)
        build = (version.stdout + version.stderr).strip().splitlines()
        self.label = f"llama.cpp llama-bench ({build[0] if build else '?'}; KV {kv_cache_type}; -fa {flash_attn})"

    def _run(self, pp: int, tg: int, depth: int) -> float:
        cmd = [self.binary, "-m", self.path, "-t", str(self.threads), "-p", str(pp), "-n", str(tg), "-d", str(depth),
               "-r", "1", "-ctk", self.kv, "-ctv", self.kv, "-fa", self.fa, "-o", "json"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr.strip()[-1000:]}")
        row = json.loads(proc.stdout)[0]
        return (pp or tg) / row["avg_ts"]

    def pp(self, n: int, depth: int = 0) -> float:
        """Seconds of its pp test (its own timing)."""
        return self._run(n, 0, depth)

    def tg(self, n: int, depth: int = 0) -> float:
        """Seconds of its tg test (its own timing)."""
        return self._run(0, n, depth)


class Transformers:
    """HF transformers (float32) loading the same GGUF."""

    def __init__(self, path: str, n_prompt: int):
        from transformers import AutoModelForCausalLM

        folder, name = os.path.split(path)
        self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
        vocab = self.model.config.vocab_size
        self.prompt = torch.randint(100, vocab, (1, n_prompt), generator=torch.Generator().manual_seed(0))
        self.label = "transformers float32"

    def pp(self, n: int) -> float:
        """Seconds of one forward over `n` prompt tokens."""
        start = time.perf_counter()
        with torch.inference_mode():
            self.model(self.prompt[:, :n])
        return time.perf_counter() - start

    def tg(self, n: int) -> float:
        """Seconds to generate `n` tokens greedily after a one-token prompt."""
        start = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(self.prompt[:, :1], max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start


def gguf_matrix_bytes(path: str) -> int:
    """Bytes of the file's matrices a decode step reads once each: every 2-D tensor but the token embedding (read a
    row at a time), which counts when it is also the output head (tied)."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors if len(t.shape) == 2}
    tied = "output.weight" not in tensors
    return sum(int(t.n_bytes) for name, t in tensors.items() if name != "token_embd.weight" or tied)


def bytes_per_decode_token(engine: Gpullama, n: int = 16) -> float | None:
    """Weight bytes the CPU fast path's matmul and MoE kernels read per token while generating `n` tokens (None
    when the engine does not run them)."""
    from gpullama.kernels import cpu_native
    from gpullama.ops.cpu_ops import CpuOps

    if not isinstance(engine.llm.model.ops, CpuOps):
        return None
    before = cpu_native.matmul_bytes_read() + cpu_native.moe_bytes_read()
    engine.tg(n)
    return (cpu_native.matmul_bytes_read() + cpu_native.moe_bytes_read() - before) / n


def main() -> None:
    """Parse arguments, load every engine, alternate them over the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="gpullama dtypes, one row pair each")
    parser.add_argument("--n-prompt", type=int, default=512)
    parser.add_argument("--n-gen", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5, help="rounds (each engine once per round)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-cpp", metavar="PYTHON", help="a Python with llama-cpp-python: add llama.cpp's rows")
    parser.add_argument("--transformers", action="store_true", help="also run the HF transformers reference")
    parser.add_argument("--llama-bench", metavar="BINARY", help="llama.cpp's llama-bench: add its rows")
    parser.add_argument("--n-depth", default="0", help="depths, comma-separated (llama-bench's -d; default 0)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="gpullama's KV cache format (default auto)")
    parser.add_argument("--activation-bits", default="16",
                        help="gpullama's CPU matmul activations, a row each: 16, 8 or 16,8 (default 16)")
    parser.add_argument("--llama-kv", default="f16", help="llama-bench's -ctk/-ctv (default f16)")
    parser.add_argument("--llama-fa", default="0,1", help="llama-bench's -fa settings, a row each; the ratio is to "
                        "the fastest of them per test (default 0,1: on CPUs flash attention is sometimes the slow one)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    depths = [int(d) for d in args.n_depth.split(",") if d]
    engines: list = [Gpullama(path, d, args.device, args.n_prompt, args.n_gen, args.threads, n_depth=max(depths),
                              kv_cache_dtype=args.kv_cache_dtype, cpu_activation_bits=int(bits))
                     for d in args.dtypes.split(",") if d for bits in args.activation_bits.split(",") if bits]
    if args.llama_bench:
        engines += [LlamaBench(args.llama_bench, path, args.threads, args.llama_kv, fa)
                    for fa in args.llama_fa.split(",") if fa]
    if (args.llama_cpp or args.transformers) and depths != [0]:
        raise SystemExit("--n-depth: gpullama and --llama-bench only")
    if args.llama_cpp:
        engines.append(LlamaCpp(args.llama_cpp, path, args.threads, args.n_prompt + args.n_gen + 16))
    if args.transformers:
        engines.append(Transformers(path, args.n_prompt))
    tests = [(f"{kind}{n}" + (f" @ d{d}" if d else ""), kind, n, d)
             for d in depths for kind, n in (("pp", args.n_prompt), ("tg", args.n_gen)) if n > 0]
    times: dict[tuple[int, str], list[float]] = {(i, t[0]): [] for i in range(len(engines)) for t in tests}

    def timed(engine, kind: str, n: int, depth: int) -> float:
        return getattr(engine, kind)(n, depth) if depth else getattr(engine, kind)(n)

    for engine in engines:  # warm-up (gpullama: also the depths' contexts into its prefix cache)
        if not isinstance(engine, LlamaBench):
            for _, kind, n, d in tests:
                timed(engine, kind, min(n, 8) if kind == "tg" else n, d)
    for _ in range(args.repeats):
        for i, engine in enumerate(engines):
            for name, kind, n, d in tests:
                times[i, name].append(timed(engine, kind, n, d))
    tokens = {name: n for name, _, n, _ in tests}
    speeds = {key: sorted(tokens[key[1]] / s for s in seconds) for key, seconds in times.items()}
    llama = [i for i, e in enumerate(engines) if isinstance(e, LlamaCpp | LlamaBench)]
    reference = {name: max(llama, key=lambda i: statistics.median(speeds[i, name])) for name, *_ in tests} \
        if llama else None
    print(f"\nmodel: {os.path.basename(path)}; device: {args.device} ({cpu_name()}, {os.cpu_count()} logical cores), "
          f"{args.threads} threads, torch {torch.__version__}; {datetime.datetime.now():%Y-%m-%d %H:%M}; "
          f"{args.repeats} alternating rounds\n")
    ratio = " | vs llama.cpp's best" if reference is not None else ""
    print(f"| engine | test | tokens/s (median) | min-max{ratio} |")
    print("| --- | --- | ---: | ---:" + (" | ---:" if ratio else "") + " |")
    for name, *_ in tests:
        for i, engine in enumerate(engines):
            s = speeds[i, name]
            cell = f" | {statistics.median(s) / statistics.median(speeds[reference[name], name]):.2f}x" if ratio else ""
            print(f"| {engine.label} | {name} | {statistics.median(s):.1f} | {s[0]:.1f}-{s[-1]:.1f}{cell} |")
    for engine in engines:
        if isinstance(engine, Gpullama):
            runner = engine.llm.engine.runner
            print(f"\n{engine.label}: load added {engine.loaded_bytes / 2**20:.0f} MiB resident "
                  f"(file {os.path.getsize(path) / 2**20:.0f} MiB; KV pool {runner.kv_cache_bytes / 2**20:.0f} MiB)",
                  end="")
            read = bytes_per_decode_token(engine)
            if read is not None:
                matrices = gguf_matrix_bytes(path)
                print(f"; weight bytes read per decode token {read / 2**20:.1f} MiB, {read / matrices:.3f}x the "
                      f"file's matrix bytes ({matrices / 2**20:.1f} MiB)", end="")
    print()


if __name__ == "__main__":
    main()

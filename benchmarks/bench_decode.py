"""Prefill and decode speed in the style of llama.cpp's llama-bench: pp512 and tg128 rows, tokens/s, side by side.

    python benchmarks/bench_decode.py --model smollm2-135m --dtypes bfloat16,float32 --threads 2 \\
        --llama-cpp /work/venv-llamacpp/bin/python [--transformers]

Every engine is loaded once, in this process (llama.cpp in a worker process, `llama_cpp_worker.py`, run by the
Python given to --llama-cpp, a virtualenv with llama-cpp-python built from source; never a dependency of
gpullama), then the rounds alternate the engines (engine A pp and tg, engine B pp and tg, ..., then again), so
all see the same machine load; the table gives the median over the rounds, its min-max, and the ratio to
llama.cpp. Prefix caching is off, greedy, EOS ignored; same prompt length and same thread count for all. The
gpullama rows also give the resident memory their load added (RSS after minus before) and the KV pool size.
"""

from __future__ import annotations

import argparse
import datetime
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_model(args.model)
    engines: list = [Gpullama(path, d, args.device, args.n_prompt, args.n_gen, args.threads)
                     for d in args.dtypes.split(",") if d]
    if args.llama_cpp:
        engines.append(LlamaCpp(args.llama_cpp, path, args.threads, args.n_prompt + args.n_gen + 16))
    if args.transformers:
        engines.append(Transformers(path, args.n_prompt))
    tests = [("pp", args.n_prompt), ("tg", args.n_gen)]
    times: dict[tuple[int, str], list[float]] = {(i, t): [] for i in range(len(engines)) for t, _ in tests}
    for engine in engines:  # warm-up
        engine.pp(args.n_prompt)
        engine.tg(8)
    for _ in range(args.repeats):
        for i, engine in enumerate(engines):
            for test, n in tests:
                times[i, test].append(getattr(engine, test)(n))
    tokens = dict(tests)
    speeds = {key: sorted(tokens[key[1]] / s for s in seconds) for key, seconds in times.items()}
    reference = next((i for i, e in enumerate(engines) if isinstance(e, LlamaCpp)), None)
    print(f"\nmodel: {os.path.basename(path)}; device: {args.device} ({cpu_name()}, {os.cpu_count()} logical cores), "
          f"{args.threads} threads, torch {torch.__version__}; {datetime.datetime.now():%Y-%m-%d %H:%M}; "
          f"{args.repeats} alternating rounds\n")
    ratio = " | vs llama.cpp" if reference is not None else ""
    print(f"| engine | test | tokens/s (median) | min-max{ratio} |")
    print("| --- | --- | ---: | ---:" + (" | ---:" if ratio else "") + " |")
    for i, engine in enumerate(engines):
        for test, n in tests:
            s = speeds[i, test]
            cell = f" | {statistics.median(s) / statistics.median(speeds[reference, test]):.2f}x" if ratio else ""
            print(f"| {engine.label} | {test}{n} | {statistics.median(s):.1f} | {s[0]:.1f}-{s[-1]:.1f}{cell} |")
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

"""Time to swap between two models in one ``gpullama-serve``: with ``--max-loaded-models 1``, a request for the model
that is not loaded unloads the other, loads it and answers; timed from the request to its first streamed token.

    python benchmarks/bench_model_swap.py --model a=~/.cache/gpullama/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --model b=~/.cache/gpullama/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf --rounds 5 [-- --dtype float32]

Each round asks model b then model a (each a swap), one token, streamed, on ``/v1/completions``; then once more the
model just loaded (no swap: the first-token time of a loaded model, for comparison). The server logs each load's
seconds; the table gives the median with min-max, and ``uptime`` before and after (the machine's load).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time

import httpx
from bench_startup import free_port  # benchmarks/bench_startup.py
from machine import cpu_name  # benchmarks/machine.py


def first_token(client: httpx.Client, model: str) -> float:
    """Seconds from sending a one-token streamed completion for `model` to its first token."""
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0, "stream": True}
    start = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError(f"no token from {model}")


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", action="append", required=True, help="NAME=PATH, twice")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("extra", nargs="*", help="more gpullama-serve flags (after --)")
    args = p.parse_args()
    names = [m.split("=", 1)[0] for m in args.model]
    assert len(names) == 2, "give --model twice"
    port = free_port()
    flags = [f for m in args.model for f in ("--model", os.path.expanduser(m))]
    uptime_before = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    proc = subprocess.Popen([sys.executable, "-m", "gpullama.server", *flags, "--port", str(port),
                             "--max-loaded-models", "1", "--log-stats-interval", "0", *args.extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    swaps: dict[str, list[float]] = {n: [] for n in names}
    warm: list[float] = []
    memory: dict[str, list[float]] = {n: [] for n in names}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            while True:
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            first_token(client, names[0])  # warm-up: the default model answers once
            for _ in range(args.rounds):
                for name in (names[1], names[0]):
                    swaps[name].append(first_token(client, name))
                    memory[name].append(rss_mib(proc.pid))
                warm.append(first_token(client, names[0]))
    finally:
        proc.kill()
        proc.wait()
    uptime_after = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()

    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"

    print(f"{datetime.date.today()}, {cpu_name()}, {os.cpu_count()} cores; flags: {' '.join(args.extra) or '-'}")
    print(f"uptime before: {uptime_before}\nuptime after:  {uptime_after}\n")
    print("| request | first token (s) | RSS after (MiB) |\n| --- | ---: | ---: |")
    for name in (names[1], names[0]):
        other = names[0] if name == names[1] else names[1]
        print(f"| swap {other} -> {name} (unload, load, first token) | {cell(swaps[name])} | "
              f"{statistics.median(memory[name]):.0f} |")
    print(f"| {names[0]} loaded, no swap | {cell(warm)} | |")


if __name__ == "__main__":
    main()

"""Server start to first token, and the server's memory, for one or more checkouts side by side.

    python benchmarks/bench_startup.py --model ~/.cache/gpullama/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --checkout before=/tmp/before --checkout after=. --rounds 5

Each round starts ``python -m gpullama.server`` once per checkout, in turn (``PYTHONPATH`` naming the checkout, so
every round sees the same machine load for all), and times, from the process start: the socket answering, ``GET
/health`` answering 200 (the model loaded), and the first streamed token of a one-token chat completion. Then it
reads the server's resident memory (VmRSS) and its peak (VmHWM) from /proc and kills it (SIGKILL: shutdown time is
not part of this). The table gives the median over the rounds and the min-max.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from machine import cpu_name  # benchmarks/machine.py

CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 1,
        "temperature": 0, "stream": True}


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_memory(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process in MiB."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


def one_start(checkout: Path, model: str, extra: list[str], timeout: float) -> dict[str, float]:
    """Start the server from `checkout`, time it to the socket, to ready and to the first token; its memory then."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(checkout), PYTHONUNBUFFERED="1")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "gpullama.server", "--model", model, "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=checkout)
    out: dict[str, float] = {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=timeout) as http:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"the server from {checkout} exited with {proc.returncode}")
                if time.perf_counter() - start > timeout:
                    raise SystemExit(f"the server from {checkout} was not ready in {timeout}s")
                try:
                    status = http.get("/health").status_code
                except httpx.TransportError:
                    time.sleep(0.02)
                    continue
                out.setdefault("socket_s", time.perf_counter() - start)
                if status == 200:
                    out["ready_s"] = time.perf_counter() - start
                    break
                time.sleep(0.02)
            with http.stream("POST", "/v1/chat/completions", json=CHAT) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    choice = json.loads(line[len("data: "):])["choices"][0]
                    if choice["delta"].get("content") or choice["finish_reason"] is not None:
                        out["first_token_s"] = time.perf_counter() - start
                        break
        out["rss_mib"], out["peak_rss_mib"] = proc_memory(proc.pid)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return out


def main() -> None:
    """Parse arguments, alternate the checkouts over the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--checkout", action="append", required=True, metavar="NAME=PATH")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("server_args", nargs="*", help="more gpullama-serve flags, after --")
    args = parser.parse_args()
    checkouts = [(name, Path(path).resolve()) for name, _, path in (c.partition("=") for c in args.checkout)]
    extra = args.server_args or ["--device", "cpu", "--dtype", "float32"]
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in checkouts}
    for _ in range(args.rounds):
        for name, path in checkouts:
            results[name].append(one_start(path, args.model, extra, args.timeout))
    print(f"\nmodel: {os.path.basename(args.model)}; {cpu_name()}, {os.cpu_count()} logical cores; server flags "
          f"{' '.join(extra)}; {datetime.datetime.now():%Y-%m-%d %H:%M}; {args.rounds} alternating rounds\n")
    columns = [("socket_s", "socket up (s)"), ("ready_s", "/health 200 (s)"), ("first_token_s", "first token (s)"),
               ("rss_mib", "RSS (MiB)"), ("peak_rss_mib", "peak RSS (MiB)")]
    print("| checkout | " + " | ".join(title for _, title in columns) + " |")
    print("| --- |" + " ---: |" * len(columns))
    for name, runs in results.items():
        cells = []
        for key, _ in columns:
            values = sorted(run[key] for run in runs)
            fmt = ".0f" if "mib" in key else ".2f"
            cells.append(f"{statistics.median(values):{fmt}} ({values[0]:{fmt}}-{values[-1]:{fmt}})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

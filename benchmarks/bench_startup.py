"""Server start to first token, and the server's memory, for one or more checkouts side by side, and llama.cpp's.

    python benchmarks/bench_startup.py --model ~/.cache/gpullama/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --checkout before=/tmp/before --checkout after=. --rounds 5
    python benchmarks/bench_startup.py --model llama-3.1-8b-q4_k_m.gguf --checkout gpullama=. \\
        --llama-server /path/to/llama-server --ctx 4096 --rounds 3 -- --device cpu

Each round starts ``python -m gpullama.server`` once per checkout, in turn (``PYTHONPATH`` naming the checkout, so
every round sees the same machine load for all), then llama.cpp's ``llama-server`` when one is named (``-c CTX -t
THREADS``), and times, from the process start: the socket answering, ``GET /health`` answering 200 (the model
loaded; both servers answer 503 while loading), and the first streamed token of a one-token chat completion. Then it
reads the server's resident memory (VmRSS) and its peak (VmHWM) from /proc and kills it (SIGKILL: shutdown time is
not part of this). ``--warmup`` starts of each server come first and are not counted (the file in the page cache:
the figures are for a warm start). The table gives the median over the rounds and the min-max.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
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


def gpullama_command(checkout: Path, model: str, port: int, extra: list[str]) -> tuple[list[str], dict, Path]:
    """The command, environment and directory that start gpullama's server from `checkout`."""
    env = dict(os.environ, PYTHONPATH=str(checkout), PYTHONUNBUFFERED="1")
    return [sys.executable, "-m", "gpullama.server", "--model", model, "--port", str(port), *extra], env, checkout


def llama_server_command(binary: Path, model: str, port: int, ctx: int, threads: int,
                         more: list[str]) -> tuple[list[str], dict, Path]:
    """The command, environment and directory that start llama.cpp's server."""
    cmd = [str(binary), "-m", model, "--port", str(port), "--host", "127.0.0.1", "-c", str(ctx), "-t", str(threads),
           *more]
    return cmd, dict(os.environ), binary.parent


def one_start(command, timeout: float) -> dict[str, float]:
    """Start a server (`command(port)`: its argv, environment and directory), time it to the socket, to ready and
    to the first token; its memory then."""
    port = free_port()
    argv, env, cwd = command(port)
    label = " ".join(argv[:3])
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
    out: dict[str, float] = {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=timeout) as http:
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"{label} ... exited with {proc.returncode}")
                if time.perf_counter() - start > timeout:
                    raise SystemExit(f"{label} ... was not ready in {timeout}s")
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
    """Parse arguments, alternate the servers over the rounds, print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--checkout", action="append", required=True, metavar="NAME=PATH")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--warmup", type=int, default=1, help="uncounted starts of each server first")
    parser.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary, started after the checkouts")
    parser.add_argument("--ctx", type=int, default=4096,
                        help="llama-server's context (-c); give gpullama the same with -- --max-model-len")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server's threads (-t)")
    parser.add_argument("--llama-args", default="", help="more llama-server flags, one string (shell words)")
    parser.add_argument("server_args", nargs="*", help="more gpullama-serve flags, after --")
    args = parser.parse_args()
    checkouts = [(name, Path(path).resolve()) for name, _, path in (c.partition("=") for c in args.checkout)]
    extra = args.server_args or ["--device", "cpu", "--dtype", "float32"]
    servers = [(name, lambda port, path=path: gpullama_command(path, args.model, port, extra))
               for name, path in checkouts]
    if args.llama_server:
        binary = args.llama_server.resolve()
        more = shlex.split(args.llama_args)
        servers.append(("llama.cpp", lambda port: llama_server_command(binary, args.model, port, args.ctx,
                                                                      args.threads, more)))
    results: dict[str, list[dict[str, float]]] = {name: [] for name, _ in servers}
    for i in range(args.warmup + args.rounds):
        for name, command in servers:
            run = one_start(command, args.timeout)
            if i >= args.warmup:
                results[name].append(run)
    llama = f"; llama-server -c {args.ctx} -t {args.threads} {args.llama_args}".rstrip() if args.llama_server else ""
    print(f"\nmodel: {os.path.basename(args.model)}; {cpu_name()}, {os.cpu_count()} logical cores; server flags "
          f"{' '.join(extra)}{llama}; {datetime.datetime.now():%Y-%m-%d %H:%M}; {args.warmup} uncounted start(s), "
          f"then {args.rounds} alternating rounds\n")
    columns = [("socket_s", "socket up (s)"), ("ready_s", "/health 200 (s)"), ("first_token_s", "first token (s)"),
               ("rss_mib", "RSS (MiB)"), ("peak_rss_mib", "peak RSS (MiB)")]
    print("| server | " + " | ".join(title for _, title in columns) + " |")
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

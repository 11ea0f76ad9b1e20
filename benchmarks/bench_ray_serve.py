"""Ray Serve replicas against gpullama-serve alone: aggregate tokens/s of 16 streaming clients.

    python benchmarks/bench_ray_serve.py --model smollm2-135m --clients 16 --duration 20 --rounds 2

Starts `gpullama-serve --threads 1` and, on a local Ray instance, two Serve applications of
`gpullama.integrations.ray`: one replica (route /one) and two replicas (route /two), every replica one torch
thread and one Ray CPU. Then the rounds alternate the three (server alone, 1 replica, 2 replicas), each `--clients`
clients streaming completions back to back for `--duration` seconds, so all see the same machine load. Each request
has its own prompt (a request number before a fixed text), so the prefix router balances them by load rather than
piling them on one replica. Prints the median tokens/s (min-max), the ratio to the server alone, and the resident
memory of the server and of all Ray processes.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from bench_server import Result, one_request  # benchmarks/bench_server.py
from machine import cpu_name  # benchmarks/machine.py

from gpullama.hub import resolve_model

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


async def run(url: str, clients: int, duration: float, max_tokens: int, counter) -> Result:
    result = Result(url, 0.0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients + 2)) as c:
        end = time.perf_counter() + duration
        start = time.perf_counter()

        async def worker() -> None:
            while time.perf_counter() < end:
                body = {"prompt": f"Story {next(counter)}. {PROMPT}", "max_tokens": max_tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                await one_request(c, body, result)

        await asyncio.gather(*(worker() for _ in range(clients)))
        result.elapsed = time.perf_counter() - start
    return result


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total / 2**20


def wait_ready(url: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not ready")
        time.sleep(0.5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--duration", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--port", type=int, default=18480)
    args = p.parse_args()
    import logging

    import ray
    from ray import serve

    from gpullama.integrations.ray import build_app

    model = resolve_model(args.model)
    serve_bin = Path(sys.executable).with_name("gpullama-serve")
    server = subprocess.Popen([str(serve_bin), "--model", model, "--threads", "1", "--port", str(args.port),
                               "--log-level", "warning", "--log-stats-interval", "0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    alone = f"http://127.0.0.1:{args.port}"
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False, configure_logging=False)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port + 1})
        engine = {"model": model, "threads": 1}
        serve.run(build_app(engine, num_replicas=1), name="one", route_prefix="/one")
        serve.run(build_app(engine, num_replicas=2), name="two", route_prefix="/two")
        wait_ready(alone)
        urls = {"gpullama-serve alone (1 thread)": alone,
                "Ray Serve, 1 replica (1 thread)": f"http://127.0.0.1:{args.port + 1}/one",
                "Ray Serve, 2 replicas (1 thread each)": f"http://127.0.0.1:{args.port + 1}/two"}
        for url in urls.values():
            wait_ready(url)
        ray_pids = [q.pid for q in psutil.Process().children(recursive=True) if q.pid != server.pid]
        memory = {"gpullama-serve alone (1 thread)": rss_mib([server.pid]),
                  "Ray processes (driver excluded; 3 replicas, ingresses, proxy, controller, GCS, raylet)":
                  rss_mib(ray_pids)}
        counter = itertools.count()
        for url in urls.values():  # warm-up
            asyncio.run(run(url, 2, 2.0, 8, counter))
        rates: dict[str, list[float]] = {name: [] for name in urls}
        errors = 0
        for _ in range(args.rounds):
            for name, url in urls.items():
                result = asyncio.run(run(url, args.clients, args.duration, args.max_tokens, counter))
                rates[name].append(result.tokens_per_s)
                errors += result.errors
    finally:
        serve.shutdown()
        ray.shutdown()
        server.terminate()
        server.wait()
    base = statistics.median(rates["gpullama-serve alone (1 thread)"])
    print(f"\n{cpu_name()}, {os.cpu_count()} logical cores; {datetime.date.today()}; {args.model}; {args.clients} "
          f"streaming clients, {args.max_tokens} tokens per request (ignore_eos), {args.duration:g}s per run, "
          f"median (min-max) of {args.rounds} rounds; errors: {errors}\n")
    print("| setup | generated tokens/s | / gpullama-serve alone |")
    print("| --- | ---: | ---: |")
    for name, values in rates.items():
        m = statistics.median(values)
        print(f"| {name} | {m:.1f} ({min(values):.1f}-{max(values):.1f}) | {m / base:.2f} |")
    print("\n| process | resident MiB |")
    print("| --- | ---: |")
    for name, value in memory.items():
        print(f"| {name} | {value:.0f} |")


if __name__ == "__main__":
    main()

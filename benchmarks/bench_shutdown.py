"""How `gpullama-serve` stops on SIGTERM (or SIGINT) with streams open: one table row per checkout.

    python benchmarks/bench_shutdown.py [--compare /path/to/other/checkout] [--rounds 3] [--signal INT]

Each round starts the server (the default model, float32) from each checkout in turn, opens 4 streaming
completions, waits for their first tokens, sends the signal, and measures how long until every stream ended and
until the process exited; it also records the exit status, how many streams ended with `[DONE]` and how many
log lines the stop printed with "Traceback" or "CancelledError". The table gives medians over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_round(tree: Path, sig: signal.Signals) -> dict[str, float]:
    """Start a server from `tree`, stop it with `sig` under 4 open streams; what happened."""
    port = _free_port()
    log = Path(tempfile.mkstemp(suffix=".log")[1])
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gpullama.server", "--port", str(port), "--dtype", "float32"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tree)
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{base}/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)

    async def streams() -> tuple[list[list[str]], float]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            async def stream(i: int, opened: asyncio.Event) -> list[str]:
                lines: list[str] = []
                try:
                    async with c.stream("POST", "/v1/completions", json={
                            "prompt": f"Story {i}:", "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
                        async for line in r.aiter_lines():
                            if line:
                                lines.append(line)
                                opened.set()
                except httpx.HTTPError:
                    opened.set()
                return lines

            opened = [asyncio.Event() for _ in range(4)]
            tasks = [asyncio.create_task(stream(i, e)) for i, e in enumerate(opened)]
            await asyncio.gather(*(e.wait() for e in opened))
            start = time.perf_counter()
            proc.send_signal(sig)
            ended = await asyncio.gather(*tasks)
            return ended, start

    ended, start = asyncio.run(streams())
    streams_s = time.perf_counter() - start
    returncode = proc.wait(timeout=60)
    exit_s = time.perf_counter() - start
    text = log.read_text(errors="replace")
    log.unlink()
    return {"streams_s": streams_s, "exit_s": exit_s, "returncode": returncode,
            "done": sum(bool(lines) and lines[-1] == "data: [DONE]" for lines in ended),
            "trace_lines": sum(("Traceback" in line or "CancelledError" in line) for line in text.splitlines())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compare", type=Path, default=None, help="another checkout to measure alternately")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--signal", default="TERM", choices=["TERM", "INT"])
    args = p.parse_args()
    sig = signal.Signals[f"SIG{args.signal}"]
    trees = [REPO] + ([args.compare.resolve()] if args.compare else [])
    results: dict[Path, list[dict[str, float]]] = {t: [] for t in trees}
    for _ in range(args.rounds):
        for tree in trees:
            results[tree].append(one_round(tree, sig))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import cpu_name  # benchmarks/machine.py

    print(f"{datetime.date.today()}, {cpu_name()}, SIG{args.signal} under 4 open streams, {args.rounds} rounds")
    print("| checkout | streams ended s | process exited s | exit status | streams ending with [DONE] | "
          "traceback lines |")
    print("|---|---:|---:|---|---:|---:|")
    for tree in trees:
        r = results[tree]
        print(f"| {tree.name} | {statistics.median(x['streams_s'] for x in r):.2f} | "
              f"{statistics.median(x['exit_s'] for x in r):.2f} | {sorted({int(x['returncode']) for x in r})} | "
              f"{statistics.median(x['done'] for x in r):.0f} of 4 | {statistics.median(x['trace_lines'] for x in r):.0f} |")


if __name__ == "__main__":
    main()

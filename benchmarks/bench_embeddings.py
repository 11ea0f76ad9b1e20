"""Embeddings per second for one request of 64 texts: gpullama-serve's /v1/embeddings beside llama.cpp's
``llama-server --embedding`` on the same GGUF file, rounds alternating between the two servers.

    python benchmarks/bench_embeddings.py --model ~/.cache/gpullama/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --llama-server /work/bench/llama.cpp/build/bin/llama-server --threads 2 --rounds 5

Both pool by the last token (llama.cpp: ``--pooling last``; the file has no pooling_type, so gpullama pools the last
token) and L2-normalise. One gpullama server per ``--dtypes`` entry (auto: the CPU fast path; float32: the exact
path) and llama.cpp's all run before the first round (each idle while another is measured); one warm-up request
each is not counted. Prints the machine, a markdown table (median embeddings/s with the range over
the rounds, and the request latency), and the lowest cosine similarity between the two servers' vectors of a text.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_name  # noqa: E402

SUBJECTS = ["The river", "A small robot", "My grandmother", "The old library", "A quantum computer", "The chef",
            "This spreadsheet", "The mountain village"]
PREDICATES = ["keeps a secret that nobody has guessed for years.", "runs faster when the weather turns cold.",
              "was built from parts found in a forgotten warehouse.", "explains the rules of chess to anyone who asks.",
              "smells of bread, rain and old paper in the morning.", "costs more than the whole street did in 1950.",
              "sings quietly while the city sleeps.", "has three doors, and only one of them opens."]
TEXTS = [f"{s} {p}" for s in SUBJECTS for p in PREDICATES]  # 64 texts of 10-20 tokens


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{what} exited with {process.returncode} while starting")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what} was not ready after {timeout:.0f}s")


def embed(url: str, texts: list[str]) -> tuple[float, list[np.ndarray]]:
    """(seconds, vectors) of one /v1/embeddings request."""
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/embeddings", json={"input": texts, "encoding_format": "float"}, timeout=600)
    took = time.perf_counter() - start
    r.raise_for_status()
    data = sorted(r.json()["data"], key=lambda d: d["index"])
    return took, [np.asarray(d["embedding"], dtype=np.float64) for d in data]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the GGUF file both servers load")
    parser.add_argument("--llama-server", default="/work/bench/llama.cpp/build/bin/llama-server")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtypes", default="auto,float32",
                        help="gpullama-serve --dtype of each gpullama server (auto: the CPU fast path; float32: exact)")
    args = parser.parse_args(argv)
    texts = TEXTS
    serve = shutil.which("gpullama-serve") or str(Path(sys.executable).with_name("gpullama-serve"))
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    processes: dict[str, subprocess.Popen] = {}
    urls: dict[str, str] = {}
    for dtype in args.dtypes.split(","):
        port = free_port()
        processes[f"gpullama {dtype}"] = subprocess.Popen(
            [serve, "--model", args.model, "--port", str(port), "--threads", str(args.threads), "--dtype", dtype,
             "--log-level", "warning"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        urls[f"gpullama {dtype}"] = f"http://127.0.0.1:{port}"
    port = free_port()
    processes["llama.cpp"] = subprocess.Popen(
        [args.llama_server, "-m", args.model, "--port", str(port), "--embedding", "--pooling", "last",
         "-t", str(args.threads), "-c", "8192", "-np", "64", "-b", "2048", "-ub", "2048"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    urls["llama.cpp"] = f"http://127.0.0.1:{port}"
    try:
        for name, url in urls.items():
            wait_ready(url, processes[name], name)
        vectors = {}
        for name, url in urls.items():  # warm-up, and the vectors compared below
            vectors[name] = embed(url, texts)[1]
        times: dict[str, list[float]] = {name: [] for name in urls}
        for _ in range(args.rounds):
            for name, url in urls.items():
                times[name].append(embed(url, texts)[0])
    finally:
        for process in processes.values():
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
    print(f"machine: {cpu_name()}, {args.threads} threads; model {Path(args.model).name}; {len(texts)} texts per "
          f"request, {args.rounds} rounds alternating the servers")
    print()
    print("| server | embeddings/s (median, range) | request latency s (median) | vs llama.cpp |")
    print("|---|---|---|---|")
    rate = {name: [len(texts) / t for t in ts] for name, ts in times.items()}
    base = statistics.median(rate["llama.cpp"])
    for name in urls:
        r = rate[name]
        print(f"| {name} | {statistics.median(r):.1f} ({min(r):.1f}-{max(r):.1f}) | "
              f"{statistics.median(times[name]):.3f} | {statistics.median(r) / base:.2f}x |")
    print()
    for name in urls:
        if name != "llama.cpp":
            cosines = [float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
                       for a, b in zip(vectors[name], vectors["llama.cpp"])]
            print(f"lowest cosine similarity of a text's vectors, {name} vs llama.cpp: {min(cosines):.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""End-to-end serve for the GPU check: gpullama-serve on a GGUF, `bench_server.py` at each client count, table rows.

    python benchmarks/gpu_serve.py --model /tmp/llama-3.2-1b-q4_k.gguf --format q4_k --clients 1,64 --duration 12

Starts ``python -m gpullama.server`` (what the `gpullama-serve` script runs) on `--device`, waits for /health,
checks in its log that decode steps replay CUDA graphs (on CUDA), runs `bench_server.run_level` (streaming
completions, ignore_eos, a fixed token count) at each client count, stops the server, and prints one row per
count in `gpu_check.py`'s timing table: ms/step is the median inter-token latency (one decode step under that
load), tok/s the generated tokens per second of all clients together, and the floor the file's matrix bytes
(what one decode step reads) over the copy bandwidth. The server's log and bench_server's own table go to --log.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from bench_server import percentile, run_level, table  # noqa: E402
from gpu_check import Row  # noqa: E402

from gpullama.gguf_file import read_header  # noqa: E402
from gpullama.quants import expected_nbytes  # noqa: E402

GRAPH_LOG_LINE = "captured decode graphs"  # what DecodeGraphs logs once it has captured


def decode_bytes(model: str) -> int:
    """Bytes of the matrices one decode step reads: every 2-D tensor, the embedding only when it is the tied head."""
    header = read_header(model)
    names = {t.name for t in header.tensors}
    total = 0
    for t in header.tensors:
        if len(t.shape) != 2 or (t.name == "token_embd.weight" and "output.weight" in names):
            continue
        total += expected_nbytes(t.qtype, t.shape)
    return total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="GGUF file to serve")
    p.add_argument("--format", default="q4_k", help="the file's matrix type, for the table's first column")
    p.add_argument("--device", default="cuda")
    p.add_argument("--clients", default="1,64", help="comma list of concurrent streaming clients")
    p.add_argument("--duration", type=float, default=12.0, help="seconds per client count")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--max-model-len", type=int, default=2048, help="the server's context limit (sizes its KV pool)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--startup-timeout", type=float, default=150.0, help="seconds to wait for /health")
    p.add_argument("--bandwidth", type=float, default=4.3e12, help="copy bandwidth in bytes/s for the floor")
    p.add_argument("--log", default="gpu_serve.log", help="file for the server's log and the full bench table")
    p.add_argument("--server-arg", action="append", default=[], help="extra gpullama-serve argument (repeatable)")
    args = p.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    return args


def start_server(args: argparse.Namespace, log) -> subprocess.Popen:
    """The server process, its output appended to the log."""
    cmd = [sys.executable, "-m", "gpullama.server", "--model", args.model, "--device", args.device,
           "--port", str(args.port), "--max-model-len", str(args.max_model_len),
           "--max-num-seqs", str(max(max(args.clients), 1)), *args.server_arg]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    if args.device.startswith("cuda"):
        env.pop("TRITON_INTERPRET", None)  # compiled kernels on the GPU
    print(f"$ {' '.join(cmd)}", file=log, flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)


def wait_ready(server: subprocess.Popen, url: str, timeout: float) -> None:
    """Poll /health until 200; RuntimeError when the server exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"gpullama-serve exited with status {server.returncode} before it was ready")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"gpullama-serve was not ready after {timeout:.0f} s")


def stop_server(server: subprocess.Popen) -> None:
    """SIGINT (uvicorn's graceful stop), then SIGKILL to the whole process group after 10 s."""
    if server.poll() is None:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def main(argv: list[str] | None = None) -> int:
    """Serve, benchmark, print the rows; exit 1 when the server fails, a request errs or graphs were not captured."""
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop)  # `timeout` in gpu_check.sh: still stop the server and print the rows
    weight_bytes = decode_bytes(args.model)
    floor_ms = weight_bytes / args.bandwidth * 1e3
    url = f"http://127.0.0.1:{args.port}"
    body = {"prompt": "Once upon a time, in a small village by the sea,", "max_tokens": args.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    rows: list[Row] = []
    results = []
    failed = False
    with open(args.log, "a") as log:
        server = start_server(args, log)
        try:
            t0 = time.perf_counter()
            wait_ready(server, url, args.startup_timeout)
            print(f"server ready in {time.perf_counter() - t0:.1f} s", file=log, flush=True)
            graphs = GRAPH_LOG_LINE in Path(args.log).read_text(errors="replace")
            if args.device.startswith("cuda") and not graphs:
                print("FAIL: the server did not capture decode graphs", file=log, flush=True)
                failed = True
            mode = "graphs" if graphs else "eager"
            for clients in args.clients:
                result = asyncio.run(run_level(url, {}, body, clients, args.duration))
                results.append(result)
                failed |= result.errors > 0 or result.requests == 0
                step_ms = percentile(result.itl, 50) * 1e3
                label = (f"gpullama-serve ({mode}), {clients} streaming client{'s' if clients > 1 else ''}, "
                         f"TTFT p50 {percentile(result.ttft, 50) * 1e3:.0f} ms, {result.errors} errors")
                rows.append(Row(args.format, clients, label, step_ms, weight_bytes / 1e9, floor_ms,
                                tok_s=result.tokens_per_s))
                print(rows[-1].markdown(), file=log, flush=True)
        except (Exception, KeyboardInterrupt, SystemExit) as exc:  # report, stop the server, print what was measured
            print(f"FAIL: {type(exc).__name__}: {exc}", file=log, flush=True)
            print(f"gpu_serve: {type(exc).__name__}: {exc} (log: {args.log})", file=sys.stderr)
            failed = True
        finally:
            stop_server(server)
            if results:
                print(f"\n{table(results)}\n", file=log, flush=True)
    for row in rows:
        print(row.markdown(), flush=True)
    return 1 if failed else 0


def _stop(signum: int, frame: object) -> None:
    """SIGTERM handler: unwind to `main`, which stops the server and prints the rows."""
    raise SystemExit(f"signal {signum}")


if __name__ == "__main__":
    sys.exit(main())

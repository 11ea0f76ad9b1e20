"""Benchmark a running gpullama-serve: N concurrent streaming clients for a fixed time; optional library baseline.

    python benchmarks/bench_server.py --url http://127.0.0.1:8080 --concurrency 1,4,8 --duration 30
    python benchmarks/bench_server.py --concurrency 1 --compare-library smollm2-135m --dtype auto

Prints a markdown table (requests/s, generated tokens/s, time to first token and inter-token latency p50/p99).
``--compare-library MODEL`` then loads the same model in this process and alternates one single-client server
request with one ``LLM.stream`` call on the same prompt and token count (so both see the same machine load), and
prints the overhead ratio: server streaming tokens/s over the library's tokens/s (the issue asks for >= 0.90). Every request uses ``ignore_eos`` and a fixed
``max_tokens``, so both sides generate the same number of tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import dataclass, field

import httpx
import orjson


@dataclass
class Result:
    """What one concurrency level measured."""

    label: str
    elapsed: float
    requests: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: int = 0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second over the whole run."""
        return self.tokens / self.elapsed if self.elapsed else 0.0


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation; NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


async def one_request(client: httpx.AsyncClient, body: dict, result: Result) -> None:
    """Stream one completion, recording TTFT, the gaps between content chunks and the usage's token count."""
    start = time.perf_counter()
    last = None
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            result.errors += 1
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["text"]:
                now = time.perf_counter()
                if last is None:
                    result.ttft.append(now - start)
                else:
                    result.itl.append(now - last)
                last = now
    result.requests += 1
    result.tokens += tokens


async def run_level(url: str, headers: dict, body: dict, concurrency: int, duration: float) -> Result:
    """``concurrency`` clients each sending requests back to back until ``duration`` seconds have passed."""
    result = Result(f"server, {concurrency} client{'s' if concurrency > 1 else ''}", 0.0)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:
        await one_request(client, {**body, "max_tokens": 4}, Result("warm-up", 0.0))
        start = time.perf_counter()
        end = start + duration

        async def worker() -> None:
            while time.perf_counter() < end:
                await one_request(client, body, result)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        result.elapsed = time.perf_counter() - start
    return result


async def run_interleaved(url: str, headers: dict, body: dict, model: str, device: str, dtype: str,
                          duration: float) -> tuple[Result, Result]:
    """Single-client server streaming and the library's ``LLM.stream`` on the same prompt, one request of each in
    turn for ``duration`` seconds, so both see the same machine load (the server is idle during library runs)."""
    from gpullama import LLM, SamplingParams

    llm = LLM(model, device=device, dtype=dtype)
    params = SamplingParams(max_tokens=body["max_tokens"], temperature=0, ignore_eos=True)
    for _ in llm.stream(body["prompt"], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)):
        pass
    server = Result("server, 1 client (interleaved)", 0.0)
    library = Result("library LLM.stream, 1 client (interleaved)", 0.0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:
        await one_request(client, {**body, "max_tokens": 4}, Result("warm-up", 0.0))
        end = time.perf_counter() + duration
        while time.perf_counter() < end or not library.requests:
            t0 = time.perf_counter()
            await one_request(client, body, server)
            server.elapsed += time.perf_counter() - t0
            t0 = time.perf_counter()
            last = None
            for _ in llm.stream(body["prompt"], params):
                now = time.perf_counter()
                if last is None:
                    library.ttft.append(now - t0)
                else:
                    library.itl.append(now - last)
                last = now
            library.elapsed += time.perf_counter() - t0
            library.requests += 1
            library.tokens += body["max_tokens"]
    return server, library


def table(results: list[Result]) -> str:
    """The markdown table of all runs."""
    rows = ["| run | requests | requests/s | gen tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | errors |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rows.append(f"| {r.label} | {r.requests} | {r.requests / r.elapsed:.2f} | {r.tokens_per_s:.1f} | "
                    f"{percentile(r.ttft, 50) * 1e3:.1f} | {percentile(r.ttft, 99) * 1e3:.1f} | "
                    f"{percentile(r.itl, 50) * 1e3:.2f} | {percentile(r.itl, 99) * 1e3:.2f} | {r.errors} |")
    return "\n".join(rows)


def main() -> None:
    """Parse flags, run every concurrency level (and the library baseline), print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL")
    p.add_argument("--api-key", default=None, help="sent as a Bearer token")
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated numbers of concurrent clients")
    p.add_argument("--duration", type=float, default=30.0, help="seconds per concurrency level")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request (ignore_eos)")
    p.add_argument("--prompt", default="Once upon a time, in a small village by the sea,")
    p.add_argument("--compare-library", metavar="MODEL", default=None,
                   help="also time LLM.stream in-process on this model (path or alias) for the overhead ratio")
    p.add_argument("--device", default="auto", help="device for --compare-library (match the server's)")
    p.add_argument("--dtype", default="auto", help="dtype for --compare-library (match the server's)")
    args = p.parse_args()

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    body = {"prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    results = [asyncio.run(run_level(args.url, headers, body, c, args.duration)) for c in levels]
    if args.compare_library:
        results += asyncio.run(run_interleaved(args.url, headers, body, args.compare_library, args.device,
                                               args.dtype, args.duration))
    print(f"\nprompt {args.prompt!r}, {args.max_tokens} tokens per request, {args.duration:.0f}s per run\n")
    print(table(results))
    if args.compare_library:
        single = results[-2]
        ratio = single.tokens_per_s / results[-1].tokens_per_s
        print(f"\nsingle-client server streaming / library LLM.stream tokens/s: {ratio:.3f} "
              f"({single.tokens_per_s:.1f} / {results[-1].tokens_per_s:.1f}); target >= 0.90")


if __name__ == "__main__":
    main()

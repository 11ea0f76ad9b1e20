"""`gpullama bench`: prefill and decode speed as llama.cpp's llama-bench prints it (pp and tg rows, tokens/s).

Each test runs `repeats` times after one warm-up; the table gives the mean and standard deviation of the tokens/s,
one row per test, with the model (labelled by its GGUF file type, ``Q4_K - Medium``), its file size, parameter
count, backend and threads as llama-bench's columns. A depth d (``-d``, llama-bench's) puts d tokens of context
before each test: they are prefilled once (the warm-up) and served from the prefix cache, so a row times its own
tokens only (``tg128 @ d2048``: 128 tokens generated after 2048). The tg rows also give the share of the machine's
memory bandwidth they use: the bytes one token reads (the file's matrices, the whole output head, the KV cache of
its context) times tokens/s, over the read bandwidth measured in the same run (`read_bandwidth`, a streaming read
by the same threads). `benchmarks/bench_decode.py` puts the
same rows beside llama.cpp's and transformers'.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpullama.engine.args import EngineArgs
from gpullama.llm import LLM, resident_bytes
from gpullama.sampling_params import SamplingParams


class PpTg:
    """A model loaded to time pp (prefill `n` prompt tokens, sample one) and tg (generate `n` tokens after a
    one-token prompt), each after `depth` tokens of context: batch of one, greedy, end-of-sequence ignored. The
    prefix cache serves the depth's context (pp prompts are fresh tokens every call: never a cache hit)."""

    def __init__(self, model: str, dtype: str, device: str, n_prompt: int, n_gen: int, threads: int | None,
                 on_progress: Callable[[str], None] | None = None, n_depth: int = 0, **engine_args) -> None:
        before = resident_bytes()
        args = EngineArgs(model=model, device=device, dtype=dtype, threads=threads,
                          max_model_len=n_depth + max(n_prompt, 1) + n_gen + 16, max_num_seqs=1,
                          max_num_batched_tokens=max(512, n_prompt), enable_prefix_caching=True, **engine_args)
        self.llm = LLM.from_engine_args(args, on_progress)
        self.loaded_bytes = resident_bytes() - before  # resident memory the load added
        self.label = f"gpullama {dtype} ({self.llm.model.ops.mode})"
        vocab = self.llm.config.vocab_size
        self._low = min(100, vocab - 1)  # past the special tokens at the start of most vocabularies
        self._tokens = torch.Generator().manual_seed(0)
        self.prompt = self._fresh(max(n_prompt, 1))
        self.context = self._fresh(n_depth)  # the depth's tokens

    def _fresh(self, n: int) -> list[int]:
        """`n` random token ids, new each call."""
        return torch.randint(self._low, self.llm.config.vocab_size, (n,), generator=self._tokens).tolist()

    def _settle(self, depth: int) -> None:
        """The depth's context into the prefix cache, untimed (llama-bench fills its -d context before timing too):
        the tests between two at this depth may have evicted some of its blocks, whose recompute would count."""
        if depth:
            self.llm.generate([self.context[:depth]], SamplingParams(max_tokens=1, temperature=0))

    def pp(self, n: int, depth: int = 0) -> float:
        """Seconds to prefill `n` prompt tokens (and sample one) after `depth` tokens of context."""
        prompt = self.context[:depth] + self._fresh(n)
        self._settle(depth)
        start = time.perf_counter()
        self.llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        return time.perf_counter() - start

    def tg(self, n: int, depth: int = 0) -> float:
        """Seconds to generate `n` tokens after a one-token prompt that follows `depth` tokens of context."""
        prompt = self.context[:depth] + self.prompt[:1]
        self._settle(depth)
        start = time.perf_counter()
        self.llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    def bytes_per_token(self, n: int, depth: int) -> float:
        """Bytes one of `n` generated tokens after `depth` reads: the file's matrices (the whole output head, one
        embedding row, the active experts' share) and the KV cache of its context (on average depth + n / 2)."""
        return decode_weight_bytes(self.llm.path) + self.kv_bytes_per_position() * (depth + n / 2)

    def kv_bytes_per_position(self) -> float:
        """KV cache bytes of one context position (k and v of every layer), in the pool's format."""
        runner = self.llm.engine.runner
        return runner.kv_cache_bytes / ((runner.num_blocks + 1) * self.llm.args.block_size)


def decode_weight_bytes(path: str) -> int:
    """Weight bytes one decode token reads from the file: every matrix (experts: the active share), one row of the
    embedding table, and the table in full when it is also the output head (no ``output.weight``)."""
    from gpullama.gguf_file import model_size, read_header

    return model_size(read_header(path)).active_bytes


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 5, threads: int | None = None) -> float:
    """The machine's memory read bandwidth in bytes/s, as STREAM measures it: `threads` (default torch's) threads
    read a float32 buffer of `nbytes` (far larger than the caches) once each time, in contiguous shares, with
    vector loads (`cpu_native.read_sum`; `torch.sum` where the C kernels are not built); the best of `repeats`
    after a first touch. A decode step reads every weight once, so this is its limit. The buffer is on 2 MiB pages
    where Linux gives them (`cpu_native.advise_huge_pages`): on 4 KiB pages this loop, which has no software
    prefetch, waits on a TLB miss a page, and read 15% slower on a VM than on 2 MiB pages, where it matches the
    decode matmuls' own stream (docs/performance.md)."""
    from gpullama.kernels import cpu_native

    x = torch.empty(nbytes // 4)
    cpu_native.advise_huge_pages(x)
    x.fill_(1.0)
    read = cpu_native.read_sum if cpu_native.library() is not None else (lambda t, n: float(t.sum()))
    read(x, threads)  # first touch
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        read(x, threads)
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best


def copy_bandwidth(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """The machine's memory bandwidth in bytes/s: a torch copy of `nbytes` to another buffer (read and write, all
    threads), the best of `repeats`."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


@dataclass
class Row:
    """One test's result: its name (``pp512``, ``tg128 @ d2048``), tokens/s of every repetition, and for tg rows
    the bytes one token reads."""

    test: str
    tokens_per_s: list[float]
    bytes_per_token: float | None = None

    def cell(self) -> str:
        """``mean ± sd`` as llama-bench writes it."""
        mean = statistics.fmean(self.tokens_per_s)
        sd = statistics.stdev(self.tokens_per_s) if len(self.tokens_per_s) > 1 else 0.0
        return f"{mean:.2f} ± {sd:.2f}"


def run(bench: PpTg, n_prompts: list[int], n_gens: list[int], repeats: int, depths: list[int] = (0,)) -> list[Row]:
    """Time every pp and tg test at every depth `repeats` times after one warm-up of each (which also prefills the
    depth's context into the prefix cache)."""
    tests = [("pp", n) for n in n_prompts if n > 0] + [("tg", n) for n in n_gens if n > 0]
    rows = []
    for depth in depths:
        for kind, n in tests:
            timed = getattr(bench, kind)
            timed(n, depth)  # warm-up: first-call allocations, kernel selection, the depth's context
            name = f"{kind}{n}" + (f" @ d{depth}" if depth else "")
            per_token = bench.bytes_per_token(n, depth) if kind == "tg" else None
            rows.append(Row(name, [n / timed(n, depth) for _ in range(repeats)], per_token))
    return rows


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _params(count: int) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.2f} M"


def table(bench: PpTg, rows: list[Row], bandwidth: float | None = None) -> str:
    """The markdown table: model, size, params, backend, threads, test, t/s, and with `bandwidth` (bytes/s) the
    share of it each tg row's reads take."""
    llm = bench.llm
    count, size_label, file_type = _header(llm.path)
    model = f"{llm.config.architecture} {size_label} {file_type}"
    backend = f"{llm.device.type} ({llm.model.ops.name}, {llm.model.ops.mode}; KV {llm.engine.runner.kv_cache_format})"
    cols = ["model", "size", "params", "backend", "threads", "test", "t/s"] + (["% read BW"] if bandwidth else [])
    lines = ["| " + " | ".join(cols) + " |", "| --- | ---: | ---: | --- | ---: | ---: | ---: |"
             + (" ---: |" if bandwidth else "")]
    for row in rows:
        cells = [model, _size(os.path.getsize(llm.path)), _params(count), backend, str(torch.get_num_threads()),
                 row.test, row.cell()]
        if bandwidth:
            used = statistics.fmean(row.tokens_per_s) * row.bytes_per_token if row.bytes_per_token else None
            cells.append(f"{100 * used / bandwidth:.0f}%" if used else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _header(path: str) -> tuple[int, str, str]:
    """Parameter count, a size label such as ``135M``, and the file type as llama.cpp names it."""
    from gpullama.gguf_file import file_type_name, read_header

    header = read_header(path)
    count = sum(math.prod(t.shape) for t in header.tensors)
    label = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"
    return count, label, file_type_name(header)

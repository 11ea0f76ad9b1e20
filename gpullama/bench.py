"""`gpullama bench`: prefill and decode speed as llama.cpp's llama-bench prints it (pp and tg rows, tokens/s).

Each test runs `repeats` times after one warm-up; the table gives the mean and standard deviation of the tokens/s,
one row per test, with the model, its file size, parameter count, backend and threads as llama-bench's columns.
`benchmarks/bench_decode.py` puts the same rows beside llama.cpp's and transformers'.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpullama.engine.args import EngineArgs
from gpullama.llm import LLM, resident_bytes
from gpullama.sampling_params import SamplingParams


class PpTg:
    """A model loaded to time pp (prefill `n` prompt tokens, sample one) and tg (generate `n` tokens after a
    one-token prompt): batch of one, prefix caching off, greedy, end-of-sequence ignored."""

    def __init__(self, model: str, dtype: str, device: str, n_prompt: int, n_gen: int, threads: int | None,
                 on_progress: Callable[[str], None] | None = None, **engine_args) -> None:
        before = resident_bytes()
        args = EngineArgs(model=model, device=device, dtype=dtype, threads=threads,
                          max_model_len=n_prompt + n_gen + 16, max_num_seqs=1,
                          max_num_batched_tokens=max(512, n_prompt), enable_prefix_caching=False, **engine_args)
        self.llm = LLM.from_engine_args(args, on_progress)
        self.loaded_bytes = resident_bytes() - before  # resident memory the load added
        self.label = f"gpullama {dtype} ({self.llm.model.ops.mode})"
        vocab = self.llm.config.vocab_size
        low = min(100, vocab - 1)  # past the special tokens at the start of most vocabularies
        self.prompt = torch.randint(low, vocab, (max(n_prompt, 1),), generator=torch.Generator().manual_seed(0)).tolist()

    def pp(self, n: int) -> float:
        """Seconds to prefill `n` prompt tokens (and sample one)."""
        start = time.perf_counter()
        self.llm.generate([self.prompt[:n]], SamplingParams(max_tokens=1, temperature=0))
        return time.perf_counter() - start

    def tg(self, n: int) -> float:
        """Seconds to generate `n` tokens after a one-token prompt."""
        start = time.perf_counter()
        self.llm.generate([self.prompt[:1]], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return time.perf_counter() - start


@dataclass
class Row:
    """One test's result: its name (``pp512``, ``tg128``) and tokens/s of every repetition."""

    test: str
    tokens_per_s: list[float]

    def cell(self) -> str:
        """``mean ± sd`` as llama-bench writes it."""
        mean = statistics.fmean(self.tokens_per_s)
        sd = statistics.stdev(self.tokens_per_s) if len(self.tokens_per_s) > 1 else 0.0
        return f"{mean:.2f} ± {sd:.2f}"


def run(bench: PpTg, n_prompts: list[int], n_gens: list[int], repeats: int) -> list[Row]:
    """Time every pp and tg test `repeats` times after one warm-up of each."""
    tests = [("pp", n) for n in n_prompts if n > 0] + [("tg", n) for n in n_gens if n > 0]
    rows = []
    for kind, n in tests:
        timed = getattr(bench, kind)
        timed(n)  # warm-up: first-call allocations and kernel selection
        rows.append(Row(f"{kind}{n}", [n / timed(n) for _ in range(repeats)]))
    return rows


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


def _params(count: int) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.2f} M"


def table(bench: PpTg, rows: list[Row]) -> str:
    """The markdown table: model, size, params, backend, threads, test, t/s."""
    llm = bench.llm
    count, size_label, weight_type = _header(llm.path)
    model = f"{llm.config.architecture} {size_label} {weight_type}"
    backend = f"{llm.device.type} ({llm.model.ops.name}, {llm.model.ops.mode})"
    cols = ["model", "size", "params", "backend", "threads", "test", "t/s"]
    lines = ["| " + " | ".join(cols) + " |", "| --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for row in rows:
        cells = [model, _size(os.path.getsize(llm.path)), _params(count), backend, str(torch.get_num_threads()),
                 row.test, row.cell()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _header(path: str) -> tuple[int, str, str]:
    """Parameter count, a size label such as ``135M``, and the most common matrix type of a GGUF file."""
    from gpullama.gguf_file import read_header

    header = read_header(path)
    count = sum(math.prod(t.shape) for t in header.tensors)
    matrices = Counter(t.qtype.name for t in header.tensors if len(t.shape) == 2)
    label = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"
    return count, label, matrices.most_common(1)[0][0] if matrices else "?"

"""The KV pool on the CPU: sized by the limits it can serve, resident only as requests fill it, logged at load."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

LOAD = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
import torch
from gpullama import LLM, SamplingParams
from gpullama.llm import resident_bytes
before = resident_bytes()
llm = LLM(sys.argv[1], device="cpu", dtype="float32", **eval(sys.argv[2]))
loaded = resident_bytes()
runner = llm.engine.runner
out = llm.generate("hello", SamplingParams(max_tokens=int(sys.argv[3]), temperature=0, ignore_eos=True))[0]
used = resident_bytes()
print(runner.kv_cache_bytes, loaded - before, used - loaded, llm.engine.kv_capacity_tokens, len(out.token_ids))
"""


def load(model: Path, kwargs: dict, max_tokens: int = 4) -> tuple[list[int], str]:
    """Load `model` in a fresh process; its KV pool bytes, RSS added by the load and by one generation, the pool's
    tokens and the tokens generated, with the process's log."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", LOAD, str(model), repr(kwargs), str(max_tokens)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    return [int(v) for v in result.stdout.split()], result.stderr


def test_cpu_pool_costs_resident_memory_only_as_it_is_used(tiny_model) -> None:
    path = tiny_model("llama", "F32").path
    (pool, load_rss, use_rss, tokens, generated), log = load(path, {"kv_cache_memory": 512 * 2**20})
    assert pool >= 512 * 2**20 * 0.99  # the whole pool is reserved ...
    assert load_rss < 128 * 2**20, f"loading took {load_rss / 2**20:.0f} MiB resident"  # ... but not touched
    assert use_rss < 64 * 2**20 and generated == 4
    assert f"KV cache: {tokens} tokens reserved" in log and "sized by kv_cache_memory" in log, log


def test_default_pool_is_what_the_limits_can_use_and_the_log_says_so(tiny_model) -> None:
    path = tiny_model("llama", "F32").path
    (pool, _, _, tokens, _), log = load(path, {"max_num_seqs": 3, "max_model_len": 100, "block_size": 16})
    assert tokens == 3 * 7 * 16  # 3 sequences of ceil(100 / 16) = 7 blocks, far below the 1 GiB default
    assert f"KV cache: {tokens} tokens reserved" in log and "sized by max_num_seqs 3 x max_model_len 100" in log, log

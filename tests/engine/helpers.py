"""Helpers for the engine tests: engines sharing one loaded model, run-to-completion, solo references, pool checks."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

import torch

from gpullama import LLM
from gpullama.engine.args import EngineConfig, SpeculativeConfig
from gpullama.engine.block_manager import BlockManager
from gpullama.engine.llm_engine import LLMEngine
from gpullama.engine.sequence import Sequence
from gpullama.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)

# Plain English used to build real-text prompts for the real model (written for these tests).
PASSAGE = (
    "The old lighthouse stood at the end of a narrow spit of rock, and for more than a century its lamp had "
    "turned every night without fail. The keepers who lived there kept careful logs of the weather, the ships "
    "that passed, and the small repairs that a building facing the open sea always needs. In winter the waves "
    "climbed the walls and salt crusted the windows; in summer the gulls nested in every crack, and children "
    "from the village rowed out to watch the great lens being polished. When the light was finally automated, "
    "the last keeper packed his books and his barometer into a wooden crate and walked back along the causeway "
    "at low tide. He said later that the silence of his first night on land was louder than any storm. The "
    "village council turned the keeper's cottage into a small museum, with the logbooks in glass cases and a "
    "map showing every wreck along that coast since records began. Visitors read the entries slowly: a schooner "
    "aground in fog, a fishing boat saved by a rope thrown from the rocks, a calm week in August when nothing at "
    "all happened and the keeper wrote only that the sea was like glass. Scientists later used the same logs to "
    "study how the climate of the region had changed, because few other places had such long and steady "
    "records of wind, rain and temperature taken at the same hour every day by people who had nothing better to "
    "do than to be exact. The lamp itself still turns, now watched by a computer in a town forty miles away, "
    "and on clear nights its beam sweeps across the water exactly as it did when the first keeper lit it."
)

_ids = itertools.count()


def make_engine(
    llm: LLM,
    *,
    num_blocks: int | None = None,
    block_size: int = 16,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
    enable_prefix_caching: bool = True,
    max_model_len: int | None = None,
    static_decode: bool = False,
    speculative: SpeculativeConfig | None = None,
) -> LLMEngine:
    """A fresh engine (its own KV pool and scheduler) over `llm`'s already loaded model and tokenizer;
    `static_decode` runs decode steps on the model runner's padded static buffers (as CUDA graphs do);
    `speculative` turns on n-gram speculation."""
    max_model_len = max_model_len or llm.max_model_len
    if num_blocks is None:
        num_blocks = max_num_seqs * -(-max_model_len // block_size)
    config = EngineConfig(
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
        static_decode=static_decode,
        speculative=speculative,
    )
    return LLMEngine(llm.model, llm.tokenizer, config)


def run_requests(
    engine: LLMEngine, prompts: Seq[list[int]], params: SamplingParams | Seq[SamplingParams], max_steps: int = 10_000
) -> list[Sequence]:
    """Queue every prompt (with its own params when a list is given) and step the engine until all finish."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    seqs = [engine.add_request(f"req-{next(_ids)}", list(p), sp) for p, sp in zip(prompts, params, strict=True)]
    for _ in range(max_steps):
        if not engine.has_work():
            break
        engine.step()
    else:
        raise AssertionError(f"the engine did not finish {len(seqs)} requests in {max_steps} steps")
    assert all(seq.is_finished for seq in seqs)
    return seqs


def solo_runs(llm: LLM, prompts: Seq[list[int]], params: SamplingParams | Seq[SamplingParams]) -> list[Sequence]:
    """The reference: each request run alone, on its own fresh engine with prefix caching off (no chunking)."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    out = []
    for prompt, sp in zip(prompts, params, strict=True):
        engine = make_engine(llm, max_num_seqs=1, enable_prefix_caching=False, max_num_batched_tokens=4096)
        out.extend(run_requests(engine, [prompt], sp))
    return out


def random_prompt(gen: torch.Generator, length: int, vocab: int, bos: int | None = None) -> list[int]:
    """`length` random ordinary token ids (below `vocab`), starting with `bos` when given."""
    ids = torch.randint(0, vocab, (length,), generator=gen).tolist()
    if bos is not None:
        ids[0] = bos
    return ids


def assert_pool_idle(bm: BlockManager) -> None:
    """Every block is free and unreferenced, and the prefix cache's hash map agrees with the blocks."""
    assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} blocks still held"
    assert sorted(bm.free) == list(range(bm.num_blocks)), "the free list has duplicates or strangers"
    held = [b.block_id for b in bm.blocks if b.ref_count != 0]
    assert not held, f"blocks with a non-zero reference count while idle: {held[:10]}"
    assert len(bm.cached) <= bm.num_blocks
    for h, block_id in bm.cached.items():
        block = bm.blocks[block_id]
        assert block.hash == h, f"cache entry for block {block_id} has hash {h} but the block says {block.hash}"
        assert len(block.token_ids) == bm.block_size, f"cached block {block_id} is not full"
    assert len(set(bm.cached.values())) == len(bm.cached), "two hashes point at one block"

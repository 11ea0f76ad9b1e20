"""Recurrent-state checkpoints without a model: the LRU index, prefix hits cut back to a saved boundary, the prefill
chunk that ends at the prompt's last block boundary, and the loads a hit schedules. (With models: the hybrid tests
of tests/test_converted_models.py.)"""

from __future__ import annotations

from gpullama.engine.block_manager import BlockManager
from gpullama.engine.scheduler import Scheduler
from gpullama.engine.sequence import Sequence
from gpullama.engine.state_checkpoints import StateCheckpoints, last_prompt_boundary
from gpullama.sampling_params import SamplingParams
from tests.engine.test_scheduler import finish_step, plan

BS = 4


def prompt_seq(name: str, ids: list[int]) -> Sequence:
    return Sequence(name, ids, SamplingParams(max_tokens=8), 8)


def test_index_evicts_the_least_recently_used_and_reuses_dropped_slots() -> None:
    cps = StateCheckpoints(2)
    assert cps.reserve(10) == 0 and cps.reserve(20) == 1
    assert cps.reserve(10) is None  # already kept: only marked as used, so 20 is now the oldest
    assert cps.reserve(30) == 1 and 20 not in cps and cps.lookup(30) == 1
    assert cps.lookup(10) == 0  # used: 30 is the oldest
    assert cps.reserve(40) == 1 and 30 not in cps
    cps.drop(10)
    assert 10 not in cps and cps.reserve(50) == 0 and len(cps) == 2
    assert [last_prompt_boundary(n, 16) for n in (1, 16, 17, 33, 45)] == [0, 0, 16, 32, 32]


def test_prefix_hit_ends_at_the_last_boundary_with_saved_states() -> None:
    shared = list(range(100, 112))  # three full blocks
    cps = StateCheckpoints(4)
    bm = BlockManager(num_blocks=16, block_size=BS, state_checkpoints=cps)
    first = prompt_seq("a", shared + [1])
    assert bm.allocate(first, 13)
    first.num_computed_tokens = 13
    bm.commit_full_blocks(first, 0)
    hashes = [bm.blocks[b].hash for b in first.block_table[:3]]
    bm.free_sequence(first)

    def hit(name: str) -> int:
        s = prompt_seq(name, shared + [2, 3])
        assert bm.allocate(s, 14)
        cached = s.num_computed_tokens
        bm.free_sequence(s)
        return cached

    assert hit("none saved") == 0  # the KV blocks alone are not enough
    cps.reserve(hashes[0])
    assert hit("one saved") == 4
    cps.reserve(hashes[2])
    assert hit("last saved") == 12  # the longest boundary with both
    cps.drop(hashes[2])
    assert hit("dropped") == 4


def test_prefill_ends_at_the_prompts_last_boundary_and_a_hit_loads_its_checkpoint() -> None:
    cps = StateCheckpoints(4)
    bm = BlockManager(num_blocks=32, block_size=BS, state_checkpoints=cps)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100)
    prompt = list(range(200, 211))  # 11 tokens: the last boundary inside it is 8
    a = prompt_seq("a", prompt)
    sched.add(a)
    batch = sched.schedule()
    assert plan(batch) == [("a", 8)] and not batch.sampling and not batch.state_loads
    finish_step(batch, bm)
    saved = cps.reserve(bm.blocks[a.block_table[1]].hash)  # what the engine saves after this step
    assert plan(sched.schedule()) == [("a", 3)]  # the rest of the prompt, sampling
    b = prompt_seq("b", prompt + [5, 6])
    sched.add(b)
    batch = sched.schedule()
    assert b.num_cached_tokens == 8 and batch.state_loads == [(saved, b.state_slot)]
    assert ("b", 4) in plan(batch)  # up to its own last boundary, 12
    # without checkpoints (a model without recurrent layers) the prefill is not cut
    plain = Scheduler(BlockManager(num_blocks=32, block_size=BS), max_num_seqs=4, max_num_batched_tokens=100)
    plain.add(prompt_seq("c", prompt))
    assert plan(plain.schedule()) == [("c", 11)]

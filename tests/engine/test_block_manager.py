"""The block manager without a model: allocation, reference counts, the prefix cache and its LRU reuse."""

from __future__ import annotations

from gpullama.engine.block_manager import BlockManager
from gpullama.engine.sequence import Sequence
from gpullama.sampling_params import SamplingParams
from tests.engine.helpers import assert_pool_idle

BS = 4  # tokens per block in these tests


def seq(name: str, tokens: list[int]) -> Sequence:
    """A waiting sequence over `tokens` (its own max_tokens of 8)."""
    return Sequence(name, tokens, SamplingParams(max_tokens=8), max_tokens=8)


def compute_all(bm: BlockManager, s: Sequence) -> None:
    """What the engine does after a step that computed every token of `s`: count them, register full blocks."""
    old = s.num_computed_tokens
    s.num_computed_tokens = s.num_tokens
    bm.commit_full_blocks(s, old)


def test_fresh_allocation_takes_ceil_blocks_and_refuses_without_side_effects() -> None:
    bm = BlockManager(num_blocks=5, block_size=BS)
    a = seq("a", list(range(10)))  # 10 tokens: 3 blocks
    assert bm.allocate(a, 10)
    assert len(a.block_table) == 3 and len(set(a.block_table)) == 3 and bm.num_free_blocks == 2
    b = seq("b", list(range(100, 109)))  # 9 tokens: 3 blocks, only 2 free
    assert not bm.allocate(b, 9)
    assert b.block_table == [] and bm.num_free_blocks == 2
    assert bm.allocate(b, 8)  # a budget of 8 tokens needs only 2 blocks
    assert len(b.block_table) == 2 and bm.num_free_blocks == 0
    bm.free_sequence(a)
    bm.free_sequence(b)
    assert_pool_idle(bm)


def test_shared_prefix_is_served_from_the_cache_except_the_last_token() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks
    a = seq("a", prefix + [9])
    assert bm.allocate(a, a.num_tokens)
    compute_all(bm, a)
    b = seq("b", prefix + [42, 43])
    assert bm.allocate(b, b.num_tokens)
    assert b.num_computed_tokens == 8 and b.block_table[:2] == a.block_table[:2]
    assert [bm.blocks[i].ref_count for i in a.block_table[:2]] == [2, 2]
    assert b.block_table[2] != a.block_table[2]
    # exactly the two blocks as the whole prompt: the last token must be computed, so only one block is reused
    c = seq("c", list(prefix))
    assert bm.allocate(c, c.num_tokens)
    assert c.num_computed_tokens == 4 and c.block_table[0] == a.block_table[0] and c.block_table[1] != a.block_table[1]
    for s in (a, b, c):
        bm.free_sequence(s)
    assert_pool_idle(bm)


def test_a_block_is_only_reused_after_the_same_preceding_block() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate(a, a.num_tokens)
    compute_all(bm, a)
    b = seq("b", [0, 0, 0, 0, 5, 6, 7, 8, 9])  # second block equal to a's, first block different
    assert bm.allocate(b, b.num_tokens)
    assert b.num_computed_tokens == 0 and not set(b.block_table) & set(a.block_table)
    assert bm.allocate(seq("c", [1, 2, 3, 4, 5, 6, 7, 8, 1]), 9)  # a's chain itself still hits
    assert bm.cached and all(bm.blocks[i].ref_count == 1 for i in b.block_table)


def test_freed_blocks_stay_findable_until_reused_oldest_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # 3 blocks, two of them full
    assert bm.allocate(a, 9)
    compute_all(bm, a)
    first, second, third = a.block_table
    bm.free_sequence(a)
    assert bm.num_free_blocks == 4
    # freed tail first: the partial third block, then the second, then the first go to the end of the LRU list
    assert list(bm.free)[-3:] == [third, second, first]
    again = seq("again", [1, 2, 3, 4, 5, 6, 7, 8, 10])
    assert bm.allocate(again, 9)
    assert again.num_computed_tokens == 8 and again.block_table[:2] == [first, second]
    bm.free_sequence(again)
    # a request that needs every block takes the cached ones too: their keys are dropped and nothing hits after
    big = seq("big", list(range(50, 66)))
    assert bm.allocate(big, 16)
    assert big.num_computed_tokens == 0 and sorted(big.block_table) == [0, 1, 2, 3]
    assert not bm.cached
    bm.free_sequence(big)
    assert_pool_idle(bm)


def test_prefix_caching_off_never_shares() -> None:
    bm = BlockManager(num_blocks=8, block_size=BS, enable_prefix_caching=False)
    a = seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate(a, 9)
    compute_all(bm, a)
    b = seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bm.allocate(b, 9)
    assert b.num_computed_tokens == 0 and not set(a.block_table) & set(b.block_table) and not bm.cached


def test_blocks_after_a_recomputed_copy_stay_findable() -> None:
    """Two sequences compute the same leading blocks at once (neither could hit the other's): the second's copies
    are not findable, but the block after them is, behind the first's chain (a hybrid model's hit cut back to a
    state checkpoint recomputes such copies every time)."""
    bm = BlockManager(num_blocks=16, block_size=BS)
    shared = list(range(1, 13))  # three full blocks
    a, b = seq("a", shared + [50]), seq("b", shared + [60, 61, 62, 63, 64])
    assert bm.allocate(a, a.num_tokens) and bm.allocate(b, b.num_tokens)
    assert b.num_computed_tokens == 0
    compute_all(bm, a)
    compute_all(bm, b)
    c = seq("c", shared + [60, 61, 62, 63, 70])
    assert bm.allocate(c, c.num_tokens)
    assert c.num_computed_tokens == 16
    assert c.block_table[:4] == a.block_table[:3] + [b.block_table[3]]
    d = seq("d", list(range(1, 9)) + [99, 98, 97, 96, 60, 61, 62, 63, 70])  # b's fourth block after other tokens
    assert bm.allocate(d, d.num_tokens) and d.num_computed_tokens == 8
    for s in (a, b, c, d):
        bm.free_sequence(s)
    assert_pool_idle(bm)

"""The scheduler without a model: token budget, chunked prefill, batch size cap, preemption, the batch's kind."""

from __future__ import annotations

from gpullama.engine.block_manager import BlockManager
from gpullama.engine.scheduler import ScheduledBatch, Scheduler
from gpullama.engine.sequence import Sequence, SequenceStatus
from gpullama.sampling_params import SamplingParams
from tests.engine.helpers import assert_pool_idle

BS = 4


def seq(name: str, num_prompt: int, max_tokens: int = 100) -> Sequence:
    """A sequence with `num_prompt` distinct prompt tokens (no prefix sharing between sequences)."""
    base = 1000 * (1 + sum(map(ord, name)))
    return Sequence(name, list(range(base, base + num_prompt)), SamplingParams(max_tokens=max_tokens), max_tokens)


def finish_step(batch: ScheduledBatch, bm: BlockManager, next_token: int = 7) -> None:
    """What the engine does after the forward: count the computed tokens, give each sampling sequence a token."""
    for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        old = s.num_computed_tokens
        s.num_computed_tokens += n
        bm.commit_full_blocks(s, old)
    for s in batch.sampling:
        s.append_token(next_token)


def plan(batch: ScheduledBatch) -> list[tuple[str, int]]:
    return [(s.request_id, n) for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]


def test_long_prompt_is_chunked_and_running_decodes_ride_along() -> None:
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=16)
    short, long = seq("short", 3), seq("long", 40)
    sched.add(short)
    sched.add(long)
    steps = []
    for _ in range(5):
        batch = sched.schedule()
        steps.append((plan(batch), [s.request_id for s in batch.sampling], batch.is_decode))
        finish_step(batch, bm)
    assert steps == [
        ([("short", 3), ("long", 13)], ["short"], False),  # short's whole prompt, then long's first chunk
        ([("short", 1), ("long", 15)], ["short"], False),  # short decodes; long gets the rest of the budget
        ([("short", 1), ("long", 12)], ["short", "long"], False),  # long's last chunk samples
        ([("short", 1), ("long", 1)], ["short", "long"], True),  # both decode: a uniform decode batch
        ([("short", 1), ("long", 1)], ["short", "long"], True),
    ]


def test_batch_size_cap_keeps_the_rest_waiting_in_order() -> None:
    bm = BlockManager(num_blocks=64, block_size=BS)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [seq(f"s{i}", 5) for i in range(4)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert plan(batch) == [("s0", 5), ("s1", 5)]
    assert [s.request_id for s in sched.waiting] == ["s2", "s3"]
    finish_step(batch, bm)
    sched.finish(seqs[0], "stop")
    batch = sched.schedule()
    assert plan(batch) == [("s1", 1), ("s2", 5)]
    assert seqs[0].is_finished and seqs[0].block_table == []


def test_full_pool_preempts_the_newest_and_requeues_it_first() -> None:
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)  # 16 tokens; every token recomputed
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    old, new = seq("old", 8), seq("new", 8)
    sched.add(old)
    sched.add(new)
    batch = sched.schedule()
    assert plan(batch) == [("old", 8), ("new", 8)] and bm.num_free_blocks == 0
    finish_step(batch, bm)  # both now hold 9 tokens: each needs a third block for its next token
    batch = sched.schedule()
    assert plan(batch) == [("old", 1)]
    assert sched.num_preemptions == 1 and new.status is SequenceStatus.WAITING
    assert list(sched.waiting) == [new] and new.block_table == [] and new.num_computed_tokens == 0
    finish_step(batch, bm)
    sched.finish(old, "length")
    batch = sched.schedule()
    assert plan(batch) == [("new", 9)]  # recomputed: its prompt and the token it had generated
    finish_step(batch, bm)
    sched.finish(new, "length")
    assert not sched.has_work()
    assert_pool_idle(bm)


def test_scheduled_batch_says_which_rows_sample() -> None:
    a, b = seq("a", 10), seq("b", 10)
    batch = ScheduledBatch()
    batch.add(a, 4)  # a prefill chunk: does not reach the last token
    batch.add(b, 10)  # b's whole prompt: samples
    assert batch.sampling == [b] and batch.num_tokens == 14 and not batch.is_decode and len(batch) == 2
    a.num_computed_tokens, b.num_computed_tokens = 9, 9
    decode = ScheduledBatch()
    decode.add(a, 1)
    decode.add(b, 1)
    assert decode.sampling == [a, b] and decode.is_decode
    assert not ScheduledBatch() and len(ScheduledBatch()) == 0

"""Continuous batching is invisible in the results: batched greedy tokens and logits equal each request run alone."""

from __future__ import annotations

import pytest
import torch

from gpullama import LLM
from gpullama.engine.llm_engine import LLMEngine
from gpullama.sampling_params import SamplingParams
from tests.engine.helpers import PASSAGE, make_engine, random_prompt, run_requests, solo_runs

TINY_VOCAB = 700  # ordinary tokens of the tiny vocabulary; 700.. are BOS/EOS and other specials
TINY_BOS = 700
CHUNK = 64  # token budget per step in the batched runs: prompts longer than this are prefilled in chunks
SOLO_TOKENS = 30  # the longest max_tokens of the mixed params
LOGITS_TOLERANCE = 1e-4  # max |batched - solo| / max |solo| per row, float32


def mixed_prompts() -> list[list[int]]:
    """16 prompts of 3..210 tokens: independent ones, four sharing a 96-token prefix, three sharing a 140-token
    prefix, and one exact duplicate."""
    gen = torch.Generator().manual_seed(42)
    prefix_a = random_prompt(gen, 96, TINY_VOCAB, TINY_BOS)
    prefix_b = random_prompt(gen, 140, TINY_VOCAB, TINY_BOS)
    prompts = [random_prompt(gen, n, TINY_VOCAB, TINY_BOS) for n in (3, 9, 17, 31, 64, 65, 150, 210)]
    prompts += [prefix_a + random_prompt(gen, n, TINY_VOCAB) for n in (1, 10, 40)] + [list(prefix_a)]
    prompts += [prefix_b + random_prompt(gen, n, TINY_VOCAB) for n in (5, 33, 70)]
    prompts.append(list(prompts[9]))
    assert len(prompts) == 16 and max(len(p) for p in prompts) > 3 * CHUNK
    return prompts


def mixed_params() -> list[SamplingParams]:
    """Greedy params with different lengths (so requests leave at different steps); half ignore EOS."""
    return [SamplingParams(temperature=0.0, max_tokens=8 + (i * 7) % 23, ignore_eos=i % 2 == 0) for i in range(16)]


class LogitsRecorder:
    """Wraps an engine's step forward (its model runner's `execute`): keeps (sequence, position, logits row) for
    every row the engine samples from."""

    def __init__(self, engine: LLMEngine):
        self.rows: list[tuple[object, int, torch.Tensor]] = []
        execute = engine.runner.execute

        def recording_execute(batch):
            pending = [(seq, seq.num_tokens - 1) for seq in batch.sampling]
            out = execute(batch)
            logits = out.logits
            assert logits.shape[0] == len(pending)
            self.rows.extend((seq, pos, row.float().clone()) for (seq, pos), row in zip(pending, logits))
            return out

        engine.runner.execute = recording_execute


def assert_same_outputs(got, want) -> None:
    """Batched sequences carry exactly the solo tokens, text and finish reason."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.output_token_ids == w.output_token_ids, (
            f"request {i} ({g.num_prompt_tokens} prompt tokens): batched {g.output_token_ids} "
            f"!= solo {w.output_token_ids}"
        )
        assert g.text == w.text, f"request {i}: text differs"
        assert g.finish_reason == w.finish_reason, f"request {i}: {g.finish_reason} != {w.finish_reason}"


def assert_logits_match_solo(llm: LLM, recorder: LogitsRecorder) -> None:
    """Every recorded row equals the row `llm.logits` gives for the same position of the sequence scored alone."""
    solo: dict[int, torch.Tensor] = {}
    checked = 0
    for seq, pos, row in recorder.rows:
        if id(seq) not in solo:
            solo[id(seq)] = llm.logits(seq.token_ids)
        want = solo[id(seq)][pos]
        err = (row - want).abs().max().item() / want.abs().max().item()
        assert err < LOGITS_TOLERANCE, f"{seq.request_id} position {pos}: batched logits differ by {err:.2g} (rel)"
        checked += 1
    assert checked > 0


@pytest.fixture(scope="module")
def chunked_llm(tiny_model) -> LLM:
    """The tiny llama with a 64-token step budget, so long prompts are prefilled in chunks."""
    return LLM(str(tiny_model("llama", "F32").path), device="cpu", dtype="float32", max_num_batched_tokens=CHUNK)


@pytest.fixture(scope="module")
def tiny_solo(tiny_llm: LLM) -> list:
    """The 16 mixed prompts, each run alone (no chunking, no prefix cache) for the longest length any test asks."""
    params = SamplingParams(temperature=0.0, max_tokens=SOLO_TOKENS, ignore_eos=True)
    return solo_runs(tiny_llm, mixed_prompts(), params)


def expected(solo, params: SamplingParams, eos_ids: set[int]) -> tuple[list[int], str]:
    """Greedy tokens and finish reason of a request, cut from its longer solo run: greedy decoding does not depend
    on max_tokens, so the run stops at max_tokens or (unless EOS is ignored) just after the first EOS."""
    tokens = solo.output_token_ids[: params.max_tokens]
    assert len(tokens) == params.max_tokens, "the solo run is shorter than the request"
    if not params.ignore_eos:
        for i, t in enumerate(tokens):
            if t in eos_ids:
                return tokens[: i + 1], "stop"
    return tokens, "length"


def assert_as_solo(seqs_or_completions, solo: list, params: list[SamplingParams], eos_ids: set[int]) -> None:
    """Each batched result has exactly the tokens and finish reason its solo run implies."""
    for i, (got, ref, p) in enumerate(zip(seqs_or_completions, solo, params, strict=True)):
        tokens = got.output_token_ids if hasattr(got, "output_token_ids") else got.token_ids
        want_tokens, want_reason = expected(ref, p, eos_ids)
        assert tokens == want_tokens, (
            f"request {i} ({len(ref.prompt_token_ids)} prompt tokens): {tokens} != solo {want_tokens}"
        )
        assert got.finish_reason == want_reason, f"request {i}: finish {got.finish_reason} != {want_reason}"


def test_generate_batch_of_16_equals_solo(chunked_llm: LLM, tiny_solo: list) -> None:
    """`LLM.generate` with 16 mixed prompts (chunked prefill, shared prefixes) gives each prompt its solo tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=24)
    prompts = mixed_prompts()
    completions = chunked_llm.generate(prompts, params)
    assert [c.prompt_token_ids for c in completions] == prompts
    assert_as_solo(completions, tiny_solo, [params] * 16, chunked_llm.tokenizer.eos_token_ids)


@pytest.mark.parametrize(
    ("max_num_seqs", "static_decode"), [(16, False), (5, False), (16, True), (5, True)], ids=lambda v: str(v)
)
def test_engine_batch_equals_solo_with_joins_and_cache(
    tiny_llm: LLM, tiny_solo: list, max_num_seqs: int, static_decode: bool
) -> None:
    """Per-request lengths, chunked prefill and (with 5 slots) requests joining as others leave, with decode on
    eager or padded static buffers: solo tokens."""
    engine = make_engine(
        tiny_llm, max_num_seqs=max_num_seqs, max_num_batched_tokens=CHUNK, static_decode=static_decode
    )
    seqs = run_requests(engine, mixed_prompts(), mixed_params())
    assert_as_solo(seqs, tiny_solo, mixed_params(), tiny_llm.tokenizer.eos_token_ids)
    if max_num_seqs == 5:  # later requests find the shared prefixes of earlier ones in the cache
        assert sum(s.num_cached_tokens for s in seqs) > 0


@pytest.mark.parametrize("static_decode", [False, True], ids=["eager", "static"])
def test_tiny_batched_logits_equal_solo(tiny_llm: LLM, static_decode: bool) -> None:
    """Every sampled logits row of a chunked, mixed batch matches the sequence's own `LLM.logits` row."""
    engine = make_engine(tiny_llm, max_num_seqs=16, max_num_batched_tokens=CHUNK, static_decode=static_decode)
    recorder = LogitsRecorder(engine)
    seqs = run_requests(engine, mixed_prompts(), mixed_params())
    assert len(recorder.rows) == sum(s.num_output_tokens for s in seqs)
    assert_logits_match_solo(tiny_llm, recorder)


@pytest.fixture(scope="module")
def real_batch(real_llm: LLM) -> tuple[list, list, LogitsRecorder]:
    """Five real-text prompts (two sharing a long prefix, three longer than one chunk) run as one batch."""
    tok = real_llm.tokenizer
    words = PASSAGE.split()
    texts = [
        "The capital of France is",
        " ".join(words[:50]),
        " ".join(words[:50]) + " Tell me what the keepers wrote down.",
        " ".join(words[100:125]),
        " ".join(words[40:110]),
    ]
    prompts = [tok.encode(t, add_special_tokens=True) for t in texts]
    assert max(len(p) for p in prompts) > CHUNK
    params = SamplingParams(temperature=0.0, max_tokens=5)
    engine = make_engine(real_llm, max_num_seqs=8, max_num_batched_tokens=CHUNK, num_blocks=64)
    recorder = LogitsRecorder(engine)
    seqs = run_requests(engine, prompts, params)
    return seqs, solo_runs(real_llm, prompts, params), recorder


@pytest.mark.slow
def test_real_model_batch_equals_solo(real_batch) -> None:
    """SmolLM2 in float32: greedy tokens of a chunked batch of real-text prompts equal the solo runs."""
    seqs, solo, _ = real_batch
    assert_same_outputs(seqs, solo)


@pytest.mark.slow
def test_real_model_batched_logits_equal_solo(real_llm: LLM, real_batch) -> None:
    """SmolLM2 in float32: each batched logits row is within 1e-4 (relative) of the same sequence scored alone."""
    _, _, recorder = real_batch
    assert_logits_match_solo(real_llm, recorder)


def test_return_progress_reports_each_prefill_chunk_before_the_first_token(tiny_llm: LLM) -> None:
    """`SamplingParams.return_progress` (llama.cpp's return_progress): a delta before the prompt's first chunk
    (its prefix-cache hits), then one after each chunk until the whole prompt is processed, all before the first
    token; the tokens are the ones the request gets without it, and other requests get no progress deltas."""
    gen = torch.Generator().manual_seed(8)
    prompt = [int(t) for t in torch.randint(3, 600, (70,), generator=gen)]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine = make_engine(tiny_llm, max_num_batched_tokens=32)
    engine.add_request("plain", prompt[:40], params)
    seq = engine.add_request("progress", prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                                return_progress=True))
    events: list[tuple] = []
    while engine.has_work():
        for d in engine.step():
            if d.num_computed_prompt_tokens is not None:
                assert d.request_id == "progress" and not d.token_ids and d.finish_reason is None
                events.append(("progress", d.num_computed_prompt_tokens))
            elif d.request_id == "progress" and d.token_ids:
                events.append(("tokens", len(d.token_ids)))
    processed = [n for kind, n in events if kind == "progress"]
    first_token = next(i for i, (kind, _) in enumerate(events) if kind == "tokens")
    assert processed[0] == seq.num_cached_tokens and processed[-1] == len(prompt) and len(processed) >= 3
    assert processed == sorted(processed) and first_token == len(processed)
    assert seq.output_token_ids == solo_runs(tiny_llm, [prompt], params)[0].output_token_ids

"""Embedding requests: prefill only, pooled by the model's pooling type, checked against transformers' final hidden
states pooled the same way (cosine >= 0.9999, every value within 1e-4), alone, several at once, in chunks, and in
one batch with requests that decode."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gpullama import LLM, PoolingParams, SamplingParams
from gpullama.config import ModelConfig
from gpullama.engine.admission import RequestError

TOLERANCE = 1e-4


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def reference(hf_model, ids: list[int], kind: str = "last", normalize: bool = True,
              dimensions: int | None = None) -> torch.Tensor:
    """transformers' last hidden state (after the final norm) of `ids`, pooled by `kind`."""
    with torch.no_grad():
        states = hf_model.model(torch.tensor([ids])).last_hidden_state[0].double()
    vector = {"mean": states.mean(0), "cls": states[0], "last": states[-1]}[kind]
    vector = vector[:dimensions] if dimensions else vector
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def assert_matches(got: list[float], want: torch.Tensor) -> None:
    got_t = torch.tensor(got, dtype=torch.float64)
    assert got_t.shape == want.shape
    cosine = torch.nn.functional.cosine_similarity(got_t, want, dim=0).item()
    assert cosine >= 0.9999 and (got_t - want).abs().max().item() <= TOLERANCE, (cosine, (got_t - want).abs().max())


@pytest.fixture(scope="module")
def tiny_embedders(tiny_model):
    """Per architecture: the tiny model and an LLM on it whose steps hold at most 16 tokens (prompts prefill in
    chunks)."""
    built = {}

    def get(arch: str):
        if arch not in built:
            tiny = tiny_model(arch, "F32")
            built[arch] = tiny, LLM(str(tiny.path), device="cpu", dtype="float32", max_num_batched_tokens=16)
        return built[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_last_token_embeddings_match_transformers(tiny_embedders, arch: str) -> None:
    """Without a pooling_type in the file the last token pools (decoder embedding models such as Qwen3-Embedding);
    inputs of 1 to 40 tokens embedded together, the long ones over several steps."""
    tiny, llm = tiny_embedders(arch)
    vocab = tiny.config.vocab_size
    inputs = [_ids(n, seed, vocab) for seed, n in enumerate([1, 7, 23, 40])]
    outputs = llm.embed(inputs)
    assert [o.prompt_token_ids for o in outputs] == inputs
    for ids, out in zip(inputs, outputs):
        assert_matches(out.embedding, reference(tiny.hf_model, ids))


@pytest.mark.parametrize("kind", ["mean", "cls"])
def test_the_models_pooling_type_decides(tiny_embedders, kind: str) -> None:
    """A file's pooling_type (mean, cls) pools every chunk of a long input, or its first token."""
    tiny, llm = tiny_embedders("llama")
    saved = llm.engine.limits
    llm.engine.limits = dataclasses.replace(saved, pooling_type=kind)
    try:
        inputs = [_ids(n, 10 + n, tiny.config.vocab_size) for n in (5, 37)]
        for ids, out in zip(inputs, llm.embed(inputs)):
            assert_matches(out.embedding, reference(tiny.hf_model, ids, kind))
    finally:
        llm.engine.limits = saved


def test_a_requests_own_pooling_wins_and_none_gives_every_tokens_vector(tiny_embedders) -> None:
    """`PoolingParams.kind` (the server's --pooling) pools as asked whatever the file says; none gives one
    unnormalised vector per token, over several chunks, in the same steps as a pooled request."""
    tiny, llm = tiny_embedders("llama")
    ids = _ids(37, 5, tiny.config.vocab_size)
    engine = llm.engine
    mean = engine.admit_embedding("mean", ids, PoolingParams(kind="mean"))
    per_token = engine.admit_embedding("none", ids, PoolingParams(kind="none"))
    engine.add(mean)
    engine.add(per_token)
    while engine.has_work():
        engine.step()
    assert_matches(mean.embedding, reference(tiny.hf_model, ids, "mean"))
    with torch.no_grad():
        states = tiny.hf_model.model(torch.tensor([ids])).last_hidden_state[0].double()
    assert len(per_token.embedding) == len(ids)
    for got, want in zip(per_token.embedding, states):
        assert_matches(got, want)


def test_dimensions_and_normalize(tiny_embedders) -> None:
    tiny, llm = tiny_embedders("llama")
    ids = _ids(12, 3, tiny.config.vocab_size)
    cut = llm.embed(ids, PoolingParams(dimensions=16))[0].embedding
    assert len(cut) == 16 and abs(sum(v * v for v in cut) - 1) < 1e-6
    assert_matches(cut, reference(tiny.hf_model, ids, dimensions=16))
    raw = llm.embed(ids, PoolingParams(normalize=False))[0].embedding
    assert_matches(raw, reference(tiny.hf_model, ids, normalize=False))


def test_embeddings_share_steps_with_decoding_requests(tiny_embedders) -> None:
    """Embedding requests join the batch of a request that decodes: its tokens are the ones it gets alone, the
    embeddings the ones they get alone; their KV blocks are freed and not kept for the prefix cache."""
    tiny, llm = tiny_embedders("llama")
    vocab = tiny.config.vocab_size
    prompt = _ids(9, 21, vocab)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    alone = llm.generate(prompt, params)[0].token_ids
    engine = llm.engine
    gen = engine.add_request("gen", prompt, params)
    texts = [_ids(n, 30 + n, vocab) for n in (6, 19, 33)]
    steps = 0
    embeds = []
    while engine.has_work():
        if steps in (2, 4, 6):  # arrive while the other request decodes
            seq = engine.admit_embedding(f"emb{steps}", texts[steps // 2 - 1])
            engine.add(seq)
            embeds.append(seq)
        deltas = engine.step()
        steps += 1
        assert all(d.embedding is None or d.finish_reason == "stop" for d in deltas)
    assert gen.output_token_ids == alone
    for ids, seq in zip(texts, embeds):
        assert seq.is_finished and not seq.block_table
        assert_matches(seq.embedding, reference(tiny.hf_model, ids))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    again = llm.generate(texts[2], SamplingParams(max_tokens=1))[0]
    assert again.num_cached_tokens == 0  # the embedding's blocks were not registered


def test_bad_embedding_requests_are_refused_by_name(tiny_embedders) -> None:
    tiny, llm = tiny_embedders("llama")
    engine = llm.engine
    cases = [([], None, "prompt"), ([1] * (llm.max_model_len + 1), None, "prompt"), ([10**9], None, "prompt"),
             ([1, 2], PoolingParams(dimensions=0), "dimensions"),
             ([1, 2], PoolingParams(dimensions=tiny.config.hidden_size + 1), "dimensions"),
             ([1, 2], PoolingParams(normalize="yes"), "normalize")]
    for ids, pooling, param in cases:
        with pytest.raises(RequestError) as info:
            engine.admit_embedding("bad", ids, pooling)
        assert info.value.param == param, (ids[:3], pooling, str(info.value))
    assert len(llm.embed([1] * llm.max_model_len)[0].embedding) == tiny.config.hidden_size  # the whole context


def test_pooling_type_is_read_from_the_file_metadata() -> None:
    base = {"general.architecture": "llama", "llama.embedding_length": 8, "llama.attention.head_count": 2,
            "llama.block_count": 1, "llama.feed_forward_length": 16, "llama.context_length": 32,
            "tokenizer.ggml.tokens": ["a", "b"]}
    assert ModelConfig.from_metadata(base).pooling_type == "last"
    for value, kind in ((0, "last"), (1, "mean"), (2, "cls"), (3, "last"), (4, "rank")):
        assert ModelConfig.from_metadata({**base, "llama.pooling_type": value}).pooling_type == kind

"""`LLM.rerank` and `LLM.score` on a tiny Qwen3 reranker written by llama.cpp's converter: each document's score is
transformers' probability of "yes" on the prompt llama.cpp builds (within 1e-5), so the order is transformers';
a model that is not a reranker is refused, and a reranker has no embeddings."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest

from gpullama import LLM
from gpullama.kernels import cpu_native
from gpullama.ops import CpuOps
from tests.fixtures.reranker import qwen3_reranker, reference_score, rerank_template
from tests.test_converted_models import smollm2_tokenizer

QUERY = "What is a panda?"
DOCUMENTS = ["hi", "it is a bear", "The giant panda is a bear species endemic to China.",
             "Paris, capitale de la France", "pandas: a Python library for data analysis", "ça va? 😀"]


@pytest.fixture(scope="module")
def rerankers(default_model_path: Path):
    """Factory: (transformers model, tokenizer, GGUF path, LLM) of the tied or untied tiny reranker."""
    made: dict[bool, tuple] = {}

    def get(tied: bool = True):
        if tied not in made:
            model, tok, path = qwen3_reranker(smollm2_tokenizer(default_model_path), tied)
            made[tied] = model, tok, path, LLM(str(path), device="cpu", dtype="float32")
        return made[tied]

    return get


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_scores_and_order_are_transformers(rerankers, tied: bool) -> None:
    model, tok, path, llm = rerankers(tied)
    assert llm.is_reranker and llm.config.classifier_labels == ("yes", "no")
    template = rerank_template(path)
    want = [reference_score(model, tok, template, QUERY, d) for d in DOCUMENTS]
    results = llm.rerank(QUERY, DOCUMENTS)
    assert [r.index for r in results] == sorted(range(len(DOCUMENTS)), key=lambda i: -want[i][0])
    for r in results:
        score, ids = want[r.index]
        assert abs(r.relevance_score - score) <= 1e-5 and r.document == DOCUMENTS[r.index]
        assert r.num_prompt_tokens == len(ids) and llm.rerank_prompt(QUERY, r.document) == ids
    assert max(s for s, _ in want) - min(s for s, _ in want) > 0.05  # the scores spread: the order means something
    assert [r.index for r in llm.rerank(QUERY, DOCUMENTS, top_n=2)] == [r.index for r in results[:2]]


@pytest.mark.skipif(cpu_native.library() is None, reason=f"no CPU kernels: {cpu_native.build_error()}")
def test_the_cpu_fast_path_scores_as_transformers(rerankers) -> None:
    """The C kernels' path (`CpuOps`, its one-call layer stack) pools the same last row: scores within 1e-3, the
    order transformers' wherever two scores are not within 1e-2 of each other."""
    model, tok, path, _ = rerankers()
    with mock.patch("gpullama.engine.model_spec.quantized_cpu_path", return_value=True):
        fast = LLM(str(path), device="cpu")
    assert isinstance(fast.model.ops, CpuOps)
    template = rerank_template(path)
    want = [reference_score(model, tok, template, QUERY, d)[0] for d in DOCUMENTS]
    got = fast.score(QUERY, DOCUMENTS)
    assert got == pytest.approx(want, abs=1e-3)
    for i in range(len(want)):
        for j in range(len(want)):
            if want[i] > want[j] + 1e-2:
                assert got[i] > got[j]


def test_score_pairs_as_vllm(rerankers) -> None:
    model, tok, path, llm = rerankers()
    template = rerank_template(path)
    one_to_n = llm.score(QUERY, DOCUMENTS[:3])
    assert one_to_n == pytest.approx([reference_score(model, tok, template, QUERY, d)[0] for d in DOCUMENTS[:3]],
                                     abs=1e-5)
    queries = ["bears", "cities"]
    pairwise = llm.score(queries, DOCUMENTS[1:3])
    assert pairwise == pytest.approx([reference_score(model, tok, template, q, d)[0]
                                      for q, d in zip(queries, DOCUMENTS[1:3])], abs=1e-5)
    with pytest.raises(ValueError, match="1:1, 1:N or N:N"):
        llm.score(queries, DOCUMENTS[:3])
    with pytest.raises(ValueError, match="documents"):
        llm.rerank(QUERY, [])
    with pytest.raises(ValueError, match="top_n"):
        llm.rerank(QUERY, DOCUMENTS, top_n=0)


def test_a_reranker_has_no_embeddings_and_other_models_do_not_rerank(rerankers, default_llm) -> None:
    llm = rerankers()[3]
    with pytest.raises(ValueError, match="reranker"):
        llm.embed("hello")
    assert not default_llm.is_reranker
    with pytest.raises(ValueError, match="not a reranker"):
        default_llm.rerank(QUERY, DOCUMENTS)

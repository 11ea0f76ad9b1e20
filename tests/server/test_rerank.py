"""``POST /rerank`` (``/v1/rerank``, llama.cpp's Jina-like shape, and TEI's with ``texts``) and ``POST /v1/score``
(vLLM's shape) on a served tiny Qwen3 reranker written by llama.cpp's converter: the scores are transformers'
probability of "yes" on the prompt llama.cpp builds, the order is theirs, and each answer validates against a JSON
schema of its API's shape; bad input is a 400 naming the field, and a model that is not a reranker is refused."""

from __future__ import annotations

from pathlib import Path

import httpx
import jsonschema
import pytest

from tests.fixtures.reranker import qwen3_reranker, reference_score, rerank_template
from tests.server.conftest import start_server, stop_server
from tests.server.helpers import API_KEY
from tests.test_converted_models import smollm2_tokenizer

MAX_MODEL_LEN = 256
QUERY = "What is a panda?"
DOCUMENTS = ["hi", "it is a bear", "The giant panda is a bear species endemic to China.",
             "Paris, capitale de la France", "pandas: a Python library for data analysis"]

USAGE = {"type": "object", "required": ["prompt_tokens", "total_tokens"],
         "properties": {"prompt_tokens": {"type": "integer", "minimum": 0},
                        "total_tokens": {"type": "integer", "minimum": 0}}}
RERANK_SCHEMA = {
    # llama.cpp's tools/server/README.md ("POST /reranking": query, documents, top_n; similar to Jina's reranker
    # API) and the answer its server builds (format_response_rerank in tools/server/server-common.cpp)
    "type": "object",
    "required": ["model", "object", "usage", "results"],
    "properties": {
        "model": {"type": "string"},
        "object": {"const": "list"},
        "usage": USAGE,
        "results": {"type": "array", "items": {
            "type": "object", "required": ["index", "relevance_score"], "additionalProperties": False,
            "properties": {"index": {"type": "integer", "minimum": 0}, "relevance_score": {"type": "number"},
                           "document": {"type": "object", "required": ["text"],
                                        "properties": {"text": {"type": "string"}}}}}},
    },
}
TEI_SCHEMA = {  # the same answer in TEI's format (a body with `texts`): the list alone, `score` for the score
    "type": "array", "items": {"type": "object", "required": ["index", "score"], "additionalProperties": False,
                               "properties": {"index": {"type": "integer", "minimum": 0}, "score": {"type": "number"},
                                              "text": {"type": "string"}}}}
SCORE_SCHEMA = {  # vLLM's ScoreResponse (vllm/entrypoints/openai/protocol.py)
    "type": "object",
    "required": ["id", "object", "created", "model", "data", "usage"],
    "properties": {
        "id": {"type": "string", "pattern": "^score-"},
        "object": {"const": "list"},
        "created": {"type": "integer"},
        "model": {"type": "string"},
        "data": {"type": "array", "items": {
            "type": "object", "required": ["index", "object", "score"], "additionalProperties": False,
            "properties": {"index": {"type": "integer", "minimum": 0}, "object": {"const": "score"},
                           "score": {"type": "number"}}}},
        "usage": USAGE,
    },
}


@pytest.fixture(scope="module")
def reranker(default_model_path: Path):
    """(transformers model, tokenizer, GGUF path) of the tiny reranker."""
    return qwen3_reranker(smollm2_tokenizer(default_model_path))


@pytest.fixture(scope="module")
def rr(reranker, tmp_path_factory) -> httpx.Client:
    """A client of a server of the reranker (context 256)."""
    srv = start_server(reranker[2], tmp_path_factory.mktemp("rerank") / "server.log",
                       ["--max-model-len", str(MAX_MODEL_LEN)])
    try:
        with httpx.Client(base_url=srv.base_url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            yield c
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def want(reranker) -> list[tuple[float, list[int]]]:
    """transformers' score and prompt ids of each (QUERY, document) pair."""
    model, tok, path = reranker
    template = rerank_template(path)
    return [reference_score(model, tok, template, QUERY, d) for d in DOCUMENTS]


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/reranking"])
def test_rerank_is_transformers_order_and_llamacpp_shape(rr: httpx.Client, want, path: str) -> None:
    name = rr.get("/v1/models").json()["data"][0]["id"]
    r = rr.post(path, json={"model": name, "query": QUERY, "documents": DOCUMENTS})
    assert r.status_code == 200, r.text
    body = r.json()
    jsonschema.validate(body, RERANK_SCHEMA)
    assert [x["index"] for x in body["results"]] == sorted(range(len(DOCUMENTS)), key=lambda i: -want[i][0])
    for x in body["results"]:
        assert x["relevance_score"] == pytest.approx(want[x["index"]][0], abs=1e-5) and "document" not in x
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == sum(len(ids) for _, ids in want)
    assert body["model"] == name


def test_top_n_return_documents_and_document_objects(rr: httpx.Client, want) -> None:
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -want[i][0])
    docs = [{"text": d} for d in DOCUMENTS]
    body = rr.post("/v1/rerank", json={"query": QUERY, "documents": docs, "top_n": 2, "return_documents": True}).json()
    jsonschema.validate(body, RERANK_SCHEMA)
    assert [(x["index"], x["document"]["text"]) for x in body["results"]] == [(i, DOCUMENTS[i]) for i in order[:2]]
    assert len(rr.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 99}).json()["results"]) == 5


def test_tei_texts_shape(rr: httpx.Client, want) -> None:
    body = rr.post("/rerank", json={"query": QUERY, "texts": DOCUMENTS, "return_text": True}).json()
    jsonschema.validate(body, TEI_SCHEMA)
    assert [(x["index"], x["text"]) for x in body] == \
        [(i, DOCUMENTS[i]) for i in sorted(range(len(DOCUMENTS)), key=lambda i: -want[i][0])]
    assert body[0]["score"] == pytest.approx(max(s for s, _ in want), abs=1e-5)


def test_score_pairs_as_vllm(rr: httpx.Client, reranker, want) -> None:
    r = rr.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS})
    assert r.status_code == 200, r.text
    body = r.json()
    jsonschema.validate(body, SCORE_SCHEMA)
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    assert [d["score"] for d in body["data"]] == pytest.approx([s for s, _ in want], abs=1e-5)
    model, tok, path = reranker
    pairs = [("bears", DOCUMENTS[1]), ("cities", DOCUMENTS[3])]
    body = rr.post("/score", json={"text_1": [q for q, _ in pairs], "text_2": [d for _, d in pairs]}).json()
    jsonschema.validate(body, SCORE_SCHEMA)
    template = rerank_template(path)
    assert [d["score"] for d in body["data"]] == \
        pytest.approx([reference_score(model, tok, template, q, d)[0] for q, d in pairs], abs=1e-5)


@pytest.mark.parametrize("path, body, param", [
    ("/rerank", {"query": QUERY, "documents": []}, "documents"),
    ("/rerank", {"query": QUERY, "documents": None}, "documents"),
    ("/rerank", {"query": QUERY, "documents": 123}, "documents"),
    ("/rerank", {"query": QUERY, "documents": [1, 2, 3]}, "documents[0]"),
    ("/rerank", {"documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": 5, "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "top_n": 0}, "top_n"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"], "return_documents": "yes"}, "return_documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a"] * 1001}, "documents"),
    ("/v1/rerank", {"query": QUERY, "documents": ["a", "word " * 300]}, "documents[1]"),
    ("/v1/rerank", {"query": "word " * 300, "documents": ["a"]}, "query"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/v1/score", {"text_1": [], "text_2": "a"}, "text_1"),
    ("/v1/score", {"text_1": "a", "text_2": ["a", "word " * 300]}, "text_2[1]"),
    ("/v1/embeddings", {"input": "a"}, "model"),
    # a reranker does not generate text (llama.cpp's server in reranking mode refuses completions too)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, "model"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "model"),
    ("/completion", {"prompt": "hi", "n_predict": 2}, "model"),
])
def test_bad_input_is_400_naming_the_field(rr: httpx.Client, path: str, body: dict, param: str) -> None:
    r = rr.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    if "word " * 300 in str(body):
        assert str(MAX_MODEL_LEN) in r.json()["error"]["message"]


@pytest.mark.parametrize("path, body", [("/v1/rerank", {"query": "a", "documents": ["b"]}),
                                        ("/v1/score", {"text_1": "a", "text_2": "b"})])
def test_a_model_that_is_not_a_reranker_is_refused(http: httpx.Client, path: str, body: dict) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text
    assert "not a reranker" in r.json()["error"]["message"]

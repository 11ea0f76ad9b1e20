"""``POST /v1/embeddings`` through the official openai SDK (base64, its default) and raw JSON (float), against
transformers' final hidden states of the same GGUF, last-token pooled and L2-normalised (cosine >= 0.9999, every
value within 1e-4)."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

TEXTS = ["The capital of France is Paris.", "Embeddings turn text into vectors.", "ça va? 😀"]


def reference(hf_default_model, ids: list[int], dimensions: int | None = None) -> np.ndarray:
    with torch.no_grad():
        last = hf_default_model.model(torch.tensor([ids])).last_hidden_state[0, -1].double()
    return torch.nn.functional.normalize(last[:dimensions] if dimensions else last, dim=0).numpy()


def assert_matches(got, want: np.ndarray) -> None:
    got = np.asarray(got, dtype=np.float64)
    cosine = float(got @ want / np.linalg.norm(got) / np.linalg.norm(want))
    assert got.shape == want.shape and cosine >= 0.9999 and np.abs(got - want).max() <= 1e-4, cosine


def test_the_sdk_gets_the_reference_embeddings(client: openai.OpenAI, model_name: str, hf_default_model,
                                               hf_tokenizer) -> None:
    out = client.embeddings.create(model=model_name, input=TEXTS)
    ids = [hf_tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    assert [d.index for d in out.data] == [0, 1, 2] and out.model == model_name
    assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
    for d, want_ids in zip(out.data, ids):
        assert_matches(d.embedding, reference(hf_default_model, want_ids))


def test_float_token_ids_and_dimensions(http: httpx.Client, hf_default_model, hf_tokenizer) -> None:
    ids = hf_tokenizer.encode(TEXTS[0], add_special_tokens=True)
    r = http.post("/v1/embeddings", json={"input": [ids, TEXTS[0]], "encoding_format": "float", "dimensions": 64})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and all(d["object"] == "embedding" for d in body["data"])
    first, second = (d["embedding"] for d in body["data"])
    assert len(first) == 64 and first == second
    assert_matches(first, reference(hf_default_model, ids, dimensions=64))
    b64 = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    assert_matches(vector, reference(hf_default_model, ids))


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": ""}, "input[0]"),
    ({"input": ["a", 3]}, "input[1]"),
    ({"input": []}, "input"),
    ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": 100000}, "dimensions"),
    ({"input": [[1, 10**9]]}, "input"),
    ({"input": "word " * 9000}, "input"),
])
def test_bad_input_is_400_naming_the_field(http: httpx.Client, body: dict, param: str) -> None:
    r = http.post("/v1/embeddings", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text

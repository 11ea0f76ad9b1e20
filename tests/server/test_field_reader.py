"""The one sampling-field reader: every family's fields read from its own table, every refusal named in the family's
wire names (whether the reader refuses the value or SamplingParams' range check does later), and the logit_bias
key that `str.isdigit` takes but `int` does not ("²") a 400 in every family that has logit_bias."""

from __future__ import annotations

import httpx
import pytest

from gpullama.sampling_params import SamplingParams
from gpullama.server.anthropic.request import FIELDS as ANTHROPIC
from gpullama.server.http.errors import APIError
from gpullama.server.llamacpp.request import FIELDS as LLAMACPP
from gpullama.server.ollama.request import FIELDS as OLLAMA
from gpullama.server.openai.chat import FIELDS as CHAT
from gpullama.server.openai.completions import FIELDS as COMPLETIONS
from gpullama.server.openai.responses.request import FIELDS as RESPONSES
from gpullama.server.pipeline.sampling import sampling_params

# (table, wire path, SamplingParams field, a value of the wrong type, a value SamplingParams refuses)
CASES = [
    (CHAT, "temperature", "temperature", "hot", -1),
    (CHAT, "max_completion_tokens", "max_tokens", 2.5, None),
    (CHAT, "repetition_penalty", "repetition_penalty", "x", 0),
    (COMPLETIONS, "top_p", "top_p", [], 5),
    (RESPONSES, "max_output_tokens", "max_tokens", "many", None),
    (RESPONSES, "top_k", "top_k", 1.5, -7),
    (LLAMACPP, "n_predict", "max_tokens", "x", None),
    (LLAMACPP, "repeat_penalty", "repetition_penalty", "x", 0),
    (LLAMACPP, "top_p", "top_p", "x", 5),
    (LLAMACPP, "n_probs", "logprobs", "x", None),
    (OLLAMA, "options.repeat_penalty", "repetition_penalty", "x", 0),
    (OLLAMA, "options.num_predict", "max_tokens", "x", None),
    (OLLAMA, "options.top_k", "top_k", 2.5, -9),
    (ANTHROPIC, "stop_sequences", "stop", 7, None),
    (ANTHROPIC, "temperature", "temperature", "x", -2),
]


def _body(path: str, value) -> dict:
    """A body with `value` at `path` (``options.x`` under Ollama's options)."""
    head, _, tail = path.partition(".")
    return {head: {tail: value}} if tail else {path: value}


@pytest.mark.parametrize("table, path, target, wrong_type, out_of_range", CASES)
def test_a_refusal_names_the_wire_field_whichever_layer_refuses(table, path, target, wrong_type, out_of_range):
    with pytest.raises(APIError) as info:
        table.read(_body(path, wrong_type))
    assert info.value.status == 400 and info.value.param == path and f"'{path}'" in info.value.message
    if out_of_range is None:
        return
    opts = table.read(_body(path, out_of_range))
    with pytest.raises(APIError) as info:
        sampling_params(opts)  # SamplingParams' own check, in its names
    assert info.value.param == target
    renamed = opts.names.apply(info.value)
    assert renamed.param == path and f"'{path}'" in renamed.message, renamed.message


def test_each_family_reads_its_own_names_into_the_same_params():
    want = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, top_k=3, seed=11, stop=["x"],
                          repetition_penalty=1.1)
    bodies = [
        (CHAT, {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "seed": 11, "stop": "x",
                "repetition_penalty": 1.1}),
        (LLAMACPP, {"n_predict": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "seed": 11, "stop": ["x"],
                    "repeat_penalty": 1.1, "min_p": 0.0}),
        (OLLAMA, {"options": {"num_predict": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "seed": 11,
                              "stop": ["x"], "repeat_penalty": 1.1}}),
    ]
    for table, body in bodies:
        assert sampling_params(table.read(body)) == want, table


def test_an_alias_the_request_used_names_its_errors():
    opts = CHAT.read({"max_completion_tokens": 5, "max_tokens": 9})
    assert opts.max_tokens == 5 and opts.names.param("max_tokens") == "max_completion_tokens"
    assert CHAT.read({"max_tokens": 9}).names.param("max_tokens") == "max_tokens"
    opts = LLAMACPP.read({"max_tokens": 4})
    assert opts.max_tokens == 4 and opts.names.param("max_tokens") == "max_tokens"
    assert LLAMACPP.read({}).names.param("max_tokens") == "n_predict"


NOT_ASCII_DIGITS = ["²", "٣", "１", "12345678901"]  # superscript two, Arabic-Indic three, fullwidth one, 11 digits


@pytest.mark.parametrize("key", NOT_ASCII_DIGITS)
@pytest.mark.parametrize("path, body", [
    ("/completion", {"prompt": "hi", "n_predict": 1}),
    ("/infill", {"input_prefix": "def f():\n", "input_suffix": "\n", "n_predict": 1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 1}),
])
def test_a_logit_bias_key_that_is_not_ascii_digits_is_a_400_in_every_family(http: httpx.Client, path, body, key):
    response = http.post(path, json={**body, "logit_bias": {key: 1}})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "logit_bias" and key in error["message"]


def test_llamacpp_still_biases_a_text_and_an_ascii_digit_key(http: httpx.Client, hf_tokenizer):
    """llama.cpp's forms stay: an object key of ASCII digits is a token id, a pair's text is its tokens."""
    token = hf_tokenizer.encode(" Paris", add_special_tokens=False)[0]
    out = http.post("/completion", json={"prompt": "The capital of France is", "n_predict": 1, "temperature": 0,
                                         "logit_bias": {str(token): -100}}).json()
    assert out["generation_settings"]["logit_bias"] == [{"bias": -100.0, "token": token}]  # llama.cpp's pairs
    out = http.post("/completion", json={"prompt": "hi", "n_predict": 1, "logit_bias": [[" Paris", False]]}).json()
    assert [p["token"] for p in out["generation_settings"]["logit_bias"]] == hf_tokenizer.encode(
        " Paris", add_special_tokens=False)

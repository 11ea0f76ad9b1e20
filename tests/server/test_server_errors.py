"""Every error status of the server, in OpenAI's error shape."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import FAULT_PROMPT
from tests.server.helpers import API_KEY

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]


def _error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


def test_malformed_json_and_non_objects_are_400(http: httpx.Client) -> None:
    _error(http.post(CHAT, content=b'{"messages": [', headers={"content-type": "application/json"}), 400)
    _error(http.post(CHAT, content=b""), 400)
    _error(http.post(CHAT, json=[1, 2]), 400)


@pytest.mark.parametrize(("body", "param"), [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0].image_url.url"),  # a text-only model: the image is refused, naming --mmproj
    ({"messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ({"messages": MESSAGES, "temperature": -0.5}, "temperature"),
    ({"messages": MESSAGES, "top_p": 1.5}, "top_p"),
    ({"messages": MESSAGES, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens"),
    ({"messages": MESSAGES, "max_tokens": 2.5}, "max_tokens"),
    ({"messages": MESSAGES, "n": 0}, "n"),
    ({"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": MESSAGES, "stop": [1]}, "stop"),
    ({"messages": MESSAGES, "stream": "yes"}, "stream"),
    ({"messages": MESSAGES, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MESSAGES, "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"messages": MESSAGES, "logit_bias": {"5": 500}}, "logit_bias"),
    ({"messages": MESSAGES, "logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"messages": MESSAGES, "seed": 2**70}, "seed"),
])
def test_bad_chat_fields_are_400_naming_the_field(http: httpx.Client, body: dict, param: str) -> None:
    _error(http.post(CHAT, json=body), 400, param)


@pytest.mark.parametrize(("body", "param"), [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "logprobs": 30}, "logprobs"),
    ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ({"prompt": [99999999]}, "prompt"),
])
def test_bad_completion_fields_are_400_naming_the_field(http: httpx.Client, body: dict, param: str) -> None:
    _error(http.post("/v1/completions", json=body), 400, param)


def test_prompt_plus_max_tokens_over_the_context_is_400_with_both_numbers(client: openai.OpenAI,
                                                                           model_name: str) -> None:
    limit = client.models.list().data[0].model_extra["max_model_len"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=limit)
    message = info.value.body["message"]
    assert str(limit) in message and str(limit + 5) in message  # the prompt is 5 tokens
    assert info.value.body["param"] == "max_tokens"
    assert info.value.body["n_prompt_tokens"] == 5 and info.value.body["n_ctx"] == limit  # llama.cpp's fields
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="hi " * (limit + 10), max_tokens=1)
    assert str(limit) in info.value.body["message"]


def test_missing_or_wrong_api_key_is_401_and_health_stays_open(server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        error = _error(httpx.post(f"{server.base_url}{CHAT}", json={"messages": MESSAGES}, headers=headers), 401)
        assert error["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_route_and_unknown_model_are_404(http: httpx.Client, client: openai.OpenAI) -> None:
    _error(http.get("/v1/nothing-here"), 404)
    _error(http.post("/v2/chat/completions", json={}), 404)
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_wrong_method_is_405(http: httpx.Client) -> None:
    error = _error(http.get(CHAT), 405)
    assert error["code"] == "method_not_allowed"
    _error(http.post("/v1/models", json={}), 405)
    _error(http.delete("/health"), 405)


def test_body_over_the_limit_is_413(http: httpx.Client) -> None:
    big = b'{"prompt": "' + b"a" * (4 * 1024 * 1024) + b'"}'
    _error(http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(5):
            yield b"a" * (1024 * 1024)

    _error(http.post("/v1/completions", content=chunked()), 413)


def test_generation_failure_is_500_for_that_request_alone(http: httpx.Client, server, model_name: str) -> None:
    response = http.post("/v1/completions", json={"prompt": FAULT_PROMPT, "max_tokens": 3})
    error = _error(response, 500)
    # the body says only "internal error" and the request id; the detail is in the server's log under that id
    request_id = response.headers["x-request-id"]
    assert error["type"] == "server_error" and error["message"] == f"internal error (request id {request_id})"
    assert any("injected fault" in line for line in server.log().splitlines() if request_id in line)
    stream = http.post("/v1/completions", json={"prompt": FAULT_PROMPT, "max_tokens": 3, "stream": True})
    _error(stream, 500)
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"model": model_name, "prompt": "The capital of France is",
                                            "temperature": 0, "max_tokens": 3})
    assert ok.status_code == 200 and "Paris" in ok.json()["choices"][0]["text"]

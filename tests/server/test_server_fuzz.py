"""A bounded fuzz of the request schema against the real server: any mix of valid, out-of-range and wrongly typed
fields gets an answer below 500 (a 4xx in OpenAI's error shape, or a complete answer), and the server stays up."""

from __future__ import annotations

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**64) + 1, 2**64 - 1), st.text(max_size=12),
                      st.floats(allow_nan=False, allow_infinity=False))
JSON_ANY = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=3)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


# max_tokens is never missing, null or mid-sized, so a valid request stays a few tokens long
MAX_TOKENS = st.one_of(st.integers(1, 3), st.integers(max_value=0), st.integers(min_value=10**6, max_value=2**64))
TOKEN_ID = st.integers(-3, 50_000)
# each field's plausible values, out-of-range ones included; any field may also be replaced by any JSON (below)
COMMON = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "top_k": st.one_of(st.integers(-2, 100), st.integers(0, 2**64 - 1)),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**64),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(0, 2),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=6)),
    "stop_token_ids": st.lists(TOKEN_ID, max_size=4),
    "logit_bias": st.dictionaries(st.one_of(TOKEN_ID.map(str), st.text(max_size=5)),
                                  st.one_of(st.floats(-150, 150), st.integers(-200, 200)), max_size=4),
    "n": st.one_of(st.integers(1, 3), st.integers(0, 17)),
    "ignore_eos": st.booleans(),
    "model": st.just("SmolLM2-135M-Instruct.Q4_1"),
    "max_completion_tokens": MAX_TOKENS,
    "user": JSON_ANY,  # an unknown field is ignored
}
PART = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)})
MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "tool", "wizard", "developer", "assistant", "user"]),
    "content": st.one_of(st.text(max_size=20), st.lists(PART, max_size=2)),
})
CHAT = st.fixed_dictionaries(
    {"messages": st.lists(MESSAGE, min_size=1, max_size=3), "max_tokens": MAX_TOKENS},
    optional={**COMMON, "logprobs": st.booleans(), "top_logprobs": st.integers(-1, 25)})
COMPLETION = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(min_size=1, max_size=30), st.lists(TOKEN_ID, min_size=1, max_size=5),
                         st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3),
                         st.lists(st.lists(TOKEN_ID, max_size=3), max_size=3), st.text(min_size=1, max_size=30)),
     "max_tokens": MAX_TOKENS},
    optional={**COMMON, "logprobs": st.integers(-1, 25), "echo": st.booleans(), "suffix": st.text(max_size=3),
              "best_of": st.integers(0, 3)})
KEYS = sorted({*COMMON, "messages", "prompt", "max_tokens", "logprobs", "top_logprobs", "echo", "best_of", "stream",
               "stream_options"})
# up to two fields replaced by any JSON value at all (never null or a mid-sized integer: as max_tokens those would
# make a valid request generate for long)
GARBAGE = st.lists(st.tuples(st.sampled_from(KEYS), JSON_ANY.filter(
    lambda v: v is not None and not (isinstance(v, int) and 3 < v <= 10**5))), max_size=2)


STREAMING = st.sampled_from([{}, {"stream": False}, {"stream_options": {"include_usage": True}},  # needs stream
                             {"stream": True, "stream_options": {}},
                             {"stream": True, "stream_options": {"include_usage": True}}, {"stream": True}])


def _with_garbage(body: dict, streaming: dict, garbage: list[tuple[str, object]]) -> dict:
    return {**body, **streaming, **dict(garbage)}


REQUESTS = st.one_of(
    st.builds(_with_garbage, CHAT, STREAMING, GARBAGE).map(lambda body: ("/v1/chat/completions", body)),
    st.builds(_with_garbage, COMPLETION, STREAMING, GARBAGE).map(lambda body: ("/v1/completions", body)))


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(request=REQUESTS)
def test_no_request_body_gets_a_5xx(http: httpx.Client, request: tuple[str, dict]) -> None:
    path, body = request
    with http.stream("POST", path, json=body) as answer:
        content = answer.read()
    assert answer.status_code < 500, (path, body, content[:500])
    if answer.status_code >= 400:
        error = answer.json()["error"]
        # a request that does not fit the context adds llama.cpp's n_prompt_tokens and n_ctx (issue 25)
        assert set(error) - {"n_prompt_tokens", "n_ctx"} == {"message", "type", "param", "code"} and error["message"]
    elif answer.headers["content-type"].startswith("text/event-stream"):
        assert content.rstrip().endswith(b"data: [DONE]"), content[-300:]
        assert b'"error"' not in content, content[-500:]


# Valid requests only: every field within its documented range, in any combination; each must be answered whole.
VOCAB = 49152
VALID_TOKEN = st.integers(0, VOCAB - 1)
VALID_COMMON = {
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.one_of(st.integers(-1, 100), st.integers(0, 2**64 - 1)),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 16),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=4)),
    "stop_token_ids": st.lists(VALID_TOKEN, max_size=4),
    "logit_bias": st.dictionaries(VALID_TOKEN.map(str), st.floats(-100, 100), max_size=4),
    "n": st.integers(1, 3),
    "ignore_eos": st.booleans(),
    "model": st.just("SmolLM2-135M-Instruct.Q4_1"),
    "max_completion_tokens": st.integers(1, 3),
}
VALID_STREAMING = st.sampled_from([{}, {"stream": True}, {"stream": True, "stream_options": {"include_usage": True}}])
VALID_MESSAGE = st.fixed_dictionaries({
    "role": st.sampled_from(["system", "developer", "user", "assistant"]),
    "content": st.one_of(st.text(max_size=20), st.lists(PART, min_size=1, max_size=2)),
})
VALID_CHAT = st.fixed_dictionaries(
    {"messages": st.lists(VALID_MESSAGE, min_size=1, max_size=3), "max_tokens": st.integers(1, 3)},
    optional={**VALID_COMMON, "top_logprobs": st.integers(0, 20)})
VALID_COMPLETION = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(min_size=1, max_size=30), st.lists(VALID_TOKEN, min_size=1, max_size=5),
                         st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=3)),
     "max_tokens": st.integers(1, 3)},
    optional={**VALID_COMMON, "logprobs": st.integers(0, 5), "echo": st.booleans()})


def _valid_chat(body: dict, streaming: dict) -> dict:
    if "top_logprobs" in body:
        body["logprobs"] = True
    return {**body, **streaming}


def _valid_completion(body: dict, streaming: dict) -> dict:
    if body.get("echo"):
        body.pop("logprobs", None)  # echo with logprobs is refused (prompt logprobs are not computed)
    if isinstance(body["prompt"], list) and isinstance(body["prompt"][0], str):
        body["n"] = 1  # n times the prompts stays within 16
    return {**body, **streaming}


VALID_REQUESTS = st.one_of(
    st.builds(_valid_chat, VALID_CHAT, VALID_STREAMING).map(lambda body: ("/v1/chat/completions", body)),
    st.builds(_valid_completion, VALID_COMPLETION, VALID_STREAMING).map(lambda body: ("/v1/completions", body)))


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(request=VALID_REQUESTS)
def test_every_valid_combination_is_answered_whole(http: httpx.Client, request: tuple[str, dict]) -> None:
    path, body = request
    with http.stream("POST", path, json=body) as answer:
        content = answer.read()
    assert answer.status_code == 200, (path, body, content[:500])
    if body.get("stream"):
        assert content.rstrip().endswith(b"data: [DONE]") and b'"error"' not in content, content[-500:]
    else:
        choices = answer.json()["choices"]
        assert len(choices) == body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list)
                                                    and isinstance(body["prompt"][0], str) else 1)
        assert all(c["finish_reason"] in ("stop", "length") for c in choices)

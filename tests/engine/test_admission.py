"""The admission check: every field a request carries is refused by name before the request can join a batch,
with the OpenAI API's caps where it has them (4 stop strings, 300 logit_bias entries). The library's chat uses the
chat layer's message check (tests/chat/test_messages.py)."""

from __future__ import annotations

import pytest

from gpullama.engine.admission import (
    MAX_LOGIT_BIAS,
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
    AdmissionLimits,
    RequestError,
    check_request,
)
from gpullama.sampling_params import SamplingParams

LIMITS = AdmissionLimits(vocab_size=1000, max_model_len=256, kv_capacity_tokens=4096)
PROMPT = [1, 2, 3]


def _refused(param: str, fn, *args) -> str:
    with pytest.raises(RequestError) as info:
        fn(*args)
    assert info.value.param == param, (param, info.value.param, str(info.value))
    message = str(info.value)
    assert message and "\n" not in message and "SamplingParams." not in message
    return message


@pytest.mark.parametrize(("field", "value", "param"), [
    ("stop", ["a"] * (MAX_STOP + 1), "stop"),
    ("stop_token_ids", [1] * (MAX_STOP_TOKEN_IDS + 1), "stop_token_ids"),
    ("stop_token_ids", [1000], "stop_token_ids"),
    ("logit_bias", {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, "logit_bias"),
    ("logit_bias", {1000: 1.0}, "logit_bias"),
    ("max_tokens", 2**64, "max_tokens"),
    ("max_tokens", 254, "max_tokens"),
])
def test_limits_of_the_model_and_the_caps(field: str, value, param: str) -> None:
    _refused(param, check_request, PROMPT, SamplingParams(**{field: value}), LIMITS)


@pytest.mark.parametrize(("field", "value"), [
    ("top_k", 2**31), ("temperature", 10**400), ("top_p", "1"), ("seed", 2**70), ("logprobs", 10**30),
    ("stop", [""]), ("repetition_penalty", float("nan")), ("logit_bias", {-5: 1.0}), ("max_tokens", 0),
])
def test_fields_changed_after_construction_are_checked_again(field: str, value) -> None:
    params = SamplingParams(max_tokens=4)
    setattr(params, field, value)
    if field == "top_k":  # a top_k past the vocabulary is not an error: it keeps every token
        assert check_request(PROMPT, params, LIMITS) == 4
        return
    _refused(field, check_request, PROMPT, params, LIMITS)


class _Unscanned(list):
    """A prompt that fails the test if anything iterates over its ids."""

    def __iter__(self):
        raise AssertionError("the prompt's ids were scanned")


def test_prompts() -> None:
    _refused("prompt", check_request, [], SamplingParams(), LIMITS)
    _refused("prompt", check_request, [1, 1000], SamplingParams(), LIMITS)
    _refused("prompt", check_request, [1, -1], SamplingParams(), LIMITS)
    _refused("prompt", check_request, [1, 2**64], SamplingParams(), LIMITS)
    _refused("prompt", check_request, [1, True], SamplingParams(), LIMITS)
    _refused("prompt", check_request, "1 2 3", SamplingParams(), LIMITS)
    message = _refused("prompt", check_request, _Unscanned([0] * 10_000), SamplingParams(), LIMITS)
    assert "10000 tokens" in message  # refused by its length, before any of its ids was looked at
    assert check_request(PROMPT, SamplingParams(max_tokens=None), LIMITS) == 256 - 3


def test_the_library_uses_the_same_check(tiny_llm) -> None:
    vocab = tiny_llm.engine.limits.vocab_size
    with pytest.raises(RequestError) as info:
        tiny_llm.generate([1, 2, 3], SamplingParams(logit_bias={vocab: 1.0}, max_tokens=2))
    assert info.value.param == "logit_bias"
    with pytest.raises(RequestError) as info:
        tiny_llm.chat([{"role": ["user"], "content": "hi"}])
    assert info.value.param == "messages[0].role"
    greedy = SamplingParams(temperature=1.0, seed=4, max_tokens=5, ignore_eos=True)
    huge_k = SamplingParams(temperature=1.0, seed=4, max_tokens=5, ignore_eos=True, top_k=2**40)
    assert tiny_llm.generate([1, 2, 3], huge_k)[0].token_ids == tiny_llm.generate([1, 2, 3], greedy)[0].token_ids

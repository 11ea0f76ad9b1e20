"""SamplingParams validation: every out-of-range or ill-typed value raises ValueError naming its field."""

from __future__ import annotations

import math

import pytest

from gpullama import SamplingParams

INVALID: list[tuple[str, object]] = [
    ("n", 0),
    ("n", 1.5),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", 2.5),
    ("max_tokens", "16"),
    ("max_tokens", True),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.2),
    ("top_p", math.nan),
    ("top_k", -2),
    ("top_k", 3.0),
    ("min_p", -0.1),
    ("min_p", 1.1),
    ("seed", 1.5),
    ("seed", "42"),
    ("stop", [""]),
    ("stop", [3]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["2"]),
    ("presence_penalty", 2.5),
    ("presence_penalty", -3.0),
    ("frequency_penalty", 2.01),
    ("frequency_penalty", math.inf),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("logprobs", -1),
    ("logprobs", SamplingParams.MAX_LOGPROBS + 1),
    ("logprobs", 2.0),
    ("logit_bias", {5: 101.0}),
    ("logit_bias", {5: -150.0}),
    # integers of any size are refused by name, never an OverflowError or a conversion-limit error from inside
    ("temperature", 10**400),
    ("top_p", -(10**400)),
    ("presence_penalty", 10**400),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
    ("logit_bias", {5: 10**400}),
    ("logit_bias", {"9" * 5000: 1.0}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"abc": 1.0}),
    ("logit_bias", {5: math.nan}),
]

VALID: list[dict[str, object]] = [
    {},
    {"max_tokens": None},
    {"max_tokens": 1, "temperature": 0},
    {"temperature": 2.0, "top_p": 1.0, "top_k": -1, "min_p": 1.0},
    {"top_p": 1e-6, "top_k": 1, "min_p": 0.0, "seed": 0},
    {"presence_penalty": -2.0, "frequency_penalty": 2.0, "repetition_penalty": 1.3},
    {"stop": ["\n", "END"], "stop_token_ids": [0, 2], "logprobs": 0},
    {"logprobs": SamplingParams.MAX_LOGPROBS, "logit_bias": {0: -100, 7: 100}},
    {"top_k": 2**64, "seed": 2**64 - 1, "max_tokens": 2**70},  # checked against the model at admission
    {"seed": -(2**63)},
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_value_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value})
    assert field in str(excinfo.value), f"message does not name {field!r}: {excinfo.value}"


@pytest.mark.parametrize("kwargs", VALID, ids=[",".join(k) or "defaults" for k in VALID])
def test_valid_values_are_accepted(kwargs: dict[str, object]) -> None:
    params = SamplingParams(**kwargs)
    for field, value in kwargs.items():
        assert getattr(params, field) == value


def test_a_single_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]


def test_temperature_zero_is_greedy() -> None:
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.7).greedy

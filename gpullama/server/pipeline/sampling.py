"""The sampling fields every generating endpoint shares (temperature, top_p, stop, seed, penalties, ...), read into
`SamplingOptions` and bound into `SamplingParams`; the cap on choices per request. Errors name the fields as chat
completions does; each API module's field names rename them at its boundary."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gpullama.engine.admission import MAX_LOGIT_BIAS, MAX_STOP, MAX_STOP_TOKEN_IDS, RequestError, check_count
from gpullama.sampling_params import SamplingParams

from ..http.errors import APIError
from ..http.fields import admitted, bad, bool_field, int_field, kind, num_field

MAX_N = 16  # choices per request (n, or n times the number of prompts)
FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


@dataclass
class SamplingOptions:
    """The sampling fields of a request, type-checked but not yet bound to a prompt length."""

    max_tokens: int | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


def check_choices(num_prompts: int, n: int) -> None:
    """`n` choices for each of `num_prompts` prompts: n >= 1 and n times the prompts at most `MAX_N`."""
    if not 1 <= n <= MAX_N:
        raise RequestError(f"'n' must be in [1, {MAX_N}], got {n}", "n")
    if num_prompts > MAX_N:
        raise RequestError(f"'prompt' takes at most {MAX_N} prompts, got {num_prompts}", "prompt")
    if num_prompts * n > MAX_N:
        raise RequestError(f"'n' times the number of prompts must be at most {MAX_N}, got {num_prompts * n}", "n")


def stop_strings(body: dict, name: str = "stop") -> list[str]:
    """A stop string or a list of them (at most `MAX_STOP`, none empty)."""
    value = body.get(name)
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise bad(name, f"'{name}' must be a string or a list of strings")
    if len(value) > MAX_STOP:
        raise bad(name, f"'{name}' takes at most {MAX_STOP} sequences, got {len(value)}")
    if not all(isinstance(s, str) for s in value):
        raise bad(name, f"'{name}' must be a string or a list of strings")
    if not all(value):
        raise bad(name, f"'{name}' sequences must not be empty strings")
    return value


def _logit_bias(body: dict) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad("logit_bias", "'logit_bias' must be an object mapping token ids to numbers")
    admitted(check_count, "logit_bias", len(value), MAX_LOGIT_BIAS)
    out: dict[int, float] = {}
    for key, bias in value.items():
        # ASCII digits only, and few: int() of thousands of digits raises, and no vocabulary has 10**10 tokens
        if not re.fullmatch(r"[0-9]{1,10}", str(key)):
            raise bad("logit_bias", f"'logit_bias' keys must be token ids (non-negative integers), got "
                      f"{str(key)[:20]!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad("logit_bias", f"'logit_bias' values must be numbers, got {kind(bias)} for token {key}")
        if not -100 <= bias <= 100:  # compared before float(): an integer of any size is refused, never overflows
            raise bad("logit_bias", f"'logit_bias' values must be in [-100, 100], got {str(bias)[:20]} for token {key}")
        out[int(key)] = float(bias)
    return out


def _stop_token_ids(body: dict) -> list[int]:
    value = body.get("stop_token_ids")
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("stop_token_ids", "'stop_token_ids' must be a list of integers")
    admitted(check_count, "stop_token_ids", len(value), MAX_STOP_TOKEN_IDS)  # before looking at each item
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad("stop_token_ids", "'stop_token_ids' must be a list of integers")
    return value


def seed_field(body: dict, name: str = "seed") -> int | None:
    """A seed: an integer that fits in a signed 64-bit one."""
    seed = int_field(body, name)
    if seed is not None and not -(2**63) <= seed < 2**63:
        raise bad(name, f"'{name}' must fit in a signed 64-bit integer, got {seed}")
    return seed


def sampling_options(body: dict) -> SamplingOptions:
    """The sampling fields of an OpenAI-style body (chat, completions, responses): max_tokens (or
    max_completion_tokens, which wins), the float fields, top_k, seed, stop, stop_token_ids, logit_bias and
    ignore_eos."""
    opts = SamplingOptions()
    max_tokens = int_field(body, "max_tokens")
    max_completion_tokens = int_field(body, "max_completion_tokens")
    name = "max_completion_tokens" if max_completion_tokens is not None else "max_tokens"
    opts.max_tokens = max_completion_tokens if max_completion_tokens is not None else max_tokens
    if opts.max_tokens is not None and opts.max_tokens < 1:
        raise bad(name, f"'{name}' must be >= 1, got {opts.max_tokens}")
    kw = opts.kwargs
    for float_name in FLOAT_FIELDS:
        value = num_field(body, float_name)
        if value is not None:
            kw[float_name] = value
    top_k = int_field(body, "top_k")
    if top_k is not None:
        kw["top_k"] = top_k
    seed = seed_field(body)
    if seed is not None:
        kw["seed"] = seed
    kw["stop"] = stop_strings(body)
    kw["stop_token_ids"] = _stop_token_ids(body)
    kw["logit_bias"] = _logit_bias(body)
    kw["ignore_eos"] = bool_field(body, "ignore_eos")
    return opts


def sampling_params(opts: SamplingOptions, seed_offset: int = 0) -> SamplingParams:
    """The request's SamplingParams (choice `seed_offset` of n draws with seed + offset); max_tokens None means the
    rest of the context, which the engine's admission check resolves along with every limit of the prompt. A bad
    value is a 400 naming the SamplingParams field."""
    kwargs = dict(opts.kwargs)
    if seed_offset and kwargs.get("seed") is not None:
        kwargs["seed"] = kwargs["seed"] + seed_offset
    try:
        return SamplingParams(max_tokens=opts.max_tokens, **kwargs)
    except ValueError as exc:
        match = re.search(r"SamplingParams\.(\w+)", str(exc))
        raise APIError(400, str(exc).replace("SamplingParams.", "", 1),
                       param=match.group(1) if match else None) from exc

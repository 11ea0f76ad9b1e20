"""Parse and validate OpenAI request bodies into plain request objects and ``SamplingParams``."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gpullama.engine.admission import (
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP,
    MAX_STOP_TOKEN_IDS,
    RequestError,
    check_choices,
    check_count,
    check_messages,
)
from gpullama.sampling_params import SamplingParams

from .errors import APIError

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# message fields passed on to the chat template as given (checked in structured_request: tool calls, tool results)
PASSED_MESSAGE_FIELDS = ("tool_calls", "tool_call_id", "name", "reasoning_content", "reasoning")


@dataclass
class SamplingOptions:
    """The sampling fields of a request, type-checked but not yet bound to a prompt length."""

    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    kwargs: dict[str, Any] = field(default_factory=dict)
    logprobs_param: str = "logprobs"


@dataclass
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` body."""

    model: str | None
    messages: list[dict[str, str]]
    options: SamplingOptions
    n: int
    stream: bool
    include_usage: bool


@dataclass
class CompletionRequest:
    """A validated ``POST /v1/completions`` body; each prompt is a string or a list of token ids."""

    model: str | None
    prompts: list[str | list[int]]
    options: SamplingOptions
    n: int
    stream: bool
    include_usage: bool
    echo: bool


def _bad(name: str, message: str) -> APIError:
    return APIError(400, message, param=name)


def _admitted(check, *args) -> None:
    """Run one of the engine's admission checks; its RequestError becomes a 400 naming the field."""
    try:
        check(*args)
    except RequestError as exc:
        raise _bad(exc.param, str(exc)) from None


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"'{name}' must be an integer, got {_kind(value)} {value!r}")
    return value


def _num(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, f"'{name}' must be a number, got {_kind(value)} {value!r}")
    return value


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(name, f"'{name}' must be a boolean, got {_kind(value)} {value!r}")
    return value


def _str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _bad(name, f"'{name}' must be a string, got {_kind(value)}")
    return value


def _stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        raise _bad("stop", "'stop' must be a string or a list of strings")
    if len(value) > MAX_STOP:
        raise _bad("stop", f"'stop' takes at most {MAX_STOP} sequences, got {len(value)}")
    if not all(isinstance(s, str) for s in value):
        raise _bad("stop", "'stop' must be a string or a list of strings")
    if not all(value):
        raise _bad("stop", "'stop' sequences must not be empty strings")
    return value


def _logit_bias(body: dict) -> dict[int, float]:
    value = body.get("logit_bias")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad("logit_bias", "'logit_bias' must be an object mapping token ids to numbers")
    _admitted(check_count, "logit_bias", len(value), MAX_LOGIT_BIAS)
    out: dict[int, float] = {}
    for key, bias in value.items():
        # ASCII digits only, and few: int() of thousands of digits raises, and no vocabulary has 10**10 tokens
        if not re.fullmatch(r"[0-9]{1,10}", str(key)):
            raise _bad("logit_bias", f"'logit_bias' keys must be token ids (non-negative integers), got "
                       f"{str(key)[:20]!r}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise _bad("logit_bias", f"'logit_bias' values must be numbers, got {_kind(bias)} for token {key}")
        if not -100 <= bias <= 100:  # compared before float(): an integer of any size is refused, never overflows
            raise _bad("logit_bias", f"'logit_bias' values must be in [-100, 100], got {str(bias)[:20]} for token {key}")
        out[int(key)] = float(bias)
    return out


def _stop_token_ids(body: dict) -> list[int]:
    value = body.get("stop_token_ids")
    if value is None:
        return []
    if not isinstance(value, list):
        raise _bad("stop_token_ids", "'stop_token_ids' must be a list of integers")
    _admitted(check_count, "stop_token_ids", len(value), MAX_STOP_TOKEN_IDS)  # before looking at each item
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise _bad("stop_token_ids", "'stop_token_ids' must be a list of integers")
    return value


def _options(body: dict) -> SamplingOptions:
    """The sampling fields shared by both endpoints."""
    opts = SamplingOptions()
    max_tokens = _int(body, "max_tokens")
    max_completion_tokens = _int(body, "max_completion_tokens")
    if max_completion_tokens is not None:
        opts.max_tokens, opts.max_tokens_param = max_completion_tokens, "max_completion_tokens"
    else:
        opts.max_tokens = max_tokens
    if opts.max_tokens is not None and opts.max_tokens < 1:
        raise _bad(opts.max_tokens_param, f"'{opts.max_tokens_param}' must be >= 1, got {opts.max_tokens}")
    kw = opts.kwargs
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        value = _num(body, name)
        if value is not None:
            kw[name] = value
    top_k = _int(body, "top_k")
    if top_k is not None:
        kw["top_k"] = top_k
    seed = _int(body, "seed")
    if seed is not None:
        if not -(2**63) <= seed < 2**63:
            raise _bad("seed", f"'seed' must fit in a signed 64-bit integer, got {seed}")
        kw["seed"] = seed
    kw["stop"] = _stop(body)
    kw["stop_token_ids"] = _stop_token_ids(body)
    kw["logit_bias"] = _logit_bias(body)
    kw["ignore_eos"] = _bool(body, "ignore_eos")
    return opts


def _common(body: Any) -> tuple[str | None, int, bool, bool]:
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {_kind(body)}")
    model = _str(body, "model")
    n = _int(body, "n")
    n = 1 if n is None else n
    _admitted(check_choices, 1, n)
    stream = _bool(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise _bad("stream_options", "'stream_options' must be an object")
        include_usage = _bool(stream_options, "include_usage")
        if not stream:
            raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    return model, n, stream, include_usage


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else _kind(part)
                raise _bad(f"{where}[{j}]", f"'{where}[{j}]' must be a {{\"type\": \"text\", \"text\": ...}} part "
                           f"(only text is supported), got {kind!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad(where, f"'{where}' must be a string or a list of text parts, got {_kind(value)}")


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages", "'messages' is a required field")
    _admitted(check_messages, messages)  # list, count, objects, role strings
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise _bad(f"{where}.role", f"'{where}.role' must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        elif content is None:
            raise _bad(f"{where}.content", f"'{where}.content' is required for role {role!r}")
        entry = {"role": CHAT_ROLES[role], "content": _content(content, f"{where}.content")}
        entry.update((k, message[k]) for k in PASSED_MESSAGE_FIELDS if message.get(k) is not None)
        out.append(entry)
    return out


def parse_chat(body: Any) -> ChatRequest:
    """Validate a chat completions body; raises ``APIError`` (400) naming the bad field."""
    model, n, stream, include_usage = _common(body)
    messages = _messages(body)
    opts = _options(body)
    if _bool(body, "logprobs"):
        top = _int(body, "top_logprobs")
        top = 0 if top is None else top
        if not 0 <= top <= SamplingParams.MAX_LOGPROBS:
            raise _bad("top_logprobs", f"'top_logprobs' must be in [0, {SamplingParams.MAX_LOGPROBS}], got {top}")
        opts.kwargs["logprobs"] = top
    elif body.get("top_logprobs") is not None:
        raise _bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
    opts.logprobs_param = "top_logprobs"
    return ChatRequest(model, messages, opts, n, stream, include_usage)


def _prompts(body: dict) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("prompt", "'prompt' is a required field")

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x)

    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        _admitted(check_count, "prompt", len(prompt), MAX_N)  # a list of prompts: its length before its items
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise _bad("prompt", "'prompt' must be a string, a list of strings, a list of token ids "
                   "or a list of token-id lists (non-empty)")
    return prompts


def parse_completion(body: Any) -> CompletionRequest:
    """Validate a text completions body; raises ``APIError`` (400) naming the bad field."""
    model, n, stream, include_usage = _common(body)
    prompts = _prompts(body)
    _admitted(check_choices, len(prompts), n)
    opts = _options(body)
    logprobs = _int(body, "logprobs")
    if logprobs is not None:
        if not 0 <= logprobs <= SamplingParams.MAX_LOGPROBS:
            raise _bad("logprobs", f"'logprobs' must be in [0, {SamplingParams.MAX_LOGPROBS}], got {logprobs}")
        opts.kwargs["logprobs"] = logprobs
    echo = _bool(body, "echo")
    if echo and logprobs is not None:
        raise _bad("echo", "'echo' together with 'logprobs' is not supported (prompt log-probabilities are not computed)")
    if _str(body, "suffix"):
        raise _bad("suffix", "'suffix' is not supported")
    best_of = _int(body, "best_of")
    if best_of is not None and best_of not in (1, n):
        raise _bad("best_of", f"'best_of' other than 1 or n is not supported, got {best_of}")
    return CompletionRequest(model, prompts, opts, n, stream, include_usage, echo)


def sampling_params(opts: SamplingOptions, seed_offset: int = 0) -> SamplingParams:
    """The request's SamplingParams (choice `seed_offset` of n draws with seed + offset); max_tokens None means the
    rest of the context, which the engine's admission check resolves along with every limit of the prompt."""
    kwargs = dict(opts.kwargs)
    if seed_offset and kwargs.get("seed") is not None:
        kwargs["seed"] = kwargs["seed"] + seed_offset
    try:
        return SamplingParams(max_tokens=opts.max_tokens, **kwargs)
    except ValueError as exc:
        match = re.search(r"SamplingParams\.(\w+)", str(exc))
        name = match.group(1) if match else None
        if name == "logprobs":
            name = opts.logprobs_param
        elif name == "max_tokens":
            name = opts.max_tokens_param
        raise _bad(name, str(exc).replace("SamplingParams.", "", 1)) from exc

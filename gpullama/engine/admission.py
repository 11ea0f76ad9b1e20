"""Admission: the one check a request passes before it may join the batch (the library and the server both use it)."""

from __future__ import annotations

from dataclasses import dataclass

from gpullama.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request the engine can never run; `param` names the request field at fault (as OpenAI's errors do)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class AdmissionLimits:
    """What a request is checked against: the vocabulary, the context and the KV pool."""

    vocab_size: int
    max_model_len: int
    kv_capacity_tokens: int


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: AdmissionLimits) -> int:
    """Validate a request against the model and the engine; returns its resolved max_tokens (the rest of the
    context when `params.max_tokens` is None). Raises RequestError naming the field, the limit and both numbers."""
    n = len(prompt_token_ids)
    limit = limits.max_model_len
    vocab = limits.vocab_size
    if params.n != 1:
        raise RequestError(f"one engine request is one sample, got n={params.n}: LLM.generate/chat and the server "
                           "run n samples as n requests", "n")
    if n == 0:
        raise RequestError("the prompt is empty: it needs at least one token", "prompt")
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)]
    if bad:
        raise RequestError(f"prompt token id {bad[0]!r} is out of range: the vocabulary has {vocab} tokens", "prompt")
    for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
        outside = [t for t in ids if t >= vocab]
        if outside:
            raise RequestError(f"'{name}' holds token id {outside[0]}, outside the vocabulary of {vocab} tokens", name)
    if n >= limit:
        raise RequestError(
            f"This model's maximum context length is {limit} tokens, but the prompt has {n} tokens, leaving no room "
            f"for the completion (at most {limit - 1} prompt tokens). Please shorten the prompt.", "prompt")
    max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
    if n + max_tokens > limit:
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested {n + max_tokens} tokens "
            f"({n} in the prompt, {max_tokens} for the completion). Please reduce the prompt or 'max_tokens'.",
            "max_tokens")
    if n + max_tokens > limits.kv_capacity_tokens:
        raise RequestError(
            f"the request needs up to {n + max_tokens} tokens of KV cache but the pool holds "
            f"{limits.kv_capacity_tokens}", "max_tokens")
    return max_tokens

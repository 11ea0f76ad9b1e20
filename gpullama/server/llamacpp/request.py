"""llama.cpp's native request fields (``/completion``, ``/infill``) read into the common plan: the prompts (text,
token ids, both mixed, or a list of prompts), the sampling fields under llama.cpp's names and with its defaults,
``n_probs``, the grammar fields, and how to answer (``stream``, ``return_tokens``, ``response_fields``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpullama.fim import ExtraChunk

from ..http.errors import FieldNames
from ..http.fields import bad, bool_field, int_field, object_body, str_field
from ..pipeline.chat_plan import response_format_spec
from ..pipeline.prompts import Pieces, prompt_list
from ..pipeline.sampling import (
    MAX_N,
    OPENAI,
    Field,
    SamplingOptions,
    check_choices,
    flag,
    integer,
    logit_bias,
    max_tokens,
    number,
    sampling_params,
    seed,
    streamed,
    top_count,
)
from ..state import NO_DEFAULTS, RequestDefaults

RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: draw a seed
FIELDS = OPENAI.select("presence_penalty", "frequency_penalty", "stop", "ignore_eos", "lora").but(
    Field("n_predict", "max_tokens", max_tokens(until_full=(-1,))),
    Field("max_tokens", "max_tokens", max_tokens(until_full=(-1,)), alias=True),
    # llama.cpp's sampler defaults where a request leaves a field out (its common_params_sampling)
    Field("temperature", "temperature", number(floor=0.0), default=0.8),  # <= 0: greedy
    Field("top_k", "top_k", integer(floor=0), default=40),  # <= 0: off
    Field("top_p", "top_p", number(), default=0.95),
    Field("min_p", "min_p", number(), default=0.05),
    Field("repeat_penalty", "repetition_penalty", number()),
    Field("seed", "seed", seed(random=(-1, RANDOM_SEED))),
    Field("logit_bias", "logit_bias", logit_bias(pairs=True)),
    Field("n_probs", "logprobs", top_count(zero_is_off=True)),
    # llama.cpp's samplers gpullama has not: accepted at their "off" value, refused otherwise
    *(Field(name, None, number(), off=off) for name, off in (
        ("typical_p", 1.0), ("dynatemp_range", 0.0), ("mirostat", 0), ("dry_multiplier", 0.0),
        ("xtc_probability", 0.0), ("top_n_sigma", -1.0))),
    Field("post_sampling_probs", "logprobs_mode", flag("processed_logprobs")),
    Field("return_progress", "return_progress", streamed),
    others=FieldNames(fields=(("n", "n_cmpl"),)))
"""llama.cpp's sampling fields, under its names and with its defaults."""
NAMES = FIELDS.names
"""llama.cpp's names for the common plan's fields."""


@dataclass
class NativeRequest:
    """A validated ``/completion`` or ``/infill`` body."""

    prompts: list[list[int | str]]  # each prompt's pieces: text and token ids, in order
    options: SamplingOptions
    n_cmpl: int = 1
    stream: bool = False
    return_tokens: bool = False
    response_fields: list[str] = field(default_factory=list)
    n_probs: int = 0
    post_sampling_probs: bool = False  # n_probs after the sampler chain, as probabilities
    timings_per_token: bool = False
    settings: dict[str, Any] = field(default_factory=dict)  # the generation settings to echo


def prompts(body: dict, name: str = "prompt") -> list[Pieces]:
    """llama.cpp's prompt shapes (`gpullama.server.pipeline.prompts`): one prompt or a list of them, each as its
    pieces."""
    return prompt_list(body.get(name), name, MAX_N, media=name == "prompt")


def sampling(body: dict, tokenizer: Any, defaults: RequestDefaults = NO_DEFAULTS
             ) -> tuple[SamplingOptions, dict[str, Any]]:
    """The sampling options of a native body (the server's `defaults`, else llama.cpp's, where absent), and the
    settings to echo."""
    opts = FIELDS.read(body, tokenizer, defaults)
    params = sampling_params(opts)
    settings = {
        "n_predict": -1 if params.max_tokens is None else params.max_tokens,
        "seed": RANDOM_SEED if params.seed is None else params.seed,
        "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p,
        "repeat_penalty": params.repetition_penalty, "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty, "stop": params.stop, "ignore_eos": params.ignore_eos,
        # llama.cpp's pairs; ignore_eos shows what it adds, every end token banned (its -inf bias, null in JSON)
        "logit_bias": [{"bias": b, "token": t} for t, b in params.logit_bias.items()] + (
            [{"bias": None, "token": t} for t in sorted(tokenizer.eos_token_ids)] if params.ignore_eos else []),
        "post_sampling_probs": params.logprobs_mode == "processed_logprobs",
    }
    return opts, settings


def parse_native(body: Any, tokenizer: Any, prompt_field: str | None = "prompt",
                 defaults: RequestDefaults = NO_DEFAULTS) -> NativeRequest:
    """Validate a ``/completion`` body (``/infill``'s, with `prompt_field` None: the caller reads its prompt;
    `defaults`: the server's values of fields it leaves out); 400 naming the bad field in llama.cpp's names."""
    body = object_body(body)
    pieces = prompts(body, prompt_field) if prompt_field else [[]]
    opts, settings = sampling(body, tokenizer, defaults)
    n_cmpl = int_field(body, "n_cmpl")
    n_cmpl = 1 if n_cmpl is None else n_cmpl
    check_choices(len(pieces), n_cmpl)
    n_probs = opts.kwargs.get("logprobs", 0)
    fields = body.get("response_fields")
    if fields is not None and (not isinstance(fields, list) or not all(isinstance(f, str) for f in fields)):
        raise bad("response_fields", "'response_fields' must be a list of strings")
    spec = response_format_spec(body)
    if spec is not None:
        opts.kwargs["structured_output"] = spec
    stream = bool_field(body, "stream")
    settings.update(stream=stream, n_probs=n_probs, grammar=str_field(body, "grammar") or "",
                    max_tokens=settings["n_predict"])
    return NativeRequest(pieces, opts, n_cmpl, stream, bool_field(body, "return_tokens"), list(fields or []),
                         n_probs, settings["post_sampling_probs"], bool_field(body, "timings_per_token"), settings)


def input_extra(body: dict) -> list[ExtraChunk]:
    """``/infill``'s ``input_extra``: a list of ``{"filename": string, "text": string}`` (filename optional)."""
    value = body.get("input_extra")
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad("input_extra", "'input_extra' must be an array of {\"filename\": string, \"text\": string}")
    chunks = []
    for i, chunk in enumerate(value):
        where = f"input_extra[{i}]"
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            raise bad(where, f"'{where}' must have a \"text\" field with a string value")
        filename = chunk.get("filename", "tmp")
        if not isinstance(filename, str):
            raise bad(f"{where}.filename", f"'{where}.filename' must be a string")
        chunks.append(ExtraChunk(chunk["text"], filename))
    return chunks


def finite(x: float) -> float:
    """`x`, or the lowest float for -inf (llama.cpp writes log 0 so, as JSON has no -inf)."""
    return x if math.isfinite(x) else -3.4028234663852886e38

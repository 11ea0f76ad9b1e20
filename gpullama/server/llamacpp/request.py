"""llama.cpp's native request fields (``/completion``, ``/infill``) read into the common plan: the prompts (text,
token ids, both mixed, or a list of prompts), the sampling fields under llama.cpp's names and with its defaults,
``n_probs``, the grammar fields, and how to answer (``stream``, ``return_tokens``, ``response_fields``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gpullama.engine.admission import MAX_LOGIT_BIAS, check_count
from gpullama.fim import ExtraChunk
from gpullama.sampling_params import SamplingParams

from ..http.errors import CHAT_NAMES, FieldNames
from ..http.fields import admitted, bad, bool_field, int_field, kind, num_field, object_body, str_field
from ..pipeline.chat_plan import response_format_spec
from ..pipeline.sampling import MAX_N, SamplingOptions, check_choices, seed_field, stop_strings

NAMES: FieldNames = CHAT_NAMES.but(max_tokens="n_predict", repetition_penalty="repeat_penalty",
                                   logprobs="n_probs", n="n_cmpl")
"""llama.cpp's names for the common plan's fields."""

DEFAULTS: dict[str, float | int] = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
"""llama.cpp's sampler defaults where a request leaves a field out (its ``common_params_sampling``)."""

RANDOM_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: draw a seed

# llama.cpp's samplers gpullama has not: accepted at their "off" value, refused otherwise
_OFF = {"typical_p": 1.0, "dynatemp_range": 0.0, "mirostat": 0, "dry_multiplier": 0.0, "xtc_probability": 0.0,
        "top_n_sigma": -1.0}
_PAIRS = (("temperature", "temperature"), ("top_p", "top_p"), ("min_p", "min_p"),
          ("presence_penalty", "presence_penalty"), ("frequency_penalty", "frequency_penalty"),
          ("repeat_penalty", "repetition_penalty"))


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
    timings_per_token: bool = False
    return_progress: bool = False
    settings: dict[str, Any] = field(default_factory=dict)  # the generation settings to echo


def _is_token(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _prompt_pieces(value: Any, where: str) -> list[int | str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(_is_token(x) or isinstance(x, str) for x in value):
        return list(value)
    if isinstance(value, dict):
        raise bad(where, f"'{where}': multimodal prompts (prompt_string, multimodal_data) are not supported")
    raise bad(where, f"'{where}' must be a string, a list of token ids (strings may be mixed in), or a list of "
              "those (non-empty)")


def prompts(body: dict, name: str = "prompt") -> list[list[int | str]]:
    """llama.cpp's prompt shapes: a string, token ids (mixed with strings), or a list of prompts (strings, token
    lists, mixed lists); each prompt as its pieces."""
    value = body.get(name)
    if value is None:
        raise bad(name, f"'{name}' is a required field")
    if isinstance(value, list) and value and not any(_is_token(x) for x in value):  # a list of prompts
        admitted(check_count, name, len(value), MAX_N)
        return [_prompt_pieces(p, f"{name}[{i}]") for i, p in enumerate(value)]
    return [_prompt_pieces(value, name)]


def tokenize_pieces(tokenizer: Any, pieces: list[int | str]) -> list[int]:
    """The ids of a prompt's pieces; BOS (and EOS) as the GGUF says when the prompt opens with text (llama.cpp's
    rule), special-token names in the text parsed."""
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            ids += tokenizer.encode(piece, add_special_tokens=(i == 0))
        else:
            ids.append(piece)
    return ids


def _logit_bias(body: dict, tokenizer: Any) -> dict[int, float]:
    """llama.cpp's ``logit_bias``: ``[[token, bias], ...]`` (token an id or a string, each of its tokens biased;
    bias false bans) or OpenAI's ``{"id": bias}``."""
    value = body.get("logit_bias")
    if value is None:
        return {}
    items: list[tuple[Any, Any]]
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        items = [(p[0], p[1]) for p in value]
    else:
        raise bad("logit_bias", "'logit_bias' must be a list of [token, bias] pairs or an object of token ids to "
                  "biases")
    admitted(check_count, "logit_bias", len(items), MAX_LOGIT_BIAS)
    out: dict[int, float] = {}
    for key, bias in items:
        if bias is False:
            bias = -100.0  # banned
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad("logit_bias", f"'logit_bias' biases must be numbers in [-100, 100] or false, got {str(bias)[:20]}")
        if _is_token(key):
            ids = [key]
        elif isinstance(key, str) and key.isdigit() and len(key) <= 10 and isinstance(value, dict):
            ids = [int(key)]
        elif isinstance(key, str) and key:
            ids = tokenizer.encode(key)
        else:
            raise bad("logit_bias", f"'logit_bias' tokens must be token ids or non-empty strings, got {kind(key)}")
        for tid in ids:
            if tid >= tokenizer.vocab_size:
                raise bad("logit_bias", f"'logit_bias' token id {tid} is out of range: the vocabulary has "
                          f"{tokenizer.vocab_size} tokens")
            out[tid] = float(bias)
    return out


def sampling(body: dict, tokenizer: Any) -> tuple[SamplingOptions, dict[str, Any]]:
    """The sampling options of a native body (llama.cpp's defaults where absent), and the settings to echo."""
    opts = SamplingOptions()
    kw = opts.kwargs
    n_predict = int_field(body, "n_predict")
    if n_predict is None:
        n_predict = int_field(body, "max_tokens")
    if n_predict is not None and (n_predict == 0 or n_predict < -1):
        raise bad("n_predict", f"'n_predict' must be -1 (until the context is full) or a positive integer, got "
                  f"{n_predict}")
    opts.max_tokens = n_predict if n_predict is not None and n_predict > 0 else None
    for name, target in _PAIRS:
        value = num_field(body, name)
        if value is None:
            value = DEFAULTS.get(name)
        if value is not None:
            kw[target] = max(0.0, float(value)) if name == "temperature" else value  # <= 0: greedy
    top_k = int_field(body, "top_k")
    kw["top_k"] = max(0, DEFAULTS["top_k"] if top_k is None else top_k)  # <= 0: off
    seed = seed_field(body)
    if seed is not None and seed not in (-1, RANDOM_SEED):
        kw["seed"] = seed
    kw["stop"] = stop_strings(body)
    kw["ignore_eos"] = bool_field(body, "ignore_eos")
    kw["logit_bias"] = _logit_bias(body, tokenizer)
    for name, off in _OFF.items():
        value = num_field(body, name)
        if value is not None and value != off:
            raise bad(name, f"'{name}' is not supported (only its default, {off}, which turns it off)")
    if bool_field(body, "post_sampling_probs"):
        raise bad("post_sampling_probs", "'post_sampling_probs' is not supported (n_probs gives log-probabilities "
                  "of the model's distribution)")
    settings = {
        "n_predict": -1 if opts.max_tokens is None else opts.max_tokens,
        "seed": kw.get("seed", RANDOM_SEED),
        "temperature": kw["temperature"], "top_k": kw["top_k"], "top_p": kw["top_p"], "min_p": kw["min_p"],
        "repeat_penalty": kw.get("repetition_penalty", 1.0), "presence_penalty": kw.get("presence_penalty", 0.0),
        "frequency_penalty": kw.get("frequency_penalty", 0.0), "stop": kw["stop"], "ignore_eos": kw["ignore_eos"],
        "logit_bias": [[t, b] for t, b in kw["logit_bias"].items()],
    }
    return opts, settings


def parse_native(body: Any, tokenizer: Any, prompt_field: str | None = "prompt") -> NativeRequest:
    """Validate a ``/completion`` body (``/infill``'s, with `prompt_field` None: the caller reads its prompt);
    400 naming the bad field in llama.cpp's names."""
    body = object_body(body)
    pieces = prompts(body, prompt_field) if prompt_field else [[]]
    opts, settings = sampling(body, tokenizer)
    n_cmpl = int_field(body, "n_cmpl")
    n_cmpl = 1 if n_cmpl is None else n_cmpl
    admitted(check_choices, len(pieces), n_cmpl)
    n_probs = int_field(body, "n_probs") or 0
    if not 0 <= n_probs <= SamplingParams.MAX_LOGPROBS:
        raise bad("n_probs", f"'n_probs' must be in [0, {SamplingParams.MAX_LOGPROBS}], got {n_probs}")
    if n_probs:
        opts.kwargs["logprobs"] = n_probs
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
                         n_probs, bool_field(body, "timings_per_token"), bool_field(body, "return_progress"),
                         settings)


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

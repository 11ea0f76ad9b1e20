"""The one reader of sampling fields, for every API family: a family describes its fields in a `FieldTable` (each
field's wire name, the `SamplingParams` field it sets, how it is read, the family's default, the "off" value of a
sampler gpullama lacks), and `FieldTable.read` turns a body into `SamplingOptions`, bound into `SamplingParams` per
choice by `sampling_params`. The same table gives the family's error names (`FieldTable.names`): the layers below
raise errors in chat completions' field names (``max_tokens``, ``repetition_penalty``), which the family's boundary
renames to the wire names (``n_predict``, ``options.repeat_penalty``). Also here: the cap on choices per request."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpullama.checks import RequestError, check_count, kind
from gpullama.engine.admission import MAX_LOGIT_BIAS, MAX_STOP, MAX_STOP_TOKEN_IDS
from gpullama.sampling_params import SamplingParams

from ..http import fields
from ..http.errors import CHAT_NAMES, APIError, FieldNames
from ..http.fields import bad
from ..state import NO_DEFAULTS, RequestDefaults

MAX_N = 16  # choices per request (n, or n times the number of prompts)


@dataclass(frozen=True)
class Scope:
    """What a reader sees besides its value: the object the field lives in (for fields read together with a
    neighbour) and the model's tokenizer (for biases given as text)."""

    fields: dict
    tokenizer: Any = None


Reader = Callable[[Any, str, Scope], Any]
"""``read(value, where, scope)``: the field's value checked (a 400 naming `where` otherwise), or None to leave the
SamplingParams default. Called for absent fields too (value None), so a field may depend on a neighbour."""


@dataclass(frozen=True)
class Field:
    """One sampling field of a family's body."""

    wire: str  # its name in the family's body
    target: str | None  # the SamplingParams field it sets (the common plan's name); None: a sampler gpullama lacks
    read: Reader
    default: Any = None  # the family's value when the field is absent (llama.cpp's sampler defaults)
    off: Any = None  # target None: the value that turns the missing sampler off, the only one accepted
    alias: bool = False  # another name for a target listed before or after it: wins when given, named only then
    note: str = ""  # target None: what to use instead, said in the refusal


@dataclass
class SamplingOptions:
    """The sampling fields of a request, checked but not yet bound to a choice (seed offset) or a prompt length;
    `names` is the request's error names (its family's, with the aliases it used)."""

    max_tokens: int | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    names: FieldNames = CHAT_NAMES


@dataclass(frozen=True)
class FieldTable:
    """A family's sampling fields (`under`: the object that holds them, as Ollama's ``options``) and its other
    field renames (`others`: the prompt, the response format, tool paths)."""

    fields: tuple[Field, ...]
    under: str | None = None
    others: FieldNames = CHAT_NAMES

    def path(self, wire: str) -> str:
        """A field's name in messages (``options.temperature`` under Ollama's ``options``)."""
        return f"{self.under}.{wire}" if self.under else wire

    @property
    def names(self) -> FieldNames:
        """The family's names for the common plan's fields: each target under its first non-alias wire name."""
        renames = {}
        for f in self.fields:
            if f.target is not None and not f.alias and f.target not in renames:
                renames[f.target] = self.path(f.wire)
        return self.others.but(**{t: w for t, w in renames.items() if w != t})

    def but(self, *fields: Field, without: tuple[str, ...] = (), under: str | None = None,
            others: FieldNames | None = None) -> FieldTable:
        """This table with `fields` added first (they win over the ones that set the same target), the wire names in
        `without` left out, and (when given) another holding object and other renames."""
        kept = tuple(f for f in self.fields if f.wire not in without)
        return FieldTable(fields + kept, under or self.under, self.others if others is None else others)

    def select(self, *wires: str) -> FieldTable:
        """This table with only the fields of these wire names."""
        return FieldTable(tuple(f for f in self.fields if f.wire in wires), self.under, self.others)

    def read(self, body: dict, tokenizer: Any = None, defaults: RequestDefaults = NO_DEFAULTS) -> SamplingOptions:
        """The request's sampling options: each field read, the first of a target's names that gives a value
        winning; fields the table does not name are ignored. A target the request leaves out takes the server's
        `defaults` (``--temp``, ``--seed``, ``-n``) when it sets one, else the family's default."""
        scope_fields = body
        if self.under is not None:
            scope_fields = body.get(self.under)
            if scope_fields is None:
                scope_fields = {}
            if not isinstance(scope_fields, dict):
                raise bad(self.under, f"'{self.under}' must be an object, got {kind(scope_fields)}")
        scope = Scope(scope_fields, tokenizer)
        opts = SamplingOptions(names=self.names)
        chosen: dict[str, Field] = {}
        given: set[str] = set()  # the targets the request itself sets
        for f in self.fields:
            where = self.path(f.wire)
            value = scope_fields.get(f.wire)
            if value is not None and f.target is not None:
                given.add(f.target)
            if value is None:
                value = f.default
            value = f.read(value, where, scope)
            if f.target is None:
                if value is not None and value != f.off:
                    note = f"; {f.note}" if f.note else ""
                    raise bad(where, f"'{where}' is not supported (only {f.off!r}, which turns it off{note})")
            elif value is not None and f.target not in chosen:
                chosen[f.target] = f
                opts.kwargs[f.target] = value
        targets = {f.target for f in self.fields}
        for target, value in defaults.sampling().items():
            if target in targets and target not in given:
                opts.kwargs[target] = value
        if "lora" not in opts.kwargs:  # a named adapter's model name (vLLM), else the server's adapters (llama.cpp)
            lora = defaults.lora_for(body.get("model") if isinstance(body, dict) else None)
            if lora is not None:
                opts.kwargs["lora"] = lora
        opts.max_tokens = opts.kwargs.pop("max_tokens", None)
        used = {t: self.path(f.wire) for t, f in chosen.items() if f.alias}
        if used:
            opts.names = opts.names.but(**used)
        return opts


# ---- readers: each checks one value and names the field at fault ----------------------------------------------------

def number(floor: float | None = None) -> Reader:
    """A number; below `floor`, `floor` (llama.cpp's: a temperature <= 0 is greedy)."""
    def read(value: Any, where: str, scope: Scope) -> float | None:
        if value is None:
            return None
        value = fields.number(value, where)
        return value if floor is None else max(floor, float(value))
    return read


def integer(floor: int | None = None) -> Reader:
    """An integer; below `floor`, `floor` (llama.cpp's: a top_k <= 0 is off)."""
    def read(value: Any, where: str, scope: Scope) -> int | None:
        if value is None:
            return None
        value = fields.integer(value, where)
        return value if floor is None else max(floor, value)
    return read


def boolean(value: Any, where: str, scope: Scope) -> bool | None:
    """A boolean."""
    return None if value is None else fields.boolean(value, where)


def flag(on: Any) -> Reader:
    """A boolean that sets its target to `on` when true (llama.cpp's ``post_sampling_probs``: the processed
    log-probabilities); false leaves the target's default."""
    def read(value: Any, where: str, scope: Scope) -> Any:
        return on if boolean(value, where, scope) else None
    return read


def seed(random: tuple[int, ...] = ()) -> Reader:
    """A seed: an integer that fits in a signed 64-bit one; the values in `random` draw one (llama.cpp's -1)."""
    def read(value: Any, where: str, scope: Scope) -> int | None:
        if value is None:
            return None
        value = fields.integer(value, where)
        if value in random:
            return None
        if not -(2**63) <= value < 2**63:
            raise bad(where, f"'{where}' must fit in a signed 64-bit integer, got {value}")
        return value
    return read


def max_tokens(until_full: tuple[int, ...] = ()) -> Reader:
    """The completion's token limit: an integer >= 1; the values in `until_full` mean the rest of the context."""
    def read(value: Any, where: str, scope: Scope) -> int | None:
        if value is None:
            return None
        value = fields.integer(value, where)
        if value in until_full:
            return None
        if value < 1:
            full = f", or {' or '.join(map(str, until_full))} (until the context is full)" if until_full else ""
            raise bad(where, f"'{where}' must be >= 1{full}, got {value}")
        return value
    return read


def top_count(zero_is_off: bool = False) -> Reader:
    """How many most likely tokens to report with each token's log-probability, 0 to `SamplingParams.MAX_LOGPROBS`
    (`zero_is_off`: 0 asks for none, as llama.cpp's ``n_probs``)."""
    def read(value: Any, where: str, scope: Scope) -> int | None:
        if value is None:
            return None
        value = fields.integer(value, where)
        if not 0 <= value <= SamplingParams.MAX_LOGPROBS:
            raise bad(where, f"'{where}' must be in [0, {SamplingParams.MAX_LOGPROBS}], got {value}")
        return None if zero_is_off and value == 0 else value
    return read


def top_logprobs(flag: str) -> Reader:
    """Chat's ``top_logprobs``: counted only when the boolean `flag` (``logprobs``) is true, 0 when it is true
    alone."""
    count = top_count()

    def read(value: Any, where: str, scope: Scope) -> int | None:
        if not boolean(scope.fields.get(flag), flag, scope):
            if value is not None:
                raise bad(where, f"'{where}' requires '{flag}' to be true")
            return None
        return count(0 if value is None else value, where, scope)
    return read


def streamed(value: Any, where: str, scope: Scope) -> bool | None:
    """A boolean that counts only when the body streams (llama.cpp's ``return_progress``: progress is streamed)."""
    if not boolean(value, where, scope):
        return None
    return True if boolean(scope.fields.get("stream"), "stream", scope) else None


def stop(value: Any, where: str, scope: Scope) -> list[str] | None:
    """A stop string or a list of them (at most `MAX_STOP`, none empty)."""
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad(where, f"'{where}' must be a string or a list of strings")
    if len(value) > MAX_STOP:
        raise bad(where, f"'{where}' takes at most {MAX_STOP} sequences, got {len(value)}")
    if not all(value):
        raise bad(where, f"'{where}' sequences must not be empty strings")
    return value


def token_ids(value: Any, where: str, scope: Scope) -> list[int] | None:
    """A list of token ids (at most `MAX_STOP_TOKEN_IDS`, counted before each is looked at)."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad(where, f"'{where}' must be a list of integers")
    check_count(where, len(value), MAX_STOP_TOKEN_IDS)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise bad(where, f"'{where}' must be a list of integers")
    return value


def lora(value: Any, where: str, scope: Scope) -> list[tuple[int, float]] | None:
    """llama.cpp's per-request adapters, ``[{"id": 0, "scale": 0.5}, ...]`` (ids of GET /lora-adapters; an adapter
    left out is off; an empty list: the server's own adapters, as llama.cpp) as (id, scale) pairs."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad(where, f"'{where}' must be a list of {{\"id\", \"scale\"}} objects, got {kind(value)}")
    check_count(where, len(value), SamplingParams.MAX_LORA)
    pairs = []
    for i, entry in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise bad(at, f"'{at}' must be an object with 'id' and 'scale', got {kind(entry)}")
        adapter_id = fields.integer(entry.get("id"), f"{at}.id")
        if not 0 <= adapter_id < 2**31:
            raise bad(f"{at}.id", f"'{at}.id' must be an adapter id >= 0, got {adapter_id}")
        scale = fields.number(entry.get("scale", 0.0), f"{at}.scale")  # llama.cpp's default: 0 (off)
        pairs.append((adapter_id, float(scale)))
    return pairs or None


def _token_id_key(key: str) -> bool:
    # ASCII digits only, and few: str.isdigit() takes "²", which int() refuses, and int() of thousands of digits
    # raises; no vocabulary has 10**10 tokens
    return re.fullmatch(r"[0-9]{1,10}", key) is not None


def logit_bias(pairs: bool = False) -> Reader:
    """OpenAI's ``{"token id": bias}`` (biases in [-100, 100]); with `pairs`, llama.cpp's forms too:
    ``[[token, bias], ...]`` where a token is an id or a text (each of its tokens biased) and a bias of false bans
    it, and token ids checked against the vocabulary."""
    def read(value: Any, where: str, scope: Scope) -> dict[int, float] | None:
        if value is None:
            return None
        if isinstance(value, dict):
            items = list(value.items())
        elif pairs and isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
            items = [(p[0], p[1]) for p in value]
        else:
            shape = "a list of [token, bias] pairs or an object of token ids to biases" if pairs else \
                "an object mapping token ids to numbers"
            raise bad(where, f"'{where}' must be {shape}")
        check_count(where, len(items), MAX_LOGIT_BIAS)
        out: dict[int, float] = {}
        for key, bias in items:
            if pairs and bias is False:
                bias = -100.0  # banned
            if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise bad(where, f"'{where}' biases must be numbers, got {kind(bias)} for token {str(key)[:20]!r}")
            if not -100 <= bias <= 100:  # compared before float(): an integer of any size is refused
                raise bad(where, f"'{where}' biases must be in [-100, 100], got {str(bias)[:20]} for token "
                          f"{str(key)[:20]!r}")
            from_object = isinstance(value, dict)
            if from_object and isinstance(key, str) and _token_id_key(key):
                ids = [int(key)]
            elif from_object and isinstance(key, str) and key.isdigit():  # "²", or too many digits for a token id
                raise bad(where, f"'{where}' keys that are token ids must be at most 10 ASCII digits, got "
                          f"{key[:20]!r}")
            elif pairs and isinstance(key, int) and not isinstance(key, bool) and key >= 0:
                ids = [key]
            elif pairs and isinstance(key, str) and key:
                ids = scope.tokenizer.encode(key)
            else:
                raise bad(where, f"'{where}' keys must be token ids (non-negative integers){' or texts' * pairs}, "
                          f"got {kind(key)} {str(key)[:20]!r}")
            for tid in ids:
                if pairs and tid >= scope.tokenizer.vocab_size:
                    raise bad(where, f"'{where}' token id {tid} is out of range: the vocabulary has "
                              f"{scope.tokenizer.vocab_size} tokens")
                out[tid] = float(bias)
        return out
    return read


# ---- binding ------------------------------------------------------------------------------------------------------

def check_choices(num_prompts: int, n: int) -> None:
    """`n` choices for each of `num_prompts` prompts: n >= 1 and n times the prompts at most `MAX_N`."""
    if not 1 <= n <= MAX_N:
        raise RequestError(f"'n' must be in [1, {MAX_N}], got {n}", "n")
    if num_prompts > MAX_N:
        raise RequestError(f"'prompt' takes at most {MAX_N} prompts, got {num_prompts}", "prompt")
    if num_prompts * n > MAX_N:
        raise RequestError(f"'n' times the number of prompts must be at most {MAX_N}, got {num_prompts * n}", "n")


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
        name = match.group(1) if match else None  # quoted, so the family's names rename it in the message too
        raise APIError(400, str(exc).replace(f"SamplingParams.{name}", f"'{name}'", 1) if name else str(exc),
                       param=name) from exc


OPENAI = FieldTable((
    Field("max_completion_tokens", "max_tokens", max_tokens(), alias=True),
    Field("max_tokens", "max_tokens", max_tokens()),
    Field("temperature", "temperature", number()),
    Field("top_p", "top_p", number()),
    Field("min_p", "min_p", number()),
    Field("presence_penalty", "presence_penalty", number()),
    Field("frequency_penalty", "frequency_penalty", number()),
    Field("repetition_penalty", "repetition_penalty", number()),
    Field("top_k", "top_k", integer()),
    Field("seed", "seed", seed()),
    Field("stop", "stop", stop),
    Field("stop_token_ids", "stop_token_ids", token_ids),
    Field("logit_bias", "logit_bias", logit_bias()),
    Field("ignore_eos", "ignore_eos", boolean),
    Field("lora", "lora", lora),  # llama.cpp's, which its OpenAI-compatible endpoints read too
))
"""The sampling fields of OpenAI's bodies and the extensions vLLM takes beside them (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos); each OpenAI endpoint adds or leaves out a few (`FieldTable.but`)."""

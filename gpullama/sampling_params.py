"""Sampling parameters of one request, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gpullama.structured.spec import StructuredOutput


@dataclass
class SamplingParams:
    """How to pick tokens for one request (the field names follow vLLM's ``SamplingParams``).

    ``temperature == 0`` means greedy decoding. Invalid values raise ``ValueError`` naming the field.
    ``structured_output`` constrains the output with a grammar (a `gpullama.structured.StructuredOutput`, or a
    dict of its fields such as ``{"json_schema": {...}}``).
    """

    n: int = 1  # samples per prompt (LLM.generate/chat return them in Completion.outputs)
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    logprobs: int | None = None
    # what `logprobs` reports (vLLM's names): the model's distribution ("raw_logprobs"), or the one the sampler
    # draws from after bias, penalties, temperature, min-p, top-k and top-p ("processed_logprobs": greedy is one
    # token of probability 1; cut tokens have log 0, -inf; llama.cpp's post_sampling_probs)
    logprobs_mode: str = "raw_logprobs"
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_output: StructuredOutput | None = None
    # special (control) tokens whose text stays in the output text, which otherwise drops every special token
    # (llama.cpp's preserved_tokens): a chat format's tool-call markers, such as Mistral's [TOOL_CALLS]
    preserved_token_ids: list[int] = field(default_factory=list)
    # deliver the prompt's progress while it prefills (llama.cpp's return_progress): a delta without tokens whose
    # `num_computed_prompt_tokens` is set, before its first chunk (the prefix-cache hits) and after each chunk
    return_progress: bool = False
    # LoRA adapters for this request (llama.cpp's per-request `lora`): (adapter id, scale) pairs, the ids the engine
    # gave its adapters (`LLM.lora_adapters`, the server's GET /lora-adapters); an id given twice: the last scale;
    # scale 0 leaves it out; None or []: the base model
    lora: list[tuple[int, float]] | None = None

    MAX_LOGPROBS = 20
    MAX_LORA = 16
    LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.preserved_token_ids = list(self.preserved_token_ids or [])
        self.logit_bias = _bias_map(self.logit_bias)
        if self.lora is not None and isinstance(self.lora, (list, tuple)):
            self.lora = [tuple(p) if isinstance(p, (list, tuple)) else p for p in self.lora]
        if isinstance(self.structured_output, dict):
            try:
                self.structured_output = StructuredOutput(**self.structured_output)
            except TypeError as e:  # an unknown field name
                raise ValueError(f"SamplingParams.structured_output: {e}") from None
        self._check()

    def validate(self) -> None:
        """Check every field's type and range again (fields may have been changed since construction); raises
        ValueError naming the field. The engine's admission check calls it before a request joins the batch."""
        self._check()

    def _check(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and _finite(v)

        if not isinstance(self.return_progress, bool):
            raise bad("return_progress", "must be True or False")
        if not is_int(self.n) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 (or None for the rest of the context)")
        if not is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an integer >= 0 (0 or -1 disables it)")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise bad("seed", "must be an integer in [-2**63, 2**64) or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if not all(is_int(t) and t >= 0 for t in self.preserved_token_ids):
            raise bad("preserved_token_ids", "must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_num(value) or not -2 <= value <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be a number > 0")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= self.MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {self.MAX_LOGPROBS}] or None")
        if self.logprobs_mode not in self.LOGPROBS_MODES:
            raise bad("logprobs_mode", f"must be one of {', '.join(self.LOGPROBS_MODES)}")
        if not isinstance(self.logit_bias, dict) or not all(
                is_int(k) and k >= 0 and is_num(v) and -100 <= v <= 100 for k, v in self.logit_bias.items()):
            raise bad("logit_bias", "must map token ids (integers >= 0) to biases in [-100, 100]")
        if self.lora is not None and (not isinstance(self.lora, list) or len(self.lora) > self.MAX_LORA or not all(
                isinstance(p, tuple) and len(p) == 2 and is_int(p[0]) and 0 <= p[0] < 2**31 and is_num(p[1])
                for p in self.lora)):
            raise bad("lora", f"must be at most {self.MAX_LORA} (adapter id, scale) pairs, ids integers >= 0, "
                      "scales finite numbers")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise bad("structured_output", "must be a gpullama.structured.StructuredOutput, a dict of its fields "
                      "or None")

    @property
    def greedy(self) -> bool:
        """True when the request decodes with argmax."""
        return self.temperature == 0


def _finite(value: int | float) -> bool:
    """True for a finite number; an integer too large for a float is not one (math.isfinite would raise)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _bias_map(bias) -> dict[int, float]:
    """``logit_bias`` with integer keys and float values; a key or value that is not a number raises ValueError
    naming the field (never an OverflowError or TypeError from deep inside)."""
    if not bias:
        return {}
    if not isinstance(bias, dict):
        raise ValueError(f"SamplingParams.logit_bias must be a dict of token id to bias, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        # keys may be strings of digits (as in JSON); more than 10 digits is no token id of any vocabulary, and
        # int() of thousands of digits raises (Python's int-conversion limit)
        ok_key = (isinstance(key, int) and not isinstance(key, bool)) or (
            isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10)
        ok_value = isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
        if not (ok_key and ok_value):
            raise ValueError(f"SamplingParams.logit_bias must map token ids (integers >= 0) to biases in "
                             f"[-100, 100], got {str(key)[:20]!r}: {str(value)[:20]}")
        out[int(key)] = float(value)
    return out

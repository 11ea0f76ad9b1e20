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
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured_output: StructuredOutput | None = None

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        if isinstance(self.structured_output, dict):
            try:
                self.structured_output = StructuredOutput(**self.structured_output)
            except TypeError as e:  # an unknown field name
                raise ValueError(f"SamplingParams.structured_output: {e}") from None
        self._check()

    def _check(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

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
        if self.seed is not None and not is_int(self.seed):
            raise bad("seed", "must be an integer or None")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_num(value) or not -2 <= value <= 2:
                raise bad(name, "must be in [-2, 2]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be a number > 0")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= self.MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {self.MAX_LOGPROBS}] or None")
        if not all(-100 <= v <= 100 for v in self.logit_bias.values()):
            raise bad("logit_bias", "values must be in [-100, 100]")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise bad("structured_output", "must be a gpullama.structured.StructuredOutput, a dict of its fields "
                      "or None")

    @property
    def greedy(self) -> bool:
        """True when the request decodes with argmax."""
        return self.temperature == 0

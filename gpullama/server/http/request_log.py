"""What the access log says about one request: its tokens, time to first token, speed and finish reason, or why it
was refused.

The access-log middleware opens a `RequestRecord` for every request (a context variable, so the route code that
runs inside the request fills it without being handed it); each `Generation` adds itself, and an error response's
body gives the reason of a 4xx.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import orjson

MAX_ERROR_BODY = 8192  # bytes of an error body kept to find its message


@dataclass
class RequestRecord:
    """The generations one request ran and the body of its error response, filled while it is served."""

    generations: list[Any] = field(default_factory=list)  # gpullama.server.generation.Generation
    error_body: bytearray = field(default_factory=bytearray)

    def keep_error_body(self, chunk: bytes) -> None:
        """Keep the start of an error response's body (its message)."""
        room = MAX_ERROR_BODY - len(self.error_body)
        if room > 0:
            self.error_body += chunk[:room]

    def error_message(self) -> str | None:
        """The error message of the response body (OpenAI's or Anthropic's error object, Ollama's string), if it
        is one."""
        try:
            error = orjson.loads(bytes(self.error_body)).get("error")
        except (orjson.JSONDecodeError, AttributeError):
            return None
        if isinstance(error, str):
            return error
        if not isinstance(error, dict) or not isinstance(error.get("message"), str):
            return None
        param = error.get("param")
        return error["message"] + (f" (param {param})" if isinstance(param, str) else "")

    def describe(self, status: int, seconds: float) -> str:
        """The tail of the access line: duration, then tokens and speed of a generation, or the reason of an error."""
        text = f"{seconds * 1000:.1f}ms" if seconds < 1 else f"{seconds:.2f}s"
        if status >= 400:
            message = self.error_message()
            return f"{text}: {message}" if message else text
        if not self.generations:
            return text
        return f"{text}: " + "; ".join(_generation(gen) for gen in self.generations)


def _generation(gen: Any) -> str:
    prompt = f"prompt {gen.num_prompt_tokens} tokens"
    if gen.num_cached_tokens:
        prompt += f" ({gen.num_cached_tokens} cached)"
    parts = [prompt, f"generated {gen.num_generated_tokens} tokens"]
    if gen.first_token_at is not None:
        parts.append(f"first token {gen.first_token_at - gen.arrival:.2f}s")
        decode = gen.last_token_at - gen.first_token_at
        after_first = gen.num_generated_tokens - len(gen.jobs)  # each choice's first token comes with the prompt
        if decode > 0 and after_first > 0:
            parts.append(f"{after_first / decode:.1f} tokens/s")
    reasons = [gen.finish_reasons.get(job.index) or "aborted" for job in gen.jobs]
    parts.append("finish " + ",".join(reasons))
    return ", ".join(parts)


current_request: ContextVar[RequestRecord | None] = ContextVar("gpullama_request", default=None)

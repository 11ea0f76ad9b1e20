"""The base of every request check, under the chat layer, the engine and the server alike: the error a request
that can never run raises (`RequestError`, naming the field at fault), the cap on a list field's length, and how a
message names a JSON value's type."""

from __future__ import annotations

from typing import Any


class RequestError(ValueError):
    """A request that can never run; `param` names the request field at fault (as OpenAI's errors do).
    `n_prompt_tokens` and `n_ctx` are set when the request does not fit the context."""

    def __init__(self, message: str, param: str | None = None, n_prompt_tokens: int | None = None,
                 n_ctx: int | None = None):
        super().__init__(message)
        self.param = param
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx


def kind(value: Any) -> str:
    """A JSON value's type as a message names it (``null`` for None)."""
    return "null" if value is None else type(value).__name__


def check_count(name: str, count: int, limit: int) -> None:
    """Refuse a list field holding more than `limit` items (checked before its items are looked at)."""
    if count > limit:
        raise RequestError(f"'{name}' holds {count} items; at most {limit} are allowed", name)

"""API errors: one exception type, each API family's names for the common plan's fields, and each family's error
shape (OpenAI's, Anthropic's, Ollama's), applied at one boundary: where an error becomes a response or a stream's
error event.

Everything below the API modules (the chat plan, the sampling fields, the engine's admission check) raises errors
in chat completions' field names (``messages``, ``max_tokens``, ``tools[0].function.parameters``,
``response_format``). Each API module says how it names those fields (`FieldNames`); the boundary renames the
error's ``param`` and the field names in its message, then writes it in the family's shape (`ErrorStyle`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import orjson

from gpullama.checks import RequestError

_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}
_ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "api_error",
}


class APIError(Exception):
    """An error answered to the client (in its API's shape): status, message, the field at fault, a code."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, extra: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}
        self.extra = extra or {}  # more fields of the error object (llama.cpp's n_prompt_tokens and n_ctx)

    def body(self) -> dict:
        """The OpenAI error object (with the extra fields)."""
        body = error_body(self.status, self.message, param=self.param, code=self.code)
        body["error"].update(self.extra)
        return body


def request_error(exc: RequestError) -> APIError:
    """A request the layers below refused (`RequestError`, in the common plan's field names) as its 400; one that
    does not fit the context says so as llama.cpp does, with ``n_prompt_tokens`` and ``n_ctx`` fields."""
    extra = {"n_prompt_tokens": exc.n_prompt_tokens, "n_ctx": exc.n_ctx} if exc.n_ctx is not None else None
    return APIError(400, str(exc), param=exc.param, extra=extra)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    """Build OpenAI's error object for an HTTP status."""
    return {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def internal_error(request_id: str, code: str = "internal_error") -> APIError:
    """The 500 a client sees for a failure on our side: only "internal error" and the request id that finds the
    detail in the server's log (exception text can carry paths, data of other requests, or internals)."""
    return APIError(500, f"internal error (request id {request_id})", code=code)


@dataclass(frozen=True)
class FieldNames:
    """One API's names for the common plan's fields.

    `fields`: a field (and the paths under it) renamed, ``("max_tokens", "max_output_tokens")``; in the message
    only where it is quoted (``'max_tokens'``), so prose such as "the prompt is empty" stays as written. `paths`:
    regular expressions over field paths, renamed in the ``param`` and anywhere in the message
    (``tools[0].function.parameters`` -> ``tools[0].parameters``). The renames are written so that the API's own
    names never match them: errors the API module raised itself pass through unchanged.
    """

    fields: tuple[tuple[str, str], ...] = ()
    paths: tuple[tuple[str, str], ...] = ()
    _compiled: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        first = dict(reversed(self.fields))  # a field renamed twice: the first rename (`but`'s) wins
        object.__setattr__(self, "fields", tuple((old, first[old]) for old in dict.fromkeys(o for o, _ in self.fields)))
        compiled = [(re.compile(rf"(?<![\w.\]])'{re.escape(old)}(?=['.\[])"), f"'{new}") for old, new in self.fields]
        compiled += [(re.compile(pattern), new) for pattern, new in self.paths]
        object.__setattr__(self, "_compiled", tuple(compiled))

    def but(self, **fields: str) -> FieldNames:
        """These names with more field renames, taking precedence (a request's own choice, such as
        ``max_completion_tokens`` for ``max_tokens``)."""
        return FieldNames(tuple(fields.items()) + self.fields, self.paths)

    def param(self, param: str | None) -> str | None:
        """The API's name of a field path."""
        if not param:
            return param
        for old, new in self.fields:
            if param == old or param.startswith((old + ".", old + "[")):
                param = new + param[len(old):]
                break
        for pattern, new in self._compiled[len(self.fields):]:
            param = pattern.sub(new, param)
        return param

    def message(self, message: str) -> str:
        """The message with the API's field names."""
        for pattern, new in self._compiled:
            message = pattern.sub(new, message)
        return message

    def apply(self, error: APIError) -> APIError:
        """`error` in this API's names (the same object when nothing changes)."""
        param, message = self.param(error.param), self.message(error.message)
        if param == error.param and message == error.message:
            return error
        return APIError(error.status, message, param=param, code=error.code, headers=error.headers, extra=error.extra)


CHAT_NAMES = FieldNames()
"""The common plan's own names (chat completions')."""


class ErrorStyle:
    """How one API family writes an error body."""

    name = "openai"

    def body(self, error: APIError) -> dict:
        """The error object of this family."""
        return error.body()

    def bytes(self, error: APIError) -> bytes:
        """The error object serialised."""
        return orjson.dumps(self.body(error))


def _named(error: APIError) -> str:
    """The message, naming the field when it does not already (for shapes without a ``param``)."""
    if error.param and error.param not in error.message:
        return f"{error.message} (field '{error.param}')"
    return error.message


class AnthropicErrorStyle(ErrorStyle):
    """Anthropic's ``{"type": "error", "error": {"type", "message"}}`` (the field at fault named in the message)."""

    name = "anthropic"

    def body(self, error: APIError) -> dict:
        kind = _ANTHROPIC_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
        return {"type": "error", "error": {"type": kind, "message": _named(error)}}


class OllamaErrorStyle(ErrorStyle):
    """Ollama's ``{"error": "message"}`` (the field at fault named in the message)."""

    name = "ollama"

    def body(self, error: APIError) -> dict:
        return {"error": _named(error)}


OPENAI, ANTHROPIC, OLLAMA = ErrorStyle(), AnthropicErrorStyle(), OllamaErrorStyle()
_PREFIXES = (("/v1/messages", ANTHROPIC), ("/api/", OLLAMA))


def style_for_path(path: str) -> ErrorStyle:
    """The error shape of the API family a request path belongs to (OpenAI's unless Anthropic's or Ollama's)."""
    return next((style for prefix, style in _PREFIXES if path.startswith(prefix)), OPENAI)


def error_bytes(status: int, message: str, *, param: str | None = None, code: str | None = None,
                path: str = "/") -> bytes:
    """The error object of `path`'s API family, serialised."""
    return style_for_path(path).bytes(APIError(status, message, param=param, code=code))

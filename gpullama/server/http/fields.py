"""Typed reads of JSON request fields, each refusal one 400 naming the field (every API module uses them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpullama.engine.admission import RequestError

from .errors import APIError


def bad(name: str | None, message: str) -> APIError:
    """A 400 naming the field at fault."""
    return APIError(400, message, param=name)


def kind(value: Any) -> str:
    """A JSON value's type as a message names it."""
    return "null" if value is None else type(value).__name__


def admitted(check: Callable[..., None], *args: Any) -> None:
    """Run one of the admission checks; its RequestError becomes a 400 naming the field."""
    try:
        check(*args)
    except RequestError as exc:
        raise bad(exc.param, str(exc)) from None


def object_body(body: Any) -> dict:
    """The request body, which must be a JSON object."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {kind(body)}")
    return body


def int_field(body: dict, name: str, where: str | None = None) -> int | None:
    """An integer field (None when absent); `where` is its name in messages (`name` by default)."""
    value, where = body.get(name), where or name
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(where, f"'{where}' must be an integer, got {kind(value)} {value!r}")
    return value


def num_field(body: dict, name: str, where: str | None = None) -> float | None:
    """A number field (None when absent)."""
    value, where = body.get(name), where or name
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(where, f"'{where}' must be a number, got {kind(value)} {value!r}")
    return value


def bool_field(body: dict, name: str, default: bool = False, where: str | None = None) -> bool:
    """A boolean field (`default` when absent or null)."""
    value, where = body.get(name), where or name
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(where, f"'{where}' must be a boolean, got {kind(value)} {value!r}")
    return value


def str_field(body: dict, name: str, where: str | None = None) -> str | None:
    """A string field (None when absent)."""
    value, where = body.get(name), where or name
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad(where, f"'{where}' must be a string, got {kind(value)}")
    return value

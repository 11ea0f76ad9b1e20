"""Typed reads of JSON request fields, each refusal one 400 naming the field (every API module uses them; a
`gpullama.checks.RequestError` from the layers below is answered as the same 400)."""

from __future__ import annotations

from typing import Any

from gpullama.checks import kind

from .errors import APIError


def bad(name: str | None, message: str) -> APIError:
    """A 400 naming the field at fault."""
    return APIError(400, message, param=name)


def object_body(body: Any) -> dict:
    """The request body, which must be a JSON object."""
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {kind(body)}")
    return body


def integer(value: Any, where: str) -> int:
    """`value`, which must be an integer (not a boolean)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(where, f"'{where}' must be an integer, got {kind(value)} {value!r}")
    return value


def number(value: Any, where: str) -> int | float:
    """`value`, which must be a number (not a boolean)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(where, f"'{where}' must be a number, got {kind(value)} {value!r}")
    return value


def boolean(value: Any, where: str) -> bool:
    """`value`, which must be a boolean."""
    if not isinstance(value, bool):
        raise bad(where, f"'{where}' must be a boolean, got {kind(value)} {value!r}")
    return value


def string(value: Any, where: str) -> str:
    """`value`, which must be a string."""
    if not isinstance(value, str):
        raise bad(where, f"'{where}' must be a string, got {kind(value)}")
    return value


def int_field(body: dict, name: str, where: str | None = None) -> int | None:
    """An integer field (None when absent); `where` is its name in messages (`name` by default)."""
    value = body.get(name)
    return None if value is None else integer(value, where or name)


def num_field(body: dict, name: str, where: str | None = None) -> float | None:
    """A number field (None when absent)."""
    value = body.get(name)
    return None if value is None else number(value, where or name)


def bool_field(body: dict, name: str, default: bool = False, where: str | None = None) -> bool:
    """A boolean field (`default` when absent or null)."""
    value = body.get(name)
    return default if value is None else boolean(value, where or name)


def str_field(body: dict, name: str, where: str | None = None) -> str | None:
    """A string field (None when absent)."""
    value = body.get(name)
    return None if value is None else string(value, where or name)

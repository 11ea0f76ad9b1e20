"""Chat messages as `LLM.chat` and every chat endpoint take them: the shape checked once, before the template."""

from __future__ import annotations

from typing import Any

from gpullama.engine.admission import RequestError, check_count

MAX_MESSAGES = 2048  # chat messages, as the OpenAI API allows
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")  # the roles chat templates know


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def check_messages(messages: Any) -> None:
    """A chat: a non-empty list of at most `MAX_MESSAGES` objects, each with a `role` string from
    `MESSAGE_ROLES`; `content` is a string, a list of parts, or absent. Raises RequestError naming the field
    (``messages[3].role``)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(f"'messages' must be a non-empty list of message objects, got {_kind(messages)}",
                           "messages")
    check_count("messages", len(messages), MAX_MESSAGES)
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"'{where}' must be an object, got {_kind(message)}", where)
        role = message.get("role")
        if not isinstance(role, str) or role not in MESSAGE_ROLES:
            shown = repr(role) if isinstance(role, str) else _kind(role)
            raise RequestError(f"'{where}.role' must be one of {list(MESSAGE_ROLES)}, got {shown[:40]}",
                               f"{where}.role")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"'{where}.content' must be a string or a list of parts, got {_kind(content)}",
                               f"{where}.content")

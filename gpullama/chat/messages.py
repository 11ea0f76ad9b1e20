"""Chat messages as `LLM.chat` and every chat endpoint take them: the shape checked once, before the template
(`check_messages`), and the pieces every API family's converter into that shape reads its own list with
(`message_items`, `role_of`, `text_of`), so each family only says what is its own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gpullama.checks import RequestError, check_count, kind

MAX_MESSAGES = 2048  # chat messages, as the OpenAI API allows
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")  # the roles chat templates know


def message_items(value: Any, name: str = "messages") -> Iterator[tuple[str, dict]]:
    """The items of a message list, each with its path (``messages[3]``): a non-empty list of at most
    `MAX_MESSAGES` objects (its length checked before any item is looked at). Raises RequestError naming the
    field."""
    if not isinstance(value, list) or not value:
        raise RequestError(f"'{name}' must be a non-empty list of message objects, got {kind(value)}", name)
    check_count(name, len(value), MAX_MESSAGES)
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, dict):
            raise RequestError(f"'{where}' must be an object, got {kind(item)}", where)
        yield where, item


def role_of(item: dict, where: str, roles: tuple[str, ...] | list[str] = MESSAGE_ROLES) -> str:
    """An item's ``role``: a string from `roles`."""
    role = item.get("role")
    if not isinstance(role, str) or role not in roles:
        shown = repr(role) if isinstance(role, str) else kind(role)
        raise RequestError(f"'{where}.role' must be one of {list(roles)}, got {shown[:40]}", f"{where}.role")
    return role


def text_of(value: Any, where: str, part_types: tuple[str, ...] = ("text",)) -> str:
    """A content: a string, or a list of text parts (``{"type": one of part_types, "text": ...}``) joined with
    newlines. Any other part (an image, a file) is refused by its path: these models read text only."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise RequestError(f"'{where}' must be a string or a list of text parts, got {kind(value)}", where)
    texts = []
    for j, part in enumerate(value):
        if not isinstance(part, dict) or part.get("type") not in part_types or not isinstance(part.get("text"), str):
            shown = part.get("type") if isinstance(part, dict) else kind(part)
            raise RequestError(f"'{where}[{j}]' must be a text part ({{\"type\": {' or '.join(map(repr, part_types))}, "
                               f"\"text\": ...}}; only text is supported here), got {str(shown)[:40]!r}", f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def check_messages(messages: Any) -> None:
    """A chat: a non-empty list of at most `MAX_MESSAGES` objects, each with a `role` string from
    `MESSAGE_ROLES`; `content` is a string, a list of parts, or absent. Raises RequestError naming the field
    (``messages[3].role``). Every API family runs it on the chat its body converted to, `LLM.chat` on its
    argument."""
    for where, message in message_items(messages):
        role_of(message, where)
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestError(f"'{where}.content' must be a string or a list of parts, got {kind(content)}",
                               f"{where}.content")

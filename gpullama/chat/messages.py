"""Chat messages as `LLM.chat` and every chat endpoint take them: the shape checked once, before the template
(`check_messages`), and the pieces every API family's converter into that shape reads its own list with
(`message_items`, `role_of`, `text_of`), so each family only says what is its own."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gpullama.checks import RequestError, check_count, kind
from gpullama.vision.images import ImageRef

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


IMAGE_PART_TYPES = ("image_url", "input_image", "image")


def image_part(part: Any, where: str) -> ImageRef | None:
    """The image of a content part in any API's shape, not yet loaded (None: not an image part). OpenAI's
    ``{"type": "image_url", "image_url": {"url": ...}}`` (or the URL as a string), the Responses API's
    ``{"type": "input_image", "image_url": ...}``, Anthropic's ``{"type": "image", "source": {"type": "base64",
    "data": ...} | {"type": "url", "url": ...}}``, and the library's ``{"type": "image", "image": path | bytes | PIL
    image | data URL}`` (transformers' ``url`` and ``path`` keys too). The URL is a data URL, raw base64, or an
    http(s) or file URL the server's policy may allow; RequestError naming the part when it has no image."""
    if not isinstance(part, dict) or part.get("type") not in IMAGE_PART_TYPES:
        return None
    kind_ = part["type"]
    if kind_ in ("image_url", "input_image"):
        value = part.get("image_url")
        if isinstance(value, dict):
            value, where = value.get("url"), f"{where}.image_url.url"
        else:
            where = f"{where}.image_url"
    elif isinstance(part.get("source"), dict):
        source = part["source"]
        if source.get("type") == "base64":
            value, where = source.get("data"), f"{where}.source.data"
        elif source.get("type") == "url":
            value, where = source.get("url"), f"{where}.source.url"
        else:
            raise RequestError(f"'{where}.source.type' must be 'base64' or 'url', got {source.get('type')!r:.40}",
                               f"{where}.source.type")
    else:
        key = next((k for k in ("image", "url", "path") if part.get(k) is not None), "image")
        value, where = part.get(key), f"{where}.{key}"
    if value is None or (isinstance(value, str) and not value.strip()):
        raise RequestError(f"'{where}' must hold the image (a data URL or base64)", where)
    return ImageRef(value, where)


def content_of(value: Any, where: str, part_types: tuple[str, ...] = ("text",)) -> str | list[dict]:
    """A content as `text_of` reads it, except that image parts (`image_part`, any API's shape) are kept: a
    content with images becomes a list of ``{"type": "text", "text": ...}`` and ``{"type": "image", "image":
    ImageRef}`` parts (the chat template places them), one without stays a string."""
    if not isinstance(value, list) or not any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                              for p in value):
        return text_of(value, where, part_types)
    parts: list[dict] = []
    for j, part in enumerate(value):
        ref = image_part(part, f"{where}[{j}]")
        if ref is not None:
            parts.append({"type": "image", "image": ref})
        elif isinstance(part, dict) and part.get("type") in part_types and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            shown = part.get("type") if isinstance(part, dict) else kind(part)
            raise RequestError(f"'{where}[{j}]' must be a text or image part, got {str(shown)[:40]!r}",
                               f"{where}[{j}]")
    return parts


def chat_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[ImageRef]]:
    """The messages as the chat template takes them, each image part (any API's shape, `image_part`) as
    ``{"type": "image"}``, and the images in the order they appear. Messages without images stay as they are."""
    refs: list[ImageRef] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in IMAGE_PART_TYPES
                                             for p in content):
            parts = []
            for j, part in enumerate(content):
                ref = part.get("image") if isinstance(part, dict) and isinstance(part.get("image"), ImageRef) \
                    else image_part(part, f"messages[{i}].content[{j}]")
                if ref is None:
                    parts.append(part)
                else:
                    refs.append(ref)
                    parts.append({"type": "image"})
            message = {**message, "content": parts}
        out.append(message)
    return out, refs


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

"""Prompt inputs in llama.cpp's shapes, read once for every route that takes them (``/completion``'s ``prompt``,
the embeddings' ``input`` and ``content``): a string; token ids; both mixed (``[12, "text", 34]``: each string
after the first piece tokenized without BOS and spliced in place); ``{"prompt_string": ...}`` (a string or a mixed
list); for embeddings also ``{"content": [{"type": "text", "text": ...}]}`` (the parts joined as they are); or a
list of those. Each prompt is read as its pieces, text and token ids in order."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpullama.checks import check_count, kind
from gpullama.vision.images import ImageRef

from ..http.fields import bad

Pieces = list[Any]
"""One prompt: its text and token-id pieces, in order (or one `MediaPrompt`)."""

MEDIA_MARKER = "<__media__>"
"""Where each of ``multimodal_data``'s images goes in ``prompt_string`` (llama.cpp's ``mtmd_default_marker()``)."""


@dataclass
class MediaPrompt:
    """``{"prompt_string": text, "multimodal_data": [base64, ...]}``: the text with one `MEDIA_MARKER` per image."""

    text: str
    images: list[ImageRef]


def is_token(value: Any) -> bool:
    """A token id: a non-negative integer (not a boolean)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _text_parts(value: Any, where: str) -> str:
    """An OpenAI content list's text parts, joined as they are; any other part is a 400 (text-only models)."""
    if not isinstance(value, list) or not value:
        raise bad(where, f"'{where}' must be a non-empty list of {{\"type\": \"text\", \"text\": ...}} parts")
    text = ""
    for i, part in enumerate(value):
        here = f"{where}[{i}]"
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            shown = part.get("type") if isinstance(part, dict) else kind(part)
            raise bad(here, f"'{here}' must be a {{\"type\": \"text\", \"text\": ...}} part (this model reads text "
                      f"only), got {str(shown)[:40]!r}")
        text += part["text"]
    return text


def prompt_pieces(value: Any, where: str, content: bool = False, media: bool = False) -> Pieces:
    """One prompt as its pieces (`content`: OpenAI content objects taken too; `media`: ``multimodal_data`` taken,
    as one `MediaPrompt`); a 400 naming `where` otherwise."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(is_token(x) or isinstance(x, str) for x in value):
        return list(value)
    if isinstance(value, dict):
        if value.get("multimodal_data") is not None:
            if not media:
                raise bad(where, f"'{where}' carries multimodal_data, which only /completion reads")
            data, text = value["multimodal_data"], value.get("prompt_string")
            if not isinstance(text, str):
                raise bad(f"{where}.prompt_string", f"'{where}.prompt_string' must be a string with one "
                          f"{MEDIA_MARKER} per image")
            if not isinstance(data, list) or not all(isinstance(d, str) for d in data):
                raise bad(f"{where}.multimodal_data", f"'{where}.multimodal_data' must be a list of base64 strings")
            if text.count(MEDIA_MARKER) != len(data):
                raise bad(f"{where}.multimodal_data", f"'{where}.prompt_string' has {text.count(MEDIA_MARKER)} "
                          f"{MEDIA_MARKER} markers for {len(data)} multimodal_data items")
            return [MediaPrompt(text, [ImageRef(d, f"{where}.multimodal_data[{i}]") for i, d in enumerate(data)])]
        if "prompt_string" in value and not isinstance(value["prompt_string"], dict):
            return prompt_pieces(value["prompt_string"], where)
        if content and "content" in value:
            return [_text_parts(value["content"], f"{where}.content")]
    forms = ", {\"content\": [text parts]}" if content else ""
    raise bad(where, f"'{where}' must be a string, a non-empty list of token ids (strings may be mixed in), or "
              f"{{\"prompt_string\": ...}}{forms}; got {kind(value)}")


def prompt_list(value: Any, name: str, limit: int, content: bool = False, mixed: bool = True,
                media: bool = False) -> list[Pieces]:
    """The prompts of a field (at most `limit`): one prompt, or a list of them. A list that holds a token id is one
    prompt when `mixed` (llama.cpp's rule), or only when every item is a token id (OpenAI's: ``["a", 3]`` is then
    two inputs, the second a 400)."""
    if value is None:
        raise bad(name, f"'{name}' is a required field")
    one = isinstance(value, list) and value and (
        any(is_token(x) for x in value) if mixed else all(is_token(x) for x in value))
    if isinstance(value, list) and value and not one:
        check_count(name, len(value), limit)
        return [prompt_pieces(p, f"{name}[{i}]", content, media) for i, p in enumerate(value)]
    return [prompt_pieces(value, name, content, media)]


def tokenize_pieces(tokenizer: Any, pieces: Pieces) -> list[int]:
    """The ids of a prompt's pieces; BOS (and EOS) as the GGUF says when the prompt opens with text (llama.cpp's
    rule), special-token names in the text parsed."""
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if isinstance(piece, str):
            ids += tokenizer.encode(piece, add_special_tokens=(i == 0))
        else:
            ids.append(piece)
    return ids

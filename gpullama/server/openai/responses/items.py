"""The output items of a ``/v1/responses`` answer, built as the answer's text arrives, with the typed stream events
each piece settles.

The text is read by the chat path's `ChatOutputShaper` (reasoning, content, tool calls; the same result for any
split of the text) and becomes, in the order it is written: a ``reasoning`` item (the model's ``<think>`` text), an
assistant ``message`` item (one ``output_text`` part) and one ``function_call`` item per call. One item is open at
a time, as OpenAI streams them: it is announced (``response.output_item.added``), grows by deltas and is closed
(``...done`` events, ``response.output_item.done``) before the next one opens. The non-streamed answer runs the
same steps and drops the events, so both give the same items.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ...pipeline.chat_output import ChatOutputShaper

Event = tuple[str, dict[str, Any]]  # (event type, its fields besides type and sequence_number)

# per item kind: (id prefix, text delta event, text done event)
_KINDS = {
    "message": ("msg", "response.output_text.delta", "response.output_text.done"),
    "reasoning": ("rs", "response.reasoning_text.delta", "response.reasoning_text.done"),
    "function_call": ("fc", "response.function_call_arguments.delta", "response.function_call_arguments.done"),
}


def output_text_part(text: str) -> dict:
    """An ``output_text`` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class OutputItem:
    """One output item: its kind, id, place in `output`, text (message or reasoning text, or call arguments),
    and for a call its call id and function name."""

    kind: str
    index: int
    id: str = ""
    text: str = ""
    call_id: str = ""
    name: str = ""
    status: str = "in_progress"

    def __post_init__(self) -> None:
        self.id = self.id or f"{_KINDS[self.kind][0]}_{uuid.uuid4().hex}"

    def part(self, text: str | None = None) -> dict:
        """The item's one content part (message and reasoning items)."""
        text = self.text if text is None else text
        return output_text_part(text) if self.kind == "message" else {"type": "reasoning_text", "text": text}

    def to_dict(self, with_content: bool = True) -> dict:
        """The item as the API writes it (content left empty when it is first announced)."""
        if self.kind == "function_call":
            return {"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name,
                    "arguments": self.text, "status": self.status}
        content = [self.part()] if with_content else []
        if self.kind == "reasoning":
            return {"type": "reasoning", "id": self.id, "summary": [], "content": content, "status": self.status}
        return {"type": "message", "id": self.id, "status": self.status, "role": "assistant", "content": content}


class OutputItems:
    """The items of one answer as its text arrives (`feed`), then ended (`end`); each step returns its events."""

    def __init__(self, shaper: ChatOutputShaper | None) -> None:
        self.shaper = shaper  # None: the text is plain content (no tools offered, no reasoning)
        self.items: list[OutputItem] = []
        self._open: OutputItem | None = None
        self._calls: dict[int, OutputItem] = {}  # tool call index -> its item

    def output(self) -> list[dict]:
        """The ``output`` list as it stands."""
        return [item.to_dict() for item in self.items]

    def feed(self, text: str) -> list[Event]:
        """Take the next piece of the answer's text."""
        if not text:
            return []
        fields = self.shaper.delta(0, text) if self.shaper is not None else {"content": text}
        return self._add(fields)

    def end(self, status: str) -> list[Event]:
        """The answer ended (`status` ``completed`` or ``incomplete``): settle the text held back, close the open
        item with `status` (the others are complete), and give an answer without any item an empty message."""
        events = self._add(self.shaper.finish(0)) if self.shaper is not None else []
        if not self.items:
            events += self._start("message")
        return events + self._close(status)

    def fail(self) -> list[dict]:
        """The ``output`` of an answer that failed midway: the open item is incomplete."""
        if self._open is not None:
            self._open.status = "incomplete"
        return self.output()

    def _add(self, fields: dict[str, Any] | None) -> list[Event]:
        events: list[Event] = []
        if not fields:
            return events
        if fields.get("reasoning"):
            events += self._text("reasoning", fields["reasoning"])
        if fields.get("content"):
            events += self._text("message", fields["content"])
        for piece in fields.get("tool_calls", ()):
            item = self._calls.get(piece["index"])
            if item is None:
                events += self._start("function_call", call_id=piece["id"], name=piece["function"]["name"])
                item = self._calls[piece["index"]] = self.items[-1]
            arguments = piece["function"].get("arguments", "")
            if arguments:
                item.text += arguments
                events.append((_KINDS["function_call"][1], {"item_id": item.id, "output_index": item.index,
                                                            "delta": arguments}))
        return events

    def _text(self, kind: str, text: str) -> list[Event]:
        """Text for a message or reasoning item: the open one of that kind, or a new one."""
        events = [] if self._open is not None and self._open.kind == kind else self._start(kind)
        item = self._open
        item.text += text
        events.append((_KINDS[kind][1], {**self._where(item), "delta": text, **_logprobs(kind)}))
        return events

    def _start(self, kind: str, **fields: str) -> list[Event]:
        events = self._close("completed")
        item = self._open = OutputItem(kind, len(self.items), **fields)
        self.items.append(item)
        events.append(("response.output_item.added", {"output_index": item.index,
                                                      "item": item.to_dict(with_content=False)}))
        if kind != "function_call":
            events.append(("response.content_part.added", {**self._where(item), "part": item.part("")}))
        return events

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        if item.kind == "function_call":
            events = [(_KINDS[item.kind][2], {"item_id": item.id, "output_index": item.index,
                                              "arguments": item.text})]
        else:
            events = [(_KINDS[item.kind][2], {**self._where(item), "text": item.text, **_logprobs(item.kind)}),
                      ("response.content_part.done", {**self._where(item), "part": item.part()})]
        return events + [("response.output_item.done", {"output_index": item.index, "item": item.to_dict()})]

    @staticmethod
    def _where(item: OutputItem) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": item.index, "content_index": 0}


def _logprobs(kind: str) -> dict[str, list]:
    return {"logprobs": []} if kind == "message" else {}

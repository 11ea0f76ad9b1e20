"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API over the common chat plan.

The answer's text is read by `ChatOutputShaper` (reasoning, content, tool calls; the same for any split) into
content blocks in the order the model wrote them: ``thinking``, ``text``, ``tool_use``. One block is open at a
time, as Anthropic streams them. The stream is typed server-sent events: ``message_start``, ``ping``, then per
block ``content_block_start``, its ``content_block_delta`` events (``thinking_delta``, ``text_delta``,
``input_json_delta``) and ``content_block_stop``, then ``message_delta`` (stop reason, usage) and
``message_stop``; an error midway is an ``error`` event in Anthropic's shape.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gpullama.chat.model_format import chat_format

from ..http.body import JSONResponse, off_loop_if_large, parse_json
from ..http.errors import ANTHROPIC, APIError, internal_error
from ..http.streaming import ClientDisconnected, StreamResponse, typed_event, unless_disconnected
from ..pipeline.chat_output import ChatOutputShaper
from ..pipeline.chat_plan import ChatPlan, image_input, plan_chat, render_planned_chat
from ..pipeline.generation import Generation, Job, start_generation
from ..pipeline.intake import model_fields, read_and_prepare, read_request_body
from ..pipeline.sampling import sampling_params
from ..registry import answer_name, use_model
from ..state import ServerState, check_model, require_ready, server_state
from .request import NAMES, MessagesRequest, parse_messages_body

log = logging.getLogger("gpullama.server")
Event = tuple[str, dict[str, Any]]
_DELTAS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
           "tool_use": ("input_json_delta", "partial_json")}


class ContentBlocks:
    """The content blocks of one answer as its text arrives (`feed`), then ended (`end`); each step returns the
    stream events it settles (the whole answer runs the same steps and keeps only `content()`)."""

    def __init__(self, shaper: ChatOutputShaper | None) -> None:
        self.shaper = shaper  # None: the text is plain content (no tools, no reasoning)
        self.blocks: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._calls: dict[int, dict[str, Any]] = {}  # tool call index -> its block
        self.called = False

    def feed(self, text: str) -> list[Event]:
        """Take the next piece of the answer's text."""
        if not text:
            return []
        return self._add(self.shaper.delta(0, text) if self.shaper is not None else {"content": text})

    def end(self) -> list[Event]:
        """The answer ended: settle what the shaper held back and close the open block."""
        events = self._add(self.shaper.finish(0)) if self.shaper is not None else []
        return events + self._close()

    def content(self) -> list[dict[str, Any]]:
        """The ``content`` list: each block whole (a call's ``input`` parsed from its JSON)."""
        out = []
        for block in self.blocks:
            if block["type"] == "tool_use":
                try:
                    arguments = json.loads(block["json"] or "{}")
                except ValueError:  # a call cut by max_tokens
                    arguments = {}
                out.append({"type": "tool_use", "id": block["id"], "name": block["name"],
                            "input": arguments if isinstance(arguments, dict) else {}})
            elif block["type"] == "thinking":
                out.append({"type": "thinking", "thinking": block["thinking"], "signature": ""})
            else:
                out.append({"type": "text", "text": block["text"]})
        return out

    def _add(self, fields: dict[str, Any] | None) -> list[Event]:
        events: list[Event] = []
        if not fields:
            return events
        if fields.get("reasoning"):
            events += self._text("thinking", fields["reasoning"])
        if fields.get("content"):
            events += self._text("text", fields["content"])
        for piece in fields.get("tool_calls", ()):
            block = self._calls.get(piece["index"])
            if block is None:
                events += self._start({"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:24]}",
                                        "name": piece["function"]["name"], "json": ""})
                block = self._calls[piece["index"]] = self._open
                self.called = True
            arguments = piece["function"].get("arguments", "")
            if arguments:
                block["json"] += arguments
                events.append(self._delta(block, arguments))
        return events

    def _text(self, kind: str, text: str) -> list[Event]:
        events = [] if self._open is not None and self._open["type"] == kind else self._start({"type": kind, kind: ""})
        self._open[kind] += text
        return events + [self._delta(self._open, text)]

    def _delta(self, block: dict[str, Any], text: str) -> Event:
        kind, key = _DELTAS[block["type"]]
        return "content_block_delta", {"type": "content_block_delta", "index": block["index"],
                                       "delta": {"type": kind, key: text}}

    def _start(self, block: dict[str, Any]) -> list[Event]:
        events = self._close()
        block["index"] = len(self.blocks)
        self.blocks.append(block)
        self._open = block
        if block["type"] == "tool_use":
            first = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
        elif block["type"] == "thinking":
            first = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            first = {"type": "text", "text": ""}
        return events + [("content_block_start", {"type": "content_block_start", "index": block["index"],
                                                  "content_block": first})]

    def _close(self) -> list[Event]:
        block, self._open = self._open, None
        if block is None:
            return []
        return [("content_block_stop", {"type": "content_block_stop", "index": block["index"]})]


def stop_reason(finish: str | None, stop: str | int | None, called: bool) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for the engine's finish: max_tokens, tool_use, stop_sequence (with
    the string), or end_turn."""
    if finish == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def _usage(gen: Generation, output_tokens: int | None = None) -> dict[str, int]:
    return {"input_tokens": gen.num_prompt_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": gen.num_cached_tokens,
            "output_tokens": gen.num_generated_tokens if output_tokens is None else output_tokens}


def _message(mid: str, model: str, content: list, reason: str | None, sequence: str | None, usage: dict) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage}


def _plan(request: Request, state: ServerState, raw: bytes,
          count_only: bool = False) -> tuple[MessagesRequest, ChatPlan]:
    """Parse the body (errors in its own names), then plan it as a chat (errors in chat's names, renamed)."""
    req = parse_messages_body(parse_json(raw), count_only, state.config.defaults)
    check_model(state, req.model)
    request.state.field_names = NAMES
    return req, plan_chat(req.chat_fields, req.messages, chat_format(state.llm.tokenizer), state.config.chat)


def _prepare(request: Request, state: ServerState, raw: bytes) -> tuple[MessagesRequest, ChatPlan, str, list[int]]:
    """Parse, plan, render and tokenize (a worker thread may run it)."""
    req, plan = _plan(request, state, raw)
    text, ids = render_planned_chat(state.llm.tokenizer, plan, req.options.kwargs, **image_input(state))
    return req, plan, text, ids


async def create_message(request: Request) -> Response:
    """``POST /v1/messages``."""
    arrival, state, (req, plan, prompt, ids) = await read_and_prepare(request, _prepare, request)
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    gen = await start_generation(request, state, [Job(0, ids, sampling_params(req.options), request_id=mid)], arrival)
    if gen is None:
        return Response(status_code=499)
    shaper = ChatOutputShaper(plan, prompt)
    blocks = ContentBlocks(shaper if shaper.active else None)
    if req.stream:
        return StreamResponse(_events(mid, answer_name(request, state), gen, blocks))

    async def collect() -> dict:
        finish, stop = None, None
        try:
            async for _, delta in gen.deltas():
                blocks.feed(delta.text)
                if delta.finish_reason is not None:
                    finish, stop = delta.finish_reason, delta.stop_reason
        finally:
            await gen.close()
        blocks.end()
        reason, sequence = stop_reason(finish, stop, blocks.called)
        return _message(mid, answer_name(request, state), blocks.content(), reason, sequence, _usage(gen))

    try:
        return JSONResponse(await unless_disconnected(request.receive, collect))
    except ClientDisconnected:
        return Response(status_code=499)


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return typed_event(kind, data)


async def _events(mid: str, model: str, gen: Generation, blocks: ContentBlocks) -> AsyncIterator[bytes]:
    """message_start, ping, the blocks' events, message_delta, message_stop (or an error event)."""
    start = _message(mid, model, [], None, None, _usage(gen, output_tokens=0))
    yield _event("message_start", {"type": "message_start", "message": start})
    yield _event("ping", {"type": "ping"})
    finish, stop = None, None
    try:
        async for _, delta in gen.deltas():
            for kind, data in blocks.feed(delta.text):
                yield _event(kind, data)
            if delta.finish_reason is not None:
                finish, stop = delta.finish_reason, delta.stop_reason
        for kind, data in blocks.end():
            yield _event(kind, data)
        reason, sequence = stop_reason(finish, stop, blocks.called)
        yield _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                          "stop_sequence": sequence},
                                       "usage": _usage(gen)})
        yield _event("message_stop", {"type": "message_stop"})
    except APIError as exc:
        yield _event("error", ANTHROPIC.body(NAMES.apply(exc)))
    except Exception:  # noqa: BLE001 - a bug of ours: the client gets an error event, the log the detail
        log.exception("streaming %s failed (request id %s)", mid, gen.http_request_id)
        yield _event("error", ANTHROPIC.body(internal_error(gen.http_request_id)))
    finally:
        await gen.close()


async def count_tokens(request: Request) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's tokens as `create_message` would render it."""
    require_ready(server_state(request))
    raw = await read_request_body(request)
    name, _ = await off_loop_if_large(len(raw), model_fields, raw, request.url.path)
    state = await use_model(request, name)

    def count() -> int:
        _, plan = _plan(request, state, raw, count_only=True)  # images count as the tokens they take
        return len(render_planned_chat(state.llm.tokenizer, plan, {}, **image_input(state))[1])

    return JSONResponse({"input_tokens": await off_loop_if_large(len(raw), count)})

"""``/v1/responses`` without a model: input items render as the equivalent chat conversation does, and an answer's
text becomes reasoning, message and function_call items whose stream events (each validated strictly as the
openai SDK's own type) rebuild, through the SDK's own stream state, the same response as the whole answer, for
every split of the text."""

from __future__ import annotations

import itertools
import json

import pytest
from openai._types import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types import responses as types

from gpullama.chat.model_format import ChatFormat
from gpullama.chat_template import ChatTemplate
from gpullama.server.http.errors import APIError
from gpullama.server.openai.responses.items import OutputItems
from gpullama.server.openai.responses.request import NAMES, parse_responses
from gpullama.server.openai.responses.serving import ResponseObject
from gpullama.server.pipeline.chat_output import ChatOutputShaper
from gpullama.server.pipeline.chat_plan import plan_chat
from tests.chat.test_tool_parsers import CONVERSATION, QWEN25_TOOLS_TEMPLATE, TOOLS
from tests.server.test_chat_output import HERMES_REASONING, THINK_AND_CALL

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]
EVENT_TYPES = {
    "response.created": types.ResponseCreatedEvent,
    "response.output_item.added": types.ResponseOutputItemAddedEvent,
    "response.content_part.added": types.ResponseContentPartAddedEvent,
    "response.output_text.delta": types.ResponseTextDeltaEvent,
    "response.output_text.done": types.ResponseTextDoneEvent,
    "response.reasoning_text.delta": types.ResponseReasoningTextDeltaEvent,
    "response.reasoning_text.done": types.ResponseReasoningTextDoneEvent,
    "response.content_part.done": types.ResponseContentPartDoneEvent,
    "response.function_call_arguments.delta": types.ResponseFunctionCallArgumentsDeltaEvent,
    "response.function_call_arguments.done": types.ResponseFunctionCallArgumentsDoneEvent,
    "response.output_item.done": types.ResponseOutputItemDoneEvent,
    "response.completed": types.ResponseCompletedEvent,
    "response.incomplete": types.ResponseIncompleteEvent,
}


def _answer(body: dict, fmt: ChatFormat, pieces: list[str], status: str = "completed"):
    """(the response object, its events as the SDK's types) of an answer written in `pieces`."""
    req = parse_responses({"input": "Weather in Paris?", **body})
    plan = plan_chat(req.chat_fields, req.messages, fmt)
    shaper = ChatOutputShaper(plan, "prompt")
    items = OutputItems(shaper if shaper.active else None)
    response = ResponseObject(req, "m")
    raw = [("response.created", {"response": response.build("in_progress", [])})]
    for piece in pieces:
        raw += items.feed(piece)
    raw += items.end(status)
    whole = response.build(status, items.output())
    raw.append((f"response.{status}", {"response": whole}))
    seq = itertools.count()
    events = [EVENT_TYPES[kind].model_validate({"type": kind, "sequence_number": next(seq), **fields}, strict=True)
              for kind, fields in raw]
    return types.Response.model_validate(whole, strict=True), events


def _shape(response: types.Response) -> list[dict]:
    """The output items without their random ids."""
    return [item.model_dump(exclude={"id", "call_id"}, exclude_none=True) for item in response.output]


def test_reasoning_message_and_calls_whole_and_streamed_at_every_split():
    body = {"tools": FLAT_TOOLS}
    whole, _ = _answer(body, HERMES_REASONING, [THINK_AND_CALL])
    kinds = [item.type for item in whole.output]
    assert kinds == ["reasoning", "message", "function_call", "function_call"]
    reasoning, message, weather, add = whole.output
    assert reasoning.content[0].text.startswith("The user wants") and reasoning.summary == []
    assert message.content[0].text == whole.output_text == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in (weather, add)] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 1, "b": 2})]
    assert weather.call_id.startswith("call_") and weather.id.startswith("fc_") and weather.call_id != add.call_id
    assert all(item.status == "completed" for item in whole.output)
    for cut in range(0, len(THINK_AND_CALL) + 1, 3):
        streamed, events = _answer(body, HERMES_REASONING, [THINK_AND_CALL[:cut], THINK_AND_CALL[cut:]])
        assert _shape(streamed) == _shape(whole)
        state = ResponseStreamState(input_tools=FLAT_TOOLS, text_format=omit)
        for event in events:
            state.handle_event(event)
        rebuilt = state._completed_response
        assert [item.model_dump(exclude_none=True) for item in rebuilt.output] == \
            [item.model_dump(exclude_none=True) for item in streamed.output]
        _check_event_order(events, streamed)


def _check_event_order(events: list, response: types.Response) -> None:
    """Items open one at a time, in output order; each one's deltas join to its final text."""
    opened = [e.output_index for e in events if e.type == "response.output_item.added"]
    closed = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert opened == closed == list(range(len(response.output)))
    open_now = None
    texts: dict[int, str] = {}
    for e in events:
        if e.type == "response.output_item.added":
            assert open_now is None
            open_now = e.output_index
        elif e.type == "response.output_item.done":
            assert open_now == e.output_index
            open_now = None
        elif e.type.endswith(".delta"):
            assert e.output_index == open_now and e.item_id == response.output[open_now].id
            texts[open_now] = texts.get(open_now, "") + e.delta
    for i, item in enumerate(response.output):
        final = item.arguments if item.type == "function_call" else item.content[0].text
        assert texts.get(i, "") == final


def test_plain_text_empty_and_cut_answers():
    """Without tools the text is one message; an empty answer is one empty message; a call cut by the token limit
    ends incomplete; a forced choice shows no content."""
    plain, events = _answer({}, ChatFormat("generic", False, False), ["Hel", "lo."])
    assert _shape(plain) == [{"type": "message", "status": "completed", "role": "assistant", "content": [
        {"type": "output_text", "text": "Hello.", "annotations": [], "logprobs": []}]}]
    assert [e.type for e in events][1:4] == ["response.output_item.added", "response.content_part.added",
                                           "response.output_text.delta"]
    empty, _ = _answer({}, ChatFormat("generic", False, False), [])
    assert [(i.type, i.content[0].text) for i in empty.output] == [("message", "")]
    cut, _ = _answer({"tools": FLAT_TOOLS, "tool_choice": "required"}, HERMES_REASONING,
                     ['<tool_call>\n{"name": "add", "arguments": {"a": 1, "b"'], "incomplete")
    [call] = cut.output
    assert call.type == "function_call" and call.status == "incomplete" and call.arguments == '{"a": 1, "b"'


def test_input_items_render_as_the_chat_conversation():
    """function_call items (joined to the assistant message before them), function_call_output items and
    instructions render through a tool-aware template exactly as the same conversation in chat's shape; a
    reasoning item becomes the next assistant message's reasoning_content."""
    calls = CONVERSATION[1]["tool_calls"]
    items = [
        {"role": "user", "content": CONVERSATION[0]["content"]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        *({"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
           "arguments": c["function"]["arguments"], "status": "completed"} for c in calls),
        {"type": "function_call_output", "call_id": "call_a", "output": "21 C"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "5"}]},
    ]
    req = parse_responses({"input": items, "instructions": "Be brief.", "tools": FLAT_TOOLS})
    chat = [{"role": "system", "content": "Be brief."}, CONVERSATION[0],
            {**CONVERSATION[1], "content": "Checking.", "reasoning_content": "hm"},
            {**CONVERSATION[2], "name": "get_weather"}, {**CONVERSATION[3], "name": "add"}]
    assert req.messages == chat
    template = ChatTemplate(QWEN25_TOOLS_TEMPLATE, "", "<|im_end|>")
    ours = plan_chat(req.chat_fields, req.messages, HERMES_REASONING)
    theirs = plan_chat({"tools": TOOLS}, chat, HERMES_REASONING)
    assert template.render(ours.messages, tools=ours.tools) == template.render(theirs.messages, tools=theirs.tools)
    lone = parse_responses({"input": [items[0], items[3]]}).messages[1]
    assert lone == {"role": "assistant", "content": "", "tool_calls": [calls[0]]}


@pytest.mark.parametrize("body, param", [
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools[0].strict"),
    ({"tools": FLAT_TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function"}}, "tool_choice.name"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"text": "json"}, "text"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
])
def test_bad_fields_name_the_responses_field(body, param):
    with pytest.raises(APIError) as info:
        parse_responses({"input": "hi", **body})
    assert info.value.status == 400 and info.value.param == param, info.value.message


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "description": "no name"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": 7}}]}, "tools[0].parameters"),
    ({"tools": FLAT_TOOLS + FLAT_TOOLS[:1]}, "tools[2].name"),
    ({"tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": FLAT_TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wrong"}}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": "yes"}}}, "text.format.strict"),
])
def test_planning_errors_are_renamed_to_the_responses_fields(body, param):
    req = parse_responses({"input": "hi", **body})
    with pytest.raises(APIError) as info:
        try:
            plan_chat(req.chat_fields, req.messages, ChatFormat("generic", False, False))
        except APIError as exc:
            raise NAMES.apply(exc) from None
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert "function." not in info.value.message and "response_format" not in info.value.message


@pytest.mark.parametrize("fmt, kind", [
    ({"type": "text"}, None),
    ({"type": "json_object"}, "json_object"),
    ({"type": "json_schema", "name": "n", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
      "strict": True}, "json_schema"),
])
def test_text_formats_plan_as_response_formats(fmt, kind):
    """text.format reaches the grammar as chat's response_format would, and the response repeats it."""
    req = parse_responses({"input": "hi", "text": {"format": fmt}})
    plan = plan_chat(req.chat_fields, req.messages, ChatFormat("generic", False, False))
    assert (plan.spec.kind if plan.spec is not None else None) == kind
    if kind == "json_schema":
        assert plan.spec.json_schema == fmt["schema"]
    assert req.echo["text"] == {"format": fmt}
    types.ResponseTextConfig.model_validate(req.echo["text"], strict=True)

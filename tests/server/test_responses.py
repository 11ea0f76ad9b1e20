"""``POST /v1/responses`` through the official SDK (``client.responses.create`` and ``client.responses.stream``), every
body and event also validated strictly by the SDK's own pydantic types; the text checked against chat completions
of the same conversation and the token counts against transformers' tokenizer."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import orjson
import pytest
from openai.types import responses as types

from tests.server.test_structured_api import Pet

FRANCE = "What is the capital of France? Answer with one word."
EVENT_TYPES = {
    "response.created": types.ResponseCreatedEvent,
    "response.in_progress": types.ResponseInProgressEvent,
    "response.output_item.added": types.ResponseOutputItemAddedEvent,
    "response.content_part.added": types.ResponseContentPartAddedEvent,
    "response.output_text.delta": types.ResponseTextDeltaEvent,
    "response.output_text.done": types.ResponseTextDoneEvent,
    "response.content_part.done": types.ResponseContentPartDoneEvent,
    "response.output_item.done": types.ResponseOutputItemDoneEvent,
    "response.function_call_arguments.delta": types.ResponseFunctionCallArgumentsDeltaEvent,
    "response.function_call_arguments.done": types.ResponseFunctionCallArgumentsDoneEvent,
    "response.completed": types.ResponseCompletedEvent,
    "response.incomplete": types.ResponseIncompleteEvent,
}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"],
       "additionalProperties": False}
TOOLS = [  # the Responses API's flat function tools
    {"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER,
     "strict": True},
    {"type": "function", "name": "add", "description": "Add two integers", "parameters": ADD, "strict": True},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
WEATHER_QUESTION = "What is the weather like in Paris today?"


def chat_text(client: openai.OpenAI, model: str, messages: list[dict], max_tokens: int) -> str:
    out = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
    return out.choices[0].message.content


def prompt_len(hf_tokenizer, messages: list[dict]) -> int:
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(hf_tokenizer.encode(text, add_special_tokens=False))


def raw_events(http: httpx.Client, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each server-sent event, the data validated strictly as the SDK's type of that event."""
    events = []
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = orjson.loads(line[len("data: "):])
                assert data["type"] == name, (name, data)
                EVENT_TYPES[name].model_validate(data, strict=False)
                events.append((name, data))
                name = None
            else:
                assert line == "", line
    return events


def test_text_input_answers_like_chat_with_usage_from_the_tokenizer(client: openai.OpenAI, http: httpx.Client,
                                                                    model_name: str, hf_tokenizer) -> None:
    out = client.responses.create(model=model_name, input=FRANCE, temperature=0, max_output_tokens=16)
    messages = [{"role": "user", "content": FRANCE}]
    assert out.object == "response" and out.id.startswith("resp_") and out.model == model_name
    assert out.status == "completed" and out.incomplete_details is None and out.error is None
    assert out.output_text == chat_text(client, model_name, messages, 16) and "Paris" in out.output_text
    [item] = out.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert out.usage.input_tokens == prompt_len(hf_tokenizer, messages)
    assert 1 <= out.usage.output_tokens < 16
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert out.temperature == 0 and out.max_output_tokens == 16
    raw = http.post("/v1/responses", json={"model": model_name, "input": FRANCE, "temperature": 0,
                                           "max_output_tokens": 16})
    strict = types.Response.model_validate(raw.json())  # every required field there, every type right
    assert strict.output_text == out.output_text


def test_instructions_and_message_items_render_as_a_chat(client: openai.OpenAI, model_name: str,
                                                         hf_tokenizer) -> None:
    instructions = "You are a geography teacher. Answer in one sentence."
    items = [
        {"role": "user", "content": "Which country is Lyon in?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "France."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "And its capital?"}]},
    ]
    out = client.responses.create(model=model_name, input=items, instructions=instructions, temperature=0,
                                  max_output_tokens=24)
    messages = [{"role": "system", "content": instructions}, {"role": "user", "content": "Which country is Lyon in?"},
                {"role": "assistant", "content": "France."}, {"role": "user", "content": "And its capital?"}]
    assert out.output_text == chat_text(client, model_name, messages, 24)
    assert out.usage.input_tokens == prompt_len(hf_tokenizer, messages)
    assert out.instructions == instructions


def test_max_output_tokens_makes_it_incomplete(client: openai.OpenAI, model_name: str) -> None:
    out = client.responses.create(model=model_name, input="Tell me a long story.", max_output_tokens=3,
                                  temperature=0)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 3 and out.output[0].status == "incomplete"


def test_stream_events_in_order_and_equal_the_whole_response(client: openai.OpenAI, http: httpx.Client,
                                                             model_name: str) -> None:
    body = {"model": model_name, "input": FRANCE, "temperature": 0, "max_output_tokens": 16}
    whole = http.post("/v1/responses", json=body).json()
    events = raw_events(http, body)
    names = [name for name, _ in events]
    deltas = [data for name, data in events if name == "response.output_text.delta"]
    assert deltas and names == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    text = "".join(d["delta"] for d in deltas)
    final = events[-1][1]["response"]
    assert text == whole["output"][0]["content"][0]["text"] == final["output"][0]["content"][0]["text"]
    assert final["usage"] == whole["usage"] and final["status"] == "completed"
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["id"] == final["id"]
    item_id = events[2][1]["item"]["id"]
    assert all(data.get("item_id", item_id) == item_id for _, data in events[3:-1])
    # the SDK's own iterator and its stream helper, which rebuilds the response from the events and checks them
    sdk_text = "".join(e.delta for e in client.responses.create(**body, stream=True)
                       if e.type == "response.output_text.delta")
    assert sdk_text == text
    with client.responses.stream(**body) as stream:
        for _ in stream:
            pass
        rebuilt = stream.get_final_response()
    assert rebuilt.output_text == text and rebuilt.status == "completed"


def test_stream_cut_by_max_output_tokens_ends_incomplete(http: httpx.Client, model_name: str) -> None:
    events = raw_events(http, {"model": model_name, "input": "Tell me a long story.", "max_output_tokens": 4,
                               "temperature": 0})
    name, data = events[-1]
    assert name == "response.incomplete" and data["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert data["response"]["usage"]["output_tokens"] == 4


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": 7}}]}, "tools[0].parameters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": "{not json"}]},
     "input[0].arguments"),
    # jsonschema accepts a dangling $ref; the grammar engine cannot compile it: the engine's error names the field
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "text.format.schema"),
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"temperature": -1}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].image_url"),  # a text-only model: the image is refused, naming --mmproj
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": [{"role": ["user"], "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": {"a": 1}, "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "hi"}] * 5000}, "input"),
])
def test_bad_or_unsupported_fields_are_400_naming_the_field(client: openai.OpenAI, model_name: str, extra: dict,
                                                            param: str) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**{"model": model_name, "input": "hi", **extra})
    assert err.value.body["param"] == param, err.value.body


def test_missing_input_is_400_and_unknown_model_404(http: httpx.Client) -> None:
    r = http.post("/v1/responses", json={"model": "x-unknown", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = http.post("/v1/responses", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_a_body_that_is_not_json_is_415(http: httpx.Client, model_name: str) -> None:
    r = http.post("/v1/responses", content=b'{"input": "hi"}', headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = http.post("/v1/responses", json={"model": model_name, "input": "hi", "top_k": 10**30})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"


def _without_ids(output: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "add"}])
def test_forced_function_calls_validate(client: openai.OpenAI, model_name: str, choice) -> None:
    """tool_choice required and named: the output is function_call items only, whose arguments validate against
    the tool's parameters; the raw body validates strictly as the SDK's Response."""
    raw = client.responses.with_raw_response.create(model=model_name, input=WEATHER_QUESTION, tools=TOOLS,
                                                    tool_choice=choice, temperature=1.0, extra_body={"seed": 2},
                                                    max_output_tokens=80)
    types.Response.model_validate(raw.http_response.json(), strict=True)
    out = raw.parse()
    calls = out.output if out.status == "completed" else out.output[:-1]  # parallel calls cut by the token limit
    assert calls and all(item.type == "function_call" for item in out.output) and out.output_text == ""
    for call in calls:
        assert call.status == "completed" and call.id.startswith("fc_") and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    if choice != "required":
        assert out.status == "completed" and [call.name for call in calls] == ["add"]
    assert out.tools[0].name == "get_weather" and out.tools[0].strict is True
    assert out.tool_choice == choice or out.tool_choice.name == "add"


def test_streamed_function_calls_equal_the_whole_response(client: openai.OpenAI, http: httpx.Client,
                                                          model_name: str) -> None:
    """At temperature 0 the event stream (each event validated as the SDK's type) rebuilds the non-streamed
    output: each call is announced with empty arguments, grows by argument deltas, and is done before the next;
    the SDK's stream helper, which parses strict tools' arguments, gives the same calls."""
    body = {"model": model_name, "input": WEATHER_QUESTION, "tools": TOOLS, "tool_choice": "required",
            "temperature": 0, "max_output_tokens": 80}
    whole = http.post("/v1/responses", json=body).json()
    events = raw_events(http, body)
    final = events[-1][1]["response"]
    assert _without_ids(final["output"]) == _without_ids(whole["output"]) and final["usage"] == whole["usage"]
    assert [data["item"] for name, data in events if name == "response.output_item.done"] == final["output"]
    for index, item in enumerate(final["output"]):
        added = next(data["item"] for name, data in events
                     if name == "response.output_item.added" and data["output_index"] == index)
        assert added == {**item, "arguments": "", "status": "in_progress"}
        deltas = "".join(data["delta"] for name, data in events
                         if name == "response.function_call_arguments.delta" and data["output_index"] == index)
        assert deltas == item["arguments"]
    with client.responses.stream(**body) as stream:
        for _ in stream:
            pass
        rebuilt = stream.get_final_response()
    assert [(c.name, c.arguments) for c in rebuilt.output] == [(c["name"], c["arguments"]) for c in whole["output"]]
    assert [c.parsed_arguments for c in rebuilt.output] == [json.loads(c["arguments"]) for c in whole["output"]]


def test_function_call_output_round_trip_renders_as_the_chat_conversation(client: openai.OpenAI,
                                                                          model_name: str) -> None:
    """A forced call, sent back with its function_call_output (the SDK's output items as they are): the answer and
    the prompt's token count equal chat completions' for the same conversation with tool_calls and a tool
    message."""
    first = client.responses.create(model=model_name, input=WEATHER_QUESTION, tools=TOOLS, temperature=0,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    [call] = first.output
    result = "Sunny, 24 degrees."
    final = client.responses.create(model=model_name, tools=TOOLS, tool_choice="none", temperature=0,
                                    max_output_tokens=24, input=[
                                        {"role": "user", "content": WEATHER_QUESTION}, *first.output,
                                        {"type": "function_call_output", "call_id": call.call_id, "output": result}])
    chat = client.chat.completions.create(
        model=model_name, tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                                 for t in TOOLS], tool_choice="none", temperature=0, max_tokens=24, messages=[
            {"role": "user", "content": WEATHER_QUESTION},
            {"role": "assistant", "content": None, "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                "name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": result}])
    assert final.output_text and final.output_text == chat.choices[0].message.content
    assert final.usage.input_tokens == chat.usage.prompt_tokens


def test_text_format_through_the_sdk_parse_helper(client: openai.OpenAI, model_name: str) -> None:
    """`client.responses.parse(text_format=Model)` (a strict json_schema text.format) returns the parsed model."""
    out = client.responses.parse(model=model_name, input="Describe my pet.", text_format=Pet, temperature=0,
                                 max_output_tokens=60)
    assert isinstance(out.output_parsed, Pet) and out.output_parsed == Pet.model_validate_json(out.output_text)
    assert out.text.format.type == "json_schema"

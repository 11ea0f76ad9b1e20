"""response_format, tools and tool_choice through the openai SDK against the real server (SmolLM2): outputs are
valid by construction, tool calls stream as they are answered whole, free requests in the same batch are
unchanged, and bad input gets a 400 naming the field."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.server.helpers import API_KEY, sse_events

CHAT = "/v1/chat/completions"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def _chat(http: httpx.Client, model: str, **body) -> dict:
    response = http.post(CHAT, json={"model": model, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_json_schema_answers_validate_and_free_requests_in_the_batch_are_unchanged(server, http, model_name):
    """Three free requests answer alone, then again batched with three strict-schema requests of n=6 sampled
    choices each: the free answers are unchanged, and all 18 constrained answers parse and validate."""
    free = [
        {"messages": [{"role": "user", "content": "Name three colours."}], "temperature": 0, "max_tokens": 24},
        {"messages": [{"role": "user", "content": "Tell me about the sea."}], "temperature": 1.0, "seed": 4,
         "max_tokens": 24},
        {"messages": [{"role": "user", "content": "What is 2+2?"}], "temperature": 0.8, "top_p": 0.9,
         "seed": 9, "max_tokens": 24},
    ]
    constrained = [{"messages": [{"role": "user", "content": f"Invent {who} and describe them as JSON."}],
                    "response_format": PERSON_FORMAT, "n": 6, "temperature": 1.0, "seed": seed, "max_tokens": 120}
                   for seed, who in enumerate(("a pirate", "a teacher", "a robot"))]
    alone = [_chat(http, model_name, **body)["choices"][0]["message"]["content"] for body in free]

    async def together() -> list[dict]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300,
                                     headers={"Authorization": f"Bearer {API_KEY}"}) as c:
            answers = await asyncio.gather(*(c.post(CHAT, json={"model": model_name, **b})
                                             for b in constrained + free))
        assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        return [a.json() for a in answers]

    answers = asyncio.run(together())
    assert [a["choices"][0]["message"]["content"] for a in answers[3:]] == alone
    contents = [c["message"]["content"] for a in answers[:3] for c in a["choices"]]
    for answer in answers[:3]:
        assert [c["finish_reason"] for c in answer["choices"]] == ["stop"] * 6
    for content in contents:
        jsonschema.validate(json.loads(content), PERSON)
    assert len(set(contents)) > 12


def test_json_object_answers_parse(http, model_name):
    """response_format json_object: every sampled choice is one JSON object."""
    out = _chat(http, model_name, messages=[{"role": "user", "content": "Give a small JSON object with a car's "
                                                                       "make and year."}],
                response_format={"type": "json_object"}, n=8, temperature=0.7, seed=1, max_tokens=100)
    for choice in out["choices"]:
        assert choice["finish_reason"] == "stop", choice["message"]["content"]
        assert isinstance(json.loads(choice["message"]["content"]), dict)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    kind: Literal["cat", "dog", "fish"]
    age: int


def test_sdk_parse_with_a_pydantic_model(client: openai.OpenAI, model_name: str):
    """`client.chat.completions.parse(response_format=Model)` returns the parsed model."""
    out = client.chat.completions.parse(model=model_name, response_format=Pet, temperature=0, max_tokens=60,
                                        messages=[{"role": "user", "content": "Describe my pet."}])
    message = out.choices[0].message
    assert isinstance(message.parsed, Pet) and message.parsed == Pet.model_validate_json(message.content)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_tool_calls_validate(client: openai.OpenAI, model_name: str, choice):
    """tool_choice required (any tool, possibly several) and named (that tool, once): sampled calls whose
    arguments validate against the tool's parameters; finish_reason "tool_calls" (named: "stop")."""
    out = client.chat.completions.create(model=model_name, messages=WEATHER_QUESTION, tools=TOOLS,
                                         tool_choice=choice, n=4, temperature=1.0, seed=2, max_tokens=120)
    for c in out.choices:
        calls = c.message.tool_calls
        assert calls and c.message.content is None
        if c.finish_reason == "length":  # parallel calls cut by max_tokens: the complete ones still count
            assert choice == "required" and len(calls) > 1
            calls = calls[:-1]
        else:
            assert c.finish_reason == ("tool_calls" if choice == "required" else "stop")
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        if choice != "required":
            assert [call.function.name for call in calls] == ["add"]
    assert len({c.id for ch in out.choices for c in ch.message.tool_calls}) == sum(
        len(ch.message.tool_calls) for ch in out.choices)


def test_streamed_tool_calls_accumulate_to_the_whole_answer(client, http, model_name):
    """At temperature 0 the SDK's stream accumulation yields the calls of the non-streamed answer; each call's
    id, type and name come once, in its first piece."""
    body = dict(model=model_name, messages=WEATHER_QUESTION, tools=TOOLS, tool_choice="required",
                parallel_tool_calls=True, temperature=0, max_tokens=120)
    whole = client.chat.completions.create(**body).choices[0]
    with client.chat.completions.stream(**body) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    with http.stream("POST", CHAT, json={**body, "stream": True}) as response:
        events = sse_events(response)
    pieces = [t for e in events[:-1] for c in e["choices"] for t in c["delta"].get("tool_calls", [])]
    firsts = {}
    for piece in pieces:
        if piece["index"] not in firsts:
            firsts[piece["index"]] = piece
            assert piece["id"].startswith("call_") and piece["type"] == "function" and piece["function"]["name"]
        else:
            assert "id" not in piece and "name" not in piece["function"]
    assert len(firsts) == len(whole.message.tool_calls)


def test_tool_round_trip(client: openai.OpenAI, model_name: str):
    """A forced call, its result as a role "tool" message, then a plain answer that uses it."""
    first = client.chat.completions.create(model=model_name, messages=WEATHER_QUESTION, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           temperature=0, max_tokens=60).choices[0].message
    call = first.tool_calls[0]
    messages = [*WEATHER_QUESTION, first,  # the SDK's message object, sent back as clients do
                {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 degrees."}]
    final = client.chat.completions.create(model=model_name, messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=40).choices[0]
    assert final.finish_reason in ("stop", "length") and final.message.content and not final.message.tool_calls
    auto = client.chat.completions.create(model=model_name, messages=messages, tools=TOOLS, temperature=0,
                                          max_tokens=40).choices[0]
    assert auto.message.content or auto.message.tool_calls


def test_completions_accept_response_format(http, model_name):
    """/v1/completions honours response_format too (as vLLM does)."""
    response = http.post("/v1/completions", json={"model": model_name, "prompt": "A JSON person:", "max_tokens": 120,
                                                  "temperature": 0, "response_format": PERSON_FORMAT})
    assert response.status_code == 200, response.text
    jsonschema.validate(json.loads(response.json()["choices"][0]["text"]), PERSON)


NAMELESS = [{"type": "function", "function": {"description": "x", "parameters": {"type": "object"}}}]
BAD_CALL = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wrong"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": NAMELESS}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"messages": BAD_CALL}, "messages[1].tool_calls[0].function.arguments"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    # jsonschema accepts a dangling $ref; the grammar engine cannot compile it: the engine's error is a 400 too
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "response_format.json_schema.schema"),
])
def test_bad_structured_requests_are_400_naming_the_field(http, model_name, extra, param):
    body = {"model": model_name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    response = http.post(CHAT, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error

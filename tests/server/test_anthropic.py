"""Anthropic's Messages API through the official ``anthropic`` SDK: whole and streamed answers, tools (forced by a
grammar, then answered with a tool_result), stop sequences, count_tokens, x-api-key and Bearer auth, Anthropic's
error shape; the event order and the SDK's accumulation checked on a Qwen-style answer with thinking, text and
tool calls."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import openai
import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from gpullama.chat.model_format import ChatFormat
from gpullama.server.anthropic.messages import ContentBlocks, stop_reason
from gpullama.server.anthropic.request import parse_messages_body
from gpullama.server.pipeline.chat_output import ChatOutputShaper
from gpullama.server.pipeline.chat_plan import plan_chat
from tests.server.helpers import API_KEY
from tests.server.test_chat_output import THINK_AND_CALL

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
USER = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
EVENTS = TypeAdapter(RawMessageStreamEvent)
GREEDY = {"temperature": 0}  # the SDK no longer has sampling arguments; clients send them as extra fields


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    """The official Anthropic client pointed at the server, with the key as x-api-key."""
    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def _raw_events(http: httpx.Client, body: dict) -> list[tuple[str, dict]]:
    events, kind = [], None
    with http.stream("POST", "/v1/messages", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                data = orjson.loads(line[len("data: "):])
                assert data["type"] == kind
                events.append((kind, data))
    return events


def test_a_text_answer_whole_and_streamed(claude: anthropic.Anthropic, client: openai.OpenAI, http: httpx.Client,
                                          model_name: str) -> None:
    """The answer is chat completions' answer to the same conversation (greedy), with Anthropic's usage; the stream
    gives the same message, its events in Anthropic's order."""
    kwargs = dict(model=model_name, max_tokens=24, system="Be brief.", messages=USER, extra_body=GREEDY)
    whole = claude.messages.create(**kwargs)
    chat = client.chat.completions.create(model=model_name, max_tokens=24, temperature=0,
                                          messages=[{"role": "system", "content": "Be brief."}, *USER])
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text == chat.choices[0].message.content
    assert whole.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.choices[0].finish_reason]
    assert whole.usage.input_tokens == chat.usage.prompt_tokens == claude.messages.count_tokens(
        model=model_name, system="Be brief.", messages=USER).input_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    with claude.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert [b.text for b in streamed.content] == [b.text for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason
    raw = {k: v for k, v in kwargs.items() if k != "extra_body"} | GREEDY
    kinds = [k for k, _ in _raw_events(http, raw)]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_forced_tool_use_then_its_result(claude: anthropic.Anthropic, model_name: str, choice: dict) -> None:
    """A forced tool choice gives a tool_use block whose input validates against input_schema (stop_reason
    tool_use), streamed the same; the conversation goes on with the tool_result."""
    kwargs = dict(model=model_name, max_tokens=64, extra_body=GREEDY, tools=TOOLS, tool_choice=choice,
                  messages=[{"role": "user", "content": "What's the weather in Paris?"}])
    whole = claude.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use" and [b.type for b in whole.content] == ["tool_use"]
    call = whole.content[0]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER)
    with claude.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content] == [(call.name, call.input)]
    follow = claude.messages.create(model=model_name, max_tokens=16, extra_body=GREEDY, tools=TOOLS, messages=[
        *kwargs["messages"], {"role": "assistant", "content": [c.model_dump() for c in whole.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "21 C, sunny"}]}])
    assert follow.type == "message" and follow.usage.input_tokens > whole.usage.input_tokens


def test_a_stop_sequence_ends_the_answer(claude: anthropic.Anthropic, model_name: str) -> None:
    kwargs = dict(model=model_name, max_tokens=24, extra_body=GREEDY, messages=USER)
    text = claude.messages.create(**kwargs).content[0].text
    word = text.split()[len(text.split()) // 2]
    cut = claude.messages.create(**kwargs, stop_sequences=[word])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert cut.content[0].text == text[: text.index(word)]


def test_auth_by_x_api_key_or_bearer(server, model_name: str) -> None:
    body = {"model": model_name, "max_tokens": 1, "messages": USER}
    with httpx.Client(base_url=server.base_url, timeout=60) as raw:
        assert raw.post("/v1/messages", json=body, headers={"x-api-key": API_KEY}).status_code == 200
        assert raw.post("/v1/messages", json=body, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
        refused = raw.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert refused.status_code == 401
    assert refused.json()["type"] == "error" and refused.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0).messages.create(**body)


@pytest.mark.parametrize("body, words", [
    ({"messages": USER}, "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "--mmproj"),  # an image to a text-only model
    ({"max_tokens": 8, "messages": USER, "tools": [{"name": "f", "input_schema": {"type": 7}}]},
     "tools[0].input_schema"),
    ({"max_tokens": 8, "messages": USER, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 8, "messages": USER, "stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
])
def test_bad_requests_get_anthropics_error_shape(http: httpx.Client, model_name: str, body: dict,
                                                 words: str) -> None:
    r = http.post("/v1/messages", json={"model": model_name, **body})
    assert r.status_code == 400, r.text
    error = r.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"] and ".function" not in error["error"]["message"], error


def test_unknown_model_and_route_are_anthropic_shaped(http: httpx.Client) -> None:
    r = http.post("/v1/messages", json={"model": "claude-nope", "max_tokens": 1, "messages": USER})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert http.get("/v1/messages/nothing").json()["error"]["type"] == "not_found_error"


# ---- the blocks and events of a Qwen-style answer (no model needed) ----

QWEN3 = ChatFormat("hermes", template_tools=True, reasoning=True)
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
              {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def test_thinking_text_and_tool_use_events_accumulate_to_the_whole_message() -> None:
    """Every split of a reasoning + text + two calls answer streams events in Anthropic's order that the SDK
    accumulates into the whole answer's content."""
    plan = plan_chat({"tools": CHAT_TOOLS}, USER, QWEN3)

    def run(pieces: list[str]) -> tuple[list[tuple[str, dict]], ContentBlocks]:
        blocks = ContentBlocks(ChatOutputShaper(plan, "prompt"))
        events = [e for p in pieces for e in blocks.feed(p)] + blocks.end()
        return events, blocks

    _, whole = run([THINK_AND_CALL])
    content = whole.content()
    assert [b["type"] for b in content] == ["thinking", "text", "tool_use", "tool_use"]
    assert content[1]["text"] == "Let me check." and content[2]["input"] == {"city": "Paris", "unit": "celsius"}
    assert stop_reason("stop", None, whole.called) == ("tool_use", None)
    for cut in range(0, len(THINK_AND_CALL) + 1, 7):
        events, blocks = run([THINK_AND_CALL[:cut], THINK_AND_CALL[cut:]])
        start = {"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
                                                      "model": "m", "content": [], "stop_reason": None,
                                                      "stop_sequence": None,
                                                      "usage": {"input_tokens": 1, "output_tokens": 0}}}
        snapshot, bufs = None, {}
        for data in [start, *(d for _, d in events)]:
            snapshot = accumulate_event(event=EVENTS.validate_python(data), current_snapshot=snapshot, json_bufs=bufs)
        got = [b.model_dump(exclude_none=True) for b in snapshot.content]
        for b, want in zip(got, content):
            if b["type"] == "tool_use":
                assert (b["name"], b["input"]) == (want["name"], want["input"])
            else:
                assert b[b["type"]] == want[b["type"]]
        assert len(got) == len(content)
        Message.model_validate({**start["message"], "content": blocks.content()})


def test_conversion_to_chat_messages() -> None:
    req = parse_messages_body({"max_tokens": 5, "system": [{"type": "text", "text": "Sys."}], "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                                     {"type": "text", "text": "Thanks"}]}],
        "tools": TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "stop_sequences": ["END"]})
    assert req.messages == [
        {"role": "system", "content": "Sys."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "hmm", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"}, {"role": "user", "content": "Thanks"}]
    assert req.chat_fields == {"tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER, "description": "Current weather in a city"}}],
        "tool_choice": "required", "parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": True}}
    assert req.options.kwargs["stop"] == ["END"] and req.options.max_tokens == 5
    assert json.loads(req.messages[2]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}

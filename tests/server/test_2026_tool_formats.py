"""Forced tool calls (tool_choice required and named) in the 2026 families' formats, through the openai SDK against a
real server: the default model (SmolLM2) with llama.cpp's real template of each format (``--chat-template-file``),
so the grammar writes the format's text and the server's parser reads it back. The calls' arguments validate
against the tools' schemas (jsonschema), and a streamed answer accumulates to the whole one. With thinking on
(DeepSeek V3.2 / V4, whose prompt then opens ``<think>``), a tiny model on a vocabulary holding the reasoning tags
as single tokens closes its block (a logit bias pushes ``</think>``) before the grammar forces the call."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.fixtures.llamacpp_source import llamacpp_source
from tests.server.conftest import start_server, stop_server
from tests.server.helpers import API_KEY

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}, "required": ["a", "b"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# SmolLM2's vocabulary has no <think> token, so no reasoning can come before the forced calls (the grammar's
# reasoning gate needs it); with thinking on, DeepSeek V3.1's prompt would open a block its calls never close
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TEMPLATES = {  # format -> the llama.cpp template that writes it
    "qwen3_coder": "Qwen3.5-4B.jinja", "glm45": "GLM-4.6.jinja", "deepseek": "deepseek-ai-DeepSeek-V3.1.jinja",
    "gemma4": "google-gemma-4-31B-it.jinja"}
# DSML's markup takes SmolLM2 many tokens (each ｜ several): 360 a call, 50 s for this file's three tests on an idle
# machine, twice that in the suite. DeepSeek V3.2 and V4 (the same markup through the same grammar and parser; their
# templates and names: tests/chat/test_dsml.py) go through the server with thinking on, below, on a vocabulary where
# DSML's token is one: the rendered prompt, forced calls required and named, whole and streamed
THINKING_TEMPLATES = {"deepseek_v3_2": "deepseek-ai-DeepSeek-V3.2.jinja", "deepseek_v4": "deepseek-ai-DeepSeek-V4.jinja"}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def served(request, default_model_path, tmp_path_factory):
    """(format, openai client, httpx client, model id) of a server on the default model with the format's real template."""
    fmt = request.param
    template = llamacpp_source() / "models" / "templates" / TEMPLATES[fmt]
    srv = start_server(default_model_path, tmp_path_factory.mktemp(fmt) / "server.log",
                       ["--chat-template-file", str(template)])
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    with httpx.Client(base_url=srv.base_url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        yield fmt, client, http, model
    stop_server(srv)


def test_the_server_renders_the_template(served):
    fmt, _, http, _ = served
    source = (llamacpp_source() / "models" / "templates" / TEMPLATES[fmt]).read_text(encoding="utf-8")
    assert http.get("/props").json()["chat_template"] == source
    prompt = http.post("/apply-template", json={"messages": QUESTION, "tools": TOOLS}).json()["prompt"]
    assert QUESTION[0]["content"] in prompt
    assert ("get_weather" in prompt) == (fmt != "deepseek")  # DeepSeek V3.1's template does not describe tools


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_forced_calls_parse_and_validate(served, choice):
    _, client, _, model = served
    out = client.chat.completions.create(model=model, messages=QUESTION, tools=TOOLS, tool_choice=choice, n=2,
                                         temperature=1.0, seed=3, max_tokens=160,
                                         extra_body=NO_THINKING)
    for c in out.choices:
        calls = c.message.tool_calls
        assert calls and not c.message.content, c.message
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


def test_streamed_calls_accumulate_to_the_whole_answer(served):
    _, client, _, model = served
    body = dict(model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                temperature=0, max_tokens=160, extra_body=NO_THINKING)
    whole = client.chat.completions.create(**body).choices[0]
    with client.chat.completions.stream(**body) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert whole.message.tool_calls and streamed.finish_reason == whole.finish_reason
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


THINKING = sorted(THINKING_TEMPLATES)
WEATHER_ONLY = TOOLS[:1]  # bounded values: a random model's numbers would not end


@pytest.fixture(scope="module", params=THINKING)
def thinking(request, tmp_path_factory):
    """(openai client, model id, the ids of <think> and </think>) of a server on a tiny qwen2 whose vocabulary
    holds the reasoning tags and DSML's token as single tokens, with the format's real template."""
    from tests.fixtures.tiny_models import build_tiny_model

    folder = tmp_path_factory.mktemp(f"thinking-{request.param}")
    path = build_tiny_model("qwen2", folder, vocab="qwen2-markers", context_length=4096).path
    template = llamacpp_source() / "models" / "templates" / THINKING_TEMPLATES[request.param]
    srv = start_server(path, folder / "server.log", ["--chat-template-file", str(template)])
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    with httpx.Client(base_url=srv.base_url, timeout=120, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        prompt = http.post("/apply-template", json={"messages": QUESTION, "tools": WEATHER_ONLY,
                                                    "chat_template_kwargs": {"enable_thinking": True}}).json()["prompt"]
        assert prompt.endswith("<｜Assistant｜><think>")  # the prompt opens the reasoning block
        tags = [http.post("/tokenize", json={"content": tag}).json()["tokens"] for tag in ("<think>", "</think>")]
        assert [len(ids) for ids in tags] == [1, 1]
        yield client, model, tags[0][0], tags[1][0]
    stop_server(srv)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_with_thinking_on_comes_after_the_reasoning(thinking, choice):
    """The prompt opened ``<think>``: the grammar leaves the block free until ``</think>`` (pushed by a logit
    bias; the random model's own favourite, ``<think>``, kept off), then forces the call, which is read as a call,
    not as reasoning; no content, and streamed, the same answer. (Without the gate the grammar would force the
    call inside the open block, where it is reasoning text.)"""
    client, model, open_id, close_id = thinking
    body = dict(model=model, messages=QUESTION, tools=WEATHER_ONLY, tool_choice=choice, parallel_tool_calls=False,
                temperature=1.0, seed=11, max_tokens=400, logit_bias={str(open_id): -100, str(close_id): 100},
                extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    whole = client.chat.completions.create(**body).choices[0]
    message = whole.message
    assert message.tool_calls and not message.content, message
    assert not getattr(message, "reasoning_content", None), message  # the block closed at once
    assert whole.finish_reason == ("tool_calls" if choice == "required" else "stop")
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), WEATHER)
    with client.chat.completions.stream(**body) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == whole.finish_reason and not streamed.message.content
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls]

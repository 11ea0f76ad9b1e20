"""Ollama's native API through the official ``ollama`` client: chat and generate whole and streamed (NDJSON),
`format` (json, a schema) enforced by the grammar engine, options, tools in the conversation, think, embed, tags,
show, ps and version, and Ollama's error shape; tool calls and thinking read out of Qwen-style output checked
without a model."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import openai
import pytest
from ollama._types import ChatResponse

from gpullama.chat.model_format import ChatFormat
from gpullama.server.ollama.chat import OllamaAnswer
from gpullama.server.pipeline.chat_output import ChatOutputShaper
from gpullama.server.pipeline.chat_plan import plan_chat
from tests.chat.test_tool_parsers import QWEN_CODER_FENCED
from tests.server.helpers import API_KEY
from tests.server.test_chat_output import THINK_AND_CALL

USER = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
GREEDY = {"temperature": 0, "num_predict": 24}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                 "parameters": {"type": "object", "properties": {
                                                     "city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def olla(server) -> ollama.Client:
    """The official Ollama client pointed at the server, with the key as a bearer token."""
    return ollama.Client(host=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def test_chat_whole_and_streamed(olla: ollama.Client, client: openai.OpenAI, model_name: str) -> None:
    """The answer is chat completions' (greedy, same conversation), with Ollama's counts; the NDJSON stream joins
    to the same text and ends with done."""
    whole = olla.chat(model=model_name, messages=USER, options=GREEDY)
    chat = client.chat.completions.create(model=model_name, messages=USER, max_tokens=24, temperature=0)
    assert whole.message.role == "assistant" and whole.message.content == chat.choices[0].message.content
    assert whole.done and whole.done_reason == chat.choices[0].finish_reason
    assert whole.prompt_eval_count == chat.usage.prompt_tokens and whole.eval_count == chat.usage.completion_tokens
    assert whole.total_duration > 0 and whole.created_at.endswith("Z")
    parts = list(olla.chat(model=model_name, messages=USER, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == whole.done_reason
    assert "".join(p.message.content for p in parts) == whole.message.content
    latest = olla.chat(model=f"{model_name}:latest", messages=USER, options={**GREEDY, "num_predict": 2})
    assert latest.done


def test_generate_with_the_template_and_raw(olla: ollama.Client, client: openai.OpenAI, model_name: str) -> None:
    prompt = USER[0]["content"]
    templated = olla.generate(model=model_name, prompt=prompt, options=GREEDY)
    chat = client.chat.completions.create(model=model_name, messages=USER, max_tokens=24, temperature=0)
    assert templated.response == chat.choices[0].message.content and templated.done
    raw = olla.generate(model=model_name, prompt="The capital of France is", raw=True, options=GREEDY)
    completion = client.completions.create(model=model_name, prompt="The capital of France is", max_tokens=24,
                                           temperature=0)
    assert raw.response == completion.choices[0].text
    assert raw.context[: raw.prompt_eval_count] == client.post(
        "/../tokenize", cast_to=object, body={"prompt": "The capital of France is"})["tokens"]
    streamed = list(olla.generate(model=model_name, prompt=prompt, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == templated.response and streamed[-1].done
    assert olla.generate(model=model_name, prompt="").done_reason == "load"


def test_format_json_and_schema_are_enforced(olla: ollama.Client, model_name: str) -> None:
    messages = [{"role": "user", "content": "Give me a person as JSON."}]
    loose = olla.chat(model=model_name, messages=messages, format="json", options={"temperature": 0,
                                                                                   "num_predict": 64})
    if loose.done_reason == "stop":
        assert isinstance(json.loads(loose.message.content), dict)
    strict = olla.chat(model=model_name, messages=messages, format=PERSON, options={"temperature": 0.7, "seed": 3,
                                                                                    "num_predict": 80})
    assert strict.done_reason == "stop", strict
    jsonschema.validate(json.loads(strict.message.content), PERSON)


def test_options_seed_and_stop(olla: ollama.Client, model_name: str) -> None:
    sampled = {"temperature": 1.0, "seed": 11, "num_predict": 12}
    a = olla.chat(model=model_name, messages=USER, options=sampled).message.content
    assert a == olla.chat(model=model_name, messages=USER, options=sampled).message.content
    text = olla.chat(model=model_name, messages=USER, options=GREEDY).message.content
    word = text.split()[len(text.split()) // 2]
    cut = olla.chat(model=model_name, messages=USER, options={**GREEDY, "stop": [word]})
    assert cut.message.content == text[: text.index(word)] and cut.done_reason == "stop"


def test_tools_and_tool_results_reach_the_prompt(olla: ollama.Client, http: httpx.Client, model_name: str) -> None:
    """A conversation with an assistant tool call (object arguments) and the tool's result renders as the chat
    completions prompt of the same conversation (the count /tokenize gives for it)."""
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "21 C, sunny", "tool_name": "get_weather"}]
    out = olla.chat(model=model_name, messages=messages, tools=[WEATHER_TOOL], options={**GREEDY, "num_predict": 8},
                    think=False)
    openai_messages = [messages[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "21 C, sunny"}]
    count = http.post("/tokenize", json={"messages": openai_messages, "tools": [WEATHER_TOOL],
                                         "chat_template_kwargs": {"enable_thinking": False}}).json()["count"]
    assert out.prompt_eval_count == count


CALL_SCHEMA = {"type": "object", "properties": {
    "name": {"const": "get_weather"},
    "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                  "additionalProperties": False}}, "required": ["name", "arguments"], "additionalProperties": False}


def test_a_tool_call_whole_and_streamed(olla: ollama.Client, model_name: str) -> None:
    """With tools offered, a call the model writes (here held to the call's JSON by `format`, as Ollama has no
    tool_choice) comes back as message.tool_calls with object arguments, whole and streamed (the call once, whole)."""
    kwargs = dict(model=model_name, messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                  tools=[WEATHER_TOOL], format=CALL_SCHEMA, options={"temperature": 0, "num_predict": 48})
    whole = olla.chat(**kwargs)
    assert whole.done_reason == "stop" and whole.message.content == "", whole
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather" and isinstance(call.function.arguments["city"], str)
    parts = list(olla.chat(**kwargs, stream=True))
    streamed = [c for p in parts for c in p.message.tool_calls or ()]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [
        (call.function.name, dict(call.function.arguments))]
    assert "".join(p.message.content for p in parts) == "" and parts[-1].done


def test_embed_equals_the_openai_endpoint(olla: ollama.Client, http: httpx.Client, model_name: str) -> None:
    texts = ["The capital of France is Paris.", "Vectors."]
    got = olla.embed(model=model_name, input=texts)
    want = http.post("/v1/embeddings", json={"input": texts}).json()["data"]
    assert got.embeddings == [d["embedding"] for d in want] and got.prompt_eval_count > 0
    legacy = olla.embeddings(model=model_name, prompt=texts[0])
    assert list(legacy.embedding) == want[0]["embedding"]


def test_tags_show_ps_and_version(olla: ollama.Client, http: httpx.Client, model_name: str, server) -> None:
    listed = olla.list().models
    assert [m.model for m in listed] == [model_name] and listed[0].size > 0 and listed[0].details.format == "gguf"
    assert listed[0].details.family == "llama" and listed[0].details.quantization_level == "Q4_1"
    shown = olla.show(model_name)
    assert "{%" in shown.template and shown.modelinfo["general.architecture"] == "llama"
    assert "completion" in shown.capabilities
    assert [m.model for m in olla.ps().models] == [model_name]
    assert http.get("/api/version").json()["version"]
    assert httpx.get(server.base_url + "/").text == "Ollama is running"


@pytest.mark.parametrize("body, status, words", [
    ({"model": "nope:7b", "messages": USER}, 404, "model 'nope:7b' not found"),
    ({"messages": USER, "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ({"messages": USER, "options": {"temperature": -1}}, 400, "options.temperature"),
    ({"messages": USER, "options": {"num_ctx": 10**7}}, 400, "options.num_ctx"),
    ({"messages": USER, "options": {"num_predict": 0}}, 400, "options.num_predict"),
    ({"messages": USER, "format": "xml"}, 400, "format"),
    ({"messages": USER, "format": {"type": 7}}, 400, "format"),
    ({"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
])
def test_errors_are_ollama_shaped(http: httpx.Client, body: dict, status: int, words: str) -> None:
    r = http.post("/api/chat", json={"stream": False, **body})
    assert r.status_code == status and set(r.json()) == {"error"} and words in r.json()["error"], r.text


def test_the_client_raises_response_error(olla: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        olla.chat(model="nope", messages=USER)
    assert info.value.status_code == 404


# ---- tool calls and thinking in Ollama's shape (no model needed) ----

def _run(plan, text: str, pieces: list[str]):
    answer = OllamaAnswer(ChatOutputShaper(plan, "prompt"), "content")
    lines = [f for p in pieces for f in answer.feed(p)] + answer.end()
    return answer.whole(), lines


@pytest.mark.parametrize("text", [THINK_AND_CALL, QWEN_CODER_FENCED])
def test_calls_and_thinking_in_ollamas_shape(text: str) -> None:
    """Calls come whole (arguments an object), once each, streamed or not; thinking is its own field."""
    tools = [WEATHER_TOOL, {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    plan = plan_chat({"tools": tools}, USER, ChatFormat("hermes", template_tools=True, reasoning=True))
    whole, _ = _run(plan, text, [text])
    message = ChatResponse.model_validate({"model": "m", "message": {"role": "assistant", **whole}}).message
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    if text == THINK_AND_CALL:
        assert message.thinking.startswith("The user wants") and message.content == "Let me check."
        assert [c.function.arguments for c in message.tool_calls] == [{"city": "Paris", "unit": "celsius"},
                                                                      {"a": 1, "b": 2}]
    for cut in range(0, len(text) + 1, 5):
        again, lines = _run(plan, text, [text[:cut], text[cut:]])
        calls = [c for line in lines for c in line.get("tool_calls", ())]
        assert calls == whole["tool_calls"] and "".join(line["content"] for line in lines) == whole["content"]
        assert "".join(line.get("thinking", "") for line in lines) == whole.get("thinking", "")

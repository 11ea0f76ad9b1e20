"""``/tokenize``, ``/detokenize`` and ``/version`` in vLLM's shapes, checked against transformers' tokenizer of the
same GGUF and against pyproject.toml."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital is"}]


def test_tokenize_a_prompt(http: httpx.Client, hf_tokenizer, model_name: str) -> None:
    prompt = "The capital of France is Paris. Émile said: “ça va?” 😀"
    r = http.post("/tokenize", json={"model": model_name, "prompt": prompt, "return_token_strs": True})
    assert r.status_code == 200, r.text
    out = r.json()
    want = hf_tokenizer.encode(prompt, add_special_tokens=True)
    assert out["tokens"] == want and out["count"] == len(want)
    assert out["token_strs"] == hf_tokenizer.convert_ids_to_tokens(want)
    assert out["max_model_len"] == http.get("/v1/models").json()["data"][0]["max_model_len"]
    plain = http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()
    assert plain["tokens"] == hf_tokenizer.encode(prompt, add_special_tokens=False) and plain["token_strs"] is None


@pytest.mark.parametrize("mode", ["generation_prompt", "no_generation_prompt", "continue_final_message"])
def test_tokenize_messages_with_the_chat_template(http: httpx.Client, hf_tokenizer, mode: str) -> None:
    body = {"messages": MESSAGES if mode == "continue_final_message" else MESSAGES[:2]}
    kwargs = {"add_generation_prompt": mode == "generation_prompt"}
    if mode == "continue_final_message":
        body["continue_final_message"] = kwargs["continue_final_message"] = True
    body["add_generation_prompt"] = kwargs["add_generation_prompt"]
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    text = hf_tokenizer.apply_chat_template(body["messages"], tokenize=False, **kwargs)
    assert r.json()["tokens"] == hf_tokenizer.encode(text, add_special_tokens=False)


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                                  "parameters": {"type": "object", "properties": {
                                                      "city": {"type": "string"}}, "required": ["city"]}}}


def test_tokenize_counts_the_tools_as_the_chat_prompt_has_them(http: httpx.Client, client, model_name: str) -> None:
    """With `tools` the count is the prompt chat completions renders (its usage.prompt_tokens), not the messages'
    alone; tool_choice "none" hides the tools from both."""
    body = {"model": model_name, "messages": MESSAGES[:2], "tools": [WEATHER_TOOL]}
    with_tools = http.post("/tokenize", json=body).json()["count"]
    without = http.post("/tokenize", json={"messages": MESSAGES[:2]}).json()["count"]
    chat = client.chat.completions.create(model=model_name, messages=MESSAGES[:2], tools=[WEATHER_TOOL], max_tokens=1)
    assert with_tools == chat.usage.prompt_tokens > without
    hidden = http.post("/tokenize", json={**body, "tool_choice": "none"}).json()["count"]
    assert hidden == without


def test_detokenize_is_the_tokenizers_decode(http: httpx.Client, hf_tokenizer) -> None:
    text = hf_tokenizer.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    ids = hf_tokenizer.encode(text + "Paris 😀 ça", add_special_tokens=False)
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200, r.text
    text = hf_tokenizer.decode(ids)
    assert r.json() == {"prompt": text, "content": text}  # vLLM's name, llama.cpp's; special tokens kept, as both do


def test_llama_cpp_tokenize_fields(http: httpx.Client, hf_tokenizer) -> None:
    """llama.cpp's /tokenize: content, add_special (BOS when the GGUF adds one; SmolLM2's does not),
    parse_special, with_pieces (text, or the bytes of a token that is not whole UTF-8), mixed token ids."""
    content = "This is a test <|im_end|> with unicode 媽 and emoji 🤗"
    ids = hf_tokenizer.encode(content, add_special_tokens=False)
    r = http.post("/tokenize", json={"content": content})
    assert r.status_code == 200 and r.json()["tokens"] == ids
    assert http.post("/tokenize", json={"content": content, "add_special": True}).json()["tokens"] == ids
    plain = hf_tokenizer(content, add_special_tokens=False, split_special_tokens=True).input_ids
    assert http.post("/tokenize", json={"content": content, "parse_special": False}).json()["tokens"] == plain
    pieces = http.post("/tokenize", json={"content": content, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert raw.decode() == content and any(isinstance(p["piece"], list) for p in pieces)  # 媽 and 🤗 split
    mixed = http.post("/tokenize", json={"content": [ids[0], hf_tokenizer.decode(ids[1:3])]}).json()["tokens"]
    assert mixed == ids[:3]
    detok = http.post("/detokenize", json={"tokens": ids}).json()
    assert detok["content"] == content


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"content": "hi", "prompt": "hi"}, "prompt"),
    ("/tokenize", {"content": {"a": 1}}, "content"),
    ("/tokenize", {"content": [10**9]}, "content"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True},
     "continue_final_message"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
])
def test_bad_input_is_400_naming_the_field(http: httpx.Client, path: str, body: dict, param: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_unknown_model_is_404(http: httpx.Client) -> None:
    r = http.post("/detokenize", json={"model": "nope", "tokens": [1]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_version_is_the_package_version(http: httpx.Client) -> None:
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert http.get("/version").json() == {"version": re.search(r'^version = "(.+)"$', pyproject, re.M)[1]}

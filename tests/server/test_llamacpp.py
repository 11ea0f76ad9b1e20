"""llama.cpp's native endpoints against the real server, in the request and response shapes of llama.cpp's
``tools/server/README.md`` and its ``tests/unit`` (test_completion.py, test_infill.py): ``/completion`` on SmolLM2
(checked against /v1/completions and transformers' tokenizer), ``/infill`` and ``/v1/completions``' ``suffix`` on a
tiny Qwen2.5-Coder-style model whose GGUF names its FIM tokens (the prompt checked token by token against
llama.cpp's layout, each piece tokenized by transformers)."""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import openai
import pytest

from tests.fixtures.tiny_models import build_tiny_model
from tests.server.conftest import start_server, stop_server
from tests.server.helpers import API_KEY, sse_events

PROMPT = "I believe the meaning of life is"


def _greedy(http: httpx.Client, **body) -> dict:
    response = http.post("/completion", json={"temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def test_completion_shape_counts_and_text_match_the_openai_endpoint(http, hf_tokenizer, model_name):
    out = _greedy(http, prompt=PROMPT, n_predict=8, ignore_eos=True)
    n_prompt = len(hf_tokenizer.encode(PROMPT))
    assert out["timings"]["prompt_n"] + out["timings"]["cache_n"] == n_prompt == out["tokens_evaluated"]
    assert out["timings"]["predicted_n"] == 8 == out["tokens_predicted"]
    assert out["stop"] is True and out["stop_type"] == "limit" and out["stopping_word"] == ""
    assert out["truncated"] is False and isinstance(out["has_new_line"], bool) and out["tokens"] == []
    assert out["model"] == model_name and out["prompt"] == PROMPT
    settings = out["generation_settings"]
    assert settings["n_predict"] == 8 and settings["temperature"] == 0 and settings["top_k"] == 40
    assert settings["n_ctx"] > 0 and settings["seed"] == 4294967295
    oai = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                                             "ignore_eos": True}).json()
    assert out["content"] == oai["choices"][0]["text"]
    with_tokens = _greedy(http, prompt=PROMPT, n_predict=8, ignore_eos=True, return_tokens=True)
    assert hf_tokenizer.decode(with_tokens["tokens"]) == out["content"]


def test_completion_stream_events_join_to_the_whole_answer(http):
    whole = _greedy(http, prompt=PROMPT, n_predict=8, ignore_eos=True)
    with http.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": 8, "temperature": 0,
                                                  "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert "[DONE]" not in events  # llama.cpp's native stream ends with the stop event
    assert all(isinstance(e["stop"], bool) for e in events) and [e["stop"] for e in events][-1] is True
    for e in events[:-1]:
        assert e["tokens"] and all(isinstance(t, int) for t in e["tokens"])
    last = events[-1]
    assert last["stop_type"] == "limit" and last["timings"]["predicted_n"] == 8
    assert last["generation_settings"]["n_predict"] == 8 and "content" in last
    assert "".join(e["content"] for e in events) == whole["content"]


def test_completion_prompt_shapes_several_prompts_and_n_cmpl(http, hf_tokenizer):
    ids = hf_tokenizer.encode(PROMPT)
    text = _greedy(http, prompt=PROMPT, n_predict=4)["content"]
    assert _greedy(http, prompt=ids, n_predict=4)["content"] == text
    assert _greedy(http, prompt=[*ids[:2], hf_tokenizer.decode(ids[2:])], n_predict=4)["content"] == text
    both = _greedy(http, prompt=[PROMPT, ids], n_predict=4)
    assert isinstance(both, list) and [b["content"] for b in both] == [text, text]
    assert [b["index"] for b in both] == [0, 1]
    many = _greedy(http, prompt=PROMPT, n_predict=4, n_cmpl=2)
    assert [b["content"] for b in many] == [text, text]


def test_completion_response_fields_and_stop_words(http):
    out = _greedy(http, prompt=PROMPT, n_predict=8, response_fields=["content", "generation_settings/n_predict",
                                                                       "prompt", "no/such"])
    assert set(out) == {"content", "generation_settings/n_predict", "prompt"}
    assert out["generation_settings/n_predict"] == 8 and out["prompt"] == PROMPT
    full = _greedy(http, prompt=PROMPT, n_predict=16, ignore_eos=True)["content"]
    word = full.split()[2]
    stopped = _greedy(http, prompt=PROMPT, n_predict=16, ignore_eos=True, stop=[word])
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word
    assert stopped["content"] == full[: full.index(word)]


def test_n_probs_whole_and_streamed_match_openai_logprobs(http):
    out = _greedy(http, prompt=PROMPT, n_predict=5, n_probs=10, ignore_eos=True)
    probs = out["completion_probabilities"]
    assert len(probs) == 5
    oai = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 10,
                                             "ignore_eos": True}).json()["choices"][0]["logprobs"]
    for tok, oai_token, oai_logprob in zip(probs, oai["tokens"], oai["token_logprobs"]):
        assert tok["id"] >= 0 and tok["token"] == oai_token and tok["bytes"] == list(oai_token.encode())
        assert math.isclose(tok["logprob"], oai_logprob, abs_tol=1e-4) and tok["logprob"] <= 0
        assert len(tok["top_logprobs"]) == 10
        assert tok["top_logprobs"][0]["id"] == tok["id"]  # greedy: the sampled token is the most likely
        for p in tok["top_logprobs"]:
            assert set(p) == {"id", "token", "bytes", "logprob"} and p["logprob"] <= 0
    with http.stream("POST", "/completion", json={"prompt": PROMPT, "n_predict": 5, "temperature": 0,
                                                  "n_probs": 10, "ignore_eos": True, "stream": True}) as r:
        events = sse_events(r)
    streamed = [p for e in events if not e["stop"] for p in e["completion_probabilities"]]
    assert [p["id"] for p in streamed] == [p["id"] for p in probs]


def test_seed_repeats_and_timings_per_token_and_progress(http):
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 1.0, "seed": 42}
    assert _greedy(http, **body)["content"] == _greedy(http, **body)["content"]
    with http.stream("POST", "/completion", json={**body, "stream": True, "timings_per_token": True,
                                                  "return_progress": True}) as r:
        events = sse_events(r)
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert progress[0]["processed"] == progress[0]["cache"] and progress[0]["time_ms"] == 0
    assert progress[-1]["total"] == progress[-1]["processed"] == events[0]["tokens_evaluated"]
    assert all("timings" in e for e in events if "prompt_progress" not in e)


@pytest.mark.parametrize("body, param", [
    ({"prompt": PROMPT, "n_predict": 0}, "n_predict"),
    ({"prompt": PROMPT, "mirostat": 2}, "mirostat"),
    ({"prompt": PROMPT, "n_probs": 99}, "n_probs"),
    ({"prompt": {"prompt_string": "x", "multimodal_data": ["AAAA"]}}, "prompt.multimodal_data"),  # no marker
    ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"prompt": PROMPT, "grammar": "root ::= undefined_rule"}, "grammar"),
    ({"prompt": PROMPT, "grammar": 'root ::= "a"', "json_schema": {}}, "json_schema"),
    ({}, "prompt"),
])
def test_completion_bad_fields_get_400_naming_them(http, body, param):
    response = http.post("/completion", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_infill_without_fim_tokens_is_a_clear_400(http):
    response = http.post("/infill", json={"input_prefix": "def f():\n", "input_suffix": "\n"})
    assert response.status_code == 400
    assert "no FIM prefix, suffix, middle token" in response.json()["error"]["message"]
    response = http.post("/v1/completions", json={"prompt": "def f():\n", "suffix": "\n", "max_tokens": 2})
    assert response.status_code == 400 and response.json()["error"]["param"] == "suffix"
    response = http.post("/api/generate", json={"prompt": "def f():\n", "suffix": "\n", "stream": False})
    assert response.status_code == 400 and "no FIM prefix" in response.json()["error"]


# ---- llama.cpp's grammar fields: grammar (GBNF), a top-level json_schema, response_format with its schema ----------

YES_NO = 'root ::= ("yes" | "no") "."'
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"]}


def _chat_text(http: httpx.Client, **body) -> str:
    response = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Describe a person as JSON."}], "max_tokens": 60, "temperature": 1.0,
        "seed": 7, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_grammar_and_schemas_constrain_every_endpoint(http):
    import json

    import jsonschema

    assert _greedy(http, prompt=PROMPT, n_predict=8, grammar=YES_NO)["content"] in ("yes.", "no.")
    jsonschema.validate(json.loads(_greedy(http, prompt=PROMPT, n_predict=60, json_schema=SCHEMA)["content"]), SCHEMA)
    completion = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "grammar": YES_NO}).json()
    assert completion["choices"][0]["text"] in ("yes.", "no.")
    assert _chat_text(http, grammar=YES_NO) in ("yes.", "no.")
    for fields in ({"json_schema": SCHEMA}, {"response_format": {"type": "json_object", "schema": SCHEMA}},
                   {"response_format": {"type": "json_schema", "schema": SCHEMA}}):
        jsonschema.validate(json.loads(_chat_text(http, **fields)), SCHEMA)
    assert isinstance(json.loads(_chat_text(http, json_schema={})), (dict, list, str, int, float, bool, type(None)))


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/completion"])
@pytest.mark.parametrize("fields, param", [
    ({"grammar": "root ::= undefined_rule"}, "grammar"),
    ({"grammar": 'root ::= "a'}, "grammar"),
    ({"json_schema": {"type": "no-such-type"}}, "json_schema"),
    ({"response_format": {"type": "json_object", "schema": {"minimum": "zero"}}}, "response_format.schema"),
    ({"grammar": YES_NO, "response_format": {"type": "json_object"}}, "response_format"),
])
def test_invalid_grammar_or_schema_is_a_400_naming_it(http, path, fields, param):
    body = {"messages": [{"role": "user", "content": "Hi"}]} if "chat" in path else {"prompt": PROMPT}
    response = http.post(path, json={**body, "max_tokens": 4, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# ---- FIM on a tiny model whose GGUF names its FIM tokens (tokenizer.ggml.fim_*_token_id) -------------------------


@pytest.fixture(scope="module")
def coder(tmp_path_factory: pytest.TempPathFactory):
    """(server, transformers' tokenizer) of a server on a tiny Qwen2.5-Coder-style model (4096-token context, so
    that llama.cpp's layout keeps the extra files: it gives them what a 2048-token batch leaves), bound to two
    addresses and allowing CORS from ``localhost`` (the keyword) and one other origin."""
    import transformers

    out = tmp_path_factory.mktemp("coder")
    tiny = build_tiny_model("qwen2", out, vocab="qwen2-coder", context_length=4096)
    srv = start_server(tiny.path, out / "server.log",
                       ["--host", "127.0.0.1,127.0.0.2", "--allowed-origins", "localhost,http://app.example"])
    ref = transformers.AutoTokenizer.from_pretrained(str(Path(tiny.path).parent), gguf_file=Path(tiny.path).name)
    yield srv, ref
    stop_server(srv)


def _plain(ref, text: str) -> list[int]:
    return ref(text, add_special_tokens=False, split_special_tokens=True).input_ids


def _layout(ref, prefix: str, suffix: str, extra: list[dict], prompt: str = "") -> list[int]:
    """llama.cpp's format_prompt_infill order, each piece tokenized by transformers."""
    t = ref.convert_tokens_to_ids
    ids = [t("<|repo_name|>"), *_plain(ref, "myproject\n")]
    for chunk in extra:
        ids += [t("<|file_sep|>"), *_plain(ref, chunk.get("filename", "tmp") + "\n"), *_plain(ref, chunk["text"])]
    ids += [t("<|file_sep|>"), *_plain(ref, "filename\n")]
    return [*ids, t("<|fim_prefix|>"), *_plain(ref, prefix), *ref.encode(prompt, add_special_tokens=False),
            t("<|fim_suffix|>"), *_plain(ref, suffix), t("<|fim_middle|>")]


INFILL = {"input_prefix": "#include <cstdio>\n#include \"llama.h\"\n\nint main() {\n",
          "prompt": "    int n_threads = llama_", "input_suffix": "}\n"}


@pytest.mark.parametrize("extra", [[], [{"filename": "llama.h", "text": "LLAMA_API int32_t llama_n_threads();\n"},
                                        {"text": "int x;\n"}]])
def test_infill_prompt_is_llama_cpp_layout(coder, extra):
    srv, ref = coder
    want = _layout(ref, INFILL["input_prefix"], INFILL["input_suffix"], extra, INFILL["prompt"])
    with httpx.Client(base_url=srv.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        out = http.post("/infill", json={**INFILL, "input_extra": extra, "n_predict": 4, "temperature": 0})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["tokens_evaluated"] == len(want) and body["prompt"] == ref.decode(want)
    assert body["stop_type"] in ("limit", "eos") and isinstance(body["content"], str)


def test_infill_takes_an_editor_plugins_body(coder):
    """A body shaped as llama.vscode sends it: its hints and slot options are taken, response_fields honoured."""
    srv, ref = coder
    body = {**INFILL, "input_extra": [{"filename": "a.h", "text": "int a;\n"}], "n_predict": 4, "n_indent": 4,
            "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000,
            "response_fields": ["content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"]}
    with httpx.Client(base_url=srv.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        out = http.post("/infill", json=body)
    assert out.status_code == 200, out.text
    got = out.json()
    assert set(got) == {"content", "timings/prompt_n", "timings/predicted_n", "truncated", "tokens_cached"}
    want = _layout(ref, INFILL["input_prefix"], INFILL["input_suffix"], body["input_extra"], INFILL["prompt"])
    assert got["timings/prompt_n"] + got["tokens_cached"] == len(want) and got["truncated"] is False


@pytest.mark.parametrize("input_extra", [{}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": "abc"},
                                         {"filename": 123, "text": 456}])
def test_infill_invalid_input_extra_is_400(coder, input_extra):
    srv, _ = coder
    with httpx.Client(base_url=srv.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        out = http.post("/infill", json={**INFILL, "input_extra": [input_extra]})
    assert out.status_code == 400 and "input_extra[0]" in out.json()["error"]["param"]


def test_openai_suffix_is_fill_in_the_middle(coder):
    """The OpenAI SDK's ``suffix``: the prompt is the code before, laid out as /infill lays it out (no extra)."""
    srv, ref = coder
    client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0)
    out = client.completions.create(model=client.models.list().data[0].id, prompt="def add(a, b):\n",
                                    suffix="\n", max_tokens=3, temperature=0)
    assert out.usage.prompt_tokens == len(_layout(ref, "def add(a, b):\n", "\n", []))
    with httpx.Client(base_url=srv.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        same = http.post("/infill", json={"input_prefix": "def add(a, b):\n", "input_suffix": "\n", "n_predict": 3,
                                          "temperature": 0}).json()
    assert out.choices[0].text == same["content"]
    with httpx.Client(base_url=srv.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        ollama = http.post("/api/generate", json={"prompt": "def add(a, b):\n", "suffix": "\n", "stream": False,
                                                  "options": {"num_predict": 3, "temperature": 0}}).json()
    assert ollama["prompt_eval_count"] == out.usage.prompt_tokens and ollama["response"] == same["content"]


# ---- /apply-template and /props --------------------------------------------------------------------------------


def test_apply_template_is_the_chat_templates_render(http, hf_tokenizer):
    messages = [{"role": "user", "content": "What is today?"}]
    for flag in (True, False):
        out = http.post("/apply-template", json={"messages": messages, "add_generation_prompt": flag, "tools": []})
        assert out.status_code == 200, out.text
        assert out.json() == {"prompt": hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                                         add_generation_prompt=flag)}
    prefill = [*messages, {"role": "assistant", "content": "Today is"}]
    out = http.post("/apply-template", json={"messages": prefill, "continue_final_message": True}).json()["prompt"]
    assert out.endswith("<|im_start|>assistant\nToday is")
    bad = http.post("/apply-template", json={"messages": [{"role": "robot", "content": "hi"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].role"


def test_props_has_the_fields_clients_read(http, default_model_path, model_name):
    from gpullama.gguf_file import read_header

    props = http.get("/props").json()
    meta = read_header(str(default_model_path)).metadata
    assert props["chat_template"] == meta["tokenizer.chat_template"]
    assert props["model_path"] == str(default_model_path) and props["model_alias"] == model_name
    assert props["default_generation_settings"]["n_ctx"] == http.post("/tokenize", json={"prompt": ""}).json()[
        "max_model_len"]
    params = props["default_generation_settings"]["params"]
    assert params["temperature"] == 0.8 and params["top_k"] == 40 and params["n_predict"] == -1
    assert props["build_info"].startswith("gpullama-") and props["total_slots"] >= 1
    assert props["bos_token"] == "<|im_start|>" and props["eos_token"] == "<|im_end|>"
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}


# ---- the small OpenAI and CORS items ------------------------------------------------------------------------------


def test_unprefixed_openai_routes_fingerprint_and_timings(server, model_name):
    """/chat/completions and /models as llama.cpp serves them (the OpenAI SDK without /v1), behind the API key;
    system_fingerprint on objects and chunks; llama.cpp's timings added to the OpenAI shape. (/completions is
    llama.cpp's native completion, as llama-server serves it: see test_completions_without_v1_is_native.)"""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    text = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=4, temperature=0)
    assert text.system_fingerprint.startswith("gpullama-") and text.model_extra["timings"]["predicted_n"] == 4
    client = openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    assert client.models.list().data[0].id == model_name
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.system_fingerprint.startswith("gpullama-")
    timings = chat.model_extra["timings"]
    assert timings["predicted_n"] == chat.usage.completion_tokens
    assert timings["prompt_n"] + timings["cache_n"] == chat.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.content == "" and chunks[0].choices[0].delta.role == "assistant"
    assert all(c.system_fingerprint.startswith("gpullama-") for c in chunks)
    assert chunks[-1].model_extra["timings"]["predicted_n"] == chat.usage.completion_tokens
    for path in ("/completions", "/chat/completions", "/completion", "/models", "/props", "/embeddings", "/embedding",
                 "/chat/completions/input_tokens"):
        assert httpx.request("GET" if path in ("/models", "/props") else "POST", server.base_url + path,
                             json={}).status_code == 401, path


# ---- the second pass (issue 38): prompt forms, native routes ------------------------------------------------------


def test_completion_takes_prompt_string_objects_and_mixed_lists(http, hf_tokenizer):
    """llama.cpp's prompt shapes: {"prompt_string": s} alone or in a list, token lists with strings spliced in
    (each string after the first piece tokenized without BOS); multimodal_data on a text model is a clear 400
    naming --mmproj (and, on any model, one whose markers do not match its items)."""
    ids = hf_tokenizer.encode(PROMPT)
    text = _greedy(http, prompt=PROMPT, n_predict=4)["content"]
    assert _greedy(http, prompt={"prompt_string": PROMPT}, n_predict=4)["content"] == text
    split = PROMPT.index(" the")
    mixed = [*hf_tokenizer.encode(PROMPT[:split]), PROMPT[split:]]
    out = _greedy(http, prompt=[{"prompt_string": PROMPT}, mixed, {"prompt_string": mixed}], n_predict=4,
                  return_tokens=True)
    assert [o["content"] for o in out] == [text] * 3 and out[1]["tokens_evaluated"] == len(ids)
    bad = http.post("/completion", json={"prompt": [{"prompt_string": "x <__media__>", "multimodal_data": ["AAAA"]}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt[0].multimodal_data[0]"
    assert "--mmproj" in bad.json()["error"]["message"]
    bad = http.post("/completion", json={"prompt": [{"prompt_string": "x", "multimodal_data": ["AAAA"]}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt[0].multimodal_data"


def test_completions_without_v1_is_native(http):
    """POST /completions answers as /completion (llama.cpp serves its native completion there), /v1/completions
    stays OpenAI's."""
    native = _greedy(http, prompt=PROMPT, n_predict=4, ignore_eos=True)
    out = http.post("/completions", json={"prompt": PROMPT, "n_predict": 4, "temperature": 0, "ignore_eos": True})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["content"] == native["content"] and body["stop_type"] == "limit" and "choices" not in body
    with http.stream("POST", "/completions", json={"prompt": PROMPT, "n_predict": 4, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1]["stop"] is True and "[DONE]" not in events
    assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).json()["object"] == "text_completion"


def test_native_embeddings_shape_and_inputs(http, hf_tokenizer):
    """/embeddings and /embedding: [{index, embedding: [[...]]}], one normalised row per input (the model's pooling
    here); inputs in every llama.cpp shape, content parts joined as they are; embd_normalize -1 leaves it raw."""
    import numpy as np

    oai = http.post("/v1/embeddings", json={"input": ["Hello world", "Paris"]}).json()["data"]
    out = http.post("/embeddings", json={"input": ["Hello world", {"prompt_string": "Paris"}]})
    assert out.status_code == 200, out.text
    rows = out.json()
    assert [r["index"] for r in rows] == [0, 1] and all(len(r["embedding"]) == 1 for r in rows)
    for row, want in zip(rows, oai):
        assert np.allclose(row["embedding"][0], want["embedding"], atol=1e-5)
    ids = hf_tokenizer.encode("Hello")
    same = [{"content": [*ids, " world"]}, {"input": {"content": [{"type": "text", "text": "Hello"},
                                                                  {"type": "text", "text": " world"}]}}]
    for body in same:
        got = http.post("/embedding", json=body).json()[0]["embedding"][0]
        assert np.allclose(got, oai[0]["embedding"], atol=1e-5), body
    raw = np.asarray(http.post("/embedding", json={"content": "Hello world", "embd_normalize": -1}).json()[0][
        "embedding"][0])
    assert np.allclose(raw / np.linalg.norm(raw), oai[0]["embedding"], atol=1e-5) and abs(np.linalg.norm(raw) - 1) > 0.1
    openai_forms = http.post("/v1/embeddings", json={"input": [{"prompt_string": "Paris"}]}).json()["data"][0]
    assert np.allclose(openai_forms["embedding"], oai[1]["embedding"], atol=1e-5)
    for path, body, param in (("/embeddings", {}, "input"), ("/embedding", {"content": [{"x": 1}]}, "content[0]"),
                              ("/embeddings", {"input": {"content": [{"type": "image_url"}]}}, "input.content[0]"),
                              ("/v1/embeddings", {"input": ["a", 3]}, "input[1]")):
        bad = http.post(path, json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (path, bad.text)


def test_chat_input_tokens_count_the_prompt(http, hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
    want = len(hf_tokenizer.encode(hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                                      add_generation_prompt=True)))
    for path in ("/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"):
        out = http.post(path, json={"messages": messages})
        assert out.status_code == 200 and out.json() == {"object": "response.input_tokens", "input_tokens": want}
    usage = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == want
    bad = http.post("/v1/chat/completions/input_tokens", json={"messages": [{"role": "robot", "content": "x"}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages[0].role"


def test_post_sampling_probs_are_the_samplers_distribution(http):
    """post_sampling_probs: prob and top_probs after the sampler chain (top_k 3 here: at most 3, summing to 1; the
    cut tokens left out); greedy puts probability 1 on the chosen token alone."""
    body = {"prompt": PROMPT, "n_predict": 4, "n_probs": 6, "top_k": 3, "seed": 5, "post_sampling_probs": True}
    out = http.post("/completion", json=body).json()
    assert out["generation_settings"]["post_sampling_probs"] is True
    for tok in out["completion_probabilities"]:
        assert "logprob" not in tok and "top_logprobs" not in tok
        top = tok["top_probs"]
        assert 1 <= len(top) <= 3 and abs(sum(t["prob"] for t in top) - 1) < 1e-4
        assert all(t["prob"] > 0 and set(t) == {"id", "token", "bytes", "prob"} for t in top)
        assert [t["prob"] for t in top] == sorted((t["prob"] for t in top), reverse=True)
        assert any(t["id"] == tok["id"] and abs(t["prob"] - tok["prob"]) < 1e-6 for t in top)
    greedy = http.post("/completion", json={**body, "temperature": 0}).json()["completion_probabilities"]
    assert all(t["prob"] == 1.0 and t["top_probs"] == [{"id": t["id"], "token": t["token"], "bytes": t["bytes"],
                                                         "prob": 1.0}] for t in greedy)
    with http.stream("POST", "/completion", json={**body, "temperature": 0, "stream": True}) as r:
        streamed = [p for e in sse_events(r) if not e["stop"] for p in e["completion_probabilities"]]
    assert streamed == greedy


def test_generation_settings_show_logit_bias_pairs_and_the_end_tokens_ignore_eos_bans(http, hf_tokenizer):
    token = hf_tokenizer.encode(" the")[0]
    settings = _greedy(http, prompt=PROMPT, n_predict=1, logit_bias=[[token, 2.5]])["generation_settings"]
    assert settings["logit_bias"] == [{"bias": 2.5, "token": token}]
    settings = _greedy(http, prompt=PROMPT, n_predict=1, ignore_eos=True)["generation_settings"]
    ends = [pair for pair in settings["logit_bias"] if pair["bias"] is None]
    assert ends and {"bias": None, "token": hf_tokenizer.eos_token_id} in ends


def test_an_array_valued_items_is_a_tuple(http):
    import json

    schema = {"type": "array", "items": [{"type": "string", "maxLength": 8}, {"type": "integer", "maximum": 99}]}
    out = _greedy(http, prompt=PROMPT, n_predict=40, json_schema=schema)["content"]
    value = json.loads(out)
    assert len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


LLAMACPP_FAMILIES = {
    "prompt_tokens_total": "counter", "prompt_tokens_cached_total": "counter", "prompt_seconds_total": "counter",
    "tokens_predicted_total": "counter", "tokens_predicted_seconds_total": "counter", "n_decode_total": "counter",
    "n_tokens_max": "counter", "spec_decode_num_draft_tokens_total": "counter",
    "spec_decode_num_accepted_tokens_total": "counter", "spec_decode_num_drafts_total": "counter",
    "prompt_tokens_seconds": "gauge", "predicted_tokens_seconds": "gauge", "requests_processing": "gauge",
    "requests_deferred": "gauge", "n_busy_slots_per_decode": "gauge"}


def _llamacpp_metrics(server) -> tuple[dict[str, float], httpx.Response]:
    answer = httpx.get(f"{server.base_url}/metrics")
    lines = answer.text.splitlines()
    values = {}
    for name, kind in LLAMACPP_FAMILIES.items():
        full = f"llamacpp:{name}"
        at = lines.index(f"# TYPE {full} {kind}")  # llama-server's lines: HELP, TYPE, the value
        assert lines[at - 1].startswith(f"# HELP {full} ") and lines[at + 1].startswith(full + " ")
        values[name] = float(lines[at + 1].split()[1])
    return values, answer


def test_metrics_export_llamacpps_families(server, http):
    """/metrics adds llama.cpp's llamacpp:* families (HELP, TYPE and value, as llama-server writes them) and its
    Process-Start-Time-Unix header; a completion moves the counters by what it did."""
    import time

    from prometheus_client.parser import text_string_to_metric_families

    before, answer = _llamacpp_metrics(server)
    assert 0 < int(answer.headers["Process-Start-Time-Unix"]) <= time.time()
    list(text_string_to_metric_families(answer.text))  # the whole text still parses
    out = _greedy(http, prompt=f"{time.time()} {PROMPT}", n_predict=5, ignore_eos=True)
    after, _ = _llamacpp_metrics(server)
    assert after["tokens_predicted_total"] - before["tokens_predicted_total"] == 5
    computed = out["tokens_evaluated"] - out["tokens_cached"]
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == computed
    assert after["prompt_tokens_cached_total"] - before["prompt_tokens_cached_total"] == out["tokens_cached"]
    assert after["n_decode_total"] - before["n_decode_total"] >= 5 and after["n_busy_slots_per_decode"] >= 1
    assert after["prompt_seconds_total"] > before["prompt_seconds_total"]
    assert after["tokens_predicted_seconds_total"] > before["tokens_predicted_seconds_total"]
    assert after["n_tokens_max"] >= out["tokens_evaluated"] + 5
    assert after["predicted_tokens_seconds"] > 0 and after["prompt_tokens_seconds"] > 0  # since the last scrape
    assert after["requests_processing"] == after["requests_deferred"] == 0
    assert _llamacpp_metrics(server)[0]["predicted_tokens_seconds"] == 0  # nothing generated since


def test_chat_takes_n_probs_and_the_rendering_flags(http, hf_tokenizer, model_name):
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    body = {"model": model_name, "messages": messages, "max_tokens": 3, "temperature": 0}
    out = http.post("/v1/chat/completions", json={**body, "continue_final_message": True, "n_probs": 3}).json()
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert out["usage"]["prompt_tokens"] == len(hf_tokenizer.encode(text))
    assert len(out["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3
    flat = http.post("/v1/chat/completions", json={**body, "add_generation_prompt": False}).json()
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert flat["usage"]["prompt_tokens"] == len(hf_tokenizer.encode(text))
    both = http.post("/v1/chat/completions", json={**body, "add_generation_prompt": True,
                                                   "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    completion = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n_probs": 2}).json()
    assert len(completion["choices"][0]["logprobs"]["top_logprobs"][0]) >= 2


def test_verbose_adds_the_native_result(http, hf_tokenizer, model_name):
    """llama.cpp's "verbose": true: the answer adds its native result (the prompt as text) as "__verbose"."""
    messages = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
    for verbose in (True, False):
        out = http.post("/chat/completions", json={"messages": messages, "max_tokens": 2, "verbose": verbose}).json()
        assert ("__verbose" in out) is verbose
    assert out["choices"]  # the OpenAI fields stay as they are
    out = http.post("/chat/completions", json={"messages": messages, "max_tokens": 2, "verbose": True}).json()
    native = out["__verbose"]
    assert native["prompt"] == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert native["content"] == out["choices"][0]["message"]["content"] and native["stop_type"] == "limit"
    assert native["tokens_evaluated"] == out["usage"]["prompt_tokens"]
    text = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "verbose": True}).json()
    assert text["__verbose"]["prompt"] == PROMPT and text["__verbose"]["content"] == text["choices"][0]["text"]


def test_context_overflow_names_n_prompt_tokens_and_n_ctx(http, hf_tokenizer):
    n_ctx = http.get("/props").json()["default_generation_settings"]["n_ctx"]
    out = http.post("/completion", json={"prompt": PROMPT, "n_predict": n_ctx})
    assert out.status_code == 400
    error = out.json()["error"]
    assert error["n_prompt_tokens"] == len(hf_tokenizer.encode(PROMPT)) and error["n_ctx"] == n_ctx
    assert error["param"] == "n_predict"


PREFLIGHT = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}


def test_several_hosts_and_the_localhost_cors_keyword(coder):
    srv, _ = coder
    port = srv.base_url.rsplit(":", 1)[1]
    for address in ("127.0.0.1", "127.0.0.2"):
        assert httpx.get(f"http://{address}:{port}/health").status_code == 200
    for origin in ("http://localhost:5173", "https://127.0.0.1", "http://[::1]:8000", "http://app.example"):
        ok = httpx.options(f"{srv.base_url}/v1/completions", headers={"origin": origin, **PREFLIGHT})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == origin
    for origin in ("http://evil.example", "http://localhost.evil.example", "http://app.example:1"):
        refused = httpx.options(f"{srv.base_url}/v1/completions", headers={"origin": origin, **PREFLIGHT})
        assert refused.status_code == 400 and refused.text == "Disallowed CORS origin"
        assert "access-control-allow-origin" not in refused.headers


def test_without_allowed_origins_a_preflight_is_refused_as_starlette_does(server):
    refused = httpx.options(f"{server.base_url}/v1/chat/completions",
                            headers={"origin": "http://localhost:3000", **PREFLIGHT})
    assert refused.status_code == 400 and refused.text == "Disallowed CORS origin"


# ---- a bounded fuzz of the native bodies ---------------------------------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(2**64) + 1, 2**64 - 1), st.text(max_size=8),
                  st.floats(allow_nan=False, allow_infinity=False))
_ANY = st.recursive(_LEAF, lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=6)
_TOKEN = st.integers(-2, 50_000)
_NATIVE = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(max_size=20), st.lists(_TOKEN, max_size=4),
                         st.lists(st.one_of(_TOKEN, st.text(max_size=6)), max_size=3),
                         st.lists(st.one_of(st.text(max_size=6), st.lists(_TOKEN, max_size=3)), max_size=3), _ANY),
     "n_predict": st.one_of(st.integers(-2, 3), st.integers(min_value=10**6, max_value=2**64))},
    optional={"temperature": st.floats(-1, 2), "top_k": st.integers(-2, 100), "top_p": st.floats(0, 1),
              "min_p": st.floats(0, 1), "seed": st.integers(-2, 2**64), "stop": _ANY, "n_probs": st.integers(-1, 30),
              "n_cmpl": st.integers(0, 20), "logit_bias": st.one_of(_ANY, st.lists(st.tuples(
                  st.one_of(_TOKEN, st.text(max_size=4)), st.one_of(st.booleans(), st.floats(-200, 200))).map(list),
                  max_size=3)),
              "repeat_penalty": st.floats(0, 2), "mirostat": st.integers(0, 2), "typical_p": st.floats(0, 1),
              "response_fields": _ANY, "return_tokens": _ANY, "stream": st.booleans(), "grammar": _ANY,
              "json_schema": _ANY, "post_sampling_probs": _ANY, "return_progress": st.booleans(),
              "timings_per_token": st.booleans(), "cache_prompt": _ANY, "id_slot": _ANY})


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(body=_NATIVE, infill=st.booleans())
def test_no_native_body_gets_a_5xx(http, body, infill):
    if infill:
        body = {**body, "input_prefix": body.pop("prompt"), "input_suffix": "x"}
    with http.stream("POST", "/infill" if infill else "/completion", json=body) as answer:
        content = answer.read()
    assert answer.status_code < 500, (body, content[:500])
    if answer.status_code >= 400:
        assert answer.json()["error"]["message"]
    elif answer.headers["content-type"].startswith("text/event-stream"):
        assert b'"stop":true' in content and b'"error"' not in content, content[-300:]

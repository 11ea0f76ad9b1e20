"""Chat and text completions through the official OpenAI client and raw httpx, against the real server."""

from __future__ import annotations

import math

import httpx
import openai

from tests.server.helpers import sse_events

FRANCE_CHAT = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
FRANCE_PROMPT = "The capital of France is"


def _chat_prompt_len(hf_tokenizer, messages: list[dict]) -> int:
    text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return len(hf_tokenizer.encode(text, add_special_tokens=False))


def test_chat_answers_paris_with_usage_from_the_tokenizer(client: openai.OpenAI, model_name: str, hf_tokenizer) -> None:
    out = client.chat.completions.create(model=model_name, messages=FRANCE_CHAT, temperature=0, max_tokens=16)
    assert out.object == "chat.completion" and out.model == model_name and out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    assert out.usage.prompt_tokens == _chat_prompt_len(hf_tokenizer, FRANCE_CHAT)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    assert 1 <= out.usage.completion_tokens < 16


def test_completion_answers_paris_with_usage_from_the_tokenizer(client: openai.OpenAI, model_name: str,
                                                                hf_tokenizer) -> None:
    out = client.completions.create(model=model_name, prompt=FRANCE_PROMPT, temperature=0, max_tokens=4)
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].text.strip().startswith("Paris")
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(hf_tokenizer.encode(FRANCE_PROMPT))
    assert out.usage.completion_tokens == 4


def test_content_parts_and_system_role_render_like_strings(client: openai.OpenAI, model_name: str) -> None:
    plain = [{"role": "system", "content": "Be brief."}, FRANCE_CHAT[0]]
    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": FRANCE_CHAT[0]["content"]}]}]
    a = client.chat.completions.create(model=model_name, messages=plain, temperature=0, max_tokens=6)
    b = client.chat.completions.create(model=model_name, messages=parts, temperature=0, max_tokens=6)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_chat_stream_shape_and_equals_non_streamed(http: httpx.Client, client: openai.OpenAI, model_name: str) -> None:
    body = {"model": model_name, "messages": FRANCE_CHAT, "temperature": 0, "max_tokens": 12}
    whole = http.post("/v1/chat/completions", json=body).json()
    with http.stream("POST", "/v1/chat/completions",
                     json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage_chunk, finish_chunk, content_chunks = chunks[-1], chunks[-2], chunks[1:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    assert finish_chunk["choices"][0]["delta"] == {}
    assert finish_chunk["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert content_chunks and all(c["choices"][0]["finish_reason"] is None for c in content_chunks)
    assert all(c["usage"] is None for c in chunks[:-1])
    streamed = "".join(c["choices"][0]["delta"]["content"] for c in content_chunks)
    assert streamed == whole["choices"][0]["message"]["content"]
    # the same through the SDK's stream iterator
    sdk = client.chat.completions.create(model=model_name, messages=FRANCE_CHAT, temperature=0, max_tokens=12,
                                         stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in sdk) == streamed


def test_completion_stream_equals_non_streamed_and_no_usage_without_option(http: httpx.Client, model_name: str) -> None:
    body = {"model": model_name, "prompt": FRANCE_PROMPT, "temperature": 0, "max_tokens": 10}
    whole = http.post("/v1/completions", json=body).json()
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


def test_echo_prepends_the_prompt(client: openai.OpenAI, model_name: str) -> None:
    plain = client.completions.create(model=model_name, prompt=FRANCE_PROMPT, temperature=0, max_tokens=3)
    echo = client.completions.create(model=model_name, prompt=FRANCE_PROMPT, temperature=0, max_tokens=3, echo=True)
    assert echo.choices[0].text == FRANCE_PROMPT + plain.choices[0].text


def test_stop_strings_end_the_text_before_the_stop(client: openai.OpenAI, model_name: str) -> None:
    free = client.completions.create(model=model_name, prompt=FRANCE_PROMPT, temperature=0, max_tokens=8)
    assert "." in free.choices[0].text  # " Paris.\n..." so a "." stop must cut it
    cut = client.completions.create(model=model_name, prompt=FRANCE_PROMPT, temperature=0, max_tokens=8,
                                    stop=[".", "zzz"])
    assert cut.choices[0].text == free.choices[0].text.split(".")[0]
    assert cut.choices[0].finish_reason == "stop"
    one = client.completions.create(model=model_name, prompt=FRANCE_PROMPT, temperature=0, max_tokens=8, stop=".")
    assert one.choices[0].text == cut.choices[0].text


def test_max_tokens_gives_length_and_max_completion_tokens_wins(http: httpx.Client, model_name: str) -> None:
    body = {"model": model_name, "messages": [{"role": "user", "content": "Tell me a long story."}], "temperature": 0}
    out = http.post("/v1/chat/completions", json={**body, "max_tokens": 3}).json()
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 3
    out = http.post("/v1/chat/completions", json={**body, "max_tokens": 9, "max_completion_tokens": 2}).json()
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 2


def test_n_gives_several_choices(client: openai.OpenAI, model_name: str) -> None:
    greedy = client.chat.completions.create(model=model_name, messages=FRANCE_CHAT, temperature=0, max_tokens=5, n=2)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content
    assert greedy.usage.completion_tokens == 10
    sampled = client.completions.create(model=model_name, prompt=["Hello", "Bye"], temperature=1.0, seed=3,
                                        max_tokens=4, n=2)
    assert sorted(c.index for c in sampled.choices) == [0, 1, 2, 3]
    assert sampled.usage.completion_tokens == 16


def test_n_streams_every_choice(http: httpx.Client, model_name: str) -> None:
    body = {"model": model_name, "prompt": FRANCE_PROMPT, "temperature": 0, "max_tokens": 4, "n": 2, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in events[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finished.add(choice["index"])
    assert finished == {0, 1} and texts[0] == texts[1] and texts[0]


def test_seed_makes_sampling_reproducible(client: openai.OpenAI, model_name: str) -> None:
    def run() -> str:
        out = client.completions.create(model=model_name, prompt="Once upon a time", temperature=1.0, seed=1234,
                                        max_tokens=8)
        return out.choices[0].text

    assert run() == run()


def test_chat_logprobs(client: openai.OpenAI, model_name: str) -> None:
    out = client.chat.completions.create(model=model_name, messages=FRANCE_CHAT, temperature=0, max_tokens=5,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(t.token for t in content).startswith(out.choices[0].message.content)
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert t.token == t.top_logprobs[0].token and math.isclose(t.logprob, tops[0])  # greedy picks the top one
        assert sum(math.exp(x) for x in tops) <= 1 + 1e-3
        assert bytes(t.bytes) == t.token.encode()


def test_completion_logprobs(client: openai.OpenAI, model_name: str) -> None:
    out = client.completions.create(model=model_name, prompt=FRANCE_PROMPT, temperature=0, max_tokens=4, logprobs=2)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob and max(top.values()) == logprob and 2 <= len(top) <= 3

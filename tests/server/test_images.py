"""Images through every API (issue 34), on a server running the tiny random Gemma 3 of `tests/fixtures/gemma3_vision`
with its mmproj found beside the model: the same image question through the official OpenAI, Anthropic and Ollama
clients (and the Responses API) gives transformers' greedy answer; llama.cpp's ``/completion`` takes
``multimodal_data``; the prefix cache hits for the same image and misses for another; every refusal is a 400 that
names the limit or the flag, and a remote URL is never fetched."""

from __future__ import annotations

import base64
import io
import socket
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
import torch

from tests.fixtures.gemma3_vision import gemma3_vision_folder
from tests.server.conftest import API_KEY, start_server, stop_server
from tests.test_converted_models import smollm2_tokenizer
from tests.test_vision import encoded, hf_greedy, picture

QUESTION = "What is in this picture?"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def folder(default_model_path: Path) -> Path:
    return gemma3_vision_folder(smollm2_tokenizer(default_model_path))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("media")
    (out / "cat.png").write_bytes(encoded(picture(21)))
    return out


@pytest.fixture(scope="module")
def vision_server(folder: Path, media_dir: Path, tmp_path_factory):
    srv = start_server(folder / "gemma3-f32.gguf", tmp_path_factory.mktemp("vision") / "server.log",
                       ["--max-image-pixels", "250000", "--max-images-per-request", "3",
                        "--allowed-local-media-path", str(media_dir), "--served-model-name", "g3"])
    yield srv
    stop_server(srv)


@pytest.fixture(scope="module")
def raw(vision_server) -> httpx.Client:
    with httpx.Client(base_url=vision_server.base_url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def reference(folder: Path) -> str:
    """transformers' greedy answer to the question about picture 20, as text."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder)
    model = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    image = encoded(picture(20))
    from PIL import Image

    messages = [{"role": "user", "content": [{"type": "image", "image": Image.open(io.BytesIO(image))},
                                             {"type": "text", "text": QUESTION}]}]
    _, tokens = hf_greedy((model, processor), messages, MAX_TOKENS)
    ends = {processor.tokenizer.convert_tokens_to_ids("<end_of_turn>"), processor.tokenizer.eos_token_id}
    cut = next((i for i, t in enumerate(tokens) if t in ends), len(tokens))
    return processor.tokenizer.decode(tokens[:cut])


def b64(seed: int) -> str:
    return base64.b64encode(encoded(picture(seed))).decode()


def data_url(seed: int) -> str:
    return "data:image/png;base64," + b64(seed)


def openai_chat(raw: httpx.Client, image_url: str, text: str = QUESTION, **extra) -> httpx.Response:
    return raw.post("/v1/chat/completions", json={
        "model": "g3", "temperature": 0, "max_tokens": MAX_TOKENS, **extra,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url}},
                                                  {"type": "text", "text": text}]}]})


def test_the_same_answer_through_every_client(vision_server, reference: str) -> None:
    url = vision_server.base_url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
    chat = client.chat.completions.create(model="g3", temperature=0, max_tokens=MAX_TOKENS, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(20)}},
                                     {"type": "text", "text": QUESTION}]}]).choices[0].message.content
    raw_b64 = client.chat.completions.create(model="g3", temperature=0, max_tokens=MAX_TOKENS, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": b64(20)}},
                                     {"type": "text", "text": QUESTION}]}]).choices[0].message.content
    responses = client.responses.create(model="g3", temperature=0, max_output_tokens=MAX_TOKENS, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(20)},
                                     {"type": "input_text", "text": QUESTION}]}]).output_text
    claude = anthropic.Anthropic(base_url=url, api_key=API_KEY, max_retries=0)
    message = claude.messages.create(model="g3", max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(20)}},
            {"type": "text", "text": QUESTION}]}])
    llama = ollama.Client(host=url, headers={"Authorization": f"Bearer {API_KEY}"})
    answer = llama.chat(model="g3", options={"temperature": 0, "num_predict": MAX_TOKENS, "repeat_penalty": 1.0},
                        messages=[{"role": "user", "content": QUESTION, "images": [encoded(picture(20))]}])
    assert chat == raw_b64 == responses == message.content[0].text == answer.message.content == reference


def test_two_images_and_a_later_turn(raw) -> None:
    first = openai_chat(raw, data_url(22)).json()["choices"][0]["message"]["content"]
    second = openai_chat(raw, data_url(23)).json()["choices"][0]["message"]["content"]
    assert first != second
    body = {"model": "g3", "temperature": 0, "max_tokens": MAX_TOKENS, "messages": [
        {"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": [{"type": "text", "text": "Compare"},
                                     {"type": "image_url", "image_url": {"url": data_url(22)}},
                                     {"type": "image_url", "image_url": {"url": data_url(23)}}]}]}
    answer = raw.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] > 2 * 4


def test_the_prefix_cache_is_keyed_by_the_image(raw) -> None:
    text = "Describe this picture for me, in as much detail as you can."
    first = openai_chat(raw, data_url(24), text).json()
    again = openai_chat(raw, data_url(24), text).json()
    other = openai_chat(raw, data_url(25), text).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_llamacpp_multimodal_data_and_props(raw, http) -> None:
    assert raw.get("/props").json()["modalities"]["vision"] is True
    assert http.get("/props").json()["modalities"]["vision"] is False  # the shared text-only server
    answers = []
    for seed in (26, 27):
        r = raw.post("/completion", json={"prompt": {"prompt_string": "Look: <__media__> What is it?",
                                                     "multimodal_data": [b64(seed)]},
                                          "n_predict": MAX_TOKENS, "temperature": 0, "return_tokens": True})
        assert r.status_code == 200, r.text
        answers.append(r.json()["tokens"])
    assert answers[0] != answers[1]
    bad = raw.post("/completion", json={"prompt": {"prompt_string": "no marker", "multimodal_data": [b64(26)]}})
    assert bad.status_code == 400 and "<__media__>" in bad.json()["error"]["message"]
    assert "vision" in raw.post("/api/show", json={"model": "g3"}).json()["capabilities"]


def test_ollama_generate_takes_images(raw) -> None:
    r = raw.post("/api/generate", json={"model": "g3", "prompt": QUESTION, "images": [b64(20)], "stream": False,
                                        "options": {"temperature": 0, "num_predict": MAX_TOKENS}})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_eval_count"] > 4
    r = raw.post("/api/generate", json={"model": "g3", "prompt": QUESTION, "images": [b64(20)], "raw": True})
    assert r.status_code == 400 and "images" in r.text


def error_of(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    body = r.json()
    return str(body.get("error", body))


def test_refusals_name_the_limit(raw, media_dir: Path) -> None:
    assert "not a readable image" in error_of(openai_chat(raw, "data:image/png;base64,"
                                                          + base64.b64encode(b"plain text").decode()))
    big = "data:image/png;base64," + base64.b64encode(encoded(picture(28, (600, 500)))).decode()
    assert "--max-image-pixels" in error_of(openai_chat(raw, big))
    body = {"model": "g3", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(i)}} for i in range(4)]}]}
    assert "at most 3" in error_of(raw.post("/v1/chat/completions", json=body))
    assert error_of(openai_chat(raw, f"file://{media_dir}/../elsewhere.png")).count("allowed local media path")
    ok = openai_chat(raw, f"file://{media_dir}/cat.png")
    assert ok.status_code == 200, ok.text
    claude = raw.post("/v1/messages", json={"model": "g3", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "%%%"}}]}]})
    assert claude.status_code == 400 and "base64" in claude.text


def test_a_remote_url_is_refused_without_network_access(raw) -> None:
    with socket.socket() as listener:  # an HTTP server that must never hear from the model server
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        port = listener.getsockname()[1]
        message = error_of(openai_chat(raw, f"http://127.0.0.1:{port}/cat.png"))
        assert "--allowed-media-domains" in message
        with pytest.raises(BlockingIOError):
            listener.accept()


def test_an_image_to_a_text_only_model_names_mmproj(http, model_name: str) -> None:
    r = http.post("/v1/chat/completions", json={"model": model_name, "max_tokens": 1, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(1)}}]}]})
    assert r.status_code == 400 and "--mmproj" in r.json()["error"]["message"]
    r = http.post("/api/chat", json={"model": model_name, "stream": False, "messages": [
        {"role": "user", "content": "hi", "images": [b64(1)]}]})
    assert r.status_code == 400 and "--mmproj" in r.text



@pytest.mark.parametrize("projector", ["idefics3", "qwen2vl", "qwen25vl", "qwen3vl"])
def test_other_projectors_through_openai_and_ollama(default_model_path: Path, tmp_path: Path, projector: str) -> None:
    """SmolVLM's projector (the image cut into tiles plus the whole image) and Qwen2-VL's (the image at its own
    size, M-RoPE positions; Qwen2.5-VL's window attention; Qwen3-VL's deepstack), `tests/fixtures/tiny_vlm`: through
    the OpenAI and Ollama clients, transformers' greedy answer."""
    from PIL import Image
    from transformers import (
        AutoProcessor,
        Idefics3ForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
    )

    from tests.fixtures.tiny_vlm import qwen2vl_processor, tiny_vlm_folder

    folder = tiny_vlm_folder(projector, smollm2_tokenizer(default_model_path))
    if projector == "idefics3":
        processor = AutoProcessor.from_pretrained(folder)
        model = Idefics3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
        end = "<end_of_utterance>"
    else:
        processor = qwen2vl_processor(folder, "Qwen3VLProcessor" if projector == "qwen3vl" else "Qwen2VLProcessor")
        kind = {"qwen2vl": Qwen2VLForConditionalGeneration, "qwen25vl": Qwen2_5_VLForConditionalGeneration,
                "qwen3vl": Qwen3VLForConditionalGeneration}[projector]
        model = kind.from_pretrained(folder, dtype=torch.float32).eval()
        end = "<|im_end|>"
    image = Image.open(io.BytesIO(encoded(picture(20))))
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": QUESTION}]}]
    _, tokens = hf_greedy((model, processor), messages, MAX_TOKENS)
    ends = {processor.tokenizer.convert_tokens_to_ids(end), processor.tokenizer.eos_token_id}
    reference = processor.tokenizer.decode(tokens[:next((i for i, t in enumerate(tokens) if t in ends), len(tokens))])
    srv = start_server(folder / f"{projector}-f32.gguf", tmp_path / "server.log", ["--served-model-name", "vlm"])
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=API_KEY, max_retries=0)
        chat = client.chat.completions.create(model="vlm", temperature=0, max_tokens=MAX_TOKENS, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(20)}},
                                         {"type": "text", "text": QUESTION}]}]).choices[0].message.content
        llama = ollama.Client(host=srv.base_url, headers={"Authorization": f"Bearer {API_KEY}"})
        answer = llama.chat(model="vlm", options={"temperature": 0, "num_predict": MAX_TOKENS, "repeat_penalty": 1.0},
                            messages=[{"role": "user", "content": QUESTION, "images": [encoded(picture(20))]}])
    finally:
        stop_server(srv)
    assert reference and chat == answer.message.content == reference

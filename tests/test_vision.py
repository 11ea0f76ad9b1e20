"""Images in (issue 34), through the library: a tiny random Gemma 3 with a SigLIP tower (`tests/fixtures/gemma3_vision`),
converted by llama.cpp's own converter into a text GGUF and an mmproj GGUF. The references are transformers'
`Gemma3ForConditionalGeneration` in float32 with its processor (the image features, the prompt ids, the greedy
tokens), on the exact path and the CPU fast path; and Pillow itself for the image sources."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image

from gpullama import LLM, SamplingParams
from gpullama.checks import RequestError
from gpullama.kernels import cpu_native
from gpullama.ops import CpuOps
from gpullama.vision.images import ImagePolicy, ImageRef, load_image
from tests.fixtures.gemma3_vision import gemma3_vision_folder
from tests.fixtures.tiny_vlm import vlm_factory
from tests.test_converted_models import smollm2_tokenizer

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)

needs_kernels = pytest.mark.skipif(cpu_native.library() is None, reason=f"no CPU kernels: {cpu_native.build_error()}")


def picture(seed: int, size: tuple[int, int] = (60, 45)) -> Image.Image:
    """A random RGB picture (width, height)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def encoded(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **kw)
    return out.getvalue()


@pytest.fixture(scope="session")
def vision_folder(default_model_path: Path) -> Path:
    return gemma3_vision_folder(smollm2_tokenizer(default_model_path))


@pytest.fixture(scope="session")
def hf(vision_folder):
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(vision_folder)
    model = Gemma3ForConditionalGeneration.from_pretrained(vision_folder, dtype=torch.float32).eval()
    return model, processor


def hf_greedy(hf, messages: list[dict], n: int = GREEDY.max_tokens) -> tuple[list[int], list[int]]:
    """transformers' prompt ids and greedy tokens for a chat whose image parts hold PIL images."""
    model, processor = hf
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"]
              if p["type"] == "image"]
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, do_sample=False)
    return inputs["input_ids"][0].tolist(), out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.fixture(scope="session")
def vision_llm(vision_folder):
    """Factory: the model with its mmproj, on the exact path (found beside the model by itself) or the fast path
    (named explicitly; the C kernels on the converter's F32/F16 matrices)."""
    return vlm_factory(vision_folder / "gemma3-f32.gguf", mmproj=str(vision_folder / "mmproj-gemma3-f32.gguf"))


def one_image(img, question: str = "What is in this picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": img}, {"type": "text", "text": question}]}]


CHATS = {
    "one image": lambda: one_image(picture(1)),
    "two images in one message": lambda: [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image", "image": picture(2)},
        {"type": "text", "text": "with"}, {"type": "image", "image": picture(3, (20, 50))},
        {"type": "text", "text": "please."}]}],
    "an image in a later turn": lambda: [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "image", "image": picture(4)}]}],
}


def test_tower_matches_transformers_image_features(vision_llm, hf) -> None:
    model, processor = hf
    images = [picture(5), picture(6, (31, 77))]
    pixels = processor.image_processor(images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ref = model.model.get_image_features(pixels).pooler_output
    tower = vision_llm().vision.tower
    ours = torch.stack([tower.preprocess(load_image(ImageRef(im)).image) for im in images])
    torch.testing.assert_close(ours, pixels, atol=1e-6, rtol=0)  # Pillow's resize, the file's mean and std
    torch.testing.assert_close(tower.encode(ours), ref, atol=2e-5, rtol=1e-4)


@needs_kernels
def test_fast_tower_matches_transformers_image_features(vision_llm, hf) -> None:
    model, processor = hf
    pixels = processor.image_processor([picture(5)], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ref = model.model.get_image_features(pixels).pooler_output
    torch.testing.assert_close(vision_llm(fast=True).vision.tower.encode(pixels), ref, atol=2e-3, rtol=1e-2)


@needs_kernels
@pytest.mark.parametrize(("kind", "tolerance"), [("f16", 1e-3), ("q8_0", 2e-2)])
def test_f16_and_q8_0_towers_on_the_c_kernels(vision_folder, hf, kind: str, tolerance: float) -> None:
    """The converter's F16 and Q8_0 mmproj files: the fast path's tower multiplies their blocks with the C kernels
    (`CpuWeight`), as the exact path does after dequantizing them, and stays near transformers' float32 features."""
    from gpullama.ops.cpu_weights import CpuWeight
    from gpullama.ops.torch_ops import TorchOps
    from gpullama.vision.tower import VisionTower

    model, processor = hf
    pixels = processor.image_processor([picture(5), picture(6)], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        ref = model.model.get_image_features(pixels).pooler_output
    path = vision_folder / kind / f"mmproj-gemma3-{kind}.gguf"
    fast = VisionTower(path, CpuOps(torch.device("cpu")))
    assert isinstance(fast.blocks[0].qkv, CpuWeight) and isinstance(fast.blocks[0].down, CpuWeight)
    exact = VisionTower(path, TorchOps(torch.device("cpu"))).encode(pixels)
    torch.testing.assert_close(fast.encode(pixels), exact, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(exact, ref, atol=tolerance, rtol=0)


@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=needs_kernels)], ids=["exact", "fast"])
@pytest.mark.parametrize("chat", list(CHATS))
def test_greedy_tokens_equal_transformers(vision_llm, hf, chat: str, fast: bool) -> None:
    messages = CHATS[chat]()
    ref_prompt, ref_tokens = hf_greedy(hf, messages)
    out = vision_llm(fast).chat(messages, GREEDY)[0]
    assert out.prompt_token_ids == ref_prompt
    assert out.token_ids == ref_tokens


def assert_two_pictures_answer_apart(llm: LLM) -> None:
    """Two chats that differ only in their picture's pixels: the same prompt ids, different answers."""
    first, second = llm.chat([one_image(picture(7)), one_image(picture(8))], GREEDY)
    assert first.prompt_token_ids == second.prompt_token_ids  # the same text and placeholders: only the pixels differ
    assert first.token_ids != second.token_ids


def test_two_images_give_different_answers(vision_llm) -> None:
    assert_two_pictures_answer_apart(vision_llm())


def test_every_image_source_reads_the_same_pixels(vision_llm, tmp_path) -> None:
    img = picture(9)
    png = encoded(img)
    path = tmp_path / "cat.png"
    path.write_bytes(png)
    sources = [img, png, path, str(path), "data:image/png;base64," + base64.b64encode(png).decode(),
               base64.b64encode(png).decode()]
    answers = vision_llm().chat([one_image(s) for s in sources] + [
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                          + base64.b64encode(png).decode()}},
                                      {"type": "text", "text": "What is in this picture?"}]}]], GREEDY)
    assert len({tuple(a.token_ids) for a in answers}) == 1


def test_decoding_follows_pillow(tmp_path) -> None:
    base = picture(10, (40, 24))
    # EXIF orientation 6 (rotate 90 clockwise to view): the image as shown is Pillow's exif_transpose of it
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = load_image(ImageRef(encoded(base, "JPEG", exif=exif.tobytes(), quality=95))).image
    assert rotated.size == (24, 40)
    plain = load_image(ImageRef(encoded(base, "JPEG", quality=95))).image
    assert np.array_equal(np.asarray(rotated), np.asarray(plain.transpose(Image.Transpose.ROTATE_270)))
    # GIF: the first frame, as RGB; WebP lossless; RGBA and grayscale become RGB
    frames = [picture(11, (16, 16)).quantize(), picture(12, (16, 16)).quantize()]
    gif = io.BytesIO()
    frames[0].save(gif, format="GIF", save_all=True, append_images=frames[1:])
    first = load_image(ImageRef(gif.getvalue())).image
    assert first.mode == "RGB" and np.array_equal(np.asarray(first), np.asarray(frames[0].convert("RGB")))
    webp = load_image(ImageRef(encoded(base, "WEBP", lossless=True))).image
    assert np.array_equal(np.asarray(webp), np.asarray(base))
    assert load_image(ImageRef(encoded(base.convert("L")))).image.mode == "RGB"
    # the content key: the same pixels however sent, other pixels another key
    assert load_image(ImageRef(encoded(base))).key == load_image(ImageRef(base)).key
    assert load_image(ImageRef(encoded(picture(13, (40, 24))))).key != load_image(ImageRef(base)).key


def test_image_limits_and_bad_payloads_are_refused_by_name(tmp_path) -> None:
    png = encoded(picture(14, (64, 64)))
    with pytest.raises(RequestError, match="max-image-bytes"):
        load_image(ImageRef(png, "messages[0].content[0]"), ImagePolicy(max_bytes=100))
    with pytest.raises(RequestError, match="64x64 = 4096 pixels.*max-image-pixels"):
        load_image(ImageRef(png), ImagePolicy(max_pixels=4000))
    with pytest.raises(RequestError, match="not a readable image") as err:
        load_image(ImageRef(b"this is not an image", "messages[0].content[1].image_url.url"))
    assert err.value.param == "messages[0].content[1].image_url.url"
    with pytest.raises(RequestError, match="not valid base64"):
        load_image(ImageRef("data:image/png;base64,@@@not base64@@@"))
    with pytest.raises(RequestError, match="corrupt"):
        load_image(ImageRef(png[:60]))
    remote = ImageRef("https://example.com/cat.png")
    with mock.patch("urllib.request.urlopen", side_effect=AssertionError("no network access")):
        with pytest.raises(RequestError, match="--allowed-media-domains"):
            load_image(remote, ImagePolicy())
        with pytest.raises(RequestError, match="--allowed-media-domains"):
            load_image(remote, ImagePolicy(allowed_domains=("example.org",)))
    (tmp_path / "cat.png").write_bytes(png)
    with pytest.raises(RequestError, match="--allowed-local-media-path"):
        load_image(ImageRef(f"file://{tmp_path}/cat.png"), ImagePolicy())
    with pytest.raises(RequestError, match="outside the allowed local media path"):
        load_image(ImageRef(f"file://{tmp_path}/cat.png"), ImagePolicy(allowed_local_path=str(tmp_path / "sub")))
    assert load_image(ImageRef(f"file://{tmp_path}/cat.png"), ImagePolicy(allowed_local_path=str(tmp_path))).key


def test_too_many_images_and_no_projector(vision_llm, vision_folder) -> None:
    llm = vision_llm()
    with pytest.raises(RequestError, match="'images' holds 9 items; at most 8"):
        llm.chat([{"role": "user", "content": [{"type": "image", "image": picture(1)}] * 9}], GREEDY)
    text_only = LLM(str(vision_folder / "gemma3-f32.gguf"), device="cpu", dtype="float32", no_mmproj=True)
    assert text_only.vision is None
    with pytest.raises(RequestError, match="mmproj"):
        text_only.chat(one_image(picture(1)), GREEDY)
    assert text_only.chat([{"role": "user", "content": "Hi"}], GREEDY)[0].token_ids  # text still works


def test_prefix_cache_is_keyed_by_the_image(vision_llm) -> None:
    llm = vision_llm()
    question = "Tell me everything about this picture, in detail."
    first = llm.chat(one_image(picture(15), question), GREEDY)[0]
    again = llm.chat(one_image(picture(15), question), GREEDY)[0]
    other = llm.chat(one_image(picture(16), question), GREEDY)[0]
    start = first.prompt_token_ids.index(llm.vision.image_token_id)
    assert start < 16  # the image lies in the first KV block
    assert again.num_cached_tokens >= 16 and again.token_ids == first.token_ids
    assert other.num_cached_tokens == 0  # the same text with another image: no hit
    assert other.token_ids != first.token_ids


def test_chunked_prefill_never_splits_an_image(vision_folder, hf) -> None:
    messages = CHATS["two images in one message"]()
    _, ref = hf_greedy(hf, messages)
    small = LLM(str(vision_folder / "gemma3-f32.gguf"), device="cpu", dtype="float32", max_num_batched_tokens=6)
    assert small.chat(messages, GREEDY)[0].token_ids == ref
    tiny = LLM(str(vision_folder / "gemma3-f32.gguf"), device="cpu", dtype="float32", max_num_batched_tokens=3)
    with pytest.raises(RequestError, match="more than max_num_batched_tokens"):
        tiny.chat(messages, GREEDY)


def test_info_shows_the_modalities(vision_folder, capsys) -> None:
    from gpullama.cli import main

    assert main(["info", str(vision_folder / "gemma3-f32.gguf")]) == 0
    assert "text, image (mmproj-gemma3-f32.gguf: gemma3 projector, 32x32 pixels)" in capsys.readouterr().out


def test_the_command_line_takes_images(vision_llm, vision_folder, tmp_path, capsys) -> None:
    from gpullama.cli import ChatSession, main

    path = tmp_path / "cat.png"
    path.write_bytes(encoded(picture(30)))
    expected = vision_llm().chat(one_image(path, "What is it?"), GREEDY)[0].text
    session = ChatSession(vision_llm(), GREEDY, None)
    session.command(f"/image {path}")
    session.answer("What is it?")
    assert capsys.readouterr().out == expected + "\n"
    (tmp_path / "notes.txt").write_text("not an image")
    session.command(f"/image {tmp_path / 'notes.txt'}")
    session.answer("And this?")
    assert "not a readable image" in capsys.readouterr().err and len(session.messages) == 2  # the bad turn dropped
    assert main(["generate", "--model", str(vision_folder / "gemma3-f32.gguf"), "--device", "cpu", "--dtype",
                 "float32", "--prompt", "What is it?", "--image", str(path), "--max-tokens", "10",
                 "--ignore-eos"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def test_the_projector_beside_the_model_is_found_only_when_alone(tmp_path) -> None:
    from gpullama.vision.loading import find_mmproj

    model = tmp_path / "gemma-3-4b-it-Q4_K_M.gguf"
    model.write_bytes(b"")
    assert find_mmproj(str(model)) is None
    (tmp_path / "mmproj-gemma-3-4b-it-f16.gguf").write_bytes(b"")
    assert find_mmproj(str(model)) == str(tmp_path / "mmproj-gemma-3-4b-it-f16.gguf")
    (tmp_path / "mmproj-other.gguf").write_bytes(b"")
    assert find_mmproj(str(model)) is None  # two: none is guessed (--mmproj names one)


def test_generate_takes_a_prompt_with_images(vision_llm, hf) -> None:
    """vLLM's prompt dict: the text with the model's image marker (or llama.cpp's <__media__>) and the images."""
    model, processor = hf
    image = picture(31)
    inputs = processor(text="Look: <start_of_image> What is it?", images=[image], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    ref = out[0, inputs["input_ids"].shape[1]:].tolist()
    llm = vision_llm()
    for marker in ("<start_of_image>", "<__media__>"):
        got = llm.generate({"prompt": f"Look: {marker} What is it?", "multi_modal_data": {"image": image}}, GREEDY)[0]
        assert got.prompt_token_ids == inputs["input_ids"][0].tolist()
        assert got.token_ids == ref

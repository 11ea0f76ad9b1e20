"""Gemma 4's images (issue 34): a tiny random Gemma 4 with a vision tower (`tests/fixtures/gemma4_vision`), converted
by llama.cpp's own converter into a text GGUF and a ``gemma4v`` mmproj GGUF. The references are transformers'
`Gemma4ForConditionalGeneration` in float32 with its processor (the pixels, the image features, the prompt ids,
the greedy tokens), on the exact path and the CPU fast path."""

from __future__ import annotations

import pytest
import torch

from gpullama.ops import CpuOps
from tests.fixtures.gemma4_vision import PATCH, gemma4_processor, gemma4_vision_folder
from tests.fixtures.tiny_vlm import vlm_factory
from tests.test_vision import CHATS as VISION_CHATS
from tests.test_vision import GREEDY, assert_two_pictures_answer_apart, needs_kernels, picture


@pytest.fixture(scope="module")
def folder():
    return gemma4_vision_folder()


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return model, gemma4_processor(folder)


@pytest.fixture(scope="module")
def llm(folder):
    """Factory: the model with its mmproj, on the exact path (found beside the model) or the fast path."""
    return vlm_factory(folder / "gemma4-f32.gguf", mmproj=str(folder / "mmproj-gemma4-f32.gguf"))


def hf_features(hf, images):
    """transformers' pixels (patches) and image features, one tensor of each per image."""
    model, processor = hf
    inputs = processor.image_processor(images, return_tensors="pt")
    counts = inputs["num_soft_tokens_per_image"].tolist()
    with torch.no_grad():
        features = model.model.get_image_features(inputs["pixel_values"], inputs["image_position_ids"]).pooler_output
    patches = [p[: n * 9] for p, n in zip(inputs["pixel_values"], counts)]  # the real patches lead, padding after
    return patches, list(features)


def as_patches(pixels: torch.Tensor) -> torch.Tensor:
    """``[3, H, W]`` -> transformers' patches ``[patches, p * p * 3]`` (row, column, channel order)."""
    c, h, w = pixels.shape
    return pixels.reshape(c, h // PATCH, PATCH, w // PATCH, PATCH).permute(1, 3, 2, 4, 0).reshape(-1, PATCH**2 * c)


IMAGES = [(60, 45), (31, 77)]


@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=needs_kernels)], ids=["exact", "fast"])
def test_tower_matches_transformers_image_features(llm, hf, fast: bool) -> None:
    images = [picture(5 + i, size) for i, size in enumerate(IMAGES)]
    patches, ref = hf_features(hf, images)
    tower = llm(fast).vision.tower
    if fast:
        from gpullama.ops.cpu_weights import CpuWeight

        assert isinstance(tower.blocks[0].q, CpuWeight) and isinstance(tower.projection, CpuWeight)
    for image, want_patches, want in zip(images, patches, ref):
        pixels = tower.preprocess(image)
        torch.testing.assert_close(as_patches(pixels), want_patches, atol=1e-6, rtol=0)  # bicubic, sizes
        torch.testing.assert_close(tower.encode(pixels), want, atol=2e-3 if fast else 2e-5, rtol=1e-4)


@needs_kernels
def test_f16_tower_on_the_c_kernels(folder, hf) -> None:
    from gpullama.ops.torch_ops import TorchOps
    from gpullama.vision.gemma4_tower import Gemma4VisionTower

    image = picture(5, IMAGES[0])
    _, (ref,) = hf_features(hf, [image])
    path = folder / "f16" / "mmproj-gemma4-f16.gguf"
    fast, exact = Gemma4VisionTower(path, CpuOps(torch.device("cpu"))), Gemma4VisionTower(path, TorchOps(
        torch.device("cpu")))
    pixels = exact.preprocess(image)
    torch.testing.assert_close(fast.encode(pixels), exact.encode(pixels), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(exact.encode(pixels), ref, atol=1.5e-2, rtol=0)  # the weights rounded to F16


def hf_greedy(hf, messages: list[dict]) -> tuple[list[int], list[int]]:
    """transformers' prompt ids and greedy tokens for a chat whose image parts hold PIL images."""
    model, processor = hf
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images = [p["image"] for m in messages for p in m["content"] if p["type"] == "image"]
    inputs = processor(text=text, images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    return inputs["input_ids"][0].tolist(), out[0, inputs["input_ids"].shape[1]:].tolist()


CHATS = {name: VISION_CHATS[name] for name in ("one image", "two images in one message")}


@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=needs_kernels)], ids=["exact", "fast"])
@pytest.mark.parametrize("chat", list(CHATS))
def test_greedy_tokens_equal_transformers(llm, hf, chat: str, fast: bool) -> None:
    messages = CHATS[chat]()
    ref_prompt, ref_tokens = hf_greedy(hf, messages)
    out = llm(fast).chat(messages, GREEDY)[0]
    assert out.prompt_token_ids == ref_prompt
    assert out.token_ids == ref_tokens


def test_two_images_give_different_answers(llm) -> None:
    assert_two_pictures_answer_apart(llm())


def test_info_names_the_projector(folder, capsys) -> None:
    from gpullama.cli import main

    assert main(["info", str(folder / "gemma4-f32.gguf")]) == 0
    assert ("text, image (mmproj-gemma4-f32.gguf: gemma4v projector, images at their own aspect in tokens of 12x12 "
            "pixels (up to 280 tokens an image), 2-D rotary positions)") in capsys.readouterr().out


def test_generate_takes_a_prompt_with_images(llm, hf) -> None:
    _, processor = hf
    image = picture(9)
    # the file's add_bos_token puts <bos> first (llama.cpp's rule for a raw prompt); the processor adds none itself
    want = processor(text="<bos>Look: <|image|> What is it?", images=[image], return_tensors="pt")["input_ids"][0]
    want = want.tolist()
    for marker in ("<|image|>", "<__media__>"):
        got = llm().generate({"prompt": f"Look: {marker} What is it?", "multi_modal_data": {"image": image}}, GREEDY)[0]
        assert got.prompt_token_ids == want

"""The projector types after Gemma 3's (issue 34), through the library: tiny random transformers models
(`tests/fixtures/tiny_vlm`) converted by llama.cpp's own converter into a text GGUF and an mmproj GGUF. The
references are transformers in float32 with the model's processor: the pixels of each tile, the image features, the
prompt ids, the logits of a prompt with images and the greedy tokens, on the exact path and the CPU fast path."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import gguf
import numpy as np
import pytest
import torch

from gpullama import LLM, SamplingParams
from gpullama.ops import CpuOps
from gpullama.vision.images import ImageRef
from tests.fixtures.tiny_vlm import qwen2vl_processor, tiny_vlm_folder, vlm_factory
from tests.test_converted_models import smollm2_tokenizer
from tests.test_vision import needs_kernels, picture

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
QUESTION = "What is in this picture?"


@pytest.fixture(scope="module")
def idefics3_folder(default_model_path: Path) -> Path:
    return tiny_vlm_folder("idefics3", smollm2_tokenizer(default_model_path))


@pytest.fixture(scope="module", params=["qwen2vl", "qwen25vl"])
def qwen_name(request) -> str:
    """Qwen2-VL (qwen2vl_merger) and Qwen2.5-VL (qwen2.5vl_merger: RMSNorm, SwiGLU, window attention)."""
    return request.param


@pytest.fixture(scope="module")
def qwen2vl_folder(default_model_path: Path, qwen_name: str) -> Path:
    return tiny_vlm_folder(qwen_name, smollm2_tokenizer(default_model_path))


@pytest.fixture(scope="module")
def idefics3_hf(idefics3_folder):
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(idefics3_folder)
    model = Idefics3ForConditionalGeneration.from_pretrained(idefics3_folder, dtype=torch.float32).eval()
    return model, processor


@pytest.fixture(scope="module")
def idefics3_llm(idefics3_folder):
    """Factory: the model with its mmproj (found beside it) on the exact path, or on the fast path."""
    return vlm_factory(idefics3_folder / "idefics3-f32.gguf")


def images_of(messages: list[dict]) -> list:
    return [p["image"] for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"]


def hf_inputs(hf, messages: list[dict], **kw):
    """The processor's inputs for a chat whose image parts hold PIL images (`kw`: the image processor's options)."""
    _, processor = hf
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return text, processor(text=text, images=images_of(messages) or None, return_tensors="pt", **kw)


CHATS = {
    "one image": lambda: [{"role": "user", "content": [{"type": "image", "image": picture(1)},
                                                       {"type": "text", "text": QUESTION}]}],
    "two images, 2x2 and 2x1 tiles": lambda: [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image", "image": picture(2)},
        {"type": "text", "text": "with"}, {"type": "image", "image": picture(3, (20, 50))},
        {"type": "text", "text": "please."}]}],
    "an image in a later turn": lambda: [
        {"role": "user", "content": "Hello there."},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": [{"type": "text", "text": "Describe"}, {"type": "image", "image": picture(4, (64, 20))}]}],
}


def assert_two_images_answer_apart(llm: LLM, hf) -> None:
    """Two images under the same question: each answer is transformers' greedy one, and they differ (the same text and
    placeholders: only the pixels do)."""
    model, _ = hf
    answers = []
    for image in (picture(11), picture(12)):
        messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                                 {"type": "text", "text": "What is in this picture?"}]}]
        _, inputs = hf_inputs(hf, messages)
        with torch.no_grad():
            ref = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
        out = llm.chat(messages, GREEDY)[0]
        assert out.token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()
        answers.append(out)
    assert answers[0].prompt_token_ids == answers[1].prompt_token_ids
    assert answers[0].token_ids != answers[1].token_ids


def test_idefics3_tiles_and_features_equal_transformers(idefics3_llm, idefics3_hf) -> None:
    model, processor = idefics3_hf
    tower = idefics3_llm().vision.tower
    for image, grid in ((picture(5), (2, 2)), (picture(6, (31, 77)), (2, 1)), (picture(7, (300, 7)), (1, 2))):
        inputs = processor.image_processor([image], return_tensors="pt", return_row_col_info=True)
        with torch.no_grad():
            ref = model.model.get_image_features(inputs["pixel_values"], inputs["pixel_attention_mask"]).pooler_output[0]
        pixels, rows, cols = tower.tiles(image)
        assert (rows, cols) == (inputs["rows"][0][0], inputs["cols"][0][0]) == grid
        torch.testing.assert_close(pixels, inputs["pixel_values"][0], atol=1e-6, rtol=0)  # Pillow's Lanczos, mean/std
        torch.testing.assert_close(tower.encode(pixels).reshape(ref.shape), ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=needs_kernels)], ids=["exact", "fast"])
@pytest.mark.parametrize("chat", list(CHATS))
def test_idefics3_logits_and_greedy_tokens_equal_transformers(idefics3_llm, idefics3_hf, chat: str,
                                                              fast: bool) -> None:
    model, _ = idefics3_hf
    messages = CHATS[chat]()
    text, inputs = hf_inputs(idefics3_hf, messages)
    with torch.no_grad():
        want = model(**inputs).logits[0]
        ref = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    llm = idefics3_llm(fast)
    ids = llm.vision.prompt(text, [ImageRef(im) for im in images_of(messages)])
    assert list(ids) == inputs["input_ids"][0].tolist()
    got = llm.logits(ids)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < (1e-3 if fast else 1e-4), f"max error {rel:.3g} of the largest logit"
    out = llm.chat(messages, GREEDY)[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()


def test_idefics3_image_of_one_tile(idefics3_llm, idefics3_hf) -> None:
    """An mmproj whose longest edge is the tile's: the global image alone, as the processor makes it then."""
    model, _ = idefics3_hf
    llm = idefics3_llm()
    messages = CHATS["one image"]()
    _, inputs = hf_inputs(idefics3_hf, messages, size={"longest_edge": 32})
    assert inputs["pixel_values"].shape[1] == 1
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    with mock.patch.object(llm.vision.tower.config, "longest_edge", 32):
        out = llm.chat(messages, GREEDY)[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()


def test_idefics3_chunked_prefill_may_split_its_causal_tiles(idefics3_folder, idefics3_hf) -> None:
    model, _ = idefics3_hf
    messages = CHATS["two images, 2x2 and 2x1 tiles"]()
    _, inputs = hf_inputs(idefics3_hf, messages)
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    small = LLM(str(idefics3_folder / "idefics3-f32.gguf"), device="cpu", dtype="float32", max_num_batched_tokens=3)
    assert small.chat(messages, GREEDY)[0].token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()


def test_idefics3_info_shows_the_projector(idefics3_folder, capsys) -> None:
    from gpullama.cli import main

    assert main(["info", str(idefics3_folder / "idefics3-f32.gguf")]) == 0
    assert ("text, image (mmproj-idefics3-f32.gguf: idefics3 projector, 32x32 pixel tiles of the image resized to 64 "
            "pixels on its longest side, plus the whole image)") in capsys.readouterr().out


def unsupported_mmproj(path: Path, projector: str) -> Path:
    """An mmproj file of a projector type gpullama does not read (its header and one tensor)."""
    writer = gguf.GGUFWriter(path, "clip")
    writer.add_string("clip.projector_type", projector)
    writer.add_uint32("clip.vision.projection_dim", 64)
    writer.add_uint32("clip.vision.image_size", 32)
    writer.add_tensor("v.patch_embd.weight", np.zeros((32, 3, 8, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_projectors_are_refused_by_name(idefics3_folder, tmp_path, capsys) -> None:
    from gpullama.cli import main

    model = str(idefics3_folder / "idefics3-f32.gguf")
    path = unsupported_mmproj(tmp_path / "mmproj-pixtral.gguf", "pixtral")
    with pytest.raises(ValueError, match="--mmproj: .*clip.projector_type 'pixtral' is not supported; gpullama reads "
                                         "gemma3, gemma4v, idefics3, qwen2vl_merger, qwen2.5vl_merger, qwen3vl_merger"):
        LLM(model, device="cpu", dtype="float32", mmproj=str(path))
    assert main(["info", model, "--mmproj", str(path)]) == 0
    assert ("text (mmproj-pixtral.gguf: projector pixtral is not supported; gpullama reads gemma3, gemma4v, idefics3, "
            "qwen2vl_merger, qwen2.5vl_merger, qwen3vl_merger)") in capsys.readouterr().out




# -- Qwen2-VL ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen2vl_hf(qwen2vl_folder, qwen_name: str):
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration

    kind = Qwen2_5_VLForConditionalGeneration if qwen_name == "qwen25vl" else Qwen2VLForConditionalGeneration
    model = kind.from_pretrained(qwen2vl_folder, dtype=torch.float32).eval()
    return model, qwen2vl_processor(qwen2vl_folder)


@pytest.fixture(scope="module")
def qwen2vl_llm(qwen2vl_folder, qwen_name: str) -> LLM:
    llm = LLM(str(qwen2vl_folder / f"{qwen_name}-f32.gguf"), device="cpu", dtype="float32")
    assert llm.vision is not None
    return llm


def test_qwen2vl_patches_and_features_equal_transformers(qwen2vl_llm, qwen2vl_hf) -> None:
    model, processor = qwen2vl_hf
    tower = qwen2vl_llm.vision.tower
    for image in (picture(5), picture(6, (31, 77)), picture(7, (300, 7)), picture(8, (200, 150)),
                  picture(9, (300, 120))):  # the last two: several of Qwen2.5-VL's windows
        inputs = processor.image_processor([image], return_tensors="pt")
        with torch.no_grad():
            ref = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
        patches, gh, gw = tower.pixels(image)
        assert [1, gh, gw] == inputs["image_grid_thw"][0].tolist()
        torch.testing.assert_close(patches, inputs["pixel_values"], atol=1e-6, rtol=0)  # bicubic, mean/std, order
        ours = tower.encode_patches(patches, gh, gw)
        ref = ref[0] if isinstance(ref, (list, tuple)) else ref
        torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    if tower.v25:  # the windows matter: attending over the whole image in every block is another answer
        with mock.patch.object(tower, "window_pattern", 1):
            assert (tower.encode_patches(patches, gh, gw) - ref).abs().max() > 1e-3


QWEN_CHATS = {
    "one image": CHATS["one image"],
    "two images of other shapes (one of several windows)": lambda: [{"role": "user", "content": [
        {"type": "text", "text": "Compare"}, {"type": "image", "image": picture(2, (240, 100))},
        {"type": "text", "text": "with"}, {"type": "image", "image": picture(3, (20, 50))},
        {"type": "text", "text": "please."}]}],
    "an image in a later turn": CHATS["an image in a later turn"],
}


@pytest.mark.parametrize("chat", list(QWEN_CHATS))
def test_qwen2vl_logits_and_greedy_tokens_equal_transformers(qwen2vl_llm, qwen2vl_hf, chat: str) -> None:
    """M-RoPE: the image's tokens at (time, row, column) positions, the text after it one past the largest."""
    from gpullama.vision import ImageSpan
    from gpullama.vision.prompt import PromptIds

    model, _ = qwen2vl_hf
    messages = QWEN_CHATS[chat]()
    text, inputs = hf_inputs(qwen2vl_hf, messages)
    with torch.no_grad():
        want = model(**inputs).logits[0]
        ref = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    ids = qwen2vl_llm.vision.prompt(text, [ImageRef(im) for im in images_of(messages)])
    assert list(ids) == inputs["input_ids"][0].tolist()
    got = qwen2vl_llm.logits(ids)
    rel = ((got - want).abs().max() / want.abs().max()).item()
    assert rel < 1e-4, f"max error {rel:.3g} of the largest logit"
    flat = PromptIds(list(ids), [ImageSpan(s.start, s.embeds, s.key, True) for s in ids.images])  # no M-RoPE
    assert ((qwen2vl_llm.logits(flat) - want).abs().max() / want.abs().max()).item() > 1e-2
    out = qwen2vl_llm.chat(messages, GREEDY)[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()


def test_qwen2vl_chunked_prefill_and_media_marker(qwen2vl_folder, qwen2vl_hf) -> None:
    model, processor = qwen2vl_hf
    messages = QWEN_CHATS["two images of other shapes (one of several windows)"]()
    _, inputs = hf_inputs(qwen2vl_hf, messages)
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    small = LLM(str(next(qwen2vl_folder.glob("qwen*-f32.gguf"))), device="cpu", dtype="float32",
                max_num_batched_tokens=5)
    assert small.chat(messages, GREEDY)[0].token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()
    image = picture(9)
    inputs = processor(text="Look: <|vision_start|><|image_pad|><|vision_end|> What is it?", images=[image],
                       return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    got = small.generate({"prompt": "Look: <__media__> What is it?", "multi_modal_data": {"image": image}}, GREEDY)[0]
    assert got.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert got.token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()


@needs_kernels
def test_qwen2vl_fast_path_logits_equal_transformers(qwen2vl_folder, qwen2vl_hf, qwen_name: str) -> None:
    """The CPU fast path (the C kernels read each row's own M-RoPE cos|sin row, `BatchMetadata.rope_table`; the
    one-call stack steps aside): within 1e-3 of transformers' largest logit, greedy tokens equal."""
    model, _ = qwen2vl_hf
    with mock.patch("gpullama.engine.model_spec.quantized_cpu_path", return_value=True):
        fast = LLM(str(qwen2vl_folder / f"{qwen_name}-f32.gguf"), device="cpu")
    assert isinstance(fast.model.ops, CpuOps) and fast.vision is not None
    messages = QWEN_CHATS["two images of other shapes (one of several windows)"]()
    text, inputs = hf_inputs(qwen2vl_hf, messages)
    with torch.no_grad():
        want = model(**inputs).logits[0]
        ref = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    ids = fast.vision.prompt(text, [ImageRef(im) for im in images_of(messages)])
    rel = ((fast.logits(ids) - want).abs().max() / want.abs().max()).item()
    assert rel < 1e-3, f"max error {rel:.3g} of the largest logit"
    assert fast.chat(messages, GREEDY)[0].token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()


def test_qwen2vl_info_shows_the_projector(qwen2vl_folder, qwen_name: str, capsys) -> None:
    from gpullama.cli import main

    assert main(["info", str(qwen2vl_folder / f"{qwen_name}-f32.gguf")]) == 0
    projector = "qwen2.5vl_merger" if qwen_name == "qwen25vl" else "qwen2vl_merger"
    assert (f"text, image (mmproj-{qwen_name}-f32.gguf: {projector} projector, images at their own size in tokens of "
            "16x16 pixels (8 to 4096 tokens an image), M-RoPE positions)") in capsys.readouterr().out


@needs_kernels
@pytest.mark.parametrize("name", ["idefics3", "qwen2vl", "qwen25vl"])
def test_f16_mmproj_towers_near_transformers(default_model_path: Path, name: str) -> None:
    """The converter's F16 mmproj (the type projector files are published in) on the fast path's C kernels: the
    same features as the exact path on that file (1e-4), within 1e-3 of transformers' float32 largest feature."""
    from transformers import (
        AutoProcessor,
        Idefics3ForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLForConditionalGeneration,
    )

    from gpullama.ops.torch_ops import TorchOps
    from gpullama.vision.loading import load_tower

    folder = tiny_vlm_folder(name, smollm2_tokenizer(default_model_path))
    kind = {"idefics3": Idefics3ForConditionalGeneration, "qwen2vl": Qwen2VLForConditionalGeneration,
            "qwen25vl": Qwen2_5_VLForConditionalGeneration}[name]
    model = kind.from_pretrained(folder, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(folder) if name == "idefics3" else qwen2vl_processor(folder)
    image = picture(5, (200, 150))
    inputs = processor.image_processor([image], return_tensors="pt")
    with torch.no_grad():
        ref = model.model.get_image_features(**{k: v for k, v in inputs.items() if k not in ("rows", "cols")}
                                             ).pooler_output
    ref = ref[0] if isinstance(ref, (list, tuple)) else ref
    path = folder / "f16" / f"mmproj-{name}-f16.gguf"
    fast = load_tower(path, CpuOps(torch.device("cpu"))).encode_images([image])[0][0].reshape(ref.shape)
    exact = load_tower(path, TorchOps(torch.device("cpu"))).encode_images([image])[0][0].reshape(ref.shape)
    torch.testing.assert_close(fast, exact, atol=1e-4, rtol=1e-4)
    assert ((exact - ref).abs().max() / ref.abs().max()).item() < 1e-3

"""Qwen3-VL's images (qwen3vl_merger, issue 34) and its text model (qwen3vl: interleaved M-RoPE, deepstack), through
the library: a tiny random `Qwen3VLForConditionalGeneration` (`tests/fixtures/tiny_vlm.build_qwen3vl`, deepstack
mergers on two tower blocks) converted by llama.cpp's own converter. The references are transformers in float32 with
the model's processor: the patches, the image features (the merger's and the deepstack mergers'), the prompt ids, the
logits and the greedy tokens, on the exact path and the CPU fast path."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

from gpullama import LLM
from gpullama.ops import CpuOps
from gpullama.vision import ImageSpan
from gpullama.vision.images import ImageRef
from gpullama.vision.prompt import PromptIds
from tests.fixtures.tiny_vlm import QWEN3VL_DEEPSTACK, load_vlm, qwen2vl_processor, tiny_vlm_folder, vlm_factory
from tests.test_converted_models import smollm2_tokenizer
from tests.test_vision import needs_kernels, picture
from tests.test_vision_projectors import (
    GREEDY,
    QWEN_CHATS,
    assert_two_images_answer_apart,
    hf_inputs,
    images_of,
)

CHATS3 = {**QWEN_CHATS, "text only": lambda: [{"role": "user", "content": "Say something about pictures."}]}


@pytest.fixture(scope="module")
def folder(default_model_path: Path) -> Path:
    return tiny_vlm_folder("qwen3vl", smollm2_tokenizer(default_model_path))


@pytest.fixture(scope="module")
def hf(folder):
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return model, qwen2vl_processor(folder, "Qwen3VLProcessor")


@pytest.fixture(scope="module")
def qwen3vl_llm(folder):
    """Factory: the model with its mmproj (found beside it) on the exact path, or on the fast path."""
    return vlm_factory(folder / "qwen3vl-f32.gguf")


def hf_features(model, inputs) -> torch.Tensor:
    """transformers' image features of one image as llama.cpp's mmproj writes them: the merger's, then each
    deepstack merger's, side by side."""
    with torch.no_grad():
        out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    return torch.cat([out.pooler_output[0], *[feature[0] for feature in out.deepstack_features]], dim=-1)


def test_interleaved_axes_are_transformers_recomposition() -> None:
    """`mrope_axes` of Qwen3-VL's real sections (24, 20, 20 of 64 frequencies) and the tiny model's pick each
    frequency's axis as transformers' `Qwen3VLTextRotaryEmbedding.recomposition_frequencies` does."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    from gpullama.ops.rope import mrope_axes

    for sections in ([24, 20, 20], [3, 3, 2]):
        n = sum(sections)
        freqs = torch.arange(3.0).view(3, 1, 1, 1).expand(3, 1, 1, n).clone()  # each axis' frequencies hold its index
        rotary = mock.Mock(mrope_section=sections)
        want = Qwen3VLTextRotaryEmbedding.recomposition_frequencies(rotary, freqs)[0, 0, :n].long()
        assert mrope_axes(tuple(sections), interleaved=True).tolist() == want.tolist()
    assert mrope_axes((2, 3, 3)).tolist() == [0, 0, 1, 1, 1, 2, 2, 2]  # Qwen2-VL's runs


def test_patches_and_features_equal_transformers(qwen3vl_llm, hf) -> None:
    """Patches, learned position embeddings resampled to each grid, the blocks, the merger and the deepstack
    mergers: within 2e-5 of transformers' features for grids of other shapes than the position table's."""
    model, processor = hf
    tower = qwen3vl_llm().vision.tower
    assert sorted(tower.deepstack) == list(QWEN3VL_DEEPSTACK)
    for image in (picture(5), picture(6, (31, 77)), picture(8, (200, 150))):
        inputs = processor.image_processor([image], return_tensors="pt")
        patches, gh, gw = tower.pixels(image)
        assert [1, gh, gw] == inputs["image_grid_thw"][0].tolist()
        torch.testing.assert_close(patches, inputs["pixel_values"], atol=1e-6, rtol=0)
        torch.testing.assert_close(tower.encode_patches(patches, gh, gw), hf_features(model, inputs), atol=2e-5,
                                   rtol=1e-4)


@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=needs_kernels)], ids=["exact", "fast"])
@pytest.mark.parametrize("chat", list(CHATS3))
def test_logits_and_greedy_tokens_equal_transformers(qwen3vl_llm, hf, chat: str, fast: bool) -> None:
    """Prompt ids, logits within 1e-4 (exact) / 1e-3 (fast) of transformers' largest logit, greedy tokens equal:
    interleaved M-RoPE positions and the deepstack features added after the first text layers."""
    model, _ = hf
    messages = CHATS3[chat]()
    text, inputs = hf_inputs(hf, messages)
    with torch.no_grad():
        want = model(**inputs).logits[0]
        ref = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    llm = qwen3vl_llm(fast)
    ids = llm.vision.prompt(text, [ImageRef(im) for im in images_of(messages)])
    assert list(ids) == inputs["input_ids"][0].tolist()
    rel = ((llm.logits(ids) - want).abs().max() / want.abs().max()).item()
    assert rel < (1e-3 if fast else 1e-4), f"max error {rel:.3g} of the largest logit"
    out = llm.chat(messages, GREEDY)[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()
    if ids.images and not fast:  # both matter: without the deepstack features, or with M-RoPE in runs, another answer
        width = llm.model.config.hidden_size
        flat = PromptIds(list(ids), [ImageSpan(s.start, torch.cat([s.embeds[:, :width], 0 * s.embeds[:, width:]], 1),
                                               s.key, True, s.rope) for s in ids.images])
        assert ((llm.logits(flat) - want).abs().max() / want.abs().max()).item() > 1e-2
        with mock.patch.object(llm.model.config, "mrope_interleaved", False):
            assert ((llm.logits(ids) - want).abs().max() / want.abs().max()).item() > 1e-3


@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=needs_kernels)], ids=["exact", "fast"])
def test_moe_logits_and_greedy_tokens_equal_transformers(default_model_path: Path, fast: bool) -> None:
    """Qwen3-VL-MoE (`qwen3vlmoe`: qwen3moe's routed experts under the same text model and tower): two images in one
    message and an image in a later turn, logits and greedy tokens as transformers'."""
    from transformers import Qwen3VLMoeForConditionalGeneration

    moe = tiny_vlm_folder("qwen3vlmoe", smollm2_tokenizer(default_model_path))
    reference = (Qwen3VLMoeForConditionalGeneration.from_pretrained(moe, dtype=torch.float32).eval(),
                 qwen2vl_processor(moe, "Qwen3VLProcessor"))
    llm = load_vlm(moe / "qwen3vlmoe-f32.gguf", fast)
    assert llm.model.config.num_experts == 8
    for chat in ("two images of other shapes (one of several windows)", "an image in a later turn"):
        messages = QWEN_CHATS[chat]()
        text, inputs = hf_inputs(reference, messages)
        with torch.no_grad():
            want = reference[0](**inputs).logits[0]
            ref = reference[0].generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
        ids = llm.vision.prompt(text, [ImageRef(im) for im in images_of(messages)])
        rel = ((llm.logits(ids) - want).abs().max() / want.abs().max()).item()
        assert rel < (1e-3 if fast else 1e-4), f"max error {rel:.3g} of the largest logit"
        assert llm.chat(messages, GREEDY)[0].token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()


def test_two_images_give_different_answers(qwen3vl_llm, hf) -> None:
    assert_two_images_answer_apart(qwen3vl_llm(), hf)


def test_chunked_prefill_and_the_prefix_cache_keyed_by_the_image(folder, hf) -> None:
    """Chunks of 5 tokens cut the images and their deepstack rows; a second request with the same image reuses its
    KV blocks and answers the same, one with another image of the same size reuses none."""
    model, _ = hf
    messages = QWEN_CHATS["two images of other shapes (one of several windows)"]()
    _, inputs = hf_inputs(hf, messages)
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    small = LLM(str(folder / "qwen3vl-f32.gguf"), device="cpu", dtype="float32", max_num_batched_tokens=5)
    assert small.chat(messages, GREEDY)[0].token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()
    question = "Tell me everything about this picture, in detail."
    first, again, other = (small.chat([{"role": "user", "content": [{"type": "image", "image": picture(n, (64, 64))},
                                                                    {"type": "text", "text": question}]}], GREEDY)[0]
                           for n in (15, 15, 16))
    assert again.num_cached_tokens >= 16 and again.token_ids == first.token_ids
    assert other.num_cached_tokens == 0 and other.token_ids != first.token_ids


def test_a_projector_of_another_deepstack_is_refused(folder) -> None:
    """The model splits each image embedding by its n_deepstack_layers: an mmproj with another count is not its."""
    from gpullama import config

    def one_layer(cfg, get, opt, path):
        config._qwen3vl(cfg, get, opt, path)
        cfg.deepstack_layers = 1

    with mock.patch.dict(config._FAMILIES, {"qwen3vl": one_layer}), \
            pytest.raises(ValueError, match="--mmproj: .*writes 2 deepstack features an image token, the model takes 1"):
        LLM(str(folder / "qwen3vl-f32.gguf"), device="cpu", dtype="float32",
            mmproj=str(folder / "mmproj-qwen3vl-f32.gguf"))


def test_info_shows_the_projector(folder, capsys) -> None:
    from gpullama.cli import main

    assert main(["info", str(folder / "qwen3vl-f32.gguf")]) == 0
    assert ("text, image (mmproj-qwen3vl-f32.gguf: qwen3vl_merger projector, images at their own size in tokens of "
            "16x16 pixels (8 to 4096 tokens an image), M-RoPE positions, deepstack features of 2 tower layers)"
            ) in capsys.readouterr().out


@needs_kernels
def test_f16_mmproj_on_the_c_kernels_near_transformers(folder, hf) -> None:
    """The converter's F16 mmproj on the fast path's C kernels: the exact path's features on that file (1e-4),
    within 1e-3 of transformers' float32 largest feature."""
    from gpullama.ops.torch_ops import TorchOps
    from gpullama.vision.loading import load_tower

    model, processor = hf
    image = picture(5, (200, 150))
    ref = hf_features(model, processor.image_processor([image], return_tensors="pt"))
    path = folder / "f16" / "mmproj-qwen3vl-f16.gguf"
    fast = load_tower(path, CpuOps(torch.device("cpu"))).encode_images([image])[0][0][0]
    exact = load_tower(path, TorchOps(torch.device("cpu"))).encode_images([image])[0][0][0]
    torch.testing.assert_close(fast, exact, atol=1e-4, rtol=1e-4)
    assert ((exact - ref).abs().max() / ref.abs().max()).item() < 1e-3

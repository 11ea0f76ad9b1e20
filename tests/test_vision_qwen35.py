"""Qwen3.5's images (issue 34): its mmproj is Qwen3-VL's tower without deepstack (qwen3vl_merger), its text model the
hybrid qwen35 (gated delta-nets beside gated attention with partial interleaved M-RoPE). A tiny random
`Qwen3_5ForConditionalGeneration` (`tests/fixtures/tiny_vlm.build_qwen35`, Qwen3.5's own chat template) converted by
llama.cpp's own converter (``--no-mtp``, ``--mmproj``). The references are transformers in float32 with the model's
processor: the image features, the prompt ids, the logits and the greedy tokens, on the exact path and the CPU fast
path; the prefix cache's recurrent-state checkpoints keyed by the image."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

from gpullama import LLM
from gpullama.vision import ImageSpan
from gpullama.vision.images import ImageRef
from gpullama.vision.prompt import PromptIds
from tests.fixtures.tiny_vlm import load_vlm, qwen2vl_processor, tiny_vlm_folder, vlm_factory
from tests.test_converted_models import smollm2_tokenizer
from tests.test_vision import needs_kernels, picture
from tests.test_vision_projectors import (
    GREEDY,
    QWEN_CHATS,
    assert_two_images_answer_apart,
    hf_inputs,
    images_of,
)


@pytest.fixture(scope="module")
def folder(default_model_path: Path) -> Path:
    return tiny_vlm_folder("qwen35", smollm2_tokenizer(default_model_path))


@pytest.fixture(scope="module")
def hf(folder):
    """transformers' model and processor, its tokenizer as saved (as the converter read it: transformers would
    otherwise force Qwen3.5's own tokenizer class on SmolLM2's vocabulary)."""
    from transformers import Qwen3_5ForConditionalGeneration
    from transformers.models.auto import tokenization_auto

    model = Qwen3_5ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    with mock.patch.dict(tokenization_auto.TOKENIZER_MAPPING_NAMES, {"qwen3_5": "TokenizersBackend"}):
        return model, qwen2vl_processor(folder, "Qwen3VLProcessor")


@pytest.fixture(scope="module")
def qwen35_llm(folder):
    """Factory: the model with its mmproj (found beside it) on the exact path, or on the fast path (delta-nets in
    layers 0-2, gated attention in layer 3)."""
    load = vlm_factory(folder / "qwen35-f32.gguf")

    def get(fast: bool = False) -> LLM:
        llm = load(fast)
        assert llm.model.config.delta_layers == (True, True, True, False)
        return llm

    return get


def test_features_equal_transformers(qwen35_llm, hf) -> None:
    """The tower (Qwen3-VL's, no deepstack mergers): patches and features within 2e-5 of transformers'."""
    model, processor = hf
    tower = qwen35_llm().vision.tower
    assert not tower.deepstack
    for image in (picture(5), picture(6, (31, 77))):
        inputs = processor.image_processor([image], return_tensors="pt")
        patches, gh, gw = tower.pixels(image)
        torch.testing.assert_close(patches, inputs["pixel_values"], atol=1e-6, rtol=0)
        with torch.no_grad():
            want = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output[0]
        torch.testing.assert_close(tower.encode_patches(patches, gh, gw), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=needs_kernels)], ids=["exact", "fast"])
@pytest.mark.parametrize("chat", list(QWEN_CHATS))
def test_logits_and_greedy_tokens_equal_transformers(qwen35_llm, hf, chat: str, fast: bool) -> None:
    """Prompt ids through Qwen3.5's template and processor, logits within 1e-4 (exact) / 1e-3 (fast) of
    transformers' largest logit, greedy tokens equal: the image rows through the delta-nets like any other, the
    attention layer's interleaved M-RoPE positions (in runs, or without them, another answer)."""
    model, _ = hf
    messages = QWEN_CHATS[chat]()
    text, inputs = hf_inputs(hf, messages)
    with torch.no_grad():
        want = model(**inputs).logits[0]
        ref = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    llm = qwen35_llm(fast)
    ids = llm.vision.prompt(text, [ImageRef(im) for im in images_of(messages)])
    assert list(ids) == inputs["input_ids"][0].tolist()
    rel = ((llm.logits(ids) - want).abs().max() / want.abs().max()).item()
    assert rel < (1e-3 if fast else 1e-4), f"max error {rel:.3g} of the largest logit"
    out = llm.chat(messages, GREEDY)[0]
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()
    if not fast:
        flat = PromptIds(list(ids), [ImageSpan(s.start, s.embeds, s.key, True) for s in ids.images])  # no M-RoPE
        assert ((llm.logits(flat) - want).abs().max() / want.abs().max()).item() > 1e-3
        with mock.patch.object(llm.model.config, "mrope_interleaved", False):
            assert ((llm.logits(ids) - want).abs().max() / want.abs().max()).item() > 1e-4


def test_two_images_give_different_answers(qwen35_llm, hf) -> None:
    assert_two_images_answer_apart(qwen35_llm(), hf)


def test_chunked_prefill_and_the_state_checkpoints_keyed_by_the_image(folder, hf) -> None:
    """Chunks of 5 tokens cut the images (causal: the attention allows it; the delta-nets carry their state across
    chunks) and give transformers' tokens; a second request with the same image resumes from the recurrent-state
    checkpoint at its prompt's last block boundary and answers the same, one with another image of the same size
    (in the first block) reuses nothing."""
    model, _ = hf
    messages = QWEN_CHATS["two images of other shapes (one of several windows)"]()
    _, inputs = hf_inputs(hf, messages)
    with torch.no_grad():
        ref = model.generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
    small = LLM(str(folder / "qwen35-f32.gguf"), device="cpu", dtype="float32", max_num_batched_tokens=5)
    assert small.chat(messages, GREEDY)[0].token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()
    question = "Tell me everything about this picture, in detail."
    first, again, other = (small.chat([{"role": "user", "content": [{"type": "image", "image": picture(n, (64, 64))},
                                                                    {"type": "text", "text": question}]}], GREEDY)[0]
                           for n in (15, 15, 16))
    assert again.num_cached_tokens >= 16 and again.token_ids == first.token_ids
    assert other.num_cached_tokens == 0 and other.token_ids != first.token_ids
    assert 0 < len(small.engine.state_checkpoints)


@pytest.mark.parametrize("fast", [False, pytest.param(True, marks=needs_kernels)], ids=["exact", "fast"])
def test_moe_logits_and_greedy_tokens_equal_transformers(default_model_path: Path, fast: bool) -> None:
    """Qwen3.5-MoE (`qwen35moe`: routed experts and a gated shared expert under the same layers and tower): two
    images in one message and an image in a later turn, logits and greedy tokens as transformers'."""
    from transformers import Qwen3_5MoeForConditionalGeneration
    from transformers.models.auto import tokenization_auto

    moe = tiny_vlm_folder("qwen35moe", smollm2_tokenizer(default_model_path))
    with mock.patch.dict(tokenization_auto.TOKENIZER_MAPPING_NAMES, {"qwen3_5_moe": "TokenizersBackend"}):
        reference = (Qwen3_5MoeForConditionalGeneration.from_pretrained(moe, dtype=torch.float32).eval(),
                     qwen2vl_processor(moe, "Qwen3VLProcessor"))
    llm = load_vlm(moe / "qwen35moe-f32.gguf", fast)
    assert llm.model.config.num_experts == 8
    for chat in ("two images of other shapes (one of several windows)", "an image in a later turn"):
        messages = QWEN_CHATS[chat]()
        text, inputs = hf_inputs(reference, messages)
        with torch.no_grad():
            want = reference[0](**inputs).logits[0]
            ref = reference[0].generate(**inputs, max_new_tokens=GREEDY.max_tokens, do_sample=False)
        ids = llm.vision.prompt(text, [ImageRef(im) for im in images_of(messages)])
        assert list(ids) == inputs["input_ids"][0].tolist()
        rel = ((llm.logits(ids) - want).abs().max() / want.abs().max()).item()
        assert rel < (1e-3 if fast else 1e-4), f"max error {rel:.3g} of the largest logit"
        assert llm.chat(messages, GREEDY)[0].token_ids == ref[0, inputs["input_ids"].shape[1]:].tolist()

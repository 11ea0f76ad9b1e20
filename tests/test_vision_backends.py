"""Every vision tower through the Triton kernels (issue 34): the tiny test models' mmproj files, as llama.cpp's own
converter writes them (`tests/fixtures/gemma3_vision`, `tests/fixtures/gemma4_vision`, `tests/fixtures/tiny_vlm`), encoded with TritonOps (the
matmul, LayerNorm, GELU, RMSNorm, SwiGLU and rotary kernels; under the Triton interpreter on CPU tensors unless
GPULLAMA_TEST_DEVICE=cuda) against the float32 torch path (TorchOps) on the same file, which tests/test_vision*.py
hold to transformers' float32 features."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from gpullama.ops import TorchOps
from gpullama.ops.triton_ops import TritonOps
from gpullama.vision.gemma4_tower import Gemma4VisionTower
from gpullama.vision.loading import load_tower
from gpullama.vision.qwen3_tower import Qwen3VLTower
from gpullama.vision.qwen_tower import QwenVLTower
from gpullama.vision.tower import VisionTower
from tests.fixtures.gemma3_vision import gemma3_vision_folder
from tests.fixtures.gemma4_vision import gemma4_vision_folder
from tests.fixtures.tiny_vlm import tiny_vlm_folder
from tests.test_converted_models import smollm2_tokenizer

CPU = torch.device("cpu")

TOWERS = {  # name -> (the mmproj under its folder, the tower class)
    "gemma3": ("mmproj-gemma3-f32.gguf", VisionTower),
    "gemma3-q8_0": ("q8_0/mmproj-gemma3-q8_0.gguf", VisionTower),
    "idefics3": ("mmproj-idefics3-f32.gguf", VisionTower),
    "qwen2vl-f16": ("f16/mmproj-qwen2vl-f16.gguf", QwenVLTower),
    "qwen25vl": ("mmproj-qwen25vl-f32.gguf", QwenVLTower),
    "qwen3vl": ("mmproj-qwen3vl-f32.gguf", Qwen3VLTower),
}


@pytest.fixture(scope="module")
def device() -> torch.device:
    """CPU tensors through the interpreter, or CUDA when GPULLAMA_TEST_DEVICE=cuda."""
    name = os.environ.get("GPULLAMA_TEST_DEVICE", "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("GPULLAMA_TEST_DEVICE=cuda but no CUDA device")
    return torch.device(name)


def mmproj(default_model_path: Path, name: str) -> Path:
    """The converted mmproj file of tower `name` (its tiny model built into the test cache on first use)."""
    tokenizer = smollm2_tokenizer(default_model_path)
    model = name.split("-")[0]
    folder = gemma3_vision_folder(tokenizer) if model == "gemma3" else tiny_vlm_folder(model, tokenizer)
    return folder / TOWERS[name][0]


def picture(seed: int, size: tuple[int, int] = (56, 40)) -> Image.Image:
    """A random RGB picture (width, height): one tile (Gemma 3), 2x2 tiles and the whole (Idefics3), 6x6 patches
    (the Qwen-VLs' 48x48 pixels after their resize)."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def encoded(path: Path, ops, kind: type) -> torch.Tensor:
    """The embeddings of one picture (every tile) through the tower of `path` on `ops`, on the CPU."""
    tower = load_tower(path, ops)
    assert type(tower) is kind
    return torch.cat([e.reshape(-1, e.shape[-1]) for e, _, _ in tower.encode_images([picture(5)])]).cpu()


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute error over the largest reference magnitude."""
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("name", list(TOWERS))
def test_towers_on_triton_equal_the_torch_path(default_model_path: Path, name: str, device: torch.device) -> None:
    """float32: each tower (SigLIP with Gemma 3's and Idefics3's heads, F32 and Q8_0 blocks; Qwen2-VL's QuickGELU on
    F16 blocks, Qwen2.5-VL's RMSNorm, SwiGLU and windows, Qwen3-VL's deepstack) through TritonOps within 1e-5 of the
    torch path's largest feature."""
    path = mmproj(default_model_path, name)
    want = encoded(path, TorchOps(CPU), TOWERS[name][1])
    got = encoded(path, TritonOps(device), TOWERS[name][1])
    assert got.shape == want.shape and rel_err(got, want) < 1e-5


@pytest.mark.parametrize("name", ["gemma3", "qwen3vl"])
def test_bf16_towers_on_triton_stay_near_float32(default_model_path: Path, name: str, device: torch.device) -> None:
    """bfloat16 compute (the GPU's default: matmul inputs and the attention in bf16, norms and the residual stream
    float32) within 1e-2 of the float32 torch path's largest feature (measured 2e-3 to 4e-3 on the CPU, as TorchOps
    in bf16)."""
    path = mmproj(default_model_path, name)
    want = encoded(path, TorchOps(CPU), TOWERS[name][1])
    got = encoded(path, TritonOps(device, torch.bfloat16), TOWERS[name][1])
    assert rel_err(got, want) < 1e-2


def test_gemma4_tower_on_triton_equals_the_torch_path(device: torch.device) -> None:
    """Gemma 4's tower (RMSNorms, per-head q/k norms, its 2-D rotary in halves, GeGLU) through TritonOps within 1e-5
    of the torch path's largest feature, on 36x24 pixels (6x9 patches: a whole image's 2,500 patches take minutes
    under the interpreter; `encode` takes any whole number of pooled blocks)."""
    from gpullama.vision.images import normalise

    path = gemma4_vision_folder() / "mmproj-gemma4-f32.gguf"
    want_tower, got_tower = Gemma4VisionTower(path, TorchOps(CPU)), Gemma4VisionTower(path, TritonOps(device))
    pixels = normalise(picture(5, (36, 24)), want_tower.config.mean, want_tower.config.std)
    want, got = want_tower.encode(pixels), got_tower.encode(pixels).cpu()
    assert got.shape == want.shape == (6, 64) and rel_err(got, want) < 1e-5

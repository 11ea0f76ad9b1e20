"""The continuous-batching engine: scheduler, paged KV blocks, step loop and its async front."""

from gpullama.engine.async_engine import AsyncEngine, EngineError
from gpullama.engine.llm_engine import EngineConfig, LLMEngine

__all__ = ["AsyncEngine", "EngineConfig", "EngineError", "LLMEngine"]

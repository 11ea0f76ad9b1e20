"""Structured output: specs, a grammar-backend interface (llguidance behind it), token bitmasks, tool-call grammars.

The names load on first use: importing the package (or `gpullama.structured.spec`, which `SamplingParams` reads)
imports neither torch nor llguidance. llguidance loads when the first backend is built.
"""

from __future__ import annotations

import importlib
import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpullama.structured.backend import CompiledGrammar, GrammarBackend, GrammarMatcher, compile_pool
    from gpullama.structured.bitmask import (
        allocate_bitmask,
        allow_only,
        apply_bitmask,
        bitmask_to_bool,
        bitmask_width,
    )
    from gpullama.structured.reasoning_gate import ReasoningGatedMatcher, reasoning_token_ids
    from gpullama.structured.spec import StructuredOutput, StructuredOutputError, ToolCallGrammar, check_json_schema
    from gpullama.structured.tools import TOOL_CALL_FORMATS, ToolCallFormat, tool_call_grammar
    from gpullama.tokenizer import Tokenizer

BACKENDS = ("llguidance",)

_EXPORTS = {
    "CompiledGrammar": "backend", "GrammarBackend": "backend", "GrammarMatcher": "backend", "compile_pool": "backend",
    "allocate_bitmask": "bitmask", "allow_only": "bitmask", "apply_bitmask": "bitmask", "bitmask_to_bool": "bitmask",
    "bitmask_width": "bitmask",
    "ReasoningGatedMatcher": "reasoning_gate", "reasoning_token_ids": "reasoning_gate",
    "StructuredOutput": "spec", "StructuredOutputError": "spec", "ToolCallGrammar": "spec",
    "check_json_schema": "spec",
    "TOOL_CALL_FORMATS": "tools", "ToolCallFormat": "tools", "tool_call_grammar": "tools",
}

_backends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def get_backend(tokenizer: Tokenizer, vocab_size: int | None = None, name: str = "llguidance") -> GrammarBackend:
    """The grammar backend for `tokenizer` with logits `vocab_size` wide (default the tokenizer's size), built
    once per (tokenizer, size, name) and shared; thread-safe. The first call imports the engine (seconds)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; available: {BACKENDS}")
    size = int(vocab_size or tokenizer.vocab_size)
    with _lock:
        per_tokenizer = _backends.setdefault(tokenizer, {})
        backend = per_tokenizer.get((name, size))
        if backend is None:
            from gpullama.structured.llguidance_backend import LLGuidanceBackend

            backend = per_tokenizer[(name, size)] = LLGuidanceBackend(tokenizer, size)
        return backend


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpullama.structured' has no attribute {name!r}")
    return getattr(importlib.import_module(f"gpullama.structured.{_EXPORTS[name]}"), name)


__all__ = [
    "BACKENDS", "TOOL_CALL_FORMATS", "CompiledGrammar", "GrammarBackend", "GrammarMatcher", "ReasoningGatedMatcher",
    "StructuredOutput", "StructuredOutputError", "ToolCallFormat", "ToolCallGrammar", "allocate_bitmask",
    "allow_only", "apply_bitmask", "bitmask_to_bool", "bitmask_width", "check_json_schema", "compile_pool",
    "get_backend", "reasoning_token_ids", "tool_call_grammar",
]

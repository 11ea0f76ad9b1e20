"""The HTTP server (``gpullama-serve``): OpenAI's, Anthropic's and Ollama's APIs over the engine, one module per API
family (docs/architecture.md, "Server"). The names load on first use, so that ``gpullama-serve`` can check its
flags and model before it imports the routes."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import create_app
    from .state import ServerConfig, ServerState

_EXPORTS = {"create_app": "app", "ServerConfig": "state", "ServerState": "state"}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'gpullama.server' has no attribute {name!r}")
    return getattr(importlib.import_module(f"gpullama.server.{_EXPORTS[name]}"), name)


__all__ = ["ServerConfig", "ServerState", "create_app"]

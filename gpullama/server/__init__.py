"""OpenAI-compatible HTTP server (``gpullama-serve``): Starlette routes that translate JSON/SSE to the engine."""

from .app import create_app
from .state import ServerConfig, ServerState

__all__ = ["ServerConfig", "ServerState", "create_app"]

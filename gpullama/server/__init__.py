"""The HTTP server (``gpullama-serve``): OpenAI's, Anthropic's and Ollama's APIs over the engine, one module per API
family (docs/architecture.md, "Server")."""

from .app import create_app
from .state import ServerConfig, ServerState

__all__ = ["ServerConfig", "ServerState", "create_app"]

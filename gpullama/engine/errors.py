"""The engine's runtime errors (importing them needs no torch: the server's command line reads this module)."""

from __future__ import annotations


class EngineError(RuntimeError):
    """Generation failed inside the engine for this request."""


class EngineStopped(EngineError):
    """The engine has stopped (shut down): the request was ended, or cannot start."""

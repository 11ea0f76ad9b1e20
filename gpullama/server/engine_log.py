"""The periodic engine status line in the server log (running and waiting requests, KV use, tokens/s), as vLLM's."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gpullama.engine.stats import EngineStatus

log = logging.getLogger("gpullama.server")

DEFAULT_INTERVAL_S = 5.0


async def log_engine_status(engine: Any, interval: float) -> None:
    """Every `interval` seconds, log the `LLMEngine`'s status line while it had work in that interval (so once more
    after it goes idle, then nothing until the next request)."""
    before = EngineStatus.read(engine)
    while True:
        await asyncio.sleep(interval)
        now = EngineStatus.read(engine)
        moved = (now.prompt_tokens, now.generation_tokens) != (before.prompt_tokens, before.generation_tokens)
        if now.busy or moved:
            log.info("%s", now.line(before))
        before = now

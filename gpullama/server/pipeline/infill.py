"""The fill-in-the-middle prompt of a request, shared by llama.cpp's ``/infill``, the ``suffix`` of
``/v1/completions`` and Ollama's ``suffix``: the layout of `gpullama.fim`, or a 400 naming the field when the model
has no FIM tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpullama.fim import ExtraChunk, infill_prompt

from ..http.fields import bad


def fim_prompt_ids(tokenizer: Any, n_ctx: int, prefix: str, suffix: str, extra: Sequence[ExtraChunk] = (),
                   prompt: str = "", param: str = "suffix") -> list[int]:
    """The token ids of an infill prompt (llama.cpp's layout); 400 naming `param` when the vocabulary lacks the
    FIM prefix, suffix or middle token."""
    missing = tokenizer.fim.missing
    if missing:
        raise bad(param, f"infill is not supported by this model: its vocabulary has no FIM {', '.join(missing)} "
                  "token (tokenizer.ggml.fim_*_token_id, or a token such as <|fim_prefix|>)")
    return infill_prompt(tokenizer, tokenizer.fim, prefix, suffix, extra, prompt, n_ctx=n_ctx)

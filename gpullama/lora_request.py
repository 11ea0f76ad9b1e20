"""`LoRARequest`: which LoRA adapter a request runs with (the shape of vLLM's), without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter by name, for `LLM.generate`/`chat`/`stream`/`logits` (``lora=``): `name` of an adapter the LLM
    loaded (``LLM(model, lora=...)``, `LLM.load_lora`), or, with `path`, a GGUF adapter that is loaded under `name`
    on first use (as vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``); `scale` multiplies its product
    (llama.cpp's ``--lora-scaled``; 1.0 as trained)."""

    name: str
    path: str | None = None
    scale: float = 1.0

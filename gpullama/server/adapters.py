"""The server's LoRA adapters: the flags (llama.cpp's ``--lora FILE``, ``--lora-scaled FILE SCALE`` and
``--lora-init-without-apply``; vLLM-style named ``--lora name=path[:scale]``), the table of loaded adapters (ids as
the engine gave them), and the request defaults they make: llama.cpp's adapters apply to every request at their
global scale unless the request's ``lora`` field says otherwise; a named adapter applies when the request's
``model`` is its name (vLLM's ``--lora-modules``), at its scale. The routes: llama.cpp's ``GET``/``POST
/lora-adapters`` (`gpullama.server.llamacpp.lora`) and vLLM's ``/v1/load_lora_adapter``/``/v1/unload_lora_adapter``
behind ``--enable-lora-runtime-updating`` (`gpullama.server.vllm.lora`)."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("gpullama")


@dataclass(frozen=True)
class LoraSpec:
    """One adapter of the command line: its file, its name (None: llama.cpp's unnamed adapter, named by its
    stem and applied to every request), its scale."""

    path: str
    name: str | None = None
    scale: float = 1.0


def _scale(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{flag}: scale {text!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{flag}: scale {text!r} is not a finite number")
    return value


def parse_lora(value: str) -> list[LoraSpec]:
    """``--lora``: ``name=path[:scale]`` (a named adapter), else a file or comma-separated files (llama.cpp's)."""
    if "=" in value:
        name, _, rest = value.partition("=")
        path, scale = rest, 1.0
        head, colon, tail = rest.rpartition(":")
        if colon and head:
            try:
                scale = float(tail)
                path = head
            except ValueError:
                pass
        if not name or not path:
            raise ValueError(f"--lora {value!r}: expected FILE or NAME=PATH[:SCALE]")
        return [LoraSpec(path, name, scale)]
    return [LoraSpec(p) for p in value.split(",") if p]


def parse_lora_scaled(values: list[str]) -> list[LoraSpec]:
    """``--lora-scaled FILE SCALE`` (two arguments), or llama.cpp's newer ``FILE:SCALE[,FILE:SCALE...]``."""
    if len(values) == 2 and ":" not in values[1]:
        return [LoraSpec(values[0], None, _scale(values[1], "--lora-scaled"))]
    specs = []
    for value in values:
        for item in value.split(","):
            path, colon, scale = item.rpartition(":")
            if not colon or not path:
                raise ValueError(f"--lora-scaled {item!r}: expected FILE SCALE or FILE:SCALE")
            specs.append(LoraSpec(path, None, _scale(scale, "--lora-scaled")))
    return specs


@dataclass
class ServedAdapter:
    """A loaded adapter as the server lists it: the engine's id, its name (a request's `model` may name it), file,
    llama.cpp's global `scale` (every request without a `lora` field gets it; 0: off; a named adapter starts at 0)
    and the scale a request that names it as its model gets."""

    id: int
    name: str
    path: str
    scale: float
    model_scale: float = 1.0


def load_adapters(llm: Any, specs: list[LoraSpec], init_without_apply: bool = False) -> list[ServedAdapter]:
    """Load the command line's adapters into `llm` (blocking; the load thread runs it): unnamed ones under their
    file's stem (made unique), at scale 0 with `init_without_apply`."""
    served = []
    for spec in specs:
        if not os.path.isfile(spec.path):
            raise FileNotFoundError(f"LoRA adapter {spec.path!r} does not exist")
        name = spec.name
        if name is None:
            stem = os.path.splitext(os.path.basename(spec.path))[0]
            name, n = stem, 1
            while name in llm.loras:
                n += 1
                name = f"{stem}-{n}"
        elif name in llm.loras:
            raise ValueError(f"--lora: the name {name!r} is given twice")
        adapter_id = llm.load_lora(spec.path, name)
        scale = 0.0 if spec.name is not None or init_without_apply else spec.scale
        served.append(ServedAdapter(adapter_id, name, spec.path, scale, spec.scale))
    return served


def restore_adapters(llm: Any, loaded: list[ServedAdapter], before: list[ServedAdapter]) -> list[ServedAdapter]:
    """A model loaded again after an unload (blocking; the load thread runs it): the adapters it served before,
    as they were (loaded or unloaded at run time, their scales set by POST /lora-adapters), under the new engine's
    ids; `loaded` are the command line's, which `load_engine` has just loaded. An adapter whose file is gone is
    left out, with a warning."""
    fresh = {a.name: a for a in loaded}
    served = []
    for old in before:
        if old.name in fresh:
            new = fresh.pop(old.name)
            served.append(ServedAdapter(new.id, old.name, new.path, old.scale, old.model_scale))
            continue
        try:
            served.append(ServedAdapter(llm.load_lora(old.path, old.name), old.name, old.path, old.scale,
                                        old.model_scale))
        except (OSError, ValueError) as exc:
            log.warning("LoRA adapter %s (%s) could not be loaded again: %s", old.name, old.path, exc)
    for name in fresh:  # unloaded at run time before: it stays unloaded
        llm.unload_lora(name)
    return served


def lora_defaults(defaults: Any, adapters: list[ServedAdapter]) -> Any:
    """`defaults` (a `RequestDefaults`) with the adapters' request defaults: every adapter at its global scale
    (None when all are 0: the base model), and each adapter's pair by its name."""
    applied = tuple((a.id, a.scale) for a in adapters if a.scale != 0)
    named = tuple((a.name, ((a.id, a.model_scale),)) for a in adapters)
    return dataclasses.replace(defaults, lora=applied or None, lora_models=named)

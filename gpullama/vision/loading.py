"""Which mmproj file a model gets (``--mmproj``, or the one ``mmproj*.gguf`` beside it) and loading it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("gpullama")

ARCHITECTURES = {"gemma3": ("gemma3",), "gemma4": ("gemma4v",), "llama": ("idefics3",),
                 "qwen2vl": ("qwen2vl_merger", "qwen2.5vl_merger"), "qwen3vl": ("qwen3vl_merger",),
                 "qwen3vlmoe": ("qwen3vl_merger",), "qwen35": ("qwen3vl_merger",), "qwen35moe": ("qwen3vl_merger",)}
"""Text architecture -> the projector types it takes (SmolVLM's and Idefics3's text models are llama's; Qwen3.5's
mmproj is Qwen3-VL's tower without deepstack)."""
EXPECTS_MMPROJ = ("gemma3", "gemma4")
"""Architectures whose models mostly come with an mmproj (`gpullama info` says when none lies beside one)."""


def find_mmproj(model_path: str) -> str | None:
    """The ``mmproj*.gguf`` file beside `model_path` when its folder holds exactly one (None otherwise; several
    are logged and none is taken: name one with --mmproj)."""
    folder = Path(os.path.abspath(model_path)).parent  # not resolved: a cache's symlinks stay in the model's folder
    try:
        found = sorted(p for p in folder.iterdir()
                       if p.name.lower().startswith("mmproj") and p.name.lower().endswith(".gguf") and p.is_file())
    except OSError:
        return None
    found = [p for p in found if p.resolve() != Path(model_path).resolve()]
    if len(found) > 1:
        log.warning("%d mmproj files beside %s (%s): none loaded; name one with --mmproj", len(found),
                    Path(model_path).name, ", ".join(p.name for p in found))
        return None
    return str(found[0]) if found else None


def load_tower(path: str | os.PathLike, ops):
    """The tower of an mmproj file for its projector type: `VisionTower` (SigLIP: gemma3, idefics3), `QwenVLTower`
    (qwen2vl_merger, qwen2.5vl_merger), `Qwen3VLTower` (qwen3vl_merger) or `Gemma4VisionTower` (gemma4v)."""
    from gpullama.gguf_file import read_gguf
    from gpullama.vision.gemma4_tower import Gemma4VisionTower
    from gpullama.vision.projectors import QWEN_PROJECTORS, projector_type
    from gpullama.vision.qwen3_tower import Qwen3VLTower
    from gpullama.vision.qwen_tower import QwenVLTower
    from gpullama.vision.tower import VisionTower

    model = read_gguf(os.fspath(path), text_model=False)
    projector = projector_type(model.metadata)
    kind = Qwen3VLTower if projector == "qwen3vl_merger" else QwenVLTower if projector in QWEN_PROJECTORS else \
        Gemma4VisionTower if projector == "gemma4v" else VisionTower
    return kind(path, ops, model)


def load_vision(args, model_path: str, model, tokenizer, tp_size: int = 1):
    """The `VisionModel` of a loaded text model: `args.mmproj` (ValueError when it does not fit), else the file
    `find_mmproj` finds (skipped, with a log line, when it does not fit); None without one."""
    from gpullama.gguf_file import ModelFileError, read_header
    from gpullama.vision.prompt import VisionModel
    from gpullama.vision.tower import VisionConfig

    explicit = args.mmproj
    path = os.fspath(explicit) if explicit else (None if args.no_mmproj else find_mmproj(model_path))
    if path is None:
        return None
    arch = model.config.architecture
    try:
        if arch not in ARCHITECTURES:
            VisionConfig.from_metadata(read_header(path, text_model=False).metadata, path)  # names its projector
            raise ValueError(f"{Path(path).name}: images are supported for {', '.join(ARCHITECTURES)} models, "
                             f"not {arch}")
        if tp_size > 1:
            raise ValueError(f"{Path(path).name}: an mmproj is not supported with tensor parallelism")
        tower = load_tower(path, model.ops)
        if tower.config.projection_dim != model.config.hidden_size:
            raise ValueError(f"{path}: its projector writes {tower.config.projection_dim}-dim embeddings, the "
                             f"model's are {model.config.hidden_size}: not this model's mmproj")
        if tower.config.projector not in ARCHITECTURES[arch]:
            raise ValueError(f"{path}: projector type {tower.config.projector} does not fit a {arch} model "
                             f"(it takes {', '.join(ARCHITECTURES[arch])})")
        deepstack = len(tower.config.deepstack_layers)
        if deepstack != model.config.deepstack_layers:  # how the model splits each image embedding (llama.cpp's)
            raise ValueError(f"{path}: its tower writes {deepstack} deepstack features an image token, the model "
                             f"takes {model.config.deepstack_layers} ({arch}.n_deepstack_layers): not this model's "
                             "mmproj")
        vision = VisionModel(tower, tokenizer)
    except (ValueError, ModelFileError) as exc:
        if explicit:
            raise ValueError(f"--mmproj: {exc}") from None
        log.warning("not loading %s found beside the model: %s", Path(path).name, exc)
        return None
    log.info("vision: %s (projector %s, %dx%d pixels -> %d tokens a tile)", Path(path).name,
             tower.config.projector, tower.config.image_size, tower.config.image_size, tower.tokens_per_tile)
    return vision

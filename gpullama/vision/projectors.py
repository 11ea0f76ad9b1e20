"""The mmproj projector types gpullama reads and what `gpullama info` says of each: names only, no torch (the
towers themselves are `gpullama.vision.tower` and `gpullama.vision.qwen_tower`)."""

from __future__ import annotations

PROJECTORS = ("gemma3", "idefics3", "qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")
"""The ``clip.projector_type`` values gpullama reads (the Qwen ones: `gpullama.vision.qwen_tower`)."""
QWEN_PROJECTORS = ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")
DEFAULT_SCALE = {"gemma3": 4, "idefics3": 2, "qwen2vl_merger": 2, "qwen2.5vl_merger": 2, "qwen3vl_merger": 2}
"""``clip.vision.projector.scale_factor`` when a file has none (llama.cpp's defaults)."""


def describe_projector(meta: dict) -> str:
    """A line on what an mmproj file's metadata says its tower reads (`gpullama info`)."""
    projector, size = meta.get("clip.projector_type"), meta.get("clip.vision.image_size")
    if projector in QWEN_PROJECTORS:
        side = meta.get("clip.vision.patch_size", 14) * meta.get("clip.vision.spatial_merge_size", 2)
        deepstack = sum(bool(x) for x in meta.get("clip.vision.is_deepstack_layers") or ())
        return (f"{projector} projector, images at their own size in tokens of {side}x{side} pixels "
                "(8 to 4096 tokens an image), M-RoPE positions"
                + (f", deepstack features of {deepstack} tower layers" if deepstack else ""))
    if projector == "idefics3":
        edge = meta.get("clip.vision.preproc_image_size", size)
        return (f"{projector} projector, {size}x{size} pixel tiles of the image resized to {edge} pixels on its "
                "longest side, plus the whole image")
    return f"{projector} projector, {size}x{size} pixels"

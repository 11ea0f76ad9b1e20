"""The mmproj projector types gpullama reads and what `gpullama info` says of each: names only, no torch (the
towers themselves are `gpullama.vision.tower` and `gpullama.vision.qwen_tower`)."""

from __future__ import annotations

PROJECTORS = ("gemma3", "gemma4v", "idefics3", "qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")
"""The ``clip.projector_type`` values gpullama reads (the Qwen ones: `gpullama.vision.qwen_tower`; gemma4v:
`gpullama.vision.gemma4_tower`)."""
QWEN_PROJECTORS = ("qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger")
DEFAULT_SCALE = {"gemma3": 4, "gemma4v": 3, "idefics3": 2, "qwen2vl_merger": 2, "qwen2.5vl_merger": 2, "qwen3vl_merger": 2}
"""``clip.vision.projector.scale_factor`` when a file has none (llama.cpp's defaults)."""
GEMMA4_MAX_TOKENS = 280
"""The tokens of one Gemma 4 image at most: transformers' `Gemma4ImageProcessor` default ``max_soft_tokens`` (the
mmproj file does not say)."""


def projector_type(meta: dict) -> str | None:
    """An mmproj file's vision projector type: ``clip.projector_type``, or ``clip.vision.projector_type`` where the
    converter wrote one a modality (a file with a vision and an audio tower, as Gemma 4's)."""
    return meta.get("clip.projector_type") or meta.get("clip.vision.projector_type")


def describe_projector(meta: dict) -> str:
    """A line on what an mmproj file's metadata says its tower reads (`gpullama info`)."""
    projector, size = projector_type(meta), meta.get("clip.vision.image_size")
    if projector in QWEN_PROJECTORS:
        side = meta.get("clip.vision.patch_size", 14) * meta.get("clip.vision.spatial_merge_size", 2)
        deepstack = sum(bool(x) for x in meta.get("clip.vision.is_deepstack_layers") or ())
        return (f"{projector} projector, images at their own size in tokens of {side}x{side} pixels "
                "(8 to 4096 tokens an image), M-RoPE positions"
                + (f", deepstack features of {deepstack} tower layers" if deepstack else ""))
    if projector == "gemma4v":
        patch = meta.get("clip.vision.patch_size", 16)
        side = patch * meta.get("clip.vision.projector.scale_factor", DEFAULT_SCALE[projector])
        return (f"{projector} projector, images at their own aspect in tokens of {side}x{side} pixels (up to "
                f"{GEMMA4_MAX_TOKENS} tokens an image), 2-D rotary positions")
    if projector == "idefics3":
        edge = meta.get("clip.vision.preproc_image_size", size)
        return (f"{projector} projector, {size}x{size} pixel tiles of the image resized to {edge} pixels on its "
                "longest side, plus the whole image")
    return f"{projector} projector, {size}x{size} pixels"

"""Images in: mmproj files (`tower.VisionTower`), image sources, limits and preprocessing (`images`), and each
projector type's image tokens in a prompt (`prompt`). An image (or each of its tiles) becomes a run of embeddings
(`ImageSpan`) that the engine puts in place of its placeholder tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ImageSpan:
    """One image (or one tile of it) in a prompt: its embeddings ``[length, hidden]`` (Qwen3-VL: ``[length, hidden *
    (1 + deepstack layers)]``, the deepstack features after the embedding) take the place of the prompt's
    tokens ``start .. start + length`` (each the model's image token), attend to each other both ways (Gemma 3) or
    causally as text does (`causal`: Idefics3, Qwen2-VL), and key the prefix cache by `key` (a hash of the image's
    pixels). `rope`: the M-RoPE positions (time, row, column) of its tokens, ``[3, length]`` (Qwen2-VL); the text
    after it goes on from one past their largest (`rope_positions`)."""

    start: int
    embeds: Any  # torch.Tensor [length, ModelConfig.input_embedding_size] float32
    key: bytes
    causal: bool = False
    rope: Any = None  # torch.Tensor [3, length] int64, or None

    @property
    def length(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def end(self) -> int:
        return self.start + self.length


def rope_positions(spans: list[ImageSpan], start: int, end: int) -> list[list[int]]:
    """The M-RoPE positions (time, row, column lists) of tokens ``start .. end`` of a sequence whose images are
    `spans` (in order): an image's tokens its `rope`, any other token its index shifted by the images before it
    (each ends one past its largest position)."""
    out: list[list[int]] = [[], [], []]
    shift, i = 0, start
    for span in spans:
        if span.start >= end:
            break
        if span.end > i:
            lo, hi = max(i, span.start), min(end, span.end)
            for axis in out:  # the text before it
                axis.extend(range(i + shift, lo + shift))
            if span.rope is not None:
                for axis, values in zip(out, span.rope[:, lo - span.start : hi - span.start].tolist()):
                    axis.extend(values)
            else:
                for axis in out:
                    axis.extend(range(lo + shift, hi + shift))
            i = hi
        if span.rope is not None and span.end <= end:
            shift = int(span.rope.max()) + 1 - span.end
    for axis in out:
        axis.extend(range(i + shift, end + shift))
    return out


def mrope_image_positions(start: int, rows: int, cols: int) -> Any:
    """M-RoPE positions ``[3, rows * cols]`` int64 (time, row, column) of an image's tokens whose first position is
    `start` (Qwen2-VL's `get_rope_index` for one still image); the text after it goes on from
    ``start + max(rows, cols)``."""
    import torch

    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    return torch.stack([torch.zeros(rows * cols, dtype=torch.long), r.flatten(), c.flatten()]) + start

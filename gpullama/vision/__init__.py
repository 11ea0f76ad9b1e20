"""Images in: mmproj files (`tower.VisionTower`), image sources, limits and preprocessing (`images`), and each
projector type's image tokens in a prompt (`prompt`). An image (or each of its tiles) becomes a run of embeddings
(`ImageSpan`) that the engine puts in place of its placeholder tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class ImageSpan:
    """One image (or one tile of it) in a prompt: its embeddings ``[length, hidden]`` take the place of the prompt's
    tokens ``start .. start + length`` (each the model's image token), attend to each other both ways (Gemma 3) or
    causally as text does (`causal`: Idefics3), and key the prefix cache by `key` (a hash of the image's pixels)."""

    start: int
    embeds: Any  # torch.Tensor [length, hidden] float32
    key: bytes
    causal: bool = False

    @property
    def length(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def end(self) -> int:
        return self.start + self.length

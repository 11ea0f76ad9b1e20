"""Gemma 4's vision tower from its mmproj (``clip.projector_type = gemma4v``, as llama.cpp's converter writes it and
``tools/mtmd/models/gemma4v.cpp`` reads it). Each image at its own size (`gemma4_size`: aspect kept, at most
`GEMMA4_MAX_TOKENS` tokens, sides a multiple of patch x pool; Pillow's bicubic on uint8 pixels, as transformers'
`Gemma4ImageProcessorPil`); its pixels scaled to [-1, 1], the patch embedding a convolution without bias, plus a
learned x and a y position embedding (``v.position_embd``: two tables); blocks of RMSNorms (``ln1``, q/k norms per
head, values normalized without weight, ``attn_post_norm``, ``ln2``, ``ffn_post_norm``), q.k unscaled, a 2-D NeoX
rotary (the first half of each head rotated by the patch's column, the second by its row, base 100), a GeGLU MLP
(``ffn_gate``/``ffn_up``/``ffn_down``, GELU tanh), an optional scale of each block's output (``out_scale``) and
optional clamps of each matrix's input and output (``.input_min`` ... ``.output_max``: Gemma4ClippableLinear); then
each KxK block of patches averaged, times sqrt(width), standardized (``v.std_bias``, ``v.std_scale``), an RMSNorm
without weight and ``mm.input_projection`` into the text model. Its matrices, RMSNorms with a weight, GELU, rotary
and attention go through the model's ops (as the other towers'); the patch and position embeddings, the norms
without weight, the pooling and the clamps are torch on the ops' device."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpullama.gguf_file import ModelFileError, read_gguf
from gpullama.vision.tower import TowerTensors, VisionConfig

ROPE_BASE = 100.0  # llama.cpp's (and transformers' Gemma4VisionConfig's) rope_theta


def gemma4_size(height: int, width: int, patch: int, max_patches: int, pool: int) -> tuple[int, int]:
    """The (height, width) an image is resized to (transformers' `get_aspect_ratio_preserving_size`): the largest
    with the aspect kept, at most `max_patches` patches, each side a multiple of ``pool * patch``."""
    target = max_patches * patch * patch
    factor = math.sqrt(target / (height * width))
    side = pool * patch
    h, w = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
    if h == 0 and w == 0:
        raise ValueError(f"a {width}x{height} image cannot be resized to a multiple of {side} pixels a side")
    longest = (max_patches // pool**2) * side
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        w, h = side, min(int(math.floor(height / width)) * side, longest)
    if h * w > target:
        raise ValueError(f"a {width}x{height} image resized to {w}x{height} exceeds {max_patches} patches")
    return h, w


@dataclass
class _Block:
    ln1: torch.Tensor
    q: object
    k: object
    v: object
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    out: object
    attn_post_norm: torch.Tensor
    ln2: torch.Tensor
    gate: object
    up: object
    down: object
    ffn_post_norm: torch.Tensor
    out_scale: torch.Tensor | None
    clamps: dict  # matrix -> (input min, input max, output min, output max)


class Gemma4VisionTower:
    """A Gemma 4 mmproj loaded for `ops`: `encode_images(images)` -> each image's embeddings ``[1, tokens,
    projection_dim]`` (0, 0: no tiles)."""

    def __init__(self, path: str | os.PathLike, ops, model=None):
        path = os.fspath(path)
        model = model or read_gguf(path, text_model=False)
        self.path, self.ops = path, ops
        self.config = c = VisionConfig.from_metadata(model.metadata, path)
        t = TowerTensors(model, ops, path)
        self.patch_w = t.dense("v.patch_embd.weight").reshape(c.hidden, -1)  # [D, 3 * p * p] (conv as a matmul)
        if self.patch_w.shape[1] != 3 * c.patch_size**2:
            raise ModelFileError(f"{path}: v.patch_embd does not take {c.patch_size}x{c.patch_size} RGB patches")
        self.position = t.dense("v.position_embd.weight")  # [2 (x, y), positions, D]
        if self.position.dim() != 3 or self.position.shape[0] != 2 or self.position.shape[2] != c.hidden:
            raise ModelFileError(f"{path}: v.position_embd is {tuple(self.position.shape)}, expected (2, positions, "
                                 f"{c.hidden})")
        if c.hidden % c.heads or (c.hidden // c.heads) % 4:
            raise ModelFileError(f"{path}: {c.heads} heads of a {c.hidden}-wide tower are not a multiple of 4 wide")

        def clamp(name: str):
            base = name.removesuffix(".weight")
            if not t.has(base + ".input_min"):
                return None
            return tuple(float(t.dense(base + s).flatten()[0]) for s in (".input_min", ".input_max", ".output_min",
                                                                         ".output_max"))

        self.blocks = []
        for i in range(c.layers):
            b = f"v.blk.{i}."
            mats = {m: b + m + ".weight" for m in ("attn_q", "attn_k", "attn_v", "attn_out", "ffn_gate", "ffn_up",
                                                    "ffn_down")}
            self.blocks.append(_Block(
                t.dense(b + "ln1.weight"), t.weight(mats["attn_q"]), t.weight(mats["attn_k"]),
                t.weight(mats["attn_v"]), t.dense(b + "attn_q_norm.weight"), t.dense(b + "attn_k_norm.weight"),
                t.weight(mats["attn_out"]), t.dense(b + "attn_post_norm.weight"), t.dense(b + "ln2.weight"),
                t.weight(mats["ffn_gate"]), t.weight(mats["ffn_up"]), t.weight(mats["ffn_down"]),
                t.dense(b + "ffn_post_norm.weight"),
                t.dense(b + "out_scale.weight") if t.has(b + "out_scale.weight") else None,
                {m: clamp(name) for m, name in mats.items() if clamp(name) is not None}))
        self.std = (t.dense("v.std_bias"), t.dense("v.std_scale")) if t.has("v.std_bias") else None
        proj = t.need("mm.input_projection.weight")  # [text hidden, D] as torch reads it
        if tuple(proj.shape) != (c.projection_dim, c.hidden):
            raise ModelFileError(f"{path}: mm.input_projection is {tuple(proj.shape)}, expected "
                                 f"({c.projection_dim}, {c.hidden})")
        self.projection = t.weight("mm.input_projection.weight")
        self.projection_clamp = clamp("mm.input_projection.weight")
        quarter = c.hidden // c.heads // 4
        self.inv_freq = 1.0 / ROPE_BASE ** (torch.arange(quarter, dtype=torch.float32, device=ops.device) / quarter)

    @property
    def tokens_per_tile(self) -> int:
        """The tokens of one image at most."""
        return self.config.tokens_per_tile

    def preprocess(self, image) -> torch.Tensor:
        """Pixels ``[3, H, W]`` of a decoded RGB PIL image as transformers' Gemma 4 image processor makes them (before
        the tower's scaling to [-1, 1]): resized to `gemma4_size` (bicubic), then mean/std from the file."""
        from PIL import Image

        from gpullama.vision.images import normalise

        c = self.config
        h, w = gemma4_size(image.height, image.width, c.patch_size, c.tokens_per_tile * c.pool**2, c.pool)
        if (w, h) != image.size:
            image = image.resize((w, h), resample=Image.BICUBIC)
        return normalise(image, c.mean, c.std)

    def encode_images(self, images: list) -> list[tuple[torch.Tensor, int, int]]:
        """Each decoded RGB PIL image's embeddings ``[1, tokens, projection_dim]`` (no tiles: 0, 0)."""
        return [(self.encode(self.preprocess(image))[None], 0, 0) for image in images]

    def _linear(self, x: torch.Tensor, w, bounds) -> torch.Tensor:
        if bounds is None:
            return self.ops.linear(x.contiguous(), w)
        return self.ops.linear(x.clamp(bounds[0], bounds[1]).contiguous(), w).clamp(bounds[2], bounds[3])

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[tokens, projection_dim]`` float32 of one image's pixels ``[3, H, W]`` (`preprocess`)."""
        c, ops = self.config, self.ops
        p, k = c.patch_size, c.pool
        pixels = pixels.to(self.position.device, torch.float32) * 2.0 - 1.0
        rows, cols = pixels.shape[1] // p, pixels.shape[2] // p
        if rows * p != pixels.shape[1] or cols * p != pixels.shape[2] or rows % k or cols % k:
            raise ValueError(f"{pixels.shape[2]}x{pixels.shape[1]} pixels are not whole {k}x{k} blocks of patches")
        n = rows * cols
        # [3, H, W] -> [rows * cols, 3 * p * p] in the conv weight's (channel, row, column) order
        patches = pixels.unfold(1, p, p).unfold(2, p, p).permute(1, 2, 0, 3, 4).reshape(n, -1)
        index = torch.arange(n, device=pixels.device)
        px, py = index % cols, index // cols
        if cols > self.position.shape[1] or rows > self.position.shape[1]:
            raise ValueError(f"{cols}x{rows} patches exceed the tower's {self.position.shape[1]} positions a side")
        x = patches @ self.patch_w.t() + self.position[0][px] + self.position[1][py]
        rope_x, rope_y = self._rotary(px), self._rotary(py)
        hd = c.hidden // c.heads
        half = hd // 2
        for blk in self.blocks:
            cl = blk.clamps
            h = ops.post_norm(x, blk.ln1, c.eps)
            q = ops.head_rms_norm(self._linear(h, blk.q, cl.get("attn_q")).view(n, c.heads, hd), blk.q_norm, c.eps)
            kk = ops.head_rms_norm(self._linear(h, blk.k, cl.get("attn_k")).view(n, c.heads, hd), blk.k_norm, c.eps)
            v = _rms(self._linear(h, blk.v, cl.get("attn_v")).view(n, c.heads, hd), c.eps)
            # the 2-D rotary: each half of a head its own NeoX rotation, by the patch's column, then by its row
            qx, kx = ops.rotate(q[..., :half].contiguous(), kk[..., :half].contiguous(), rope_x)
            qy, ky = ops.rotate(q[..., half:].contiguous(), kk[..., half:].contiguous(), rope_y)
            q, kk = torch.cat([qx, qy], dim=-1), torch.cat([kx, ky], dim=-1)
            a = ops.image_attention(q.transpose(0, 1)[None], kk.transpose(0, 1)[None], v.transpose(0, 1)[None], 1.0)
            a = self._linear(a[0].transpose(0, 1).reshape(n, c.hidden), blk.out, cl.get("attn_out"))
            x = x + ops.post_norm(a, blk.attn_post_norm, c.eps)
            h = ops.post_norm(x, blk.ln2, c.eps)
            h = ops.gelu(self._linear(h, blk.gate, cl.get("ffn_gate")), "tanh") * \
                self._linear(h, blk.up, cl.get("ffn_up"))
            x = x + ops.post_norm(self._linear(h, blk.down, cl.get("ffn_down")), blk.ffn_post_norm, c.eps)
            if blk.out_scale is not None:
                x = x * blk.out_scale
        pooled = F.avg_pool2d(x.view(rows, cols, c.hidden).permute(2, 0, 1)[None], k, k)  # [1, D, rows/k, cols/k]
        x = pooled[0].flatten(1).t() * math.sqrt(c.hidden)
        if self.std is not None:
            x = (x - self.std[0]) * self.std[1]
        return self._linear(_rms(x, c.eps), self.projection, self.projection_clamp).float()

    def _rotary(self, positions: torch.Tensor) -> torch.Tensor:
        """The cos|sin rows ``[n, head_dim / 2]`` of one axis's positions for `ops.rotate` (NeoX pairs within a half
        head: i and i + a quarter)."""
        angles = positions[:, None].float() * self.inv_freq
        return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without weight over the last dim (the values, the pooled tokens), float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

"""Qwen2-VL's and Qwen2.5-VL's vision towers from their mmproj (``clip.projector_type = qwen2vl_merger`` /
``qwen2.5vl_merger``, as llama.cpp's converter writes them): images at their own size (`smart_resize` to multiples of patch x merge pixels, bicubic), 14x14 (here: the
file's) patches of two identical frames (``v.patch_embd.weight`` and ``.weight.1``, the converter's halves of the
Conv3d), a 2D rotary over each head (height then width frequencies, transformers' axial rope), LayerNorm blocks
with QuickGELU MLPs attending over the whole image, then the merger: LayerNorm (``v.post_ln``), each 2x2 block of
patches concatenated, ``mm.0`` -> GELU -> ``mm.2``. The patches are laid out in 2x2-block order, as transformers'
image processor does, so the merger's blocks are contiguous rows. Qwen2.5-VL: RMSNorms (no biases) and SwiGLU
MLPs (``ffn_gate``, SiLU); each block but every ``clip.vision.n_wa_pattern``-th attends within windows of
``clip.vision.window_size`` pixels (112 when absent, llama.cpp's default: 4x4 merged tokens of 14-pixel patches),
the merged grid cut from its top-left corner (transformers reorders the tokens by window; a mask over the same
order is the same attention).

The text model places the image's tokens at M-RoPE positions (`gpullama.vision.mrope_image_positions`): time, row and column of each
merged token, counted from the image's first position; the text after it from one past the largest."""

from __future__ import annotations

import math
import os

import torch

from gpullama.gguf_file import ModelFileError, read_gguf
from gpullama.vision.tower import TowerTensors, VisionConfig, _f32

ROPE_THETA = 10000.0
MIN_TOKENS, MAX_TOKENS = 8, 4096
"""llama.cpp's limits of Qwen2-VL's image tokens (`set_limit_image_tokens(8, 4096)`): min and max pixels are these
times (patch x merge)^2."""


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL `smart_resize`: both sides multiples of `factor`, the area within the limits, the
    aspect ratio kept as nearly as it can."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"the image's aspect ratio is over 200 ({width}x{height})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


class QwenVLTower:
    """A Qwen2-VL mmproj loaded for `ops`: `encode_images(images)` -> each image's embeddings ``[1, tokens,
    projection_dim]`` and its merged grid (rows, columns). The patch embedding, the 2D rotary, the attention and the
    merger are shared with Qwen3-VL's tower (`gpullama.vision.qwen3_tower`), which loads its own blocks (`_load`)."""

    def __init__(self, path: str | os.PathLike, ops, model=None):
        path = os.fspath(path)
        model = model or read_gguf(path, text_model=False)
        self.path = path
        self.config = c = VisionConfig.from_metadata(model.metadata, path)
        self.ops = ops
        t = TowerTensors(model, ops, path)
        first, second = t.dense("v.patch_embd.weight"), t.dense("v.patch_embd.weight.1")  # [D, 3, p, p] each frame
        self.patch_w = torch.stack([first, second], dim=2).reshape(c.hidden, -1)  # (channel, frame, row, column)
        self.mm0, self.mm0_bias = t.weight("mm.0.weight"), t.dense("mm.0.bias")
        self.mm2, self.mm2_bias = t.weight("mm.2.weight"), t.dense("mm.2.bias")
        if t.need("mm.2.weight").shape[0] != c.projection_dim:
            raise ModelFileError(f"{path}: mm.2 writes {t.need('mm.2.weight').shape[0]} values, projection_dim is "
                                 f"{c.projection_dim}")
        hd = c.hidden // c.heads
        self.inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, hd // 2, 2, dtype=torch.float) / (hd // 2)))
        self._load(t, model.metadata)

    def _load(self, t: TowerTensors, meta: dict) -> None:
        """Qwen2-VL's blocks (LayerNorm, QuickGELU) or Qwen2.5-VL's (RMSNorm, SwiGLU, windows) and the merger's norm."""
        c, path, ops = self.config, self.path, self.ops
        self.v25 = c.projector == "qwen2.5vl_merger"
        self.window_pattern = int(meta.get("clip.vision.n_wa_pattern", 0)) if self.v25 else 0
        self.window = int(meta.get("clip.vision.window_size", 112)) // (c.patch_size * c.pool)
        if self.v25 and (self.window_pattern < 1 or self.window < 1):
            raise ModelFileError(f"{path}: Qwen2.5-VL's window attention needs clip.vision.n_wa_pattern >= 1 and a "
                                 f"window of at least one merged token (n_wa_pattern {self.window_pattern})")

        def norm(name: str):  # Qwen2-VL: LayerNorm (weight, bias); Qwen2.5-VL: RMSNorm (weight)
            return (t.dense(name + ".weight"), None if self.v25 else t.dense(name + ".bias"))

        self.blocks = []
        for i in range(c.layers):
            b = f"v.blk.{i}."
            qkv = _f32(torch.cat([t.dense(b + f"attn_{x}.weight") for x in "qkv"]), b + "attn_qkv.weight")
            # Qwen2.5-VL's SwiGLU: gate|up rows joined into one matrix (one matmul, then `ops.silu_mul`)
            up = ("ffn_gate", "ffn_up") if self.v25 else ("ffn_up",)
            self.blocks.append(dict(
                ln1=norm(b + "ln1"), qkv=ops.prepare_weight(qkv),
                qkv_bias=torch.cat([t.dense(b + f"attn_{x}.bias") for x in "qkv"]),
                out=t.weight(b + "attn_out.weight"), out_bias=t.dense(b + "attn_out.bias"),
                ln2=norm(b + "ln2"),
                up=t.weight(*(b + f"{x}.weight" for x in up)), up_bias=torch.cat([t.dense(b + f"{x}.bias") for x in up]),
                down=t.weight(b + "ffn_down.weight"), down_bias=t.dense(b + "ffn_down.bias")))
        self.post_ln = norm("v.post_ln")

    @property
    def tokens_per_tile(self) -> int:
        """0: the tokens of an image follow its size."""
        return 0

    def pixels(self, image) -> tuple[torch.Tensor, int, int]:
        """Patches ``[gh * gw, 3 * 2 * p * p]`` of a decoded RGB PIL image as transformers' Qwen2-VL image processor
        makes them (smart resize, Pillow's bicubic, mean/std from the file, 2x2-block order), and the patch grid."""
        from PIL import Image

        from gpullama.vision.images import normalise

        c = self.config
        p, m = c.patch_size, c.pool
        factor = p * m
        width, height = image.size
        h, w = smart_resize(height, width, factor, MIN_TOKENS * factor * factor, MAX_TOKENS * factor * factor)
        if (w, h) != image.size:
            image = image.resize((w, h), resample=Image.BICUBIC)
        x = normalise(image, c.mean, c.std)
        gh, gw = h // p, w // p
        x = x.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # (bh, bw, mh, mw, C, p, p)
        x = x[:, :, :, :, :, None].expand(*x.shape[:5], 2, p, p)  # two identical frames
        return x.reshape(gh * gw, -1), gh, gw

    def _rotary(self, gh: int, gw: int) -> torch.Tensor:
        """The 2D rotary's cos|sin table ``[gh * gw, head dims]`` of the patches (in 2x2-block order) for
        `ops.rotate`: each half's angles, the patch's row times the first half of the frequencies, its column times
        the second (transformers' axial rope)."""
        m = self.config.pool
        hpos, wpos = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
        shape = (gh // m, m, gw // m, m)
        hpos, wpos = (a.reshape(shape).transpose(1, 2).flatten() for a in (hpos, wpos))
        freqs = torch.cat([hpos[:, None] * self.inv_freq, wpos[:, None] * self.inv_freq], dim=-1)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def _norm(self, x: torch.Tensor, weights: tuple) -> torch.Tensor:
        """Qwen2-VL's LayerNorm (weight, bias) or Qwen2.5-VL's RMSNorm (weight), float32."""
        w, b = weights
        if b is not None:
            return self.ops.layer_norm(x, w, b, self.config.eps)
        return self.ops.post_norm(x, w, self.config.eps)

    def _window_mask(self, gh: int, gw: int) -> torch.Tensor:
        """``[n, n]`` True where two patches (in 2x2-block order) lie in one attention window (Qwen2.5-VL's windows
        of `window` x `window` merged tokens from the grid's top-left corner)."""
        m, w = self.config.pool, self.window
        rows, cols = gh // m, gw // m
        unit = torch.arange(rows * cols)
        window = (unit // cols // w) * (-(-cols // w)) + (unit % cols) // w
        window = window.repeat_interleave(m * m)
        return window[:, None] == window[None, :]

    def _attention(self, h: torch.Tensor, blk: dict, rope: torch.Tensor, mask: torch.Tensor | None = None
                   ) -> torch.Tensor:
        """One block's attention over an image's patches `h` ``[n, D]`` (normed): q|k|v, the 2D rotary (`rope`: the
        table of `_rotary`), every patch attending to every other one (or within `mask`), then the output matrix."""
        c, ops = self.config, self.ops
        n, hd = h.shape[0], c.hidden // c.heads
        q, k, v = ops.linear(h, blk["qkv"], blk["qkv_bias"]).view(n, 3, c.heads, hd).unbind(1)
        q, k = ops.rotate(q, k, rope)
        a = ops.image_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                1.0 / math.sqrt(hd), mask)[0]
        return ops.linear(a.transpose(0, 1).reshape(n, c.hidden), blk["out"], blk["out_bias"])

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        """The merger: ``v.post_ln`` on each patch, each 2x2 block of patches (contiguous rows) concatenated, then
        ``mm.0`` -> GELU -> ``mm.2``: ``[n, D]`` -> ``[n / 4, projection_dim]``."""
        c, ops = self.config, self.ops
        x = self._norm(x, self.post_ln).reshape(-1, c.hidden * c.pool * c.pool)
        x = ops.gelu(ops.linear(x.contiguous(), self.mm0, self.mm0_bias))
        return ops.linear(x, self.mm2, self.mm2_bias)

    @torch.inference_mode()
    def encode_patches(self, patches: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
        """Embeddings ``[gh * gw / 4, projection_dim]`` float32 of one image's patches (`pixels`)."""
        ops = self.ops
        device = self.post_ln[0].device
        windows = self._window_mask(gh, gw).to(device) if self.v25 else None
        x = patches.to(device, torch.float32) @ self.patch_w.t()
        rope = self._rotary(gh, gw).to(device)
        for i, blk in enumerate(self.blocks):
            full = windows is None or (i + 1) % self.window_pattern == 0
            x = x + self._attention(self._norm(x, blk["ln1"]), blk, rope, None if full else windows)
            h = ops.linear(self._norm(x, blk["ln2"]), blk["up"], blk["up_bias"])
            h = ops.silu_mul(h) if self.v25 else ops.gelu(h, "quick")  # Qwen2.5-VL: SwiGLU; Qwen2-VL: QuickGELU
            x = x + ops.linear(h, blk["down"], blk["down_bias"])
        return self._merge(x).float()

    def encode_images(self, images: list) -> list[tuple[torch.Tensor, int, int]]:
        """Each decoded RGB PIL image's embeddings ``[1, tokens, projection_dim]`` and its merged grid (rows,
        columns: the M-RoPE height and width of its tokens)."""
        out = []
        for image in images:
            patches, gh, gw = self.pixels(image)
            out.append((self.encode_patches(patches, gh, gw)[None], gh // self.config.pool, gw // self.config.pool))
        return out


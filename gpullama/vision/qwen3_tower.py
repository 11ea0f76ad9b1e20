"""Qwen3-VL's vision tower from its mmproj (``clip.projector_type = qwen3vl_merger``, as llama.cpp's converter writes
it): Qwen2-VL's patches (`QwenVLTower.pixels`: smart resize, two identical frames, 2x2-block order) through the
converter's halves of the Conv3d plus its bias (``v.patch_embd.bias``), plus learned position embeddings
(``v.position_embd``, a square grid resampled to the image's patch grid: bilinear, corners aligned, as transformers'
`fast_pos_embed_interpolate`), the 2D rotary of Qwen2-VL, LayerNorm blocks with a fused ``attn_qkv`` and GELU (tanh)
MLPs over the whole image, then the merger (``v.post_ln`` on each patch, each 2x2 block concatenated, ``mm.0`` -> GELU
-> ``mm.2``).

Deepstack: after each block of ``clip.vision.is_deepstack_layers`` its output goes through a merger of its own
(``v.deepstack.N.*``: the 2x2 block concatenated first, then a LayerNorm over it, ``fc1`` -> GELU -> ``fc2``). As
llama.cpp's mmproj output, each merged token's embedding is the main one followed by the deepstack ones
(``[tokens, projection_dim * (1 + deepstack)]``); the text model (`qwen3vl`, ``n_deepstack_layers``) takes the first
as the token's input and adds the k-th to its hidden state after text layer k (`gpullama.model.Decoder`). Qwen3.5's
mmproj (text model `qwen35`) is this tower without deepstack: one embedding a merged token."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpullama.gguf_file import ModelFileError
from gpullama.vision.qwen_tower import QwenVLTower
from gpullama.vision.tower import TowerTensors


@dataclass
class DeepstackMerger:
    """One deepstack merger (``v.deepstack.N``): LayerNorm over a 2x2 block's concatenated patches, fc1, GELU, fc2."""

    norm: tuple[torch.Tensor, torch.Tensor]
    fc1: object
    fc1_bias: torch.Tensor
    fc2: object
    fc2_bias: torch.Tensor


class Qwen3VLTower(QwenVLTower):
    """A Qwen3-VL mmproj loaded for `ops`: `encode_images(images)` -> each image's embeddings ``[1, tokens,
    projection_dim * (1 + deepstack)]`` (the main embedding, then each deepstack one) and its merged grid."""

    v25 = False

    def _load(self, t: TowerTensors, meta: dict) -> None:
        c, ops = self.config, self.ops
        self.patch_b = t.dense("v.patch_embd.bias")
        self.position = t.dense("v.position_embd.weight")  # [side * side, D]
        self.side = c.image_size // c.patch_size
        if tuple(self.position.shape) != (self.side * self.side, c.hidden):
            raise ModelFileError(f"{self.path}: v.position_embd is {tuple(self.position.shape)}, expected "
                                 f"({self.side * self.side}, {c.hidden}) for {c.image_size}-pixel images of "
                                 f"{c.patch_size}-pixel patches")

        def norm(name: str):
            return t.dense(name + ".weight"), t.dense(name + ".bias")

        self.blocks = []
        for i in range(c.layers):
            b = f"v.blk.{i}."
            self.blocks.append(dict(
                ln1=norm(b + "ln1"), qkv=t.weight(b + "attn_qkv.weight"), qkv_bias=t.dense(b + "attn_qkv.bias"),
                out=t.weight(b + "attn_out.weight"), out_bias=t.dense(b + "attn_out.bias"), ln2=norm(b + "ln2"),
                up=t.weight(b + "ffn_up.weight"), up_bias=t.dense(b + "ffn_up.bias"),
                down=t.weight(b + "ffn_down.weight"), down_bias=t.dense(b + "ffn_down.bias")))
        self.post_ln = norm("v.post_ln")
        self.deepstack = {}
        for i in c.deepstack_layers:
            d = f"v.deepstack.{i}."
            fc2 = t.need(d + "fc2.weight")
            if fc2.shape[0] != c.projection_dim:
                raise ModelFileError(f"{self.path}: {d}fc2 writes {fc2.shape[0]} values, projection_dim is "
                                     f"{c.projection_dim}")
            self.deepstack[i] = DeepstackMerger(norm(d + "norm"), t.weight(d + "fc1.weight"), t.dense(d + "fc1.bias"),
                                                ops.prepare_weight(fc2), t.dense(d + "fc2.bias"))

    @property
    def embedding_width(self) -> int:
        """The width of one merged token's embedding: the main one and each deepstack one."""
        return self.config.projection_dim * (1 + len(self.deepstack))

    def _positions(self, gh: int, gw: int) -> torch.Tensor:
        """The learned position embeddings resampled to a ``gh x gw`` patch grid (bilinear, corners aligned), in the
        patches' 2x2-block order: ``[gh * gw, D]``."""
        c, m, side = self.config, self.config.pool, self.side
        grid = self.position.view(side, side, c.hidden).permute(2, 0, 1)[None]
        grid = F.interpolate(grid, size=(gh, gw), mode="bilinear", align_corners=True)[0].permute(1, 2, 0)
        return grid.reshape(gh // m, m, gw // m, m, c.hidden).transpose(1, 2).reshape(gh * gw, c.hidden)

    def _deepstack(self, x: torch.Tensor, merger: DeepstackMerger) -> torch.Tensor:
        """A deepstack merger over a block's output ``[n, D]`` -> ``[n / 4, projection_dim]``."""
        c, ops = self.config, self.ops
        width = c.hidden * c.pool * c.pool
        x = ops.layer_norm(x.reshape(-1, width), *merger.norm, c.eps)
        return ops.linear(ops.gelu(ops.linear(x, merger.fc1, merger.fc1_bias)), merger.fc2, merger.fc2_bias)

    @torch.inference_mode()
    def encode_patches(self, patches: torch.Tensor, gh: int, gw: int) -> torch.Tensor:
        """Embeddings ``[gh * gw / 4, projection_dim * (1 + deepstack)]`` float32 of one image's patches
        (`pixels`): the merger's, then each deepstack merger's in block order."""
        ops = self.ops
        device = self.post_ln[0].device
        x = patches.to(device, torch.float32) @ self.patch_w.t() + self.patch_b + self._positions(gh, gw)
        rope = self._rotary(gh, gw).to(device)
        deep = []
        for i, blk in enumerate(self.blocks):
            x = x + self._attention(self._norm(x, blk["ln1"]), blk, rope)
            h = ops.gelu(ops.linear(self._norm(x, blk["ln2"]), blk["up"], blk["up_bias"]), "tanh")
            x = x + ops.linear(h, blk["down"], blk["down_bias"])
            if i in self.deepstack:
                deep.append(self._deepstack(x, self.deepstack[i]))
        return torch.cat([self._merge(x), *deep], dim=-1).float()

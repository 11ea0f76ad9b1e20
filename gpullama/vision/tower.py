"""The vision side of a multimodal model, from llama.cpp's mmproj GGUF (``general.architecture = "clip"``, as
``convert_hf_to_gguf.py --mmproj`` writes it and ``tools/mtmd/clip.cpp`` reads it): the SigLIP tower
(``v.patch_embd``, ``v.position_embd``, ``v.blk.N.*``, ``v.post_ln``) and the projector into the text model's
embedding space. Projector types read here (each a head class in `HEADS`): ``gemma3`` (a KxK average pool of the
patch grid to tokens, ``mm.soft_emb_norm`` (an RMSNorm, its +1 folded in by the converter), then
``mm.input_projection``); ``idefics3`` (SmolVLM, Idefics3: a pixel shuffle that folds each KxK block of patches
into one token of K*K times the width, then ``mm.model.fc``, no bias; the image is cut into tiles of the tower's
size plus the whole image, `gpullama.vision.images.idefics3_tiles`).

The tower runs through the text model's ops: its matrices (`ops.prepare_weight` / `ops.linear`: float32 torch on
the exact path, the C kernels on F32/F16/Q8_0 blocks on the CPU fast path, the Triton matmul on the GPU), its
LayerNorms (`ops.layer_norm`), GELUs (`ops.gelu`), attention (`ops.image_attention`) and the head's RMSNorm
(`ops.post_norm`), each a Triton kernel under `TritonOps` but the attention (torch's SDPA in the compute dtype);
the patch embedding (a float32 matmul of the pixels), the position embeddings and the pooling are torch on the ops'
device."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpullama.gguf_file import ModelFileError, read_gguf
from gpullama.vision.projectors import DEFAULT_SCALE, GEMMA4_MAX_TOKENS, PROJECTORS, QWEN_PROJECTORS, projector_type


@dataclass
class VisionConfig:
    """The keys of an mmproj file that shape the tower."""

    projector: str
    image_size: int
    patch_size: int
    hidden: int
    ffn: int
    layers: int
    heads: int
    eps: float
    mean: list[float]
    std: list[float]
    tokens_per_tile: int  # the tokens of one tile (of the whole image, for gemma3; at most, for gemma4v)
    pool: int  # gemma3's average pool (4: 896/14 = 64 patches a side -> 16 -> 256 tokens), idefics3's pixel shuffle
    projection_dim: int  # the text model's embedding length
    longest_edge: int = 0  # idefics3: the image's longest side before it is cut into tiles
    deepstack_layers: tuple[int, ...] = ()  # qwen3vl: the blocks whose outputs feed a deepstack merger

    @classmethod
    def from_metadata(cls, meta: dict, path: str) -> VisionConfig:
        arch = meta.get("general.architecture")
        if arch != "clip":
            raise ModelFileError(f"{path}: not an mmproj file (general.architecture {arch!r}, expected 'clip')")
        projector = projector_type(meta)
        if projector not in PROJECTORS:
            raise ModelFileError(f"{path}: clip.projector_type {projector!r} is not supported; gpullama reads "
                                 f"{', '.join(PROJECTORS)}")

        def key(name: str):
            full = f"clip.vision.{name}"
            if full not in meta:
                raise ModelFileError(f"{path}: the mmproj file has no {full!r}")
            return meta[full]

        image, patch = int(key("image_size")), int(key("patch_size"))
        side = image // patch
        scale_key = "spatial_merge_size" if projector in QWEN_PROJECTORS else "projector.scale_factor"
        pool = int(meta.get(f"clip.vision.{scale_key}", DEFAULT_SCALE[projector]))
        if pool < 1 or (side % pool and projector != "gemma4v"):  # gemma4v: each image at a size of its own
            raise ModelFileError(f"{path}: {side} patches a side do not pool by {pool}")
        longest = int(meta.get("clip.vision.preproc_image_size", image)) if projector == "idefics3" else 0
        if projector == "idefics3" and longest < image:
            raise ModelFileError(f"{path}: clip.vision.preproc_image_size {longest} is smaller than a tile ({image})")
        layers = int(key("block_count"))
        deepstack = tuple(i for i, on in enumerate(meta.get("clip.vision.is_deepstack_layers") or ()) if on)
        if any(i >= layers for i in deepstack):
            raise ModelFileError(f"{path}: clip.vision.is_deepstack_layers names blocks past the {layers} the tower has")
        return cls(projector, image, patch, int(key("embedding_length")), int(key("feed_forward_length")), layers,
                   int(key("attention.head_count")), float(key("attention.layer_norm_epsilon")),
                   [float(x) for x in key("image_mean")], [float(x) for x in key("image_std")],
                   GEMMA4_MAX_TOKENS if projector == "gemma4v" else (side // pool) ** 2,
                   pool, int(key("projection_dim")), longest, deepstack)


class TowerTensors:
    """An mmproj file's tensors as a tower loads them for `ops`: `need` (the raw tensor; a missing one is named),
    `dense` (float32 on the ops' device: norms, biases, embeddings) and `weight` (a matrix through
    `ops.prepare_weight`; several names: their rows stacked into one matrix, in their own blocks when their types
    agree)."""

    def __init__(self, model, ops, path: str):
        self.tensors, self.ops, self.path = model.tensors, ops, path

    def has(self, name: str) -> bool:
        return name in self.tensors

    def need(self, name: str):
        if name not in self.tensors:
            raise ModelFileError(f"{self.path}: the mmproj file has no tensor {name!r}")
        return self.tensors[name]

    def dense(self, name: str) -> torch.Tensor:
        return self.need(name).dequantize(torch.float32).to(self.ops.device)

    def weight(self, *names: str):
        parts = [self.need(n) for n in names]
        if len(parts) == 1:
            return self.ops.prepare_weight(parts[0])
        if len({p.qtype for p in parts}) == 1:
            from gpullama.quants import QTensor

            rows = torch.cat([p.data for p in parts])
            return self.ops.prepare_weight(QTensor(rows, parts[0].qtype, (rows.shape[0], parts[0].shape[1]), names[0]))
        return self.ops.prepare_weight(_f32(torch.cat([p.dequantize(torch.float32) for p in parts]), names[0]))


@dataclass
class _Block:
    ln1: tuple[torch.Tensor, torch.Tensor]
    qkv: object
    qkv_bias: torch.Tensor
    out: object
    out_bias: torch.Tensor
    ln2: tuple[torch.Tensor, torch.Tensor]
    up: object
    up_bias: torch.Tensor
    down: object
    down_bias: torch.Tensor


class Gemma3Head:
    """Gemma 3's projector: the patch grid average-pooled KxK, an RMSNorm (``mm.soft_emb_norm``), then
    ``mm.input_projection`` (stored as ``x @ W``)."""

    def __init__(self, c: VisionConfig, t: TowerTensors, ops):
        self.soft_emb_norm = t.dense("mm.soft_emb_norm.weight")
        proj = t.need("mm.input_projection.weight")  # [D, text hidden] as torch reads it: x @ W
        if c.projection_dim != proj.shape[1]:
            raise ModelFileError(f"{t.path}: mm.input_projection has {proj.shape[1]} columns, projection_dim is "
                                 f"{c.projection_dim}")
        self.projection = ops.prepare_weight(_f32(proj.dequantize(torch.float32).t().contiguous(),
                                                  "mm.input_projection.weight"))

    def __call__(self, x: torch.Tensor, b: int, side: int, c: VisionConfig, ops) -> torch.Tensor:
        """``[b * side * side, D]`` tower outputs -> ``[b * tokens_per_tile, projection_dim]``."""
        grid = x.view(b, side, side, c.hidden).permute(0, 3, 1, 2)
        pooled = F.avg_pool2d(grid, c.pool, c.pool).flatten(2).transpose(1, 2).reshape(-1, c.hidden)
        return ops.linear(ops.post_norm(pooled.contiguous(), self.soft_emb_norm, c.eps), self.projection)


class Idefics3Head:
    """Idefics3's (SmolVLM's) connector: transformers' pixel shuffle (each KxK block of patches becomes one token of
    K*K times the width), then ``mm.model.fc`` (no bias)."""

    def __init__(self, c: VisionConfig, t: TowerTensors, ops):
        fc = t.need("mm.model.fc.weight")  # [text hidden, D * K * K] as torch reads it
        if tuple(fc.shape) != (c.projection_dim, c.hidden * c.pool * c.pool):
            raise ModelFileError(f"{t.path}: mm.model.fc is {tuple(fc.shape)}, expected "
                                 f"({c.projection_dim}, {c.hidden * c.pool * c.pool})")
        self.fc = ops.prepare_weight(fc)

    def __call__(self, x: torch.Tensor, b: int, side: int, c: VisionConfig, ops) -> torch.Tensor:
        """``[b * side * side, D]`` tower outputs -> ``[b * tokens_per_tile, projection_dim]``."""
        k, d = c.pool, c.hidden
        x = x.view(b, side, side // k, d * k).permute(0, 2, 1, 3)
        x = x.reshape(b, side // k, side // k, d * k * k).permute(0, 2, 1, 3)
        return ops.linear(x.reshape(b * c.tokens_per_tile, d * k * k).contiguous(), self.fc)


HEADS = {"gemma3": Gemma3Head, "idefics3": Idefics3Head}
"""Projector type -> the head that maps the tower's patches to the text model's embeddings."""


class VisionTower:
    """An mmproj file loaded for `ops` (the text model's backend): `tiles(image)` -> the pixels of an image's tiles,
    `encode(pixels)` -> embeddings of each tile in the text model's space, ``[B, tokens_per_tile,
    projection_dim]`` float32."""

    def __init__(self, path: str | os.PathLike, ops, model=None):
        path = os.fspath(path)
        model = model or read_gguf(path, text_model=False)
        self.path = path
        self.config = c = VisionConfig.from_metadata(model.metadata, path)
        self.ops = ops
        t = TowerTensors(model, ops, path)
        self.patch_w = t.dense("v.patch_embd.weight").reshape(c.hidden, -1)  # [D, 3 * p * p] (conv as a matmul)
        self.patch_b = t.dense("v.patch_embd.bias") if t.has("v.patch_embd.bias") else None
        self.position = t.dense("v.position_embd.weight")  # [patches, D]
        self.blocks = []
        for i in range(c.layers):
            b = f"v.blk.{i}."
            self.blocks.append(_Block(
                (t.dense(b + "ln1.weight"), t.dense(b + "ln1.bias")),
                t.weight(b + "attn_q.weight", b + "attn_k.weight", b + "attn_v.weight"),
                torch.cat([t.dense(b + "attn_q.bias"), t.dense(b + "attn_k.bias"), t.dense(b + "attn_v.bias")]),
                t.weight(b + "attn_out.weight"), t.dense(b + "attn_out.bias"),
                (t.dense(b + "ln2.weight"), t.dense(b + "ln2.bias")),
                t.weight(b + "ffn_up.weight"), t.dense(b + "ffn_up.bias"),
                t.weight(b + "ffn_down.weight"), t.dense(b + "ffn_down.bias"),
            ))
        self.post_ln = (t.dense("v.post_ln.weight"), t.dense("v.post_ln.bias"))
        self.head = HEADS[c.projector](c, t, ops)

    @property
    def tokens_per_tile(self) -> int:
        """The embeddings of one tile (of one image, for a projector that does not cut images)."""
        return self.config.tokens_per_tile

    def preprocess(self, image) -> torch.Tensor:
        """Pixels ``[3, S, S]`` of a decoded RGB PIL image, as the HF Gemma 3 image processor makes them (bilinear
        resize to the tower's size, then mean/std from the file)."""
        from gpullama.vision.images import preprocess

        c = self.config
        return preprocess(image, c.image_size, c.mean, c.std, "bilinear")

    def tiles(self, image) -> tuple[torch.Tensor, int, int]:
        """The pixels ``[tiles, 3, S, S]`` of a decoded RGB PIL image as the model's HF image processor makes them,
        and the rows and columns of its tiles (0, 0: one tile, the whole image): gemma3 one resized image;
        idefics3 `idefics3_tiles` (Lanczos), then mean/std from the file."""
        from gpullama.vision.images import idefics3_tiles, normalise

        c = self.config
        if c.projector == "idefics3":
            tiles, rows, cols = idefics3_tiles(image, c.image_size, c.longest_edge)
            return torch.stack([normalise(t, c.mean, c.std) for t in tiles]), rows, cols
        return self.preprocess(image)[None], 0, 0

    def encode_images(self, images: list) -> list[tuple[torch.Tensor, int, int]]:
        """Each decoded RGB PIL image's embeddings ``[tiles, tokens_per_tile, projection_dim]`` and the rows and
        columns of its tiles (`tiles`), all tiles encoded in one batch."""
        cut = [self.tiles(image) for image in images]
        embeds = self.encode(torch.cat([pixels for pixels, _, _ in cut])).split([len(p) for p, _, _ in cut])
        return [(e, rows, cols) for e, (_, rows, cols) in zip(embeds, cut)]

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Embeddings ``[B, tokens_per_tile, projection_dim]`` float32 of preprocessed tiles ``[B, 3, S, S]``."""
        c, ops = self.config, self.ops
        pixels = pixels.to(self.position.device, torch.float32)
        b, p = pixels.shape[0], c.patch_size
        side = c.image_size // p
        # [B, 3, S, S] -> [B, side*side, 3*p*p] in the conv weight's (channel, row, column) order
        patches = pixels.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(b * side * side, -1)
        x = patches @ self.patch_w.t()
        if self.patch_b is not None:
            x = x + self.patch_b
        x = (x.view(b, side * side, c.hidden) + self.position).view(b * side * side, c.hidden)
        hd = c.hidden // c.heads
        n = side * side
        for blk in self.blocks:
            h = ops.layer_norm(x, *blk.ln1, c.eps)
            qkv = ops.linear(h, blk.qkv, blk.qkv_bias).view(b, n, 3, c.heads, hd).permute(2, 0, 3, 1, 4)
            a = ops.image_attention(qkv[0], qkv[1], qkv[2], 1.0 / math.sqrt(hd))
            a = a.permute(0, 2, 1, 3).reshape(b * n, c.hidden)
            x = x + ops.linear(a, blk.out, blk.out_bias)
            h = ops.gelu(ops.linear(ops.layer_norm(x, *blk.ln2, c.eps), blk.up, blk.up_bias), "tanh")
            x = x + ops.linear(h, blk.down, blk.down_bias)
        x = ops.layer_norm(x, *self.post_ln, c.eps)
        out = self.head(x, b, side, c, ops)
        return out.float().view(b, c.tokens_per_tile, c.projection_dim)


def _f32(tensor: torch.Tensor, name: str):
    from gguf import GGMLQuantizationType

    from gpullama.quants import QTensor

    return QTensor(tensor.contiguous(), GGMLQuantizationType.F32, tuple(tensor.shape), name)


"""The fused MoE kernel (grouped GEMMs over token-expert pairs sorted by expert, on GGUF blocks) against the torch
reference `TorchOps.moe` on the same experts; under the interpreter on small grids."""

from __future__ import annotations

import gguf
import pytest
import torch

from gpullama.kernels.fused_moe import align_pairs, fused_moe
from gpullama.ops import TorchOps
from gpullama.quants import QTensor
from tests.fixtures.quant_blocks import random_blocks, random_float_tensor

Q = gguf.GGMLQuantizationType
E, TOP_K, H, I = 4, 2, 64, 32


def experts(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, seed: int) -> QTensor:
    """E stacked random experts ``[E, rows, cols]`` of `qtype`."""
    if qtype in (Q.F32, Q.F16, Q.BF16):
        raw = torch.from_numpy(random_float_tensor(qtype, E * rows, cols, seed))
    else:
        raw = torch.from_numpy(random_blocks(qtype, E * rows, cols, seed))
    return QTensor(raw.reshape(E, rows, -1), qtype, (E, rows, cols))


def routing(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's TOP_K distinct experts (expert 2 unused) and weights."""
    g = torch.Generator().manual_seed(seed)
    choices = torch.tensor([0, 1, 3])
    ids = torch.stack([choices[torch.randperm(3, generator=g)[:TOP_K]] for _ in range(t)])
    return ids, torch.rand(t, TOP_K, generator=g)


def test_align_pairs_groups_and_pads_each_expert() -> None:
    ids = torch.tensor([[3, 0], [0, 1], [3, 0]])
    pairs, blocks = align_pairs(ids, 4, 4)
    p = ids.numel()
    assert pairs.numel() % 4 == 0 and blocks.numel() == pairs.numel() // 4
    runs = [pairs[4 * b : 4 * b + 4].tolist() for b in range(blocks.numel()) if blocks[b] >= 0]
    assert runs == [[1, 2, 5, p], [3, p, p, p], [0, 4, p, p]]  # experts 0, 1, 3 in pair order, padded
    assert blocks.tolist()[:3] == [0, 1, 3] and all(b == -1 for b in blocks.tolist()[3:])


@pytest.mark.parametrize(("qtype", "activation"), [
    (Q.Q8_0, "silu"), (Q.Q8_0, "swiglu_oai"), (Q.MXFP4, "swiglu_oai"), (Q.F16, "silu"), (Q.Q4_K, "silu"),
    (Q.Q8_0, "gelu_tanh"),
], ids=lambda v: getattr(v, "name", v))
def test_fused_moe_matches_torch(qtype, activation, device) -> None:
    """float32 compute, within 1e-5 of the reference; gpt-oss's biases and clamped SwiGLU, Gemma 4's GeGLU; an
    unused expert."""
    k_quant = qtype == Q.Q4_K
    h, i = (256, 256) if k_quant else (H, I)
    gate, up, down = experts(qtype, i, h, 1), experts(qtype, i, h, 2), experts(qtype, h, i, 3)
    g = torch.Generator().manual_seed(4)
    biases = (torch.randn(E, 2 * i, generator=g), torch.randn(E, h, generator=g)) if activation != "silu" else (None,
                                                                                                             None)
    x = torch.randn(5, h, generator=g)
    ids, weights = routing(5, 5)
    ref = TorchOps(torch.device("cpu"))
    want = ref.moe(x, ids, weights, ref.prepare_experts([gate, up], down, *biases, activation=activation))
    gate_up = QTensor(torch.cat([gate.data, up.data], dim=1), qtype, (E, 2 * i, h))
    on = [None if b is None else b.to(device) for b in biases]
    got = fused_moe(x.to(device), ids.to(device), weights.to(device), gate_up.to(device), down.to(device), *on,
                    activation=activation, block_m=16, block_n=64 if k_quant else 32, block_k=64)
    assert got.shape == want.shape
    assert ((got.cpu() - want).abs().max() / want.abs().max()).item() < 1e-5


def test_fused_moe_bf16_compute(device) -> None:
    """bfloat16 compute (inputs and weights rounded, as quant_linear does) within 1e-2."""
    gate, up, down = experts(Q.Q8_0, I, H, 6), experts(Q.Q8_0, I, H, 7), experts(Q.Q8_0, H, I, 8)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(9))
    ids, weights = routing(3, 10)
    ref = TorchOps(torch.device("cpu"))
    want = ref.moe(x, ids, weights, ref.prepare_experts([gate, up], down))
    gate_up = QTensor(torch.cat([gate.data, up.data], dim=1), Q.Q8_0, (E, 2 * I, H))
    got = fused_moe(x.to(device), ids.to(device), weights.to(device), gate_up.to(device), down.to(device),
                    compute_dtype=torch.bfloat16, block_m=16, block_n=32, block_k=32)
    assert ((got.cpu() - want).abs().max() / want.abs().max()).item() < 1e-2

"""Real-size shapes, too slow for the interpreter: run on CUDA only (`pytest -m gpu`)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gpullama.kernels.attention import paged_attention
from gpullama.kernels.quant_matmul import quant_linear
from gpullama.kernels.sampling import sample
from gpullama.ops import TorchOps
from gpullama.ops.triton_ops import TritonOps
from gpullama.quants import QTensor
from tests.fixtures.quant_blocks import random_blocks
from tests.kernel_tests.batches import make_batch, meta_to
from tests.kernel_tests.sampling_reference import sample_reference

Q = gguf.GGMLQuantizationType
CUDA = torch.device("cuda")
pytestmark = pytest.mark.gpu


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute error over the largest reference magnitude."""
    return float((got.double().cpu() - want.double().cpu()).abs().max() / want.abs().max())


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.Q5_0], ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 8, 64])
def test_llama_1b_projection_shapes(qtype, m):
    """A 2048-wide projection of Llama-3.2-1B in float32, against gguf's dequantizer and a float64 matmul."""
    n, k = 2048 + 16 * 3 + 5, 2048
    raw = random_blocks(qtype, n, k, seed=m)
    w_ref = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float64)).reshape(n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = quant_linear(x.to(CUDA), QTensor(torch.from_numpy(raw), qtype, (n, k)).to(CUDA), None, torch.float32)
    assert rel_err(out, x.double() @ w_ref.T) < 1e-5


@pytest.mark.parametrize("vocab", [49152, 151936])
def test_sampling_full_vocab(vocab):
    """Real vocab sizes: every filter against the sorting reference."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(4, vocab, generator=g) * 4
    params = dict(
        temperature=torch.tensor([0.0, 0.8, 1.0, 1.2]),
        top_k=torch.tensor([0, 50, 0, 40], dtype=torch.int32),
        top_p=torch.tensor([1.0, 1.0, 0.9, 0.95]),
        min_p=torch.tensor([0.0, 0.0, 0.0, 0.05]),
        uniform=torch.rand(4, generator=g),
    )
    got = sample(logits.to(CUDA), **{k: v.to(CUDA) for k, v in params.items()})
    assert got.cpu().tolist() == sample_reference(logits, **params).tolist()


def test_decode_attention_long_context_bf16():
    """Llama-3.2-1B heads (32 q / 8 kv, D 64) over 4000-token contexts in a bf16 pool."""
    meta = make_batch([4000, 1500, 17], [1, 1, 1], block_size=16, num_blocks=400)
    g = torch.Generator().manual_seed(0)
    pool = [torch.randn(400, 16, 8, 64, generator=g).bfloat16() for _ in range(2)]
    q = torch.randn(3, 32, 64, generator=g)
    want = TorchOps(torch.device("cpu")).attention(q, *pool, meta, 0.125)
    m = meta_to(meta, CUDA)
    got = paged_attention(q.to(CUDA), pool[0].to(CUDA), pool[1].to(CUDA), m.block_tables, m.seq_lens,
                          m.query_start_loc, 1, 0.125)
    assert rel_err(got, want) < 1e-2


def test_triton_ops_decode_step_captures_in_a_cuda_graph():
    """A TritonOps decode step (rope + paged write + attention + matmul) replays from a CUDA graph unchanged."""
    from gpullama.model import Decoder
    from tests.kernel_tests.random_model import batch_metadata, random_tensors, tiny_config

    config = tiny_config(num_layers=2, vocab_size=1000)
    decoder = Decoder(config, random_tensors(config, Q.Q4_K, CUDA), TritonOps(CUDA, torch.bfloat16), max_positions=64)
    pools = [torch.randn(8, 16, config.num_kv_heads, config.head_dim, device=CUDA) for _ in range(4)]
    meta = batch_metadata([30, 12], [1, 1], 16, CUDA)
    ids = torch.tensor([5, 7], device=CUDA)
    eager = decoder.forward(ids, meta, pools[:2], pools[2:]).clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decoder.forward(ids, meta, pools[:2], pools[2:])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decoder.forward(ids, meta, pools[:2], pools[2:])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)

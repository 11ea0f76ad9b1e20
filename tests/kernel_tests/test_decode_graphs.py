"""The decode step DecodeGraphs captures, with TritonOps: padded static buffers give the unpadded batch's logits, and
the captured region keeps the rules of a CUDA graph capture (checked on the CPU, where nothing else catches them)."""

from __future__ import annotations

import gguf
import pytest
import torch

from gpullama.engine.decode_graphs import DecodeGraphs
from gpullama.model import Decoder
from gpullama.ops.triton_ops import TritonOps
from tests.kernel_tests.capture_rules import CaptureRuleError, capture_rules
from tests.kernel_tests.random_model import batch_metadata, gpt_oss_like_config, random_tensors, tiny_config

Q = gguf.GGMLQuantizationType
BLOCK = 8
# embedding()'s token id range check runs only for CPU tensors (`ids.device.type == "cpu"`), never in a capture
CPU_ONLY_CHECKS = {"gpullama.kernels.embedding.embedding"}


def _decoder_with_context(device: torch.device, contexts: list[int], moe: bool = False) -> tuple[Decoder, list, list]:
    """A float32 TritonOps decoder and pools holding the prefilled k/v of sequences of `contexts` tokens, laid out
    as `batch_metadata` does (sequence i owns blocks i * per_seq ...), plus a scratch block last; `moe`: the
    gpt-oss-like MoE decoder (MXFP4 experts through the fused MoE kernel, sinks)."""
    if moe:
        config = gpt_oss_like_config(vocab_size=300)
        tensors = random_tensors(config, Q.Q8_0, torch.device("cpu"), seed=3, expert_qtype=Q.MXFP4)
    else:
        config = tiny_config(num_layers=2, vocab_size=300)
        tensors = random_tensors(config, Q.Q4_K, torch.device("cpu"), seed=3)
    tensors = {k: v.to(device) for k, v in tensors.items()}
    decoder = Decoder(config, tensors, TritonOps(device, torch.float32), max_positions=64)
    per_seq = -(-(max(contexts) + 1) // BLOCK)
    shape = (len(contexts) * per_seq + 1, BLOCK, config.num_kv_heads, config.head_dim)
    k = [torch.zeros(shape, device=device) for _ in range(config.num_layers)]
    v = [torch.zeros(shape, device=device) for _ in range(config.num_layers)]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (sum(contexts),), generator=g).to(device)
    decoder.forward(prompt, batch_metadata(contexts, contexts, BLOCK, device), k, v)
    return decoder, k, v


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_captured_decode_step_matches_the_unpadded_batch(device, moe):
    """3 sequences run at the ladder's padded size 4 with full-width block tables, as a replayed graph does: the
    same logits as a plain forward of the 3, and no host sync, host copy or off-device tensor in the region (the
    MoE routing and the pairs' alignment included)."""
    contexts = [5, 17, 9]
    decoder, k, v = _decoder_with_context(device, contexts, moe)
    new_ids = [11, 222, 33]
    meta = batch_metadata([c + 1 for c in contexts], [1, 1, 1], BLOCK, device)
    k_want, v_want = [x.clone() for x in k], [x.clone() for x in v]
    want = decoder.forward(torch.tensor(new_ids, device=device), meta, k_want, v_want)
    per_seq = meta.block_tables.shape[1]
    graphs = DecodeGraphs(decoder, k, v, max_num_seqs=4, max_blocks_per_seq=per_seq + 1,
                          scratch_block=k[0].shape[0] - 1, use_graphs=False)
    size, _ = graphs.load(new_ids, meta.positions.tolist(), meta.slot_mapping.tolist(), meta.block_tables.tolist())
    assert size == 4
    graphs.block_tables[:3, per_seq:] = 12345  # stale columns past a row's table must never be read
    with capture_rules(allow=CPU_ONLY_CHECKS):
        got = graphs.captured_forward(size)[:3]
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
    # the sequences' blocks hold what the plain forward wrote; the padded row wrote into the scratch block only
    scratch = graphs.scratch_block
    for got_pool, want_pool in zip(k + v, k_want + v_want):
        torch.testing.assert_close(got_pool[:scratch], want_pool[:scratch], rtol=1e-6, atol=1e-6)
        assert bool(want_pool[scratch].eq(0).all()) and bool(got_pool[scratch, 0].ne(0).any())


def test_capture_rules_catch_what_a_capture_refuses(device):
    """The checker itself: each forbidden call, made by code of the watched package, raises."""
    x = torch.ones(4, device=device)
    with capture_rules(packages=(__name__,)):
        torch.zeros(2, device=device)  # allowed: device given
        x.to(torch.float16)  # allowed: dtype only
        for forbidden in (lambda: x.sum().item(), lambda: bool(x.sum() > 0), lambda: x.tolist(),
                          lambda: torch.tensor([1, 2], device=device), lambda: torch.arange(3),
                          lambda: x.to("cpu"), lambda: x.cpu(), lambda: x.nonzero()):
            with pytest.raises(CaptureRuleError):
                forbidden()

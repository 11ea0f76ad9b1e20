"""TritonOps as a whole: a random decoder's prefill and decode logits against TorchOps on the same weights."""

from __future__ import annotations

import gguf
import pytest
import torch

from gpullama.model import Decoder
from gpullama.ops import TorchOps
from gpullama.ops.triton_ops import TritonOps
from tests.kernel_tests.random_model import (
    batch_metadata,
    gemma_like_config,
    gpt_oss_like_config,
    phi_granite_like_config,
    random_tensors,
    tiny_config,
)

Q = gguf.GGMLQuantizationType


def _prefill_then_decode(ops: TorchOps, tensors: dict, block_size: int = 8, config=None) -> list[torch.Tensor]:
    """Logits of a 2-sequence prefill (5 and 3 tokens) and of the decode step after it."""
    config = config or tiny_config()
    decoder = Decoder(config, tensors, ops, max_positions=64)
    pools = [torch.zeros(4, block_size, config.num_kv_heads, config.head_dim, device=ops.device) for _ in range(2 * config.num_layers)]
    k_caches, v_caches = pools[: config.num_layers], pools[config.num_layers :]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (8,), generator=g).to(ops.device)
    first = decoder.forward(prompt, batch_metadata([5, 3], [5, 3], block_size, ops.device), k_caches, v_caches)
    step = torch.randint(0, config.vocab_size, (2,), generator=g).to(ops.device)
    second = decoder.forward(step, batch_metadata([6, 4], [1, 1], block_size, ops.device), k_caches, v_caches)
    return [first.cpu(), second.cpu()]


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K], ids=lambda q: q.name)
def test_decoder_logits_match_torch_ops(qtype, device):
    """float32: every kernel chained through a layer and the head stays within 1e-4 of the torch path."""
    tensors = random_tensors(tiny_config(), qtype, torch.device("cpu"), seed=1)
    want = _prefill_then_decode(TorchOps(torch.device("cpu")), tensors)
    got = _prefill_then_decode(TritonOps(device), {k: v.to(device) for k, v in tensors.items()})
    for g, w in zip(got, want):
        assert float((g - w).abs().max() / w.abs().max()) < 1e-4


@pytest.mark.parametrize(("make_config", "fused"), [(gemma_like_config, False), (phi_granite_like_config, True)],
                         ids=["gemma-like", "phi-granite-like"])
def test_family_decoder_logits_match_torch_ops(make_config, fused, device):
    """The new families' flags (sliding windows shorter than the prompts, two rope tables, partial rotary, post-norms,
    GeGLU, soft-capping, the Granite multipliers, fused qkv / gate|up) chained through TritonOps equal TorchOps."""
    config = make_config()
    tensors = random_tensors(config, Q.Q8_0, torch.device("cpu"), seed=2, fused=fused)
    want = _prefill_then_decode(TorchOps(torch.device("cpu")), tensors, config=config)
    got = _prefill_then_decode(TritonOps(device), {k: v.to(device) for k, v in tensors.items()}, config=config)
    for g, w in zip(got, want):
        assert float((g - w).abs().max() / w.abs().max()) < 1e-4


def test_moe_decoder_logits_match_torch_ops(device):
    """gpt-oss's flags (MXFP4 experts through the fused MoE kernel, sinks, biases, YaRN, a window) chained through
    TritonOps equal TorchOps."""
    config = gpt_oss_like_config()
    tensors = random_tensors(config, Q.Q8_0, torch.device("cpu"), seed=3, expert_qtype=Q.MXFP4)
    want = _prefill_then_decode(TorchOps(torch.device("cpu")), tensors, config=config)
    got = _prefill_then_decode(TritonOps(device), {k: v.to(device) for k, v in tensors.items()}, config=config)
    for g, w in zip(got, want):
        assert float((g - w).abs().max() / w.abs().max()) < 1e-4


def test_image_rows_with_deepstack_and_interleaved_mrope_match_torch_ops(device):
    """Qwen3-VL's image rows (qwen3vl: q/k norms): embeddings in place of the tokens', each with two deepstack
    features added after layers 0 and 1, and each row's own interleaved M-RoPE cos|sin row, through TritonOps equal
    TorchOps; the deepstack features change the logits."""
    import dataclasses

    from gpullama.ops import rope_cos_sin
    from gpullama.ops.rope import mrope_axes, mrope_rows

    config = dataclasses.replace(tiny_config(num_layers=3), architecture="qwen3vl", qk_norm=True,
                                 rope_sections=(12, 10, 10), mrope_interleaved=True, deepstack_layers=2)
    tensors = random_tensors(config, Q.Q8_0, torch.device("cpu"), seed=4)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, config.vocab_size, (8,), generator=g)
    rows = torch.tensor([1, 2, 3, 5])
    embeds = torch.randn(4, config.input_embedding_size, generator=g)
    positions = torch.randint(0, 30, (3, 8), generator=g)
    table = mrope_rows(rope_cos_sin(config.head_dim, 64, config.rope_base), positions,
                       mrope_axes(config.rope_sections, True))

    def logits(ops, values):
        decoder = Decoder(config, {k: v.to(ops.device) for k, v in tensors.items()}, ops, max_positions=64)
        pools = [torch.zeros(4, 8, config.num_kv_heads, config.head_dim, device=ops.device) for _ in range(6)]
        meta = batch_metadata([5, 3], [5, 3], 8, ops.device)
        meta.input_embeds = (rows.to(ops.device), values.to(ops.device))
        meta.rope_table, meta.rope_index = table.to(ops.device), torch.arange(8, device=ops.device)
        return decoder.forward(prompt.to(ops.device), meta, pools[:3], pools[3:]).cpu()

    want = logits(TorchOps(torch.device("cpu")), embeds)
    got = logits(TritonOps(device), embeds)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    plain = embeds.clone()
    plain[:, config.hidden_size :] = 0
    assert float((logits(TorchOps(torch.device("cpu")), plain) - want).abs().max() / want.abs().max()) > 1e-2


def test_prepare_weight_keeps_gguf_blocks(device):
    """Kernel-readable quantized weights stay raw blocks of their GGUF size on the device."""
    tensors = random_tensors(tiny_config(num_layers=1), Q.Q4_K, torch.device("cpu"))
    weight = tensors["blk.0.ffn_up.weight"]
    prepared = TritonOps(device).prepare_weight(weight)
    assert prepared.qtype == Q.Q4_K and prepared.nbytes == weight.nbytes == 256 * 256 // 256 * 144
    assert prepared.device.type == device.type


def test_lora_rows_match_torch_ops(device):
    """A LoRA adapter on one of the batch's two sequences (q, v, down and the head): TritonOps' layer loop adds the
    same products as TorchOps' (float32, within 1e-4), the adapted sequence's logits move and the other's do not."""
    from gpullama.lora import LoraFile, prepare_lora
    from gpullama.ops.metadata import LoraGroup
    from gpullama.quants import QTensor

    config = tiny_config()
    tensors = random_tensors(config, Q.Q8_0, torch.device("cpu"), seed=4)
    g = torch.Generator().manual_seed(5)
    pairs = {}
    for name in ("blk.0.attn_q.weight", "blk.0.attn_v.weight", "blk.0.ffn_down.weight", "output.weight"):
        n, k = tensors[name].shape
        a, b = torch.randn(8, k, generator=g) * 0.1, torch.randn(n, 8, generator=g) * 0.1
        pairs[name] = (QTensor(a, Q.F32, (8, k)), QTensor(b, Q.F32, (n, 8)))

    def run(ops, tensors, with_lora: bool) -> torch.Tensor:
        decoder = Decoder(config, tensors, ops, max_positions=64)
        adapter = prepare_lora(decoder, LoraFile("random.gguf", "llama", 16.0, pairs), "random")
        pools = [torch.zeros(4, 8, config.num_kv_heads, config.head_dim, device=ops.device) for _ in range(2)]
        meta = batch_metadata([5, 3], [5, 3], 8, ops.device)
        if with_lora:  # sequence 0's five rows, its logits row 0
            dev = ops.device
            meta.lora = [LoraGroup(adapter, torch.arange(5, device=dev), torch.full((5,), 0.7, device=dev),
                                   torch.tensor([0], device=dev), torch.tensor([0.7], device=dev))]
        prompt = torch.randint(0, config.vocab_size, (8,), generator=torch.Generator().manual_seed(0))
        return decoder.forward(prompt.to(ops.device), meta, pools[:1], pools[1:]).cpu()

    cpu = torch.device("cpu")
    want, base = run(TorchOps(cpu), tensors, True), run(TorchOps(cpu), tensors, False)
    got = run(TritonOps(device), {k: v.to(device) for k, v in tensors.items()}, True)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-4
    assert float((want[0] - base[0]).abs().max()) > 1e-2 and torch.equal(want[1], base[1])


@pytest.fixture(scope="module")
def gemma4_moe_file(tmp_path_factory):
    """A tiny Gemma 4 with 2 of 4 experts (tests/test_converted_models.py's config: sliding and full layers of 16 and
    32 head dims, 2 KV-shared layers, per-layer embeddings), written as Q8_0 by llama.cpp's converter."""
    from transformers import AutoModelForCausalLM

    from tests.fixtures.llamacpp_source import convert_hf_to_gguf
    from tests.test_converted_models import CONFIGS, gemma4_tokenizer

    folder = tmp_path_factory.mktemp("gemma4-triton")
    tok = gemma4_tokenizer(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS["gemma4-moe"](vocab_size=len(tok), bos_token_id=2, eos_token_id=1,
                                                                   pad_token_id=0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.5 if "norm" in name else 0.08) + (1.0 if "norm" in name else 0))
    model.save_pretrained(folder)
    return convert_hf_to_gguf(folder, folder / "gemma4-q8_0.gguf", "--outtype", "q8_0")


def test_gemma4_decoder_logits_match_torch_ops(gemma4_moe_file, device):
    """Gemma 4 through TritonOps equals TorchOps: prefills longer than the 8-token window, then a decode step, over
    pools of two head dims (the KV-shared layers reading the producers' pools, Triton's transposed k blocks), the
    per-layer inputs and the GeGLU experts (TorchOps' dense experts beside the kernels)."""
    from gpullama.gguf_file import read_gguf

    gguf_model = read_gguf(str(gemma4_moe_file))
    c, tensors = gguf_model.config, gguf_model.tensors
    block_size = 8

    def run(ops: TorchOps, tensors: dict) -> list[torch.Tensor]:
        decoder = Decoder(c, tensors, ops, max_positions=64)
        pools = [[torch.zeros(6, block_size, c.layer_kv_heads(i), c.layer_head_dim(i), device=ops.device)
                  for i in c.kv_layers] for _ in range(2)]
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, c.vocab_size, (21,), generator=g).to(ops.device)
        first = decoder.forward(prompt, batch_metadata([12, 9], [12, 9], block_size, ops.device), *pools)
        step = torch.randint(0, c.vocab_size, (2,), generator=g).to(ops.device)
        second = decoder.forward(step, batch_metadata([13, 10], [1, 1], block_size, ops.device), *pools)
        return [first.cpu(), second.cpu()]

    want = run(TorchOps(torch.device("cpu")), tensors)
    got = run(TritonOps(device), {k: v.to(device) for k, v in tensors.items()})
    for g, w in zip(got, want):
        assert float((g - w).abs().max() / w.abs().max()) < 1e-4

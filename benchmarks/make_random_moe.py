"""Write a random-weight mixture-of-experts GGUF at Qwen3-30B-A3B's layer shapes: a decode benchmark's model.

    python benchmarks/make_random_moe.py --layers 16 --experts 32 --type q8_0 --out /tmp/qwen3moe-random.gguf

Qwen3-30B-A3B's layers as llama.cpp's converter writes them (architecture qwen3moe): hidden 2048, 32 query and 4
kv heads of 128 with q/k norms, experts of 768 rows of which 8 serve each token (stacked ``ffn_{gate,up,down}_exps``,
the router ``ffn_gate_inp`` F32), rope base 1e6. Fewer layers (48 in the model), experts (128) and vocabulary
(151,936) make it fit a small machine; what a token reads per layer (its 8 experts and the attention) is the
model's. Every matrix is random valid blocks of `--type` (`make_random_llama.random_matrix`), the tokenizer the
padded trained vocabulary of `make_random_llama`; the weights are noise, the text too: a file for timing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_random_llama import TYPES, padded_vocab, random_matrix  # noqa: E402

from tests.fixtures.vocabs import write_metadata  # noqa: E402

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERT_ROWS, USED = 2048, 32, 4, 128, 768, 8
"""Qwen3-30B-A3B's layer shapes."""


MXFP4_EXPONENTS = (119, 122)
"""MXFP4 exponent bytes drawn in [119, 122): scales 2^-9 .. 2^-7, a trained model's spread (random bytes would
give scales up to 2^127)."""


def random_mxfp4(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random MXFP4 blocks ``[rows, bytes per row]``: an exponent byte in `MXFP4_EXPONENTS`, 16 random code bytes."""
    blocks = rng.integers(0, 256, size=(rows * cols // 32, 17), dtype=np.uint8)
    blocks[:, 0] = rng.integers(*MXFP4_EXPONENTS, size=blocks.shape[0], dtype=np.uint8)
    return blocks.reshape(rows, -1)


def write_model(path: str, layers: int, experts: int, vocab: int, qtype: gguf.GGMLQuantizationType,
                seed: int = 0, expert_qtype: gguf.GGMLQuantizationType | None = None) -> None:
    """Write the model file: every matrix `qtype`, the experts `expert_qtype` (default `qtype`)."""
    expert_qtype = expert_qtype or qtype
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_name(f"random qwen3moe {layers}x{experts} {qtype.name} experts {expert_qtype.name}")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE if expert_qtype == Q.MXFP4 else
                         {Q.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_M, Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
                          Q.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K, Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
                          Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1}[qtype])
    writer.add_block_count(layers)
    writer.add_context_length(40960)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(6144)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(USED)
    writer.add_expert_feed_forward_length(EXPERT_ROWS)
    writer.add_vocab_size(vocab)
    write_metadata(writer, padded_vocab(vocab))

    def matrix(name: str, rows: int, cols: int, stack: int = 0) -> None:
        kind = expert_qtype if stack else qtype
        if kind == Q.MXFP4:
            blocks = random_mxfp4(rows * max(stack, 1), cols, rng)
        else:
            blocks = random_matrix(kind, rows * max(stack, 1), cols, rng)
        if stack:
            blocks = blocks.reshape(stack, rows, -1)
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)

    def floats(name: str, *shape: int, mean: float = 0.0, scale: float = 0.1) -> None:
        writer.add_tensor(name, (mean + scale * rng.standard_normal(shape)).astype(np.float32))

    matrix("token_embd.weight", vocab, HIDDEN)
    for i in range(layers):
        p = f"blk.{i}."
        floats(p + "attn_norm.weight", HIDDEN, mean=1.0)
        matrix(p + "attn_q.weight", HEADS * HEAD_DIM, HIDDEN)
        matrix(p + "attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        matrix(p + "attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        floats(p + "attn_q_norm.weight", HEAD_DIM, mean=1.0)
        floats(p + "attn_k_norm.weight", HEAD_DIM, mean=1.0)
        matrix(p + "attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
        floats(p + "ffn_norm.weight", HIDDEN, mean=1.0)
        floats(p + "ffn_gate_inp.weight", experts, HIDDEN, scale=0.02)
        matrix(p + "ffn_gate_exps.weight", EXPERT_ROWS, HIDDEN, stack=experts)
        matrix(p + "ffn_up_exps.weight", EXPERT_ROWS, HIDDEN, stack=experts)
        matrix(p + "ffn_down_exps.weight", HIDDEN, EXPERT_ROWS, stack=experts)
    floats("output_norm.weight", HIDDEN, mean=1.0)
    matrix("output.weight", vocab, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    """Write the file and print one line about it."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--type", choices=list(TYPES), default="q8_0", help="type of every matrix (routers stay F32)")
    p.add_argument("--expert-type", choices=[*TYPES, "mxfp4"], help="the experts' type (default --type; mxfp4: "
                   "gpt-oss's, with --type q8_0 as gpt-oss files ship the other matrices)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    expert_qtype = Q.MXFP4 if args.expert_type == "mxfp4" else TYPES.get(args.expert_type or args.type)
    write_model(args.out, args.layers, args.experts, args.vocab, TYPES[args.type], expert_qtype=expert_qtype)
    print(f"wrote {args.out}: {args.layers} layers x {args.experts} experts {args.type} "
          f"(experts {expert_qtype.name}), "
          f"{Path(args.out).stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

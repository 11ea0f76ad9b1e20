"""Write a random-weight Llama GGUF at real shapes (Llama-3.2-1B, 3B, Llama-3.1-8B) or tiny ones: a benchmark's
model, no download.

    python benchmarks/make_random_llama.py --shape llama-3.2-1b --type q4_k --out /tmp/llama-3.2-1b-q4_k.gguf
    python benchmarks/make_random_llama.py --shape llama-3.1-8b --type q4_k_m --out /tmp/llama-3.1-8b-q4_k_m.gguf

The architectures as llama.cpp writes them, Llama 3 rope scaling (rope_freqs.weight), context 131072, vocab 128256:
Llama-3.2-1B: 16 layers, hidden 2048, 32 query / 8 kv heads of 64, FFN 8192, tied embeddings (no output.weight);
Llama-3.2-3B: 28 layers, hidden 3072, 24 / 8 heads of 128, FFN 8192, tied; Llama-3.1-8B: 32 layers, hidden 4096,
32 / 8 heads of 128, FFN 14336, its own output.weight. Every matrix is random valid blocks of `--type`, or with
``--type q4_k_m`` of the type llama.cpp's `llama-quantize` gives it in a Q4_K_M file (`q4_k_m_type`: Q6_K for the
output head, or the tied embedding, and for attn_v and ffn_down of the layers `use_more_bits` picks; Q4_K for the
rest), with f16 scales giving weights a spread near 0.02 as in a trained model
(`tests/kernel_tests/random_model.SCALE_FIELDS`), so activations stay finite. The tokenizer is a small trained
Llama 3-style byte-level BPE (`tests/fixtures/vocabs.py`) padded with plain word tokens up to the vocab size, so
every id the random model emits decodes to text. The weights are noise, so the text is too: a file for timing.
``--shape smollm2-135m-tp`` has SmolLM2-135M's matrix shapes with heads that 2 tensor-parallel ranks divide
(`benchmarks/bench_tp.py`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.fixtures.vocabs import vocab_metadata, write_metadata  # noqa: E402
from tests.kernel_tests.random_model import SCALE_FIELDS  # noqa: E402

Q = gguf.GGMLQuantizationType
TYPES = {"q4_k": Q.Q4_K, "q8_0": Q.Q8_0, "q6_k": Q.Q6_K, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1}
Q4_K_M = "q4_k_m"
"""The mixture llama.cpp's Q4_K_M file type makes (`q4_k_m_type`), a `--type` beside the single types."""
# name -> (layers, hidden, heads, kv heads, head dim, FFN, vocab, context)
SHAPES = {
    "llama-3.2-1b": (16, 2048, 32, 8, 64, 8192, 128256, 131072),
    "llama-3.2-3b": (28, 3072, 24, 8, 128, 8192, 128256, 131072),
    "llama-3.1-8b": (32, 4096, 32, 8, 128, 14336, 128256, 131072),
    "tiny": (2, 256, 4, 2, 64, 512, 2048, 2048),
    # SmolLM2-135M's matrices (30 layers, hidden 576, q 576 x 576, k/v 192 x 576, FFN 1536, vocab 49152) cut into
    # 12 q / 4 KV heads of 48 instead of its 9 / 3 heads of 64, so that 2 tensor-parallel ranks divide them
    "smollm2-135m-tp": (30, 576, 12, 4, 48, 1536, 49152, 8192),
}
UNTIED = {"llama-3.1-8b"}
"""Shapes with an output head of their own (`output.weight`) rather than the token embedding's."""
# Llama 3.2's rope scaling (its config.json): factor, low / high frequency factors, original context
LLAMA3_ROPE = (32.0, 1.0, 4.0, 8192)


def random_matrix(qtype: gguf.GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid raw blocks ``[rows, bytes per row]`` of `qtype`, scales drawn from `SCALE_FIELDS`."""
    block, size = gguf.constants.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    blocks = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for offset, low, high in SCALE_FIELDS[qtype]:
        blocks[:, offset : offset + 2] = rng.uniform(low, high, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's `use_more_bits` (src/llama-quant.cpp): the first and last eighth of the layers, and every third
    one between them."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, layers: int, tied: bool) -> gguf.GGMLQuantizationType:
    """The type llama.cpp's quantizer gives tensor `name` of a Llama file in the Q4_K_M file type."""
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return Q.Q6_K
    if name.endswith((".attn_v.weight", ".ffn_down.weight")) and use_more_bits(int(name.split(".")[1]), layers):
        return Q.Q6_K
    return Q.Q4_K


def rope_factors(head_dim: int, base: float) -> np.ndarray:
    """`rope_freqs.weight` as llama.cpp's converter writes it for Llama 3 rope scaling (one factor per frequency)."""
    factor, low, high, old_ctx = LLAMA3_ROPE
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid)).astype(np.float32)


def padded_vocab(size: int) -> dict:
    """The trained llama-bpe vocabulary's tokenizer keys, padded with NORMAL word tokens up to `size` entries."""
    meta = vocab_metadata("llama-bpe")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    if size < len(tokens):
        raise ValueError(f"vocab size {size} is smaller than the trained vocabulary ({len(tokens)} tokens)")
    taken = set(tokens)
    i = 0
    while len(tokens) < size:
        word = f"\u0120w{i}"  # " w<i>" in the byte-level alphabet (\u0120 is the space)
        i += 1
        if word not in taken:
            tokens.append(word)
            types.append(int(gguf.TokenType.NORMAL))
    return meta


def write_model(path: str, shape: str, qtype: gguf.GGMLQuantizationType | str, seed: int = 0) -> int:
    """Write the model file (`qtype` one type for every matrix, or `Q4_K_M`); returns the bytes of its matrices
    (what one decode step reads, the head included: the token embedding's rows, when tied, or output.weight)."""
    layers, hidden, heads, kv_heads, head_dim, ffn, vocab, context = SHAPES[shape]
    tied = shape not in UNTIED
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"random {shape} {qtype if qtype == Q4_K_M else qtype.name}")
    writer.add_file_type({Q.Q4_K: gguf.LlamaFileType.MOSTLY_Q4_K_S, Q4_K_M: gguf.LlamaFileType.MOSTLY_Q4_K_M,
                          Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0, Q.Q6_K: gguf.LlamaFileType.MOSTLY_Q6_K,
                          Q.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0, Q.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1}[qtype])
    writer.add_block_count(layers)
    writer.add_context_length(context)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    write_metadata(writer, padded_vocab(vocab))
    matrix_bytes = 0

    def matrix(name: str, rows: int, cols: int, read: bool = True) -> None:
        nonlocal matrix_bytes
        kind = q4_k_m_type(name, layers, tied) if qtype == Q4_K_M else qtype
        blocks = random_matrix(kind, rows, cols, rng)
        writer.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
        matrix_bytes += blocks.nbytes if read else 0

    def norm(name: str) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden, read=tied)  # tied: also the output head (a decode step reads it)
    if not tied:
        matrix("output.weight", vocab, hidden)
    writer.add_tensor("rope_freqs.weight", rope_factors(head_dim, 500000.0))
    for i in range(layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        matrix(p + "attn_q.weight", heads * head_dim, hidden)
        matrix(p + "attn_k.weight", kv_heads * head_dim, hidden)
        matrix(p + "attn_v.weight", kv_heads * head_dim, hidden)
        matrix(p + "attn_output.weight", hidden, heads * head_dim)
        norm(p + "ffn_norm.weight")
        matrix(p + "ffn_gate.weight", ffn, hidden)
        matrix(p + "ffn_up.weight", ffn, hidden)
        matrix(p + "ffn_down.weight", hidden, ffn)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return matrix_bytes


def main(argv: list[str] | None = None) -> int:
    """Write the file and print one line about it."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=list(SHAPES), default="llama-3.2-1b")
    p.add_argument("--type", choices=[*TYPES, Q4_K_M], default="q4_k",
                   help="type of every matrix, or q4_k_m: llama.cpp's Q4_K_M mixture")
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    matrix_bytes = write_model(args.out, args.shape, TYPES.get(args.type, args.type), args.seed)
    print(f"wrote {args.out}: {args.shape} {args.type}, {Path(args.out).stat().st_size / 1e9:.2f} GB "
          f"({matrix_bytes / 1e9:.3f} GB of matrices) in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

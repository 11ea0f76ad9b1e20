"""Write a Q4_K_M-style GGUF at a real model's shapes, with random valid blocks: a speed benchmark's model.

    python benchmarks/make_mixed_gguf.py --like smollm2-135m --out /tmp/smollm2-135m-q4_k_m-random.gguf

Takes every metadata field (architecture, tokenizer, chat template) and every tensor's name and shape from the
`--like` file, and gives each matrix the type llama.cpp's Q4_K_M recipe gives it at those shapes: Q4_K, with
Q6_K for attn_v and ffn_down in the layers `use_more_bits` picks and for the output (or the tied embedding),
falling back to Q5_0 / Q8_0 where a row is not a whole number of 256-value super-blocks (SmolLM2's 576-wide rows).
The blocks are random but valid (`tests/fixtures/quant_blocks.py`); 1-D tensors (norms) are copied. The weights
are noise, so the text is too: it is a file for timing, not for reading.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpullama.hub import resolve_model  # noqa: E402
from tests.fixtures.quant_blocks import random_blocks  # noqa: E402

Q = gguf.GGMLQuantizationType
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}  # llama.cpp's choice when a row is not whole super-blocks


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's rule for the layers whose attn_v / ffn_down get Q6_K in Q4_K_M."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def q4_k_m_type(name: str, cols: int, n_layers: int, tied: bool) -> gguf.GGMLQuantizationType:
    """The type Q4_K_M gives matrix `name` whose rows are `cols` wide."""
    wanted = Q.Q4_K
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        wanted = Q.Q6_K
    elif name.endswith(("attn_v.weight", "ffn_down.weight")) and use_more_bits(int(name.split(".")[1]), n_layers):
        wanted = Q.Q6_K
    return wanted if cols % 256 == 0 else _FALLBACK[wanted]


def main() -> None:
    """Read the model to copy, write the random Q4_K_M-style file, print its type counts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", default="smollm2-135m", help="GGUF path or alias whose shapes and metadata to copy")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    reader = gguf.GGUFReader(resolve_model(args.like))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(args.out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    names = [t.name for t in reader.tensors]
    n_layers = 1 + max(int(n.split(".")[1]) for n in names if n.startswith("blk."))
    tied = "output.weight" not in names
    counts: collections.Counter = collections.Counter()
    for i, t in enumerate(reader.tensors):
        shape = [int(s) for s in reversed(t.shape.tolist())]  # rows, cols
        if len(shape) == 1:
            writer.add_tensor(t.name, np.array(t.data, dtype=np.float32))
            counts["F32"] += 1
            continue
        qtype = q4_k_m_type(t.name, shape[1], n_layers, tied)
        blocks = random_blocks(qtype, shape[0], shape[1], args.seed + i)
        writer.add_tensor(t.name, blocks, raw_shape=blocks.shape, raw_dtype=qtype)
        counts[qtype.name] += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.out}: " + ", ".join(f"{name} x{n}" for name, n in counts.most_common()))


if __name__ == "__main__":
    main()

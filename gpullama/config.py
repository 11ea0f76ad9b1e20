"""Model configuration read from GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    """The shape and numerics of a decoder, one set of flags covering llama, mistral, qwen2 and qwen3."""

    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_base: float
    rms_eps: float
    attention_bias: bool = False  # qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # qwen3: RMSNorm on each q and k head
    tied_embeddings: bool = False  # no output.weight: the embedding doubles as the output head
    permuted_qk: bool = False  # llama.cpp's converter interleaved the Q/K rows (llama architecture)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], path: str = "") -> "ModelConfig":
        """Read the config of the architecture named in ``general.architecture``."""
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{path}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"{path}: missing metadata key '{arch}.{key}'")
            return value

        hidden = int(get("embedding_length"))
        heads = int(get("attention.head_count"))
        kv_heads = get("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):  # some files store one count per layer
            kv_heads = kv_heads[0]
        head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = int(meta.get(f"{arch}.vocab_size") or (len(tokens) if tokens else 0))
        return cls(
            architecture=arch,
            num_layers=int(get("block_count")),
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            vocab_size=vocab,
            context_length=int(get("context_length", 2048)),
            rope_base=float(get("rope.freq_base", 10000.0)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            attention_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            permuted_qk=arch == "llama",
        )

"""How an embedding request turns the model's hidden states into one vector (vLLM's `PoolingParams`)."""

from __future__ import annotations

from dataclasses import dataclass

# GGUF's `{arch}.pooling_type` values (llama.cpp's enum llama_pooling_type)
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
POOLING_KINDS = ("mean", "cls", "last", "none")  # what an embedding can be pooled by (none: one vector per token)
RANK = "rank"  # a reranker's pooling: the last token's hidden state through the model's classification head


@dataclass
class PoolingParams:
    """An embedding request's options: `normalize` (L2-normalise the vector, the default, as the OpenAI API's
    embeddings are), `dimensions` (keep only the first N values, then renormalise: Matryoshka truncation, the
    OpenAI API's `dimensions`), `kind`: how the hidden states are pooled, mean, cls, last token, or none (one vector
    per token, never normalised: llama.cpp's ``--pooling none``), or `RANK` (a reranker's scores: the classification
    head's outputs, the first being the score; see `gpullama.rerank`); None, the model's
    (`ModelConfig.pooling_type`), which the engine sets."""

    normalize: bool = True
    dimensions: int | None = None
    kind: str | None = None

    def validate(self, hidden_size: int | None = None) -> None:
        """Check the fields; ValueError naming the field."""
        if not isinstance(self.normalize, bool):
            raise ValueError(f"PoolingParams.normalize must be a boolean, got {type(self.normalize).__name__}")
        if self.kind not in (*POOLING_KINDS, RANK):
            raise ValueError(f"PoolingParams.kind must be one of {(*POOLING_KINDS, RANK)}, got {self.kind!r}")
        d = self.dimensions
        if d is not None:
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise ValueError(f"PoolingParams.dimensions must be an integer >= 1, got {d!r}")
            if hidden_size is not None and d > hidden_size:
                raise ValueError(f"PoolingParams.dimensions must be at most the model's embedding size {hidden_size}, "
                                 f"got {d}")

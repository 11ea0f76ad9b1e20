"""Reranking: how a reranker's (query, document) pair becomes one prompt, as llama.cpp's server builds it, and how
vLLM's score API pairs its two text lists.

A reranker is a GGUF whose ``{arch}.pooling_type`` is 4 (rank) and that carries a classification head
(``cls.output.weight``): llama.cpp's converter writes Qwen3-Reranker so, its head the ``yes`` and ``no`` rows of the
language-model head (``{arch}.classifier.output_labels``), and its prompt as the named chat template
``tokenizer.chat_template.rerank`` with ``{query}`` and ``{document}`` in it. The prompt is `format_prompt_rerank`
of llama.cpp's ``tools/server/server-common.cpp``: that template with the two replaced (query first), tokenized with
special tokens parsed and no BOS added; without one (a BERT-style cross-encoder), ``[BOS] query [EOS] [SEP] document
[EOS]``, each of BOS, EOS and SEP as the vocabulary adds them, the texts tokenized as plain text. The score is the
head's first output (for Qwen3, the softmax of the yes/no logits of the last token: the probability of "yes").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

RERANK_TEMPLATE_KEY = "tokenizer.chat_template.rerank"


@dataclass(frozen=True)
class RerankFormat:
    """A reranker's prompt layout: its ``rerank`` template, else the BOS/EOS/SEP tokens around the two texts."""

    template: str | None
    bos: int | None
    eos: int | None
    sep: int | None
    add_bos: bool
    add_eos: bool
    add_sep: bool

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], tokenizer: Any) -> RerankFormat:
        """Read the ``rerank`` template and the special tokens (llama.cpp's fallback: SEP when there is no EOS)."""
        n = tokenizer.vocab_size

        def token(key: str) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            return int(value) if value is not None and 0 <= int(value) < n else None

        template = meta.get(RERANK_TEMPLATE_KEY)
        sep = token("seperator_token_id")  # gguf's spelling
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else sep
        return cls(template if isinstance(template, str) else None, tokenizer.bos_token_id, eos, sep,
                   tokenizer.add_bos_token, tokenizer.add_eos_token, bool(meta.get("tokenizer.ggml.add_sep_token")))

    def prompt_ids(self, tokenizer: Any, query: str, document: str) -> list[int]:
        """The token ids of one (query, document) pair."""
        if self.template is not None:
            text = self.template.replace("{query}", query).replace("{document}", document)
            return tokenizer.encode(text, add_special_tokens=False)
        ids: list[int] = []
        if self.add_bos and self.bos is not None:
            ids.append(self.bos)
        ids += tokenizer.encode_plain(query)
        if self.add_eos and self.eos is not None:
            ids.append(self.eos)
        if self.add_sep and self.sep is not None:
            ids.append(self.sep)
        ids += tokenizer.encode_plain(document)
        if self.add_eos and self.eos is not None:
            ids.append(self.eos)
        return ids


def score_pairs(text_1: list[str], text_2: list[str]) -> list[tuple[str, str]]:
    """vLLM's score pairing: one `text_1` against each of `text_2` (1:N), or the i-th with the i-th (N:N);
    ValueError for any other lengths or an empty list."""
    if not text_1 or not text_2:
        raise ValueError("At least one text element must be given in text_1 and in text_2")
    if len(text_1) == 1:
        return [(text_1[0], t) for t in text_2]
    if len(text_1) != len(text_2):
        raise ValueError(f"Input lengths must be either 1:1, 1:N or N:N; got {len(text_1)} text_1 and "
                         f"{len(text_2)} text_2")
    return list(zip(text_1, text_2))

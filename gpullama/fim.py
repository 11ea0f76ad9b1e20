"""Fill-in-the-middle: a vocabulary's FIM tokens and the infill prompt, laid out as llama.cpp's server lays it out.

The tokens come from the GGUF's ``tokenizer.ggml.fim_*_token_id`` keys (and the older ``prefix``/``suffix``/
``middle`` ones), else from the token names llama.cpp's vocabulary loader looks for (Qwen's ``<|fim_prefix|>``,
StarCoder's and Granite's ``<fim_prefix>``, DeepSeek's, CodeLlama's ``<PRE>``, ...). The layout is
`format_prompt_infill` of llama.cpp's ``tools/server/server-common.cpp`` (the repo-level pattern of Qwen2.5-Coder,
arXiv 2409.12186)::

    [FIM_REP]myproject\\n[FIM_SEP]{filename}\\n{text}...[FIM_SEP]filename\\n[FIM_PRE]{prefix}[FIM_SUF]{suffix}[FIM_MID]{prompt}

with its truncation: the prefix keeps its last 3/4 of a batch, the suffix its first quarter less the prompt, the
extra context the rest of the context after a batch and twice the tokens to predict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

FIM_ROLES = ("pre", "suf", "mid", "pad", "rep", "sep")

# llama.cpp's llama-vocab.cpp: the names each FIM token goes by, when the GGUF does not give its id
_NAMES: dict[str, tuple[str, ...]] = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
_OLD_KEYS = {"pre": "prefix_token_id", "suf": "suffix_token_id", "mid": "middle_token_id"}

N_BATCH = 2048
"""llama.cpp's default logical batch (``--batch-size``), which its infill truncation is measured in."""


@dataclass(frozen=True)
class FimTokens:
    """The FIM token ids of a vocabulary (None where it has none)."""

    pre: int | None = None
    suf: int | None = None
    mid: int | None = None
    pad: int | None = None
    rep: int | None = None
    sep: int | None = None

    @classmethod
    def from_metadata(cls, meta: dict[str, Any], tokens: Sequence[str]) -> FimTokens:
        """Read the ``tokenizer.ggml.fim_*`` keys, else find the tokens by name, as llama.cpp does."""
        n = len(tokens)
        found: dict[str, int] = {}
        for role in FIM_ROLES:
            for key in (f"tokenizer.ggml.fim_{role}_token_id", f"tokenizer.ggml.{_OLD_KEYS.get(role, '-')}"):
                value = meta.get(key)
                if value is not None and 0 <= int(value) < n:
                    found[role] = int(value)
                    break
        missing = {role: set(_NAMES[role]) for role in FIM_ROLES if role not in found}
        if missing:
            for i, token in enumerate(tokens):
                for role, names in missing.items():
                    if role not in found and token in names:
                        found[role] = i
        return cls(**found)

    @property
    def missing(self) -> list[str]:
        """Which of the three tokens infill needs (prefix, suffix, middle) the vocabulary lacks."""
        return [name for name, tid in (("prefix", self.pre), ("suffix", self.suf), ("middle", self.mid))
                if tid is None]

    @property
    def stop_ids(self) -> list[int]:
        """The tokens that end an infill (llama.cpp counts them as end of generation): pad, repo, file separator."""
        return [t for t in (self.pad, self.rep, self.sep) if t is not None]


@dataclass(frozen=True)
class ExtraChunk:
    """A file given as extra context (llama.cpp's ``input_extra`` item)."""

    text: str
    filename: str = "tmp"


_SNIPPET = "\n\n--- snippet ---\n\n"  # llama.cpp's separator of extra chunks when the vocabulary has no FIM_SEP


def infill_prompt(tokenizer: Any, fim: FimTokens, prefix: str, suffix: str, extra: Sequence[ExtraChunk] = (),
                  prompt: str = "", n_ctx: int = 4096, n_predict: int = -1, n_batch: int = N_BATCH) -> list[int]:
    """The token ids of an infill request (`prompt` follows the prefix; `extra` files come first), as llama.cpp's
    `format_prompt_infill` builds them. Prefix, suffix and extra text are tokenized as plain text (control-token
    names in them are not parsed), `prompt` with them parsed; BOS opens the FIM part when the vocabulary adds one."""
    if fim.missing:
        raise ValueError(f"infill is not supported by this model: its vocabulary has no FIM {', '.join(fim.missing)} "
                         "token")

    def plain(text: str) -> list[int]:
        return tokenizer.encode_plain(text)

    extra_ids: list[int] = []
    if fim.rep is not None:
        extra_ids += [fim.rep, *plain("myproject\n")]
    for chunk in extra:
        if fim.sep is not None:
            extra_ids += [fim.sep, *plain(chunk.filename + "\n")]
        else:
            extra_ids += plain(_SNIPPET)
        extra_ids += plain(chunk.text)
    if fim.sep is not None:
        extra_ids += [fim.sep, *plain("filename\n")]
    prefix_ids, suffix_ids, prompt_ids = plain(prefix), plain(suffix), tokenizer.encode(prompt)
    n_prefix = min(len(prefix_ids), 3 * (n_batch // 4))
    n_suffix = min(len(suffix_ids), max(0, n_batch // 4 - (2 + len(prompt_ids))))
    n_extra = min(max(0, n_ctx - n_batch - 2 * n_predict), len(extra_ids))
    head = [fim.pre, *prefix_ids[len(prefix_ids) - n_prefix:], *prompt_ids]
    if tokenizer.add_bos_token:
        head.insert(0, tokenizer.bos_token_id)
    return [*extra_ids[len(extra_ids) - n_extra:], *head, fim.suf, *suffix_ids[:n_suffix], fim.mid]

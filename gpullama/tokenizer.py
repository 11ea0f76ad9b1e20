"""A GGUF file's tokenizer, built on HF ``tokenizers`` from the file's ``tokenizer.*`` metadata."""

from __future__ import annotations

import logging
from collections.abc import Collection
from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer

from gpullama.chat_template import CHATML_TEMPLATE, ChatTemplate
from gpullama.fim import FimTokens

logger = logging.getLogger("gpullama")

# GGUF token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Byte-level split regexes. These are the regexes of the original tokenizer.json files, which transformers'
# GGUF converter uses too; llama.cpp (llama-vocab.cpp) spells the case-insensitive contractions as
# `'[sS]|'[tT]...` and approximates tekken's \p{Lu}/\p{Ll} classes with `(?=[\p{L}])[^a-z]` / `[^A-Z]`
# because its regex engine lacks them (so llama.cpp splits e.g. "Él" or "ÉCOLE" slightly differently).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k (GPT-4o; Phi-4-mini): tekken's case-aware words with English contractions attached, digits in threes.
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> (pre-tokenizer kind, ignore_merges, default add_bos). ignore_merges and the BOS default
# follow llama.cpp: for the Llama 3 family and tekken a word that is itself a token is emitted whole.
_PRE: dict[str, tuple[str, bool, bool]] = {
    **{name: ("llama3", True, True) for name in (
        "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")},
    **{name: ("llama3", False, False) for name in ("dbrx", "smaug-bpe")},
    **{name: ("qwen2", False, False) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")},
    "tekken": ("tekken", True, True),
    **{name: ("gpt-4o", False, False) for name in ("gpt-4o", "llama4")},
    # llama.cpp (and SmolLM2's own tokenizer.json) isolate every \p{N} character before the GPT-2 regex for
    # "smollm"; transformers' GGUF loader does not. SmolLM2's merges hold no digit, so the two differ only where a
    # space or a second numeric character precedes a non-ASCII numeric one (" ½", " ²"). The project requires
    # exact parity with transformers on SmolLM2, so "smollm" follows transformers; the rest follow llama.cpp.
    "smollm": ("gpt2", False, False),
    **{name: ("digits+gpt2", False, False) for name in (
        "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b")},
    **{name: ("gpt2", False, False) for name in ("gpt2", "gpt-2", "mpt", "olmo", "jais", "phi-2", "trillion")},
    "default": ("default", False, False),
}

# Token texts llama.cpp treats as end-of-generation wherever they are in the vocabulary (its EOG set).
_EOG_TEXTS = (
    "<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "</s>", "<EOT>", "_<EOT>", "<｜end▁of▁sentence｜>", "<|end▁of▁sentence|>", "<end_of_utterance>",
    "<|return|>", "<|call|>", "<turn|>", "<|tool_response>",  # the last two Gemma 4's (as llama.cpp)
)


@lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[dict[int, str], dict[str, int]]:
    """GPT-2's reversible byte <-> printable-unicode map, both ways."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars, {c: b for b, c in chars.items()}


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp applies for `tokenizer.ggml.pre` (split regexes, then the byte map)."""
    kind = _PRE[pre][0]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)

    def split(regex: str) -> pre_tokenizers.PreTokenizer:
        return pre_tokenizers.Split(Regex(regex), behavior="isolated")

    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "digits+gpt2":
        # llama.cpp: every numeric character alone, then the GPT-2 regex (transformers omits the digit split).
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if kind == "default":
        # llama.cpp's fallback for BPE vocabularies without a known pre-tokenizer. transformers uses the plain
        # GPT-2 regex here instead, so the two differ on punctuation runs and digit runs longer than three.
        return pre_tokenizers.Sequence([
            split(r"[\p{P}\$\+<=>\^~\|]+"), split(_GPT2_SPLIT), split(r"\p{N}+"), split(r"[0-9][0-9][0-9]"),
            byte_level,
        ])
    regex = {"llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT, "tekken": _TEKKEN_SPLIT, "gpt-4o": _GPT4O_SPLIT}[kind]
    return pre_tokenizers.Sequence([split(regex), byte_level])


def _parse_merges(merges: list[str]) -> list[tuple[str, str]]:
    out = []
    for index, merge in enumerate(merges):
        left, sep, right = merge.partition(" ")
        if not sep or not left or not right:
            raise ValueError(f"tokenizer.ggml.merges[{index}] = {merge!r} is not two tokens separated by a space")
        out.append((left, right))
    return out


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by the vocabulary: every split of a token into two tokens, best score first.

    Ties are ordered as transformers orders them (longer left piece first, then token id), so both build the
    same model.
    """
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    found = []
    for token, i in ids.items():
        score = scores[i]
        pairs = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids]
        pairs.sort(key=lambda p: (ids[p[0]], ids[p[1]]))
        found.extend((left, right, score) for left, right in pairs)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


class Tokenizer:
    """Encode/decode text with a GGUF vocabulary and render its chat template."""

    def __init__(self, backend: _HFTokenizer, meta: dict[str, Any]) -> None:
        self._tk = backend
        self._model: str = meta["tokenizer.ggml.model"]
        self._tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        n = len(self._tokens)
        self._types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * n)
        self.vocab_size: int = n
        self.bos_token_id: int | None = _token_id(meta, "bos_token_id", n)
        self.eos_token_id: int | None = _token_id(meta, "eos_token_id", n)
        self.bos_token: str = self._tokens[self.bos_token_id] if self.bos_token_id is not None else ""
        self.eos_token: str = self._tokens[self.eos_token_id] if self.eos_token_id is not None else ""
        # Without tokenizer.ggml.add_bos_token: BOS for SentencePiece, and (as llama.cpp) for the Llama 3 family
        # and tekken byte-level vocabularies; none for other byte-level ones. Never when there is no BOS token.
        pre = meta.get("tokenizer.ggml.pre", "default")
        default_bos = self._model in ("llama", "gemma4") or (self._model == "gpt2" and _PRE.get(pre, ("", False, False))[2])
        default_bos = default_bos and self.bos_token_id is not None
        self.add_bos_token: bool = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
        self.add_eos_token: bool = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        if self.add_bos_token and self.bos_token_id is None:
            raise ValueError("tokenizer.ggml.add_bos_token is set but tokenizer.ggml.bos_token_id is missing")
        if self.add_eos_token and self.eos_token_id is None:
            raise ValueError("tokenizer.ggml.add_eos_token is set but tokenizer.ggml.eos_token_id is missing")
        self.special_token_ids: set[int] = {i for i, t in enumerate(self._types) if t in (CONTROL, USER_DEFINED)}
        # the tokens the backend holds as special (see _add_special_tokens): the ones skip_special_tokens drops
        self._skipped_ids = frozenset(i for i, t in enumerate(self._types) if t in (CONTROL, UNKNOWN))
        self.eos_token_ids: set[int] = self._eog_ids(meta)
        self.fim: FimTokens = FimTokens.from_metadata(meta, self._tokens)
        self._token_bytes: list[bytes] | None = None
        self._plain_tk: _HFTokenizer | None = None

        source = meta.get("tokenizer.chat_template")
        if not source:
            logger.warning("GGUF has no tokenizer.chat_template; falling back to a ChatML template")
            source = CHATML_TEMPLATE
        self.has_chat_template: bool = bool(meta.get("tokenizer.chat_template"))
        extra = {}
        for key, name in (("unknown_token_id", "unk_token"), ("padding_token_id", "pad_token")):
            tid = _token_id(meta, key, n)
            if tid is not None:
                extra[name] = self._tokens[tid]
        self.chat_template = ChatTemplate(source, self.bos_token, self.eos_token, **extra)

    @classmethod
    def from_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build the tokenizer from GGUF metadata (key -> python value); ValueError on a missing or unknown part."""
        model = meta.get("tokenizer.ggml.model")
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
        types = meta.get("tokenizer.ggml.token_type")
        if types is not None and len(types) != len(tokens):
            raise ValueError(
                f"tokenizer.ggml.token_type has {len(types)} entries but tokenizer.ggml.tokens has {len(tokens)}"
            )
        meta = _render_harmony_markers(meta)
        if model == "gpt2":
            backend = _build_byte_level(meta)
        elif model in ("llama", "gemma4"):
            backend = _build_sentencepiece(meta)
        else:
            raise ValueError(f"unsupported tokenizer.ggml.model {model!r}; supported: 'gpt2', 'llama', 'gemma4'")
        return cls(backend, meta)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in it are parsed. BOS/EOS added as the GGUF says."""
        ids = self._tk.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos_token:
                ids = [self.bos_token_id, *ids]
            if self.add_eos_token:
                ids = [*ids, self.eos_token_id]
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with control-token names in it read as plain text (llama.cpp's
        ``parse_special=false``); user-defined tokens are still parsed whole, and no BOS or EOS is added."""
        if self._plain_tk is None:  # a copy of the backend, so that encode() keeps parsing them
            plain = _HFTokenizer.from_str(self._tk.to_str())
            plain.encode_special_tokens = True
            self._plain_tk = plain
        return self._plain_tk.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False,
               preserved_token_ids: Collection[int] = ()) -> str:
        """Text of `ids` (invalid UTF-8 becomes U+FFFD); optionally without control tokens, except those in
        `preserved_token_ids`."""
        ids = list(ids)
        if skip_special_tokens and preserved_token_ids:
            # what skipping does (the backend drops its special tokens before decoding), less the preserved ones
            keep = set(preserved_token_ids)
            ids = [i for i in ids if i in keep or i not in self._skipped_ids]
            skip_special_tokens = False
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        """The vocabulary's own strings of `ids` (such as ``Ġthe``), as transformers' method of that name."""
        return [self._tokens[i] for i in ids]

    def token_bytes(self, id: int) -> bytes:
        """Raw bytes of one token (byte-level map undone, `<0xNN>` as its byte, `▁` as a space)."""
        if self._token_bytes is None:
            self._token_bytes = self._all_token_bytes()
        if not 0 <= id < self.vocab_size:
            raise ValueError(f"token id {id} out of range [0, {self.vocab_size})")
        return self._token_bytes[id]

    def token_to_str(self, id: int) -> str:
        """Text of one token as it appears in decoded output; partial UTF-8 shows as U+FFFD."""
        return self.token_bytes(id).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **extra: Any) -> str:
        """Prompt text for a conversation, rendered with the GGUF's chat template (or the ChatML fallback)."""
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra)

    def _all_token_bytes(self) -> list[bytes]:
        if self._model == "gpt2":
            _, decoder = _byte_alphabet()
            out = []
            for token, kind in zip(self._tokens, self._types):
                if kind in (CONTROL, USER_DEFINED) or not all(c in decoder for c in token):
                    out.append(token.encode("utf-8"))
                else:
                    out.append(bytes(decoder[c] for c in token))
            return out
        out = []
        for token, kind in zip(self._tokens, self._types):
            if kind == BYTE and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                out.append(bytes([int(token[3:5], 16)]))
            else:
                out.append(token.replace("\u2581", " ").encode("utf-8"))
        return out

    def _eog_ids(self, meta: dict[str, Any]) -> set[int]:
        ids = {self.eos_token_id}
        for key in ("eot_token_id", "eom_token_id"):
            ids.add(_token_id(meta, key, self.vocab_size))
        wanted = set(_EOG_TEXTS)
        if {"<|return|>", "<|call|>"} <= set(self._tokens):  # gpt-oss (as llama.cpp): <|end|> closes a message,
            wanted.discard("<|end|>")  # the answer ends at <|return|> or <|call|>
        ids.update(i for i, t in enumerate(self._tokens) if t in wanted)
        ids.discard(None)
        return ids  # type: ignore[return-value]


# gpt-oss's harmony markers that llama.cpp always renders in output text (as user-defined tokens)
_RENDERED_MARKERS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def _render_harmony_markers(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with gpt-oss's channel markers typed user-defined (kept in decoded text, parsed whole), as llama.cpp
    does, so the text shows which channel said what; other vocabularies unchanged."""
    tokens, types = meta.get("tokenizer.ggml.tokens"), meta.get("tokenizer.ggml.token_type")
    if not types or "<|channel|>" not in tokens or "<|message|>" not in tokens:
        return meta
    marked = set(_RENDERED_MARKERS)
    types = [USER_DEFINED if t in marked and k == CONTROL else k for t, k in zip(tokens, types)]
    return {**meta, "tokenizer.ggml.token_type": types}


def _token_id(meta: dict[str, Any], key: str, n: int) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is None:
        return None
    value = int(value)
    if not 0 <= value < n:
        raise ValueError(f"tokenizer.ggml.{key} = {value} is outside the vocabulary of {n} tokens")
    return value


def _add_special_tokens(tk: _HFTokenizer, tokens: list[str], types: list[int], specials: set[int]) -> None:
    """Control/unknown tokens become special added tokens, user-defined ones plain added tokens (parsed whole)."""
    special = [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(specials)]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    if special:
        tk.add_special_tokens(special)
    if user:
        tk.add_tokens(user)


def _build_byte_level(meta: dict[str, Any]) -> _HFTokenizer:
    """GPT-2 style byte-level BPE from tokens + merges, with the pre-tokenizer named by tokenizer.ggml.pre."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE:
        raise ValueError(f"unsupported tokenizer.ggml.pre {pre!r} for a gpt2 (byte-level BPE) vocabulary; "
                         f"supported: {sorted(_PRE)}")
    if "tokenizer.ggml.merges" not in meta:
        raise ValueError("gpt2 (byte-level BPE) vocabulary has no tokenizer.ggml.merges")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    alphabet = set(_byte_alphabet()[1])
    spell = _byte_alphabet()[0]
    vocab: dict[str, int] = {}
    for i, (token, kind) in enumerate(zip(tokens, types)):
        # Special tokens keep their text (they are matched in raw text); any other token not written in the
        # byte alphabet is respelled in it, as transformers does.
        if kind not in (CONTROL, USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spell[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    ignore_merges = _PRE[pre][1]
    model = models.BPE(vocab, _parse_merges(meta["tokenizer.ggml.merges"]), dropout=None,
                       continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                       byte_fallback=False, ignore_merges=ignore_merges)
    tk = _HFTokenizer(model)
    tk.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tk.decoder = decoders.ByteLevel()
    specials = {i for i, k in enumerate(types) if k in (CONTROL, UNKNOWN)}
    _add_special_tokens(tk, tokens, types, specials)
    return tk


def _build_sentencepiece(meta: dict[str, Any]) -> _HFTokenizer:
    """SentencePiece BPE (scores, `<0xNN>` byte fallback, `▁` for spaces) as a `tokenizers` BPE model; Gemma 4's
    (`gemma4`: merges, no space prefix) the same, its text split at runs of newlines first.

    Spaces become `▁` and, with tokenizer.ggml.add_space_prefix (default true), each run of text gets a `▁`
    prepended -- including text right after a special token and text that already starts with a space. That is
    what llama.cpp and sentencepiece do. transformers' GGUF LlamaTokenizer uses `Metaspace(prepend_scheme="first")`
    instead, which prepends only at the very start of the input and never before an existing leading space, so
    it differs on "  two leading spaces" and on text following a special token (transformers does the same as
    us for architecture "phi3").
    """
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if "tokenizer.ggml.merges" in meta:
        merges = _parse_merges(meta["tokenizer.ggml.merges"])
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise ValueError("llama (SentencePiece) vocabulary needs tokenizer.ggml.scores, one per token "
                             "(or tokenizer.ggml.merges)")
        merges = _merges_from_scores(tokens, scores)
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    unk_id = _token_id(meta, "unknown_token_id", len(tokens))
    model = models.BPE(vocab, merges, dropout=None, fuse_unk=True, byte_fallback=True,
                       unk_token=tokens[unk_id] if unk_id is not None else None)
    tk = _HFTokenizer(model)
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Replace(" ", "\u2581")]
    if add_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tk.normalizer = normalizers.Sequence(steps)
    # Gemma 4's (llama.cpp's gemma4 pre-tokenizer): the merges run on each run of newlines and of other text apart
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("\n+"), "isolated") if meta["tokenizer.ggml.model"] == "gemma4" \
        else None
    chain = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        chain.append(decoders.Strip(" ", 1, 0))
    tk.decoder = decoders.Sequence(chain)
    specials = {i for i, k in enumerate(types) if k in (CONTROL, UNKNOWN)}
    _add_special_tokens(tk, tokens, types, specials)
    return tk

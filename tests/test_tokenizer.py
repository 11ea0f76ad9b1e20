"""Tokenizer parity with transformers' GGUF tokenizer on small trained vocabularies and the real SmolLM2 file."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import gguf
import pytest
import transformers
from transformers.convert_slow_tokenizer import bytes_to_unicode

from gpullama.tokenizer import Tokenizer
from tests.fixtures.vocabs import KINDS, SENTENCEPIECE_KINDS, spm_model, vocab_metadata, write_tokenizer_gguf

BYTE_LEVEL_KINDS = [k for k in KINDS if k not in SENTENCEPIECE_KINDS]
# The architecture a vocabulary's reference tokenizer is built for (transformers picks its SentencePiece builder by
# architecture: Gemma's rebuilds merges from the token order and respells whitespace tokens).
REFERENCE_ARCH = {"gemma-spm": "gemma3"}

# ---------------------------------------------------------------------------------------------------------------
# Corpus: varied strings (code, numbers, whitespace runs, accents, CJK, emoji, special tokens inside text).
# ---------------------------------------------------------------------------------------------------------------
_BASE = [
    # plain prose
    "Hello world",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, there was a little girl who lived in a village near the forest.",
    "Machine learning models learn patterns from data.",
    "What's the weather like today? It's sunny, isn't it?",
    "I'm sure you'll see that we've done it; they're here and she's gone, I'd say.",
    "DON'T STOP, IT'S LATE. WE'VE GOT TO GO. YOU'LL SEE. I'D LIKE THAT.",
    "iPhone McDonald XMLHttpRequest getHTTPResponseCode CamelCaseNames snake_case_names kebab-case-names",
    "a",
    "A",
    "ab",
    "the",
    "The",
    "THE",
    "supercalifragilisticexpialidocious",
    "antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
    "To be, or not to be, that is the question.",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore.",
    "Mr. Smith went to Washington D.C. on Jan. 5th, e.g. for a meeting, i.e. work.",
    # numbers
    "0",
    "7",
    "42",
    "123",
    "1234",
    "12345",
    "123456789012345678901234567890",
    "3.14159265358979",
    "-273.15",
    "+1 (555) 123-4567",
    "1,000,000 and 1.000.000 and 1 000 000",
    "2024-01-31T12:30:45Z",
    "v1.2.3-rc.4+build.567",
    "0x1F 0b1010 0o777 1e-10 6.02e23",
    "Room 101, floor 7, building 3A, zip 90210.",
    "The year 1969 had 365 days; 2024 had 366.",
    "x1 y22 z333 w4444 v55555",
    "１２３ full-width digits ４５６",
    "٣٤٥ Arabic-Indic digits and ४५६ Devanagari digits",
    "Ⅻ roman numeral ½ ¾ ² ³ superscripts",
    # whitespace
    " leading space",
    "  two leading spaces",
    "   three leading spaces",
    "trailing space ",
    "trailing spaces   ",
    " ",
    "  ",
    "     ",
    "\t",
    "\n",
    "\n\n",
    "\r\n",
    "line one\nline two",
    "line one\n\nline three",
    "para\n\n\n\nend",
    "windows\r\nline\r\nendings",
    "tab\tseparated\tvalues",
    "double\t\ttab",
    "mixed \t \n whitespace \n\t ",
    "a  b   c    d     e",
    " \n leading newline with space",
    "\n\nstarts with newlines",
    "ends with newlines\n\n",
    "space before newline \nand after\n next",
    "\u00a0non-breaking\u00a0space",
    "thin\u2009space and\u3000ideographic space",
    "zero\u200bwidth\u200bspace",
    # code
    "def encode(text: str) -> list[int]:\n    return [ord(c) for c in text]\n",
    "class Tokenizer:\n    def __init__(self):\n        self.vocab = {}\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\n",
    "if (x != null && y >= 0 || z <= -1) { return x ?? y; }",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%smith%' ORDER BY id DESC;",
    "const f = (a, b) => a + b; let s = `template ${f(1, 2)}`;",
    "fn main() { let v: Vec<u8> = vec![1, 2, 3]; println!(\"{:?}\", v); }",
    "<html><body><p class=\"x\">Some <b>bold</b> text &amp; entities &lt; &gt;</p></body></html>",
    "{\"name\": \"gpullama\", \"version\": \"0.1.0\", \"list\": [1, 2, 3], \"ok\": true, \"none\": null}",
    "x = [i**2 for i in range(10) if i % 2 == 0]  # squares of evens",
    "    indented four\n        indented eight\n\tindented tab",
    "$ ls -la | grep '^d' > /dev/null 2>&1 && echo ok",
    "https://example.com/path/to/page?query=value&other=1#anchor",
    "user@example.org, admin+tag@sub.domain.co.uk",
    "C:\\Users\\name\\Documents\\file.txt",
    "/usr/local/bin/python3 -m pytest -q tests/",
    "a_b__c___d",
    "--flag=value -x -vvv --no-color",
    "@decorator\ndef f(*args, **kwargs): ...",
    "#!/usr/bin/env bash\nset -euo pipefail\n",
    "key: value\nlist:\n  - one\n  - two\n",
    "| col1 | col2 |\n|------|------|\n| a    | b    |",
    # punctuation
    "!!!",
    "???!!!...",
    "...",
    "—",
    "- - -",
    "(parenthesis) [brackets] {braces} <angles>",
    "\"double quotes\" 'single quotes' `backticks`",
    "“curly quotes” ‘single curly’ «guillemets» „low quotes“",
    "semi;colon:colon,comma.period",
    "a+b=c; a-b=d; a*b=e; a/b=f; a%b=g; a^b=h",
    "~tilde ^caret |pipe \\backslash",
    "§ ¶ † ‡ • … ‰ ′ ″ ‹ › ⁂",
    "→ ← ↑ ↓ ⇒ ⇔ ∀ ∃ ∈ ∉ ∑ ∏ ∫ √ ∞ ≈ ≠ ≤ ≥",
    "© ® ™ € £ ¥ ¢ $ ₹ ₽ ₿",
    # accents and other scripts
    "Café, naïve, façade, résumé, jalapeño, Über, straße, señor, déjà vu.",
    "Él está aquí. ÉCOLE NORMALE. Ça va? Ñandú. Øresund. Ærø.",
    "e\u0301 (e + combining acute) vs é (precomposed)",
    "Привет, мир! Как дела?",
    "ПРИВЕТ МИР",
    "Γειά σου κόσμε. ΑΒΓΔ αβγδ",
    "Merhaba dünya. Witaj świecie. Ahoj světe. Sveika pasaule.",
    "שלום עולם",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "Xin chào thế giới",
    "ქართული ენა",
    "Հայերեն լեզու",
    # CJK
    "你好，世界。",
    "我喜欢学习语言模型。",
    "今天天气很好，我们去公园吧！",
    "東京は日本の首都です。",
    "こんにちは、世界！カタカナ ひらがな",
    "안녕하세요 세계",
    "中文English混合text",
    "数字123和汉字",
    "「引用」『二重引用』【括弧】",
    "漢字かなカナ한글",
    # emoji and symbols
    "😀",
    "😀😃😄",
    "🤖 🚀 🎉",
    "👍🏽 skin tone",
    "👨‍👩‍👧‍👦 family ZWJ sequence",
    "❤️ heart with variation selector",
    "🇫🇷🇩🇪🇯🇵 flags",
    "emoji😀inside😃words",
    "🙂🙃 🫠 newer emoji",
    "★☆✓✗☐☑",
    "♠♣♥♦ ♪♫",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 𝒮𝒸𝓇𝒾𝓅𝓉",
    "\U0001F600\U0001F4A9\U0001F9E0",
    # control-ish characters
    "bell\x07char",
    "null\x00byte",
    "escape\x1b[31mred\x1b[0m",
    "del\x7fchar",
    "form\x0cfeed and vertical\x0btab",
    "replacement \ufffd char",
    "BOM\ufeffinside",
    # mixed
    "The price is $19.99 (or €17,50) — a 15% discount!",
    "Call me at 555-0100 between 9am–5pm, Mon–Fri.",
    "Temperature: -5°C / 23°F; humidity 80%.",
    "H₂O, CO₂, E=mc², x⁰ x¹",
    "¿Dónde está la biblioteca? ¡Aquí!",
    "Ich möchte ein Stück Kuchen, bitte.",
    "Le cœur a ses raisons que la raison ne connaît point.",
    "日本語とEnglishと123と😀",
    "RT @user: Check this out! #hashtag #AI http://t.co/abc123",
    "<<<>>> <<>> <>",
    "''''''",
    "\"\"\"docstring\"\"\"",
    "it's its it''s it'''s",
    "'s 't 're 've 'm 'll 'd",
    "'S 'T 'RE 'VE 'M 'LL 'D",
    "he's She'S THEY'RE",
    "don’t (curly apostrophe)",
]

# Special tokens of the test vocabularies (and SmolLM2) written inside text.
_SPECIALS = [
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>",
    "text before <|im_end|> text after",
    "<|im_end|><|im_end|>",
    "<|im_start|><|im_start|>x",
    "<|endoftext|>",
    "prefix<|endoftext|>suffix",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>",
    "<|eot_id|> after eot",
    "<s>[INST] What is 2+2? [/INST] 4</s>",
    "<s> spaced bos",
    "a<s>b </s> c",
    "[INST]no spaces[/INST]",
    "<think>reasoning here</think>answer",
    "<|tool|> tool call",
    "<|im_start",
    "im_end|>",
    "< |im_start| >",
    "<repo_name>gpullama<file_sep>main.py",
    "<|fim_prefix|>def f():<|im_end|>",
    "<unk> unknown",
    "<s>",
    "</s>",
]


def _corpus() -> list[str]:
    """At least 200 varied strings; variants add leading spaces, newlines and special tokens around some."""
    strings = list(_BASE) + list(_SPECIALS)
    for s in _BASE[::4]:
        strings.append(" " + s)
    for s in _BASE[1::7]:
        strings.append(s + "\n" + s.upper())
    for s in _BASE[2::9]:
        strings.append("<|im_start|>" + s + "<|im_end|>")
    seen: set[str] = set()
    return [s for s in strings if not (s in seen or seen.add(s))]


CORPUS = _corpus()


def _mismatches(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    return [f"{s!r}: got {got[s]!r}, want {want[s]!r}" for s in want if got[s] != want[s]]


def _load_hf(path: Path) -> Any:
    """transformers' tokenizer for a GGUF file (the reference)."""
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def hf_vocab(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Factory `hf_vocab(kind, architecture=REFERENCE_ARCH or "llama")`: transformers' tokenizer for a
    tokenizer-only GGUF."""
    root = tmp_path_factory.mktemp("vocab_ggufs")
    built: dict[tuple[str, str], Any] = {}

    def get(kind: str, architecture: str | None = None) -> Any:
        architecture = architecture or REFERENCE_ARCH.get(kind, "llama")
        if (kind, architecture) not in built:
            path = root / f"{kind}-{architecture}.gguf"
            write_tokenizer_gguf(str(path), vocab_metadata(kind), architecture)
            built[kind, architecture] = _load_hf(path)
        return built[kind, architecture]

    return get


@pytest.fixture(scope="session")
def ours() -> Any:
    """Factory `ours(kind)`: our Tokenizer for a fixture vocabulary, built once."""
    built: dict[str, Tokenizer] = {}

    def get(kind: str) -> Tokenizer:
        if kind not in built:
            built[kind] = Tokenizer.from_metadata(vocab_metadata(kind))
        return built[kind]

    return get


def _read_tokenizer_metadata(path: Path) -> dict[str, Any]:
    reader = gguf.GGUFReader(str(path), "r")
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


@pytest.fixture(scope="module")
def smollm2(default_model_path: Path, hf_tokenizer) -> tuple[Tokenizer, Any, dict[str, Any]]:
    """(ours, transformers', metadata) for the real SmolLM2-135M-Instruct GGUF."""
    meta = _read_tokenizer_metadata(default_model_path)
    return Tokenizer.from_metadata(meta), hf_tokenizer, meta


def _assert_parity(tok: Tokenizer, ref: Any, strings: list[str]) -> None:
    """encode (with and without special tokens) and decode equal transformers' on every string."""
    for add in (False, True):
        got = {s: tok.encode(s, add_special_tokens=add) for s in strings}
        want = {s: ref.encode(s, add_special_tokens=add) for s in strings}
        bad = _mismatches(got, want)
        assert not bad, f"encode(add_special_tokens={add}) differs on {len(bad)} strings:\n" + "\n".join(bad[:10])
    for skip in (False, True):
        got = {s: tok.decode(want_ids, skip_special_tokens=skip) for s, want_ids in
               ((s, ref.encode(s, add_special_tokens=True)) for s in strings)}
        want = {s: ref.decode(ref.encode(s, add_special_tokens=True), skip_special_tokens=skip) for s in strings}
        bad = _mismatches(got, want)
        assert not bad, f"decode(skip_special_tokens={skip}) differs on {len(bad)} strings:\n" + "\n".join(bad[:10])


def test_corpus_is_large_and_varied() -> None:
    assert len(CORPUS) >= 200
    assert any("\t" in s for s in CORPUS) and any("😀" in s for s in CORPUS) and any("你" in s for s in CORPUS)
    assert any(s.startswith(" ") for s in CORPUS) and any("<|im_start|>" in s for s in CORPUS)


# ---------------------------------------------------------------------------------------------------------------
# Byte-level BPE vocabularies: exact parity with transformers.
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", BYTE_LEVEL_KINDS)
def test_byte_level_matches_transformers(kind: str, ours: Any, hf_vocab: Any) -> None:
    # llama-bpe and tekken use llama.cpp's ignore_merges (a pre-token that is itself a token is kept whole);
    # transformers' GGUF loader does not, but on vocabularies trained by BPE both give the same tokens here.
    tok, ref = ours(kind), hf_vocab(kind)
    strings = CORPUS
    if "<|endoftext|>" not in vocab_metadata(kind)["tokenizer.ggml.tokens"]:
        # transformers' GPT2Tokenizer adds its default "<|endoftext|>" as a new token past the GGUF vocabulary
        # (id == vocab_size) when the file has none; a model cannot take that id, so we leave such text as text.
        assert ref.convert_tokens_to_ids("<|endoftext|>") == tok.vocab_size
        strings = [s for s in CORPUS if "<|endoftext|>" not in s]
    _assert_parity(tok, ref, strings)
    assert max(i for s in CORPUS for i in tok.encode(s, add_special_tokens=True)) < tok.vocab_size


@pytest.mark.parametrize("kind", KINDS)
def test_token_bytes_and_str(kind: str, ours: Any, hf_vocab: Any) -> None:
    tok, ref = ours(kind), hf_vocab(kind)
    assert tok.vocab_size == len(vocab_metadata(kind)["tokenizer.ggml.tokens"])
    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
    for i in range(tok.vocab_size):
        piece = ref.convert_ids_to_tokens(i)
        if kind in SENTENCEPIECE_KINDS:
            want = bytes([int(piece[3:5], 16)]) if piece.startswith("<0x") else piece.replace("▁", " ").encode()
        elif i in tok.special_token_ids:
            want = piece.encode()
        else:
            want = bytes(byte_decoder[c] for c in piece)
        assert tok.token_bytes(i) == want, (i, piece)
        if kind not in SENTENCEPIECE_KINDS:  # (the SentencePiece decoder strips the leading space of a lone token)
            assert tok.token_to_str(i) == ref.decode([i]), (i, piece)
    with pytest.raises(ValueError, match="out of range"):
        tok.token_bytes(tok.vocab_size)


@pytest.mark.parametrize("kind", BYTE_LEVEL_KINDS)
def test_decode_keeps_only_the_preserved_special_tokens(kind: str, ours: Any, hf_vocab: Any) -> None:
    """skip_special_tokens with preserved_token_ids: the preserved control token's text stays where it was, every
    other control token goes (transformers' skipping decode of the parts around it, joined by the token's text)."""
    tok, ref = ours(kind), hf_vocab(kind)
    types = vocab_metadata(kind)["tokenizer.ggml.token_type"]
    control = [i for i, t in enumerate(types) if t == 3]
    keep = control[-1]
    for s in CORPUS[:40]:
        ids = ref.encode(s, add_special_tokens=True)
        half = len(ids) // 2
        before, after = ids[:half] + control[:2], control[:1] + ids[half:]
        got = tok.decode(before + [keep] + after, skip_special_tokens=True, preserved_token_ids=[keep])
        want = ref.decode(before, skip_special_tokens=True) + ref.decode([keep]) + \
            ref.decode(after, skip_special_tokens=True)
        assert got == want
        assert tok.decode(ids, skip_special_tokens=True, preserved_token_ids=[keep]) == \
            ref.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("kind", KINDS)
def test_special_tokens_and_ids(kind: str, ours: Any, hf_vocab: Any) -> None:
    tok, ref, meta = ours(kind), hf_vocab(kind), vocab_metadata(kind)
    types = meta["tokenizer.ggml.token_type"]
    assert tok.special_token_ids == {i for i, t in enumerate(types) if t in (3, 4)}
    # transformers adds every control / user-defined token (plus the unknown token) as an added token
    unk = {i for i, t in enumerate(types) if t == 2}
    # ... except Gemma's runs of spaces, which it respells as `▁` pieces and reaches by merges (we, llama.cpp and
    # sentencepiece match them whole in the text)
    spaces = {i for i, t in enumerate(meta["tokenizer.ggml.tokens"]) if t.isspace() and types[i] == 4}
    # (ids past the GGUF vocabulary are transformers' invented "<|endoftext|>", see above)
    assert tok.special_token_ids | unk == {i for i in ref.added_tokens_decoder if i < tok.vocab_size} | spaces
    assert (tok.bos_token, tok.eos_token) == (ref.bos_token, ref.eos_token)
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert tok.eos_token_id in tok.eos_token_ids
    for name in ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>"):
        if name in meta["tokenizer.ggml.tokens"]:
            assert ref.convert_tokens_to_ids(name) in tok.eos_token_ids, name
    if "<|im_start|>" in meta["tokenizer.ggml.tokens"]:
        assert ref.convert_tokens_to_ids("<|im_start|>") not in tok.eos_token_ids


def test_gpt2_pre_tokenizer_matches_transformers(tmp_path: Path) -> None:
    # "gpt2" is the plain GPT-2 regex in llama.cpp and transformers alike.
    meta = vocab_metadata("gpt2-smollm") | {"tokenizer.ggml.pre": "gpt2"}
    ref = _load_hf(Path(write_tokenizer_gguf(str(tmp_path / "gpt2.gguf"), meta)))
    _assert_parity(Tokenizer.from_metadata(meta), ref, CORPUS)


def test_default_pre_tokenizer_follows_llama_cpp() -> None:
    # llama.cpp's fallback for BPE without a known pre-tokenizer isolates punctuation runs and splits digit runs
    # into groups of three (transformers uses the GPT-2 regex instead, a known difference).
    meta = vocab_metadata("gpt2-smollm") | {"tokenizer.ggml.pre": "default"}
    tok = Tokenizer.from_metadata(meta)
    pieces = [p for p, _ in tok._tk.pre_tokenizer.pre_tokenize_str("x 12345!? ok")]
    assert pieces == ["x", "Ġ", "123", "45", "!?", "Ġok"]


# ---------------------------------------------------------------------------------------------------------------
# SentencePiece (llama) vocabulary.
# ---------------------------------------------------------------------------------------------------------------
def test_spm_matches_transformers_with_llama_cpp_space_prefix(ours: Any, hf_vocab: Any) -> None:
    # We follow llama.cpp / sentencepiece: `▁` is prepended to every run of raw text (also after a special token,
    # also when it already starts with a space). transformers builds exactly that for architecture "phi3"
    # (normalizer Prepend + Replace), so that is the reference for the whole corpus.
    _assert_parity(ours("llama-spm"), hf_vocab("llama-spm", "phi3"), CORPUS)


def test_spm_known_difference_from_transformers_llama(ours: Any, hf_vocab: Any) -> None:
    # transformers' GGUF LlamaTokenizer uses Metaspace(prepend_scheme="first"): it adds `▁` only at the very start
    # and not before an existing leading space. On every other string it agrees with us.
    tok, ref = ours("llama-spm"), hf_vocab("llama-spm")
    specials = [t for i, t in enumerate(vocab_metadata("llama-spm")["tokenizer.ggml.tokens"])
                if i in tok.special_token_ids or t == "<unk>"]
    plain = [s for s in CORPUS if not s[:1].isspace() and not any(t in s for t in specials)]
    assert len(plain) > 150
    _assert_parity(tok, ref, plain)
    # llama.cpp's rule, stated with the reference: text after a special token is encoded as if it started a prompt
    bos = tok.bos_token_id
    for left, right in (("a", "b c"), ("Hello", "world"), ("x", "y\nz")):
        want = ref.encode(left, add_special_tokens=False) + [bos] + ref.encode(right, add_special_tokens=False)
        assert tok.encode(f"{left}<s>{right}") == want
        assert ref.encode(f"{left}<s>{right}", add_special_tokens=False) != want  # transformers: no `▁` after <s>
    # ... and a leading space still gets the prefix (transformers: only when the text has no leading `▁` yet)
    for text in ("  two", " one", "\u2581x"):
        assert tok.encode(text) == ref.encode("\u2581" + text, add_special_tokens=False)


def test_gemma_spm_matches_sentencepiece(ours: Any) -> None:
    # Gemma's own tokenizer is SentencePiece: the trained model is the oracle (text holding no special token, which
    # sentencepiece would not parse). Runs of spaces are user-defined pieces, matched whole.
    tok, sp = ours("gemma-spm"), spm_model("gemma-spm")
    specials = [t for i, t in enumerate(vocab_metadata("gemma-spm")["tokenizer.ggml.tokens"])
                if (i in tok.special_token_ids and not t.isspace()) or t == "<unk>"]
    plain = [s for s in CORPUS if not any(t in s for t in specials)]
    assert len(plain) > 200 and any("   " in s for s in plain)
    bad = [f"{s!r}: got {tok.encode(s)}, want {sp.encode(s)}" for s in plain if tok.encode(s) != sp.encode(s)]
    assert not bad, f"{len(bad)} strings differ from sentencepiece:\n" + "\n".join(bad[:10])
    assert tok.encode("hi", add_special_tokens=True)[0] == tok.bos_token_id == 2  # BOS added, no space prefix
    assert tok.decode(tok.encode(" a  b")) == sp.decode(sp.encode(" a  b")) == " a  b"


def test_gemma_spm_matches_transformers_but_long_space_runs(ours: Any, hf_vocab: Any) -> None:
    # transformers' Gemma builder reaches runs of spaces through merges (rebuilt from the token order); it agrees
    # with sentencepiece except on runs longer than the longest space piece (4 here): five spaces are `▁▁▁▁ ▁` for
    # sentencepiece (leftmost longest piece) and `▁▁ ▁▁▁` for transformers.
    tok, ref = ours("gemma-spm"), hf_vocab("gemma-spm")
    plain = [s for s in CORPUS if "     " not in s]
    assert len(plain) > 200
    _assert_parity(tok, ref, plain)
    assert tok.encode("a     b") == spm_model("gemma-spm").encode("a     b") != ref.encode("a     b")


def test_spm_without_space_prefix(ours: Any) -> None:
    meta = vocab_metadata("llama-spm") | {"tokenizer.ggml.add_space_prefix": False}
    tok = Tokenizer.from_metadata(meta)
    spm = ours("llama-spm")
    assert tok.encode("Hello world") != spm.encode("Hello world")  # no `▁` before "Hello"
    assert tok.encode(" Hello world") == spm.encode("Hello world")
    assert tok.decode(tok.encode(" Hello world")) == " Hello world"


def test_spm_byte_fallback(ours: Any, hf_vocab: Any) -> None:
    tok = ours("llama-spm")
    ids = tok.encode("ꙮ")  # not in the vocabulary: three <0xNN> byte tokens after the ▁
    assert [tok._tokens[i] for i in ids[-3:]] == ["<0xEA>", "<0x99>", "<0xAE>"]
    assert b"".join(tok.token_bytes(i) for i in ids) == " ꙮ".encode()
    assert tok.decode(ids) == hf_vocab("llama-spm").decode(ids) == "ꙮ"


# ---------------------------------------------------------------------------------------------------------------
# BOS / EOS defaults and errors.
# ---------------------------------------------------------------------------------------------------------------
def test_add_special_tokens_defaults() -> None:
    spm = vocab_metadata("llama-spm")
    del spm["tokenizer.ggml.add_bos_token"]
    tok = Tokenizer.from_metadata(spm)
    assert tok.encode("hi", add_special_tokens=True)[0] == tok.bos_token_id  # SentencePiece: BOS by default
    qwen = vocab_metadata("qwen2")
    del qwen["tokenizer.ggml.add_bos_token"]
    tok = Tokenizer.from_metadata(qwen)
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")  # byte-level: no BOS unless asked
    eos = vocab_metadata("qwen2") | {"tokenizer.ggml.add_eos_token": True}
    tok = Tokenizer.from_metadata(eos)
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi") + [tok.eos_token_id]


def test_bad_metadata_raises_value_error() -> None:
    meta = vocab_metadata("qwen2")
    with pytest.raises(ValueError, match="'wordpiece'"):
        Tokenizer.from_metadata(meta | {"tokenizer.ggml.model": "wordpiece"})
    with pytest.raises(ValueError, match="'no-such-pre'"):
        Tokenizer.from_metadata(meta | {"tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens"):
        Tokenizer.from_metadata(meta | {"tokenizer.ggml.tokens": []})
    with pytest.raises(ValueError, match="token_type"):
        Tokenizer.from_metadata(meta | {"tokenizer.ggml.token_type": [1, 1]})
    with pytest.raises(ValueError, match=r"merges\[1\]"):
        Tokenizer.from_metadata(meta | {"tokenizer.ggml.merges": ["a b", "ab"]})
    with pytest.raises(ValueError, match="eos_token_id = 99999"):
        Tokenizer.from_metadata(meta | {"tokenizer.ggml.eos_token_id": 99999})
    spm = vocab_metadata("llama-spm")
    del spm["tokenizer.ggml.scores"]
    with pytest.raises(ValueError, match="scores"):
        Tokenizer.from_metadata(spm)


# ---------------------------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct vocabulary (gpt2 BPE, pre "smollm"): exact parity with transformers.
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2: tuple[Tokenizer, Any, dict[str, Any]]) -> None:
    tok, ref, _ = smollm2
    _assert_parity(tok, ref, CORPUS)
    assert tok.vocab_size == 49152
    assert (tok.bos_token, tok.eos_token) == (ref.bos_token, ref.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert not tok.add_bos_token


@pytest.mark.slow
def test_smollm2_eos_and_special_ids(smollm2: tuple[Tokenizer, Any, dict[str, Any]]) -> None:
    tok, ref, meta = smollm2
    im_end, endoftext = ref.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert im_end == 2 == tok.eos_token_id
    assert tok.eos_token_ids == {im_end, endoftext}  # llama.cpp's EOG set for this vocabulary
    assert tok.special_token_ids == set(ref.added_tokens_decoder) == set(range(17))
    for i in (0, 1, 2, 17, 28, 1345, 49151):
        assert tok.token_to_str(i) == ref.decode([i])


@pytest.mark.slow
def test_smollm2_chat_template_matches_transformers(smollm2: tuple[Tokenizer, Any, dict[str, Any]]) -> None:
    tok, ref, _ = smollm2
    assert tok.has_chat_template
    chats = [
        [{"role": "user", "content": "Hi!"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}],
    ]
    for chat in chats:
        for gen in (True, False):
            want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(chat, add_generation_prompt=gen) == want
            assert tok.encode(want) == ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen,
                                                               return_dict=False)


@pytest.mark.slow
def test_smollm2_builds_fast(smollm2: tuple[Tokenizer, Any, dict[str, Any]]) -> None:
    _, _, meta = smollm2
    start = time.perf_counter()
    Tokenizer.from_metadata(meta)
    # about 0.12 s on one free core; the bound leaves room for a loaded 2-core machine
    assert time.perf_counter() - start < 1.5


def test_no_chat_template_falls_back_to_chatml(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gpullama"):
        tok = Tokenizer.from_metadata(vocab_metadata("qwen2"))
    assert "ChatML" in caplog.text and not tok.has_chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_add_bos_default_follows_llama_cpp_for_llama3_family() -> None:
    meta = vocab_metadata("llama-bpe")
    del meta["tokenizer.ggml.add_bos_token"]
    tok = Tokenizer.from_metadata(meta)
    assert tok.encode("hi", add_special_tokens=True) == [tok.bos_token_id, *tok.encode("hi")]
    del meta["tokenizer.ggml.bos_token_id"]
    assert Tokenizer.from_metadata(meta).encode("hi", add_special_tokens=True) == tok.encode("hi")
    with pytest.raises(ValueError, match="bos_token_id is missing"):
        Tokenizer.from_metadata(meta | {"tokenizer.ggml.add_bos_token": True})

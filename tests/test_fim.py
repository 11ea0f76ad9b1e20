"""Fill-in-the-middle without a server: the FIM tokens a vocabulary names (GGUF keys, else llama.cpp's token names)
and the infill prompt, token by token in the order llama.cpp's `format_prompt_infill` builds it, each piece
tokenized by transformers (the reference tokenizer)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpullama.fim import ExtraChunk, FimTokens, infill_prompt
from gpullama.tokenizer import Tokenizer
from tests.fixtures.vocabs import QWEN_FIM_TOKENS, vocab_metadata, write_tokenizer_gguf


@pytest.fixture(scope="module")
def coder(tmp_path_factory: pytest.TempPathFactory):
    """(our tokenizer, transformers' tokenizer) of the Qwen2.5-Coder-style test vocabulary."""
    import transformers

    path = write_tokenizer_gguf(str(tmp_path_factory.mktemp("fim") / "coder.gguf"), vocab_metadata("qwen2-coder"),
                               architecture="qwen2")
    ours = Tokenizer.from_metadata(vocab_metadata("qwen2-coder"))
    ref = transformers.AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
    return ours, ref


def _plain(ref, text: str) -> list[int]:
    """transformers' ids of `text` with special-token names read as text (llama.cpp's parse_special=false)."""
    return ref(text, add_special_tokens=False, split_special_tokens=True).input_ids


def test_fim_tokens_come_from_the_gguf_keys_else_from_llama_cpp_names(coder):
    ours, ref = coder
    ids = {t: ref.convert_tokens_to_ids(t) for t in QWEN_FIM_TOKENS}
    assert ours.fim == FimTokens(pre=ids["<|fim_prefix|>"], suf=ids["<|fim_suffix|>"], mid=ids["<|fim_middle|>"],
                                 pad=ids["<|fim_pad|>"], rep=ids["<|repo_name|>"], sep=ids["<|file_sep|>"])
    meta = vocab_metadata("qwen2-coder")
    keyless = {k: v for k, v in meta.items() if "fim_" not in k}
    assert FimTokens.from_metadata(keyless, meta["tokenizer.ggml.tokens"]) == ours.fim  # found by name
    # a key wins over the names; StarCoder's and CodeLlama's spellings; SmolLM2 has only a repo token
    assert FimTokens.from_metadata({**keyless, "tokenizer.ggml.fim_pre_token_id": 5}, meta["tokenizer.ggml.tokens"]).pre == 5
    assert FimTokens.from_metadata({}, ["a", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]) == \
        FimTokens(pre=1, suf=3, mid=2, pad=4)
    assert FimTokens.from_metadata({}, ["▁<PRE>", "▁<SUF>", "▁<MID>"]).missing == []
    smol = FimTokens.from_metadata({}, ["<|endoftext|>", "<repo_name>", "<reponame>", "<file_sep>"])
    assert smol == FimTokens(rep=2) and smol.missing == ["prefix", "suffix", "middle"]


def test_infill_prompt_is_llama_cpp_layout_with_input_extra(coder):
    """[REP]myproject\\n [SEP]name\\n text ... [SEP]filename\\n [PRE]prefix prompt [SUF]suffix [MID]: llama.cpp's
    order (the prompt follows the prefix, as its code does); specials written in the code stay plain text."""
    ours, ref = coder
    fim = ours.fim
    prefix, suffix, prompt = "def add(a, b):\n    <|fim_middle|>", "\n\nprint(add(1, 2))\n", "    return"
    extra = [ExtraChunk("import math\n", "util.py"), ExtraChunk("x = 1\n")]
    want = [fim.rep, *_plain(ref, "myproject\n"),
            fim.sep, *_plain(ref, "util.py\n"), *_plain(ref, "import math\n"),
            fim.sep, *_plain(ref, "tmp\n"), *_plain(ref, "x = 1\n"),
            fim.sep, *_plain(ref, "filename\n"),
            fim.pre, *_plain(ref, prefix), *ref.encode(prompt, add_special_tokens=False),
            fim.suf, *_plain(ref, suffix), fim.mid]
    assert infill_prompt(ours, fim, prefix, suffix, extra, prompt, n_ctx=4096) == want
    assert "<|fim_middle|>" in ref.decode(want[want.index(fim.pre):])  # the one in the code, as text


def test_infill_prompt_truncates_as_llama_cpp(coder):
    """Prefix: its last 3/4 batch; suffix: its first batch/4 - 2 - len(prompt); extra: what the context leaves after
    a batch and 2 * n_predict (n_ctx - n_batch + 2 with n_predict -1); no repo tokens: the snippet separator."""
    ours, ref = coder
    fim = ours.fim
    prefix = "".join(f"line {i}\n" for i in range(40))
    suffix = "".join(f"tail {i}\n" for i in range(40))
    p_ids, s_ids = _plain(ref, prefix), _plain(ref, suffix)
    n_batch = 64
    got = infill_prompt(ours, fim, prefix, suffix, [ExtraChunk("x = 1\n", "a.py")], "", n_ctx=64, n_batch=n_batch,
                        n_predict=1)
    assert got == [fim.pre, *p_ids[-48:], fim.suf, *s_ids[:14], fim.mid]
    got = infill_prompt(ours, fim, prefix, suffix, [], "", n_ctx=64, n_batch=n_batch)  # n_predict -1: 2 extra
    assert got == [*_plain(ref, "filename\n")[-2:], fim.pre, *p_ids[-48:], fim.suf, *s_ids[:14], fim.mid]
    extra = [fim.rep, *_plain(ref, "myproject\n"), fim.sep, *_plain(ref, "a.py\n"), *_plain(ref, "x = 1\n"),
             fim.sep, *_plain(ref, "filename\n")]
    got = infill_prompt(ours, fim, "a", "b", [ExtraChunk("x = 1\n", "a.py")], "", n_ctx=n_batch + 7, n_batch=n_batch,
                        n_predict=1)
    assert got[:5] == extra[-5:] and got[5] == fim.pre
    no_repo = FimTokens(pre=fim.pre, suf=fim.suf, mid=fim.mid)
    got = infill_prompt(ours, no_repo, "a", "b", [ExtraChunk("x = 1\n", "a.py")], "", n_ctx=4096)
    assert got == [*_plain(ref, "\n\n--- snippet ---\n\n"), *_plain(ref, "x = 1\n"), fim.pre, *_plain(ref, "a"),
                   fim.suf, *_plain(ref, "b"), fim.mid]
    with pytest.raises(ValueError, match="no FIM prefix, suffix, middle token"):
        infill_prompt(ours, FimTokens(), "a", "b")


def test_encode_plain_reads_control_token_names_as_text(coder):
    ours, ref = coder
    text = "a<|fim_prefix|>b<|im_end|>"
    assert ours.encode_plain(text) == _plain(ref, text)
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False)  # encode() still parses them

"""Incremental detokenization against a whole decode of the same ids: the deltas never split a character and add
up to exactly the decoded output, SentencePiece leading spaces included."""

from __future__ import annotations

import pytest
import torch

from gpullama import LLM, SamplingParams
from gpullama.engine.detokenizer import CONTEXT_TOKENS, Detokenizer
from gpullama.engine.sequence import Sequence

TEXTS = [
    "Hello world, this is a test.",
    " leading space and  double  spaces\tand tabs\nnew lines",
    "café naïve Ünïcödé Ελληνικά русский",
    "中文字符和日本語のテキスト 한국어",
    "emoji 🎉🚀 and flags 🇫🇷 ❤️ mixed with text",
    "code: def f(x):\n    return x ** 2  # comment",
]


@pytest.mark.parametrize("arch", ["llama", "mistral"])  # byte-level BPE vocabulary, SentencePiece with byte fallback
def test_deltas_add_up_to_the_whole_decode(tiny_model, arch: str) -> None:
    llm = LLM(str(tiny_model(arch, "F32").path), device="cpu", dtype="float32")
    tok = llm.tokenizer
    detok = Detokenizer(tok)
    prompt = tok.encode("Say:", add_special_tokens=True)
    for text in TEXTS:
        output = tok.encode(text)
        seq = Sequence("r", prompt, SamplingParams(), max_tokens=len(output))
        deltas = []
        for i, token in enumerate(output):
            seq.append_token(token)
            delta, stopped = detok.update(seq, finishing=i == len(output) - 1)
            assert not stopped
            deltas.append(delta)
        context = prompt[-CONTEXT_TOKENS:]
        head = tok.decode(context, skip_special_tokens=True)
        whole = tok.decode(context + output, skip_special_tokens=True)
        assert whole.startswith(head)
        assert "".join(deltas) == whole[len(head) :]
        assert all("\ufffd" not in d for d in deltas), f"a delta split a character: {deltas}"


def test_random_generation_streams_the_whole_decode(tiny_model) -> None:
    """Random weights emit arbitrary byte-level tokens (partial UTF-8 included): stream, generate and a whole
    decode of the generated ids agree."""
    llm = LLM(str(tiny_model("llama", "F32").path), device="cpu", dtype="float32")
    tok = llm.tokenizer
    gen = torch.Generator().manual_seed(1)
    for trial in range(4):
        prompt = torch.randint(3, tok.vocab_size, (5,), generator=gen).tolist()
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=trial, ignore_eos=True)
        pieces = list(llm.stream(prompt, params))
        done = llm.generate([prompt], params)[0]
        head = tok.decode(prompt[-CONTEXT_TOKENS:], skip_special_tokens=True)
        whole = tok.decode(prompt[-CONTEXT_TOKENS:] + done.token_ids, skip_special_tokens=True)
        assert done.text == whole[len(head) :]
        assert "".join(pieces) == done.text


class _PieceTokenizer:
    """Token i decodes to PIECES[i]; no special tokens (the oracle below needs exact text per token)."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids: list[int], skip_special_tokens: bool = True, preserved_token_ids=()) -> str:
        return "".join(self.pieces[i] for i in ids)


def _whole_text_release(text: str, stops: list[str]) -> tuple[str, bool]:
    """The oracle, on the whole text so far: everything before the first stop string (then the sequence stops),
    else everything but the longest tail that could still grow into a stop string."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return text[: min(hits)], True
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - hold], False


@pytest.mark.parametrize("seed", range(6))
def test_incremental_stop_strings_release_what_the_whole_text_allows(seed: int) -> None:
    """Stop strings are checked on the unsent tail only; at every token the text released so far equals what a
    check of the whole text releases, and the held-back tail stays shorter than the longest stop string."""
    gen = torch.Generator().manual_seed(seed)
    alphabet = "ab c\n"
    pieces = ["".join(alphabet[i] for i in torch.randint(0, len(alphabet), (int(n),), generator=gen))
              for n in torch.randint(1, 4, (40,), generator=gen)]
    detok = Detokenizer(_PieceTokenizer(pieces))
    stop_sets = [["ab c"], ["c\nc", "bb", "a a a"], ["\n\n", "cab"], ["abcabc ab"]]
    for stops in stop_sets:
        output = torch.randint(0, len(pieces), (300,), generator=gen).tolist()
        seq = Sequence("r", [0], SamplingParams(stop=stops), max_tokens=len(output))
        released = ""
        for i, token in enumerate(output):
            seq.append_token(token)
            delta, stopped = detok.update(seq, finishing=False)
            released += delta
            whole = "".join(pieces[t] for t in output[: i + 1])
            assert (released, stopped) == _whole_text_release(whole, stops), (stops, i)
            if stopped:
                break
            assert len(seq.held_text) < max(map(len, stops))
        assert seq.text == released

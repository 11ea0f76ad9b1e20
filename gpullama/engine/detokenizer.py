"""Incremental detokenization with stop strings: new text per step, never half a character, never a stop string."""

from __future__ import annotations

from gpullama.engine.sequence import Sequence

CONTEXT_TOKENS = 4  # prompt tokens decoded in front of the output so a leading space survives (SentencePiece)


class Detokenizer:
    """Turns a sequence's output ids into text deltas, holding back what may be the start of a stop string."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _new_text(self, seq: Sequence, drop_last: bool = False, finishing: bool = False) -> str:
        """The output text decoded since the last call. Decodes only a window of recent tokens (as vLLM does): the
        window starts a few tokens back so a SentencePiece leading space survives, and text is added only once its
        UTF-8 is complete (or the sequence is finishing)."""
        start = max(0, seq.num_prompt_tokens - CONTEXT_TOKENS)  # ids are indexed from the prompt's last tokens
        if seq.read_offset < 0:
            seq.prefix_offset, seq.read_offset = 0, seq.num_prompt_tokens - start
        end = seq.num_tokens - start - (1 if drop_last else 0)
        if end > seq.read_offset:
            ids = seq.token_ids[start + seq.prefix_offset : start + end]
            keep = seq.params.preserved_token_ids  # special tokens the request keeps in its text (tool-call markers)
            prefix = self.tokenizer.decode(ids[: seq.read_offset - seq.prefix_offset], skip_special_tokens=True,
                                           preserved_token_ids=keep)
            text = self.tokenizer.decode(ids, skip_special_tokens=True, preserved_token_ids=keep)
            if len(text) > len(prefix) and (finishing or not text.endswith("\ufffd")):
                seq.prefix_offset, seq.read_offset = seq.read_offset, end
                return text[len(prefix) :]
        return ""

    def update(self, seq: Sequence, finishing: bool, drop_last: bool = False) -> tuple[str, bool]:
        """Decode after a new token: returns (new text to send, whether a stop string ended the sequence).
        `drop_last` leaves out the last token (a stop token, whose text is never shown).

        Incremental: only the text not yet sent is searched. That is the new text plus the held-back tail, which is
        shorter than the longest stop string (no stop string can begin in text already sent, since any tail that
        could begin one is held back), so a step costs the same at the 10th token as at the 10,000th."""
        stops = seq.params.stop
        text = seq.held_text + self._new_text(seq, drop_last, finishing)
        stopped = False
        if stops:
            hits = [(i, s) for s in stops if (i := text.find(s)) >= 0]
            if hits:
                at, seq.stop_reason = min(hits)
                text, stopped = text[:at], True
        ready = len(text)
        if not (stopped or finishing):
            ready -= _stop_prefix_len(text, stops)  # a tail that may grow into a stop string waits
        delta, seq.held_text = text[:ready], text[ready:]
        if delta:
            seq.text_parts.append(delta)
            seq.sent_text_len += len(delta)
        return delta, stopped


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is the beginning of some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest

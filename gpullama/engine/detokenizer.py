"""Incremental detokenization with stop strings: new text per step, never half a character, never a stop string."""

from __future__ import annotations

from gpullama.engine.sequence import Sequence

CONTEXT_TOKENS = 4  # prompt tokens decoded in front of the output so a leading space survives (SentencePiece)


class Detokenizer:
    """Turns a sequence's output ids into text deltas, holding back what may be the start of a stop string."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def output_text(self, seq: Sequence, drop_last: bool = False) -> str:
        """The whole output text so far, decoded in the context of the prompt's last tokens."""
        context = seq.prompt_token_ids[-CONTEXT_TOKENS:]
        output = seq.output_token_ids[:-1] if drop_last else seq.output_token_ids
        head = self.tokenizer.decode(context, skip_special_tokens=True)
        full = self.tokenizer.decode(context + output, skip_special_tokens=True)
        return full[len(head) :] if full.startswith(head) else full

    def update(self, seq: Sequence, finishing: bool, drop_last: bool = False) -> tuple[str, bool]:
        """Decode after a new token: returns (new text to send, whether a stop string ended the sequence).
        `drop_last` leaves out the last token (a stop token, whose text is never shown)."""
        text = self.output_text(seq, drop_last)
        stops = seq.params.stop
        stopped = False
        if stops:
            window = max(0, seq.sent_text_len - max(len(s) for s in stops))
            hits = [i for i in (text.find(s, window) for s in stops) if i >= 0]
            if hits:
                text, stopped = text[: min(hits)], True
        ready = len(text)
        if not (stopped or finishing):
            if text.endswith("\ufffd"):  # an incomplete UTF-8 character: wait for its other bytes
                ready = len(text.rstrip("\ufffd"))
            ready -= _stop_prefix_len(text[:ready], stops)  # a tail that may grow into a stop string waits
        ready = max(ready, seq.sent_text_len)
        delta = text[seq.sent_text_len : ready]
        seq.sent_text_len = ready
        seq.text = text[:ready]
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

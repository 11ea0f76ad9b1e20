"""Build OpenAI response objects and stream chunks from engine outputs."""

from __future__ import annotations

import time
import uuid

from gpullama.outputs import TokenLogprob


def new_id(prefix: str) -> str:
    """A fresh response id such as ``chatcmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time in seconds for the ``created`` field."""
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    """OpenAI's usage object."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def _utf8(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(items: list[TokenLogprob]) -> dict:
    """Chat-style logprobs: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    return {"content": [
        {"token": lp.token, "logprob": lp.logprob, "bytes": _utf8(lp.token),
         "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": _utf8(t.token)} for t in lp.top]}
        for lp in items
    ]}


def completion_logprobs(items: list[TokenLogprob], text_offset: int) -> dict:
    """Legacy completions logprobs: parallel lists of tokens, logprobs, top dicts and text offsets."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for lp in items:
        tokens.append(lp.token)
        token_logprobs.append(lp.logprob)
        top = {t.token: t.logprob for t in lp.top}
        top.setdefault(lp.token, lp.logprob)  # OpenAI always includes the sampled token
        tops.append(top)
        offsets.append(offset)
        offset += len(lp.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_completion(rid: str, created: int, model: str, choices: list[dict], usage_obj: dict) -> dict:
    """A whole ``chat.completion`` object; each choice is ``{index, text, logprobs, finish_reason}``."""
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{
            "index": c["index"],
            "message": c.get("message") or {"role": "assistant", "content": c["text"]},
            "logprobs": chat_logprobs(c["logprobs"]) if c["logprobs"] is not None else None,
            "finish_reason": c["finish_reason"],
        } for c in choices],
        "usage": usage_obj,
    }


def text_completion(rid: str, created: int, model: str, choices: list[dict], usage_obj: dict) -> dict:
    """A whole ``text_completion`` object; each choice is ``{index, text, logprobs, finish_reason, offset}``."""
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{
            "index": c["index"],
            "text": c["text"],
            "logprobs": completion_logprobs(c["logprobs"], c["offset"]) if c["logprobs"] is not None else None,
            "finish_reason": c["finish_reason"],
        } for c in choices],
        "usage": usage_obj,
    }


class ChunkBuilder:
    """Builds the stream chunks of one request (chat or text completion)."""

    def __init__(self, chat: bool, rid: str, created: int, model: str, include_usage: bool) -> None:
        self.chat = chat
        self.head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": created, "model": model}
        self.include_usage = include_usage

    def _chunk(self, choice: dict) -> dict:
        chunk = dict(self.head)
        chunk["choices"] = [choice]
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def role(self, index: int) -> dict:
        """The first chat chunk of a choice: the assistant role and empty content."""
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def content(self, index: int, text: str, logprobs: list[TokenLogprob] | None, offset: int = 0) -> dict:
        """A chunk carrying new text (and its tokens' logprobs when asked)."""
        if self.chat:
            return self._chunk({"index": index, "delta": {"content": text},
                                "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
                                "finish_reason": None})
        return self._chunk({"index": index, "text": text,
                            "logprobs": completion_logprobs(logprobs, offset) if logprobs is not None else None,
                            "finish_reason": None})

    def fields(self, index: int, delta: dict, logprobs: list[TokenLogprob] | None) -> dict:
        """A chat chunk carrying the given delta fields (content, reasoning_content, tool_calls)."""
        return self._chunk({"index": index, "delta": delta,
                            "logprobs": chat_logprobs(logprobs) if logprobs is not None else None,
                            "finish_reason": None})

    def finish(self, index: int, reason: str | None) -> dict:
        """The last chunk of a choice: no new content, the finish reason."""
        if self.chat:
            return self._chunk({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return self._chunk({"index": index, "text": "", "logprobs": None, "finish_reason": reason})

    def usage(self, usage_obj: dict) -> dict:
        """The usage chunk sent before ``[DONE]`` when ``stream_options.include_usage`` is set."""
        chunk = dict(self.head)
        chunk["choices"] = []
        chunk["usage"] = usage_obj
        return chunk

"""What chat completions and completions share: the request head (model, n, stream, stream_options), the choices
run on the engine and answered as one object or as SSE chunks, and the OpenAI objects and chunks themselves."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gpullama.outputs import StreamDelta, TokenLogprob

from ..http.body import JSONResponse
from ..http.errors import APIError, FieldNames, internal_error
from ..http.fields import bool_field, int_field, object_body, str_field
from ..http.streaming import DONE, ClientDisconnected, StreamResponse, event, unless_disconnected
from ..pipeline.chat_output import ChatOutputShaper
from ..pipeline.generation import Generation, Job, prompt_progress, start_generation
from ..pipeline.sampling import check_choices
from ..registry import answer_name
from ..state import BUILD_INFO, ServerState

log = logging.getLogger("gpullama.server")


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


def generation_usage(gen: Generation) -> dict:
    """OpenAI's usage object for the tokens a generation has seen so far."""
    return usage(gen.num_prompt_tokens, gen.num_generated_tokens, gen.num_cached_tokens)


def generation_timings(gen: Generation) -> dict:
    """llama.cpp's ``timings`` of a request so far: prompt tokens (less the cached ones) and generated tokens,
    with their times (prompt: arrival to first token; generation: first to last token) and rates."""
    first = gen.first_token_at or time.perf_counter()
    prompt_n = gen.num_prompt_tokens - gen.num_cached_tokens
    prompt_ms = (first - gen.arrival) * 1e3
    predicted_n = gen.num_generated_tokens
    predicted_ms = ((gen.last_token_at or first) - first) * 1e3
    steps = max(0, predicted_n - len(gen.jobs))  # the first token of each choice comes with the prompt
    return {"cache_n": gen.num_cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
            "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
            "predicted_per_second": 1e3 * steps / predicted_ms if predicted_ms > 0 else 0.0}


@dataclass
class RequestHead:
    """The fields chat completions and completions share besides sampling: model, n, stream, include_usage, and
    llama.cpp's timings_per_token."""

    model: str | None
    n: int
    stream: bool
    include_usage: bool
    timings_per_token: bool = False  # llama.cpp's: streamed chunks carry timings on every delta


def parse_head(body: Any) -> RequestHead:
    """The shared fields of a chat completions or completions body; 400 naming the bad one."""
    body = object_body(body)
    model = str_field(body, "model")
    n = int_field(body, "n")
    n = 1 if n is None else n
    check_choices(1, n)
    stream = bool_field(body, "stream")
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise APIError(400, "'stream_options' must be an object", param="stream_options")
        include_usage = bool_field(stream_options, "include_usage")
        if not stream:
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    return RequestHead(model, n, stream, include_usage, bool_field(body, "timings_per_token"))


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
        "id": rid, "object": "chat.completion", "created": created, "model": model, "system_fingerprint": BUILD_INFO,
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
        "id": rid, "object": "text_completion", "created": created, "model": model, "system_fingerprint": BUILD_INFO,
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
                     "created": created, "model": model, "system_fingerprint": BUILD_INFO}
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

    def progress(self, index: int) -> dict:
        """A chunk of prompt progress (llama.cpp's): an empty assistant delta, as its first chunk is."""
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": None}, "logprobs": None,
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


@dataclass
class Answer:
    """What one API request answers with: its kind and id, the engine jobs of its choices, the prompt texts to echo."""

    chat: bool
    id: str
    jobs: list[Job]
    prompt_texts: list[str | None]  # per prompt (None: token ids, decoded once accepted)
    echo: bool
    include_usage: bool
    arrival: float
    names: FieldNames  # the request's field names, for errors in its stream
    shaper: ChatOutputShaper | None = None  # chat: reasoning and tool calls read out of the text
    verbose: bool = False  # llama.cpp's "verbose": add its native result as "__verbose"
    timings_per_token: bool = False  # llama.cpp's: timings on every streamed delta, not only the last chunk
    prompt_text: str = ""  # the first choice's prompt as text (special tokens written), for "__verbose"


async def serve_choices(request: Request, state: ServerState, answer: Answer, stream: bool) -> Response:
    """Submit the answer's jobs (the engine's admission check turns a bad one into a 400), then answer with one
    JSON object or an SSE stream."""
    for job in answer.jobs:
        job.request_id = f"{answer.id}-{job.index}"
    gen = await start_generation(request, state, answer.jobs, answer.arrival)
    if gen is None:
        return Response(status_code=499)
    for job in answer.jobs:
        if answer.prompt_texts[job.prompt_index] is None:
            answer.prompt_texts[job.prompt_index] = state.llm.tokenizer.decode(job.prompt_ids)
    if answer.verbose:
        answer.prompt_text = state.llm.tokenizer.decode(answer.jobs[0].prompt_ids)
    if stream:
        return _stream_response(answer, gen, answer_name(request, state))
    return await _full_response(request, answer, gen, answer_name(request, state))


def verbose_result(answer: Answer, gen: Generation, model: str, text: str, finish: str | None,
                   stop_reason: str | int | None) -> dict:
    """llama.cpp's ``__verbose``: the first choice as its native ``/completion`` result would give it."""
    stop_type = "none" if finish is None else "limit" if finish == "length" else (
        "word" if isinstance(stop_reason, str) else "eos")
    return {"index": 0, "content": text, "tokens": [], "id_slot": -1, "stop": True, "model": model,
            "tokens_predicted": gen.num_generated_tokens, "tokens_evaluated": gen.num_prompt_tokens,
            "prompt": answer.prompt_text, "has_new_line": "\n" in text, "truncated": False, "stop_type": stop_type,
            "stopping_word": stop_reason if isinstance(stop_reason, str) else "",
            "tokens_cached": gen.num_cached_tokens, "timings": generation_timings(gen)}


async def _full_response(request: Request, answer: Answer, gen: Generation, model: str) -> Response:
    """Collect every choice and answer with one ``chat.completion`` or ``text_completion`` object."""
    jobs = answer.jobs

    async def collect() -> dict:
        texts = {job.index: answer.prompt_texts[job.prompt_index] if answer.echo else "" for job in jobs}
        logprobs = {job.index: ([] if job.params.logprobs is not None else None) for job in jobs}
        finish: dict[int, str | None] = {}
        stop_reasons: dict[int, str | int | None] = {}
        try:
            async for index, delta in gen.deltas():
                texts[index] += delta.text
                if delta.logprobs and logprobs[index] is not None:
                    logprobs[index].extend(delta.logprobs)
                if delta.finish_reason is not None:
                    finish[index] = delta.finish_reason
                    stop_reasons[index] = delta.stop_reason
        finally:
            await gen.close()
        choices = [{"index": job.index, "text": texts[job.index], "logprobs": logprobs[job.index],
                    "finish_reason": finish.get(job.index), "offset": 0} for job in jobs]
        if answer.shaper is not None:
            for c in choices:
                c["message"] = answer.shaper.message(c["index"], c["text"])
                c["finish_reason"] = answer.shaper.finish_reason(c["index"], c["finish_reason"])
        build = chat_completion if answer.chat else text_completion
        out = {**build(answer.id, now(), model, choices, generation_usage(gen)), "timings": generation_timings(gen)}
        if answer.verbose:
            first = jobs[0].index
            out["__verbose"] = verbose_result(answer, gen, model, texts[first], finish.get(first),
                                              stop_reasons.get(first))
        return out

    try:
        return JSONResponse(await unless_disconnected(request.receive, collect))
    except ClientDisconnected:
        log.info("client disconnected before %s finished; generation aborted", answer.id)
        return Response(status_code=499)


def _stream_response(answer: Answer, gen: Generation, model: str) -> StreamResponse:
    """Stream every choice's deltas as SSE chunks, then the usage chunk when asked, then ``[DONE]``."""
    chunks = ChunkBuilder(answer.chat, answer.id, now(), model, answer.include_usage)

    first = answer.jobs[0].index
    texts = {job.index: "" for job in answer.jobs}  # for "__verbose", on the first choice's last chunk
    progress_at: dict[int, float] = {}  # when each choice's first prompt-progress chunk went out

    def timed(chunk: dict) -> dict:
        """A chunk with llama.cpp's timings, when every delta carries them (timings_per_token)."""
        return {**chunk, "timings": generation_timings(gen)} if answer.timings_per_token else chunk

    def last(index: int, chunk: dict, delta: StreamDelta) -> dict:
        """A choice's last chunk, with llama.cpp's timings unless the usage chunk carries them (and its native
        result, for the first choice)."""
        if not answer.include_usage:
            chunk = {**chunk, "timings": generation_timings(gen)}
        if answer.verbose and index == first:
            chunk["__verbose"] = verbose_result(answer, gen, model, texts[index], delta.finish_reason,
                                                delta.stop_reason)
        return chunk

    async def events() -> AsyncIterator[bytes]:
        # every stream ends with [DONE]: after the finish reasons (and usage), or after one error event
        offsets = {job.index: 0 for job in answer.jobs}
        try:
            for job in answer.jobs:
                text = answer.prompt_texts[job.prompt_index]
                if answer.chat:
                    yield event(chunks.role(job.index))
                elif answer.echo and text:
                    yield event(chunks.content(job.index, text, None))
            shaper = answer.shaper
            async for index, delta in gen.deltas():
                texts[index] += delta.text
                if delta.num_computed_prompt_tokens is not None:  # return_progress: an empty assistant delta
                    now = time.perf_counter()
                    started = progress_at.setdefault(index, now)
                    total = len(answer.jobs[index].prompt_ids)
                    yield event({**chunks.progress(index), "prompt_progress": prompt_progress(delta, total, started,
                                                                                              now)})
                    continue
                if shaper is not None:  # reasoning, content and tool-call pieces
                    fields = shaper.delta(index, delta.text) if delta.text else None
                    if fields or delta.logprobs:
                        yield event(timed(chunks.fields(index, fields or {}, delta.logprobs)))
                    if delta.finish_reason is not None:
                        rest = shaper.finish(index)
                        if rest:
                            yield event(timed(chunks.fields(index, rest, None)))
                        yield event(last(index, chunks.finish(index, shaper.finish_reason(index, delta.finish_reason)),
                                         delta))
                    continue
                if delta.text or delta.logprobs:
                    yield event(timed(chunks.content(index, delta.text, delta.logprobs, offsets[index])))
                    offsets[index] += len(delta.text)
                if delta.finish_reason is not None:
                    yield event(last(index, chunks.finish(index, delta.finish_reason), delta))
            if answer.include_usage:
                yield event({**chunks.usage(generation_usage(gen)), "timings": generation_timings(gen)})
        except APIError as exc:
            yield event(answer.names.apply(exc).body())
        except Exception as exc:  # noqa: BLE001 - a bug of ours: the client gets an error event, the log the detail
            log.error("streaming %s failed (request id %s)", answer.id, gen.http_request_id, exc_info=exc)
            yield event(internal_error(gen.http_request_id).body())
        finally:
            await gen.close()
        yield DONE

    return StreamResponse(events())

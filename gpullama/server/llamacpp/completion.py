"""``POST /completion`` and ``POST /infill``: llama.cpp's native completion and code infill, answered in its shape
(``content``, ``tokens``, ``stop``, ``stop_type``, ``timings``, ``generation_settings``, ``completion_probabilities``),
whole or as SSE events (no ``[DONE]``: the last event has ``stop: true``).

A body with several prompts (or ``n_cmpl`` > 1) is answered with a list of results, one per prompt and choice;
streamed, each event names its result by ``index``."""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gpullama.outputs import StreamDelta, TokenLogprob

from ..http.body import JSONResponse, parse_json
from ..http.errors import APIError, internal_error
from ..http.fields import bad, object_body, str_field
from ..http.streaming import ClientDisconnected, StreamResponse, event, unless_disconnected
from ..pipeline.generation import Generation, Job, prompt_progress, start_generation
from ..pipeline.infill import fim_prompt_ids
from ..pipeline.intake import read_and_prepare
from ..pipeline.prompts import MEDIA_MARKER, MediaPrompt, tokenize_pieces
from ..pipeline.sampling import sampling_params
from ..registry import answer_name
from ..state import ServerState, check_model
from .request import NAMES, NativeRequest, finite, input_extra, parse_native

log = logging.getLogger("gpullama.server")


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def probabilities(items: list[TokenLogprob], post_sampling: bool = False) -> list[dict]:
    """llama.cpp's ``completion_probabilities``: per token its id, text, bytes, logprob and top_logprobs; with
    `post_sampling` (``post_sampling_probs``), prob and top_probs instead, the tokens the sampler cut left out."""
    if post_sampling:
        return [{"id": lp.token_id, "token": lp.token, "bytes": _bytes(lp.token), "prob": math.exp(lp.logprob),
                 "top_probs": [{"id": t.token_id, "token": t.token, "bytes": _bytes(t.token),
                                "prob": math.exp(t.logprob)} for t in lp.top if t.logprob > -math.inf]}
                for lp in items]
    return [{"id": lp.token_id, "token": lp.token, "bytes": _bytes(lp.token), "logprob": finite(lp.logprob),
             "top_logprobs": [{"id": t.token_id, "token": t.token, "bytes": _bytes(t.token),
                               "logprob": finite(t.logprob)} for t in lp.top]}
            for lp in items]


def _rate(n: int, ms: float) -> tuple[float, float]:
    """(ms per token, tokens per second); 0 where undefined."""
    return (ms / n if n else 0.0), (1e3 * n / ms if ms > 0 else 0.0)


@dataclass
class Result:
    """What one choice has produced so far."""

    index: int
    prompt_ids: list[int]
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    probs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cached: int = 0
    first_at: float | None = None
    last_at: float | None = None
    progress_at: float | None = None  # when its first prompt-progress event came

    def add(self, delta: StreamDelta) -> None:
        """Take one engine delta."""
        now = time.perf_counter()
        if delta.token_ids:
            self.first_at = self.first_at or now
            self.last_at = now
        self.text += delta.text
        self.tokens.extend(delta.token_ids)
        if delta.logprobs:
            self.probs.extend(delta.logprobs)
        self.cached = max(self.cached, delta.num_cached_tokens)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason

    def timings(self, arrival: float) -> dict:
        """llama.cpp's ``timings``: prompt (less the cached part) and generation counts, times and rates."""
        first = self.first_at or time.perf_counter()
        prompt_n = len(self.prompt_ids) - self.cached
        prompt_ms = (first - arrival) * 1e3
        predicted_n = len(self.tokens)
        predicted_ms = ((self.last_at or first) - first) * 1e3
        prompt_per_token, prompt_per_second = _rate(prompt_n, prompt_ms)
        per_token, per_second = _rate(max(0, predicted_n - 1), predicted_ms)
        return {"cache_n": self.cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_per_token, "prompt_per_second": prompt_per_second,
                "predicted_n": predicted_n, "predicted_ms": predicted_ms, "predicted_per_token_ms": per_token,
                "predicted_per_second": per_second}

    @property
    def stop_type(self) -> str:
        """``limit`` (n_predict reached), ``word`` (a stop string), ``eos`` or ``none`` (not finished)."""
        if self.finish_reason is None:
            return "none"
        if self.finish_reason == "length":
            return "limit"
        return "word" if isinstance(self.stop_reason, str) else "eos"


@dataclass
class NativeAnswer:
    """One native request's jobs and how to answer it."""

    req: NativeRequest
    jobs: list[Job]
    prompt_texts: list[str]
    model: str
    n_ctx: int
    arrival: float

    def final(self, r: Result, streamed: bool) -> dict:
        """The last (or whole) result of a choice, in llama.cpp's fields."""
        out = {
            "index": r.index, "content": "" if streamed else r.text,
            "tokens": [] if streamed or not self.req.return_tokens else r.tokens,
            "id_slot": -1, "stop": True, "model": self.model, "tokens_predicted": len(r.tokens),
            "tokens_evaluated": len(r.prompt_ids),
            "generation_settings": {**self.req.settings, "n_ctx": self.n_ctx, "model": self.model},
            "prompt": self.prompt_texts[self.jobs[r.index].prompt_index], "has_new_line": "\n" in r.text,
            "truncated": False, "stop_type": r.stop_type,
            "stopping_word": r.stop_reason if isinstance(r.stop_reason, str) else "",
            "tokens_cached": r.cached, "timings": r.timings(self.arrival),
        }
        if not streamed and self.req.n_probs:
            out["completion_probabilities"] = probabilities(r.probs, self.req.post_sampling_probs)
        return pick(out, self.req.response_fields)

    def partial(self, r: Result, delta: StreamDelta) -> dict:
        """A streamed event carrying a delta's text and tokens."""
        out = {"index": r.index, "content": delta.text, "tokens": list(delta.token_ids), "stop": False,
               "id_slot": -1, "tokens_predicted": len(r.tokens), "tokens_evaluated": len(r.prompt_ids)}
        if self.req.timings_per_token:
            out["timings"] = r.timings(self.arrival)
        if self.req.n_probs and delta.logprobs:
            out["completion_probabilities"] = probabilities(delta.logprobs, self.req.post_sampling_probs)
        return out

    def progress(self, r: Result, delta: StreamDelta) -> dict:
        """A prompt-progress event (``return_progress``): the prompt's tokens, its prefix-cache hits, the tokens
        processed so far (the hits, before the first chunk) and the milliseconds since the first such event."""
        now = time.perf_counter()
        r.progress_at = r.progress_at or now
        total = len(r.prompt_ids)
        return {"index": r.index, "content": "", "tokens": [], "stop": False, "id_slot": -1, "tokens_predicted": 0,
                "tokens_evaluated": total, "prompt_progress": prompt_progress(delta, total, r.progress_at, now)}


def pick(result: dict, fields: list[str]) -> dict:
    """llama.cpp's ``response_fields``: only these fields, a nested one (``a/b``) under its path; missing ones
    left out."""
    if not fields:
        return result
    out: dict = {}
    for path in fields:
        value: Any = result
        for part in path.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            out[path] = value
    return out


async def _serve(request: Request, state: ServerState, req: NativeRequest, prompt_ids: list[list[int]],
                 arrival: float, extra_stop_ids: list[int] = ()) -> Response:
    jobs: list[Job] = []
    rid = f"cmpl-{uuid.uuid4().hex}"
    for p, ids in enumerate(prompt_ids):
        for i in range(req.n_cmpl):
            params = sampling_params(req.options, seed_offset=i)
            params.stop_token_ids = [*params.stop_token_ids, *extra_stop_ids]
            job = Job(p * req.n_cmpl + i, ids, params, prompt_index=p)
            job.request_id = f"{rid}-{job.index}"
            jobs.append(job)
    gen = await start_generation(request, state, jobs, arrival)
    if gen is None:
        return Response(status_code=499)
    tok = state.llm.tokenizer
    answer = NativeAnswer(req, jobs, [tok.decode(ids) for ids in prompt_ids], answer_name(request, state),
                          state.llm.max_model_len, arrival)
    results = {job.index: Result(job.index, job.prompt_ids) for job in jobs}
    if req.stream:
        return StreamResponse(_events(answer, gen, results))

    async def collect() -> Any:
        try:
            async for index, delta in gen.deltas():
                results[index].add(delta)
        finally:
            await gen.close()
        out = [answer.final(results[job.index], streamed=False) for job in jobs]
        return out[0] if len(out) == 1 else out

    try:
        return JSONResponse(await unless_disconnected(request.receive, collect))
    except ClientDisconnected:
        log.info("client disconnected before %s finished; generation aborted", rid)
        return Response(status_code=499)


async def _events(answer: NativeAnswer, gen: Generation, results: dict[int, Result]) -> AsyncIterator[bytes]:
    try:
        async for index, delta in gen.deltas():
            r = results[index]
            r.add(delta)
            if delta.num_computed_prompt_tokens is not None:
                yield event(answer.progress(r, delta))
            if delta.text or delta.token_ids:
                yield event(answer.partial(r, delta))
            if delta.finish_reason is not None:
                yield event(answer.final(r, streamed=True))
    except APIError as exc:
        yield event(answer.req.options.names.apply(exc).body())
    except Exception as exc:  # noqa: BLE001 - a bug of ours: the client gets an error event, the log the detail
        log.error("streaming failed (request id %s)", gen.http_request_id, exc_info=exc)
        yield event(internal_error(gen.http_request_id).body())
    finally:
        await gen.close()


def _prepare_completion(state: ServerState, raw: bytes) -> tuple[NativeRequest, list[list[int]]]:
    body = object_body(parse_json(raw))
    check_model(state, body.get("model"))
    tok = state.llm.tokenizer
    req = parse_native(body, tok, defaults=state.config.defaults)
    return req, [media_prompt_ids(state, pieces[0]) if pieces and isinstance(pieces[0], MediaPrompt)
                 else tokenize_pieces(tok, pieces) for pieces in req.prompts]


def media_prompt_ids(state: ServerState, prompt: MediaPrompt) -> list[int]:
    """The ids of a ``prompt_string`` with ``multimodal_data``: each media marker becomes the model's image tokens
    (Gemma 3: ``<start_of_image>``, expanded as its processor does), BOS as for any text prompt."""
    vision = getattr(state.llm, "vision", None)
    if vision is None:
        raise APIError(400, f"'{prompt.images[0].where}': this model reads no images: start the server with "
                       "--mmproj FILE (the model's vision projector, an mmproj GGUF)", param=prompt.images[0].where)
    text = prompt.text.replace(MEDIA_MARKER, vision.media_marker)
    return vision.prompt(text, prompt.images, state.config.images, add_special_tokens=True)


def _prepare_infill(state: ServerState, raw: bytes) -> tuple[NativeRequest, list[list[int]]]:
    body = object_body(parse_json(raw))
    check_model(state, body.get("model"))
    tok = state.llm.tokenizer
    for name in ("input_prefix", "input_suffix"):
        if not isinstance(body.get(name), str):
            raise bad(name, f"'{name}' is required (a string)")
    prompt = str_field(body, "prompt") or ""
    extra = input_extra(body)
    req = parse_native(body, tok, prompt_field=None, defaults=state.config.defaults)
    ids = fim_prompt_ids(tok, state.llm.max_model_len, body["input_prefix"], body["input_suffix"], extra, prompt,
                         param="input_prefix")
    return req, [ids]


async def completion(request: Request) -> Response:
    """``POST /completion``."""
    request.state.field_names = NAMES
    arrival, state, (req, prompt_ids) = await read_and_prepare(request, _prepare_completion)
    request.state.field_names = req.options.names  # with the names it chose (max_tokens for n_predict)
    return await _serve(request, state, req, prompt_ids, arrival)


async def infill(request: Request) -> Response:
    """``POST /infill``: the FIM prompt of ``input_extra``, ``input_prefix``, ``prompt`` and ``input_suffix``
    (`gpullama.fim`), completed as ``/completion`` does; it stops at the FIM pad, repo and file-separator tokens."""
    request.state.field_names = NAMES
    arrival, state, (req, prompt_ids) = await read_and_prepare(request, _prepare_infill)
    request.state.field_names = req.options.names
    return await _serve(request, state, req, prompt_ids, arrival, state.llm.tokenizer.fim.stop_ids)

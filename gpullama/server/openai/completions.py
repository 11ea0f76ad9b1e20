"""``POST /v1/completions``: prompts (text or token ids) run as n choices each, answered as a
``text_completion`` or its chunks (`choices`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gpullama.engine.admission import check_count

from ..http.body import parse_json
from ..http.errors import FieldNames
from ..http.fields import bad, bool_field, int_field, str_field
from ..pipeline.chat_plan import response_format_spec
from ..pipeline.generation import Job
from ..pipeline.infill import fim_prompt_ids
from ..pipeline.intake import read_and_prepare
from ..pipeline.sampling import MAX_N, OPENAI, Field, SamplingOptions, check_choices, sampling_params, top_count
from ..state import NO_DEFAULTS, RequestDefaults, ServerState, check_model
from .choices import Answer, new_id, parse_head, serve_choices

FIELDS = OPENAI.but(Field("logprobs", "logprobs", top_count()),
                    Field("n_probs", "logprobs", top_count(zero_is_off=True), alias=True))  # llama.cpp's name
"""Completions' sampling fields; the common plan's other fields keep their names."""
NAMES = FIELDS.names


@dataclass
class CompletionRequest:
    """A validated ``POST /v1/completions`` body; each prompt is a string or a list of token ids."""

    model: str | None
    prompts: list[str | list[int]]
    options: SamplingOptions
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    names: FieldNames = NAMES
    suffix: str | None = None  # fill in the middle: the text after the completion
    verbose: bool = False  # llama.cpp's: the answer adds its native result as "__verbose"
    timings_per_token: bool = False  # llama.cpp's: every streamed delta carries timings


def _prompts(body: dict) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if prompt is None:
        raise bad("prompt", "'prompt' is a required field")

    def is_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x)

    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        check_count("prompt", len(prompt), MAX_N)  # a list of prompts: its length before its items
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif is_ids(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        prompts = list(prompt)
    else:
        raise bad("prompt", "'prompt' must be a string, a list of strings, a list of token ids "
                  "or a list of token-id lists (non-empty)")
    return prompts


def parse_completion(body: Any, defaults: RequestDefaults = NO_DEFAULTS) -> CompletionRequest:
    """Validate a text completions body (`defaults`: the server's values of fields it leaves out); raises
    ``APIError`` (400) naming the bad field."""
    head = parse_head(body)
    prompts = _prompts(body)
    check_choices(len(prompts), head.n)
    opts = FIELDS.read(body, defaults=defaults)
    logprobs = opts.kwargs.get("logprobs")
    echo = bool_field(body, "echo")
    if echo and logprobs is not None:
        raise bad("echo", "'echo' together with 'logprobs' is not supported (prompt log-probabilities are not computed)")
    suffix = str_field(body, "suffix") or None
    if suffix is not None and echo:
        raise bad("echo", "'echo' together with 'suffix' is not supported")
    if suffix is not None and not all(isinstance(p, str) for p in prompts):
        raise bad("suffix", "'suffix' needs text prompts (the prompt is the code before the completion)")
    best_of = int_field(body, "best_of")
    if best_of is not None and best_of not in (1, head.n):
        raise bad("best_of", f"'best_of' other than 1 or n is not supported, got {best_of}")
    return CompletionRequest(head.model, prompts, opts, head.n, head.stream, head.include_usage, echo, opts.names, suffix,
                             bool_field(body, "verbose", defaults.verbose), head.timings_per_token)


def prepare_completion(state: ServerState, raw: bytes) -> tuple[CompletionRequest, list[list[int]]]:
    """Parse and validate a completions body and tokenize its prompts (a worker thread may run it)."""
    body = parse_json(raw)
    req = parse_completion(body, state.config.defaults)
    check_model(state, req.model)
    spec = response_format_spec(body)
    if spec is not None:
        req.options.kwargs["structured_output"] = spec
    tok = state.llm.tokenizer
    if req.suffix is not None:  # fill in the middle, laid out as llama.cpp's /infill; stops where it does
        req.options.kwargs["stop_token_ids"] = [*req.options.kwargs.get("stop_token_ids", []), *tok.fim.stop_ids]
        return req, [fim_prompt_ids(tok, state.llm.max_model_len, p, req.suffix) for p in req.prompts]
    return req, [tok.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p) for p in req.prompts]


async def completions(request: Request) -> Response:
    """``POST /v1/completions``."""
    request.state.field_names = NAMES
    arrival, state, (req, prompt_ids) = await read_and_prepare(request, prepare_completion)
    request.state.field_names = req.names
    jobs: list[Job] = []
    texts: list[str | None] = []
    for p, (prompt, ids) in enumerate(zip(req.prompts, prompt_ids)):
        if isinstance(prompt, str):
            texts.append(prompt)
        else:
            texts.append(None if req.echo else "")  # echoed text is decoded once the engine accepted the ids
        for i in range(req.n):
            jobs.append(Job(p * req.n + i, ids, sampling_params(req.options, seed_offset=i), prompt_index=p))
    answer = Answer(chat=False, id=new_id("cmpl"), jobs=jobs, prompt_texts=texts, echo=req.echo,
                    include_usage=req.include_usage, arrival=arrival, names=req.names, verbose=req.verbose,
                    timings_per_token=req.timings_per_token)
    return await serve_choices(request, state, answer, req.stream)

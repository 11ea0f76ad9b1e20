"""``POST /v1/chat/completions``: the body parsed and checked, planned (`chat_plan`), rendered and tokenized, run
as n choices and answered as a ``chat.completion`` or its chunks (`choices`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gpullama.chat.messages import content_of, message_items, role_of
from gpullama.chat.model_format import chat_format

from ..http.body import JSONResponse, parse_json
from ..http.errors import FieldNames
from ..http.fields import bad, bool_field
from ..pipeline.chat_output import ChatOutputShaper
from ..pipeline.chat_plan import ChatPlan, image_input, plan_chat, render_planned_chat
from ..pipeline.generation import Job
from ..pipeline.intake import read_and_prepare
from ..pipeline.sampling import OPENAI, Field, SamplingOptions, sampling_params, streamed, top_count, top_logprobs
from ..state import NO_DEFAULTS, RequestDefaults, ServerState, check_model
from .choices import Answer, RequestHead, new_id, parse_head, serve_choices

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# message fields passed on to the chat template as given (checked in chat_plan: tool calls, tool results)
PASSED_MESSAGE_FIELDS = ("tool_calls", "tool_call_id", "name", "reasoning_content", "reasoning")
FIELDS = OPENAI.but(Field("top_logprobs", "logprobs", top_logprobs("logprobs")),
                    Field("n_probs", "logprobs", top_count(zero_is_off=True), alias=True),  # llama.cpp's name
                    Field("return_progress", "return_progress", streamed),  # llama.cpp's prompt progress
                    others=FieldNames(fields=(("prompt", "messages"),)))
"""Chat completions' sampling fields and names for the common plan's fields (the engine speaks of the prompt)."""
NAMES = FIELDS.names


@dataclass
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` body."""

    model: str | None
    messages: list[dict[str, str]]
    options: SamplingOptions
    n: int
    stream: bool
    include_usage: bool
    names: FieldNames = NAMES  # with this request's own choices (max_completion_tokens, top_logprobs)
    verbose: bool = False  # llama.cpp's: the answer adds its native result as "__verbose"
    timings_per_token: bool = False  # llama.cpp's: every streamed delta carries timings


def parse_messages(body: dict) -> list[dict[str, str]]:
    """The `messages` of a chat body in the template's shape: roles mapped (``developer`` is ``system``), content
    joined, the tool fields passed on (the chat plan checks the result, `gpullama.chat.messages.check_messages`)."""
    messages = body.get("messages")
    if messages is None:
        raise bad("messages", "'messages' is a required field")
    out = []
    for where, message in message_items(messages):
        role = role_of(message, where, tuple(CHAT_ROLES))
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        elif content is None:
            raise bad(f"{where}.content", f"'{where}.content' is required for role {role!r}")
        entry = {"role": CHAT_ROLES[role], "content": content_of(content, f"{where}.content")}
        entry.update((k, message[k]) for k in PASSED_MESSAGE_FIELDS if message.get(k) is not None)
        out.append(entry)
    return out


def parse_chat(body: Any, defaults: RequestDefaults = NO_DEFAULTS) -> ChatRequest:
    """Validate a chat completions body (`defaults`: the server's values of fields it leaves out); raises
    ``APIError`` (400) naming the bad field."""
    head: RequestHead = parse_head(body)
    messages = parse_messages(body)
    opts = FIELDS.read(body, defaults=defaults)
    return ChatRequest(head.model, messages, opts, head.n, head.stream, head.include_usage, opts.names,
                       bool_field(body, "verbose", defaults.verbose), head.timings_per_token)


def prepare_chat(state: ServerState, raw: bytes) -> tuple[ChatRequest, ChatPlan, str, list[int]]:
    """Parse and validate a chat body (with its response_format, tools, tool_choice and template kwargs), render
    the chat template and tokenize (a worker thread may run it)."""
    body = parse_json(raw)
    req = parse_chat(body, state.config.defaults)
    check_model(state, req.model)
    tok = state.llm.tokenizer
    plan = plan_chat(body, req.messages, chat_format(tok), state.config.chat)
    text, ids = render_planned_chat(tok, plan, req.options.kwargs, **image_input(state))
    return req, plan, text, ids


async def input_tokens(request: Request) -> Response:
    """``POST /v1/chat/completions/input_tokens`` (llama.cpp's): a chat completions body -> the tokens of the prompt
    it would run, as ``{"object": "response.input_tokens", "input_tokens": N}``."""
    request.state.field_names = NAMES
    _, _, (_, _, _, ids) = await read_and_prepare(request, prepare_chat)
    return JSONResponse({"object": "response.input_tokens", "input_tokens": len(ids)})


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    request.state.field_names = NAMES
    arrival, state, (req, plan, text, ids) = await read_and_prepare(request, prepare_chat)
    request.state.field_names = req.names
    jobs = [Job(i, ids, sampling_params(req.options, seed_offset=i)) for i in range(req.n)]
    shaper = ChatOutputShaper(plan, text)
    answer = Answer(chat=True, id=new_id("chatcmpl"), jobs=jobs, prompt_texts=[""], echo=False,
                    include_usage=req.include_usage, arrival=arrival, names=req.names,
                    shaper=shaper if shaper.active else None, verbose=req.verbose,
                    timings_per_token=req.timings_per_token)
    return await serve_choices(request, state, answer, req.stream)

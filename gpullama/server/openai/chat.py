"""``POST /v1/chat/completions``: the body parsed and checked, planned (`chat_plan`), rendered and tokenized, run
as n choices and answered as a ``chat.completion`` or its chunks (`choices`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from gpullama.chat.messages import check_messages
from gpullama.chat.model_format import chat_format
from gpullama.sampling_params import SamplingParams

from ..http.body import parse_json
from ..http.errors import FieldNames
from ..http.fields import admitted, bad, bool_field, int_field, kind
from ..pipeline.chat_output import ChatOutputShaper
from ..pipeline.chat_plan import ChatPlan, plan_chat, render_planned_chat
from ..pipeline.generation import Job
from ..pipeline.intake import read_and_prepare
from ..pipeline.sampling import SamplingOptions, sampling_options, sampling_params
from ..state import ServerState, check_model
from .choices import Answer, RequestHead, new_id, parse_head, serve_choices

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# message fields passed on to the chat template as given (checked in chat_plan: tool calls, tool results)
PASSED_MESSAGE_FIELDS = ("tool_calls", "tool_call_id", "name", "reasoning_content", "reasoning")
NAMES = FieldNames(fields=(("prompt", "messages"),))
"""Chat completions' names for the common plan's fields (the engine speaks of the prompt)."""


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
    add_generation_prompt: bool = True  # vLLM's and llama.cpp's rendering flags (as /tokenize takes them)
    continue_final_message: bool = False
    verbose: bool = False  # llama.cpp's: the answer adds its native result as "__verbose"


def message_content(value: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts joined with newlines."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                shown = part.get("type") if isinstance(part, dict) else kind(part)
                raise bad(f"{where}[{j}]", f"'{where}[{j}]' must be a {{\"type\": \"text\", \"text\": ...}} part "
                          f"(only text is supported), got {shown!r}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(where, f"'{where}' must be a string or a list of text parts, got {kind(value)}")


def parse_messages(body: dict) -> list[dict[str, str]]:
    """The `messages` of a chat body, checked (`gpullama.chat.messages.check_messages`) and put in the template's
    shape: roles mapped (``developer`` is ``system``), content joined, the tool fields passed on."""
    messages = body.get("messages")
    if messages is None:
        raise bad("messages", "'messages' is a required field")
    admitted(check_messages, messages)  # list, count, objects, role strings
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role", f"'{where}.role' must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        elif content is None:
            raise bad(f"{where}.content", f"'{where}.content' is required for role {role!r}")
        entry = {"role": CHAT_ROLES[role], "content": message_content(content, f"{where}.content")}
        entry.update((k, message[k]) for k in PASSED_MESSAGE_FIELDS if message.get(k) is not None)
        out.append(entry)
    return out


def parse_chat(body: Any) -> ChatRequest:
    """Validate a chat completions body; raises ``APIError`` (400) naming the bad field."""
    head: RequestHead = parse_head(body)
    messages = parse_messages(body)
    opts = sampling_options(body)
    if bool_field(body, "logprobs"):
        top = int_field(body, "top_logprobs")
        top = 0 if top is None else top
        if not 0 <= top <= SamplingParams.MAX_LOGPROBS:
            raise bad("top_logprobs", f"'top_logprobs' must be in [0, {SamplingParams.MAX_LOGPROBS}], got {top}")
        opts.kwargs["logprobs"] = top
    elif body.get("top_logprobs") is not None:
        raise bad("top_logprobs", "'top_logprobs' requires 'logprobs' to be true")
    names = NAMES.but(logprobs="top_logprobs")
    n_probs = int_field(body, "n_probs")  # llama.cpp's: the top n_probs of each token, as top_logprobs
    if n_probs and "logprobs" not in opts.kwargs:
        if not 0 <= n_probs <= SamplingParams.MAX_LOGPROBS:
            raise bad("n_probs", f"'n_probs' must be in [0, {SamplingParams.MAX_LOGPROBS}], got {n_probs}")
        opts.kwargs["logprobs"] = n_probs
        names = NAMES.but(logprobs="n_probs")
    if body.get("max_completion_tokens") is not None:
        names = names.but(max_tokens="max_completion_tokens")
    add_generation = bool_field(body, "add_generation_prompt", default=True)
    cont = bool_field(body, "continue_final_message")
    if cont and add_generation:
        if body.get("add_generation_prompt") is not None:
            raise bad("continue_final_message", "'continue_final_message' and 'add_generation_prompt' cannot both "
                      "be true")
        add_generation = False
    return ChatRequest(head.model, messages, opts, head.n, head.stream, head.include_usage, names, add_generation,
                       cont, bool_field(body, "verbose"))


def prepare_chat(state: ServerState, raw: bytes) -> tuple[ChatRequest, ChatPlan, str, list[int]]:
    """Parse and validate a chat body (with its response_format, tools, tool_choice and template kwargs), render
    the chat template and tokenize (a worker thread may run it)."""
    body = parse_json(raw)
    req = parse_chat(body)
    check_model(state, req.model)
    tok = state.llm.tokenizer
    plan = plan_chat(body, req.messages, chat_format(tok))
    text, ids = render_planned_chat(tok, plan, req.options.kwargs, req.add_generation_prompt,
                                    req.continue_final_message)
    return req, plan, text, ids


async def chat_completions(request: Request) -> Response:
    """``POST /v1/chat/completions``."""
    request.state.field_names = NAMES
    arrival, state, (req, plan, text, ids) = await read_and_prepare(request, prepare_chat)
    request.state.field_names = req.names
    jobs = [Job(i, ids, sampling_params(req.options, seed_offset=i)) for i in range(req.n)]
    shaper = ChatOutputShaper(plan, text)
    answer = Answer(chat=True, id=new_id("chatcmpl"), jobs=jobs, prompt_texts=[""], echo=False,
                    include_usage=req.include_usage, arrival=arrival, names=req.names,
                    shaper=shaper if shaper.active else None, verbose=req.verbose)
    return await serve_choices(request, state, answer, req.stream)

"""The common chat plan every chat-like endpoint builds (chat completions, responses, Anthropic's messages,
Ollama's chat): the structured-output and tool fields in chat completions' shape (`response_format`, `tools`,
`tool_choice`, `parallel_tool_calls`, `chat_template_kwargs`), checked and turned into the prompt's messages and
tools, the grammar, and how to read the output. An API in another shape converts its body into this one first.

What the model's chat template supports decides how tools reach the prompt (`gpullama.chat.formats`): a template
with tool support (Hermes/Qwen, Llama 3, Mistral) renders them itself, with the calls in earlier assistant
messages given as objects; any other template gets the generic tool prompt (llama.cpp's approach) and the calls
written as the generic JSON. `required` and named choices are forced by a grammar in the same format; `auto` is
parsed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from gpullama.chat.messages import chat_images, check_messages
from gpullama.chat.model_format import ChatFormat
from gpullama.checks import kind as kind_of
from gpullama.structured.spec import StructuredOutput, StructuredOutputError
from gpullama.structured.tools import parse_tool, tool_call_grammar

from ..http.errors import APIError
from ..http.fields import bool_field
from ..state import ChatDefaults

TOOL_CHOICES = ("none", "auto", "required")
DEFAULTS = ChatDefaults()  # the server's flags at their defaults (--reasoning auto, assistant prefill on)
# names the render itself passes; chat_template_kwargs may not replace them
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "documents"})


@dataclass
class ChatPlan:
    """A chat request's structured side: the messages and tools for the template, its extra template variables,
    the grammar of every choice, and how to read the output (which tool calls count)."""

    format: ChatFormat
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None  # for the template (templates with tool support only)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    spec: StructuredOutput | None = None
    # parse calls of these functions (each name's parameters schema, which types tagged formats' values); None: no
    # tool parsing
    tool_names: dict[str, dict] | None = None
    tool_choice: str = "none"  # none, auto, required or named
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True  # end the prompt with the template's opening of the assistant's turn
    continue_final_message: bool = False  # end it right after the last message's content instead (its prefill)

    @property
    def preserved_token_ids(self) -> list[int]:
        """The special tokens the output text must keep for its parsers: the tool-call markers when calls are
        parsed, the reasoning tags when the model reasons."""
        ids = list(self.format.reasoning_marker_ids) if self.format.reasoning else []
        if self.tool_names is not None:
            ids.extend(self.format.tool_marker_ids)
        return ids


def _bad(error: StructuredOutputError) -> APIError:
    return APIError(400, str(error), param=error.param)


def response_format_spec(body: dict) -> StructuredOutput | None:
    """The grammar a request asks for (None for text or none); 400 naming the field. OpenAI's ``response_format``,
    and llama.cpp's extensions: ``grammar`` (GBNF), a top-level ``json_schema``, and ``response_format`` of type
    ``json_object`` or ``json_schema`` with its ``schema`` beside the type. At most one of them."""
    value = body.get("response_format")
    asked = [name for name in ("grammar", "json_schema") if body.get(name) is not None]
    if isinstance(value, dict) and value.get("type") not in (None, "text"):
        asked.append("response_format")
    if len(asked) > 1:
        raise APIError(400, f"give at most one of 'grammar', 'json_schema' and 'response_format', got "
                       f"{' and '.join(repr(a) for a in asked)}", param=asked[1])
    try:
        if body.get("grammar") is not None:
            return StructuredOutput(grammar=body["grammar"], param="grammar")
        if body.get("json_schema") is not None:
            return StructuredOutput(json_schema=body["json_schema"], param="json_schema")
        if isinstance(value, dict) and value.get("type") in ("json_object", "json_schema") and "schema" in value:
            if value.get("schema") is None:  # llama.cpp's shape without a schema: any JSON object
                return StructuredOutput(json_object=True, param="response_format")
            return StructuredOutput(json_schema=value["schema"], param="response_format.schema")
    except StructuredOutputError as e:
        raise _bad(e) from None
    if isinstance(value, dict) and value.get("type") == "json_schema" and isinstance(value.get("json_schema"), dict):
        inner = value["json_schema"]
        for key, kind in (("strict", bool), ("name", str)):
            if inner.get(key) is not None and not isinstance(inner[key], kind):
                raise APIError(400, f"'response_format.json_schema.{key}' must be a {kind.__name__}",
                               param=f"response_format.json_schema.{key}")
    try:
        return StructuredOutput.from_response_format(value)
    except StructuredOutputError as e:
        raise _bad(e) from None


def _tool_choice(body: dict, tools: list | None) -> tuple[Any, str]:
    """(tool_choice as given, its kind: none, auto, required or named)."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if tools else "none"), ("auto" if tools else "none")
    if not tools and choice != "none":
        raise APIError(400, "'tool_choice' is only allowed when 'tools' are given", param="tool_choice")
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise APIError(400, f"'tool_choice' must be one of {list(TOOL_CHOICES)} or "
                           f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}", param="tool_choice")
        return choice, choice
    if not isinstance(choice, dict):
        raise APIError(400, "'tool_choice' must be a string or an object", param="tool_choice")
    return choice, "named"


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not tools:
        raise APIError(400, "'tools' must be a non-empty list of tool objects", param="tools")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        try:
            name, _ = parse_tool(tool, i)
        except StructuredOutputError as e:
            raise _bad(e) from None
        if name in names:
            raise APIError(400, f"'tools' has two functions named {name!r}", param=f"tools[{i}].function.name")
        names.add(name)
    return tools


def _template_kwargs(body: dict, fmt: ChatFormat, defaults: ChatDefaults) -> dict[str, Any]:
    """The request's template kwargs, with ``enable_thinking`` always set: the request's (a boolean), else the
    server's `--reasoning` for this template."""
    value = body.get("chat_template_kwargs")
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise APIError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS & set(value))
    if reserved:
        raise APIError(400, f"'chat_template_kwargs' may not set {reserved[0]!r}", param="chat_template_kwargs")
    thinking = value.get("enable_thinking")
    if thinking is None:
        thinking = defaults.enable_thinking(fmt.thinking_switch)
    elif not isinstance(thinking, bool):
        raise APIError(400, f"'chat_template_kwargs.enable_thinking' must be a boolean, got {kind_of(thinking)}",
                       param="chat_template_kwargs.enable_thinking")
    return {**value, "enable_thinking": thinking}


def _rendering(body: dict, messages: list[dict[str, Any]], defaults: ChatDefaults) -> tuple[bool, bool]:
    """(add_generation_prompt, continue_final_message): the body's (vLLM's and llama.cpp's flags) when it gives
    either, else llama.cpp's assistant prefill: a conversation that ends with an assistant message (one without
    tool calls) continues that message, unless the server runs with ``--no-prefill-assistant``."""
    add_generation = bool_field(body, "add_generation_prompt", default=True)
    cont = bool_field(body, "continue_final_message")
    if cont and add_generation:
        if body.get("add_generation_prompt") is not None:
            raise APIError(400, "'continue_final_message' and 'add_generation_prompt' cannot both be true",
                           param="continue_final_message")
        add_generation = False
    given = body.get("add_generation_prompt") is not None or body.get("continue_final_message") is not None
    last = messages[-1]
    if given or not defaults.prefill_assistant or last["role"] != "assistant" or last.get("tool_calls"):
        return add_generation, cont
    if len(messages) >= 2 and messages[-2]["role"] == "assistant":
        raise APIError(400, "Cannot have 2 or more assistant messages at the end of the list: the last assistant "
                       "message is continued (assistant prefill; the server's --no-prefill-assistant turns it off)",
                       param="messages")
    return False, True


def plan_chat(body: dict, messages: list[dict[str, Any]], fmt: ChatFormat,
              defaults: ChatDefaults = DEFAULTS) -> ChatPlan:
    """Check the chat a family's body converted to (`check_messages`, the one message check) and the request's
    tool, response-format, template and rendering fields (`defaults`: the server's `--reasoning` and assistant
    prefill), and plan its prompt and grammar; a 400 naming the field at fault."""
    check_messages(messages)
    add_generation, cont = _rendering(body, messages, defaults)
    tools = _tools(body)
    choice, kind = _tool_choice(body, tools)
    parallel = bool_field(body, "parallel_tool_calls", default=True)
    plan = ChatPlan(fmt, messages, template_kwargs=_template_kwargs(body, fmt, defaults), tool_choice=kind,
                    parallel_tool_calls=parallel, add_generation_prompt=add_generation, continue_final_message=cont)
    plan.spec = response_format_spec(body)
    if fmt.tools.channels and (plan.spec is not None or kind in ("required", "named")):
        field = "response_format" if plan.spec is not None else "tool_choice"
        raise APIError(400, f"'{field}' is not supported with this model's chat format ({fmt.tools.channels}); "
                       "ask without it (tool_choice 'auto' lets the model call tools)", param=field)
    offered = tools if kind != "none" else None  # tool_choice "none": the model is not shown the tools
    try:
        plan.messages = fmt.tools.prompt_messages(messages, offered, choice, parallel)
        plan.tools = offered if fmt.template_tools else None
        if offered:
            plan.tool_names = dict(parse_tool(t, i) for i, t in enumerate(offered))
            forced = None if fmt.tools.grammar is None else tool_call_grammar(
                offered, choice, parallel_tool_calls=parallel, format=fmt.tools.grammar.name)
            if forced is not None:  # required or named: the calls' grammar replaces any response_format
                plan.spec = forced
        if plan.spec is not None and plan.spec.reasoning_tags != fmt.tools.think_tags:
            # the grammar's reasoning gate lets the format's own reasoning block through first (Gemma 4's)
            plan.spec = replace(plan.spec, reasoning_tags=fmt.tools.think_tags)
    except StructuredOutputError as e:
        raise _bad(e) from None
    return plan


def render_plan(tokenizer: Any, plan: ChatPlan, add_generation_prompt: bool = True) -> str:
    """The prompt text of the plan's messages and tools; a template that rejects them is a 400 naming
    ``messages``."""
    try:
        return tokenizer.apply_chat_template(plan.messages, add_generation_prompt=add_generation_prompt,
                                             tools=plan.tools, **plan.template_kwargs)
    except Exception as exc:  # jinja2 errors (raise_exception in templates) and ValueError
        raise APIError(400, f"the chat template rejected the conversation: {exc}", param="messages") from exc


def render_chat(tokenizer: Any, plan: ChatPlan) -> str:
    """The prompt text of a planned conversation (its tools rendered as the chat endpoint renders them); with the
    plan's `continue_final_message` it ends right after the last message's content (no end-of-turn), so the model
    continues that message (transformers' rule; an empty last message: the turns before it, then the generation
    prompt, as llama.cpp continues one)."""
    if not plan.continue_final_message:
        return render_plan(tokenizer, plan, plan.add_generation_prompt)
    final = str(plan.messages[-1].get("content") or "").strip()
    if not final:
        return render_plan(tokenizer, replace(plan, messages=plan.messages[:-1]), add_generation_prompt=True)
    text = render_plan(tokenizer, plan, add_generation_prompt=False)
    cut = text.rfind(final)
    if cut < 0:
        raise APIError(400, "continue_final_message: the chat template does not keep the last message's text "
                       "verbatim, so it cannot be continued", param="continue_final_message")
    return text[: cut + len(final)]


def image_input(state: Any) -> dict[str, Any]:
    """`render_planned_chat`'s image keywords for a server's state: the model's vision (None: no mmproj) and the
    server's image policy (its limits and allowed sources)."""
    return {"vision": getattr(state.llm, "vision", None), "policy": state.config.images}


def render_planned_chat(tokenizer: Any, plan: ChatPlan, sampling_kwargs: dict[str, Any], vision: Any = None,
                        policy: Any = None) -> tuple[str, list[int]]:
    """Give the request's sampling options the plan's grammar and kept marker tokens, render the chat template on
    the plan's messages and tools (`render_chat`), and tokenize. Image parts (any API's shape, read into the chat
    by `gpullama.chat.messages.content_of`) are loaded under `policy`, encoded by `vision` (the model's mmproj)
    and come back with the ids (`gpullama.vision.prompt.PromptIds`); a 400 naming --mmproj without one."""
    if plan.spec is not None:
        sampling_kwargs["structured_output"] = plan.spec
    sampling_kwargs["preserved_token_ids"] = plan.preserved_token_ids
    messages, refs = chat_images(plan.messages)
    if not refs:
        text = render_chat(tokenizer, plan)
        return text, tokenizer.encode(text, add_special_tokens=False)
    if vision is None:
        raise APIError(400, f"'{refs[0].where}': this model reads no images: start the server with --mmproj FILE "
                       "(the model's vision projector, an mmproj GGUF)", param=refs[0].where)
    text = render_chat(tokenizer, replace(plan, messages=messages))
    return text, vision.prompt(text, refs, policy) if policy is not None else vision.prompt(text, refs)

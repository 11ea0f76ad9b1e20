"""Jinja chat templates rendered the way transformers' ``apply_chat_template`` renders them."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# A plain ChatML template, used when a GGUF carries no ``tokenizer.chat_template``. It accepts a message
# ``content`` given either as a string or as a list of ``{"type": "text", "text": ...}`` parts.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is not none %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Names a message's reasoning may come under; templates read the first (transformers aliases them the same way).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike jinja's own filter, this does not HTML-escape, and exposes json.dumps' options (as transformers does).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _dates() -> dict[str, str]:
    """The dates every render may read, as llama.cpp defines them (``common_chat_extra_context``): ``date_string``
    (today as ``26 Jul 2024``) and ``datetime`` (``Jul 26 2024``)."""
    now = datetime.now()
    return {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y")}


class _TemplateDict:
    """``dict`` as templates may call it, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's ``namespace`` refusing underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


class _GenerationTag(jinja2.ext.Extension):
    """Accept transformers' ``{% generation %}...{% endgeneration %}`` block; it renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON-like types (dataclasses and pydantic models become dicts)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    if callable(getattr(value, "item", None)):  # numpy / torch scalars
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as plain dicts without None-valued keys, reasoning aliased under every name templates read."""
    out = []
    for index, message in enumerate(_plain(list(messages))):
        if not isinstance(message, dict):
            raise ValueError(f"chat message {index} must be a dict with 'role' and 'content', got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


class ChatTemplate:
    """A compiled chat template; ``render`` matches transformers' ``apply_chat_template(..., tokenize=False)``."""

    def __init__(self, source: str, bos_token: str, eos_token: str, **special_tokens: str) -> None:
        if not isinstance(source, str) or not source:
            raise ValueError("chat template source must be a non-empty string")
        self.source = source
        self.special_tokens: dict[str, str] = {"bos_token": bos_token, "eos_token": eos_token, **special_tokens}
        self._thinking_switch: bool | None = None
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template syntax error at line {e.lineno}: {e.message}") from e

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, **extra: Any) -> str:
        """Render a conversation; a template error (e.g. ``raise_exception``) becomes ValueError with its message."""
        if tools is not None:
            for index, tool in enumerate(tools):
                if not isinstance(tool, Mapping):
                    raise ValueError(f"tool {index} must be a JSON schema dict, got {type(tool).__name__}")
        context = {**_dates(), **self.special_tokens, **_plain(extra)}
        try:
            return self._template.render(
                messages=_messages(messages),
                tools=_plain(tools),
                documents=_plain(context.pop("documents", None)),
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except jinja2.TemplateError as e:
            raise ValueError(str(e.message if e.message is not None else e)) from e
        except (TypeError, KeyError, AttributeError, IndexError) as e:
            raise ValueError(f"chat template failed to render: {type(e).__name__}: {e}") from e

    @property
    def thinking_switch(self) -> bool:
        """Whether the template's output depends on ``enable_thinking`` (Qwen3's, DeepSeek-R1's and QwQ's as
        llama.cpp ships them): a user turn, alone or after a system message, rendered with the generation prompt,
        with it true and false, differs."""
        if self._thinking_switch is None:
            turns = ([{"role": "user", "content": "test"}],
                     [{"role": "system", "content": "test"}, {"role": "user", "content": "test"}])
            switch = False
            for turn in turns:
                try:
                    on, off = (self.render(turn, enable_thinking=flag) for flag in (True, False))
                except ValueError:  # a template that cannot render this conversation: nothing to find there
                    continue
                switch = switch or on != off
            self._thinking_switch = switch
        return self._thinking_switch

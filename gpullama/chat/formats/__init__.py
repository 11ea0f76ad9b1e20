"""The tool-call formats, one module each (markers, template detection, prompt, parser, the grammar's text form).

A new format is one module defining a `ChatToolFormat` named ``FORMAT`` (DSML's module defines two, V3.2's and
V4's), listed in `FORMATS` (detection tries them in order; the generic format, last, takes any template). Its
forced calls need its text form in `gpullama.structured.tools.TOOL_CALL_FORMATS`, which the grammar engine (a lower
layer) reads.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpullama.chat.formats import deepseek, dsml, gemma4, generic, glm45, harmony, hermes, llama3, mistral, qwen3_coder
from gpullama.chat.formats.base import ChatToolFormat, call_arguments, template_messages
from gpullama.chat.formats.deepseek import DeepSeekToolParser
from gpullama.chat.formats.dsml import DsmlToolParser
from gpullama.chat.formats.gemma4 import Gemma4ToolParser
from gpullama.chat.formats.generic import GenericToolParser, generic_messages, generic_tool_prompt
from gpullama.chat.formats.glm45 import Glm45ToolParser
from gpullama.chat.formats.hermes import HermesToolParser
from gpullama.chat.formats.llama3 import Llama3ToolParser
from gpullama.chat.formats.mistral import MistralToolParser
from gpullama.chat.formats.qwen3_coder import Qwen3CoderToolParser
from gpullama.chat.tool_calls import ToolParser

FORMATS: tuple[ChatToolFormat, ...] = (harmony.FORMAT, dsml.V3_2, dsml.V4, gemma4.FORMAT, qwen3_coder.FORMAT,
                                       glm45.FORMAT, hermes.FORMAT, deepseek.FORMAT, mistral.FORMAT, llama3.FORMAT,
                                       generic.FORMAT)
"""Every format, in the order template detection tries them."""

FORMAT_BY_NAME: dict[str, ChatToolFormat] = {f.name: f for f in FORMATS}
PARSERS: dict[str, type[ToolParser]] = {f.name: f.parser for f in FORMATS if issubclass(f.parser, ToolParser)}
"""The tool-call parsers (harmony's parser reads the whole output, reasoning included: not one of them)."""


def format_for_template(source: str | None) -> ChatToolFormat:
    """The tool-call format a chat template's source is written for (the generic one when none is)."""
    return next(f for f in FORMATS if f.detects(source or ""))


def parser_name_for_template(source: str | None) -> str:
    """The name of the tool-call format a chat template's source uses: harmony, deepseek_v3_2, deepseek_v4, gemma4,
    qwen3_coder, glm45, hermes, deepseek, llama3, mistral, or generic."""
    return format_for_template(source).name


def parser_for_template(source: str | None, tool_names: Iterable[str] | None = None) -> ToolParser:
    """A fresh parser of the format the chat template `source` uses (see `format_for_template`)."""
    return format_for_template(source).parser(tool_names)


__all__ = [
    "FORMATS", "FORMAT_BY_NAME", "PARSERS", "ChatToolFormat", "DeepSeekToolParser", "DsmlToolParser", "Gemma4ToolParser", "GenericToolParser", "Glm45ToolParser", "HermesToolParser",
    "Llama3ToolParser", "MistralToolParser", "Qwen3CoderToolParser", "call_arguments", "format_for_template", "generic_messages",
    "generic_tool_prompt", "parser_for_template", "parser_name_for_template", "template_messages",
]

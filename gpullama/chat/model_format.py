"""The chat format of one model: its template's tool-call format, whether it reasons in ``<think>`` blocks, and
which of those formats' markers its vocabulary holds as special tokens."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any

from gpullama.chat.formats import FORMAT_BY_NAME, ChatToolFormat, format_for_template


@dataclass(frozen=True)
class ChatFormat:
    """What a model's chat template and vocabulary support: its tool-call format (harmony, hermes, llama3, mistral
    or generic), whether the template renders tools itself, whether the model reasons in <think> blocks, which
    of the format's markers are special tokens of the vocabulary (the detokenizer drops special tokens unless
    told to keep them, and the parsers must see these), and whether the template reads ``enable_thinking``."""

    tool_format: str
    template_tools: bool
    reasoning: bool
    tool_marker_ids: tuple[int, ...] = ()  # the tool-call format's markers ([TOOL_CALLS], <|python_tag|>)
    reasoning_marker_ids: tuple[int, ...] = ()  # <think> and </think>
    thinking_switch: bool = False  # the template's output depends on enable_thinking (Qwen3, DeepSeek-R1, QwQ)

    @property
    def tools(self) -> ChatToolFormat:
        """The tool-call format itself (parser, prompt, grammar form)."""
        return FORMAT_BY_NAME[self.tool_format]


_formats: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_formats_lock = threading.Lock()


def chat_format(tokenizer: Any) -> ChatFormat:
    """The chat format of `tokenizer` (computed once per tokenizer). A model reasons when its vocabulary has
    <think> and </think> as single tokens or its template speaks of its format's closing tag (</think>: Qwen3,
    DeepSeek-R1 distills; <channel|>: Gemma 4)."""
    with _formats_lock:
        found = _formats.get(tokenizer)
    if found is None:
        from gpullama.structured.reasoning_gate import reasoning_token_ids  # imports torch: not for --help

        source = tokenizer.chat_template.source
        tools = format_for_template(source)
        ids = sorted(tokenizer.special_token_ids)
        special = dict(zip(tokenizer.convert_ids_to_tokens(ids), ids))
        markers = tuple(special[m] for m in tools.token_markers if m in special)
        switch = tokenizer.chat_template.thinking_switch
        if tools.channels:  # gpt-oss: channels carry the reasoning, the answer and the calls
            found = ChatFormat(tools.name, tools.template_tools, True, (), markers, switch)
        else:
            reasoning = tools.think_tags[1] in source or reasoning_token_ids(tokenizer) is not None
            # the special tokens that spell the reasoning tags (<think>, </think>; Gemma 4's <|channel>, <channel|>)
            think = tuple(i for m, i in special.items() if len(m) > 2 and any(m in t for t in tools.think_tags))
            found = ChatFormat(tools.name, tools.template_tools, reasoning, markers, think, switch)
        with _formats_lock:
            _formats[tokenizer] = found
    return found

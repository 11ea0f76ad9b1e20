"""The chat plan's rendering choices against llama.cpp's real templates (its ``models/templates``, fetched by the
test fixture): ``--reasoning`` on, off and auto give each template the ``enable_thinking`` llama.cpp gives it (the
prompt ends as llama-server's does), a request's ``chat_template_kwargs.enable_thinking`` wins, and assistant prefill
continues a last assistant message (two at the end are refused)."""

from __future__ import annotations

import pytest

from gpullama.chat.model_format import ChatFormat
from gpullama.chat_template import ChatTemplate
from gpullama.server.http.errors import APIError
from gpullama.server.pipeline.chat_plan import plan_chat, render_chat
from gpullama.server.state import ChatDefaults
from tests.fixtures.llamacpp_source import llamacpp_source

USER = [{"role": "user", "content": "What is 2 + 2?"}]


class Templated:
    """The part of a tokenizer the chat plan renders with."""

    def __init__(self, name: str) -> None:
        source = (llamacpp_source() / "models" / "templates" / name).read_text(encoding="utf-8")
        self.chat_template = ChatTemplate(source, "<s>", "</s>")
        self.format = ChatFormat("generic", template_tools=False, reasoning=True,
                                 thinking_switch=self.chat_template.thinking_switch)

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None, **extra) -> str:
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra)

    def render(self, reasoning: str = "auto", body: dict | None = None, messages=USER, prefill: bool = True) -> str:
        plan = plan_chat(body or {}, messages, self.format, ChatDefaults(reasoning, prefill))
        return render_chat(self, plan)


R1 = "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
QWEN3 = "Qwen-Qwen3-0.6B.jinja"
QWQ = "Qwen-QwQ-32B.jinja"


@pytest.mark.parametrize("name, mode, ending", [
    (R1, "on", "<｜Assistant｜><think>\n"), (R1, "auto", "<｜Assistant｜><think>\n"),
    (R1, "off", "<｜Assistant｜><think>\n</think>"),
    (QWEN3, "on", "<|im_start|>assistant\n"), (QWEN3, "auto", "<|im_start|>assistant\n"),
    (QWEN3, "off", "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    (QWQ, "auto", "<|im_start|>assistant\n<think>\n"), (QWQ, "off", "<|im_start|>assistant\n<think>\n</think>"),
])
def test_reasoning_switch_ends_the_prompt_as_llamacpp_does(name: str, mode: str, ending: str) -> None:
    assert Templated(name).render(mode).endswith(ending)


def test_a_requests_enable_thinking_wins_and_must_be_a_boolean() -> None:
    qwen3 = Templated(QWEN3)
    assert qwen3.render("on", {"chat_template_kwargs": {"enable_thinking": False}}).endswith("</think>\n\n")
    assert qwen3.render("off", {"chat_template_kwargs": {"enable_thinking": True}}).endswith("assistant\n")
    for value in ("false", 0, [], {}):
        with pytest.raises(APIError) as info:
            qwen3.render("auto", {"chat_template_kwargs": {"enable_thinking": value}})
        assert info.value.status == 400 and info.value.param == "chat_template_kwargs.enable_thinking"


def test_a_template_without_the_switch_renders_the_same_in_every_mode() -> None:
    llama = Templated("meta-llama-Llama-3.1-8B-Instruct.jinja")
    assert not llama.format.thinking_switch
    assert llama.render("on") == llama.render("off") == llama.render("auto")


PREFILL = [*USER, {"role": "assistant", "content": "The answer is"}]
LLAMA3 = "meta-llama-Llama-3.1-8B-Instruct.jinja"
ASSISTANT = "<|start_header_id|>assistant<|end_header_id|>\n\n"


def test_a_last_assistant_message_is_continued() -> None:
    llama = Templated(LLAMA3)
    assert llama.render(messages=PREFILL).endswith(ASSISTANT + "The answer is")
    whole = llama.render(messages=PREFILL, prefill=False)  # --no-prefill-assistant: a whole turn, then a new one
    assert whole.endswith("The answer is<|eot_id|>" + ASSISTANT)
    # the request's own rendering flags win over the prefill
    assert llama.render(messages=PREFILL, body={"add_generation_prompt": True}) == whole
    assert llama.render(messages=[*USER, {"role": "assistant", "content": ""}]) == llama.render()


def test_two_assistant_messages_at_the_end_are_a_400_naming_the_rule() -> None:
    llama = Templated(LLAMA3)
    messages = [*PREFILL, {"role": "assistant", "content": "four"}]
    with pytest.raises(APIError) as info:
        llama.render(messages=messages)
    assert info.value.status == 400 and info.value.param == "messages"
    assert "Cannot have 2 or more assistant messages at the end of the list" in info.value.message
    assert llama.render(messages=messages, prefill=False).endswith("four<|eot_id|>" + ASSISTANT)


@pytest.mark.parametrize("fmt, tags", [("gemma4", ("<|channel>thought", "<channel|>")),
                                       ("deepseek_v3_2", ("<think>", "</think>")),
                                       ("qwen3_coder", ("<think>", "</think>"))])
@pytest.mark.parametrize("body", [{"tool_choice": "required"}, {"tool_choice": {"type": "function", "function": {
    "name": "now"}}}, {"response_format": {"type": "json_object"}}])
def test_the_grammar_gates_on_the_formats_own_reasoning_tags(fmt, tags, body) -> None:
    """A forced call's or a response_format's grammar lets the format's reasoning block through first (its
    ``think_tags``: Gemma 4's channel, ``<think>`` elsewhere)."""
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    plan = plan_chat({"tools": tools, **body}, USER, ChatFormat(fmt, template_tools=True, reasoning=True))
    assert plan.spec is not None and plan.spec.reasoning and plan.spec.reasoning_tags == tags

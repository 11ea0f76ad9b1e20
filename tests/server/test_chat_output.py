"""The chat side of structured output without a model: request planning (tools into the prompt, the grammar,
template kwargs) and the answer split into reasoning, content and tool calls, streamed chunks accumulating (with
the openai SDK's own stream state) to the whole answer for every split of the text."""

from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from gpullama.chat.model_format import ChatFormat, chat_format
from gpullama.chat_template import ChatTemplate
from gpullama.server.http.errors import APIError
from gpullama.server.openai.choices import ChunkBuilder, chat_completion
from gpullama.server.pipeline.chat_output import ChatOutputShaper
from gpullama.server.pipeline.chat_plan import plan_chat
from gpullama.structured import StructuredOutput
from gpullama.tokenizer import Tokenizer
from tests.chat.test_tool_parsers import (
    CONVERSATION,
    QWEN25_TOOLS_TEMPLATE,
    QWEN_CODER_BARE,
    QWEN_CODER_FENCED,
    TOOLS,
)
from tests.fixtures.vocabs import vocab_metadata

HERMES_REASONING = ChatFormat("hermes", template_tools=True, reasoning=True)
GENERIC = ChatFormat("generic", template_tools=False, reasoning=False)
USER = [{"role": "user", "content": "Weather in Paris?"}]
THINK_AND_CALL = ('<think>\nThe user wants the weather. <tool_call>{"name": "add", "arguments": {}}</tool_call> is '
                  'not it.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                  '"Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, '
                  '"b": 2}}\n</tool_call>')
QWEN3_THINKING_SNIPPET = (  # how Qwen3's template ends the generation prompt
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "<|im_start|>assistant\n{%- if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{%- endif %}")


def _whole(shaper: ChatOutputShaper, text: str, reason: str = "stop") -> ChatCompletion:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason, "offset": 0,
              "message": shaper.message(0, text)}
    choice["finish_reason"] = shaper.finish_reason(0, reason)
    return ChatCompletion.model_validate(chat_completion("id", 0, "m", [choice], {
        "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}))


def _streamed(shaper: ChatOutputShaper, pieces: list[str], reason: str = "stop"):
    """The chunks the server sends for these pieces, fed to the SDK's stream state; also the raw chunks."""
    chunks = ChunkBuilder(True, "id", 0, "m", False)
    sent = [chunks.role(0)]
    for piece in pieces:
        fields = shaper.delta(0, piece)
        if fields:
            sent.append(chunks.fields(0, fields, None))
    rest = shaper.finish(0)
    if rest:
        sent.append(chunks.fields(0, rest, None))
    sent.append(chunks.finish(0, shaper.finish_reason(0, reason)))
    state = ChatCompletionStreamState()
    for chunk in sent:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    return state.get_final_completion(), sent


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_reasoning_content_and_tool_calls_whole_and_streamed_at_every_split():
    """Reasoning goes to reasoning_content (and reasoning), a call written inside it stays reasoning text, the
    answer's calls become tool_calls with finish_reason "tool_calls"; every two-piece split streams to the same."""
    plan = plan_chat({"tools": TOOLS}, USER, HERMES_REASONING)
    whole = _whole(ChatOutputShaper(plan, "prompt"), THINK_AND_CALL)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check."
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning.startswith("The user wants") and '<tool_call>{"name": "add"' in reasoning
    assert message.model_extra["reasoning"] == reasoning
    assert _calls(message) == [("get_weather", {"city": "Paris", "unit": "celsius"}), ("add", {"a": 1, "b": 2})]
    for cut in range(len(THINK_AND_CALL) + 1):
        streamed, sent = _streamed(ChatOutputShaper(plan, "prompt"), [THINK_AND_CALL[:cut], THINK_AND_CALL[cut:]])
        got = streamed.choices[0]
        assert got.finish_reason == "tool_calls" and got.message.content == message.content
        assert _calls(got.message) == _calls(message)
        assert "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in sent) == reasoning


QWEN_CODER = ChatFormat("hermes", template_tools=True, reasoning=False)


@pytest.mark.parametrize("text", [QWEN_CODER_BARE, QWEN_CODER_FENCED, "I'll check.\n" + QWEN_CODER_FENCED])
def test_qwen_coder_calls_without_the_tag_reach_the_client_as_tool_calls(text):
    """Qwen2.5-Coder's auto tool call (bare JSON or a ```json fence, no <tool_call> tag) is a tool call, whole and
    streamed at every split, read back by the openai SDK; the same JSON without tools offered stays content."""
    plan = plan_chat({"tools": TOOLS, "tool_choice": "auto"}, USER, QWEN_CODER)
    whole = _whole(ChatOutputShaper(plan, "prompt"), text).choices[0]
    assert whole.finish_reason == "tool_calls" and _calls(whole.message) == [("get_weather", {"city": "Paris"})]
    assert whole.message.content == ("I'll check." if text.startswith("I'll") else None)
    for cut in range(len(text) + 1):
        streamed, _ = _streamed(ChatOutputShaper(plan, "prompt"), [text[:cut], text[cut:]])
        got = streamed.choices[0]
        assert got.finish_reason == "tool_calls" and _calls(got.message) == _calls(whole.message), cut
        assert (got.message.content or None) == whole.message.content  # the role chunk carries content ""
    without_tools = plan_chat({}, USER, QWEN_CODER)
    assert _whole(ChatOutputShaper(without_tools, "prompt"), text).choices[0].message.content == text


def test_prompt_opened_reasoning_and_template_kwargs():
    """chat_template_kwargs reach the template (Qwen3's enable_thinking closes the block in the prompt); a prompt
    that leaves the block open makes the output start as reasoning."""
    template = ChatTemplate(QWEN3_THINKING_SNIPPET, "", "<|im_end|>")
    plan = plan_chat({"chat_template_kwargs": {"enable_thinking": False}}, USER, HERMES_REASONING)
    closed = template.render(plan.messages, tools=plan.tools, **plan.template_kwargs)
    assert closed.endswith("<think>\n\n</think>") and "<think>" not in template.render(plan.messages)
    answer = _whole(ChatOutputShaper(plan, closed), "Sunny.").choices[0].message
    assert answer.content == "Sunny." and answer.model_extra["reasoning_content"] is None
    opened = _whole(ChatOutputShaper(plan, "<|im_start|>assistant\n<think>\n"), "hmm, sun?\n</think>\n\nSunny.")
    assert opened.choices[0].message.content == "Sunny."
    assert opened.choices[0].message.model_extra["reasoning_content"] == "hmm, sun?"


def test_named_and_single_call_choices():
    """A named choice ends with "stop"; without parallel_tool_calls only the first call counts; a forced choice
    never shows text outside its calls as content (a call cut by max_tokens)."""
    named = plan_chat({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
                      USER, HERMES_REASONING)
    assert named.spec.tool_calls.tools[0][0] == "get_weather" and not named.spec.tool_calls.parallel
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice", "unit": "celsius"}}\n</tool_call>'
    out = _whole(ChatOutputShaper(named, ""), text).choices[0]
    assert out.finish_reason == "stop" and _calls(out.message) == [("get_weather", {"city": "Nice", "unit": "celsius"})]
    single = plan_chat({"tools": TOOLS, "parallel_tool_calls": False}, USER, HERMES_REASONING)
    two = text + "\n" + text.replace("Nice", "Pau")
    out = _whole(ChatOutputShaper(single, ""), two).choices[0]
    assert [a["city"] for _, a in _calls(out.message)] == ["Nice"]
    streamed, _ = _streamed(ChatOutputShaper(single, ""), list(two))
    assert _calls(streamed.choices[0].message) == _calls(out.message)
    required = plan_chat({"tools": TOOLS, "tool_choice": "required"}, USER, HERMES_REASONING)
    cut = _whole(ChatOutputShaper(required, ""), text + '\n<tool_call>\n{"na', "length").choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None and len(cut.message.tool_calls) == 1


def test_plans_for_templates_with_and_without_tool_support():
    """A template with tool support gets the tools and the calls' arguments as objects; the generic one gets the
    tool prompt; "none" offers no tools and reads no calls; forced choices get a grammar in the template's format,
    which replaces response_format."""
    plan = plan_chat({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                     CONVERSATION, HERMES_REASONING)
    assert plan.tools == TOOLS and list(plan.tool_names) == ["get_weather", "add"]
    assert plan.messages[1]["tool_calls"][1]["function"]["arguments"] == {"a": 2, "b": 3}
    assert plan.spec.kind == "tool_calls" and plan.spec.tool_calls.format == "hermes" and plan.spec.tool_calls.parallel
    prompt = ChatTemplate(QWEN25_TOOLS_TEMPLATE, "", "<|im_end|>").render(plan.messages, tools=plan.tools)
    assert '"name": "get_weather"' in prompt and "<tool_response>" in prompt
    generic = plan_chat({"tools": TOOLS, "response_format": {"type": "json_object"}}, CONVERSATION, GENERIC)
    assert generic.tools is None and generic.messages[0]["role"] == "system"
    assert "You can call tools" in generic.messages[0]["content"]
    assert generic.spec == StructuredOutput(json_object=True)  # auto: the response_format grammar stays
    none = plan_chat({"tools": TOOLS, "tool_choice": "none"}, CONVERSATION, GENERIC)
    assert none.tool_names is None and none.spec is None and "You can call tools" not in str(none.messages)
    assert not ChatOutputShaper(none, "").active


@pytest.mark.parametrize("body, param", [
    ({"tools": []}, "tools"),
    ({"tools": TOOLS, "tool_choice": 3}, "tool_choice"),
    ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": "json"}, "response_format"),
])
def test_more_bad_fields(body, param):
    with pytest.raises(APIError) as info:
        plan_chat(body, USER, GENERIC)
    assert info.value.status == 400 and info.value.param == param


def test_chat_format_of_vocabularies(default_model_path):
    """SmolLM2's template has no tool support and the model does not reason; a vocabulary with single-token
    <think> tags reasons; a template speaking of </think> does too."""
    from gpullama.gguf_file import read_gguf

    smollm = Tokenizer.from_metadata(read_gguf(str(default_model_path)).metadata)
    assert chat_format(smollm) == ChatFormat("generic", False, False)
    assert chat_format(Tokenizer.from_metadata(vocab_metadata("qwen2"))).reasoning
    meta = dict(vocab_metadata("gpt2-smollm"), **{"tokenizer.chat_template": QWEN25_TOOLS_TEMPLATE + "</think>"})
    assert chat_format(Tokenizer.from_metadata(meta)) == ChatFormat("hermes", True, True)


"""Chat templates rendered equal to transformers' ``apply_chat_template(..., tokenize=False)``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jinja2
import pytest
import transformers

from gpullama.chat_template import CHATML_TEMPLATE, ChatTemplate
from gpullama.tokenizer import Tokenizer
from tests.fixtures.vocabs import CHATML_TEMPLATE as SMOLLM2_TEMPLATE
from tests.fixtures.vocabs import GEMMA_TEMPLATE, HARMONY_TEMPLATE, vocab_metadata, write_tokenizer_gguf

# Llama 2 style: a system-prompt branch, bos/eos tokens, and raise_exception on non-alternating roles.
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}"
    "{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

# Tools, tojson with options, strftime_now, namespace, loop controls, {% generation %}, list contents, tool calls.
TOOLS_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(system='You are a helpful assistant.', n=0) %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] %}
{%- endif %}
<|im_start|>system
{{ ns.system }} Year: {{ strftime_now('%Y') }}
{%- if tools %}

# Tools
{% for tool in tools %}
{{ tool | tojson(indent=2) }}
{% endfor %}
{%- endif %}<|im_end|>
{% for message in messages %}
    {%- if message['role'] == 'system' %}{% continue %}{% endif %}
    {%- set ns.n = ns.n + 1 %}
<|im_start|>{{ message['role'] }}
{% if message['content'] is string %}{{ message['content'] }}
{%- elif message['content'] is not none %}{% for part in message['content'] %}
    {%- if part['type'] == 'text' %}{{ part['text'] }}{% endif %}
    {%- if loop.index >= 3 %}{% break %}{% endif %}
{%- endfor %}{% endif %}
{%- if message['role'] == 'assistant' %}{% generation %}{% if message.get('reasoning_content') %}<think>{{ message['reasoning_content'] }}</think>{% endif %}{% endgeneration %}{% endif %}
{%- if message.get('tool_calls') %}{% for call in message['tool_calls'] %}
<tool_call>{{ {'name': call['function']['name'], 'arguments': call['function']['arguments']} | tojson }}</tool_call>
{%- endfor %}{% endif %}
{%- if 'tool_calls' in message and message['tool_calls'] is none %}NONE-LEAKED{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>
{% endif %}{% endif %}
{{- '(' ~ ns.n ~ ' turns)' }}"""

# Phi-3 style (written for these tests): <|role|> headers, <|end|> after each turn, EOS when not generating.
PHI3_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and message['content'] %}{{ '<|system|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '<|end|>\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + '<|end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

# Granite 3.x style (written for these tests): a dated default system prompt, tools as an `available_tools` turn.
GRANITE_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = "Knowledge Cutoff Date: April 2024.\nToday's Date: " + strftime_now('%B %d, %Y') + ".\nYou are Granite." %}
    {%- if tools %}{%- set system_message = system_message + " You can call these tools." %}{%- endif %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\n' }}
{%- if tools %}{{- '<|start_of_role|>available_tools<|end_of_role|>' + tools | tojson(indent=4) + '<|end_of_text|>\n' }}{%- endif %}
{%- for message in loop_messages %}
    {{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\n' }}
    {%- if loop.last and add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}
{%- endfor %}"""

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "  And 3+3? \n"}],
    [{"role": "user", "content": "Héllo 你好 😀"}, {"role": "assistant", "content": "Salut!"},
     {"role": "user", "content": "<|im_start|> is special"}],
]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city, in °C.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
]


@pytest.fixture(scope="module")
def refs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """transformers' tokenizers (the reference) for the gpt2-smollm (ChatML), llama-spm and gemma-spm vocabularies."""
    root = tmp_path_factory.mktemp("chat_ggufs")
    out = {}
    for kind, arch in (("gpt2-smollm", "llama"), ("llama-spm", "llama"), ("gemma-spm", "gemma3"),
                       ("harmony", "llama")):
        path = Path(write_tokenizer_gguf(str(root / f"{kind}.gguf"), vocab_metadata(kind), arch))
        out[kind] = transformers.AutoTokenizer.from_pretrained(str(root), gguf_file=path.name)
    return out


def _ours(kind: str, template: str) -> Tokenizer:
    return Tokenizer.from_metadata(vocab_metadata(kind) | {"tokenizer.chat_template": template})


@pytest.mark.parametrize("kind,template", [
    ("gpt2-smollm", SMOLLM2_TEMPLATE), ("llama-spm", LLAMA2_TEMPLATE), ("gpt2-smollm", TOOLS_TEMPLATE),
    ("llama-spm", TOOLS_TEMPLATE), ("gpt2-smollm", CHATML_TEMPLATE), ("llama-spm", PHI3_TEMPLATE),
    ("gemma-spm", GEMMA_TEMPLATE), ("gpt2-smollm", GRANITE_TEMPLATE), ("harmony", HARMONY_TEMPLATE),
])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_matches_transformers(kind: str, template: str, add_generation_prompt: bool,
                                     refs: dict[str, Any]) -> None:
    tok, ref = _ours(kind, template), refs[kind]
    assert tok.has_chat_template
    for chat in CHATS:
        want = ref.apply_chat_template(chat, chat_template=template, tokenize=False,
                                       add_generation_prompt=add_generation_prompt)
        assert tok.apply_chat_template(chat, add_generation_prompt=add_generation_prompt) == want


def test_smollm2_template_is_the_gguf_one(refs: dict[str, Any]) -> None:
    # transformers reads the template from the GGUF itself; no chat_template argument
    ref = refs["gpt2-smollm"]
    tok = Tokenizer.from_metadata(vocab_metadata("gpt2-smollm"))
    for chat in CHATS:
        assert tok.apply_chat_template(chat) == ref.apply_chat_template(chat, tokenize=False,
                                                                         add_generation_prompt=True)


def test_gemma_template_is_the_gguf_one(refs: dict[str, Any]) -> None:
    # transformers reads the Gemma vocabulary's template from the GGUF: `model` turns, BOS written by the template
    ref, tok = refs["gemma-spm"], Tokenizer.from_metadata(vocab_metadata("gemma-spm"))
    for chat in CHATS:
        want = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(chat) == want
        assert want.startswith("<bos><start_of_turn>user\n") and want.endswith("<start_of_turn>model\n")
    chat = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ValueError, match="roles must alternate"):
        tok.apply_chat_template(chat)


def test_granite_template_with_tools(refs: dict[str, Any]) -> None:
    ref, tok = refs["gpt2-smollm"], _ours("gpt2-smollm", GRANITE_TEMPLATE)
    want = ref.apply_chat_template(CHATS[0], chat_template=GRANITE_TEMPLATE, tools=TOOLS, tokenize=False,
                                   add_generation_prompt=True)
    got = tok.apply_chat_template(CHATS[0], tools=TOOLS)
    assert got == want and "<|start_of_role|>available_tools<|end_of_role|>" in got


def test_harmony_template_with_tools_reasoning_and_calls(refs: dict[str, Any]) -> None:
    """gpt-oss's format (the harmony vocabulary's GGUF template): tools in a developer message, reasoning in the
    analysis channel, calls to functions in commentary, tool results from functions.NAME; text and token ids as
    transformers renders and encodes them."""
    ref, tok = refs["harmony"], Tokenizer.from_metadata(vocab_metadata("harmony"))
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "reasoning_content": "call the tool",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "name": "get_weather", "content": "{\"temp\": 21}"},
        {"role": "assistant", "content": "21 °C.", "reasoning_content": "report it"},
        {"role": "user", "content": "Thanks"},
    ]
    want = ref.apply_chat_template(chat, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    got = tok.apply_chat_template(chat, tools=TOOLS)
    assert got == want
    assert "<|channel|>analysis<|message|>call the tool<|end|>" in got and got.endswith("<|start|>assistant")
    assert "to=functions.get_weather<|channel|>commentary json<|message|>" in got
    assert tok.encode(got) == ref.encode(want, add_special_tokens=False)


def test_tools_list_content_and_extra_kwargs(refs: dict[str, Any]) -> None:
    ref, tok = refs["gpt2-smollm"], _ours("gpt2-smollm", TOOLS_TEMPLATE)
    chat = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "image"},
                                     {"type": "text", "text": "Paris?"}, {"type": "text", "text": "(cut)"}]},
        {"role": "assistant", "content": None, "reasoning_content": "call the tool",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}", "tool_calls": None},
        {"role": "assistant", "content": "21 °C.", "thinking": "old field name"},
    ]
    for extra in ({}, {"enable_thinking": False}):
        want = ref.apply_chat_template(chat, chat_template=TOOLS_TEMPLATE, tools=TOOLS, tokenize=False,
                                       add_generation_prompt=True, **extra)
        got = tok.apply_chat_template(chat, tools=TOOLS, **extra)
        assert got == want
        assert '"name": "get_weather"' in got and "°C" in got and "NONE-LEAKED" not in got
    assert "<think>" in tok.apply_chat_template(chat[:1], enable_thinking=False)


def test_raise_exception_becomes_value_error(refs: dict[str, Any]) -> None:
    chat = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(jinja2.TemplateError) as want:
        refs["llama-spm"].apply_chat_template(chat, chat_template=LLAMA2_TEMPLATE, tokenize=False)
    with pytest.raises(ValueError) as got:
        _ours("llama-spm", LLAMA2_TEMPLATE).apply_chat_template(chat)
    assert str(got.value) == str(want.value) == "Conversation roles must alternate user/assistant/user/assistant/..."


def test_list_content_in_a_string_only_template_is_a_value_error() -> None:
    tok = _ours("gpt2-smollm", SMOLLM2_TEMPLATE)
    chat = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    with pytest.raises(ValueError, match="chat template failed to render"):
        tok.apply_chat_template(chat)


def test_chatml_fallback_warns_and_renders(caplog: pytest.LogCaptureFixture, refs: dict[str, Any]) -> None:
    meta = vocab_metadata("gpt2-smollm")
    del meta["tokenizer.chat_template"]
    with caplog.at_level(logging.WARNING, logger="gpullama"):
        tok = Tokenizer.from_metadata(meta)
    assert any(r.name == "gpullama" and "ChatML" in r.getMessage() for r in caplog.records)
    assert not tok.has_chat_template
    chat = CHATS[2]
    want = refs["gpt2-smollm"].apply_chat_template(chat, chat_template=CHATML_TEMPLATE, tokenize=False,
                                                   add_generation_prompt=True)
    assert tok.apply_chat_template(chat) == want == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n<|im_start|>user\n  And 3+3? \n<|im_end|>\n<|im_start|>assistant\n"
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.apply_chat_template(parts, add_generation_prompt=False) == "<|im_start|>user\nab<|im_end|>\n"


def test_chat_template_errors_and_sandbox() -> None:
    with pytest.raises(ValueError, match="syntax error at line 1"):
        ChatTemplate("{% for m in messages %}", "<s>", "</s>")
    with pytest.raises(ValueError, match="non-empty"):
        ChatTemplate("", "<s>", "</s>")
    with pytest.raises(ValueError, match="tool 0"):
        ChatTemplate("{{ tools }}", "<s>", "</s>").render([], tools=[print])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="message 0"):
        ChatTemplate("x", "<s>", "</s>").render(["not a dict"])  # type: ignore[list-item]
    with pytest.raises(ValueError):  # the immutable sandbox refuses to mutate inputs
        ChatTemplate("{{ messages.append(1) }}", "<s>", "</s>").render([])
    with pytest.raises(ValueError, match="underscore"):
        ChatTemplate("{% set ns = namespace(_x=1) %}", "<s>", "</s>").render([])
    rendered = ChatTemplate("{{ bos_token }}{{ {'a': '<b>é'} | tojson }}{{ eos_token }}", "<s>", "</s>").render([])
    assert rendered == '<s>{"a": "<b>é"}</s>'

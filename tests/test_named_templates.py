"""llama.cpp's built-in chat templates by name (`gpullama.named_templates`) and the context every render gets: each
name renders llama.cpp's test conversation exactly as its ``tests/test-chat-template.cpp`` expects
(``llama_chat_apply_template``'s output), ``--chat-template NAME`` takes them, ``date_string`` and ``datetime`` are
today in llama.cpp's formats, and `ChatTemplate.thinking_switch` finds the real templates that read
``enable_thinking``."""

from __future__ import annotations

import argparse
from datetime import datetime

import pytest

from gpullama.chat_template import ChatTemplate
from gpullama.engine.args import EngineArgs
from gpullama.named_templates import NAMED_TEMPLATES
from tests.fixtures.llamacpp_source import llamacpp_source

# the conversation of llama.cpp's tests/test-chat-template.cpp, and what each built-in writes for it
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Who are you"},
    {"role": "assistant", "content": "   I am an assistant   "},
    {"role": "user", "content": "Another question"},
]
EXPECTED = {
    "chatml": "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
    "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n<|im_start|>assistant\n"
    "   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother question<|im_end|>\n<|im_start|>assistant\n",
    "llama2": "[INST] You are a helpful assistant\nHello [/INST]Hi there</s>[INST] Who are you [/INST]   I am an "
    "assistant   </s>[INST] Another question [/INST]",
    "llama2-sys-bos": "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s><s>[INST] Who "
    "are you [/INST]   I am an assistant   </s><s>[INST] Another question [/INST]",
    "llama2-sys-strip": "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s>[INST] Who "
    "are you [/INST]I am an assistant</s>[INST] Another question [/INST]",
    "monarch": "system\nYou are a helpful assistant</s>\n<s>user\nHello</s>\n<s>assistant\nHi there</s>\n<s>user\n"
    "Who are you</s>\n<s>assistant\n   I am an assistant   </s>\n<s>user\nAnother question</s>\n<s>assistant\n",
    "gemma": "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>model\nHi there"
    "<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\nI am an assistant"
    "<end_of_turn>\n<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n",
    "orion": "Human: You are a helpful assistant\n\nHello\n\nAssistant: </s>Hi there</s>Human: Who are you\n\n"
    "Assistant: </s>   I am an assistant   </s>Human: Another question\n\nAssistant: </s>",
    "openchat": "You are a helpful assistant<|end_of_turn|>GPT4 Correct User: Hello<|end_of_turn|>GPT4 Correct "
    "Assistant: Hi there<|end_of_turn|>GPT4 Correct User: Who are you<|end_of_turn|>GPT4 Correct Assistant:    I am "
    "an assistant   <|end_of_turn|>GPT4 Correct User: Another question<|end_of_turn|>GPT4 Correct Assistant:",
    "deepseek": "You are a helpful assistant### Instruction:\nHello\n### Response:\nHi there\n<|EOT|>\n### "
    "Instruction:\nWho are you\n### Response:\n   I am an assistant   \n<|EOT|>\n### Instruction:\nAnother "
    "question\n### Response:\n",
    "vicuna": "You are a helpful assistant\n\nUSER: Hello\nASSISTANT: Hi there</s>\nUSER: Who are you\nASSISTANT:    "
    "I am an assistant   </s>\nUSER: Another question\nASSISTANT:",
    "vicuna-orca": "SYSTEM: You are a helpful assistant\nUSER: Hello\nASSISTANT: Hi there</s>\nUSER: Who are you\n"
    "ASSISTANT:    I am an assistant   </s>\nUSER: Another question\nASSISTANT:",
    "command-r": "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a helpful assistant<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hello<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hi there"
    "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Who are you<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
    "<|CHATBOT_TOKEN|>I am an assistant<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Another question"
    "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|><|start_header_id|>"
    "user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
    "\n\nI am an assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnother question<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "phi3": "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n"
    "<|user|>\nWho are you<|end|>\n<|assistant|>\n   I am an assistant   <|end|>\n<|user|>\nAnother question<|end|>\n"
    "<|assistant|>\n",
    "chatglm3": "[gMASK]sop<|system|>\n You are a helpful assistant<|user|>\n Hello<|assistant|>\n Hi there<|user|>\n "
    "Who are you<|assistant|>\n    I am an assistant   <|user|>\n Another question<|assistant|>",
    "chatglm4": "[gMASK]<sop><|system|>\nYou are a helpful assistant<|user|>\nHello<|assistant|>\nHi there<|user|>\n"
    "Who are you<|assistant|>\n   I am an assistant   <|user|>\nAnother question<|assistant|>\n",
    "glmedge": "<|system|>\nYou are a helpful assistant<|user|>\nHello<|assistant|>\nHi there<|user|>\nWho are you"
    "<|assistant|>\n   I am an assistant   <|user|>\nAnother question<|assistant|>",
    "minicpm": "You are a helpful assistant<用户>Hello<AI>Hi there<用户>Who are you<AI>I am an assistant<用户>Another "
    "question<AI>",
    "deepseek2": "You are a helpful assistant\n\nUser: Hello\n\nAssistant: Hi there<｜end▁of▁sentence｜>User: Who are "
    "you\n\nAssistant:    I am an assistant   <｜end▁of▁sentence｜>User: Another question\n\nAssistant:",
    "granite": "<|start_of_role|>system<|end_of_role|>You are a helpful assistant<|end_of_text|>\n<|start_of_role|>user"
    "<|end_of_role|>Hello<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>Hi there<|end_of_text|>\n"
    "<|start_of_role|>user<|end_of_role|>Who are you<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>   I am "
    "an assistant   <|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Another question<|end_of_text|>\n"
    "<|start_of_role|>assistant<|end_of_role|>",
    "mistral-v1": " [INST] You are a helpful assistant\n\nHello [/INST] Hi there</s> [INST] Who are you [/INST]    I am "
    "an assistant   </s> [INST] Another question [/INST]",
    "mistral-v3": "[INST] You are a helpful assistant\n\nHello[/INST] Hi there</s>[INST] Who are you[/INST] I am an "
    "assistant</s>[INST] Another question[/INST]",
    "mistral-v3-tekken": "[INST]You are a helpful assistant\n\nHello[/INST]Hi there</s>[INST]Who are you[/INST]   I am "
    "an assistant   </s>[INST]Another question[/INST]",
    "mistral-v7": "[SYSTEM_PROMPT] You are a helpful assistant[/SYSTEM_PROMPT][INST] Hello[/INST] Hi there</s>[INST] "
    "Who are you[/INST]    I am an assistant   </s>[INST] Another question[/INST]",
    "gigachat": "<s>You are a helpful assistant<|message_sep|>user<|role_sep|>Hello<|message_sep|>available functions"
    "<|role_sep|>[]<|message_sep|>assistant<|role_sep|>Hi there<|message_sep|>user<|role_sep|>Who are you"
    "<|message_sep|>available functions<|role_sep|>[]<|message_sep|>assistant<|role_sep|>   I am an assistant   "
    "<|message_sep|>user<|role_sep|>Another question<|message_sep|>available functions<|role_sep|>[]<|message_sep|>"
    "assistant<|role_sep|>",
    "megrez": "<|role_start|>system<|role_end|>You are a helpful assistant<|turn_end|><|role_start|>user<|role_end|>"
    "Hello<|turn_end|><|role_start|>assistant<|role_end|>Hi there<|turn_end|><|role_start|>user<|role_end|>Who are "
    "you<|turn_end|><|role_start|>assistant<|role_end|>   I am an assistant   <|turn_end|><|role_start|>user"
    "<|role_end|>Another question<|turn_end|><|role_start|>assistant<|role_end|>",
    "phi4": "<|im_start|>system<|im_sep|>You are a helpful assistant<|im_end|><|im_start|>user<|im_sep|>Hello"
    "<|im_end|><|im_start|>assistant<|im_sep|>Hi there<|im_end|><|im_start|>user<|im_sep|>Who are you<|im_end|>"
    "<|im_start|>assistant<|im_sep|>   I am an assistant   <|im_end|><|im_start|>user<|im_sep|>Another question"
    "<|im_end|><|im_start|>assistant<|im_sep|>",
    "yandex": " Пользователь: Hello\n\n Ассистент: Hi there\n\n Пользователь: Who are you\n\n Ассистент:    I am an "
    "assistant   \n\n Пользователь: Another question\n\n Ассистент:[SEP]",
    "bailing": "<role>SYSTEM</role>You are a helpful assistant<role>HUMAN</role>Hello<role>ASSISTANT</role>Hi there"
    "<role>HUMAN</role>Who are you<role>ASSISTANT</role>   I am an assistant   <role>HUMAN</role>Another question"
    "<role>ASSISTANT</role>",
    "seed_oss": "<seed:bos>system\nYou are a helpful assistant<seed:eos><seed:bos>user\nHello<seed:eos><seed:bos>"
    "assistant\nHi there<seed:eos><seed:bos>user\nWho are you<seed:eos><seed:bos>assistant\nI am an assistant"
    "<seed:eos><seed:bos>user\nAnother question<seed:eos><seed:bos>assistant\n",
}
# every name of llama.cpp's LLM_CHAT_TEMPLATES (src/llama-chat.cpp)
LLAMACPP_NAMES = (
    "chatml llama2 llama2-sys llama2-sys-bos llama2-sys-strip mistral-v1 mistral-v3 mistral-v3-tekken mistral-v7 "
    "mistral-v7-tekken phi3 phi4 falcon3 zephyr monarch gemma orion openchat vicuna vicuna-orca deepseek deepseek2 "
    "deepseek3 deepseek-ocr command-r llama3 chatglm3 chatglm4 glmedge minicpm exaone3 exaone4 exaone-moe rwkv-world "
    "granite granite-4.0 granite-4.1 gigachat megrez yandex bailing bailing-think bailing2 llama4 smolvlm hunyuan-moe "
    "gpt-oss hunyuan-dense hunyuan-vl kimi-k2 seed_oss grok-2 pangu-embedded solar-open").split()


def test_every_llamacpp_name_is_there() -> None:
    assert sorted(NAMED_TEMPLATES) == sorted(LLAMACPP_NAMES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_named_template_writes_what_llamacpp_writes(name: str) -> None:
    assert ChatTemplate(NAMED_TEMPLATES[name], "<s>", "</s>").render(CONVERSATION) == EXPECTED[name]


@pytest.mark.parametrize("name", LLAMACPP_NAMES)
def test_every_named_template_renders_each_role(name: str) -> None:
    """Every built-in renders a conversation with every common role, and only adds a generation prompt when
    asked (those llama.cpp gives one)."""
    template = ChatTemplate(NAMED_TEMPLATES[name], "<s>", "</s>")
    messages = [*CONVERSATION, {"role": "assistant", "content": "Fine."}, {"role": "tool", "content": "{}"}]
    with_prompt = template.render(messages, add_generation_prompt=True)
    without = template.render(messages, add_generation_prompt=False)
    assert with_prompt.startswith(without) and "Fine." in without


def test_chat_template_flag_takes_a_name_and_a_file_of_that_name_wins(tmp_path, monkeypatch) -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--chat-template", "llama3"]))
    assert args.chat_template == NAMED_TEMPLATES["llama3"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "chatml").write_text("{{ 'mine' }}", encoding="utf-8")
    assert EngineArgs(chat_template="chatml").chat_template == "{{ 'mine' }}"
    with pytest.raises(ValueError, match="built-in template names"):
        EngineArgs(chat_template="no-such-template")


def test_every_render_has_llamacpps_dates() -> None:
    out = ChatTemplate("{{ date_string }}|{{ datetime }}", "", "").render([])
    now = datetime.now()  # the formats of llama.cpp's common_chat_extra_context
    assert out in (f"{now:%d %b %Y}|{now:%b %d %Y}", f"{datetime.now():%d %b %Y}|{datetime.now():%b %d %Y}")
    assert ChatTemplate("{{ date_string }}", "", "").render([], date_string="1 Jan 2000") == "1 Jan 2000"


def _real(name: str) -> ChatTemplate:
    source = (llamacpp_source() / "models" / "templates" / name).read_text(encoding="utf-8")
    return ChatTemplate(source, "<s>", "</s>")


def test_llama_3_1s_template_says_today() -> None:
    prompt = _real("meta-llama-Llama-3.1-8B-Instruct.jinja").render([{"role": "user", "content": "Hi"}])
    assert f"Today Date: {datetime.now():%d %b %Y}" in prompt


@pytest.mark.parametrize("name, switch", [
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", True), ("Qwen-Qwen3-0.6B.jinja", True),
    ("Qwen-QwQ-32B.jinja", True), ("meta-llama-Llama-3.1-8B-Instruct.jinja", False),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", False),
])
def test_thinking_switch_finds_the_templates_that_read_enable_thinking(name: str, switch: bool) -> None:
    assert _real(name).thinking_switch is switch

"""`chat_template` (vLLM's --chat-template, llama.cpp's --chat-template-file): a template given at load replaces the
GGUF's; checked against jinja2's own rendering of the same template, and refused with one clear error when the file
is missing or the template does not parse."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import jinja2
import pytest

from gpullama import LLM, SamplingParams
from gpullama.engine.args import EngineArgs

TEMPLATE = (
    "{% for m in messages %}<<{{ m['role'] | upper }}>>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<<ASSISTANT>>{% endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def reference(add_generation_prompt: bool) -> str:
    return jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(TEMPLATE).render(
        messages=MESSAGES, add_generation_prompt=add_generation_prompt)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("templates") / "chat.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    return path


@pytest.mark.parametrize("given", ["file", "text"])
def test_a_given_template_replaces_the_models(tiny_model, template_file, given) -> None:
    tiny = tiny_model("llama", "Q8_0")
    default = LLM(str(tiny.path), device="cpu", dtype="float32")
    assert default.tokenizer.apply_chat_template(MESSAGES) != reference(True)
    llm = LLM(str(tiny.path), device="cpu", dtype="float32",
              chat_template=str(template_file) if given == "file" else TEMPLATE)
    assert llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True) == reference(True)
    assert llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False) == reference(False)
    assert llm.tokenizer.chat_template.source == TEMPLATE
    out = llm.chat(MESSAGES, SamplingParams(max_tokens=2))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode(reference(True), add_special_tokens=False)


def test_both_flag_names_set_it(template_file) -> None:
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for flag in ("--chat-template", "--chat-template-file"):
        args = EngineArgs.from_cli_args(parser.parse_args([flag, str(template_file)]))
        assert args.chat_template == TEMPLATE


@pytest.mark.parametrize("value, message", [
    ("/nonexistent/chat.jinja", "chat_template: cannot read the template file '/nonexistent/chat.jinja'"),
    ("{% for m in messages %}{{ m['content'] }}", "chat_template: chat template syntax error at line 1"),
    ("   ", "chat_template"),
])
def test_a_bad_template_is_refused_before_loading(value, message) -> None:
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        EngineArgs(chat_template=value)

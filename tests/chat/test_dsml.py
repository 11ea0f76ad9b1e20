"""DeepSeek V3.2 / V4's DSML format against llama.cpp: the outputs of llama.cpp's own DSML cases
(``tests/test-chat.cpp``) parse to the reasoning, content and calls llama.cpp expects, whole and in any split, with
the reasoning block opened or not as the real template's generation prompt leaves it; V4's tool results reach the
template in call order as llama.cpp's ``deepseek_v4_sort_tool_results`` orders them; a forced call's grammar
accepts the assistant turn the real template renders, and what it writes parses back and validates (jsonschema)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from gpullama.chat.formats import FORMAT_BY_NAME, format_for_template, template_messages
from gpullama.chat.output import accumulate_chat
from gpullama.chat.reasoning import prompt_opens_reasoning
from gpullama.chat_template import ChatTemplate
from gpullama.structured import get_backend, tool_call_grammar
from gpullama.structured.vocab import grammar_vocab
from tests.chat.test_2026_formats import _splits
from tests.fixtures.llamacpp_source import llamacpp_source
from tests.structured.helpers import greedy_tokens, random_walk

V3_2, V4, V4_FLASH = ("deepseek-ai-DeepSeek-V3.2.jinja", "deepseek-ai-DeepSeek-V4.jinja",
                      "deepseek-ai-DeepSeek-V4-Flash-0731.jinja")
# llama.cpp's test tools (tests/test-chat.cpp)
LLAMACPP_TOOLS = {
    "get_time": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "special_function": {"type": "object", "properties": {"arg1": {"type": "integer"}}, "required": ["arg1"]},
    "magic_int": {"type": "object", "properties": {"ref": {"type": "integer"}, "name": {"type": "string"}},
                  "required": ["ref"]},
    "amount": {"type": "object", "properties": {"orig": {"type": "number"}}, "required": ["orig"]},
    "toggle": {"type": "object", "properties": {"enabled": {"type": "boolean"}}, "required": ["enabled"]},
    "todo_list": {"type": "object", "properties": {"todos": {"type": "array"}}, "required": ["todos"]},
    "set_config": {"type": "object", "properties": {"config": {"type": "object"}}, "required": ["config"]},
}
D = "｜DSML｜"


def _call_block(block: str, *invokes: tuple[str, list[tuple[str, str, str]]]) -> str:
    """The text of a call block as llama.cpp's test strings spell it."""
    text = f"<{D}{block}>\n"
    for name, params in invokes:
        text += f'<{D}invoke name="{name}">\n'
        for key, string, value in params:
            text += f'<{D}parameter name="{key}" string="{string}">{value}</{D}parameter>\n'
        text += f"</{D}invoke>\n"
    return text + f"</{D}{block}>"


def _llamacpp_cases(block: str, v4: bool) -> list[tuple[bool, str, tuple]]:
    """(thinking, model output, (reasoning, content, [(name, arguments as llama.cpp expects them)])): the DSML
    cases of llama.cpp's tests/test-chat.cpp for the template with call block `block`."""
    call = lambda *invokes: _call_block(block, *invokes)  # noqa: E731
    tokyo = call(("get_time", [("city", "true", "Tokyo")]))
    special = call(("special_function", [("arg1", "false", "1")]))
    cases = [
        (False, "Hello, world!\nWhat's up?", (None, "Hello, world!\nWhat's up?", [])),
        (True, "I'm\nthinking</think>Hello, world!\nWhat's up?", ("I'm\nthinking", "Hello, world!\nWhat's up?", [])),
        (True, "Let me check the time</think>\n\n" + tokyo,
         ("Let me check the time", None, [("get_time", '{"city": "Tokyo"}')])),
        (False, special, (None, None, [("special_function", '{"arg1": 1}')])),
        (True, "Calling both</think>\n\n" + call(("get_time", [("city", "true", "Paris")]),
                                                 ("get_weather", [("city", "true", "Paris")])),
         ("Calling both", None, [("get_time", '{"city": "Paris"}'), ("get_weather", '{"city": "Paris"}')])),
        (True, "Thinking about it</think>Let me call the function.\n\n" + special,
         ("Thinking about it", "Let me call the function.", [("special_function", '{"arg1": 1}')])),
        (True, "Multi-arg call</think>\n\n" + call(("magic_int", [("ref", "false", "42"),
                                                                  ("name", "true", "foo bar")])),
         ("Multi-arg call", None, [("magic_int", '{"ref": 42, "name": "foo bar"}')])),
    ]
    if v4:  # no </think> before the block: the block ends the reasoning
        cases.append((True, "Let me check the time\n\n" + tokyo,
                      ("Let me check the time", None, [("get_time", '{"city": "Tokyo"}')])))
        return cases
    return cases + [
        (True, "Test negative</think>\n\n" + call(("magic_int", [("ref", "false", "-14")])),
         ("Test negative", None, [("magic_int", '{"ref": -14}')])),
        (True, "Test decimal</think>\n\n" + call(("amount", [("orig", "false", "3.14")])),
         ("Test decimal", None, [("amount", '{"orig": 3.14}')])),
        (True, "Test boolean</think>\n\n" + call(("toggle", [("enabled", "false", "true")])),
         ("Test boolean", None, [("toggle", '{"enabled": true}')])),
        (True, "Test array</think>\n\n" + call(("todo_list", [("todos", "false", '["buy milk","walk dog"]')])),
         ("Test array", None, [("todo_list", '{"todos": ["buy milk", "walk dog"]}')])),
        (True, "Test object</think>\n\n" + call(("set_config", [("config", "false",
                                                                 '{"theme":"dark","level":2}')])),
         ("Test object", None, [("set_config", '{"config": {"theme": "dark", "level": 2}}')])),
        (True, "</think>\n\n" + call(("get_time", [("city", "true", "XYZCITY")])),
         (None, None, [("get_time", '{"city": "XYZCITY"}')])),
    ]


CASES = ([(V3_2, *c) for c in _llamacpp_cases("function_calls", False)]
         + [(V4, *c) for c in _llamacpp_cases("tool_calls", True)]
         + [(V4_FLASH, False, "\n\n" + _call_block("tool_calls", ("special_function", [("arg1", "false", "1")])),
             (None, None, [("special_function", '{"arg1": 1}')]))])


def _source(name: str) -> str:
    return (llamacpp_source() / "models" / "templates" / name).read_text(encoding="utf-8")


def _items(arguments: str) -> list:
    """A call's arguments as (key, value) pairs in their order."""
    return list(json.loads(arguments).items())


@pytest.mark.parametrize("name, thinking, text, expected", CASES)
def test_llamacpp_dsml_cases_parse_as_llamacpp_expects_in_any_split(name, thinking, text, expected):
    """The reasoning block is open when the real template's generation prompt (with ``enable_thinking`` as the
    case sets it) leaves it open; the arguments are llama.cpp's, written as compact JSON."""
    source = _source(name)
    fmt = format_for_template(source)
    prompt = ChatTemplate(source, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>").render(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, enable_thinking=thinking)
    assert prompt_opens_reasoning(prompt, *fmt.think_tags) == thinking
    reasoning, content, calls = expected
    for pieces in [[text], *_splits(text)]:
        parser = fmt.output_parser(LLAMACPP_TOOLS, fmt.reasoning_parser(prompt))
        out = accumulate_chat([parser.feed(piece) for piece in pieces] + [parser.finish()])
        assert (out.reasoning, out.content) == (reasoning, content), pieces
        assert [(c.name, _items(c.arguments)) for c in out.tool_calls] == [(n, _items(a)) for n, a in calls]
        assert all(c.arguments == json.dumps(json.loads(c.arguments), separators=(",", ":"), ensure_ascii=False)
                   for c in out.tool_calls)


def test_v4_tool_results_reach_the_template_in_call_order():
    """Results answered out of order render in the order of the calls (llama.cpp's reordering); V3.2's template
    is given them as they came."""
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "get_time", "arguments": {"city": c}}}
             for i, c in enumerate(("Paris", "Tokyo", "Lima"))]
    messages = [{"role": "user", "content": "Times?"}, {"role": "assistant", "content": "", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c2", "content": "L"}, {"role": "tool", "tool_call_id": "c0",
                                                                        "content": "P"},
                {"role": "user", "content": "and?"}, {"role": "tool", "tool_call_id": "c1", "content": "T"}]
    v4 = FORMAT_BY_NAME["deepseek_v4"].prompt_messages(messages, None, "auto", True)
    assert [m.get("tool_call_id") for m in v4] == [None, None, "c0", "c1", None, "c2"]
    assert v4[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    rendered = ChatTemplate(_source(V4), "<s>", "</s>").render(v4, add_generation_prompt=True)
    assert ("<｜User｜><tool_result>P</tool_result>\n\n<tool_result>T</tool_result>\n\nand?\n\n"
            "<tool_result>L</tool_result><｜Assistant｜></think>") in rendered
    assert FORMAT_BY_NAME["deepseek_v3_2"].prompt_messages(messages, None, "auto", True) == \
        template_messages(messages)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"},
                                         "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "now"}},
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {}})
           for t in TOOLS}
CALLS = [("get_weather", {"city": "Paris", "days": 3, "unit": "celsius"}), ("add", {"a": 2, "b": 3.5,
                                                                                   "tags": ["x", "y z"]})]


@pytest.fixture(scope="module")
def smollm2(default_model_path):
    """SmolLM2's vocabulary: its grammar backend and token bytes."""
    from gpullama.gguf_file import read_gguf
    from gpullama.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_metadata(read_gguf(str(default_model_path)).metadata)
    return get_backend(tokenizer), grammar_vocab(tokenizer)


@pytest.mark.parametrize("fmt, name", [("deepseek_v3_2", V3_2), ("deepseek_v4", V4)])
def test_the_forced_grammar_accepts_the_templates_own_calls(smollm2, fmt, name):
    """The assistant turn the real template renders for two calls (after its ``</think>``) is text the
    ``required`` grammar accepts, and the single-call grammar refuses; the format renders the same text."""
    backend, vocab = smollm2
    conversation = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(CALLS)]}]
    rendered = ChatTemplate(_source(name), "<s>", "</s>").render(template_messages(conversation), tools=TOOLS,
                                                                 add_generation_prompt=False)
    turn = rendered[rendered.rindex("</think>") + len("</think>"):rendered.rindex("<｜end▁of▁sentence｜>")]
    assert turn.startswith("\n\n")
    turn = turn[2:]
    assert FORMAT_BY_NAME[fmt].grammar.render(CALLS) == turn

    def accepts(spec, text: str) -> bool:
        matcher = backend.matcher(backend.compile(spec))
        return all(matcher.accept_token(t) for t in greedy_tokens(vocab, text.encode())) and \
            matcher.accept_token(backend.stop_token_ids[0])

    assert accepts(tool_call_grammar(TOOLS, "required", format=fmt), turn)
    assert not accepts(tool_call_grammar(TOOLS, "required", parallel_tool_calls=False, format=fmt), turn)
    one = FORMAT_BY_NAME[fmt].grammar.render(CALLS[1:])
    assert accepts(tool_call_grammar(TOOLS, "add", format=fmt), one)
    assert not accepts(tool_call_grammar(TOOLS, "now", format=fmt), one)


@pytest.mark.parametrize("fmt", ["deepseek_v3_2", "deepseek_v4"])
@pytest.mark.parametrize("choice", ["required", "get_weather"])
def test_forced_calls_parse_back_and_validate(smollm2, fmt, choice):
    """Random decoding under the forced grammar: the DSML parser reads calls that validate against the schemas
    (the named choice: exactly one call of that tool)."""
    backend, vocab = smollm2
    spec = tool_call_grammar(TOOLS, choice, format=fmt)
    for seed in range(4):
        walk = random_walk(backend, spec, vocab.__getitem__, seed, steer_after=60)
        text = walk.text.decode()
        out = FORMAT_BY_NAME[fmt].output_parser(SCHEMAS, None).parse(text)
        assert out.tool_calls and not out.content, text
        for call in out.tool_calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        if choice != "required":
            assert [c.name for c in out.tool_calls] == [choice]

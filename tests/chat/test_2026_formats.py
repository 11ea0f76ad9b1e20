"""The 2026 families' tool-call formats against llama.cpp's real templates (``models/templates``): each renders a tool
conversation as transformers' ``render_jinja_template`` does, is detected as its format, and the calls it writes
parse back to the conversation's calls; model-like outputs (whole and in any split) parse to the calls and
reasoning that llama.cpp's parser for the format gives (``common/parsers/*.cpp``, ``common/chat*.cpp``)."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from gpullama.chat.formats import FORMAT_BY_NAME, PARSERS, format_for_template, template_messages
from gpullama.chat.output import accumulate_chat
from gpullama.chat.reasoning import ReasoningParser, prompt_opens_reasoning
from gpullama.chat.tool_calls import accumulate
from gpullama.chat_template import ChatTemplate
from tests.fixtures.llamacpp_source import llamacpp_source

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "when": {"type": ["string", "integer"]}},
           "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"},
                                        "opts": {"type": "object"}, "tags": {"type": "array"}},
       "required": ["a", "b"]}
SCHEMAS = {"get_weather": WEATHER, "add": ADD, "now": {"type": "object", "properties": {}}}
TOOLS = [{"type": "function", "function": {"name": n, "description": f"the {n} tool", "parameters": s}}
         for n, s in SCHEMAS.items()]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris for 3 days, and 2+3?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "days": 3, "unit": "celsius"}'}},
        {"id": "call_b", "type": "function", "function": {
            "name": "add", "arguments": '{"a": 2, "b": 3.5, "opts": {"exact": true}, "tags": ["x", "y z"]}'}}]},
    {"role": "tool", "tool_call_id": "call_a", "content": "21 C"},
    {"role": "tool", "tool_call_id": "call_b", "content": "5.5"},
]
TEMPLATES = {  # format -> llama.cpp's real templates that write it
    "qwen3_coder": ["Qwen3-Coder.jinja", "Qwen3.5-4B.jinja"],
    "glm45": ["GLM-4.6.jinja", "GLM-4.7-Flash.jinja"],
    # (llama.cpp's own llama-cpp-deepseek-r1.jinja pipes a generator to tojson, which transformers cannot render)
    "deepseek": ["deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"],
    "gemma4": ["google-gemma-4-31B-it.jinja", "google-gemma-4-31B-it-interleaved.jinja"],
    "deepseek_v3_2": ["deepseek-ai-DeepSeek-V3.2.jinja"],
    "deepseek_v4": ["deepseek-ai-DeepSeek-V4.jinja", "deepseek-ai-DeepSeek-V4-Flash-0731.jinja"],
}
TEMPLATE_CASES = [(fmt, name) for fmt, names in TEMPLATES.items() for name in names]


def _source(name: str) -> str:
    return (llamacpp_source() / "models" / "templates" / name).read_text(encoding="utf-8")


def _ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _calls(out) -> list[tuple[str, object]]:
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def _splits(text: str, seed: int = 0):
    """The text by character, cut in two at every place, and in random pieces."""
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    rng = random.Random(seed)
    for _ in range(10):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("fmt, name", TEMPLATE_CASES)
@pytest.mark.parametrize("generation", [True, False])
def test_real_template_renders_as_transformers_and_is_detected(fmt, name, generation):
    source = _source(name)
    assert format_for_template(source).name == fmt
    messages = template_messages(CONVERSATION)
    ours = ChatTemplate(source, "<s>", "</s>").render(messages, tools=TOOLS, add_generation_prompt=generation)
    ref, _ = render_jinja_template(conversations=[messages], tools=TOOLS, chat_template=source,
                                   add_generation_prompt=generation, bos_token="<s>", eos_token="</s>")
    assert ours == ref[0]


@pytest.mark.parametrize("fmt, name", TEMPLATE_CASES)
def test_calls_the_template_writes_parse_back(fmt, name):
    """The assistant turn the template renders for the conversation's calls, read by the format's parser with the
    tools' schemas (reasoning open when the generation prompt opens it): the conversation's calls, typed."""
    template = ChatTemplate(_source(name), "<s>", "</s>")
    messages = template_messages(CONVERSATION)
    head = template.render(messages[:2], tools=TOOLS, add_generation_prompt=True)
    whole = template.render(messages[:4], tools=TOOLS, add_generation_prompt=False)
    opening, end = TURN[fmt]
    turn = whole[whole.index(opening) + len(opening):]  # the first assistant turn
    turn = turn[:turn.index(end)] if end in turn else turn[:turn.index("<turn|>")]  # Gemma 4's interleaved
    tags = FORMAT_BY_NAME[fmt].think_tags
    # R1's past turns drop their reasoning block; DeepSeek V3.2 / V4's open with the bare closing tag of a block
    # their prompt opened
    opened = (prompt_opens_reasoning(head, *tags) or turn.startswith(tags[1])) and tags[1] in turn
    out = FORMAT_BY_NAME[fmt].output_parser(SCHEMAS, ReasoningParser(opened, *tags)).parse(turn)
    assert _calls(out) == [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                           for c in CONVERSATION[2]["tool_calls"]]
    assert not out.content


TURN = {"qwen3_coder": ("<|im_start|>assistant\n", "<|im_end|>"), "glm45": ("<|assistant|>", "<|observation|>"),
        "deepseek": ("<｜Assistant｜>", "<｜end▁of▁sentence｜>"), "gemma4": ("<|turn>model\n", "<|tool_response>"),
        "deepseek_v3_2": ("<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
        "deepseek_v4": ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")}  # an assistant turn's opening and end

# model-like outputs and what llama.cpp's parser reads from them: (reasoning, content, calls)
QWEN3_CODER_CASES = [
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>",
     (None, None, [("get_weather", '{"city":"Paris","days":3}')])),
    # schema types: a string-only value stays a string even when it reads as a number; multi-line values keep
    # their inner newlines; a string-or-integer value is JSON when it parses as one
    ("Let me check.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\n123\n</parameter>\n"
     "<parameter=when>\n7\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n"
     "1.5\n</parameter>\n<parameter=b>\n-2\n</parameter>\n<parameter=opts>\n{\"x\": [1, 2]}\n</parameter>\n"
     "<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n</function>\n</tool_call>",
     (None, "Let me check.", [("get_weather", '{"city":"123","when":7}'),
                              ("add", '{"a":1.5,"b":-2,"opts":{"x": [1, 2]},"tags":["a", "b"]}')])),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew\nYork \"NY\"\n</parameter>\n<parameter=when>\n"
     "tomorrow\n</parameter>\n</function>\n</tool_call>",
     (None, None, [("get_weather", '{"city":"New\\nYork \\"NY\\"","when":"tomorrow"}')])),
    ("<tool_call>\n<function=now>\n</function>\n</tool_call>", (None, None, [("now", "{}")])),
    # a value that ends in a newline keeps it (the delimiter is "\n</parameter>\n"; llama.cpp's test-chat.cpp)
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\n  Paris\n\n</parameter>\n</function>\n</tool_call>",
     (None, None, [("get_weather", '{"city":"  Paris\\n"}')])),
    # not calls: an unknown function, no <function= after the tag
    ("<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",
     (None, "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>", [])),
    ("I write <tool_call> tags.", (None, "I write <tool_call> tags.", [])),
    # cut off inside an argument: the call with the arguments read so far
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3",
     (None, None, [("get_weather", '{"city":"Paris"}')])),
]
QWEN35_CASES = [  # Qwen3.5's prompt opens <think>; a <tool_call> also ends the reasoning (llama.cpp's end tags)
    ("The user wants Paris.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
     "</parameter>\n</function>\n</tool_call>",
     ("The user wants Paris.", None, [("get_weather", '{"city":"Paris"}')])),
    ("Calling now.\n<tool_call>\n<function=now>\n</function>\n</tool_call>",
     ("Calling now.", None, [("now", "{}")])),
    ("\n</think>\n\nIt is sunny.", (None, "It is sunny.", [])),
]
GLM_CASES = [
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
     "<arg_value>3</arg_value>\n</tool_call>", (None, None, [("get_weather", '{"city":"Paris","days":3}')])),
    # GLM-4.7 writes no newlines; a schema that allows a string takes the raw text, even one that reads as a number
    ("Checking.<tool_call>get_weather<arg_key>city</arg_key><arg_value>123</arg_value><arg_key>when</arg_key>"
     "<arg_value>7</arg_value></tool_call><tool_call>add<arg_key>a</arg_key><arg_value>1.5</arg_value>"
     "<arg_key>b</arg_key><arg_value>2</arg_value><arg_key>opts</arg_key><arg_value>{\"x\": null}</arg_value>"
     "</tool_call>",
     (None, "Checking.", [("get_weather", '{"city":"123","when":"7"}'), ("add", '{"a":1.5,"b":2,"opts":{"x": null}}')])),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New\nYork</arg_value>\n</tool_call>",
     (None, None, [("get_weather", '{"city":"New\\nYork"}')])),
    ("<tool_call>now</tool_call>", (None, None, [("now", "{}")])),
    ("\n<think>The user wants the time.</think>\n<tool_call>now\n</tool_call>",
     ("The user wants the time.", None, [("now", "{}")])),
    ("<tool_call>rm_rf\n<arg_key>path</arg_key>\n<arg_value>/</arg_value>\n</tool_call>",
     (None, "<tool_call>rm_rf\n<arg_key>path</arg_key>\n<arg_value>/</arg_value>\n</tool_call>", [])),
    ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par", (None, None, [("get_weather", "{}")])),
]
GLM47_CASES = [  # GLM-4.7's prompt opens <think> (llama.cpp's test-chat.cpp)
    ("I'm\nthinking</think><tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key>"
     "<arg_value>2</arg_value></tool_call>", ("I'm\nthinking", None, [("add", '{"a":1,"b":2}')])),
    ("I'm\nthinking</think>Hello, world!\nWhat's up?", ("I'm\nthinking", "Hello, world!\nWhat's up?", [])),
]
B, E, CB, CE, SEP = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                      "<｜tool▁sep｜>")
DEEPSEEK_CASES = [  # V3.1 and R1 (llama.cpp's test-chat.cpp); arguments as written
    (f'{B}{CB}get_weather{SEP}{{"city": "XYZCITY"}}{CE}{E}', (None, None, [("get_weather", '{"city": "XYZCITY"}')])),
    (f'<think>Paris.</think>CONTENT{B}{CB}get_weather{SEP}{{"city": "Paris"}}{CE}{CB}now{SEP}{{}}{CE}{E}',
     ("Paris.", "CONTENT", [("get_weather", '{"city": "Paris"}'), ("now", "{}")])),
    (f'{B}{CB}function{SEP}add\n```json\n{{"a": 1, "b": 2}}```{CE}{E}', (None, None, [("add", '{"a": 1, "b": 2}')])),
    (f'{B}{CB}function{SEP}add\n```json\n{{"a": 1}}\n```{CE}{CB}function{SEP}now\n```json\n{{}}\n```{CE}{E}',
     (None, None, [("add", '{"a": 1}'), ("now", "{}")])),
    (f'{B}{CB}rm_rf{SEP}{{}}{CE}{E}', (None, f'{B}{CB}rm_rf{SEP}{{}}{CE}{E}', [])),
    (f'{B}{CB}get_weather{SEP}{{"city": "Pa', (None, None, [("get_weather", '{"city": "Pa')])),
    ("CONTENT", (None, "CONTENT", [])),
]
DEEPSEEK_OPEN_CASES = [  # the prompt opened <think> (V3.1 with thinking on, R1)
    (f'REASONING</think>{B}{CB}get_weather{SEP}{{"city": "Tokyo"}}{CE}{E}',
     ("REASONING", None, [("get_weather", '{"city": "Tokyo"}')])),
    ("REASONING</think>\nCONTENT", ("REASONING", "CONTENT", [])),
]
Q = '<|"|>'
GEMMA4_CASES = [  # llama.cpp's gemma4 parser: Gemma's object syntax to compact JSON, <|channel>thought reasoning
    (f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:3}}<tool_call|>",
     (None, None, [("get_weather", '{"city":"Paris","days":3}')])),
    (f"Let me check.<|tool_call>call:add{{a:1.5,b:-2,opts:{{x:[1,{Q}y, z: w{Q}],n:null}},tags:[]}}<tool_call|>"
     f"<|tool_call>call:now{{}}<tool_call|>",
     (None, "Let me check.", [("add", '{"a":1.5,"b":-2,"opts":{"x":[1,"y, z: w"],"n":null},"tags":[]}'),
                              ("now", "{}")])),
    (f"<|channel>thought\nThe user wants Paris.<channel|><|tool_call>call:get_weather{{city:{Q}Paris{Q}}}"
     "<tool_call|>", ("The user wants Paris.", None, [("get_weather", '{"city":"Paris"}')])),
    ("<|channel>thought\nHmm.<channel|>It is sunny.", ("Hmm.", "It is sunny.", [])),
    (f"<|tool_call>call:rm_rf{{path:{Q}/{Q}}}<tool_call|>", (None, f"<|tool_call>call:rm_rf{{path:{Q}/{Q}}}<tool_call|>", [])),
    (f"<|tool_call>call:get_weather{{city:{Q}Pa", (None, None, [("get_weather", "{}")])),
]
D = "｜DSML｜"
DSML_CASES = [  # V3.2's block (V4 writes tool_calls); typed by each parameter's string attribute, compact JSON
    (f'<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris'
     f'</{D}parameter>\n<{D}parameter name="days" string="false">3</{D}parameter>\n</{D}invoke>\n'
     f'</{D}function_calls>', (None, None, [("get_weather", '{"city":"Paris","days":3}')])),
    # a string stays one even when it reads as a number; a non-string that is not JSON becomes a string; JSON stays
    # as written; values keep their newlines; two calls
    (f'Let me check.\n\n<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" '
     f'string="true">123</{D}parameter>\n<{D}parameter name="when" string="false">soon</{D}parameter>\n'
     f'</{D}invoke>\n<{D}invoke name="add">\n<{D}parameter name="a" string="false">1.5</{D}parameter>\n'
     f'<{D}parameter name="b" string="false">-2</{D}parameter>\n<{D}parameter name="opts" string="false">'
     f'{{"x": [1, 2], "y": true}}</{D}parameter>\n<{D}parameter name="tags" string="true">a\nb</{D}parameter>\n'
     f'</{D}invoke>\n</{D}function_calls>',
     (None, "Let me check.", [("get_weather", '{"city":"123","when":"soon"}'),
                              ("add", '{"a":1.5,"b":-2,"opts":{"x": [1, 2], "y": true},"tags":"a\\nb"}')])),
    (f'<{D}function_calls>\n<{D}invoke name="now">\n\n</{D}invoke>\n</{D}function_calls>',
     (None, None, [("now", "{}")])),
    # not calls: an unknown function, no invoke after the block's tag
    (f'<{D}function_calls>\n<{D}invoke name="rm_rf">\n</{D}invoke>\n</{D}function_calls>',
     (None, f'<{D}function_calls>\n<{D}invoke name="rm_rf">\n</{D}invoke>\n</{D}function_calls>', [])),
    (f"I write <{D}function_calls> tags.", (None, f"I write <{D}function_calls> tags.", [])),
    # cut off inside a parameter: the call with the parameters read so far
    (f'<{D}function_calls>\n<{D}invoke name="get_weather">\n<{D}parameter name="city" string="true">Paris'
     f'</{D}parameter>\n<{D}parameter name="days" string="false">3',
     (None, None, [("get_weather", '{"city":"Paris"}')])),
]
DSML_V4_CASES = [(text.replace("function_calls", "tool_calls"),
                  (r, c and c.replace("function_calls", "tool_calls"), calls)) for text, (r, c, calls) in DSML_CASES]
OUTPUT_CASES = ([("deepseek_v3_2", False, text, want) for text, want in DSML_CASES]
                + [("deepseek_v4", False, text, want) for text, want in DSML_V4_CASES]
                + [("gemma4", False, text, want) for text, want in GEMMA4_CASES]
                + [("deepseek", False, text, want) for text, want in DEEPSEEK_CASES]
                + [("deepseek", True, text, want) for text, want in DEEPSEEK_OPEN_CASES]
                + [("glm45", False, text, want) for text, want in GLM_CASES]
                + [("glm45", True, text, want) for text, want in GLM47_CASES]
                + [("qwen3_coder", False, text, want) for text, want in QWEN3_CODER_CASES]
                + [("qwen3_coder", True, text, want) for text, want in QWEN35_CASES])


@pytest.mark.parametrize("fmt, opened, text, expected", OUTPUT_CASES)
def test_model_outputs_parse_as_llamacpp_parses_them_in_any_split(fmt, opened, text, expected):
    def parser():
        tags = FORMAT_BY_NAME[fmt].think_tags
        return FORMAT_BY_NAME[fmt].output_parser(SCHEMAS, ReasoningParser(opened, *tags))

    whole = parser().parse(text)
    assert (whole.reasoning, whole.content, [(c.name, c.arguments) for c in whole.tool_calls]) == expected
    for pieces in _splits(text, len(text)):
        p = parser()
        streamed = accumulate_chat([p.feed(piece) for piece in pieces] + [p.finish()])
        assert (streamed.reasoning, streamed.content, [(c.name, c.arguments) for c in streamed.tool_calls]) == \
            expected, pieces


@pytest.mark.parametrize("fmt", sorted(TEMPLATES))
def test_calls_stream_with_the_openai_shape(fmt):
    """Each call's id and name come once, in its first piece; its arguments follow as they are read."""
    text, (_, _, calls) = {"qwen3_coder": QWEN3_CODER_CASES, "glm45": GLM_CASES, "deepseek": DEEPSEEK_CASES,
                             "gemma4": GEMMA4_CASES, "deepseek_v3_2": DSML_CASES, "deepseek_v4": DSML_V4_CASES}[fmt][1]
    parser = PARSERS[fmt](SCHEMAS, id_factory=_ids())
    deltas = [parser.feed(c) for c in text] + [parser.finish()]
    firsts = {}
    for d in deltas:
        for piece in d.tool_calls:
            if piece.index not in firsts:
                firsts[piece.index] = piece
                assert piece.id == f"call_{piece.index}" and piece.name
            else:
                assert piece.id is None and piece.name is None
    assert [(c.name, c.arguments) for c in accumulate(deltas).tool_calls] == calls
    assert sum(len(d.tool_calls) for d in deltas) > len(calls)  # the arguments came in pieces after the name


@pytest.mark.parametrize("fmt, name", TEMPLATE_CASES)
def test_a_model_with_the_template_gets_the_format(fmt, name):
    """`chat_format` of a vocabulary carrying the real template: the format, and reasoning when the template
    speaks of the format's closing reasoning tag (Qwen3-Coder's does not reason)."""
    from gpullama.chat.model_format import chat_format
    from gpullama.tokenizer import Tokenizer
    from tests.fixtures.vocabs import vocab_metadata

    source = _source(name)
    found = chat_format(Tokenizer.from_metadata(dict(vocab_metadata("gpt2-smollm"),
                                                     **{"tokenizer.chat_template": source})))
    assert found.tool_format == fmt and found.template_tools
    assert found.reasoning == (name != "Qwen3-Coder.jinja")


QWEN3_CODER_BARE_CASES = [  # Qwen3-Coder (no reasoning) sometimes leaves out <tool_call>: llama.cpp's bare openers
    ("<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
     (None, [("get_weather", '{"city":"Paris"}')])),
    ("#include <functional>\n<function=now>\n</function>\n<function=add>\n<parameter=a>\n1\n</parameter>\n"
     "<parameter=b>\n2\n</parameter>\n</function>", ("#include <functional>", [("now", "{}"), ("add", '{"a":1,"b":2}')])),
    ("<function=rm_rf>\n</function>", ("<function=rm_rf>\n</function>", [])),  # not an offered tool
    ("<tool_call>\n<function=now>\n</function>\n<tool_cx", ("<tool_cx", [("now", "{}")])),
]


@pytest.mark.parametrize("text, expected", QWEN3_CODER_BARE_CASES)
def test_qwen3_coder_without_reasoning_reads_bare_function_tags(text, expected):
    fmt = FORMAT_BY_NAME["qwen3_coder"]
    whole = fmt.output_parser(SCHEMAS, None).parse(text)
    assert (whole.content, [(c.name, c.arguments) for c in whole.tool_calls]) == expected
    for pieces in _splits(text):
        p = fmt.output_parser(SCHEMAS, None)
        streamed = accumulate_chat([p.feed(piece) for piece in pieces] + [p.finish()])
        assert (streamed.content, [(c.name, c.arguments) for c in streamed.tool_calls]) == expected, pieces
    # a model that reasons (Qwen3.5) needs the tag, as in llama.cpp
    reasoning = fmt.output_parser(SCHEMAS, ReasoningParser()).parse("<function=now>\n</function>")
    assert reasoning.tool_calls == [] and reasoning.content == "<function=now>\n</function>"

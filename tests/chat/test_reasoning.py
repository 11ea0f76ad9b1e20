"""The reasoning parser: reference splits, any split of the text equal to the whole, prompt detection."""

from __future__ import annotations

import random

import pytest

from gpullama.chat.reasoning import ReasoningParser, prompt_opens_reasoning

CASES = [
    # (text, start_in_reasoning, (reasoning, content))
    ("<think>\nThe user greets me.\n</think>\n\nHello!", False, ("The user greets me.", "Hello!")),
    ("  \n<think>a</think>b", False, ("a", "b")),
    ("Just an answer.", False, (None, "Just an answer.")),
    ("  indented answer", False, (None, "  indented answer")),
    ("I like <think> tags.</think>", False, (None, "I like <think> tags.</think>")),
    ("<think>\n\n</think>\n\nHello", False, (None, "Hello")),
    ("<think>only reasoning</think>", False, ("only reasoning", None)),
    ("<think>a < b and c </ d</think>\nyes", False, ("a < b and c </ d", "yes")),
    ("<think>two\n\nparagraphs  \n</think>x", False, ("two\n\nparagraphs", "x")),
    ("<think>cut off </thi", False, ("cut off </thi", None)),
    ("<think>cut off\n\n", False, ("cut off", None)),
    ("<thin", False, (None, "<thin")),
    ("</think>stray close", False, (None, "</think>stray close")),
    ("<think>a</think>b<think>c</think>", False, ("a", "b<think>c</think>")),
    # the prompt opened the block (DeepSeek-R1 distills)
    ("Okay, 2+2 is 4.\n</think>\n\nThe answer is 4.", True, ("Okay, 2+2 is 4.", "The answer is 4.")),
    ("<think>\nrepeated open tag</think>ok", True, ("repeated open tag", "ok")),
    ("</think>answer at once", True, (None, "answer at once")),
    ("<thinking is hard</think>x", True, ("<thinking is hard", "x")),
    ("never closed", True, ("never closed", None)),
    ("<thi", True, ("<thi", None)),
    ("", True, (None, None)),
    ("", False, (None, None)),
]


@pytest.mark.parametrize("text, opened, expected", CASES)
def test_whole_text(text, opened, expected):
    assert ReasoningParser(start_in_reasoning=opened).parse(text) == expected


def _streamed(pieces, opened, **kw):
    parser = ReasoningParser(start_in_reasoning=opened, **kw)
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    reasoning = "".join(d.reasoning for d in deltas)
    content = "".join(d.content for d in deltas)
    return reasoning or None, content or None


@pytest.mark.parametrize("text, opened, expected", CASES)
def test_every_split_equals_the_whole(text, opened, expected):
    assert _streamed(list(text), opened) == expected
    for i in range(len(text) + 1):
        assert _streamed([text[:i], text[i:]], opened) == expected, i
    rng = random.Random(7)
    for _ in range(10):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 4)))
        assert _streamed([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])], opened) == expected


def test_reasoning_streams_before_the_block_ends():
    parser = ReasoningParser()
    assert parser.feed("<think>Let me ").reasoning == "Let me"
    assert parser.in_reasoning and not parser.reasoning_ended
    assert parser.feed("think.</th").reasoning == " think."
    d = parser.feed("ink>\n\nDone")
    assert d.reasoning == "" and d.content == "Done" and parser.reasoning_ended and not parser.in_reasoning
    assert parser.feed(" now.").content == " now."
    assert not parser.finish()


def test_other_tags():
    parser = ReasoningParser(open_tag="[THINK]", close_tag="[/THINK]")
    assert parser.parse("[THINK]hmm[/THINK]ok") == ("hmm", "ok")
    assert _streamed(list("[THINK]a [/THIN b[/THINK] c"), False, open_tag="[THINK]", close_tag="[/THINK]") == \
        ("a [/THIN b", "c")


@pytest.mark.parametrize("prompt, opened", [
    ("<｜User｜>2+2?<｜Assistant｜><think>\n", True),  # DeepSeek-R1 distill generation prompt
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3 with enable_thinking=False
    ("<|im_start|>assistant\n", False),
    ("<think>old</think> and <think> inside a user message, then more", False),
])
def test_prompt_opens_reasoning(prompt, opened):
    assert prompt_opens_reasoning(prompt) is opened


END_MARKER_CASES = [  # Qwen3.5: a <tool_call> also ends the reasoning and begins the answer (llama.cpp's end tags)
    ("Calling.\n<tool_call>\n<function=x>", True, ("Calling.", "<tool_call>\n<function=x>")),
    ("<think>a</think>\n<tool_call>", False, ("a", "<tool_call>")),
    ("a <tool_cal", True, ("a <tool_cal", None)),
    ("<tool_call>at once", True, (None, "<tool_call>at once")),
]
GEMMA4_TAG_CASES = [  # other tags: Gemma 4's <|channel>thought ... <channel|>
    ("<|channel>thought\nThe user greets me.<channel|>Hello!", False, ("The user greets me.", "Hello!")),
    ("<|channel>thought\n<channel|>Hi", False, (None, "Hi")),
    ("<think>not a tag here</think>", False, (None, "<think>not a tag here</think>")),
]


@pytest.mark.parametrize("text, opened, expected", END_MARKER_CASES + GEMMA4_TAG_CASES)
def test_end_markers_and_other_tags_in_any_split(text, opened, expected):
    def parser():
        if (text, opened, expected) in GEMMA4_TAG_CASES:
            return ReasoningParser(opened, "<|channel>thought", "<channel|>")
        p = ReasoningParser(opened)
        p.end_markers = ("<tool_call>",)
        return p

    assert parser().parse(text) == expected
    for i in range(len(text) + 1):
        p = parser()
        a, b, c = p.feed(text[:i]), p.feed(text[i:]), p.finish()
        assert ((a.reasoning + b.reasoning + c.reasoning) or None, (a.content + b.content + c.content) or None) \
            == expected, i
    assert prompt_opens_reasoning("<|turn>model\n<|channel>thought\n", "<|channel>thought", "<channel|>")
    assert not prompt_opens_reasoning("<|channel>thought\n<channel|>", "<|channel>thought", "<channel|>")

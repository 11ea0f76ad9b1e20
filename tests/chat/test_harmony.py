"""gpt-oss's harmony output: the analysis channel becomes reasoning_content, commentary calls to functions become
tool_calls, the final channel content; whole and streamed at every split (accumulated by the openai SDK's own
stream state), from the token ids the model writes through the detokenizer's kept markers."""

from __future__ import annotations

import json

import pytest

from gpullama.chat.formats.harmony import HarmonyParser, is_harmony_template
from gpullama.chat.model_format import chat_format
from gpullama.chat.output import accumulate_chat
from gpullama.server.http.errors import APIError
from gpullama.server.pipeline.chat_output import ChatOutputShaper
from gpullama.server.pipeline.chat_plan import plan_chat
from gpullama.tokenizer import Tokenizer
from tests.chat.test_tool_parsers import TOOLS
from tests.fixtures.vocabs import HARMONY_TEMPLATE, vocab_metadata
from tests.server.test_chat_output import USER, _calls, _streamed, _whole

ANALYSIS_AND_FINAL = ("<|channel|>analysis<|message|>The user says hi. Answer <briefly>.<|end|>"
                      "<|start|>assistant<|channel|>final<|message|>Hello! <|end|> is not here.<|return|>")
CALL = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')


@pytest.fixture(scope="module")
def harmony_tokenizer() -> Tokenizer:
    return Tokenizer.from_metadata(vocab_metadata("harmony"))


def parse(text: str, tools: list[str] | None = None, pieces: int = 1):
    """(reasoning, content, [(name, arguments)]) of `text` fed in `pieces` equal parts."""
    parser = HarmonyParser(tools)
    size = -(-len(text) // pieces) if text else 1
    deltas = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)] + [parser.finish()]
    out = accumulate_chat(deltas)
    return out.reasoning, out.content, [(c.name, c.arguments) for c in out.tool_calls]


@pytest.mark.parametrize("text,tools,want", [
    (ANALYSIS_AND_FINAL, None, ("The user says hi. Answer <briefly>.", "Hello! ", [])),
    (CALL, ["get_weather"], ("Need the weather.", None, [("get_weather", '{"city": "Paris"}')])),
    # the recipient before the channel, a content type, two calls
    ('<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.a<|channel|>commentary json<|message|>'
     '{}<|call|><|start|>assistant to=functions.b<|channel|>commentary<|message|>{"n": 1}<|call|>', ["a", "b"],
     ("x", None, [("a", "{}"), ("b", '{"n": 1}')])),
    # <|end|> not kept (the detokenizer dropped it): <|start|> closes the message
    ("<|channel|>analysis<|message|>think<|start|>assistant<|channel|>final<|message|>answer", None,
     ("think", "answer", [])),
    # no tools offered: a message to a function is content
    (CALL, None, ("Need the weather.", '{"city": "Paris"}', [])),
    # a commentary preamble is content; cut short inside the final answer
    ("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done so", None,
     (None, "Checking.Done so", [])),
    ("plain text, no channel", None, (None, "plain text, no channel", [])),
])
def test_channels_whole_and_in_pieces(text: str, tools, want) -> None:
    for pieces in (1, 2, 3, 7, len(text)):
        assert parse(text, tools, pieces) == want, pieces


def test_chat_format_and_kept_markers(harmony_tokenizer) -> None:
    """The harmony template makes the format harmony (reasoning, template tools); the request keeps every marker
    in its text; forced calls and response_format are refused (400 naming the field)."""
    assert is_harmony_template(HARMONY_TEMPLATE) and not is_harmony_template("{{ messages }}<|im_start|>")
    fmt = chat_format(harmony_tokenizer)
    assert fmt.tool_format == "harmony" and fmt.reasoning and fmt.template_tools
    plan = plan_chat({"tools": TOOLS}, USER, fmt)
    kept = harmony_tokenizer.convert_ids_to_tokens(plan.preserved_token_ids)
    assert set(kept) == {"<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>",
                         "<|return|>"}
    for body, param in (({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
                        ({"response_format": {"type": "json_object"}}, "response_format")):
        with pytest.raises(APIError) as err:
            plan_chat(body, USER, fmt)
        assert err.value.param == param


def test_eog_and_rendered_markers(harmony_tokenizer) -> None:
    """As llama.cpp: <|return|> and <|call|> end the answer, <|end|> only a message; the channel markers stay in
    the text even when special tokens are skipped."""
    tok = harmony_tokenizer
    eog = set(tok.convert_ids_to_tokens(sorted(tok.eos_token_ids)))
    assert {"<|return|>", "<|call|>"} <= eog and "<|end|>" not in eog
    ids = tok.encode(ANALYSIS_AND_FINAL)
    assert tok.decode(ids, skip_special_tokens=True) == ANALYSIS_AND_FINAL.replace("<|end|>", "").replace(
        "<|return|>", "")


def test_answer_from_token_ids_whole_and_streamed(harmony_tokenizer) -> None:
    """The model's token ids, decoded with the plan's kept markers, split into reasoning, a call and
    finish_reason tool_calls, whole and at every two-piece split."""
    plan = plan_chat({"tools": TOOLS}, USER, chat_format(harmony_tokenizer))
    ids = harmony_tokenizer.encode(CALL)
    text = harmony_tokenizer.decode(ids[:-1], skip_special_tokens=True, preserved_token_ids=plan.preserved_token_ids)
    assert text == CALL.removesuffix("<|call|>")  # the stop token <|call|> is not part of the text
    whole = _whole(ChatOutputShaper(plan, "prompt"), text)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls"
    assert message.model_extra["reasoning_content"] == "Need the weather." and not message.content
    assert _calls(message) == [("get_weather", {"city": "Paris"})]
    for cut in range(0, len(text) + 1, 3):
        streamed, _ = _streamed(ChatOutputShaper(plan, "prompt"), [text[:cut], text[cut:]])
        got = streamed.choices[0].message
        assert got.model_extra["reasoning_content"] == "Need the weather.", cut
        assert [(c.function.name, json.loads(c.function.arguments)) for c in got.tool_calls] == _calls(message)

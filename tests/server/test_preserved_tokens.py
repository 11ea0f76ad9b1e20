"""A chat format's tool-call markers that the vocabulary holds as control tokens (Mistral's ``[TOOL_CALLS]``) reach
the tool parser: the server asks the detokenizer to keep them, and only them. Run on a Mistral-style vocabulary
(tekken, ``[TOOL_CALLS]`` a control token), from the request body through the engine's own detokenizer, token by
token, to the parsed calls."""

from __future__ import annotations

import json
from types import SimpleNamespace

import orjson
import pytest

from gpullama.engine.detokenizer import Detokenizer
from gpullama.engine.sequence import Sequence
from gpullama.server.openai.chat import prepare_chat
from gpullama.server.openai.responses.items import OutputItems
from gpullama.server.openai.responses.request import parse_responses
from gpullama.server.openai.responses.serving import prepare
from gpullama.server.pipeline.chat_output import ChatOutputShaper
from gpullama.server.pipeline.sampling import sampling_params
from gpullama.server.state import ServerConfig
from gpullama.tokenizer import Tokenizer
from tests.chat.test_tool_parsers import TOOLS
from tests.fixtures.vocabs import vocab_metadata

# Mistral v3's template, shortened: tools before the last user turn, calls after [TOOL_CALLS]
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}"
    "{% if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m.content }}[/INST]{% elif m.role == 'assistant' %}{% if m.tool_calls %}[TOOL_CALLS]["
    "{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]"
    "{% else %}{{ m.content }}{% endif %}{{ eos_token }}{% elif m.role == 'tool' %}"
    "[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{% endif %}{% endfor %}"
)
CALL = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def mistral_state() -> SimpleNamespace:
    """What `prepare_chat` reads of the server state: a served model whose tokenizer is Mistral-style."""
    tok = Tokenizer.from_metadata(dict(vocab_metadata("tekken"), **{"tokenizer.chat_template": MISTRAL_TEMPLATE}))
    return SimpleNamespace(llm=SimpleNamespace(tokenizer=tok), model_name="mistral-tiny", config=ServerConfig())


def _generate(state: SimpleNamespace, body: dict, output: str,
              endpoint: str = "chat") -> tuple[list[str], ChatOutputShaper]:
    """Plan a chat (or Responses) body as the server does, then detokenize `output`'s tokens one step at a time as
    the engine does; the text pieces and the request's output shaper."""
    tok = state.llm.tokenizer
    if endpoint == "chat":
        req, plan, prompt, prompt_ids = prepare_chat(state, orjson.dumps(body))
    else:
        req = parse_responses(body)
        plan, prompt, prompt_ids = prepare(tok, req)
    ids = tok.encode(output)
    seq = Sequence("r", prompt_ids, sampling_params(req.options), max_tokens=len(ids))
    detok, pieces = Detokenizer(tok), []
    for i, token in enumerate(ids):
        seq.append_token(token)
        pieces.append(detok.update(seq, finishing=i == len(ids) - 1)[0])
    return pieces, ChatOutputShaper(plan, prompt)


def test_the_vocabulary_holds_the_marker_as_a_control_token(mistral_state):
    tok = mistral_state.llm.tokenizer
    ids = tok.encode(CALL)
    assert tok.convert_ids_to_tokens(ids[:1]) == ["[TOOL_CALLS]"] and ids[0] in tok.special_token_ids
    assert not tok.decode(ids, skip_special_tokens=True).startswith("[TOOL_CALLS]")  # what the bug dropped


def test_auto_tool_call_after_the_control_token_is_parsed_whole_and_streamed(mistral_state):
    pieces, shaper = _generate(mistral_state, {"messages": USER, "tools": TOOLS}, CALL)
    assert "".join(pieces) == CALL
    message = shaper.message(0, "".join(pieces))
    assert message["content"] is None
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    streamed = ChatOutputShaper(shaper.plan, "")
    fields = [f for f in [*(streamed.delta(0, p) for p in pieces if p), streamed.finish(0)] if f]
    assert not any(f.get("content") for f in fields)
    assert "".join(t["function"]["arguments"] for f in fields for t in f.get("tool_calls", [])) == \
        message["tool_calls"][0]["function"]["arguments"]
    assert streamed.finish_reason(0, "stop") == "tool_calls"


def test_other_control_tokens_still_leave_the_text(mistral_state):
    """Only the format's markers are kept: another control token ([INST]) is still dropped, and without tools
    (or with tool_choice "none") no token is kept, so content never shows a marker."""
    pieces, shaper = _generate(mistral_state, {"messages": USER, "tools": TOOLS}, "Sure.[INST] " + CALL)
    text = "".join(pieces)
    assert "[INST]" not in text and text.endswith(CALL)
    assert shaper.message(0, text)["content"] == "Sure."
    for body in ({"messages": USER}, {"messages": USER, "tools": TOOLS, "tool_choice": "none"}):
        pieces, shaper = _generate(mistral_state, body, CALL)
        assert "[TOOL_CALLS]" not in "".join(pieces) and not shaper.message(0, "".join(pieces)).get("tool_calls")


def test_responses_function_call_after_the_control_token(mistral_state):
    """/v1/responses plans through the same path: the call becomes a function_call item."""
    body = {"input": USER[0]["content"], "tools": [{"type": "function", **t["function"]} for t in TOOLS]}
    pieces, shaper = _generate(mistral_state, body, CALL, endpoint="responses")
    items = OutputItems(shaper)
    for piece in pieces:
        items.feed(piece)
    items.end("completed")
    [call] = items.output()
    assert (call["type"], call["name"], json.loads(call["arguments"])) == (
        "function_call", "get_weather", {"city": "Paris", "unit": "celsius"})

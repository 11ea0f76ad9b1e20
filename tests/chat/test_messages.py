"""Chat messages are refused by name before the template sees them, with the OpenAI API's cap of 2048."""

from __future__ import annotations

import pytest

from gpullama.chat.messages import MAX_MESSAGES, check_messages
from gpullama.engine.admission import RequestError


def _refused(param: str, fn, *args) -> str:
    with pytest.raises(RequestError) as info:
        fn(*args)
    assert info.value.param == param, (param, info.value.param, str(info.value))
    message = str(info.value)
    assert message and "\n" not in message
    return message


@pytest.mark.parametrize(("messages", "param"), [
    ("hi", "messages"),
    ([], "messages"),
    ([{"role": "user", "content": "x"}] * (MAX_MESSAGES + 1), "messages"),
    (["hi"], "messages[0]"),
    ([{"role": ["user"], "content": "x"}], "messages[0].role"),
    ([{"role": {"user": 1}, "content": "x"}], "messages[0].role"),
    ([{"role": 3, "content": "x"}], "messages[0].role"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "x"}, {"role": "wizard", "content": "x"}], "messages[1].role"),
    ([{"role": "user", "content": {"text": "x"}}], "messages[0].content"),
])
def test_messages(messages, param: str) -> None:
    _refused(param, check_messages, messages)


def test_valid_messages_pass() -> None:
    check_messages([{"role": r, "content": "x"} for r in ("system", "developer", "user", "assistant", "tool")])
    check_messages([{"role": "user", "content": [{"type": "text", "text": "x"}]}, {"role": "assistant"}])

"""The server's cap on choices per request: n, and n times the prompts, at most 16 (refused by name)."""

from __future__ import annotations

import pytest

from gpullama.engine.admission import RequestError
from gpullama.server.pipeline.sampling import MAX_N, check_choices


def _refused(param: str, fn, *args) -> None:
    with pytest.raises(RequestError) as info:
        fn(*args)
    assert info.value.param == param, (param, info.value.param, str(info.value))


def test_choices() -> None:
    check_choices(1, MAX_N)
    check_choices(4, 4)
    _refused("n", check_choices, 1, 0)
    _refused("n", check_choices, 1, MAX_N + 1)
    _refused("n", check_choices, 1, 2**64)
    _refused("n", check_choices, 3, 6)
    _refused("prompt", check_choices, MAX_N + 1, 1)

"""What a CPU user installs is what the library needs: no Triton, no transformers (the test extra brings them);
the grammar engine (llguidance) needs neither.

Each check runs in a fresh interpreter where importing those packages fails, as it would where they are absent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ABSENT = ("triton", "transformers", "kernels", "xgrammar")

_RUN = """
import sys
for name in {absent!r}:
    sys.modules[name] = None  # `import name` now raises ImportError
from gpullama import LLM, SamplingParams
llm = LLM({path!r}, device="cpu", dtype={dtype!r})
out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, temperature=0))[0]
assert len(out.token_ids) == 4, out
from gpullama.structured import StructuredOutput
spec = StructuredOutput(json_schema={{"type": "object", "properties": {{"a": {{"type": "integer"}}}}, "required": ["a"]}})
out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=24, temperature=0, structured_output=spec))[0]
assert "llguidance" in sys.modules
import gpullama.server.app  # the server's whole import graph
print("ok")
"""


@pytest.mark.parametrize("dtype", ["float32", "auto"], ids=["exact", "fast"])
def test_generation_structured_output_and_the_server_need_neither_triton_nor_transformers(tiny_model, dtype: str) -> None:
    path = tiny_model("llama", "Q8_0").path
    run = subprocess.run([sys.executable, "-c", _RUN.format(absent=ABSENT, path=str(path), dtype=dtype)],
                         capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0 and run.stdout.startswith("ok"), run.stderr[-3000:]

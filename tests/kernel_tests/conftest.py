"""Kernel tests run through Triton's CPU interpreter unless GPULLAMA_TEST_DEVICE=cuda asks for the GPU."""

import os
import sys

# Must be set before triton is first imported: kernels then run on CPU tensors.
ON_CPU = os.environ.get("GPULLAMA_TEST_DEVICE", "cpu") == "cpu"
if ON_CPU:
    os.environ["TRITON_INTERPRET"] = "1"


def _interpret_triton_language() -> None:
    """Rewrap triton.language's own @jit helpers (tl.zeros, tl.sum, ...) for the interpreter.

    They are decorated when triton is imported; if an earlier conftest imported it (through torch or
    transformers) before TRITON_INTERPRET was set, they are compiled-mode functions that refuse to run
    inside an interpreted kernel.
    """
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    wrapped: dict[int, InterpretedFunction] = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("triton.language"):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in wrapped:
                    wrapped[id(value)] = InterpretedFunction(value.fn)
                setattr(module, attr, wrapped[id(value)])


if ON_CPU and "triton" in sys.modules:
    import triton

    triton.knobs.runtime.interpret = True
    _interpret_triton_language()

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests put their tensors: CPU (interpreter), or CUDA when GPULLAMA_TEST_DEVICE=cuda."""
    name = os.environ.get("GPULLAMA_TEST_DEVICE", "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("GPULLAMA_TEST_DEVICE=cuda but no CUDA device")
    return torch.device(name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu`-marked tests cleanly where there is no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # the marker itself, not `"gpu" in item.keywords`: keywords also hold the names of the enclosing
        # folders, so a checkout in a directory called gpu would skip every test
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)

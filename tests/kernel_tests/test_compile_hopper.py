"""Every kernel compiles for Hopper (sm_90) with the installed Triton, checked here without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _has_ptxas() -> bool:
    """Whether the installed triton ships the NVIDIA backend and its ptxas (pip wheels do)."""
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _has_ptxas(), reason="triton build without the NVIDIA backend's ptxas")
@pytest.mark.skipif(os.environ.get("GPULLAMA_TEST_DEVICE") == "cuda", reason="this run compiles them for the real GPU")
def test_kernels_compile_for_sm90():
    """A fresh process (compiled mode, no interpreter) builds each kernel once for sm_90."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run([sys.executable, "-m", "tests.kernel_tests.compile_hopper"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr

"""The test tree cannot shadow installed packages: pytest must import our test folders as `tests.*` only."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_folder_is_a_package():
    """pytest puts the first folder above a test file that lacks ``__init__.py`` on ``sys.path``; were that
    ``tests/``, its subfolders (``kernels``, ``engine``, ...) would be importable as top-level packages and hide
    installed ones (``tests/kernels``, now ``tests/kernel_tests``, once hid transformers' ``kernels`` dependency)."""
    folders = [TESTS, *(p.parent for p in TESTS.rglob("*.py"))]
    missing = sorted({str(f.relative_to(TESTS.parent)) for f in folders if not (f / "__init__.py").is_file()})
    assert not missing, f"test folders without __init__.py: {missing}"


def test_no_top_level_module_comes_from_the_test_tree():
    assert str(TESTS) not in [str(Path(p).resolve()) for p in sys.path if p]
    shadowing = sorted(
        name for name, module in list(sys.modules.items())
        if "." not in name and name != "tests" and getattr(module, "__file__", None)
        and Path(module.__file__).resolve().is_relative_to(TESTS)
    )
    assert not shadowing, f"top-level modules imported from tests/: {shadowing}"


def test_no_test_folder_is_named_like_an_installed_module():
    """A test folder named like an importable top-level module (``tests/kernels`` beside the ``kernels``
    distribution) is one missing ``__init__.py`` away from hiding it, and confuses whoever reads a traceback."""
    names = sorted({p.name for p in TESTS.rglob("*") if p.is_dir() and (p / "__init__.py").is_file()})
    clashes = [name for name in names if importlib.util.find_spec(name) is not None]
    assert not clashes, f"test folders named like installed modules: {clashes}"

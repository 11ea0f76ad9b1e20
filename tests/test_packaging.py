"""The wheel ships every file the package reads at run time: each non-Python file under ``gpullama/`` matches a
``[tool.setuptools.package-data]`` pattern of its package (the C kernels' source was once left out: an installed
wheel then had no CPU fast path)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def _shipped(path: Path, package_data: dict[str, list[str]]) -> bool:
    for package, patterns in package_data.items():
        folder = ROOT / package.replace(".", "/")
        if path.is_relative_to(folder):
            inside = str(path.relative_to(folder))
            if any(fnmatch.fnmatchcase(inside, pattern) and inside.count("/") == pattern.count("/")
                   for pattern in patterns):
                return True
    return False


def test_every_data_file_is_package_data():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    data = [p for p in (ROOT / "gpullama").rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")]
    assert any(p.name == "cpu_native.c" for p in data)
    missing = sorted(str(p.relative_to(ROOT)) for p in data if not _shipped(p, package_data))
    assert not missing, f"files the wheel would leave out (add them to package-data in pyproject.toml): {missing}"

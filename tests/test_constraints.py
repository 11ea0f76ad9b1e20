"""The pinned set `make` installs from (constraints.txt) covers every requirement of the package and its extras."""

from __future__ import annotations

import re
from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

CONSTRAINTS = Path(__file__).resolve().parents[1] / "constraints.txt"


def pins() -> dict[str, str]:
    found = {}
    for line in CONSTRAINTS.read_text().splitlines():
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line.strip())
        if m:
            found[canonicalize_name(m[1])] = m[2]
    return found


def test_every_requirement_of_the_package_and_its_extras_is_pinned() -> None:
    """A requirement added to pyproject.toml without `make lock` would install whatever is newest that day."""
    pinned = pins()
    assert "torch" in pinned and "triton" in pinned
    missing = sorted({canonicalize_name(Requirement(r).name) for r in requires("gpullama") or []} - set(pinned))
    assert not missing, f"not in constraints.txt (run `make lock`, then `make clean test`): {missing}"

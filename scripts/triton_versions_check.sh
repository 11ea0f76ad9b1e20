#!/usr/bin/env bash
# The kernel interpreter tests under the GPU machine's Triton (3.6.0), in a scratch venv outside the repo.
# The device runs torch 2.11.0+cu130 / triton 3.6.0; PyPI's only linux torch 2.11 wheels are CUDA builds of
# several GB, so the scratch venv pairs triton 3.6.0 with the CPU wheel of torch 2.13.0 (the one `make` uses).
# Not part of `make test`. Usage:
#   scripts/triton_versions_check.sh [pytest args]       (default: tests/kernel_tests)
# Env: VENV (default /work/venv-triton36, else ../venv-triton36), TRITON_VERSION (3.6.0), TORCH_VERSION (2.13.0),
#      PYTHON (python3) to create it.
set -euo pipefail
cd "$(dirname "$0")/.."
TRITON_VERSION="${TRITON_VERSION:-3.6.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VENV="${VENV:-$( [ -d /work ] && echo /work/venv-triton36 || echo "$PWD/../venv-triton36")}"
STAMP="$VENV/.gpullama-installed"
if [ "$(cat "$STAMP" 2>/dev/null)" != "torch $TORCH_VERSION triton $TRITON_VERSION $(md5sum < pyproject.toml)" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
    # torch first, pinned (a bare requirement pulls a CUDA build), then triton pinned, then the project's other
    # requirements and test extras read from pyproject.toml (the package itself is not installed: PYTHONPATH is)
    "$VENV/bin/pip" install -q "torch==$TORCH_VERSION" "triton==$TRITON_VERSION"
    "$VENV/bin/python" - <<'PY' > "$VENV/requirements.txt"
import re, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in p["dependencies"] + p["optional-dependencies"]["test"]:
    if re.match(r"(torch|triton)\b", req) is None:
        print(req)
PY
    "$VENV/bin/pip" install -q -r "$VENV/requirements.txt" "triton==$TRITON_VERSION" "torch==$TORCH_VERSION"
    echo "torch $TORCH_VERSION triton $TRITON_VERSION $(md5sum < pyproject.toml)" > "$STAMP"
fi
"$VENV/bin/python" -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}')"
[ $# -eq 0 ] && set -- tests/kernel_tests
PYTHONPATH="$PWD" "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"

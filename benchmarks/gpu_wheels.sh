#!/usr/bin/env bash
# Download the wheels benchmarks/gpu_check.sh installs on the GPU machine, which has no network and lacks these
# packages (it has torch, triton, transformers, tokenizers, numpy, jinja2, pytest, prometheus-client, httpx,
# anyio, click, h11, attrs, pyyaml, requests, tqdm). Run here, before the device call; the folder is git-ignored
# and travels with the `run` tool's carry list. Versions are the ones installed in $PYTHON's environment (what the
# tests pass with here); pass NAME==VERSION arguments to add or override.
# Usage: benchmarks/gpu_wheels.sh [NAME==VERSION ...]
# Env: WHEELS (./wheels), PYTHON (the env to read versions from: .venv/bin/python, else python3),
#      PY_VERSION (3.12, the GPU machine's Python).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="${WHEELS:-wheels}"
PY_VERSION="${PY_VERSION:-3.12}"
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
# the server and the GGUF writer (gguf, starlette, uvicorn, orjson); structured output (jsonschema, llguidance) and
# what they pull that the machine lacks; pydantic for the structured-output tests (typing-extensions: pydantic needs
# a newer one than some machines have)
PACKAGES=(gguf starlette uvicorn orjson jsonschema jsonschema-specifications referencing rpds-py
          llguidance pydantic pydantic-core annotated-types typing-inspection typing-extensions)
pins=$("$PYTHON" - "${PACKAGES[@]}" <<'PY'
import importlib.metadata as md
import sys
print(" ".join(f"{name}=={md.version(name)}" for name in sys.argv[1:]))
PY
)
rm -rf "$WHEELS"
mkdir -p "$WHEELS"
# one version of each, built for the machine's CPython on x86-64 linux
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" $pins "$@" 2>&1 | grep -v "is ignored" || true
count=$(ls "$WHEELS"/*.whl | wc -l)
echo "$count wheels, $(du -sh "$WHEELS" | cut -f1), in $WHEELS (for CPython $PY_VERSION):"
ls "$WHEELS"
if [ "$count" -lt "${#PACKAGES[@]}" ]; then
    echo "some wheels are missing (expected ${#PACKAGES[@]})" >&2
    exit 1
fi

#!/usr/bin/env bash
# GPU check (one NVIDIA Hopper GPU, torch + triton preinstalled, no network): the kernel tests on CUDA, then
# benchmarks/gpu_check.py (logits of TritonOps vs TorchOps, decode timings). Full log: $LOG; the table is last.
# Usage: benchmarks/gpu_check.sh [extra gpu_check.py args]    (PYTHON=... to pick the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
LOG="${LOG:-${OUT:-.}/gpu_check.log}"
: > "$LOG"
echo "gpu_check $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)" | tee -a "$LOG"

missing=$("$PYTHON" - <<'PY'
import importlib.util
print(" ".join(m for m in ("torch", "triton", "gguf", "numpy", "pytest") if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ] && [ -d "${WHEELS:-wheels}" ]; then
    "$PYTHON" -m pip install -q --no-index --find-links "${WHEELS:-wheels}" $missing >>"$LOG" 2>&1
    missing=$("$PYTHON" -c 'import importlib.util as u; print(" ".join(m for m in ("gguf","numpy","pytest") if u.find_spec(m) is None))')
fi
if [ -n "$missing" ]; then
    echo "missing Python packages: $missing (put their wheels in ./wheels or set WHEELS=dir)" | tee -a "$LOG"
    exit 2
fi

# 1. kernel tests on CUDA (no interpreter); --confcutdir keeps the repo-wide conftest (transformers) out
echo "== pytest tests/kernels on CUDA" | tee -a "$LOG"
GPULLAMA_TEST_DEVICE=cuda TRITON_INTERPRET=0 timeout 130 "$PYTHON" -m pytest -q -p no:cacheprovider \
    --confcutdir=tests/kernels tests/kernels -m "gpu or not gpu" >>"$LOG" 2>&1
tests_rc=$?
tail -n 3 "$LOG"

# 2. random Llama-3.2-1B-shaped model: logits check and decode timings, in what is left of 4 m 45 s
budget=$((285 - SECONDS))
echo "== gpu_check.py (${budget}s left)" | tee -a "$LOG"
TRITON_INTERPRET=0 timeout "$budget" "$PYTHON" benchmarks/gpu_check.py --log "$LOG" "$@" > "$LOG.table" 2>>"$LOG"
check_rc=$?
echo
echo "pytest tests/kernels on CUDA: exit $tests_rc; gpu_check.py: exit $check_rc (log: $LOG)"
cat "$LOG.table"
[ "$tests_rc" -eq 0 ] && [ "$check_rc" -eq 0 ]

#!/usr/bin/env bash
# GPU check for one NVIDIA Hopper GPU (torch + triton preinstalled, no network), about 5 minutes in all:
#   tests  pytest tests/kernel_tests compiled on CUDA (the interpreter tests plus the `gpu`-marked real shapes)
#   check  benchmarks/gpu_check.py: logits of TritonOps vs TorchOps, decode step timings (eager, graphs, torch);
#          a Gemma-3-4B-shaped random vision tower (--towers gemma3): one image's embeddings through TritonOps vs
#          TorchOps float32 on the device, and the encode time of one 896x896 image (Triton, torch) in the table
#   serve  a random Llama-3.2-1B-shaped Q4_K GGUF (benchmarks/make_random_llama.py, written on the CPU while the
#          steps above run), gpullama-serve on it (CUDA, graphs on) and bench_server.py at 1 and 64 streaming
#          clients (benchmarks/gpu_serve.py); its rows join the timing table
# The table is printed last; the full log goes to $LOG. Exit status 0 only when every step passed.
#
# Usage: benchmarks/gpu_check.sh [--tiny] [--steps tests,check,serve] [extra gpu_check.py args]
#   --tiny   toy shapes (gpu_check.py --tiny, a tiny served model, short bench runs); without CUDA everything
#            runs on the CPU (the Triton interpreter, the torch serve path): how the script itself is checked
#   --steps  the steps to run (a rerun after a fix can take only the one that failed)
# Env: PYTHON (python3); WHEELS (./wheels, from benchmarks/gpu_wheels.sh: installed with pip --no-index --target
#      $SITE where the machine lacks them); SITE (/tmp/gpullama-site); LOG (gpu_check.log in $OUT, else .);
#      BUDGET (seconds for the whole run: 300 on CUDA, 900 on the CPU); SERVE_SECONDS (kept for the serve
#      step: 110); TEST_SECONDS (the tests' cap: 100); SERVE_DURATION (seconds per client count: 12).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
LOG="${LOG:-${OUT:-.}/gpu_check.log}"
TABLE="$LOG.table"
WHEELS="${WHEELS:-wheels}"
SITE="${SITE:-/tmp/gpullama-site}"
tiny=0
steps="tests,check,serve"
check_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --tiny) tiny=1; check_args+=(--tiny) ;;
        --steps) steps="$2"; shift ;;
        --steps=*) steps="${1#--steps=}" ;;
        *) check_args+=("$1") ;;
    esac
    shift
done
: > "$LOG"
: > "$TABLE"
say() { echo "$@" | tee -a "$LOG"; }
say "gpu_check $(date -u +%FT%TZ) on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi'), steps $steps"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# 0. the carried wheels of packages the machine lacks (or has at another version), into $SITE
if [ -d "$WHEELS" ]; then
    need=$("$PYTHON" - "$WHEELS" <<'PY'
import importlib.metadata as md
import pathlib
import sys

for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    try:
        if md.version(name) == version:
            continue
    except md.PackageNotFoundError:
        pass
    print(wheel)
PY
)
    if [ -n "$need" ]; then
        say "installing into $SITE: $(echo $need | xargs -n1 basename | tr '\n' ' ')"
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            $need >>"$LOG" 2>&1 || say "pip install --target $SITE failed (see $LOG)"
    fi
    export PYTHONPATH="$PYTHONPATH:$SITE"
fi
missing=$("$PYTHON" -c 'import importlib.util as u; print(" ".join(m for m in ("torch", "triton", "gguf", "numpy", "pytest", "starlette", "uvicorn", "orjson", "httpx", "tokenizers", "jinja2") if u.find_spec(m) is None))')
if [ -n "$missing" ]; then
    say "missing Python packages: $missing (benchmarks/gpu_wheels.sh puts their wheels in ./wheels)"
    exit 2
fi

device=$("$PYTHON" -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')
if [ "$device" = cpu ] && [ "$tiny" = 0 ]; then
    say "no CUDA device: run with --tiny to check the script on the CPU"
    exit 2
fi
if [ "$device" = cuda ]; then
    export TRITON_INTERPRET=0 GPULLAMA_TEST_DEVICE=cuda
    BUDGET="${BUDGET:-300}"
else
    export TRITON_INTERPRET=1 GPULLAMA_TEST_DEVICE=cpu
    BUDGET="${BUDGET:-900}"
    # the interpreter takes about a second per decode step: exercise every path once (given args still win)
    check_args=(--iters 1 --batches 1,2 --context 32 "${check_args[@]}")
fi
SERVE_SECONDS="${SERVE_SECONDS:-110}"
[[ ",$steps," == *,serve,* ]] || SERVE_SECONDS=0
say "device $device, budget ${BUDGET}s ($SERVE_SECONDS for the serve step)"

# the served model is written on the CPU while the GPU steps run
model_dir=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$model_dir"' EXIT
if [ "$tiny" = 1 ]; then shape=tiny; else shape=llama-3.2-1b; fi
model="$model_dir/$shape-q4_k.gguf"
writer_pid=
if [[ ",$steps," == *,serve,* ]]; then
    "$PYTHON" benchmarks/make_random_llama.py --shape "$shape" --type q4_k --out "$model" >"$model_dir/write.log" 2>&1 &
    writer_pid=$!
fi

rc_tests=skipped rc_check=skipped rc_serve=skipped
# 1. kernel tests; --confcutdir keeps the repo-wide conftest (transformers, tiny GGUF models) out
if [[ ",$steps," == *,tests,* ]]; then
    if [ "$device" = cuda ]; then marks=(-m "gpu or not gpu"); else marks=(); fi
    xdist=()
    if [ "$device" = cuda ] && "$PYTHON" -c 'import xdist' 2>/dev/null; then xdist=(-n 8); fi  # compiles in parallel
    say "== pytest tests/kernel_tests on $device ${xdist[*]}"
    timeout "${TEST_SECONDS:-100}" "$PYTHON" -m pytest -q -p no:cacheprovider --confcutdir=tests/kernel_tests \
        "${xdist[@]}" tests/kernel_tests "${marks[@]}" >>"$LOG" 2>&1
    rc_tests=$?
    tail -n 1 "$LOG"
fi

# 2. random Llama-3.2-1B-shaped decoder: logits check and decode timings, in what the serve step leaves
if [[ ",$steps," == *,check,* ]]; then
    left=$((BUDGET - SERVE_SECONDS - SECONDS))
    [ "$left" -ge 30 ] || left=30  # `timeout 0` would mean no limit
    say "== gpu_check.py on $device (${left}s)"
    # its log records go to stderr, hence to $LOG (--log /dev/null: not twice)
    timeout "$left" "$PYTHON" benchmarks/gpu_check.py --device "$device" --log /dev/null "${check_args[@]}" \
        >"$TABLE" 2>>"$LOG"
    rc_check=$?
fi
if ! grep -q '^| format | batch |' "$TABLE"; then
    printf '\n| format | batch | path | ms/step | tok/s | weights GB | %% of floor |\n|---|---|---|---|---|---|---|\n' >>"$TABLE"
fi

# 3. end-to-end serve: gpullama-serve on the random GGUF, bench_server.py at 1 and 64 streaming clients
if [[ ",$steps," == *,serve,* ]]; then
    wait "$writer_pid"
    written=$?
    cat "$model_dir/write.log" >>"$LOG"
    if [ "$written" -ne 0 ] || [ ! -s "$model" ]; then
        say "== serve: writing the model failed (see $LOG)"
        rc_serve=1
    else
        left=$((BUDGET - SECONDS))
        [ "$left" -ge 60 ] || left=60
        if [ "$tiny" = 1 ]; then serve_args=(--duration "${SERVE_DURATION:-4}" --max-tokens 32);
        else serve_args=(--duration "${SERVE_DURATION:-12}" --max-tokens 128); fi
        say "== serve on $device (${left}s): $(tail -n 1 "$model_dir/write.log")"
        timeout "$left" "$PYTHON" benchmarks/gpu_serve.py --model "$model" --format q4_k --device "$device" \
            --clients 1,64 "${serve_args[@]}" --log "$LOG" >>"$TABLE" 2>>"$LOG"
        rc_serve=$?
    fi
fi

echo
echo "tests: exit $rc_tests; gpu_check.py: exit $rc_check; serve: exit $rc_serve; ${SECONDS}s (log: $LOG)"
cat "$TABLE"
for rc in "$rc_tests" "$rc_check" "$rc_serve"; do
    [ "$rc" = 0 ] || [ "$rc" = skipped ] || exit 1
done

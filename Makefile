# The README's two commands: `make serve` (main job) and `make test` (whole suite).
# Both build .venv with scripts/setup-venv: torch first (TORCH=cpu by default: the CPU build from PyTorch's wheel
# index; TORCH=cu130 etc. for a CUDA build), then the package with every version pinned by constraints.txt.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= cpu
PY := $(VENV)/bin/python
MODEL ?= smollm2-135m
HOST ?= 127.0.0.1
PORT ?= 8080
# `make test`'s pytest worker processes (pytest-xdist; each takes whole test files): while one worker waits on a
# server, a subprocess or a single-threaded step, the other computes. 0 runs the suite in one process.
PYTEST_WORKERS ?= 2
export PYTHON TORCH

.PHONY: install install-test serve generate test lint bench lock clean

# The runtime environment (what `make serve` needs: no test tools, no Triton on a CPU build of torch).
$(VENV)/.installed-$(TORCH): pyproject.toml constraints.txt scripts/setup-venv
	scripts/setup-venv $(VENV)
	touch $@

# The test environment: the runtime one plus the test extra (transformers, triton for the interpreter, ...).
$(VENV)/.installed-$(TORCH)-test: pyproject.toml constraints.txt scripts/setup-venv
	scripts/setup-venv $(VENV) test
	touch $@ $(VENV)/.installed-$(TORCH)

install: $(VENV)/.installed-$(TORCH)

install-test: $(VENV)/.installed-$(TORCH)-test

serve: install
	$(VENV)/bin/gpullama-serve --model $(MODEL) --host $(HOST) --port $(PORT)

generate: install
	$(VENV)/bin/gpullama generate --model $(MODEL) --prompt "The capital of France is" --max-tokens 32

test: install-test
	$(PY) -m pip check
	scripts/install-chromium
	$(VENV)/bin/ruff check .
	$(VENV)/bin/gpullama pull $(MODEL)
	$(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint: install-test
	$(VENV)/bin/ruff check .

bench: install
	$(PY) benchmarks/bench_decode.py --model $(MODEL)

# Refresh constraints.txt from the newest releases pyproject.toml allows; then `make clean test` before committing.
lock:
	scripts/lock-deps

clean:
	rm -rf $(VENV) build *.egg-info

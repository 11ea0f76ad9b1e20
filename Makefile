# The README's two commands: `make serve` (main job) and `make test` (whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
MODEL ?= smollm2-135m
HOST ?= 127.0.0.1
PORT ?= 8080

.PHONY: install serve generate test lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU wheel of torch first: an open range would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

serve: install
	$(VENV)/bin/gpullama-serve --model $(MODEL) --host $(HOST) --port $(PORT)

generate: install
	$(VENV)/bin/gpullama generate --model $(MODEL) --prompt "The capital of France is" --max-tokens 32

test: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/gpullama pull $(MODEL)
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .

bench: install
	$(PY) benchmarks/bench_decode.py --model $(MODEL)

clean:
	rm -rf $(VENV) build *.egg-info

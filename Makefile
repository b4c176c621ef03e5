# Quick start: `make demo` and `make test` each set up .venv on first use.
# `demo` needs only the runtime packages; `test` (and lint, bench) add the dev extra.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
CORE    := $(VENV)/.installed-core
DEV     := $(VENV)/.installed-dev

.PHONY: setup demo test lint bench clean

$(CORE): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch first: a looser spec would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	@touch $(CORE)

$(DEV): $(CORE)
	$(BIN)/pip install -q -e '.[dev]'
	@touch $(DEV)

setup: $(DEV)

demo: $(CORE)
	$(BIN)/qklab demo

test: $(DEV)
	$(BIN)/python -m pytest tests

lint: $(DEV)
	$(BIN)/ruff check src tests benchmarks

bench: $(DEV)
	$(BIN)/python benchmarks/throughput.py --config small

clean:
	rm -rf $(VENV) .cache runs

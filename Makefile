# kvgate: `make demo` runs the whole system on the CPU; `make test` runs the test suite.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=
ARGS ?=

.PHONY: test test-quick lint format demo clean bench

# Recreated when missing or when pyproject.toml changed since the last install.
# pip's output goes to a log; on failure its tail is shown.
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "installing kvgate into $(VENV) ($(TORCH), CPU build; log: $(VENV)/install.log)..."
	@( $(PY) -m pip install -q --upgrade pip \
	  && $(PY) -m pip install -q $(TORCH) \
	  && $(PY) -m pip install -q -e '.[gateway,worker,test,bench]' ) > $(VENV)/install.log 2>&1 \
	  || { tail -40 $(VENV)/install.log; exit 1; }
	@touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

test: lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m bench.demo $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

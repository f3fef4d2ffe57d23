# kvgate worker: the torch inference engine with its OpenAI API and KV-event publisher.
#   make images   (docker, podman or buildah; REGISTRY=... to tag for your registry), or
#   docker build -f docker/worker.Dockerfile -t ghcr.io/kvgate/kvgate-worker:0.1.0 .
# torch is requirements/torch.in's version; where it comes from picks the build:
#   (default)                 PyPI: on x86_64 Linux the CUDA build. Its CUDA runtime (nvidia-*
#                             packages, triton) comes from requirements/cuda.lock; the node's
#                             NVIDIA driver arrives through the NVIDIA container toolkit.
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu    the CPU build (kind, minikube)
#   a wheel in docker/wheels/ (make images TORCH_WHEEL=PATH)  that wheel, e.g. a local CPU build
# BASE_IMAGE: any Debian-like image with Python 3.11 and its venv module (python3-venv).
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# pip trusts the system's CA bundle (a build behind a TLS-inspecting proxy mounts its own over
# it: docs/kubernetes.md); a build argument, so it stays out of the image.
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN python3 -m venv /opt/kvgate
COPY requirements/worker.lock requirements/cuda.lock requirements/torch.in /tmp/req/
RUN /opt/kvgate/bin/pip install --require-hashes --no-deps -r /tmp/req/worker.lock
# torch before the sources (its layer is the largest, and a code change reuses it), without its
# dependencies: worker.lock holds them, and cuda.lock the CUDA build's runtime.
ARG TORCH_INDEX_URL=
COPY docker/wheels/ /tmp/wheels/
RUN set -eu; \
    torch=$(grep '^torch==' /tmp/req/torch.in); \
    if ls /tmp/wheels/torch-*.whl >/dev/null 2>&1; then \
        where="--no-index --find-links /tmp/wheels"; \
    else \
        where="${TORCH_INDEX_URL:+--index-url $TORCH_INDEX_URL}"; \
    fi; \
    /opt/kvgate/bin/pip install --no-deps $where "$torch"; \
    if /opt/kvgate/bin/python -c 'import importlib.metadata as m, sys; \
            sys.exit(not any(r.startswith(("nvidia-", "cuda-")) for r in m.requires("torch") or ()))'; then \
        /opt/kvgate/bin/pip install --require-hashes --no-deps -r /tmp/req/cuda.lock; \
    fi
COPY pyproject.toml README.md /src/
COPY cachekey /src/cachekey
COPY kvgate_cli /src/kvgate_cli
COPY worker /src/worker
RUN /opt/kvgate/bin/pip wheel --no-deps --wheel-dir /tmp/dist /src \
    && /opt/kvgate/bin/pip install --no-deps --no-index /tmp/dist/kvgate-*.whl \
    && /opt/kvgate/bin/pip check \
    && /opt/kvgate/bin/python -c "import torch, worker; print('torch', torch.__version__)"

FROM ${BASE_IMAGE}
ENV PATH=/opt/kvgate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    KVGATE_CACHE_DIR=/var/cache/kvgate \
    XDG_CACHE_HOME=/var/cache/kvgate
COPY --from=build /opt/kvgate /opt/kvgate
RUN groupadd --gid 10001 kvgate \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvgate \
    && mkdir -p /var/cache/kvgate /models && chown 10001:10001 /var/cache/kvgate
USER 10001:10001

EXPOSE 8000 5557 5558
ENTRYPOINT ["python", "-m", "worker"]
# The chart always passes its own arguments; this default serves the demo model.
CMD ["--model", "demo", "--host", "0.0.0.0", "--port", "8000"]

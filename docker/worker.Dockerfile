# kvgate worker: the torch inference engine with its OpenAI API and KV-event publisher.
#   make images   (REGISTRY=... to tag for your registry; docs/kubernetes.md), or
#   docker build -f docker/worker.Dockerfile -t ghcr.io/kvgate/kvgate-worker:0.1.0 .
# PyPI's Linux x86_64 torch wheel is the CUDA build: it pulls the CUDA runtime libraries in as
# nvidia-* pip packages, so a slim Python base is enough; the node's NVIDIA driver arrives through
# the NVIDIA container toolkit. --build-arg TORCH=... picks another build (it must stay
# torch==2.13.0): `make images TORCH_INDEX=https://download.pytorch.org/whl/cpu` passes
# TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" for a CPU-only worker.
FROM python:3.11-slim

ARG TORCH=torch==2.13.0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    KVGATE_CACHE_DIR=/var/cache/kvgate \
    XDG_CACHE_HOME=/var/cache/kvgate

# torch first: the largest layer, and it changes least often.
# Unquoted on purpose: TORCH may carry pip options such as --index-url.
RUN pip install ${TORCH}

WORKDIR /app
COPY pyproject.toml README.md ./
COPY cachekey ./cachekey
COPY worker ./worker
RUN pip install ".[worker]" && python -c "import torch, worker; print(torch.__version__)"

RUN groupadd --gid 10001 kvgate \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvgate \
    && mkdir -p /var/cache/kvgate /models && chown 10001:10001 /var/cache/kvgate
USER 10001:10001

EXPOSE 8000 5557 5558
ENTRYPOINT ["python", "-m", "worker"]
# The chart always passes its own arguments; this default serves the demo model.
CMD ["--model", "demo", "--host", "0.0.0.0", "--port", "8000"]

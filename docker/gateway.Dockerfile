# kvgate gateway: the OpenAI-compatible routing proxy. No torch, no GPU.
#   make images   (REGISTRY=... to tag for your registry; docs/kubernetes.md), or
#   docker build -f docker/gateway.Dockerfile -t ghcr.io/kvgate/kvgate-gateway:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/tmp \
    KVGATE_CACHE_DIR=/var/cache/kvgate

WORKDIR /app
COPY pyproject.toml README.md ./
COPY cachekey ./cachekey
COPY gateway ./gateway
RUN pip install ".[gateway]" \
    && python -c "import sys, gateway, gateway.epp; assert 'torch' not in sys.modules" \
    && ! pip show torch >/dev/null 2>&1

# The chart runs this uid with a read-only root filesystem; /tmp and the cache are emptyDirs there.
RUN groupadd --gid 10001 kvgate \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvgate \
    && mkdir -p /var/cache/kvgate && chown 10001:10001 /var/cache/kvgate
USER 10001:10001

EXPOSE 8080 9002
ENTRYPOINT ["python", "-m", "gateway"]
CMD ["--host", "0.0.0.0", "--port", "8080"]

# kvgate gateway: the OpenAI-compatible routing proxy. No torch, no GPU.
#   make images   (docker, podman or buildah; REGISTRY=... to tag for your registry), or
#   docker build -f docker/gateway.Dockerfile -t ghcr.io/kvgate/kvgate-gateway:0.1.0 .
# BASE_IMAGE: any Debian-like image with Python 3.11 and its venv module (python3-venv); the
# image ships one virtualenv, /opt/kvgate, holding requirements/gateway.lock and kvgate's wheel.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# pip trusts the system's CA bundle (a build behind a TLS-inspecting proxy mounts its own over
# it: docs/kubernetes.md); a build argument, so it stays out of the image.
ARG PIP_CERT=/etc/ssl/certs/ca-certificates.crt
RUN python3 -m venv /opt/kvgate
# The locked dependencies, hashes checked, before the sources: a code change reuses this layer.
COPY requirements/gateway.lock /tmp/req/
RUN /opt/kvgate/bin/pip install --require-hashes --no-deps -r /tmp/req/gateway.lock
COPY pyproject.toml README.md /src/
COPY cachekey /src/cachekey
COPY kvgate_cli /src/kvgate_cli
COPY gateway /src/gateway
# A wheel of the gateway's packages, installed (pip compiles it); the sources stay in this stage.
RUN /opt/kvgate/bin/pip wheel --no-deps --wheel-dir /tmp/dist /src \
    && /opt/kvgate/bin/pip install --no-deps --no-index /tmp/dist/kvgate-*.whl \
    && /opt/kvgate/bin/pip check \
    && /opt/kvgate/bin/python -c "import sys, gateway, gateway.epp; assert 'torch' not in sys.modules" \
    && ! /opt/kvgate/bin/pip show torch >/dev/null 2>&1

FROM ${BASE_IMAGE}
ENV PATH=/opt/kvgate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    KVGATE_CACHE_DIR=/var/cache/kvgate
COPY --from=build /opt/kvgate /opt/kvgate
# The chart runs this uid with a read-only root filesystem; /tmp and the cache are emptyDirs there.
RUN groupadd --gid 10001 kvgate \
    && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvgate \
    && mkdir -p /var/cache/kvgate && chown 10001:10001 /var/cache/kvgate
USER 10001:10001

EXPOSE 8080 9002
ENTRYPOINT ["python", "-m", "gateway"]
CMD ["--host", "0.0.0.0", "--port", "8080"]

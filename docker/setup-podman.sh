#!/usr/bin/env bash
# Prepares podman or buildah to build (and podman to run) kvgate's images; `make images` and
# `make images-test` call it with DOCKER=podman or buildah. Idempotent: a second run only checks.
# It writes build/podman/ (the Makefile reads it):
#   containers.conf  runtime runc (crun refuses a hybrid cgroup layout) and default ulimits
#                    within this shell's hard limits, capped at 16384 files and 4096 processes
#                    (podman's defaults may exceed what runc may set: setrlimit EPERM)
#   base-image       the base image to build on: python:3.11-slim where the registry answers,
#                    else a local Debian bookworm image with python3 made by mmdebstrap
#   build-flags      the host's CA bundle mounted over the build's, for pip behind a proxy that
#                    re-signs TLS (the Dockerfiles point pip at that path)
# Missing packages are installed with apt-get when run as root on Debian/Ubuntu; otherwise it
# says which to install.
set -euo pipefail

ENGINE=${1:-podman}
OUT=${2:-build/podman}
BASE=python:3.11-slim
LOCAL_BASE=localhost/kvgate-base:bookworm-py311
CA=/etc/ssl/certs/ca-certificates.crt
mkdir -p "$OUT"

need=()
for tool in "$ENGINE" runc; do
  command -v "$tool" >/dev/null || need+=("$tool")
done
if ((${#need[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup-podman: installing ${need[*]} (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
  else
    echo "setup-podman: missing ${need[*]}; install them, e.g.: sudo apt-get install ${need[*]}" >&2
    exit 1
  fi
fi

limit() {  # this shell's hard limit, capped: runc may run under a lower one than the shell's
  local v; v=$(ulimit -H "$1"); [ "$v" = unlimited ] && v=$2; echo $((v < $2 ? v : $2))
}
nofile=$(limit -n 16384) nproc=$(limit -u 4096)
cat > "$OUT/containers.conf.new" <<EOF
# Written by docker/setup-podman.sh; read through CONTAINERS_CONF by the Makefile.
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]

[engine]
runtime = "runc"
EOF
mv "$OUT/containers.conf.new" "$OUT/containers.conf"
export CONTAINERS_CONF=$PWD/$OUT/containers.conf

if [ -f "$CA" ]; then
  echo "-v $CA:$CA:ro" > "$OUT/build-flags"
else
  : > "$OUT/build-flags"
fi

exists() { "$ENGINE" inspect --type image "$1" >/dev/null 2>&1; }
import_rootfs() {  # a root filesystem tarball -> an image (podman import; buildah has none)
  if [ "$ENGINE" = podman ]; then
    podman import --quiet --change 'CMD ["/bin/bash"]' "$1" "$2" >/dev/null
  else
    local ctr; ctr=$(buildah from scratch)
    buildah add --quiet "$ctr" "$1" / >/dev/null
    buildah config --cmd /bin/bash "$ctr"
    buildah commit --quiet --rm "$ctr" "$2" >/dev/null
  fi
}
if exists "$BASE" || timeout 120 "$ENGINE" pull -q "docker.io/library/$BASE" >/dev/null 2>&1; then
  echo "$BASE" > "$OUT/base-image"
  exit 0
fi
if ! exists "$LOCAL_BASE"; then
  echo "setup-podman: no registry answers for $BASE; making $LOCAL_BASE with mmdebstrap (a few minutes)"
  if ! command -v mmdebstrap >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null
    else
      echo "setup-podman: install mmdebstrap (sudo apt-get install mmdebstrap)," \
        "or pass BASE_IMAGE=an image with python3.11 and python3-venv" >&2
      exit 1
    fi
  fi
  tar="$OUT/base.tar"
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$tar" \
    "deb http://deb.debian.org/debian bookworm main" \
    "deb http://deb.debian.org/debian bookworm-updates main" \
    "deb http://deb.debian.org/debian-security bookworm-security main"
  import_rootfs "$tar" "$LOCAL_BASE"
  rm -f "$tar"
fi
echo "$LOCAL_BASE" > "$OUT/base-image"

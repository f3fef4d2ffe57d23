#!/usr/bin/env bash
# The container engine `make images` uses when DOCKER is not set (the Makefile's default):
# docker when its daemon answers; podman when it is installed; docker when only its CLI is (its
# own error then says the daemon is down, rather than a switch to podman that may install
# packages); podman when neither is (docker/setup-podman.sh then says what to install).
if docker info >/dev/null 2>&1; then
  echo docker
elif command -v podman >/dev/null; then
  echo podman
elif command -v docker >/dev/null; then
  echo docker
else
  echo podman
fi

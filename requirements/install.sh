#!/usr/bin/env bash
# Installs kvgate into a venv from the locks (the Makefile's $(STAMP) rule): pip's output goes to
# LOG, and a line every 20 s says which step is running and for how long, so a first install
# (2-3 minutes on 2 cores, most of it torch and the test dependencies) is never silent.
# Usage: requirements/install.sh PY LOG TORCH_PIP...   On failure: the log's tail, exit 1.
set -uo pipefail
PY=$1 LOG=$2
shift 2
TORCH_PIP=("$@")
# Exits 0 when the installed torch is a CUDA build, whose runtime requirements/cuda.lock holds.
TORCH_IS_CUDA='import importlib.metadata as m, sys
sys.exit(not any(r.startswith(("nvidia-", "cuda-")) for r in m.requires("torch") or ()))'

steps() {
  step "pip itself" "$PY" -m pip install -q --upgrade pip &&
    step "the locked dependencies (requirements/dev.lock)" \
      "$PY" -m pip install -q --require-hashes --no-deps -r requirements/dev.lock &&
    step "torch (${TORCH_PIP[*]})" "$PY" -m pip install -q --no-deps "${TORCH_PIP[@]}" &&
    if "$PY" -c "$TORCH_IS_CUDA"; then
      step "torch's CUDA runtime (requirements/cuda.lock)" \
        "$PY" -m pip install -q --require-hashes --no-deps -r requirements/cuda.lock
    fi &&
    step "kvgate itself (editable)" "$PY" -m pip install -q --no-deps -e . &&
    step "pip check" "$PY" -m pip check
}

step() {  # step WHAT COMMAND...: the step's name goes to the log, where the progress reads it
  echo "### step: $1" >>"$LOG"
  "${@:2}" >>"$LOG" 2>&1
}

: >"$LOG"
start=$SECONDS
steps &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
  for _ in $(seq 20); do  # a line every 20 s, none after the install ended
    kill -0 "$pid" 2>/dev/null || break 2
    sleep 1
  done
  now=$(sed -n 's/^### step: //p' "$LOG" | tail -1)
  echo "  ... $((SECONDS - start)) s: installing ${now:-pip}"
done
if ! wait "$pid"; then
  tail -40 "$LOG"
  exit 1
fi
echo "  installed in $((SECONDS - start)) s"

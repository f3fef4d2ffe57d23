#!/usr/bin/env bash
# The GPU acceptance runs of the engine, one command each, from the project root on a CUDA host:
#
#   bash bench/gpu.sh tests    # engine + model tests, every engine on CUDA (needs .devtools/force_cuda.py)
#   bash bench/gpu.sh engine   # bench.engine GPU suite: engine vs transformers vs floors, llama-1b shape
#   bash bench/gpu.sh memory   # an 8B-shape model finishes a 32k-token prompt with default memory settings
#   bash bench/gpu.sh ttft     # bench.ttft end to end: 4 workers on the GPU, the workload
#   bash bench/gpu.sh fused    # the fused elementwise kernels: their tests on CUDA, then
#                              # bench.engine fused vs unfused, alternated (bench.engine_ab)
#   bash bench/gpu.sh async    # --async-scheduling: its tests on CUDA, then bench.engine decode
#                              # (batch 1, 64, 16 at 2,048) off vs on, alternated, and a decode
#                              # step's profile off vs on (ms/step, GPU busy %), about 8 minutes
#   bash bench/gpu.sh asyncmix # --async-scheduling on steps with prompts and admissions: its
#                              # tests on CUDA, bench.async_mix (issue 35's closed loop, engine
#                              # alone) off vs on, then bench.ttft's hot workload on 1 worker at
#                              # concurrency 1 and 16, off vs on (issue 35's c16 >= 6x c1)
#   bash bench/gpu.sh routing  # issue 36 on the GPU: 4 llama-1b workers, the hot prefixes and
#                              # the docs' workload, every policy, 3 rounds rotated (its time on
#                              # a GPU not yet measured); `ROUTING_ONE=1` adds one worker at 1, 4
#                              # and 16 streams; `python -m bench.sim_check --gpu-results $OUT`
#                              # then sets the sim beside these figures, and where each run's
#                              # first tokens went beside the sim's (the workers' histograms),
#                              # and the workers' CPU per request in their API servers and their
#                              # engine cores (which --sim-server-model today's worker is);
#                              # `python -m bench.sim_refit --gpu-results $OUT` refits the sim's
#                              # worker-server cost to today's worker
#   bash bench/gpu.sh hosttier # the host KV tier: its engine tests on CUDA (pinned copies, side
#                              # stream), then bench.host_tier at 2,048 and 8,000 tokens: a host-tier
#                              # hit's TTFT against cold and a GPU-tier hit (issue 40: <= 0.4x cold)
#
# Wheels the host lacks (msgspec for the engine; fastapi, uvicorn, pyzmq, openai, ... for `ttft`)
# are installed from .whl/ when it is there: `python -m bench.gpu_kit` fills it (and .devtools/)
# before the run, on a machine with a package index. Results go to $OUT (default /tmp/out).
set -euo pipefail
MODE=${1:?usage: bash bench/gpu.sh tests|engine|memory|ttft|routing|fused|async|asyncmix|hosttier}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/.devtools PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, triton; print('torch', torch.__version__, \
'transformers', transformers.__version__, 'triton', triton.__version__)"
case "$MODE" in
  tests)
    python3 -m pytest -q -p force_cuda -p no:cacheprovider \
      tests/worker/engine tests/worker/models 2>&1 | tail -40 | tee "$OUT/tests.log"
    ;;
  engine)
    python3 -m bench.engine --device cuda --dtype bfloat16 --model llama-1b --reps 3 \
      --out "$OUT/engine-gpu.json" 2>&1 | tee "$OUT/engine-gpu.log"
    ;;
  memory)
    python3 -m bench.engine --device cuda --dtype bfloat16 --model llama-8b --long 32768 \
      --only-long --no-compare --out "$OUT/engine-8b.json" 2>&1 | tee "$OUT/engine-8b.log"
    ;;
  ttft)
    python3 -m bench.ttft --model llama-1b --device cuda --dtype bfloat16 --workers 4 \
      --num-blocks 700 --tenants 12 --concurrency 8 --log-dir "$OUT/ttft-logs" \
      --out "$OUT/ttft-gpu.json" 2>&1 | tee "$OUT/ttft-gpu.log"
    ;;
  routing)
    # The workloads of bench.sim_check's GPU_RUNS (the figures the sim is held to), today's tree.
    gpu=(--model llama-1b --device cuda --dtype bfloat16)
    python3 -m bench.ttft "${gpu[@]}" --workers 4 --num-blocks 700 --tenants 2 \
      --users-per-tenant 16 --concurrency 16 --seed 5 --rounds 3 --log-dir "$OUT/routing-logs" \
      --out "$OUT/routing-hot.json" 2>&1 | tee "$OUT/routing-hot.log"
    python3 -m bench.ttft "${gpu[@]}" --workers 4 --num-blocks 700 --tenants 12 \
      --concurrency 8 --policies round_robin,least_loaded,cache_aware --rounds 3 \
      --log-dir "$OUT/routing-logs" --out "$OUT/routing-docs.json" 2>&1 | tee "$OUT/routing-docs.log"
    if [ "${ROUTING_ONE:-0}" = 1 ]; then
      for c in 1 4 16; do
        python3 -m bench.ttft "${gpu[@]}" --workers 1 --num-blocks 2000 --tenants 2 \
          --users-per-tenant 16 --policies round_robin --seed 5 --rounds 1 --concurrency "$c" \
          --log-dir "$OUT/routing-logs" --out "$OUT/routing-one-c$c.json" 2>&1 \
          | tee "$OUT/routing-one-c$c.log"
      done
    fi
    ;;
  fused)
    # A failing kernel test is reported but does not cancel the measurement (device time is scarce).
    python3 -m pytest -q -p no:cacheprovider tests/worker/models/test_fused_kernels.py \
      tests/worker/engine/test_fused_engine.py 2>&1 | tail -15 | tee "$OUT/fused-tests.log" \
      || echo "FUSED KERNEL TESTS FAILED (above; $OUT/fused-tests.log)"
    python3 -m bench.engine_ab --rounds 2 \
      --side fused:--elementwise-kernels=triton --side unfused:--elementwise-kernels=reference \
      --device cuda --dtype bfloat16 --model llama-1b --no-compare --reps 3 \
      --out "$OUT/engine-fused.json" 2>&1 | tee "$OUT/engine-fused.log"
    ;;
  async)
    # As `fused`: a failing test is reported, and the measurements still run.
    python3 -m pytest -q -p force_cuda -p no:cacheprovider -k "not lora" \
      tests/worker/engine/test_async_scheduling.py 2>&1 | tail -15 | tee "$OUT/async-tests.log" \
      || echo "ASYNC SCHEDULING TESTS FAILED (above; $OUT/async-tests.log)"
    python3 -m bench.engine_ab --rounds 2 --side sync --side async:--async-scheduling \
      --device cuda --dtype bfloat16 --model llama-1b --suite gpu-decode --reps 3 \
      --out "$OUT/engine-async.json" 2>&1 | tee "$OUT/engine-async.log"
    python3 -m bench.decode_profile --device cuda --dtype bfloat16 --model llama-1b --rounds 2 \
      --out "$OUT/decode-profile.json" 2>&1 | { grep -v USDT || true; } | tee "$OUT/decode-profile.log"
    ;;
  asyncmix)
    # As `fused`: a failing test is reported, and the measurements still run.
    python3 -m pytest -q -p force_cuda -p no:cacheprovider -k "not lora" \
      tests/worker/engine/test_async_mixed_steps.py tests/worker/engine/test_async_scheduling.py \
      2>&1 | tail -15 | tee "$OUT/asyncmix-tests.log" \
      || echo "ASYNC SCHEDULING TESTS FAILED (above; $OUT/asyncmix-tests.log)"
    python3 -m bench.async_mix --device cuda --dtype bfloat16 --model llama-1b --rounds 2 \
      2>&1 | tee "$OUT/async-mix.log"
    for c in 1 16; do
      for side in off on; do
        extra=()
        [ "$side" = on ] && extra=(--worker-arg=--async-scheduling)
        python3 -m bench.ttft --model llama-1b --device cuda --dtype bfloat16 --workers 1 \
          --num-blocks 2000 --tenants 2 --users-per-tenant 16 --policies round_robin --seed 5 \
          --rounds 1 --concurrency "$c" ${extra[@]+"${extra[@]}"} --log-dir "$OUT/ttft-mix-logs" \
          --out "$OUT/ttft-mix-c$c-$side.json" 2>&1 | tee "$OUT/ttft-mix-c$c-$side.log"
      done
    done
    ;;
  hosttier)
    # As `fused`: a failing test is reported, and the measurements still run.
    python3 -m pytest -q -p force_cuda -p no:cacheprovider tests/worker/engine/test_host_tier.py \
      tests/worker/engine/test_host_tier_engine.py 2>&1 | tail -15 | tee "$OUT/hosttier-tests.log" \
      || echo "HOST TIER TESTS FAILED (above; $OUT/hosttier-tests.log)"
    for n in 2048 8000; do
      python3 -m bench.host_tier --device cuda --dtype bfloat16 --model llama-1b --tokens "$n" \
        --num-blocks 1200 --kv-offload-blocks 2400 --rounds 5 \
        --out "$OUT/host-tier-$n.json" 2>&1 | tee "$OUT/host-tier-$n.log"
    done
    ;;
  *)
    echo "unknown mode $MODE" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# The Hopper backend's GPU session in one call: its GPU tests, then the
# benchmark of every jaxattn kernel (Triton and Mosaic, end to end and kernel
# alone) against cuDNN.  OUT=dir [TESTS_K=expr] bash benchmarks/run_mosaic.sh [bench args]
set -uo pipefail
OUT=${OUT:-benchmarks/results}
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv,noheader
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -m gpu -q -s -p no:cacheprovider \
    tests/test_gpu_mosaic.py ${TESTS_K:+-k "$TESTS_K"} 2>&1 | tee "$OUT/mosaic_tests.log" \
    | grep -E "rel_rmse|passed|failed|Error" | tail -60
fi
timeout ${BENCH_TIMEOUT:-300} python3 -m jaxattn bench --out "$OUT/bench.json" "$@" 2>&1 \
  | grep -v -i "warn" | tee "$OUT/bench.log" | tail -60

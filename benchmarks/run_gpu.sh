#!/usr/bin/env bash
# The whole GPU session in one call: the GPU tests, then the benchmark on the
# issue's shapes.  Usage (repository root, on the GPU machine):
#   OUT=/some/dir [SKIP_TESTS=1] [TESTS_K=expr] bash benchmarks/run_gpu.sh [bench args]
# Peers come from wheels in .whl/ when present (sageattention, tokamax).
set -uo pipefail
OUT=${OUT:-benchmarks/results}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl
  # tokamax imports xprof only for its profiler helper: a stub stands in.
  mkdir -p /tmp/stub/xprof/cli
  touch /tmp/stub/xprof/__init__.py /tmp/stub/xprof/cli/__init__.py
  echo 'get_kernel_stats_tool = None' > /tmp/stub/xprof/cli/tools.py
  export PYTHONPATH=/tmp/site:/tmp/stub:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if [[ "${SKIP_TESTS:-0}" != 1 ]]; then
  python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/ ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
    | grep -v -i "warning" | tee "$OUT/gpu_tests.log" \
    | grep -E "rel_rmse|NaN|cos_sim|S=|passed|failed|Error" | tail -120
fi
python3 -m jaxattn bench --out "$OUT/bench.json" --log "$OUT/bench.log" "$@" 2>&1 \
  | grep -v -i "warn\|autotun"

"""Sharding under jit and ring attention on 4 virtual CPU devices.

The device count is fixed when jax starts (``XLA_FLAGS``), and the rest of
the suite runs in the same pytest processes on one device, so the cases
(``tests/multidevice_cases.py``) run in a pytest subprocess, one per group
here, so that ``pytest -n 2`` spreads the groups over its workers.
"""
import os
import pathlib
import subprocess
import sys

import pytest

CASES = pathlib.Path(__file__).with_name("multidevice_cases.py")
GROUPS = {   # balanced for two workers
    "batch_heads": "shard_local or gradients_stay or bias or explicit "
                   "or divisible or unpartitioned",
    "ring_methods": "ring_attention_every_method",
    "ring_rest": "gradients_and_lengths or residual or zigzag "
                 "or sequence_sharding",
}


@pytest.mark.slow
@pytest.mark.parametrize("group", sorted(GROUPS))
def test_multidevice(group, request):
  env = dict(os.environ)
  # the cases are mostly XLA:CPU compiles: without its optimisations they
  # take a third of the time (ring methods 85 s -> 33 s)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "")
                      + " --xla_force_host_platform_device_count=4"
                      " --xla_backend_optimization_level=0"
                      " --xla_llvm_disable_expensive_passes=true").strip()
  # 4 devices of interpret-mode kernels wait in XLA's CPU callbacks at once
  env["PJRT_NPROC"] = "64"
  result = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       "-p", "no:xdist", str(CASES), "-k", GROUPS[group],
       # (conftest's extended cells: the ring's repeated methods)
       *(["--extended"] if request.config.getoption("--extended") else [])],
      env=env, capture_output=True, text=True, timeout=900,
      cwd=CASES.parent.parent)
  assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-4000:]
  assert " passed" in result.stdout, result.stdout[-2000:]

"""Shared pytest setup: tests marked ``gpu`` are skipped unless jax sees a
GPU (markers are declared in pyproject.toml)."""
import functools
import os

import pytest

# Mosaic GPU's interpreter runs the kernel's warpgroups as threads that block
# in barrier callbacks; XLA:CPU's concurrency-optimised scheduler can run a
# thread's callbacks out of program order and deadlock them (seen with the
# Mosaic kernel's overlapped loop on 2 cores: 3 of 4 runs hung, 0 of 7 with
# this flag).  Set before jax creates its CPU client.
_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG
                             ).strip()


@functools.cache
def _has_gpu() -> bool:
  import jax
  try:
    return any(d.platform in ("gpu", "cuda", "rocm") for d in jax.devices())
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  gpu_items = [item for item in items if "gpu" in item.keywords]
  if not gpu_items or _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU (jax.devices() has none)")
  for item in gpu_items:
    item.add_marker(skip)


@pytest.fixture
def poison_allocator():
  """Fills the device allocator with NaN buffers of a shape before a kernel
  runs, so that an output element the kernel never writes shows up as NaN
  or as a mismatch instead of a stale correct value."""
  import jax.numpy as jnp

  def poison(shape):
    for _ in range(3):
      jnp.full(shape, jnp.nan, jnp.float32).block_until_ready()

  return poison

"""Shared pytest setup: tests marked ``gpu`` are skipped unless jax sees a
GPU (markers are declared in pyproject.toml)."""
import functools
import os

# Mosaic GPU's interpreter runs each simulated warpgroup as a jax computation
# on its own Python thread; the warpgroups meet at barriers inside
# io_callbacks, which XLA runs on its CPU worker pool (one thread per core
# unless PJRT_NPROC says otherwise).  On a 2-core machine the kernel's own
# callback and one warpgroup's barrier wait filled that pool, and the other
# warpgroups' callbacks never ran: the test hung (py-spy showed it).  A pool
# wider than the callbacks that can wait at once (the kernel's, 3
# warpgroups') removes the deadlock.  Read when jax creates its CPU client.
os.environ.setdefault("PJRT_NPROC", "16")

import pytest  # noqa: E402


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

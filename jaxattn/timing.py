"""Timers for the benchmarks: host time per call (:func:`time_call`) and the
GPU's own kernel durations from jax's profiler (:func:`device_kernels`,
:func:`device_ms`, :func:`device_period_ms`)."""
from __future__ import annotations

import glob
import statistics
import tempfile
import time

import jax


def time_call(fn, args, iters=10, reps=5, warmup=2):
  """Median over ``reps`` groups of ``iters`` back-to-back calls of the
  seconds per call of ``fn(*args)``, after ``warmup`` calls (compilation),
  synchronised on the device."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    for _ in range(iters):
      out = fn(*args)
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / iters)
  return statistics.median(times)


def device_kernels(fn, args, calls: int = 5):
  """The GPU kernels of ``calls`` back-to-back calls of ``fn(*args)`` (after
  one warm-up call), from jax's profiler: ``[(name, start_ns, dur_ns)]`` by
  start.  Device time, where :func:`time_call` also counts the host's
  dispatch: a call shorter than its dispatch (~0.1 ms) measures the host
  there, not the kernels."""
  jax.block_until_ready(fn(*args))
  kernels = []
  with tempfile.TemporaryDirectory() as trace_dir:
    with jax.profiler.trace(trace_dir):
      for _ in range(calls):
        out = fn(*args)
      jax.block_until_ready(out)
    for path in glob.glob(trace_dir + "/**/*.xplane.pb", recursive=True):
      for plane in jax.profiler.ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:GPU"):
          kernels += [(ev.name, ev.start_ns, ev.duration_ns)
                      for line in plane.lines
                      if line.name.startswith("Stream")
                      for ev in line.events]
  return sorted(kernels, key=lambda e: e[1])


def split_calls(kernels, calls: int):
  """:func:`device_kernels`' list as ``calls`` lists, one a call (every
  call launches the same kernels), or None where it does not split so."""
  if not kernels or len(kernels) % calls:
    return None
  n = len(kernels) // calls
  return [kernels[i * n:(i + 1) * n] for i in range(calls)]


def device_period_ms(fn, args, calls: int = 6):
  """The median over ``calls - 1`` pairs of back-to-back calls of the GPU
  time (ms) from one call's first kernel to the next call's
  (:func:`device_kernels`): the call's kernels and the idle gaps between
  them, without the host's dispatch where that is shorter; None without a
  GPU or where the kernels do not split into ``calls`` equal lists."""
  per_call = split_calls(device_kernels(fn, args, calls), calls)
  if per_call is None:
    return None
  starts = [c[0][1] for c in per_call]
  return statistics.median((b - a) / 1e6 for a, b in zip(starts, starts[1:]))


def device_ms(fn, args, calls: int = 5):
  """The median over ``calls`` calls of the GPU time (ms) of the kernels of
  one call of ``fn(*args)`` (:func:`device_kernels`; memsets count), or
  None without a GPU or where the kernels do not split into ``calls``
  equal lists."""
  per_call = split_calls(device_kernels(fn, args, calls), calls)
  if per_call is None:
    return None
  return statistics.median(sum(k[2] for k in c) / 1e6 for c in per_call)

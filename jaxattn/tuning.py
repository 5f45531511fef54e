"""Autotuning of the Triton kernels' knobs (tiles, warps, stages) on the
current device, and the timer the benchmark uses.

``autotune(method, q, k, v, ...)`` times a few configurations of the method's
Triton kernel on the given inputs and returns the fastest as a dict of
options (``tile_q``, ``block_k``, ``num_warps``, ``num_stages``) to pass back
to ``jaxattn.dot_product_attention``; results are cached per device kind,
method, shapes and flags for the life of the process.
"""
from __future__ import annotations

import argparse
import functools
import glob
import itertools
import json
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import api

_CACHE: dict[tuple, tuple[dict, list]] = {}

DEFAULT_CANDIDATES = [
    dict(tile_q=bq, block_k=bk, num_warps=w, num_stages=st)
    for bq, bk, w, st in itertools.product((64, 128), (64, 128), (4, 8),
                                           (2, 3))
]


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


def device_rounds(calls, args, rounds: int = 2, log=print):
  """Each compiled call of ``calls`` (name -> callable) on ``args``, timed
  by the GPU time of its kernels (:func:`device_ms`), in ``rounds`` rounds
  of alternating order; logs one line per call.  Returns the records
  ``{round, call, device_ms}`` (``device_ms`` None without a GPU)."""
  records, names = [], list(calls)
  for rnd in range(rounds):
    for name in (names if rnd % 2 == 0 else names[::-1]):
      records.append(dict(round=rnd, call=name,
                          device_ms=device_ms(calls[name], args)))
  for name in names:
    log(f"{name:30s} " + " ".join(
        f"{r['device_ms'] or float('nan'):.4f}" for r in records
        if r["call"] == name) + " ms (GPU)")
  return records


def benchmark_args(causal: bool = False, parts=None, extra=()):
  """The A/B scripts' command line: ``OUT.json [--causal] [--part P]
  [--shape B,S,N,D]`` (default the issue's 2,8192,32,128); ``.shape`` a
  tuple; ``--part`` one of ``parts`` where given; ``extra``: a script's own
  options, ``(flag, add_argument keywords)`` pairs."""
  ap = argparse.ArgumentParser()
  ap.add_argument("out")
  if causal:
    ap.add_argument("--causal", action="store_true")
  if parts:
    ap.add_argument("--part", choices=parts, required=True)
  ap.add_argument("--shape", default="2,8192,32,128")
  for flag, kwargs in extra:
    ap.add_argument(flag, **kwargs)
  args = ap.parse_args()
  args.shape = tuple(int(x) for x in args.shape.split(","))
  return args


def random_btnh(shape, n: int = 3, dtype=jnp.float16):
  """``n`` standard normal ``[B, S, N, D]`` arrays (``shape``) in ``dtype``
  from the fixed key 0, the A/B scripts' inputs."""
  keys = jax.random.split(jax.random.key(0), n)
  return tuple(jax.random.normal(x, shape, jnp.float32).astype(dtype)
               for x in keys)


def nonfinite_inputs(q, k, v):
  """``(q, k, v)`` with a NaN in one query row and an Inf in one key (the
  A/B scripts' check that NaN/Inf rows come out the same bits)."""
  return q.at[0, 5, 3, 7].set(jnp.nan), k.at[1, 9, 2, 0].set(jnp.inf), v


def packed_segments(rng, b, s, docs):
  """int32 ``[b, s]``: ``docs`` documents of random lengths per row (a numpy
  ``rng``), the packed workload of ``benchmarks/index_mask.py``."""
  rows = []
  for _ in range(b):
    cuts = np.sort(rng.choice(np.arange(1, s), docs - 1, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [s]]))
    rows.append(np.repeat(np.arange(docs), lengths))
  return jnp.asarray(np.stack(rows), jnp.int32)


def cudnn_reference(q, k, v, causal: bool):
  """``(fn, args)``: cuDNN bfloat16 attention on ``q, k, v`` (XLA's off a
  GPU), the reference the ratios divide."""
  fn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal,
      implementation="cudnn" if jax.default_backend() == "gpu" else "xla"))
  return fn, tuple(x.astype(jnp.bfloat16) for x in (q, k, v))


def write_record(path, **fields):
  """``fields`` as JSON at ``path``, with the device and jax version."""
  with open(path, "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                   **fields), f, indent=1)


def alternating_rounds(calls, rounds=3, reference=None, log=print):
  """Times ``calls`` (name -> (fn, args)) in ``rounds`` rounds, the order
  reversed every other round (so that drift does not favour one setting),
  with ``reference`` (fn, args; e.g. cuDNN bf16) timed at the start of each
  round.  Returns rows ``{round, call, ms[, reference_ms, ratio]}`` and
  logs one line per timing and a summary per call."""
  rows, names = [], list(calls)
  for rnd in range(rounds):
    t_ref = time_call(*reference) if reference else None
    for name in (names if rnd % 2 == 0 else names[::-1]):
      t = time_call(*calls[name])
      row = dict(round=rnd, call=name, ms=t * 1e3)
      if t_ref:
        row.update(reference_ms=t_ref * 1e3, ratio=t_ref / t)
      rows.append(row)
      log(f"round {rnd} {name:28s} {t * 1e3:.3f} ms"
          + (f"  x{t_ref / t:.3f}" if t_ref else ""))
  for name in names:
    mine = [r for r in rows if r["call"] == name]
    log(f"{name:28s} " + " ".join(f"{r['ms']:.3f}" for r in mine) + " ms"
        + ("  x" + " ".join(f"{r['ratio']:.3f}" for r in mine)
           if reference else ""))
  return rows


def record_against_cudnn(out_path, calls, qkv, *, causal: bool, **fields):
  """The A/B scripts' ending: ``calls`` (:func:`alternating_rounds`) timed
  in three alternating rounds against cuDNN bfloat16 on ``qkv`` (float16
  BTNH ``(q, k, v)``), logged, and written to ``out_path`` with the shape,
  ``causal`` and ``fields`` (e.g. ``checks``)."""
  log = lambda m: print(m, flush=True)
  rows = alternating_rounds(calls, reference=cudnn_reference(*qkv, causal),
                            log=log)
  b, s, h, d = qkv[0].shape
  write_record(out_path, causal=causal, shape=f"BTNH {b}x{s}x{h}x{d}",
               reference="cuDNN bf16", rows=rows, **fields)


def jit_with_array_options(fn, opts):
  """``(jitted, arrays)``: ``fn(q, k, v, **opts)`` jitted with the array
  options (segment ids, lengths) as its fourth argument, ``jitted(q, k, v,
  arrays)``, and the others static.  Arrays closed over would be constants
  of the compiled call, which XLA may fold (the index operands, the
  predicate of a ``lax.cond`` on them); a caller passes them as data."""
  arrays = {n: x for n, x in opts.items() if isinstance(x, jax.Array)}
  static = {n: x for n, x in opts.items() if n not in arrays}
  return jax.jit(lambda q, k, v, arrays: fn(q, k, v, **static, **arrays)), \
      arrays


def api_calls_per_setting(module, attr, settings, methods, inputs, *,
                          causal: bool, log=print, wrap=None,
                          on_setting=None):
  """An A/B of one module attribute (a switch or a function), or of several
  (``attr`` a tuple of names, each ``value`` a tuple): for each
  ``(name, method, options)`` of ``methods`` and each ``(setting, value)``
  of ``settings``, ``module.attr = value`` and the API call on the Mosaic
  kernel compiled ahead of time (after ``jax.clear_caches()``: the API's
  jit keeps the last trace otherwise).  The last setting's value is left
  in place.  ``wrap``: a function of the API call (``fn(q, k, v,
  **options)``) that gives the function to compile instead (e.g. several
  calls in a row); ``on_setting(setting)``: run after each setting's
  attributes are set (a switch of another module).

  Returns ``(calls, checks)``: ``calls`` ``"name/setting" -> (compiled,
  inputs[0])`` for :func:`alternating_rounds`; ``checks[name]`` whether
  the first two settings' outputs are the same bits on each of
  ``inputs`` (tuples ``(q, k, v)``), and their largest difference."""
  calls, checks = {}, {}
  for name, method, opts in methods:
    outs = {}
    for setting, value in settings:
      for a, x in (zip(attr, value, strict=True) if isinstance(attr, tuple)
                   else [(attr, value)]):
        setattr(module, a, x)
      if on_setting is not None:
        on_setting(setting)
      jax.clear_caches()
      fn = functools.partial(api.dot_product_attention, is_causal=causal,
                             method=method, implementation="mosaic")
      call, arrays = jit_with_array_options(wrap(fn) if wrap else fn, opts)
      compiled = call.lower(*inputs[0], arrays).compile()
      calls[f"{name}/{setting}"] = (compiled, (*inputs[0], arrays))
      outs[setting] = [np.asarray(compiled(*x, arrays), np.float32)
                       for x in inputs]
    first, second = (outs[s] for s, _ in settings[:2])
    checks[name] = dict(
        same_bits=[bool(np.array_equal(a, c, equal_nan=True))
                   for a, c in zip(first, second)],
        max_abs_diff=[float(np.nanmax(np.abs(a - c)))
                      for a, c in zip(first, second)])
    log(f"{name} {checks[name]}")
  return calls, checks


def autotune(method, q, k, v, *, is_causal=False, candidates=None,
             fixed=None, iters=10, reps=5):
  """Returns ``(best_options, [(options, seconds or error), ...])``.

  ``fixed`` options are passed to every candidate (e.g. PASA's ``block_k``,
  which is part of the algorithm) and override the candidates' values.
  """
  fixed = dict(fixed or {})
  cands = candidates or DEFAULT_CANDIDATES
  dedup = {}
  for c in cands:  # a fixed knob overrides the candidates' value
    c = {k: v for k, v in c.items() if k not in fixed}
    dedup[tuple(sorted(c.items()))] = c
  cands = list(dedup.values())
  key = (jax.devices()[0].device_kind, method, q.shape, k.shape, str(q.dtype),
         is_causal, tuple(sorted(fixed.items())),
         tuple(tuple(sorted(c.items())) for c in cands))
  if key in _CACHE:
    return _CACHE[key]
  results = []
  for c in cands:
    opts = {**c, **fixed}
    fn = jax.jit(lambda a, b, d, opts=opts: api.dot_product_attention(
        a, b, d, method=method, is_causal=is_causal, implementation="triton",
        **opts))
    try:
      results.append((opts, time_call(fn, (q, k, v), iters, reps)))
    except Exception as e:  # noqa: BLE001  (a config may not compile)
      results.append((opts, f"{type(e).__name__}: {str(e)[:200]}"))
  timed = [(o, t) for o, t in results if isinstance(t, float)]
  if not timed:
    raise RuntimeError(f"no configuration of {method} ran: {results[:3]}")
  best = min(timed, key=lambda r: r[1])[0]
  _CACHE[key] = (best, results)
  return best, results

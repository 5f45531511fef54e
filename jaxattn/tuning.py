"""Autotuning of the Triton kernels' knobs (tiles, warps, stages) on the
current device.

``autotune(method, q, k, v, ...)`` times a few configurations of the method's
Triton kernel on the given inputs and returns the fastest as a dict of
options (``tile_q``, ``block_k``, ``num_warps``, ``num_stages``) to pass back
to ``jaxattn.dot_product_attention``; results are cached per device kind,
method, shapes and flags for the life of the process.
"""
from __future__ import annotations

import itertools

import jax

from jaxattn import api
from jaxattn.timing import time_call

_CACHE: dict[tuple, tuple[dict, list]] = {}

DEFAULT_CANDIDATES = [
    dict(tile_q=bq, block_k=bk, num_warps=w, num_stages=st)
    for bq, bk, w, st in itertools.product((64, 128), (64, 128), (4, 8),
                                           (2, 3))
]


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

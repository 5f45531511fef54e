"""A/B of two schedule choices of the Mosaic kernel, end to end on the
H100, in one process against cuDNN bfloat16.

  python benchmarks/tile_schedule.py OUT.json
      --part loads|schedule|persistent|packed_kernels|persistent_packed
      [--causal] [--shape B,S,N,D]

(the ``packed`` parts are always causal.)

``loads``: the per-key-block values in global memory (the FMHA's V
column sums, INT8's V scale per block, PASA's block weights, a masked
step's key segment ids) loaded at the start of each step or where they are
used (``pallas_kernels.mosaic.EARLY_BLOCK_LOADS``).

``schedule``: the CTAs launched in the grid's natural order or longest
first, with the heads or the query tiles as the grid's faster axis
(``HEAVIEST_FIRST``, ``GRID_HEADS_INNER``).

``persistent``: one CTA per tile, or one per SM running its share of the
tiles with the next tile's Q loading during the last (``PERSISTENT``).

``packed_kernels``: the packed call's kernel alone (sage and fp8, operands
prepared beforehand, as ``benchmarks/index_mask.py`` times it) under each
combination of the two switches that move it (``EARLY_BLOCK_LOADS``,
``HEAVIEST_FIRST``); ``persistent_packed``: the same kernels (and fp32's)
under ``PERSISTENT``.

Packed rows (8 documents of random lengths per row, as
``benchmarks/index_mask.py``) run in the causal calls.  Each call is
compiled ahead of time, then timed in three rounds of alternating order;
the outputs of the first two settings (only those) must be the same bits,
on ordinary inputs and with a NaN in one query row and an Inf in one key.
"""

import functools
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import api
from jaxattn.tuning import (api_calls_per_setting, benchmark_args,
                            random_btnh, record_against_cudnn)
from pallas_kernels import common, mosaic

sys.path.insert(0, "benchmarks")
from index_mask import packed_segments  # noqa: E402

SWITCHES = {
    "loads": ("EARLY_BLOCK_LOADS", (("late", False), ("early", True))),
    "schedule": (("HEAVIEST_FIRST", "GRID_HEADS_INNER"),
                 (("natural", (False, True)), ("heaviest", (True, True)),
                  ("heaviest_tiles_inner", (True, False)))),
    "persistent": ("PERSISTENT", (("per_tile", False), ("persistent", True))),
}
PACKED_SWITCHES = {
    "packed_kernels": (("EARLY_BLOCK_LOADS", "HEAVIEST_FIRST"), [
        (f"{'early' if e else 'late'}_{'heaviest' if h else 'natural'}",
         (e, h)) for e, h in itertools.product((False, True), repeat=2)]),
    "persistent_packed": (("PERSISTENT",), [("per_tile", (False,)),
                                            ("persistent", (True,))]),
}


def methods(part, causal, segs):
  packed = [(f"packed_{m}", m, {"q_segment_ids": segs})
            for m in ("sage", "fp8")] if causal else []
  if part == "loads":
    return [("fmha_int8", "fmha_int8", {}),
            ("int8_vblock", "int8", {"v_granularity": "block"}),
            ("pasa", "pasa", {}), *packed]
  if part == "persistent":
    plain = [(m, m, {}) for m in ("fp32", "int8", "sage", "fp8")]
    return plain + ([("packed_fp32", "fp32", {"q_segment_ids": segs})]
                    + packed if causal else [])
  if causal:
    return [(m, m, {}) for m in ("fp32", "int8", "sage", "fp8")] + packed
  return [(m, m, {}) for m in ("int8", "fp8")]


def packed_kernels(out_path, shape, part):
  attrs, settings = PACKED_SWITCHES[part]
  defaults = [getattr(mosaic, a) for a in attrs]
  q, k, v = random_btnh(shape)
  segs = packed_segments(np.random.default_rng(0), shape[0], shape[1], 8)
  im = common.IndexMask(q_segments=segs, kv_segments=segs)
  lens = jnp.full((shape[0],), shape[1], jnp.int32)
  calls, checks = {}, {}
  methods = ("sage", "fp8") + (("fp32",) if part == "persistent_packed"
                               else ())
  for method in methods:
    adapter = api.BACKENDS["mosaic"].ADAPTERS[method]
    cfg = api.config_for(method, "mosaic")
    if adapter.kernel is None:   # fp32: the call is the kernel
      args = (q, k, v, lens)
      kernel = lambda q, k, v, lens, adapter=adapter, cfg=cfg: adapter.run(
          q, k, v, None, None, lens, scale=shape[-1] ** -0.5, is_causal=True,
          config=cfg, index_mask=im)
    else:
      args = (jax.jit(functools.partial(
          adapter.prepare, scale=shape[-1] ** -0.5, config=cfg,
          segments=(segs, segs)))(q, k, v, lens), lens)
      kernel = lambda ops, lens, adapter=adapter, cfg=cfg: adapter.kernel(
          ops, lens, is_causal=True, config=cfg, out_dtype=jnp.float16,
          index_mask=im)
    outs = []
    for setting, values in settings:
      for a, x in zip(attrs, values, strict=True):
        setattr(mosaic, a, x)
      jax.clear_caches()
      compiled = jax.jit(kernel).lower(*args).compile()
      calls[f"{method}/{setting}"] = (compiled, args)
      outs.append(np.asarray(compiled(*args), np.float32))
    checks[method] = dict(
        same_bits=[bool(np.array_equal(*outs[:2], equal_nan=True))],
        max_abs_diff=[float(np.nanmax(np.abs(outs[0] - outs[1])))])
    print(method, checks[method], flush=True)
  for a, x in zip(attrs, defaults, strict=True):
    setattr(mosaic, a, x)
  record_against_cudnn(out_path, calls, (q, k, v), causal=True,
                       checks=checks, part=part)


def main(out_path, part, causal, shape):
  if part in PACKED_SWITCHES:
    return packed_kernels(out_path, shape, part)
  q, k, v = random_btnh(shape)
  inputs = [(q, k, v),
            (q.at[0, 5, 3, 7].set(jnp.nan), k.at[1, 9, 2, 0].set(jnp.inf), v)]
  segs = packed_segments(np.random.default_rng(0), shape[0], shape[1], 8)
  attr, settings = SWITCHES[part]
  calls, checks = api_calls_per_setting(
      mosaic, attr, settings, methods(part, causal, segs), inputs,
      causal=causal, log=lambda m: print(m, flush=True))
  record_against_cudnn(out_path, calls, (q, k, v), causal=causal,
                       checks=checks, part=part)


if __name__ == "__main__":
  a = benchmark_args(causal=True, parts=(*SWITCHES, *PACKED_SWITCHES))
  main(a.out, a.part, a.causal, a.shape)

"""A/B of two schedule choices of the Mosaic kernel, end to end on the
H100, in one process against cuDNN bfloat16.

  python benchmarks/tile_schedule.py OUT.json
      --part loads|schedule|half_int8_qk|packed_kernels [--causal]
      [--shape B,S,N,D]

(``packed_kernels`` is always causal.)

``loads``: the per-key-block values in global memory (the FMHA's V
column sums, INT8's V scale per block, PASA's block weights, a masked
step's key segment ids) loaded at the start of each step or where they are
used (``pallas_kernels.mosaic.EARLY_BLOCK_LOADS``).

``schedule``: the CTAs launched in the grid's natural order or longest
first, with the heads or the query tiles as the grid's faster axis
(``HEAVIEST_FIRST``, ``GRID_HEADS_INNER``).

``half_int8_qk``: half-INT8's int8 QK product accumulated into registers
zeroed next to its wgmma or into a splat of zeros (``FRESH_ACCUMULATORS``
with or without ``"qk"``; half-INT8 only, the one method whose kernel
spills with either).

``packed_kernels``: the packed call's kernel alone (sage and fp8, operands
prepared beforehand, as ``benchmarks/index_mask.py`` times it) under each
combination of the two switches that move it (``EARLY_BLOCK_LOADS``,
``HEAVIEST_FIRST``).

Packed rows (8 documents of random lengths per row, as
``benchmarks/index_mask.py``) run in the causal calls.  Each call is
compiled ahead of time, then timed in three rounds of alternating order;
the outputs of the first two settings (only those) must be the same bits,
on ordinary inputs and with a NaN in one query row and an Inf in one key.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import api
from jaxattn.tuning import (api_calls_per_setting, benchmark_args,
                            nonfinite_inputs, packed_segments, random_btnh,
                            record_against_cudnn)
from pallas_kernels import common, mosaic


SWITCHES = {
    "loads": ("EARLY_BLOCK_LOADS", (("late", False), ("early", True))),
    "schedule": (("HEAVIEST_FIRST", "GRID_HEADS_INNER"),
                 (("natural", (False, True)), ("heaviest", (True, True)),
                  ("heaviest_tiles_inner", (True, False)))),
    "half_int8_qk": ("FRESH_ACCUMULATORS", (("fresh", ("qk", "pv")),
                                            ("splat", ("pv",)))),
}


def methods(part, causal, segs):
  packed = [(f"packed_{m}", m, {"q_segment_ids": segs})
            for m in ("sage", "fp8")] if causal else []
  if part == "half_int8_qk":
    return [("int8_half", "int8", {"pv_dtype": "fp16"})]
  if part == "loads":
    return [("fmha_int8", "fmha_int8", {}),
            ("int8_vblock", "int8", {"v_granularity": "block"}),
            ("pasa", "pasa", {}), *packed]
  if causal:
    return [(m, m, {}) for m in ("fp32", "int8", "sage", "fp8")] + packed
  return [(m, m, {}) for m in ("int8", "fp8")]


def packed_kernels(out_path, shape):
  q, k, v = random_btnh(shape)
  segs = packed_segments(np.random.default_rng(0), shape[0], shape[1], 8)
  im = common.IndexMask(q_segments=segs, kv_segments=segs)
  lens = jnp.full((shape[0],), shape[1], jnp.int32)
  calls = {}
  for method in ("sage", "fp8"):
    adapter = api.BACKENDS["mosaic"].ADAPTERS[method]
    cfg = api.config_for(method, "mosaic", masked=True)   # (packed)
    ops = jax.jit(functools.partial(
        adapter.prepare, scale=shape[-1] ** -0.5, config=cfg,
        segments=(segs, segs)))(q, k, v, lens)
    for early, heaviest in itertools.product((False, True), repeat=2):
      mosaic.EARLY_BLOCK_LOADS, mosaic.HEAVIEST_FIRST = early, heaviest
      jax.clear_caches()
      fn = jax.jit(lambda ops, lens, adapter=adapter, cfg=cfg:
                   adapter.kernel(ops, lens, is_causal=True, config=cfg,
                                  out_dtype=jnp.float16, index_mask=im))
      setting = (f"{'early' if early else 'late'}_"
                 f"{'heaviest' if heaviest else 'natural'}")
      calls[f"{method}/{setting}"] = (fn.lower(ops, lens).compile(),
                                      (ops, lens))
  mosaic.EARLY_BLOCK_LOADS = mosaic.HEAVIEST_FIRST = True   # the defaults
  record_against_cudnn(out_path, calls, (q, k, v), causal=True,
                       part="packed_kernels")


def main(out_path, part, causal, shape):
  if part == "packed_kernels":
    return packed_kernels(out_path, shape)
  q, k, v = random_btnh(shape)
  inputs = [(q, k, v),
            nonfinite_inputs(q, k, v)]
  segs = packed_segments(np.random.default_rng(0), shape[0], shape[1], 8)
  attr, settings = SWITCHES[part]
  calls, checks = api_calls_per_setting(
      mosaic, attr, settings, methods(part, causal, segs), inputs,
      causal=causal, log=lambda m: print(m, flush=True))
  record_against_cudnn(out_path, calls, (q, k, v), causal=causal,
                       checks=checks, part=part)


if __name__ == "__main__":
  a = benchmark_args(causal=True, parts=(*SWITCHES, "packed_kernels"))
  main(a.out, a.part, a.causal, a.shape)

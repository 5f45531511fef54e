"""A/B of two schedule choices of the Mosaic kernel, end to end on the
H100, in one process against cuDNN bfloat16.

  python benchmarks/tile_schedule.py OUT.json --part loads|schedule
      [--causal] [--shape B,S,N,D]

``loads``: the per-key-block values in global memory (the FMHA's V
column sums, INT8's V scale per block, PASA's block weights, a masked
step's key segment ids) loaded at the start of each step or where they are
used (``pallas_kernels.mosaic.EARLY_BLOCK_LOADS``).

``schedule``: the CTAs launched in the grid's natural order or longest
first, with the heads or the query tiles as the grid's faster axis
(``HEAVIEST_FIRST``, ``GRID_HEADS_INNER``).

Packed rows (8 documents of random lengths per row, as
``benchmarks/index_mask.py``) run in the causal calls.  Each call is
compiled ahead of time, then timed in three rounds of alternating order;
the first two settings' outputs must be the same bits, on ordinary inputs
and with a NaN in one query row and an Inf in one key.
"""

import sys

import jax.numpy as jnp
import numpy as np

from jaxattn.tuning import (api_calls_per_setting, benchmark_args,
                            random_btnh, record_against_cudnn)
from pallas_kernels import mosaic

sys.path.insert(0, "benchmarks")
from index_mask import packed_segments  # noqa: E402

SWITCHES = {
    "loads": ("EARLY_BLOCK_LOADS", (("late", False), ("early", True))),
    "schedule": (("HEAVIEST_FIRST", "GRID_HEADS_INNER"),
                 (("natural", (False, True)), ("heaviest", (True, True)),
                  ("heaviest_tiles_inner", (True, False)))),
}


def methods(part, causal, segs):
  packed = [(f"packed_{m}", m, {"q_segment_ids": segs})
            for m in ("sage", "fp8")] if causal else []
  if part == "loads":
    return [("fmha_int8", "fmha_int8", {}),
            ("int8_vblock", "int8", {"v_granularity": "block"}),
            ("pasa", "pasa", {}), *packed]
  if causal:
    return [(m, m, {}) for m in ("fp32", "int8", "sage", "fp8")] + packed
  return [(m, m, {}) for m in ("int8", "fp8")]


def main(out_path, part, causal, shape):
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
  a = benchmark_args(causal=True, parts=tuple(SWITCHES))
  main(a.out, a.part, a.causal, a.shape)

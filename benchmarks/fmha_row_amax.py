"""A/B of where the 8-bit FMHA takes its output's amax: from the Mosaic
kernel (each row's max |O| written in its epilogue,
``jaxattn.backends.mosaic.FMHA_ROW_AMAX``, the default) or by an XLA pass
over the float32 O (the form before 2026-11-27).  End to end on the H100,
in one process against cuDNN bfloat16.

  python benchmarks/fmha_row_amax.py OUT.json [--causal] [--shape B,S,N,D]

Each call is compiled ahead of time, then timed in three rounds of
alternating order; the two settings' outputs must be the same bits, on
ordinary inputs, on keys with a per-channel bias and outlier channels,
and with a NaN in one query row and an Inf in one key (packed rows, 8
documents of random lengths, in the causal calls).
"""

import jax
import numpy as np

from jaxattn import data
from jaxattn.backends import mosaic as mosaic_backend
from jaxattn.tuning import (api_calls_per_setting, benchmark_args,
                            nonfinite_inputs, packed_segments, random_btnh,
                            record_against_cudnn)

SETTINGS = (("xla", False), ("kernel", True))


def main(out_path, causal, shape):
  q, k, v = random_btnh(shape)
  inputs = [(q, k, v), data.channel_outlier(jax.random.key(1), shape),
            nonfinite_inputs(q, k, v)]
  methods = [("fmha_int8", "fmha_int8", {})]
  if causal:
    segs = packed_segments(np.random.default_rng(0), shape[0], shape[1], 8)
    methods.append(("packed_fmha_int8", "fmha_int8", {"q_segment_ids": segs}))
  calls, checks = api_calls_per_setting(
      mosaic_backend, "FMHA_ROW_AMAX", SETTINGS, methods, inputs,
      causal=causal, log=lambda m: print(m, flush=True))
  record_against_cudnn(out_path, calls, (q, k, v), causal=causal,
                       checks=checks)


if __name__ == "__main__":
  a = benchmark_args(causal=True)
  main(a.out, a.causal, a.shape)

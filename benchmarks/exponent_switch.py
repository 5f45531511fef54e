"""A/B of how the Mosaic adapters choose between the kernel's fused and
exact exponents, end to end on the H100, in one process against cuDNN
bfloat16:

  python benchmarks/exponent_switch.py OUT.json [--causal]
      --part methods|fp32 [--shape B,S,N,D]

``cond``: an XLA ``lax.cond`` on a bound of the scores
(``jaxattn.backends.mosaic._exact_when_needed``; the quantized methods'
default), which for ``fp32`` reads Q and K for their largest row norms
(``FP32_SCORE_BOUND``); ``fused``: the fused exponent always, with no
bound and no conditional (the time the choice costs; not safe for huge
scores); with ``--part fp32`` (fp32 only) also ``exact``: the exact
exponent always, with no bound (fp32's default since ``b885042``).
Packed rows (8 documents of random lengths per row) run in the causal
calls.  Each call is compiled ahead of time, then timed in three rounds
of alternating order; the record's ``checks`` say whether the first two
settings' outputs are the same bits, on ordinary inputs and with a NaN in
one query row and an Inf in one key.
"""

import numpy as np

from jaxattn.backends import mosaic as mosaic_backend
from jaxattn.tuning import (api_calls_per_setting, benchmark_args,
                            nonfinite_inputs, packed_segments, random_btnh,
                            record_against_cudnn)

ATTRS = ("FP32_SCORE_BOUND", "_exact_when_needed")
SETTINGS = (
    ("cond", (True, mosaic_backend._exact_when_needed)),
    ("fused", (True, lambda kernel, bound: kernel(exact_exponent=False))),
    ("exact", (False, mosaic_backend._exact_when_needed)))


def main(out_path, causal, shape, part):
  q, k, v = random_btnh(shape)
  inputs = [(q, k, v),
            nonfinite_inputs(q, k, v)]
  segs = packed_segments(np.random.default_rng(0), shape[0], shape[1], 8)
  plain = ("fp32",) if part == "fp32" else ("fp32", "int8", "sage", "fp8")
  packed = ("fp32",) if part == "fp32" else ("fp32", "fp8")
  methods = [(m, m, {}) for m in plain]
  if causal:
    methods += [(f"packed_{m}", m, {"q_segment_ids": segs}) for m in packed]
  settings = SETTINGS if part == "fp32" else SETTINGS[:2]
  calls, checks = api_calls_per_setting(
      mosaic_backend, ATTRS, settings, methods, inputs,
      causal=causal, log=lambda m: print(m, flush=True))
  mosaic_backend.FP32_SCORE_BOUND = False   # the defaults
  mosaic_backend._exact_when_needed = SETTINGS[0][1][1]
  record_against_cudnn(out_path, calls, (q, k, v), causal=causal,
                       checks=checks)


if __name__ == "__main__":
  a = benchmark_args(causal=True, parts=("methods", "fp32"))
  main(a.out, a.causal, a.shape, a.part)

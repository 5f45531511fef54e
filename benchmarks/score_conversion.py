"""A/B of how the Mosaic kernel converts 8-bit QK's int32 scores to
float32: ``cvt.rn.f32.s32`` (which issues on the unit that also takes
exp2), or an integer add and a float subtract
(``pallas_kernels.mosaic.INT_SCORES_BY_ADD``).  End to end on the H100, in
one process against cuDNN bfloat16.

  python benchmarks/score_conversion.py OUT.json [--causal] [--shape B,S,N,D]

Each call is compiled ahead of time, then timed in three rounds of
alternating order; the two settings' outputs must be the same bits, on
ordinary inputs, on keys with a per-channel bias and outlier channels,
and with a NaN in one query row and an Inf in one key.
"""

import jax

from jaxattn import data
from jaxattn.tuning import (api_calls_per_setting, benchmark_args,
                            nonfinite_inputs, random_btnh,
                            record_against_cudnn)
from pallas_kernels import mosaic

METHODS = [("sage", "sage", {}), ("int8", "int8", {}),
           ("int8_half", "int8", {"pv_dtype": "fp16"}),
           ("fmha_int8", "fmha_int8", {})]
SETTINGS = (("cvt", False), ("add", True))


def main(out_path, causal, shape):
  q, k, v = random_btnh(shape)
  inputs = [(q, k, v), data.channel_outlier(jax.random.key(1), shape),
            nonfinite_inputs(q, k, v)]
  calls, checks = api_calls_per_setting(
      mosaic, "INT_SCORES_BY_ADD", SETTINGS, METHODS, inputs, causal=causal,
      log=lambda m: print(m, flush=True))
  mosaic.INT_SCORES_BY_ADD = False   # the default
  record_against_cudnn(out_path, calls, (q, k, v), causal=causal,
                       checks=checks)


if __name__ == "__main__":
  a = benchmark_args(causal=True)
  main(a.out, a.causal, a.shape)

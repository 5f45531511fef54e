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
import jax.numpy as jnp
import numpy as np

from jaxattn import api, data
from jaxattn.tuning import (alternating_rounds, benchmark_args,
                            cudnn_reference, random_btnh, write_record)
from pallas_kernels import mosaic

METHODS = [("sage", {}), ("int8", {}), ("int8_half", {"pv_dtype": "fp16"}),
           ("fmha_int8", {})]
SETTINGS = (("cvt", False), ("add", True))


def main(out_path, causal, shape):
  b, s, h, d = shape
  q, k, v = random_btnh(shape)
  realistic = data.channel_outlier(jax.random.key(1), (b, s, h, d))
  bad = (q.at[0, 5, 3, 7].set(jnp.nan), k.at[1, 9, 2, 0].set(jnp.inf), v)
  reference = cudnn_reference(q, k, v, causal)
  calls, checks = {}, {}
  for name, opts in METHODS:
    method = name.split("_half")[0]
    outs = {}
    for setting, by_add in SETTINGS:
      mosaic.INT_SCORES_BY_ADD = by_add
      jax.clear_caches()   # the API's jit keeps the last trace otherwise
      call = jax.jit(lambda q, k, v, method=method, opts=opts:
                     api.dot_product_attention(
                         q, k, v, is_causal=causal, method=method,
                         implementation="mosaic", **opts))
      compiled = call.lower(q, k, v).compile()
      calls[f"{name}/{setting}"] = compiled
      outs[setting] = [np.asarray(compiled(*x), np.float32)
                       for x in ((q, k, v), realistic, bad)]
    checks[name] = dict(
        same_bits=[bool(np.array_equal(a, c, equal_nan=True)) for a, c in
                   zip(outs["cvt"], outs["add"])],
        max_abs_diff=[float(np.nanmax(np.abs(a - c))) for a, c in
                      zip(outs["cvt"], outs["add"])])
    print(name, checks[name], flush=True)
  mosaic.INT_SCORES_BY_ADD = SETTINGS[0][1]
  timed = {n: (c, (q, k, v)) for n, c in calls.items()}
  rows = alternating_rounds(timed, reference=reference,
                            log=lambda m: print(m, flush=True))
  write_record(out_path, causal=causal, shape=f"BTNH {b}x{s}x{h}x{d}",
               reference="cuDNN bf16", checks=checks, rows=rows)


if __name__ == "__main__":
  a = benchmark_args(causal=True)
  main(a.out, a.causal, a.shape)

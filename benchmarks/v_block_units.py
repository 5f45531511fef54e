"""A/B of how the Mosaic kernel applies one V scale per key block (fp8
"block", INT8 with ``v_granularity="block"``), end to end on the H100 in
one process against cuDNN bfloat16:

  python benchmarks/v_block_units.py OUT.json [--causal] [--shape B,S,N,D]

``per_element``: each block's ``P V`` multiplied by its scale before it is
added into O (one multiply per element of O per block).  ``row_factor``
(``pallas_kernels.mosaic.V_SCALE_IN_ROW_FACTOR``): O kept in units of the
last block's scale, the change of unit folded into the softmax's per-row
factor.  The outputs differ by the rounding of the unit ratios; the
record keeps their largest difference and each setting's error against
float32 attention on the benchmark's realistic inputs (keys with a
per-channel bias and outlier channels).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import api, data, metrics
from jaxattn.tuning import (api_calls_per_setting, benchmark_args,
                            nonfinite_inputs, random_btnh,
                            record_against_cudnn)
from pallas_kernels import mosaic

SETTINGS = (("per_element", False), ("row_factor", True))
METHODS = [("fp8_block", "fp8", {"granularity": "block"}),
           ("int8_vblock", "int8", {"v_granularity": "block"})]


def errors(causal):
  """Each setting's cosine / relative L2 against float32 attention on
  realistic inputs (one batch row, 8 heads of the benchmark's shape)."""
  q, k, v = data.channel_outlier(jax.random.key(1), (1, 4096, 8, 128))
  ref = np.asarray(jax.nn.dot_product_attention(
      *(x.astype(jnp.float32) for x in (q, k, v)), is_causal=causal),
      np.float64)
  out = {}
  for setting, value in SETTINGS:
    mosaic.V_SCALE_IN_ROW_FACTOR = value
    jax.clear_caches()
    for name, method, opts in METHODS:
      o = np.asarray(api.dot_product_attention(
          q, k, v, is_causal=causal, method=method, implementation="mosaic",
          **opts), np.float64)
      out[f"{name}/{setting}"] = dict(
          cos_sim=metrics.cosine_similarity(o, ref),
          rel_l2=metrics.relative_rmse(o, ref))
      print(name, setting, out[f"{name}/{setting}"], flush=True)
  return out


def main(out_path, causal, shape):
  errs = errors(causal)
  q, k, v = random_btnh(shape)
  calls, checks = api_calls_per_setting(
      mosaic, "V_SCALE_IN_ROW_FACTOR", SETTINGS, METHODS,
      [(q, k, v), nonfinite_inputs(q, k, v)], causal=causal,
      log=lambda m: print(m, flush=True))
  record_against_cudnn(out_path, calls, (q, k, v), causal=causal,
                       checks=checks, errors=errs)


if __name__ == "__main__":
  a = benchmark_args(causal=True)
  main(a.out, a.causal, a.shape)

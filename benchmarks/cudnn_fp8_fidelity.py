"""Whether cuDNN's fp8 attention (jax's private cuDNN module, ``use_fp8``)
computes jaxattn's ``method="fp8"`` within the tolerance its own kernels
meet, so that the method could route to it (issue 15):

  python benchmarks/cudnn_fp8_fidelity.py OUT.json      (on the GPU)

jax's fp8 call takes one descale per whole tensor (``[1, 1, 1, 1]``; not
per head, and not under vmap) and returns O in the query's dtype,
float8_e4m3fn, scaled by ``scale_o``.  For each input kind (normal, and
keys with a per-channel bias and outlier channels, ``jaxattn.data``),
this records the relative RMSE against the method's reference of: the
Mosaic kernel; cuDNN fp8 (``jaxattn.bench.cudnn_fp8``); and the reference's
own output rounded to e4m3 with cuDNN's output scale (``1 / s_V``), which
isolates what the fp8 output alone costs.  Each also against float32
attention.
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn
from jaxattn import bench, data, metrics
from pallas_kernels.common import FP8_MAX

SHAPE = (1, 8192, 8, 128)   # B, T, N, H: one batch row, 8 heads


def inputs(kind):
  if kind == "channel_outlier":
    return data.channel_outlier(jax.random.key(1), SHAPE, jnp.float16)
  ks = jax.random.split(jax.random.key(2), 3)
  return tuple(jax.random.normal(x, SHAPE, jnp.float16) for x in ks)


def e4m3_output(o, v):
  """``o`` rounded as cuDNN's fp8 output: ``fl_e4m3(o / s_V) s_V`` with
  one ``s_V = amax|V| / 448`` for the whole tensor."""
  s_v = jnp.max(jnp.abs(v.astype(jnp.float32))) / FP8_MAX
  return (o / s_v).astype(jnp.float8_e4m3fn).astype(jnp.float32) * s_v


def main(out_path):
  rows = {}
  for kind in ("normal", "channel_outlier"):
    for causal in (False, True):
      q, k, v = inputs(kind)
      f32 = lambda x: np.asarray(x, np.float64)
      exact = f32(jax.nn.dot_product_attention(
          *(x.astype(jnp.float32) for x in (q, k, v)), is_causal=causal))
      ref = jaxattn.dot_product_attention(q, k, v, method="fp8",
                                          implementation="reference",
                                          is_causal=causal)
      outs = {
          "mosaic": jaxattn.dot_product_attention(
              q, k, v, method="fp8", implementation="mosaic",
              is_causal=causal),
          "cudnn_fp8": jax.jit(lambda q, k, v: bench.cudnn_fp8(
              q, k, v, is_causal=causal))(q, k, v),
          "reference_e4m3_output": e4m3_output(ref.astype(jnp.float32), v),
      }
      for name, o in outs.items():
        row = dict(vs_reference=metrics.relative_rmse(f32(o), f32(ref)),
                   vs_float32=metrics.relative_rmse(f32(o), exact),
                   cos_vs_float32=metrics.cosine_similarity(f32(o), exact))
        rows[f"{kind}/{'causal' if causal else 'non-causal'}/{name}"] = row
        print(kind, causal, name, row, flush=True)
      rows[f"{kind}/{'causal' if causal else 'non-causal'}/reference"] = dict(
          vs_float32=metrics.relative_rmse(f32(ref), exact))
  with open(out_path, "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                   shape=f"BTNH {SHAPE}", rows=rows), f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])

"""sage end to end with each form of the smoothing bias of its key pass
(:data:`pallas_kernels.quantizers.BIAS_PRODUCTS`: "f16x3", the smoothed
keys split in float16 parts, against "exact_keys", the 16-bit keys as they
are and q_m's product with the key mean subtracted), on the GPU at
2x8192x32x128 float16 (Hopper defaults, sage2-8b on the Mosaic kernel):

  python benchmarks/bias_products_ab.py OUT.json [--causal] [--shape B,S,N,D]

Three alternating rounds against cuDNN bfloat16, the outputs of the two
settings compared (ordinary inputs and a NaN and an Inf), and each
setting's error against float32 attention (XLA, highest precision) at
1x4096x8x128 on inputs
with the structure of real activations: keys with a per-channel offset
and outlier channels (:func:`jaxattn.data.channel_outlier`), and the same
with a per-channel offset in the queries too, where the query smoothing
and so the bias matter.
"""
import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import api, data, metrics
from jaxattn.tuning import (api_calls_per_setting, benchmark_args,
                            nonfinite_inputs, random_btnh,
                            record_against_cudnn)
from pallas_kernels import quantizers

METHODS = [("sage2-8b", "sage", {})]
SETTINGS = (("f16x3", "f16x3"), ("exact_keys", "exact_keys"))


def accuracy(causal):
  """Each setting's error against float32 on the realistic inputs."""
  shape = (1, 4096, 8, 128)
  q, k, v = data.channel_outlier(jax.random.key(1), shape)
  rng = np.random.default_rng(2)
  q_offset = jnp.asarray(rng.normal(0, 2, (1, 1, 8, 128)), jnp.float16)
  cases = {"key_outliers": (q, k, v), "query_offset_too": (q + q_offset, k, v)}
  f32 = jnp.float32
  with jax.default_matmul_precision("highest"):
    refs = {n: np.asarray(jax.nn.dot_product_attention(
        *(a.astype(f32) for a in x), is_causal=causal), np.float64)
            for n, x in cases.items()}
  out = {}
  for setting, value in SETTINGS:
    quantizers.BIAS_PRODUCTS = value
    jax.clear_caches()
    for name, x in cases.items():
      o = api.dot_product_attention(*x, is_causal=causal, method="sage",
                                    implementation="mosaic")
      s = metrics.summary(np.asarray(o, np.float32), refs[name])
      out[f"{setting}/{name}"] = s
      print(f"{setting:12s} {name:18s} cos {s['cos_sim']:.6f} "
            f"rel_rmse {s['rel_rmse']:.4e}", flush=True)
  return out


def main():
  args = benchmark_args(causal=True)
  acc = accuracy(args.causal)
  q, k, v = random_btnh(args.shape)
  inputs = [(q, k, v), nonfinite_inputs(q, k, v)]
  calls, checks = api_calls_per_setting(
      quantizers, "BIAS_PRODUCTS", SETTINGS, METHODS, inputs,
      causal=args.causal, log=lambda m: print(m, flush=True))
  print(checks, flush=True)
  record_against_cudnn(args.out, calls, (q, k, v), causal=args.causal,
                       checks=checks, accuracy=acc)


if __name__ == "__main__":
  main()

"""What SageAttention2's query smoothing buys in accuracy, on the reference
(bit-faithful, so any machine; the numbers are the kernels'):

  python benchmarks/sage_smooth_q.py [B H S D]      (default 1 4 4096 128)

The error against float32 attention of ``method="sage"`` (``block_k=128``,
the Hopper kernel's) with and without ``smooth_q``, and of ``sage1`` and
``fp8`` for scale, on four inputs: N(0, 1); keys with a per-channel offset
of std 8 (``benchmarks/profiles/accuracy.py``); keys with outlier channels
(:func:`jaxattn.data.channel_outlier`); and queries with such channels as
well (the keys of a second draw used as queries).  Dropping the query
smoothing removes the smoothing bias from the quantizer and the kernel,
which is what it would save.
"""
import sys

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import data, metrics

VARIANTS = [("sage2-8b", "sage", {}),
            ("sage2-8b smooth_q=False", "sage", {"smooth_q": False}),
            ("sage1", "sage", {"preset": "sage1"}),
            ("fp8", "fp8", {})]


def inputs(shape):
  b, h, s, d = shape
  kq, kk, kv, ko = jax.random.split(jax.random.key(0), 4)
  q, k, v = (jax.random.normal(x, (b, s, h, d), jnp.float32)
             for x in (kq, kk, kv))
  k_offset = k + 8.0 * jax.random.normal(ko, (1, 1, h, d), jnp.float32)
  f16 = lambda *xs: [x.astype(jnp.float16) for x in xs]
  q1, k1, v1 = data.channel_outlier(jax.random.key(0), (b, s, h, d))
  q_out = data.channel_outlier(jax.random.key(7), (b, s, h, d))[1]
  return {"normal": f16(q, k, v), "k_offset8": f16(q, k_offset, v),
          "k_outliers": (q1, k1, v1), "q_and_k_outliers": (q_out, k1, v1)}


def main(shape):
  print(f"shape BNSD {shape}; error against float32 attention")
  print(f"{'inputs':17s} {'method':26s} {'cos':>9s} {'rel RMSE':>9s}")
  for name, (q, k, v) in inputs(shape).items():
    with jax.default_matmul_precision("highest"):
      ref = jax.jit(jax.nn.dot_product_attention)(
          *(x.astype(jnp.float32) for x in (q, k, v)))
    for label, method, opts in VARIANTS:
      if method == "sage":
        opts = {"block_k": 128, **opts}
      out = jaxattn.dot_product_attention(q, k, v, method=method,
                                          implementation="reference", **opts)
      print(f"{name:17s} {label:26s} "
            f"{float(metrics.cosine_similarity(out, ref)):9.6f} "
            f"{float(metrics.relative_rmse(out, ref)):9.2e}", flush=True)


if __name__ == "__main__":
  main(tuple(int(x) for x in sys.argv[1:5]) if len(sys.argv) > 4
       else (1, 4, 4096, 128))

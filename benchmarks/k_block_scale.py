"""A/B of the Mosaic kernel's K scales: one per key block
(``k_block_scale``, a scalar load per step and the row factor ``q_scale
k_j`` in the exponent) against one per key (a shared-memory row streamed
with K and a multiply per score), for the methods whose K scales are per
block or per head.  H100, kernels alone (fmha_int8 end to end: its adapter
has no separate kernel stage), in one process against cuDNN bfloat16.

  python benchmarks/k_block_scale.py OUT.json [--causal] [--shape B,S,N,D]

Each setting is compiled ahead of time (the choice is made when the call
is traced), then all are timed in interleaved rounds of alternating order.
The two settings' outputs are compared (the fused exponent rounds ``S
q_scale k_j`` once where the per-key form rounded ``S k_j`` first; the
exact exponent is the same arithmetic), and each setting's error against
float32 attention is taken on the benchmark's realistic inputs
(:func:`jaxattn.bench.accuracy_inputs`).
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import api, bench
from jaxattn.backends import mosaic as mosaic_backend
from jaxattn.tuning import benchmark_args, random_btnh, record_against_cudnn

VARIANTS = [  # (name, method, options, kernel alone)
    ("fp8", "fp8", {}, True),
    ("fp8_block", "fp8", {"granularity": "block"}, True),
    ("sage2-8b", "sage", {"preset": "sage2-8b"}, True),
    ("fmha_int8_e2e", "fmha_int8", {}, False),
]
PER_BLOCK = mosaic_backend._k_scales


def per_key(ops, block_k):
  del block_k
  return dict(k_scale=ops.k_scale)


def build(method, opts, alone, causal, d):
  if alone:
    setup = bench.kernel_alone(causal, d, [("k", method, opts)])["k_mosaic"]
    return setup
  def setup(q, k, v):
    fn = jax.jit(lambda q, k, v: api.dot_product_attention(
        q, k, v, is_causal=causal, method=method, implementation="mosaic",
        **opts))
    return fn, (q, k, v)
  return setup


def main(out_path, causal, shape):
  b, s, h, d = shape
  q, k, v = random_btnh(shape)
  acc_in = bench.accuracy_inputs((b, h, s, d))
  calls, checks = {}, {}
  for name, method, opts, alone in VARIANTS:
    outs = {}
    for setting, fn_k in (("per_key", per_key), ("per_block", PER_BLOCK)):
      mosaic_backend._k_scales = fn_k
      jax.clear_caches()   # the API's jit keeps the last trace otherwise
      fn, args = build(method, opts, alone, causal, d)(q, k, v)
      compiled = fn.lower(*args).compile()
      outs[setting] = np.asarray(jax.block_until_ready(compiled(*args)),
                                 np.float32)
      calls[f"{name}/{setting}"] = (compiled, args)
      e2e = lambda q, k, v: api.dot_product_attention(
          q, k, v, is_causal=causal, method=method, implementation="mosaic",
          **opts)
      checks[f"{name}/{setting}"] = bench.accuracy(e2e, jnp.float16, acc_in,
                                                   causal)
    mosaic_backend._k_scales = PER_BLOCK
    a, c = outs["per_key"], outs["per_block"]
    checks[name] = dict(
        bit_identical=bool(np.array_equal(a, c, equal_nan=True)),
        max_abs_diff=float(np.nanmax(np.abs(a - c))),
        nan_per_key=int(np.isnan(a).sum()),
        nan_per_block=int(np.isnan(c).sum()))
    print(name, checks[name], checks[f"{name}/per_key"],
          checks[f"{name}/per_block"], flush=True)
  record_against_cudnn(out_path, calls, (q, k, v), causal=causal,
                       checks=checks)


if __name__ == "__main__":
  a = benchmark_args(causal=True)
  main(a.out, a.causal, a.shape)

"""How the key pass of the quantizer forms SageAttention2's smoothing bias
``q_m K_smoothed^T`` (:data:`pallas_kernels.quantizers.BIAS_PRODUCTS`): its
time and its error, on the GPU, at 2x8192x32x128 float16.

  python benchmarks/smooth_bias.py OUT.json [--shape B,S,N,D] [--rounds 2]

The key pass is timed as the sage method runs it (per 64 rows, the key mean
subtracted, the non-finite flags on) with each way of forming the bias,
and without the bias, by the GPU time of its kernels
(:func:`jaxattn.tuning.device_rounds`) in rounds of alternating order.  The error is the
bias's largest absolute deviation from float64 ``q_m (K - k_mean)^T``,
over the largest ``|bias|``, on keys with the structure of real models'
(a per-channel offset and outlier channels).  The run of 2026-11-26
(``results/2026-11-26_h100_smooth_bias.json``, timed from the host) also
timed one TF32 product as a control; the run of 2026-11-29
(``results/2026-11-29_h200_smooth_bias.json``, commit 9ae22e6) the keys as
exact operands (q_m K^T - q_m k_mean, only q_m split), which was no
faster.
"""
import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from jaxattn.tuning import device_rounds, time_call  # noqa: E402
from pallas_kernels import quantizers  # noqa: E402

# (products, num_warps, bias_chunk); None: rows_operand's default chunk
VARIANTS = {"f16x3_w4": ("f16x3", 4, None), "f16x3_w8": ("f16x3", 8, None),
            "tf32x3_w8": ("tf32x3", 8, None), "no_bias": (None, 4, None)}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("out")
  ap.add_argument("--shape", default="2,8192,32,128")
  ap.add_argument("--rounds", type=int, default=2)
  args = ap.parse_args()
  b, s, h, d = map(int, args.shape.split(","))
  rng = np.random.default_rng(0)
  offset = rng.normal(0, 4, (1, 1, h, d))
  outliers = np.where(rng.random(d) < 0.03, 20.0, 1.0)
  k = (rng.normal(size=(b, s, h, d)) * outliers + offset).astype(np.float16)
  q_blocks = -(-s // 128)
  qm = (rng.normal(size=(b, h, q_blocks, d)) * 0.3 * outliers
        + rng.normal(0, 1, (1, h, 1, d))).astype(np.float32)
  k_mean = k.astype(np.float64).mean(axis=1, keepdims=True)
  x, lens = jnp.asarray(k), jnp.full((b,), s, jnp.int32)
  shift = jnp.asarray(k_mean, jnp.float32)
  qm_j = jnp.asarray(qm)
  # the float64 bias of the first batch's first 4 heads
  y = k[:1, :, :4].astype(np.float64) - np.asarray(shift, np.float64)[:1, :, :4]
  ref = np.einsum("bhrd,bshd->bhrs", qm[:1, :4].astype(np.float64), y)
  calls, err = {}, {}
  default = quantizers.BIAS_PRODUCTS
  for name, (products, warps, chunk) in VARIANTS.items():
    quantizers.BIAS_PRODUCTS = products or default
    jax.clear_caches()
    kw = dict(group=64, dtype=jnp.int8, shift=shift, flag_nonfinite=True,
              block=128, num_warps=warps, bias_chunk=chunk)
    if products:
      kw["bias_q_mean"] = qm_j
    fn = jax.jit(lambda x, kw=kw: quantizers.rows_operand(x, lens, **kw))
    compiled = fn.lower(x).compile()
    out = jax.block_until_ready(compiled(x))
    calls[name] = compiled
    if name != "no_bias":
      bias = np.asarray(out[2][:1, :4], np.float64)
      err[name] = float(np.abs(bias - ref).max() / np.abs(ref).max())
      print(f"{name:8s} max |bias - float64| / max |bias| = {err[name]:.3e}",
            flush=True)
  quantizers.BIAS_PRODUCTS = default
  calls["cast_floor"] = jax.jit(lambda x: x.astype(jnp.int8)).lower(
      x).compile()
  rows = device_rounds(calls, (x,), rounds=args.rounds,
                       log=lambda m: print(m, flush=True))
  cast = time_call(jax.jit(lambda x: x.astype(jnp.int8)), (x,)) * 1e3
  with open(args.out, "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                   shape=args.shape, error=err, rows=rows,
                   cast_floor_ms_host=cast), f, indent=1)
  print(f"cast floor {cast:.4f} ms")
  for name in calls:
    ms = [r["device_ms"] or float("nan") for r in rows if r["call"] == name]
    print(f"{name:14s} {' '.join(f'{m:.4f}' for m in ms)} ms (GPU)  "
          f"error {err.get(name, float('nan')):.2e}")


if __name__ == "__main__":
  main()

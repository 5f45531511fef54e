"""V's statistics for sage (the sum, max and min per channel over the keys)
and the key mean: XLA's column reduction against the Pallas pass
(:func:`pallas_kernels.quantizers.column_stats`) for each of its tiles
(:data:`~pallas_kernels.quantizers.COLUMN_STATS_TILES`: splits of the keys,
rows per step, warps), at 2x8192x32x128 float16 on the GPU.

  python benchmarks/column_stats.py OUT.json [--shape B,S,N,D]

Each call is jitted alone and timed by the GPU time of its kernels
(:func:`jaxattn.tuning.device_ms`, the median of 5 calls), in two rounds
of alternating order.  (``results/2026-11-27_h100_column_stats_probe.json``
was taken by this script's first form, which held the same kernel inline.)
"""
import jax
import jax.numpy as jnp

from jaxattn import nonfinite, operands, sage
from jaxattn.tuning import (benchmark_args, device_rounds, random_btnh,
                            write_record)
from pallas_kernels import quantizers


def main():
  args = benchmark_args()
  b, s, n, d = args.shape
  k, v = random_btnh(args.shape, 2)
  lens = jnp.full((b,), s, jnp.int32)
  cfg = sage.SageConfig.from_options(preset="sage2-8b")
  parts = {
      "xla_key_mean": lambda k, v: operands._key_mean(nonfinite.finite(k),
                                                      lens),
      "xla_v_stats": lambda k, v: operands.sage_v_stats(nonfinite.finite(v),
                                                        lens, cfg),
      "xla_amax_floor": lambda k, v: jnp.abs(k).max(axis=(1, 3))}
  default = quantizers.COLUMN_STATS_TILES
  calls = {}
  for name, fn in parts.items():
    calls[name] = jax.jit(fn).lower(k, v).compile()
  try:
    for splits in (8, 16, 32):
      for chunk in (32, 64):
        for warps in (4, 8):
          quantizers.COLUMN_STATS_TILES = (splits, chunk, warps)
          tag = f"s{splits}_c{chunk}_w{warps}"
          for extrema in (False, True):
            calls[f"pallas_{'stats' if extrema else 'sum'}_{tag}"] = (
                jax.jit(lambda k, v, e=extrema: quantizers.column_stats(
                    v if e else k, lens, extrema=e)).lower(k, v).compile())
  finally:
    quantizers.COLUMN_STATS_TILES = default
  records = device_rounds(calls, (k, v),
                          log=lambda m: print(m, flush=True))
  write_record(args.out, shape=args.shape, rows=records)


if __name__ == "__main__":
  main()

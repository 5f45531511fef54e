"""The quantizer kernels' knobs on the GPU: warps per program and rows per
tile of :func:`pallas_kernels.quantizers.rows_operand` (Q passes of sage,
INT8 and fp8) and :func:`pallas_kernels.quantizers.v_operand`, at
2x8192x32x128 float16, against a float16 -> int8 cast of one tensor (the
bandwidth floor of a pass).

  python benchmarks/quantizer_knobs.py OUT.json [--shape B,S,N,D]

Each setting is jitted alone and timed in two rounds of alternating order.
"""
import functools
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from jaxattn.tuning import (alternating_rounds, benchmark_args,  # noqa: E402
                            random_btnh, write_record)
from pallas_kernels import quantizers  # noqa: E402


def main():
  args = benchmark_args()
  b, s, n, d = args.shape
  q, v = random_btnh(args.shape, 2)
  lens = jnp.full((b,), s, jnp.int32)
  rows = functools.partial(quantizers.rows_operand, flag_nonfinite=True)
  head_scale = jnp.full((b, n), 0.01, jnp.float32)
  parts = {"cast_floor": lambda: q.astype(jnp.int8)}
  for warps in (4, 8):
    for block in (64, 128):
      tag = f"w{warps}_b{block}"
      parts[f"q_sage_tile_mean_{tag}"] = (
          lambda w=warps, bl=block: rows(
              q, lens, group=32, dtype=jnp.int8, shift="tile_mean",
              block=bl, num_warps=w))
      parts[f"q_int8_token_{tag}"] = (
          lambda w=warps, bl=block: rows(q, lens, group=1, dtype=jnp.int8,
                                         block=bl, num_warps=w))
      parts[f"q_fp8_head_{tag}"] = (
          lambda w=warps, bl=block: rows(
              q, lens, group=1, dtype=jnp.float8_e4m3fn, scale=head_scale,
              block=bl, num_warps=w))
  ones = jnp.ones((b, n, d), jnp.float32)
  for warps in (4, 8):
    for block_s in (64, 128, 256):
      parts[f"v_fp8_w{warps}_s{block_s}"] = (
          lambda w=warps, bs=block_s: quantizers.v_operand(
              v, lens, dtype=jnp.float8_e4m3fn, shift=ones * 0.1,
              inv_channel=ones, inv_row=jnp.ones((b, n, s), jnp.float32),
              key_order=True, flag_nonfinite=True, block_s=bs,
              num_warps=w))
  calls = {}
  for name, fn in parts.items():
    try:
      calls[name] = jax.jit(fn).lower().compile()
    except Exception as e:  # noqa: BLE001  (a knob the lowering refuses)
      print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
  rows = alternating_rounds({n: (c, ()) for n, c in calls.items()},
                            rounds=2, log=lambda m: print(m, flush=True))
  write_record(args.out, shape=args.shape, rows=rows)


if __name__ == "__main__":
  main()

"""The quantizer kernels' knobs on the GPU: warps per program and rows per
tile of :func:`pallas_kernels.quantizers.rows_operand` (the Q/K passes of
sage, INT8 and fp8) and of :func:`pallas_kernels.quantizers.v_operand`, at
2x8192x32x128 float16, against XLA's float16 -> int8 cast and amax of one
tensor (the bandwidth floors of a pass and of a statistics read).

  python benchmarks/quantizer_knobs.py OUT.json [--shape B,S,N,D]

Each setting is jitted alone; its time is the GPU time of its kernels
(:func:`jaxattn.tuning.device_ms`, the median of 5 calls), in two rounds of
alternating order.  (Timed from the host, a pass this short measures the
host's dispatch: ``docs/design.md``, "The passes' tiles".)
"""
import functools
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from jaxattn.tuning import (benchmark_args, device_rounds,  # noqa: E402
                            random_btnh, write_record)
from pallas_kernels import quantizers  # noqa: E402


def main():
  args = benchmark_args()
  b, s, n, d = args.shape
  q, v = random_btnh(args.shape, 2)
  lens = jnp.full((b,), s, jnp.int32)
  rows = functools.partial(quantizers.rows_operand, flag_nonfinite=True)
  head_scale = jnp.full((b, n), 0.01, jnp.float32)
  # (the arrays are arguments: closed over, they would be constants of the
  # executable, and of the profile)
  parts = {"cast_floor": lambda q, v: q.astype(jnp.int8),
           "amax_floor": lambda q, v: jnp.abs(q).max(axis=(1, 3))}
  for warps in (4, 8):
    for block in (32, 64, 128):
      tag = f"w{warps}_b{block}"
      if block == 128:
        parts[f"q_sage_tile_mean_{tag}"] = (
            lambda q, v, w=warps, bl=block: rows(
                q, lens, group=32, dtype=jnp.int8, shift="tile_mean",
                block=bl, num_warps=w))
      parts[f"q_int8_token_{tag}"] = (
          lambda q, v, w=warps, bl=block: rows(
              q, lens, group=1, dtype=jnp.int8, block=bl, num_warps=w))
      parts[f"q_fp8_head_{tag}"] = (
          lambda q, v, w=warps, bl=block: rows(
              q, lens, group=1, dtype=jnp.float8_e4m3fn, scale=head_scale,
              block=bl, num_warps=w))
  ones = jnp.ones((b, n, d), jnp.float32)
  for warps in (4, 8):
    for block_s in (64, 128):
      for dtype in (jnp.int8, jnp.float8_e4m3fn):
        parts[f"v_{jnp.dtype(dtype).name}_w{warps}_s{block_s}"] = (
            lambda q, v, w=warps, bs=block_s, dt=dtype: quantizers.v_operand(
                v, lens, dtype=dt, shift=ones * 0.1, inv_channel=ones,
                inv_row=jnp.ones((b, n, s), jnp.float32), key_order=True,
                flag_nonfinite=True, block_s=bs, num_warps=w))
  calls = {}
  for name, fn in parts.items():
    try:
      calls[name] = jax.jit(fn).lower(q, v).compile()
    except Exception as e:  # noqa: BLE001  (a knob the lowering refuses)
      print(f"{name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
  records = device_rounds(calls, (q, v),
                          log=lambda m: print(m, flush=True))
  write_record(args.out, shape=args.shape, rows=records)


if __name__ == "__main__":
  main()

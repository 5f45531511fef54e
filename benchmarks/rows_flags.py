"""What the non-finite flags cost the Q/K quantizer
(:func:`pallas_kernels.quantizers.rows_operand`) on the GPU, at
2x8192x32x128 float16, with and without ``flag_nonfinite``, in one process:

  python benchmarks/rows_flags.py OUT.json

Rows: per token (int8 and fp8, no shift), per 64 rows with SageAttention's
key mean, and with the smoothing bias as well; a float16 -> int8 cast (one
read, one write) is the bandwidth floor.
"""
import json
import sys

import jax
import jax.numpy as jnp

from pallas_kernels import quantizers
from jaxattn.tuning import time_call


def main(out_path):
  b, s, h, d = 2, 8192, 32, 128
  x = jax.random.normal(jax.random.key(0), (b, s, h, d), jnp.float16)
  lens = jnp.full((b,), s, jnp.int32)
  shift = jax.random.normal(jax.random.key(1), (b, 1, h, d), jnp.float32)
  qm = jax.random.normal(jax.random.key(2), (b, h, s // 128, d), jnp.float32)
  cases = {
      "int8_per_token": dict(group=1, dtype=jnp.int8),
      "fp8_per_token": dict(group=1, dtype=jnp.float8_e4m3fn),
      "int8_g64_shift": dict(group=64, dtype=jnp.int8, shift=shift),
      "int8_g64_shift_bias": dict(group=64, dtype=jnp.int8, shift=shift,
                                  bias_q_mean=qm),
  }
  rows = {"cast_floor": time_call(jax.jit(lambda x: x.astype(jnp.int8)),
                                  (x,)) * 1e3}
  for rnd in range(2):
    for name, kw in cases.items():
      for flag in (False, True):
        fn = jax.jit(lambda x, kw=kw, flag=flag: quantizers.rows_operand(
            x, lens, flag_nonfinite=flag, **kw))
        t = time_call(fn, (x,)) * 1e3
        rows[f"{name}_flags{flag}_round{rnd}"] = t
        print(f"round {rnd} {name:22s} flags={flag!s:5s} {t:.4f} ms",
              flush=True)
  print(f"cast floor {rows['cast_floor']:.4f} ms")
  with open(out_path, "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                   ms=rows), f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])

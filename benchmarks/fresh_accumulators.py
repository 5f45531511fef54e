"""A/B of the Mosaic kernel's wgmma accumulators zeroed next to their wgmma
(``pallas_kernels.mosaic.FRESH_ACCUMULATORS``) against a splat of zeros, on
the H100, kernels alone, in one process against cuDNN bfloat16.

  python benchmarks/fresh_accumulators.py OUT.json [--causal]

Each setting is compiled ahead of time (the flag is read when the kernel is
traced), then all are timed in interleaved rounds, so the spread between
rounds shows the noise.  The outputs of every setting must equal the
first's bit for bit (the products are the same; only the zeroing moves).
The kernel takes float16 S's accumulator from a splat whatever the setting
(the fp32 kernel measured no faster the other way: see
``results/2026-11-25_h100_fresh_accumulators.json``, recorded before that
rule).
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import bench
from jaxattn.tuning import time_call
from pallas_kernels import mosaic

SETTINGS = [(), ("pv",), ("qk", "pv")]
VARIANTS = [  # (name, method, options, settings)
    ("fp8", "fp8", {}, SETTINGS),
    ("sage2-8b", "sage", {"preset": "sage2-8b"}, SETTINGS),
    ("sage2-8b_no_smooth_q", "sage", {"preset": "sage2-8b",
                                      "smooth_q": False}, SETTINGS),
    ("int8_full", "int8", {}, [(), ("qk", "pv")]),
    ("int8_half", "int8", {"pv_dtype": "fp16"}, [(), ("qk",)]),
]


def main(out_path, causal):
  b, h, s, d = 2, 32, 8192, 128
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(x, (b, s, h, d), jnp.float32).astype(
      jnp.float16) for x in ks)
  cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, implementation="cudnn"))
  bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  calls, equal = {}, {}
  for name, method, opts, settings in VARIANTS:
    first = None
    for setting in settings:
      mosaic.FRESH_ACCUMULATORS = setting
      jax.clear_caches()
      setup = bench.kernel_alone(causal, d, [("k", method, opts)])["k_mosaic"]
      fn, args = setup(q, k, v)
      compiled = fn.lower(*args).compile()
      out = np.asarray(jax.block_until_ready(compiled(*args)))
      key = f"{name}/{'+'.join(setting) or 'splat'}"
      calls[key] = (compiled, args)
      if first is None:
        first = out
      else:
        equal[key] = dict(
            bit_identical=bool(np.array_equal(out, first, equal_nan=True)),
            max_abs_diff=float(np.nanmax(np.abs(
                out.astype(np.float32) - first.astype(np.float32)))))
        print(key, equal[key], flush=True)
  mosaic.FRESH_ACCUMULATORS = SETTINGS[-1]
  rows = []
  for rnd in range(2):
    t_ref = time_call(cudnn, bf)
    for key, (fn, args) in calls.items():
      t = time_call(fn, args)
      rows.append(dict(round=rnd, call=key, ms=t * 1e3,
                       cudnn_bf16_ms=t_ref * 1e3, ratio=t_ref / t))
      print(f"round {rnd} {key:36s} {t * 1e3:.3f} ms  x{t_ref / t:.3f} "
            f"(cuDNN bf16 {t_ref * 1e3:.3f} ms)", flush=True)
    with open(out_path, "w") as f:
      json.dump(dict(meta=dict(device=jax.devices()[0].device_kind,
                               jax=jax.__version__, causal=causal,
                               shape="BTNH 2x8192x32x128, kernels alone"),
                     equal=equal, rows=rows), f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1], "--causal" in sys.argv[2:])

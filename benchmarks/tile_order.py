"""A/B of the Mosaic kernel's launch order on the GPU, kernels alone: the
tile rows of one (batch, head) one after another, or the heads of one tile
row (``MosaicParams.tile_order``).

  python benchmarks/tile_order.py OUT.json [--workloads noncausal,causal,packed]
      [--methods fp32,fp8,sage,int8] [--rounds 2]

(``results/2026-11-26_h200_persistent_tile_order.json`` came from this
script's first form, at 63531c1, which also timed persistent CTAs.)
Every setting is compiled ahead of time (the order is read when the
kernel is traced); its output must equal the first setting's bit for bit.
Then the settings are timed in rounds whose order alternates (ABBA), each
round against cuDNN bfloat16 in the same process.  ``packed`` is causal
with 8 documents of random lengths per row (``benchmarks/index_mask.py``).
"""
import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
import jaxattn  # noqa: E402
from jaxattn.tuning import time_call  # noqa: E402
from pallas_kernels import common, mosaic  # noqa: E402
import index_mask  # noqa: E402

SETTINGS = ["heads", "rows"]
ORIGINAL_PARAMS = mosaic.MosaicParams


def kernel_call(method, x, *, causal, im):
  """The method's Mosaic kernel on operands its adapter prepared."""
  adapter = jaxattn.api.BACKENDS["mosaic"].ADAPTERS[method]
  cfg = jaxattn.api.config_for(method, "mosaic")
  q, k, v = x
  lens = jnp.full((q.shape[0],), k.shape[1], jnp.int32)
  scale = 1.0 / np.sqrt(q.shape[-1])
  if getattr(adapter, "prepare", None) is None:   # one stage (fp32)
    fn = jax.jit(lambda q, k, v, lens: adapter.run(
        q, k, v, None, None, lens, scale=scale, is_causal=causal,
        config=cfg, index_mask=im))
    return fn, (q, k, v, lens)
  segs = None if im is None or im.q_segments is None else (
      im.q_segments, im.kv_segments)
  ops = jax.block_until_ready(jax.jit(functools.partial(
      adapter.prepare, scale=scale, config=cfg, segments=segs))(q, k, v, lens))
  out_dtype = (jnp.float32 if getattr(ops, "out_row_scale", None) is not None
               else jnp.float16)
  fn = jax.jit(lambda ops, lens: adapter.kernel(
      ops, lens, is_causal=causal, config=cfg, out_dtype=out_dtype,
      index_mask=im))
  return fn, (ops, lens)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("out")
  ap.add_argument("--workloads", default="noncausal,causal,packed")
  ap.add_argument("--methods", default="fp32,fp8,sage,int8")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--shape", default="2,8192,32,128", help="B,S,N,D")
  args = ap.parse_args()
  b, s, h, d = map(int, args.shape.split(","))
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(x, (b, s, h, d), jnp.float32) for x in keys)
  x16 = tuple(a.astype(jnp.float16) for a in (q, k, v))
  bf = tuple(a.astype(jnp.bfloat16) for a in (q, k, v))
  segs = index_mask.packed_segments(np.random.default_rng(0), b, s,
                                      min(8, s // 2))
  workloads = {"noncausal": (False, None), "causal": (True, None),
               "packed": (True, common.IndexMask(q_segments=segs,
                                                 kv_segments=segs))}
  equal, rows = {}, []
  meta = dict(device=jax.devices()[0].device_kind,
              jax=jax.__version__, shape=f"BTNH {args.shape}, kernels alone")
  for wname in args.workloads.split(","):
    causal, im = workloads[wname]
    peer = "cudnn" if jax.default_backend() == "gpu" else "xla"  # (smoke)
    cudnn = jax.jit(lambda q, k, v, causal=causal: (
        jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                     implementation=peer)))
    calls = {}
    for method in args.methods.split(","):
      first = None
      for order in SETTINGS:
        mosaic.MosaicParams = functools.partial(ORIGINAL_PARAMS,
                                                tile_order=order)
        jax.clear_caches()
        fn, fargs = kernel_call(method, x16, causal=causal, im=im)
        compiled = fn.lower(*fargs).compile()
        out = np.asarray(jax.block_until_ready(compiled(*fargs)), np.float32)
        key = f"{wname}/{method}/{order}"
        calls[key] = (compiled, fargs)
        if first is None:
          first = out
          assert np.isfinite(out).all(), key
        else:
          equal[key] = bool(np.array_equal(out, first))
          print(key, "bit-identical:", equal[key], flush=True)
    mosaic.MosaicParams = ORIGINAL_PARAMS
    names = list(calls)
    for rnd in range(args.rounds):
      t_ref = time_call(cudnn, bf)
      for key in (names if rnd % 2 == 0 else names[::-1]):
        fn, fargs = calls[key]
        t = time_call(fn, fargs)
        rows.append(dict(round=rnd, call=key, ms=t * 1e3,
                         cudnn_bf16_ms=t_ref * 1e3, ratio=t_ref / t))
        print(f"round {rnd} {key:34s} {t * 1e3:7.3f} ms  x{t_ref / t:.3f}",
              flush=True)
      with open(args.out, "w") as f:
        json.dump(dict(meta=meta, equal=equal, rows=rows), f, indent=1)
  print("\nmedian ms over rounds (ratio to cuDNN bf16)")
  for key in dict.fromkeys(r["call"] for r in rows):
    ms = [r["ms"] for r in rows if r["call"] == key]
    ra = [r["ratio"] for r in rows if r["call"] == key]
    print(f"{key:34s} {np.median(ms):7.3f}  x{np.median(ra):.3f}  "
          f"rounds {' '.join(f'{m:.3f}' for m in ms)}")


if __name__ == "__main__":
  main()

"""Sweeps the kernel knobs of jaxattn's Pallas kernels on the GPU with
:func:`jaxattn.tuning.autotune` and prints every configuration's time
and its ratio to cuDNN bf16 measured in the same run.

    python benchmarks/sweep.py --methods fp32,pasa --shapes 2x32x8192x128
        [--causal] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from jaxattn import tuning  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--methods", default="fp32")
  p.add_argument("--shapes", default="2x32x8192x128")
  p.add_argument("--causal", action="store_true")
  p.add_argument("--block-k", type=int, default=None,
                 help="fixed block_k (PASA's shifting-matrix size)")
  p.add_argument("--options", default="",
                 help="fixed method options, e.g. pv_dtype=fp16")
  p.add_argument("--out", default="")
  a = p.parse_args(argv)
  doc = []
  for shape in a.shapes.split(","):
    b, h, s, d = (int(x) for x in shape.split("x"))
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (b, s, h, d), jnp.float16) for x in keys)
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=a.causal, implementation="cudnn"))
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
    t_ref = tuning.time_call(cudnn, (qb, kb, vb))
    print(f"# {shape} causal={a.causal} cudnn_bf16 {t_ref * 1e3:.3f} ms",
          flush=True)
    for method in a.methods.split(","):
      fixed = {"block_k": a.block_k} if a.block_k else {}
      if method == "pasa" and not fixed:
        fixed = {"block_k": 128}
      for item in filter(None, a.options.split(",")):
        name, value = item.split("=")
        fixed[name] = int(value) if value.isdigit() else value
      best, results = tuning.autotune(method, q, k, v, is_causal=a.causal,
                                      fixed=fixed)
      for opts, t in sorted(results, key=lambda r: r[1] if isinstance(
          r[1], float) else 1e9):
        if isinstance(t, float):
          print(f"  {method:10s} {opts} {t * 1e3:8.3f} ms "
                f"x{t_ref / t:.3f}", flush=True)
        else:
          print(f"  {method:10s} {opts} ERROR {t[:120]}", flush=True)
      doc.append(dict(shape=shape, causal=a.causal, method=method,
                      cudnn_bf16_ms=t_ref * 1e3, best=best,
                      results=[(o, t * 1e3 if isinstance(t, float) else t)
                               for o, t in results]))
  if a.out:
    with open(a.out, "w") as f:
      json.dump(doc, f, indent=1)


if __name__ == "__main__":
  main()

"""Times jaxattn's kernels and the peers on the same inputs, in one process on
the GPU, and appends the results as JSON under ``benchmarks/results/``.

    python benchmarks/bench.py [--shapes 2x32x8192x128,...] [--methods ...]
        [--causal both|yes|no] [--out benchmarks/results/NAME.json]

Peers: cuDNN through ``jax.nn.dot_product_attention(implementation="cudnn")``
in bfloat16 (the reference point of every ratio) and float16, jax's own
Pallas attention (``jax.experimental.pallas.ops.gpu.attention.mha``), and,
where they import, SageAttention's Triton kernels (torch) and tokamax.
FLOPs are ``4 B H Sq Skv D`` (halved for causal).  Times are the median over
``--reps`` timed groups of ``--iters`` back-to-back calls after warm-up,
synchronised on the device.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import jaxattn  # noqa: E402
from pallas_kernels.tuning import time_call  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)

DEFAULT_SHAPES = "4x32x2048x128,2x32x8192x128,1x32x16384x128,4x32x4096x64"


def parse_shapes(text):
  return [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s]


def jax_methods(causal, d):
  """name -> (dtype of inputs, function(q, k, v))."""
  scale = 1.0 / math.sqrt(d)
  out = {
      "cudnn_bf16": (jnp.bfloat16, lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn")),
      "cudnn_fp16": (jnp.float16, lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn")),
  }
  try:
    from jax.experimental.pallas.ops.gpu import attention as jax_pallas
    out["jax_pallas_mha"] = (jnp.float16, lambda q, k, v: jax_pallas.mha(
        q, k, v, None, sm_scale=scale, causal=causal))
  except Exception:  # noqa: BLE001
    pass
  try:
    import tokamax
    for impl in ("mosaic", "triton"):
      out[f"tokamax_{impl}_bf16"] = (
          jnp.bfloat16, lambda q, k, v, impl=impl: tokamax.dot_product_attention(
              q, k, v, is_causal=causal, implementation=impl))
  except Exception:  # noqa: BLE001
    pass
  for name, m, opts in JAXATTN_VARIANTS:
    if m not in jaxattn.METHODS or jaxattn.base.get_method(m).pallas is None:
      continue
    out[name] = (jnp.float16, lambda q, k, v, m=m, opts=opts:
                 jaxattn.dot_product_attention(
                     q, k, v, is_causal=causal, method=m,
                     implementation="pallas", **opts))
  return out


# (benchmark name, method, options): end to end from float16 inputs.
JAXATTN_VARIANTS = [
    ("jaxattn_fp32", "fp32", {}),
    ("jaxattn_fp16_fp32", "fp16_fp32", {}),
    ("jaxattn_fp16", "fp16", {}),
    ("jaxattn_pasa", "pasa", {}),
    ("jaxattn_sage2-8b", "sage", {"preset": "sage2-8b"}),
    ("jaxattn_sage2-4b", "sage", {"preset": "sage2-4b"}),
    ("jaxattn_sage1", "sage", {"preset": "sage1"}),
    ("jaxattn_int8_full", "int8", {}),
    ("jaxattn_int8_full_vblock", "int8", {"v_granularity": "block"}),
    ("jaxattn_int8_half", "int8", {"pv_dtype": "fp16"}),
    ("jaxattn_fmha_int8", "fmha_int8", {}),
    ("jaxattn_fp8", "fp8", {}),
]


def kernel_alone(causal, d):
  """name -> (prepare(q, k, v) -> args, kernel(*args)): the kernels timed
  on pre-quantized inputs (the quantizer's time excluded)."""
  out = {}
  try:
    from pallas_kernels import quantized as qk
    from jaxattn import int_flash
  except ImportError:
    return out
  scale = 1.0 / math.sqrt(d)

  def int8_prep(pv_dtype):
    cfg = int_flash.Int8Config(pv_dtype=pv_dtype)
    def prep(q, k, v):
      qz = int_flash.int8_quantize(q, k, v, None, config=cfg)
      vv = qz["v"].transpose(0, 2, 3, 1) if pv_dtype == "int8" else qz["v"]
      lens = jnp.full((q.shape[0],), k.shape[1], jnp.int32)
      return (qz["q"], qz["q_scale"] * scale * 1.4426950408889634, qz["k"],
              qz["k_scale"], vv, lens)
    params = qk.kernel_params(d, cfg, block_k=cfg.block_k)
    def kern(q8, qs, k8, ks, vv, lens):
      return qk.quantized_attention(
          q8, qs, k8, ks, vv, lens, None, None,
          pv="int8" if pv_dtype == "int8" else "fp16", is_causal=causal,
          params=params)
    return prep, kern

  out["kernel_int8_full"] = int8_prep("int8")
  out["kernel_int8_half"] = int8_prep("fp16")

  def sage_prep(preset):
    from jaxattn import sage
    cfg = sage.SageConfig.from_options(preset=preset)
    fp8 = cfg.pv_dtype == "fp8"
    def prep(q, k, v):
      z = sage.sage_quantize(q, k, v, None, scale=scale, config=cfg)
      qbias = None
      if cfg.smooth_q:
        qbias = (z["smooth_bias"] * sage.log2_scale(scale)).transpose(0, 2, 1, 3)
      vv = z["v"].transpose(0, 2, 3, 1) if fp8 else z["v"]
      osc = z["v_scale"] / 448.0 if fp8 else jnp.ones_like(z["v_mean"])
      lens = jnp.full((q.shape[0],), k.shape[1], jnp.int32)
      return (z["q"], z["q_scale_folded"], z["k"], z["k_scale"], vv, lens,
              qbias, osc, z["v_mean"])
    params = qk.kernel_params(d, cfg, block_k=cfg.block_k)
    def kern(q8, qs, k8, ks, vv, lens, qbias, osc, vmean):
      return qk.quantized_attention(
          q8, qs, k8, ks, vv, lens, None, None, pv=cfg.pv_dtype,
          is_causal=causal, params=params, q_block_bias=qbias,
          bias_rows=cfg.block_q, out_scale=osc, out_shift=vmean,
          out_dtype=jnp.float16)
    return prep, kern

  for preset in ("sage2-8b", "sage1"):
    out[f"kernel_{preset}"] = sage_prep(preset)
  return out


def torch_methods(causal):
  out = {}
  try:
    import torch
    from sageattention import sageattn
    out["sageattention_triton"] = lambda q, k, v: sageattn(
        q, k, v, tensor_layout="NHD", is_causal=causal)
    del torch
  except Exception:  # noqa: BLE001
    pass
  return out


def bench_shape(shape, causal, names, iters, reps, log):
  b, h, s, d = shape
  flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
  key = jax.random.key(0)
  kq, kk, kv = jax.random.split(key, 3)
  base = {dt: [jax.random.normal(x, (b, s, h, d), jnp.float32).astype(dt)
               for x in (kq, kk, kv)]
          for dt in (jnp.float16, jnp.bfloat16)}
  rows = {}
  for name, (dt, fn) in jax_methods(causal, d).items():
    if names and name not in names and name != "cudnn_bf16":
      continue
    try:
      f = jax.jit(fn)
      t = time_call(f, base[dt], iters, reps)
      mem = f.lower(*base[dt]).compile().memory_analysis()
      temp = getattr(mem, "temp_size_in_bytes", None)
      rows[name] = dict(ms=t * 1e3, tflops=flops / t / 1e12, temp_bytes=temp)
    except Exception as e:  # noqa: BLE001
      rows[name] = dict(error=f"{type(e).__name__}: {e}"[:400])
      log.write(traceback.format_exc())
  for name, (prep, kern) in kernel_alone(causal, d).items():
    if names and name not in names:
      continue
    try:
      args = jax.block_until_ready(jax.jit(prep)(*base[jnp.float16]))
      t = time_call(jax.jit(kern), args, iters, reps)
      rows[name] = dict(ms=t * 1e3, tflops=flops / t / 1e12)
    except Exception as e:  # noqa: BLE001
      rows[name] = dict(error=f"{type(e).__name__}: {e}"[:400])
      log.write(traceback.format_exc())
  tm = torch_methods(causal)
  if tm and (not names or any(n in names for n in tm)):
    import torch
    import triton.testing
    tq = [torch.randn(b, s, h, d, device="cuda", dtype=torch.float16)
          for _ in range(3)]
    for name, fn in tm.items():
      try:
        ms = triton.testing.do_bench(lambda: fn(*tq), warmup=50, rep=300,
                                     return_mode="median")
        rows[name] = dict(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
      except Exception as e:  # noqa: BLE001
        rows[name] = dict(error=f"{type(e).__name__}: {e}"[:400])
        log.write(traceback.format_exc())
  ref = rows.get("cudnn_bf16", {}).get("ms")
  for r in rows.values():
    if ref and "ms" in r:
      r["ratio_vs_cudnn_bf16"] = ref / r["ms"]
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shapes", default=DEFAULT_SHAPES)
  p.add_argument("--methods", default="", help="comma list; default all")
  p.add_argument("--causal", default="both", choices=["both", "yes", "no"])
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--out", default="")
  p.add_argument("--log", default=os.devnull)
  a = p.parse_args(argv)
  names = [n for n in a.methods.split(",") if n]
  causals = {"both": [False, True], "yes": [True], "no": [False]}[a.causal]
  dev = jax.devices()[0]
  meta = dict(device=getattr(dev, "device_kind", str(dev)),
              jax=jax.__version__, date=datetime.datetime.now().isoformat(),
              host=platform.node())
  results = []
  with open(a.log, "a") as log:
    for shape in parse_shapes(a.shapes):
      for causal in causals:
        rows = bench_shape(shape, causal, names, a.iters, a.reps, log)
        results.append(dict(shape=shape, causal=causal, rows=rows))
        print(f"# B,H,S,D={shape} causal={causal}", flush=True)
        for n, r in rows.items():
          if "ms" in r:
            print(f"  {n:28s} {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s "
                  f"x{r.get('ratio_vs_cudnn_bf16', float('nan')):.3f}",
                  flush=True)
          else:
            print(f"  {n:28s} ERROR {r['error'][:200]}", flush=True)
  doc = dict(meta=meta, results=results)
  if a.out:
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
      json.dump(doc, f, indent=1)
  return doc


if __name__ == "__main__":
  main()

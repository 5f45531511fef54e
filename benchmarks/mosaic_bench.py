"""Times the Hopper (Mosaic GPU) kernels against cuDNN bf16 and the Triton
kernels in one process (end to end from float16 inputs, and kernel alone on
pre-quantized inputs), and sweeps the Mosaic block sizes.

    python benchmarks/mosaic_bench.py --out results.json [--shapes 2x32x8192x128]
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import sys
import os

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import jaxattn  # noqa: E402
from jaxattn import fp8 as fp8_ref, int_flash, sage  # noqa: E402
from pallas_kernels import mosaic  # noqa: E402
from pallas_kernels.tuning import time_call  # noqa: E402

E2E = [  # (name, method, options, implementations)
    ("fp32", "fp32", {}, ("mosaic", "pallas")),
    ("sage2-8b", "sage", {"preset": "sage2-8b"}, ("mosaic", "pallas")),
    ("sage2-8b_bk128", "sage", {"preset": "sage2-8b", "block_k": 128}, ("mosaic",)),
    ("sage2-4b", "sage", {"preset": "sage2-4b"}, ("mosaic",)),
    ("sage1", "sage", {"preset": "sage1"}, ("mosaic", "pallas")),
    ("int8_full", "int8", {}, ("mosaic", "pallas")),
    ("int8_half", "int8", {"pv_dtype": "fp16"}, ("mosaic", "pallas")),
    ("fp8", "fp8", {}, ("mosaic",)),
]


def kernel_alone(name, q, k, v, causal):
  """jitted kernel call on pre-quantized inputs (no quantizer)."""
  b, t, n, d = q.shape
  lens = jnp.full((b,), k.shape[1], jnp.int32)
  scale = 1 / math.sqrt(d)
  c = scale * math.log2(math.e)
  if name.startswith("sage"):
    bk = 128 if name.endswith("bk128") else 64
    cfg = sage.SageConfig.from_options(preset="sage2-8b", block_k=bk)
    z = sage.sage_quantize(q, k, v, lens, scale=scale, config=cfg)
    qb = (z["smooth_bias"] * sage.log2_scale(scale)).transpose(0, 2, 1, 3)
    args = (z["q"], z["k"], z["v"].transpose(0, 2, 3, 1), lens,
            z["q_scale_folded"], z["k_scale"], qb, z["v_scale"] / 448.0,
            z["v_mean"])
    f = lambda q8, k8, vt, l, qs, ks, qb, osc, osh: mosaic.mosaic_attention(
        q8, k8, vt, l, qk="int8", pv="fp8", is_causal=causal,
        params=mosaic.MosaicParams(block_kv=bk), q_scale=qs, k_scale=ks,
        q_block_bias=qb, bias_rows=cfg.block_q, out_scale=osc, out_shift=osh)
  elif name == "int8_full":
    cfg = int_flash.Int8Config.from_options()
    z = int_flash.int8_quantize(q, k, v, lens, config=cfg)
    sv = z["v_scale"]
    osc = jnp.broadcast_to(sv[..., None], (*sv.shape, d))
    args = (z["q"], z["k"], z["v"].transpose(0, 2, 3, 1), lens,
            z["q_scale"] * c, z["k_scale"], osc, jnp.zeros_like(osc))
    f = lambda q8, k8, vt, l, qs, ks, osc, osh: mosaic.mosaic_attention(
        q8, k8, vt, l, qk="int8", pv="int8", is_causal=causal,
        params=mosaic.MosaicParams(block_kv=cfg.block_k), q_scale=qs,
        k_scale=ks, out_scale=osc, out_shift=osh)
  elif name == "fp8":
    cfg = fp8_ref.Fp8Config.from_options()
    z = fp8_ref.fp8_quantize(q, k, v, lens, config=cfg)
    s_len, nk = k.shape[1], k.shape[2]
    qs = jnp.broadcast_to(z["q_scale"][:, None, :], (b, t, n)) * c
    ks = jnp.broadcast_to(z["k_scale"][:, None, :], (b, s_len, nk))
    osc = jnp.broadcast_to((z["v_scale"] / 448.0)[..., None], (b, nk, d))
    args = (z["q"], z["k"], z["v"].transpose(0, 2, 3, 1), lens, qs, ks, osc,
            jnp.zeros_like(osc))
    f = lambda q8, k8, vt, l, qs, ks, osc, osh: mosaic.mosaic_attention(
        q8, k8, vt, l, qk="fp8", pv="fp8", is_causal=causal,
        params=mosaic.MosaicParams(block_kv=cfg.block_k), q_scale=qs,
        k_scale=ks, out_scale=osc, out_shift=osh)
  else:
    raise ValueError(name)
  return jax.jit(f), [jax.block_until_ready(a) for a in args]


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--shapes", default="2x32x8192x128,1x32x16384x128,4x32x4096x64")
  p.add_argument("--out", default=None)
  p.add_argument("--sweep", action="store_true")
  a = p.parse_args(argv)
  results = []
  table = []
  for shape in a.shapes.split(","):
    b, h, s, d = (int(x) for x in shape.split("x"))
    ks = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(kk, (b, s, h, d), jnp.float16) for kk in ks)
    for causal in (False, True):
      flops = 4 * b * h * s * s * d / (2 if causal else 1)
      qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
      cudnn = jax.jit(functools.partial(
          jax.nn.dot_product_attention, is_causal=causal,
          implementation="cudnn"))
      t_ref = time_call(cudnn, (qb, kb, vb))
      row = {"shape": shape, "causal": causal, "cudnn_bf16_ms": t_ref * 1e3}
      def rec(key, fn, args):
        try:
          t_ = time_call(fn, args)
          row[key] = t_ref / t_
          row[key + "_tflops"] = flops / t_ / 1e12
        except Exception as e:  # noqa: BLE001
          row[key] = f"error: {type(e).__name__}: {str(e)[:300]}"
        print(shape, causal, key, row[key], flush=True)
      for name, method, opts, impls in E2E:
        if d != 128 and name == "sage2-8b_bk128":
          continue
        for impl in impls:
          fn = jax.jit(functools.partial(
              jaxattn.dot_product_attention, method=method, is_causal=causal,
              implementation=impl, **opts))
          rec(f"{name}_{impl}", fn, (q, k, v))
        if name == "fp32":
          fnb = jax.jit(functools.partial(
              jaxattn.dot_product_attention, method="fp32", is_causal=causal,
              implementation="mosaic"))
          rec("fp32_bf16_mosaic", fnb, (qb, kb, vb))
      for name in ("sage2-8b", "sage2-8b_bk128", "int8_full", "fp8"):
        try:
          f, args = kernel_alone(name, q, k, v, causal)
          rec(f"kernel_{name}_mosaic", f, args)
        except Exception as e:  # noqa: BLE001
          row[f"kernel_{name}_mosaic"] = f"error: {e}"[:300]
      if a.sweep and d == 128:
        for bq, bk, st in ((64, 128, 2), (64, 64, 2), (64, 64, 3),
                           (64, 128, 3)):
          prm = mosaic.MosaicParams(block_q=bq, block_kv=bk, stages=st)
          f = jax.jit(lambda q_, k_, v_, prm=prm: mosaic.mosaic_attention(
              q_, k_, v_, jnp.full((b,), s, jnp.int32), qk="f16", pv="f16",
              is_causal=causal, params=prm, scale=1 / math.sqrt(d)))
          rec(f"sweep_fp32_bq{bq}_bk{bk}_st{st}", f, (q, k, v))
      results.append(row)
      table.append(row)
  meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
          "date": datetime.datetime.now().isoformat(timespec="seconds")}
  if a.out:
    with open(a.out, "w") as fh:
      json.dump({"meta": meta, "rows": results}, fh, indent=1)
  print("\n== ratio to cuDNN bf16 (higher is faster)", meta)
  keys = [k_ for k_ in table[0] if k_ not in ("shape", "causal") and
          not k_.endswith("_tflops")]
  for k_ in keys:
    vals = []
    for r in table:
      x = r.get(k_, "")
      vals.append(f"{x:.3f}" if isinstance(x, float) else ("ERR" if x else "-"))
    print(f"{k_:32s} " + " ".join(f"{v_:>7s}" for v_ in vals))


if __name__ == "__main__":
  main()

"""The accuracy / robustness report: the papers' cases on the references.

``python -m jaxattn report [--json PATH] [--quick] [--implementation ...]``
prints one table per family and writes the same numbers as JSON:

* PASA Table 4 at shape (1, 16, 1280, 128): NaN percentage of ``fp16_fp32``
  and ``pasa`` and their relative RMSE against a float64 reference.
* SageAttention2 granularities (token / warp / block / tensor, int4 and
  int8, with and without smoothing) on channel-outlier keys: cosine
  similarity, relative L1 and RMSE against float64 attention.
* INT-FlashAttention: the fp8 baseline, full-INT8 (per-tensor and per-block
  V) and half-INT8, plus the 8-bit FMHA, on N(0, 1) and U(-0.5, 0.5) inputs:
  the paper's mean relative error ``mean|O - O_ref| / mean|O_ref|``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn
from jaxattn import data, metrics
from jaxattn.metrics import exact_attention


def mean_relative_error(out, ref) -> float:
  """INT-FlashAttention's metric: ``mean|O - O_ref| / mean|O_ref|``."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.mean(np.abs(out - ref)) / np.mean(np.abs(ref)))


class _Progress:
  def __init__(self, total, stream=sys.stderr):
    self.total, self.done, self.stream, self.t0 = total, 0, stream, time.time()

  def step(self, label):
    self.done += 1
    self.stream.write(f"\r[{self.done}/{self.total}] {time.time() - self.t0:6.1f}s"
                      f" {label[:60]:60s}")
    if self.done == self.total:
      self.stream.write("\n")
    self.stream.flush()


def pasa_table4(shape, impl, progress):
  rows = []
  for case in data.PASA_TABLE4_CASES:
    q, k, v = data.pasa_case(jax.random.key(0), case, shape, jnp.float16)
    ref = exact_attention(q, k, v)
    row = dict(case=case["name"], x0=case["x0"], am=case["am"],
               paper_fp16_fp32_nan_pct=case["paper_nan_pct"])
    for method in ("fp16_fp32", "pasa", "fp32"):
      out = jaxattn.dot_product_attention(q, k, v, method=method,
                                          implementation=impl)
      row[f"{method}_nan_pct"] = 100.0 * metrics.nan_fraction(out)
      row[f"{method}_rel_rmse"] = metrics.relative_rmse(out, ref)
      progress.step(f"PASA {case['name']} {method}")
    rows.append(row)
  return rows


SAGE_VARIANTS = [
    # (label, options)
    *[(f"int8 {g}", dict(qk_dtype="int8", qk_granularity=g))
      for g in ("token", "warp", "block", "tensor")],
    *[(f"int4 {g}", dict(qk_dtype="int4", qk_granularity=g))
      for g in ("token", "warp", "block", "tensor")],
    ("int4 warp, no smoothing", dict(qk_dtype="int4", qk_granularity="warp",
                                     smooth_q=False, smooth_k=False,
                                     smooth_v=False)),
    ("sage1 (int8 block, fp16 PV)", dict(preset="sage1")),
]


def sage_granularity(shape, impl, progress):
  q, k, v = data.channel_outlier(jax.random.key(1), shape, jnp.float16)
  ref = exact_attention(q, k, v)
  rows = []
  for label, opts in SAGE_VARIANTS:
    out = jaxattn.dot_product_attention(q, k, v, method="sage",
                                        implementation=impl, **opts)
    s = metrics.summary(out, ref)
    rows.append(dict(variant=label, cos_sim=s["cos_sim"], rel_l1=s["rel_l1"],
                     rmse=s["rmse"], nan_frac=s["nan_frac"]))
    progress.step(f"sage {label}")
  return rows


INT_VARIANTS = [
    ("fp8 (FA3-style)", "fp8", {}),
    ("full-INT8, V per tensor", "int8", dict(v_granularity="tensor")),
    ("full-INT8, V per block", "int8", dict(v_granularity="block")),
    ("half-INT8 (fp16 PV)", "int8", dict(pv_dtype="fp16")),
    ("8-bit FMHA, dynamic", "fmha_int8", {}),
]


def int_flash(shape, impl, progress):
  rows = []
  for dist, gen in (("normal", data.normal), ("uniform", data.uniform)):
    q, k, v = gen(jax.random.key(2), shape, jnp.float16)
    ref = exact_attention(q, k, v)
    for label, method, opts in INT_VARIANTS:
      out = jaxattn.dot_product_attention(q, k, v, method=method,
                                          implementation=impl, **opts)
      rows.append(dict(data=dist, variant=label,
                       mean_rel_err=mean_relative_error(out, ref),
                       rel_rmse=metrics.relative_rmse(out, ref)))
      progress.step(f"{dist} {label}")
  return rows


def _table(title, rows, cols):
  lines = [f"\n== {title}"]
  widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols]
  lines.append("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
  for r in rows:
    lines.append("  ".join(_fmt(r[c]).rjust(w) for c, w in zip(cols, widths)))
  return "\n".join(lines)


def _fmt(x):
  if isinstance(x, float):
    return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"
  return str(x)


def run(quick=False, implementation="reference", stream=sys.stdout):
  """Computes every table; returns the JSON-able dict."""
  pasa_shape = (1, 320, 4, 128) if quick else (1, 1280, 16, 128)
  sage_shape = (1, 256, 2, 128) if quick else (1, 1024, 8, 128)
  int_shape = (1, 256, 2, 128) if quick else (1, 1024, 8, 128)
  total = (len(data.PASA_TABLE4_CASES) * 3 + len(SAGE_VARIANTS)
           + 2 * len(INT_VARIANTS))
  progress = _Progress(total)
  doc = dict(
      jax=jax.__version__, device=jax.devices()[0].device_kind,
      implementation=implementation,
      shapes=dict(pasa=pasa_shape, sage=sage_shape, int_flash=int_shape),
      pasa_table4=pasa_table4(pasa_shape, implementation, progress),
      sage_granularity=sage_granularity(sage_shape, implementation, progress),
      int_flash=int_flash(int_shape, implementation, progress),
  )
  stream.write(_table(
      f"PASA Table 4, shape (B,H,S,D)=({pasa_shape[0]},{pasa_shape[2]},"
      f"{pasa_shape[1]},{pasa_shape[3]}): NaN % and relative RMSE vs float64",
      doc["pasa_table4"],
      ["case", "paper_fp16_fp32_nan_pct", "fp16_fp32_nan_pct",
       "fp16_fp32_rel_rmse", "pasa_nan_pct", "pasa_rel_rmse",
       "fp32_rel_rmse"]))
  stream.write(_table(
      "SageAttention2 granularities on channel-outlier keys (vs float64)",
      doc["sage_granularity"], ["variant", "cos_sim", "rel_l1", "rmse"]))
  stream.write(_table(
      "INT-FlashAttention: mean relative error vs float64",
      doc["int_flash"], ["data", "variant", "mean_rel_err", "rel_rmse"]))
  stream.write("\n")
  return doc


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m jaxattn report",
                              description=__doc__.split("\n")[0])
  p.add_argument("--json", default="", help="write the numbers as JSON here")
  p.add_argument("--quick", action="store_true", help="small shapes")
  p.add_argument("--implementation", default="reference",
                 choices=["reference", "pallas"])
  a = p.parse_args(argv)
  doc = run(quick=a.quick, implementation=a.implementation)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(doc, f, indent=1, default=float)
    print(f"wrote {a.json}")
  return doc

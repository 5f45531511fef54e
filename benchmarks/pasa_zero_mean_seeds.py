"""PASA against fp16_fp32 at the x0 = 0 points of the PASA paper's Figures 9
and 10, over several draws of the inputs (docs/design.md, "PASA").

  python benchmarks/pasa_zero_mean_seeds.py OUT.json [SEEDS] [DIST ...]

(DIST: ``uniform`` and/or ``hybrid``; default both.)

At x0 = 0 the adaptive shift moves no key block, and PASA's default online
softmax (``online_softmax="running"``) is then fp16_fp32's arithmetic.  This
prints, per implementation and point, the ratio of PASA's relative RMSE to
fp16_fp32's (on fp16_fp32's finite rows) for each seed, the fraction of
output elements where the two differ, and the same ratio for Algorithm 1's
form of the softmax (``online_softmax="per_block"``), whose rounding order
differs.
"""
import json
import sys

import jax
import numpy as np

import jaxattn
from jaxattn import api, data, metrics

POINTS = (("uniform", 0.0, 0.5), ("hybrid", 0.0, 10.0))
SHAPE = (1, 1280, 16, 128)


def main(out_path, seeds=8, dists=None):
  unknown = set(dists or ()) - {p[0] for p in POINTS}
  if unknown:
    raise SystemExit(f"unknown DIST {sorted(unknown)}: uniform or hybrid")
  points = [p for p in POINTS if not dists or p[0] in dists]
  impls = (["mosaic", "triton"] if api.BACKENDS["mosaic"].native()
           else ["triton"] if api.BACKENDS["triton"].native()
           else ["reference"])
  rows = []
  for dist, x0, am in points:
    for seed in range(seeds):
      q, k, v = data.pasa_case(jax.random.key(seed),
                               dict(dist=dist, x0=x0, am=am), SHAPE)
      ref = np.asarray(metrics.exact_attention(q, k, v))
      for impl in impls:
        o16 = np.asarray(jaxattn.dot_product_attention(
            q, k, v, method="fp16_fp32", implementation=impl), np.float64)
        op, ob = (np.asarray(jaxattn.dot_product_attention(
            q, k, v, method="pasa", implementation=impl, online_softmax=form),
            np.float64) for form in ("running", "per_block"))
        keep = np.broadcast_to(np.isfinite(o16).all(-1, keepdims=True),
                               ref.shape)
        e16 = metrics.relative_rmse(o16[keep], ref[keep])
        ep = metrics.relative_rmse(op[keep], ref[keep])
        eb = metrics.relative_rmse(ob[keep], ref[keep])
        differ = float(np.mean(op != o16))
        rows.append(dict(dist=dist, x0=x0, am=am, seed=seed, impl=impl,
                         fp16_fp32=e16, pasa=ep, ratio=ep / e16,
                         differ_fraction=differ, per_block=eb,
                         per_block_ratio=eb / e16))
        print(f"{dist:7s} x0={x0} am={am} seed {seed} {impl:9s} "
              f"pasa {ep:.4e} fp16_fp32 {e16:.4e} ratio {ep / e16:.6f} "
              f"(outputs differ at {differ:.2e}); per_block ratio "
              f"{eb / e16:.5f}", flush=True)
  summary = {}
  for dist, x0, am in points:
    for impl in impls:
      for key in ("ratio", "per_block_ratio"):
        r = [x[key] for x in rows if x["dist"] == dist and x["impl"] == impl]
        summary[f"{dist} {impl} {key}"] = dict(
            min=min(r), mean=float(np.mean(r)), max=max(r),
            at_most_1=sum(x <= 1.0 for x in r), seeds=len(r))
        print(f"{dist:7s} {impl:9s} {key:15s} min {min(r):.6f} mean "
              f"{np.mean(r):.6f} max {max(r):.6f}; <= 1 in "
              f"{sum(x <= 1.0 for x in r)} of {len(r)}")
  meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
              shape="BTNH " + "x".join(map(str, SHAPE)))
  with open(out_path, "w") as f:
    json.dump(dict(meta=meta, summary=summary, rows=rows), f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "pasa_zero_mean_seeds.json",
       int(sys.argv[2]) if len(sys.argv) > 2 else 8, sys.argv[3:])

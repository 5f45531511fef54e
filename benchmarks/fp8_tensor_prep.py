"""A/B of fp8's per-head ("tensor") Q/K quantizer on the GPU: XLA's
quantizers (an amax pass, a quantizing pass and a non-finite pass per
tensor) against an XLA amax pass then one Pallas pass that quantizes and
flags (:func:`jaxattn.operands.fused_qk`, ``rows_operand(scale=...)``).

  python benchmarks/fp8_tensor_prep.py OUT.json [--shape B,S,N,D]

The whole of ``operands.quantized_operands("fp8")`` is jitted each way and
timed in three rounds of alternating order; the operands must be equal
bit for bit (float16 inputs with a NaN in one query row and one key).
"""
import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from jaxattn import api, operands  # noqa: E402
from jaxattn.tuning import time_call  # noqa: E402

FUSED = operands.fused_qk


def xla_only(method, *args, **kwargs):
  return None if method == "fp8" else FUSED(method, *args, **kwargs)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("out")
  ap.add_argument("--shape", default="2,8192,32,128")
  args = ap.parse_args()
  b, s, n, d = map(int, args.shape.split(","))
  keys = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(x, (b, s, n, d), jnp.float16) for x in keys)
  lens = jnp.full((b,), s, jnp.int32)
  cfg = api.config_for("fp8", "mosaic" if jax.default_backend() == "gpu"
                       else "triton")
  calls, outs = {}, {}
  for name, fused in (("xla", xla_only), ("pallas", FUSED)):
    operands.fused_qk = fused
    fn = jax.jit(lambda q, k, v, lens: operands.quantized_operands(
        "fp8", q, k, v, lens, scale=d ** -0.5, config=cfg))
    calls[name] = fn.lower(q, k, v, lens).compile()
    bad_q, bad_k = q.at[0, 5, 3, 7].set(jnp.nan), k.at[1, 9, 2, 0].set(
        jnp.inf)
    outs[name] = jax.tree.map(np.asarray, calls[name](bad_q, bad_k, v, lens))
  operands.fused_qk = FUSED
  same = {f: bool(np.array_equal(np.asarray(getattr(outs["xla"], f)).astype(
      np.float32), np.asarray(getattr(outs["pallas"], f)).astype(np.float32),
      equal_nan=True)) for f in ("q", "q_scale", "k", "k_scale", "v",
                                 "q_nonfinite", "kv_nonfinite")}
  print("bit-identical:", same, flush=True)
  rows = []
  names = list(calls)
  for rnd in range(3):
    for name in (names if rnd % 2 == 0 else names[::-1]):
      t = time_call(calls[name], (q, k, v, lens)) * 1e3
      rows.append(dict(round=rnd, path=name, ms=t))
      print(f"round {rnd} {name:8s} {t:.4f} ms", flush=True)
  with open(args.out, "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                   shape=args.shape, config=repr(cfg), same=same, rows=rows),
              f, indent=1)
  for name in names:
    ms = [r["ms"] for r in rows if r["path"] == name]
    print(f"{name:8s} {' '.join(f'{m:.4f}' for m in ms)} ms")


if __name__ == "__main__":
  main()

"""A/B of fp8's per-head ("tensor") Q/K quantizer on the GPU: XLA's
quantizers (an amax pass, a quantizing pass and a non-finite pass per
tensor) against an XLA amax pass then one Pallas pass that quantizes and
flags (:func:`jaxattn.operands.fused_qk`, ``rows_operand(scale=...)``).

  python benchmarks/fp8_tensor_prep.py OUT.json [--shape B,S,N,D]

The whole of ``operands.quantized_operands("fp8")`` is jitted each way and
timed in three rounds of alternating order; the operands must be equal
bit for bit (float16 inputs with a NaN in one query row and one key).
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
from jaxattn import api, operands  # noqa: E402
from jaxattn.tuning import (alternating_rounds, benchmark_args,  # noqa: E402
                            nonfinite_inputs, random_btnh, write_record)

FUSED = operands.fused_qk


def xla_only(method, *args, **kwargs):
  return None if method == "fp8" else FUSED(method, *args, **kwargs)


def main():
  args = benchmark_args()
  b, s, n, d = args.shape
  q, k, v = random_btnh(args.shape)
  lens = jnp.full((b,), s, jnp.int32)
  cfg = api.config_for("fp8", "mosaic" if jax.default_backend() == "gpu"
                       else "triton")
  calls, outs = {}, {}
  for name, fused in (("xla", xla_only), ("pallas", FUSED)):
    operands.fused_qk = fused
    fn = jax.jit(lambda q, k, v, lens: operands.quantized_operands(
        "fp8", q, k, v, lens, scale=d ** -0.5, config=cfg))
    calls[name] = fn.lower(q, k, v, lens).compile()
    bad_q, bad_k, _ = nonfinite_inputs(q, k, v)
    outs[name] = jax.tree.map(np.asarray, calls[name](bad_q, bad_k, v, lens))
  operands.fused_qk = FUSED
  same = {f: bool(np.array_equal(np.asarray(getattr(outs["xla"], f)).astype(
      np.float32), np.asarray(getattr(outs["pallas"], f)).astype(np.float32),
      equal_nan=True)) for f in ("q", "q_scale", "k", "k_scale", "v",
                                 "q_nonfinite", "kv_nonfinite")}
  print("bit-identical:", same, flush=True)
  timed = {name: (c, (q, k, v, lens)) for name, c in calls.items()}
  rows = alternating_rounds(timed, log=lambda m: print(m, flush=True))
  write_record(args.out, shape=args.shape, config=repr(cfg), same=same,
               rows=rows)


if __name__ == "__main__":
  main()

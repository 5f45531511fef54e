"""A/B of how the Mosaic kernel rounds integer P (full INT8's int8 P and
the 8-bit FMHA's uint8 P): float -> int conversions (``cvt``, the form
before 2026-11-26) or one float add rounded down
(``pallas_kernels.mosaic.ROUND_P_BY_ADD``).  End to end on the H100, in one
process against cuDNN bfloat16.

  python benchmarks/p_rounding.py OUT.json [--causal] [--shape B,S,N,D]

Each call is compiled ahead of time, then timed in three rounds of
alternating order; the two settings' outputs must be the same bits, on
ordinary inputs, on keys with a per-channel bias and outlier channels,
and with a NaN in one query row and an Inf in one key.
"""

import jax
import jax.numpy as jnp

from jaxattn import api, data, fmha, operands
from jaxattn.tuning import (api_calls_per_setting, benchmark_args,
                            nonfinite_inputs, random_btnh,
                            record_against_cudnn)
from pallas_kernels import mosaic

METHODS = [("int8", "int8", {}), ("fmha_int8", "fmha_int8", {}),
           ("int8_vblock", "int8", {"v_granularity": "block"})]
SETTINGS = (("cvt", False), ("add", True))


def main(out_path, causal, shape):
  b, s, h, d = shape
  q, k, v = random_btnh(shape)
  bad = nonfinite_inputs(q, k, v)
  inputs = [(q, k, v), data.channel_outlier(jax.random.key(1), shape), bad]
  calls, checks = api_calls_per_setting(
      mosaic, "ROUND_P_BY_ADD", SETTINGS, METHODS, inputs, causal=causal,
      log=lambda m: print(m, flush=True))
  for name, method, opts in METHODS:
    call = calls[f"{name}/add"][0]
    checks[name]["nan_rows_with_bad_input"] = int(
        jnp.isnan(call(*bad)).any(-1).sum())
  # what the FMHA adds around its kernel: its operands, and the output's
  # int8 quantization (over a float32 O, as the kernel writes)
  cfg = api.config_for("fmha_int8", "mosaic")
  calls["fmha_int8/operands"] = (jax.jit(
      lambda q, k, v: operands.fmha_operands(
          q, k, v, None, scale=d ** -0.5, config=cfg, block_k=cfg.block_k,
          v_key_order=mosaic.p_in_registers())).lower(q, k, v).compile(),
      (q, k, v))
  o32 = q.astype(jnp.float32)
  calls["fmha_int8/output"] = (jax.jit(
      lambda o: fmha.method_output(o, config=cfg).astype(q.dtype)).lower(
          o32).compile(), (o32,))
  record_against_cudnn(out_path, calls, (q, k, v), causal=causal,
                       checks=checks)


if __name__ == "__main__":
  a = benchmark_args(causal=True)
  main(a.out, a.causal, a.shape)

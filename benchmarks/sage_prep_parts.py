"""Where the sage method's pre-processing time goes on the GPU, at
2x8192x32x128 float16, Hopper defaults (sage2-8b, Mosaic backend):

  python benchmarks/sage_prep_parts.py OUT.json [--shape B,S,N,D]

Each part is jitted and timed alone, in two rounds of alternating order:
the whole of ``operands.quantized_operands("sage")``, its fused Q/K part
(``operands.fused_qk``), the means as XLA reductions, the Q pass given the
query-block means or taking each tile's own (``shift="tile_mean"``, what
``fused_qk`` runs since 2026-11-26), the K pass
(:func:`pallas_kernels.quantizers.rows_operand`), V's statistics and V's
8-bit pass (:func:`pallas_kernels.quantizers.v_operand`), and a float16 ->
int8 cast of one tensor (the bandwidth floor of a pass).
"""
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, ".")
from jaxattn import api, nonfinite, operands, sage  # noqa: E402
from jaxattn.tuning import (alternating_rounds, benchmark_args,  # noqa: E402
                            random_btnh, write_record)
from pallas_kernels import quantizers  # noqa: E402


def main():
  args = benchmark_args()
  b, s, n, d = args.shape
  q, k, v = random_btnh(args.shape)
  lens = jnp.full((b,), s, jnp.int32)
  impl = "mosaic" if jax.default_backend() == "gpu" else "triton"
  cfg = api.config_for("sage", impl)
  scale = d ** -0.5
  fin = nonfinite.finite
  q_mean, _ = operands._query_block_means(fin(q), cfg.block_q)
  k_mean = operands._key_mean(fin(k), lens)
  bias_q = (q_mean * sage.log2_scale(scale)).transpose(0, 2, 1, 3)
  stats = operands.sage_v_stats(fin(v), lens, cfg)
  parts = {
      "prep_total": lambda: operands.quantized_operands(
          "sage", q, k, v, lens, scale=scale, config=cfg),
      "fused_qk": lambda: operands.fused_qk("sage", q, k, lens, scale=scale,
                                            config=cfg),
      "q_block_means_xla": lambda: operands._query_block_means(
          fin(q), cfg.block_q),
      "k_mean": lambda: operands._key_mean(fin(k), lens),
      "q_pass_given_means": lambda: quantizers.rows_operand(
          q, lens, group=sage.q_group_rows(cfg, s), dtype=jnp.int8,
          shift=q_mean, block=cfg.block_q, flag_nonfinite=True),
      "q_pass_tile_means": lambda: quantizers.rows_operand(
          q, lens, group=sage.q_group_rows(cfg, s), dtype=jnp.int8,
          shift="tile_mean", block=cfg.block_q, flag_nonfinite=True),
      "k_pass_with_bias": lambda: quantizers.rows_operand(
          k, lens, group=sage.k_group_rows(cfg, s), dtype=jnp.int8,
          shift=k_mean[:, None], bias_q_mean=bias_q,
          block=max(128, sage.k_group_rows(cfg, s)), flag_nonfinite=True),
      "v_stats": lambda: operands.sage_v_stats(fin(v), lens, cfg),
      "v_pass": lambda: quantizers.v_operand(
          v, lens, dtype=jnp.float8_e4m3fn, shift=stats["v_mean"],
          inv_channel=1.0 / stats["v_scale"],
          inv_row=jnp.ones((b, n, s), jnp.float32), key_order=True,
          flag_nonfinite=True),
      "cast_floor": lambda: q.astype(jnp.int8),
  }
  calls = {}
  for name, fn in parts.items():
    calls[name] = jax.jit(fn).lower().compile()
  rows = alternating_rounds({n: (c, ()) for n, c in calls.items()},
                            rounds=2, log=lambda m: print(m, flush=True))
  write_record(args.out, shape=args.shape, config=repr(cfg), rows=rows)


if __name__ == "__main__":
  main()

"""Two changes to sage's pre-processing, on the GPU at 2x8192x32x128
float16 (Hopper defaults, sage2-8b on the Mosaic kernel):

* the Q pass (the query-block means of 128-row tiles, scales per 32 rows)
  quantizing its tile whole or a chunk of rows at a time after its mean
  (:data:`pallas_kernels.quantizers.CHUNK_ROWS`);
* V's sum, max and min per channel by XLA's column reduction or by
  :func:`pallas_kernels.quantizers.column_stats`
  (``operands.sage_v_stats(kernel=True)``).

  python benchmarks/sage_prep_ab.py OUT.json [--causal] [--shape B,S,N,D]

First the Q pass alone with each chunk and warp count, timed by the GPU
time of its kernels (:func:`jaxattn.tuning.device_ms`, the median of 5
calls) in two rounds of alternating order; then sage end to end with each
change's two settings, in three alternating rounds against cuDNN bfloat16.
The record holds whether each change's two settings give the same bits
end to end (on ordinary inputs and with a NaN and an Inf) and their largest
difference: on the GPU neither does, since both move a float32 sum's order
(the query-block means' in Triton's layout, V's mean), and with it the
rare quantized value.

(A first form of the Q/K kernel also chunked the key pass with the bias
and fp8 "block"'s groups of 128 rows, reading such a tile twice: both ran
slower, ``results/2026-11-27_h100_quantizer_chunks_all_passes.json``.)
"""
import functools

import jax
import jax.numpy as jnp

from jaxattn import nonfinite, operands
from jaxattn.tuning import (api_calls_per_setting, benchmark_args,
                            device_rounds, nonfinite_inputs, random_btnh,
                            record_against_cudnn)
from pallas_kernels import quantizers

METHODS = [("sage2-8b", "sage", {})]
# (chunk rows, warps) of the Q pass; 128 rows is the whole tile
KNOBS = ((128, 4), (64, 4), (64, 8), (32, 4), (32, 8))


def q_pass_times(q):
  b, s, n, d = q.shape
  lens = jnp.full((b,), s, jnp.int32)
  calls = {}
  for chunk, warps in KNOBS:
    fn = functools.partial(
        quantizers.rows_operand, lens=lens, group=32, dtype=jnp.int8,
        shift="tile_mean", block=128, chunk=chunk, num_warps=warps,
        flag_nonfinite=True)
    calls[f"sage_q_tile_mean_c{chunk}_w{warps}"] = (
        jax.jit(fn).lower(q).compile())
  return device_rounds(calls, (q,), log=lambda m: print(m, flush=True))


def _xla_v_stats(v, kv_lens, config, *, kernel=False):
  del kernel
  return _kernel_v_stats(nonfinite.finite(v), kv_lens, config)


_kernel_v_stats = operands.sage_v_stats


def main():
  args = benchmark_args(causal=True)
  q, k, v = random_btnh(args.shape)
  passes = q_pass_times(q)
  inputs = [(q, k, v), nonfinite_inputs(q, k, v)]
  log = lambda m: print(m, flush=True)
  calls, checks = {}, {}
  for module, attr, settings in (
      (operands, "sage_v_stats", (("v_stats_xla", _xla_v_stats),
                                  ("v_stats_kernel", _kernel_v_stats))),
      (quantizers, "CHUNK_ROWS", (("q_whole", 128), ("q_chunks", 64)))):
    c, ch = api_calls_per_setting(module, attr, settings, METHODS, inputs,
                                  causal=args.causal, log=log)
    calls.update(c)
    checks[attr] = ch
  record_against_cudnn(args.out, calls, (q, k, v), causal=args.causal,
                       checks=checks, q_pass=passes)


if __name__ == "__main__":
  main()

"""A/B of the Mosaic kernel's CTA shape (``MosaicParams.warpgroups``): one
warpgroup that issues its own loads, several CTAs per SM (SageAttention2's
sm90 shape), against a producer and two consumers in ping-pong, one CTA per
SM (FlashAttention-3's), end to end on the H100 in one process against cuDNN
bfloat16:

  python benchmarks/warpgroups.py OUT.json [--causal] [--shape B,S,N,D]
      [--methods fp8,sage,...] [--fused-exponent] [--no-prefetch]
      [--packed DOCS]

The setting moves ``pallas_kernels.mosaic.ONE_WARPGROUP_HEAD_DIMS`` and
``ONE_WARPGROUP_OPERANDS``: "one" gives every method one warpgroup at the
shape's head dim, "two" none; each method keeps its other defaults.
Each call is compiled ahead of time and timed in three rounds of
alternating order; ``checks`` say whether the two shapes give the same bits,
on ordinary inputs and with a NaN in one query row and an Inf in one key.
Diagnostics (not the defaults): ``--fused-exponent`` compiles only the
fused exponent (no run-time choice by the score bound; not safe for huge
scores), ``--no-prefetch`` loads the per-block values where they are used
(``PREFETCH_BLOCK_SCALES`` and ``EARLY_BLOCK_LOADS`` off).
``--packed DOCS`` packs each batch row with DOCS documents of random
lengths (``q_segment_ids``, the segment ids as the call's data), the
packed workload of ``benchmarks/index_mask.py``; use it with ``--causal``.
"""
import numpy as np

from jaxattn.tuning import (api_calls_per_setting, benchmark_args,
                            nonfinite_inputs, packed_segments, random_btnh,
                            record_against_cudnn)
from jaxattn.backends import mosaic as mosaic_backend
from pallas_kernels import mosaic

METHODS = {"fp32": ("fp32", {}), "fp32_bk64": ("fp32", {"block_k": 64}),
           "pasa": ("pasa", {}),
           "sage2-8b": ("sage", {}), "int8_full": ("int8", {}),
           "int8_half": ("int8", {"pv_dtype": "fp16"}),
           "fmha_int8": ("fmha_int8", {}), "fp8": ("fp8", {}),
           "fp8_bk128": ("fp8", {"block_k": 128})}


def main():
  args = benchmark_args(causal=True, extra=(
      ("--methods", dict(default=",".join(METHODS))),
      ("--fused-exponent", dict(action="store_true")),
      ("--no-prefetch", dict(action="store_true")),
      ("--packed", dict(type=int, default=0))))
  if args.fused_exponent:
    mosaic_backend._exact_when_needed = (
        lambda kernel, bound: kernel(exact_exponent=False))
  if args.no_prefetch:
    mosaic.PREFETCH_BLOCK_SCALES = mosaic.EARLY_BLOCK_LOADS = False
  q, k, v = random_btnh(args.shape)
  d = args.shape[3]
  every = {(a, b) for a in mosaic.QK_TYPES for b in mosaic.PV_TYPES}
  defaults = (mosaic.ONE_WARPGROUP_HEAD_DIMS, mosaic.ONE_WARPGROUP_OPERANDS)
  settings = (("one", ((d,), every)), ("two", ((), frozenset())))
  packed = {}
  if args.packed:
    packed["q_segment_ids"] = packed_segments(
        np.random.default_rng(0), q.shape[0], q.shape[1], args.packed)
  calls, checks = api_calls_per_setting(
      mosaic, ("ONE_WARPGROUP_HEAD_DIMS", "ONE_WARPGROUP_OPERANDS"), settings,
      [(n, METHODS[n][0], {**METHODS[n][1], **packed})
       for n in args.methods.split(",")],
      [(q, k, v), nonfinite_inputs(q, k, v)], causal=args.causal,
      log=lambda m: print(m, flush=True))
  mosaic.ONE_WARPGROUP_HEAD_DIMS, mosaic.ONE_WARPGROUP_OPERANDS = defaults
  record_against_cudnn(args.out, calls, (q, k, v), causal=args.causal,
                       checks=checks, fused_exponent=args.fused_exponent,
                       no_prefetch=args.no_prefetch, packed_docs=args.packed)


if __name__ == "__main__":
  main()

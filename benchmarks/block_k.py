"""A/B of the Mosaic kernel's key block, 128 against 256 keys, for the
methods with 8-bit K and V (only they fit 256-key blocks), end to end on the
H100 in one process against cuDNN bfloat16.

  python benchmarks/block_k.py OUT.json [--causal] [--shape B,S,N,D]
      [--methods fp8,int8_full,...] [--window W]

Each call is compiled ahead of time and timed in three rounds of
alternating order.  The causal run adds a packed call (8 documents of
random lengths a row, the segment ids passed as the call's data).  The
record holds each setting's error against float32 attention on the bench's
realistic inputs (``bench.accuracy_inputs``: keys with a per-channel bias
and outlier channels) and the two settings' largest difference on the timed
inputs.  ``--window W`` gives every call a W-key sliding window
(``local_window_size=(W - 1, 0)``), timed only.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import api, bench
from jaxattn.tuning import (benchmark_args, jit_with_array_options,
                            packed_segments, random_btnh,
                            record_against_cudnn)

METHODS = {"fp8": ("fp8", {}), "int8_full": ("int8", {}),
           "int8_vblock": ("int8", {"v_granularity": "block"}),
           "fmha_int8": ("fmha_int8", {}), "sage2-8b": ("sage", {}),
           "sage2-8b_no_smooth_q": ("sage", {"smooth_q": False})}
BLOCK_KS = (128, 256)


def main():
  args = benchmark_args(causal=True, extra=(
      ("--methods", dict(default="fp8,int8_full,fmha_int8")),
      ("--packed", dict(default="fp8", help="methods also timed packed "
                        "(causal runs only)")),
      ("--window", dict(type=int, default=0, help="every call with "
                        "local_window_size=(W - 1, 0)"))))
  shape = args.shape
  qkv = random_btnh(shape)
  acc_inputs = bench.accuracy_inputs((shape[0], shape[2], shape[1],
                                      shape[3]))
  segs = jnp.asarray(packed_segments(np.random.default_rng(0), shape[0],
                                     shape[1], 8))
  win = {"local_window_size": (args.window - 1, 0)} if args.window else {}
  variants = [(n, METHODS[n][0], dict(METHODS[n][1], **win))
              for n in args.methods.split(",")]
  if args.causal and args.packed:
    variants += [(f"packed_{n}", METHODS[n][0],
                  dict(METHODS[n][1], q_segment_ids=segs))
                 for n in args.packed.split(",")]
  calls, fields = {}, {"accuracy": {}, "max_abs_diff": {},
                       "window": args.window}
  for name, method, opts in variants:
    outs = []
    for bk in BLOCK_KS:
      fn, arrays = jit_with_array_options(functools.partial(
          api.dot_product_attention, is_causal=args.causal, method=method,
          implementation="mosaic"), dict(opts, block_k=bk))
      compiled = fn.lower(*qkv, arrays).compile()
      calls[f"{name}/{bk}"] = (compiled, (*qkv, arrays))
      outs.append(np.asarray(compiled(*qkv, arrays), np.float32))
      if not arrays and not win:
        acc = bench.accuracy(lambda q, k, v, fn=fn: fn(q, k, v, {}),
                             jnp.float16, acc_inputs, args.causal)
        fields["accuracy"][f"{name}/{bk}"] = acc
        print(f"{name}/{bk} accuracy {acc}", flush=True)
    diff = float(np.nanmax(np.abs(outs[0] - outs[1])))
    fields["max_abs_diff"][name] = diff
    print(f"{name}: 128 vs 256 max |diff| {diff:.3e}", flush=True)
  record_against_cudnn(args.out, calls, qkv, causal=args.causal, **fields)


if __name__ == "__main__":
  main()

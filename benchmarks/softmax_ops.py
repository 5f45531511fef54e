"""A/B of two forms of the Mosaic kernel's softmax, end to end on the H100
in one process against cuDNN bfloat16.

  python benchmarks/softmax_ops.py OUT.json [--causal] [--shape B,S,N,D]

* ``ROW_MAX_TREE`` (``pallas_kernels.mosaic``): the row max as a tree over
  column halves instead of two running chains per row (same bits; the
  record's ``checks`` compare the first two settings);
* ``EXP2_F16X2``: fp8 P's exponent on float16 pairs, one
  ``ex2.approx.f16x2`` per two scores (fp8 and sage2-8b only; it moves P,
  so the record holds each setting's error against float32 attention on
  the bench's realistic inputs, ``bench.accuracy_inputs``).

Settings in order: neither, the tree, the tree and float16 pairs.
"""
import functools

import jax
import jax.numpy as jnp

from jaxattn import api, bench
from jaxattn.tuning import (api_calls_per_setting, benchmark_args,
                            random_btnh, record_against_cudnn)
from pallas_kernels import mosaic

SWITCHES = ("ROW_MAX_TREE", "EXP2_F16X2")
SETTINGS = (("chains", (False, False)), ("tree", (True, False)),
            ("tree_f16x2", (True, True)))
METHODS = [("fp8", "fp8", {}), ("sage2-8b", "sage", {}),
           ("int8_full", "int8", {}), ("fp32", "fp32", {})]


def main():
  args = benchmark_args(causal=True)
  qkv = random_btnh(args.shape)
  acc_inputs = bench.accuracy_inputs(
      (args.shape[0], args.shape[2], args.shape[1], args.shape[3]))
  accuracy = {}
  for f16x2 in (False, True):
    mosaic.EXP2_F16X2 = f16x2
    jax.clear_caches()
    for name, method, opts in METHODS[:2]:
      fn = functools.partial(api.dot_product_attention, is_causal=args.causal,
                             method=method, implementation="mosaic", **opts)
      key = f"{name}/{'f16x2' if f16x2 else 'f32'}"
      accuracy[key] = bench.accuracy(fn, jnp.float16, acc_inputs, args.causal)
      print(f"{key} accuracy {accuracy[key]}", flush=True)
  calls, checks = api_calls_per_setting(
      mosaic, SWITCHES, SETTINGS, METHODS, [qkv], causal=args.causal,
      log=lambda m: print(m, flush=True))
  calls = {n: c for n, c in calls.items()   # (f16x2 moves fp8 P only)
           if not (n.endswith("tree_f16x2") and n.split("/")[0]
                   in ("int8_full", "fp32"))}
  for attr in SWITCHES:
    setattr(mosaic, attr, False)
  record_against_cudnn(args.out, calls, qkv, causal=args.causal,
                       checks=checks, accuracy=accuracy)


if __name__ == "__main__":
  main()

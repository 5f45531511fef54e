"""A/B of the Mosaic kernel's key block, 128 against 256 keys, for the
methods with 8-bit K and V (only they fit 256-key blocks), on the H100 in
one process against cuDNN bfloat16.

  python benchmarks/block_k.py OUT.json [--causal] [--shape B,S,N,D]

Each method runs end to end (``implementation="mosaic"``) and as its
kernel alone (operands prepared beforehand, as ``bench`` times it), in
three rounds of alternating order.  The record also holds each setting's
error against float32 attention on the bench's realistic inputs
(``bench.accuracy_inputs``: keys with a per-channel bias and outlier
channels) and the two settings' largest difference on the timed inputs.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import api, bench
from jaxattn.tuning import benchmark_args, random_btnh, record_against_cudnn

METHODS = [("fp8", "fp8", {}), ("sage2-8b", "sage", {}),
           ("int8_full", "int8", {}), ("fmha_int8", "fmha_int8", {})]
BLOCK_KS = (128, 256)


def main():
  args = benchmark_args(causal=True)
  qkv = random_btnh(args.shape)
  acc_inputs = bench.accuracy_inputs(
      (args.shape[0], args.shape[2], args.shape[1], args.shape[3]))
  calls, fields = {}, {"accuracy": {}, "max_abs_diff": {}}
  for name, method, opts in METHODS:
    outs = []
    for bk in BLOCK_KS:
      fn = functools.partial(
          api.dot_product_attention, is_causal=args.causal, method=method,
          implementation="mosaic", block_k=bk, **opts)
      compiled = jax.jit(fn).lower(*qkv).compile()
      calls[f"{name}/{bk}"] = (compiled, qkv)
      outs.append(np.asarray(compiled(*qkv), np.float32))
      acc = bench.accuracy(fn, jnp.float16, acc_inputs, args.causal)
      fields["accuracy"][f"{name}/{bk}"] = acc
      print(f"{name}/{bk} accuracy {acc}", flush=True)
      if method != "fmha_int8":   # (its kernel writes float32 for the
        variant = [(f"kernel_{name}", method, dict(opts, block_k=bk))]
        (setup,) = [s for n, s in bench.kernel_alone(
            args.causal, args.shape[-1], variant).items()
                    if n.endswith("_mosaic")]   # method's int8 output)
        kfn, kargs = setup(*qkv)
        calls[f"kernel_{name}/{bk}"] = (kfn.lower(*kargs).compile(), kargs)
    diff = float(np.nanmax(np.abs(outs[0] - outs[1])))
    fields["max_abs_diff"][name] = diff
    print(f"{name}: 128 vs 256 max |diff| {diff:.3e}", flush=True)
  record_against_cudnn(args.out, calls, qkv, causal=args.causal, **fields)


if __name__ == "__main__":
  main()

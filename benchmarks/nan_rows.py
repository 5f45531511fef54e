"""A/B of where the Mosaic methods write NaN into the rows a NaN/Inf input
reaches: in the kernel's epilogue (``nan_rows``) or by an XLA pass over the
output afterwards (``jaxattn.nonfinite.poison``, the form before
2026-11-26).  End to end on the H100, in one process against cuDNN
bfloat16.

  python benchmarks/nan_rows.py OUT.json [--causal] [--shape B,S,N,D]

The "after" setting wraps the kernel so that it drops ``nan_rows`` and
poisons its output in XLA.  Each call is compiled ahead of time, then timed
in three rounds of alternating order; the two settings' outputs must be the
same bits, on ordinary inputs and with a NaN in one query row and an Inf in
one key.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import api, nonfinite
from jaxattn.tuning import (alternating_rounds, benchmark_args,
                            cudnn_reference, random_btnh, write_record)
from pallas_kernels import mosaic

METHODS = [("sage", {}), ("fp8", {}), ("int8", {}), ("pasa", {})]
IN_KERNEL = mosaic.mosaic_attention


def after_kernel(*args, nan_rows=None, **kwargs):
  out = IN_KERNEL(*args, **kwargs)
  if nan_rows is None:
    return out
  if isinstance(out, tuple):
    return (nonfinite.poison(out[0], nan_rows), *out[1:])
  return nonfinite.poison(out, nan_rows)


def main(out_path, causal, shape):
  b, s, h, d = shape
  q, k, v = random_btnh(shape)
  bad = (q.at[0, 5, 3, 7].set(jnp.nan), k.at[1, 9, 2, 0].set(jnp.inf), v)
  reference = cudnn_reference(q, k, v, causal)
  calls, checks = {}, {}
  for method, opts in METHODS:
    outs = {}
    for setting, fn in (("after", after_kernel), ("in_kernel", IN_KERNEL)):
      mosaic.mosaic_attention = fn
      jax.clear_caches()   # the API's jit keeps the last trace otherwise
      call = jax.jit(lambda q, k, v, method=method, opts=opts:
                     api.dot_product_attention(
                         q, k, v, is_causal=causal, method=method,
                         implementation="mosaic", **opts))
      compiled = call.lower(q, k, v).compile()
      calls[f"{method}/{setting}"] = compiled
      outs[setting] = [np.asarray(compiled(*x), np.float32)
                       for x in ((q, k, v), bad)]
    mosaic.mosaic_attention = IN_KERNEL
    checks[method] = dict(
        same_bits=all(np.array_equal(a, c, equal_nan=True) for a, c in
                      zip(outs["after"], outs["in_kernel"])),
        nan_rows_with_bad_input=int(np.isnan(outs["in_kernel"][1]).any(
            -1).sum()))
    print(method, checks[method], flush=True)
  timed = {name: (c, (q, k, v)) for name, c in calls.items()}
  rows = alternating_rounds(timed, reference=reference,
                            log=lambda m: print(m, flush=True))
  write_record(out_path, causal=causal, shape=f"BTNH {b}x{s}x{h}x{d}",
               reference="cuDNN bf16", checks=checks, rows=rows)


if __name__ == "__main__":
  a = benchmark_args(causal=True)
  main(a.out, a.causal, a.shape)

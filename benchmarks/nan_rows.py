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

import jax.numpy as jnp

from jaxattn import nonfinite
from jaxattn.tuning import (api_calls_per_setting, benchmark_args,
                            nonfinite_inputs, random_btnh,
                            record_against_cudnn)
from pallas_kernels import mosaic

METHODS = [(m, m, {}) for m in ("sage", "fp8", "int8", "pasa")]
IN_KERNEL = mosaic.mosaic_attention


def after_kernel(*args, nan_rows=None, **kwargs):
  out = IN_KERNEL(*args, **kwargs)
  if nan_rows is None:
    return out
  if isinstance(out, tuple):
    return (nonfinite.poison(out[0], nan_rows), *out[1:])
  return nonfinite.poison(out, nan_rows)


def main(out_path, causal, shape):
  q, k, v = random_btnh(shape)
  bad = nonfinite_inputs(q, k, v)
  calls, checks = api_calls_per_setting(
      mosaic, "mosaic_attention",
      (("after", after_kernel), ("in_kernel", IN_KERNEL)), METHODS,
      [(q, k, v), bad], causal=causal, log=lambda m: print(m, flush=True))
  for name, _, _ in METHODS:
    checks[name]["nan_rows_with_bad_input"] = int(
        jnp.isnan(calls[f"{name}/in_kernel"][0](*bad)).any(-1).sum())
  record_against_cudnn(out_path, calls, (q, k, v), causal=causal,
                       checks=checks)


if __name__ == "__main__":
  a = benchmark_args(causal=True)
  main(a.out, a.causal, a.shape)

"""What the 8-bit FMHA's one output scale per tensor costs, causal and not:
the reference's error against float32 with its int8 output (the method)
and with the float output before that rounding (``fmha.method_output``
replaced by the identity, a measurement only), on N(0, 1) inputs.

    python benchmarks/fmha_output_scale.py [--shape B,S,N,D]
"""
import argparse

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import fmha, metrics


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--shape", default="1,4096,4,128")
  shape = tuple(int(x) for x in ap.parse_args().shape.split(","))
  q, k, v = (jax.random.normal(x, shape, jnp.float16)
             for x in jax.random.split(jax.random.key(0), 3))
  with_int8_output = fmha.method_output
  print(f"BTNH {'x'.join(map(str, shape))}, rel L2 against float32")
  for causal in (False, True):
    ref = jaxattn.dot_product_attention(
        *(x.astype(jnp.float32) for x in (q, k, v)), is_causal=causal)
    errs = []
    for output in (with_int8_output, lambda o, **kw: o.astype(jnp.float32)):
      fmha.method_output = output
      jax.clear_caches()
      out = jaxattn.dot_product_attention(
          q, k, v, method="fmha_int8", implementation="reference",
          is_causal=causal)
      errs.append(float(metrics.relative_rmse(out, ref)))
    fmha.method_output = with_int8_output
    first = float(jnp.abs(ref[:, :64]).max())
    late = float(jnp.abs(ref[:, shape[1] // 2:]).max())
    print(f"causal={causal}: int8 output {errs[0]:.3e}, float output "
          f"{errs[1]:.3e}; max|O| first 64 rows {first:.3f}, second half "
          f"{late:.3f}")


if __name__ == "__main__":
  main()

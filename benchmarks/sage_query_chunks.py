"""sage by chunks of query rows (``jaxattn.sage.BIAS_BYTES_LIMIT``) against
one call that holds the whole smoothing bias ``q_m K^T``: the compiled
call's temporary bytes, the outputs' largest difference, and the time end
to end in three alternating rounds against cuDNN bfloat16:

  python benchmarks/sage_query_chunks.py OUT.json [--causal] [--shape B,S,N,D]

(``--shape`` 1,65536,32,128 holds a 4.3 GB bias in one call.)
"""
import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import sage
from jaxattn.tuning import benchmark_args, random_btnh, record_against_cudnn


def main():
  args = benchmark_args(causal=True)
  q, k, v = random_btnh(args.shape)
  limit = sage.BIAS_BYTES_LIMIT
  calls, temp, outs = {}, {}, {}
  for name, bias_limit in (("chunks", limit), ("whole", 1 << 62)):
    sage.BIAS_BYTES_LIMIT = bias_limit    # read when the call is traced
    jax.clear_caches()                    # (the API's inner traces too)
    fn = jax.jit(lambda q, k, v: jaxattn.dot_product_attention(
        q, k, v, method="sage", is_causal=args.causal)).lower(
            q, k, v).compile()
    temp[name] = fn.memory_analysis().temp_size_in_bytes
    outs[name] = fn(q, k, v).astype(jnp.float32)
    calls[name] = (fn, (q, k, v))
  sage.BIAS_BYTES_LIMIT = limit
  rows = sage.query_chunk_rows(q, k, sage.SageConfig())
  diff = float(jnp.nanmax(jnp.abs(outs["chunks"] - outs["whole"])))
  print(f"chunk rows {rows}, temporary bytes {temp}, max |diff| {diff}",
        flush=True)
  record_against_cudnn(args.out, calls, (q, k, v), causal=args.causal,
                       chunk_rows=rows, temp_bytes=temp, max_abs_diff=diff)


if __name__ == "__main__":
  main()

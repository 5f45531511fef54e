"""The Mosaic kernel without its masked step (``kv_lens=None`` on a
non-causal call with whole key blocks) against the kernel given full key
lengths, with one and two warpgroups, kernels alone on prepared operands,
in alternating rounds against cuDNN bfloat16:

  MOSAIC_GPU_DUMP_PTXAS=1 python benchmarks/no_masked_step.py OUT.json
      [--shape B,S,N,D] [--methods sage2-8b,int8_half,fp8]

Sage and half-INT8 at D=64 with one warpgroup needed 168 registers without
the step and 206-210 with it, until the step compared constants
(docs/design.md, "The masked step's registers").  Checks that every
variant gives the first one's bits.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import api
from jaxattn.backends import mosaic as mosaic_backend
from jaxattn.tuning import benchmark_args, random_btnh, record_against_cudnn
from pallas_kernels import mosaic

METHODS = {"sage2-8b": ("sage", {}), "int8_half": ("int8", {"pv_dtype": "fp16"}),
           "fp8": ("fp8", {})}


def main():
  args = benchmark_args(extra=(
      ("--methods", dict(default="sage2-8b,int8_half")),))
  q, k, v = random_btnh(args.shape)
  d = args.shape[3]
  lens = jnp.full((q.shape[0],), k.shape[1], jnp.int32)
  calls, checks = {}, {}
  for name in args.methods.split(","):
    method, opts = METHODS[name]
    cfg = api.config_for(method, "mosaic", **opts)
    ops = jax.block_until_ready(jax.jit(functools.partial(
        mosaic_backend._prepare, method, scale=1 / math.sqrt(d),
        config=cfg))(q, k, v, lens))
    first = None
    for wgs in (1, 2):
      for key_lens in ("lens", "none"):
        fn = jax.jit(lambda ops, lens, wgs=wgs: mosaic.mosaic_attention(
            ops.q, ops.k, ops.v, lens, qk=ops.qk, pv=ops.pv, is_causal=False,
            params=mosaic.MosaicParams(block_k=cfg.block_k, warpgroups=wgs),
            q_scale=ops.q_scale, **mosaic_backend._k_scales(ops, cfg.block_k),
            q_block_bias=ops.q_block_bias, bias_rows=ops.bias_rows,
            v_block_scale=ops.v_block_scale, out_scale=ops.out_scale,
            out_shift=ops.out_shift, v_keys_ordered=ops.v_keys_ordered))
        a = (ops, lens if key_lens == "lens" else None)
        compiled = fn.lower(*a).compile()
        out = np.asarray(compiled(*a), np.float32)
        key = f"{name}/{wgs}wg_{key_lens}"
        calls[key] = (compiled, a)
        if first is None:
          first = out
        else:
          checks[key] = bool(np.array_equal(out, first, equal_nan=True))
          print(key, "same bits:", checks[key], flush=True)
  record_against_cudnn(args.out, calls, (q, k, v), causal=False,
                       checks=checks, note="kernels alone")


if __name__ == "__main__":
  main()

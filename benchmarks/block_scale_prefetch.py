"""A/B of when the Mosaic kernel loads a key block's K and V scales
(``k_block_scale``: fp8, sage2-8b; ``v_block_scale``: fp8 "block", INT8
with V per block), end to end on the H100 in one process against cuDNN
bfloat16:

  python benchmarks/block_scale_prefetch.py OUT.json [--causal]
      [--shape B,S,N,D]

``in_step``: each step loads its block's scalars from global memory at its
start.  ``ahead`` (``pallas_kernels.mosaic.PREFETCH_BLOCK_SCALES``): each
step loads the next block's and carries them into it.  The outputs must be
the same bits (on ordinary inputs and with a NaN and an Inf).
"""

from jaxattn.tuning import (api_calls_per_setting, benchmark_args,
                            nonfinite_inputs, random_btnh,
                            record_against_cudnn)
from pallas_kernels import mosaic

METHODS = [("fp8", "fp8", {}),
           ("fp8_block", "fp8", {"granularity": "block"}),
           ("int8_vblock", "int8", {"v_granularity": "block"}),
           ("sage2-8b", "sage", {})]


def main(out_path, causal, shape):
  q, k, v = random_btnh(shape)
  calls, checks = api_calls_per_setting(
      mosaic, "PREFETCH_BLOCK_SCALES", (("in_step", False), ("ahead", True)),
      METHODS, [(q, k, v), nonfinite_inputs(q, k, v)], causal=causal,
      log=lambda m: print(m, flush=True))
  record_against_cudnn(out_path, calls, (q, k, v), causal=causal,
                       checks=checks)


if __name__ == "__main__":
  a = benchmark_args(causal=True)
  main(a.out, a.causal, a.shape)

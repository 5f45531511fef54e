"""The calls an Nsight Compute profile of the packed workload compares: the
fp32 Mosaic kernel on 2x32x8192x128 float16, causal, unmasked and packed
(8 documents of random lengths per row, as ``benchmarks/index_mask.py``),
the packed tiles launched longest first and in the natural order; and the
packed fp8 call.  One launch of each, after its compile::

    ncu --clock-control none -k regex:"mosaic|anonymous" \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section WarpStateStats --section LaunchStats --metrics "$M" \\
        python benchmarks/profiles/packed_calls.py

with ``M`` these metrics joined by commas: ``sm__cycles_active.avg``,
``sm__cycles_elapsed.avg``, ``dram__bytes_read.sum``,
``lts__t_sector_hit_rate.pct``,
``smsp__average_warps_issue_stalled_{long_scoreboard,barrier,wait}_per_issue_active.ratio``
(three metrics) and ``smsp__issue_active.avg.pct_of_peak_sustained_active``

(the Mosaic kernels are named ``anonymous_mosaic_gpu_kernel``; without
the filter ncu profiles every XLA kernel of the setup too, for minutes).
The record ``results/2026-11-26_h100_packed_ncu.log`` profiled fp32 with
the fused exponent (before ``b885042``; the metric list is the one above).
"""
import jax
import numpy as np

from jaxattn import api
from jaxattn.tuning import packed_segments, random_btnh
from pallas_kernels import mosaic


shape = (2, 8192, 32, 128)
q, k, v = random_btnh(shape)
segs = packed_segments(np.random.default_rng(0), shape[0], shape[1], 8)
calls = [("fp32 causal", "fp32", {}, True),
         ("fp32 packed, longest first", "fp32", {"q_segment_ids": segs}, True),
         ("fp32 packed, natural order", "fp32", {"q_segment_ids": segs}, False),
         ("fp8 packed, longest first", "fp8", {"q_segment_ids": segs}, True)]
for name, method, opts, heaviest in calls:
  mosaic.HEAVIEST_FIRST = heaviest
  jax.clear_caches()
  fn = jax.jit(lambda q, k, v: api.dot_product_attention(
      q, k, v, is_causal=True, method=method, implementation="mosaic", **opts))
  compiled = fn.lower(q, k, v).compile()
  print(f"=== {name}", flush=True)
  jax.block_until_ready(compiled(q, k, v))
  print(f"=== end {name}", flush=True)
mosaic.HEAVIEST_FIRST = True

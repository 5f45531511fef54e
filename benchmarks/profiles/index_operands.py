"""What the Mosaic kernel's index operands cost outside the kernel: the
row bounds, the block ranges (with packed segment ids: their per-block
summaries), the longest-first tile table and each row's first and last
key, jitted alone, for the
2x8192 causal and packed calls of ``benchmarks/index_mask.py``:

    python benchmarks/profiles/index_operands.py

Prints each one's time (``jaxattn.tuning.time_call``: back-to-back calls,
as the benchmarks time the attention calls) and the kernels XLA launches
for it (the fusions, sorts and other ops of the optimized HLO's entry).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.tuning import packed_segments, time_call
from pallas_kernels import common, mosaic


b, t, bq, bk = 2, 8192, 64, 128
segs = packed_segments(np.random.default_rng(0), b, t, 8)
lens = jnp.full((b,), t, jnp.int32)


def operands(lens, segs):
  im = common.IndexMask(q_segments=segs, kv_segments=segs) if segs is not None \
      else None
  bounds, ranges, segments = common.index_operands(
      lens, im, t=t, s=t, is_causal=True, t_pad=t, s_pad=t, block_q=bq,
      block_k=bk, has_mask=False)
  return (mosaic.tile_table(ranges, heaviest_first=True),
          common.row_key_ranges(bounds, t_pad=t), segments)


for name, args in (("causal", (lens, None)), ("packed", (lens, segs))):
  compiled = jax.jit(operands).lower(*args).compile()
  hlo = compiled.as_text()
  entry = hlo[hlo.index("ENTRY"):]
  ops = re.findall(r"= .*? (fusion|sort|custom-call|copy|gather|scatter|"
                   r"reduce|concatenate|transpose)\(", entry)
  ms = time_call(compiled, args, iters=50) * 1e3
  print(f"{name}: {ms * 1e3:.1f} us per call, {len(ops)} kernels "
        f"({', '.join(sorted(set(ops)))})", flush=True)

"""The calls a per-instruction Nsight Compute profile (warp-state sampling
by SASS instruction) compares, on 2x32x8192x128 float16: the Mosaic fp8,
sage2-8b and full INT8 kernels alone (non-causal, operands prepared
beforehand, as ``bench`` times them), the fp32 kernel causal and packed
(8 documents per row, as ``benchmarks/index_mask.py``), and cuDNN's fp8
kernel.  One launch of each, after its compile; one ncu process per call
(``--only NAME``: ncu 2025.3 with the SourceCounters section segfaults as
the profiled program goes on after its first profiled kernel, having
written the report)::

    ncu --clock-control none -k regex:"anonymous|sdpa" -c 1 \\
        --section SourceCounters --section WarpStateStats \\
        --import-source no -o NAME \\
        python benchmarks/profiles/step_stalls.py --only NAME
    ncu -i NAME.ncu-rep --page source --csv --print-source sass > NAME.csv
    python benchmarks/profiles/step_stalls.py --summarize NAME.csv

with NAME one of ``kernel_fp8_mosaic``, ``kernel_sage2-8b_mosaic``,
``kernel_int8_full_mosaic``, ``fp32_causal``, ``fp32_packed``,
``cudnn_fp8``.

``--summarize`` reads the exported table and prints, per kernel, the
instructions with the most stalled samples and the share of each stall
reason by instruction kind (``BRA``, ``WARPGROUP``, ``MUFU``...), over the
whole kernel and over its hottest loop (the instructions that share the
execution count with the most samples: the consumers' unmasked step).
"""
import csv
import collections
import functools
import sys


def _number(x):
  try:
    return float(x.replace(",", ""))
  except (AttributeError, ValueError):
    return 0.0


def summarize(path, top=25):
  """Per kernel of the CSV that ``ncu --page source --csv`` writes (one
  header row per kernel), the instructions with the most stall samples
  and the samples per stall reason and opcode."""
  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  kernels, header, current = [], None, None
  for row in rows:
    if not row:
      continue
    if "Source" in row and any("Sampling" in c for c in row):
      header = row
      current = []
      kernels.append(current)
      continue
    if header is None or len(row) != len(header):
      continue
    current.append(dict(zip(header, row)))
  for n, instrs in enumerate(kernels):
    cols = list(instrs[0]) if instrs else []
    total_col = next((c for c in cols if "Sampling (All" in c), None)
    reason_cols = [c for c in cols
                   if c.startswith("stall_") and "Not Issued" not in c]
    print(f"=== kernel {n}: {len(instrs)} instructions; columns: "
          f"{total_col}, {len(reason_cols)} stall reasons")
    if total_col is None:
      print("   columns:", cols)
      continue
    total = sum(_number(i[total_col]) for i in instrs) or 1.0
    ranked = sorted(instrs, key=lambda i: -_number(i[total_col]))
    for i in ranked[:top]:
      reasons = sorted(((_number(i[c]), c) for c in reason_cols),
                       reverse=True)[:3]
      print(f"{_number(i[total_col]) / total:6.1%} {i.get('Address', ''):>6} "
            f"{i['Source'][:60]:60s} "
            + " ".join(f"{c}={v:.0f}" for v, c in reasons if v))
    print("   by reason and opcode (share of all samples):")
    _print_reasons(instrs, reason_cols, total)
    # The loop that holds most samples: the instructions that share the
    # execution count with the most samples (the consumers' unmasked step)
    by_count = collections.Counter()
    for i in instrs:
      by_count[i["Instructions Executed"]] += _number(i[total_col])
    count, _ = by_count.most_common(1)[0]
    loop = [i for i in instrs if i["Instructions Executed"] == count]
    in_loop = sum(_number(i[total_col]) for i in loop)
    print(f"   loop of {len(loop)} instructions executed {count} times: "
          f"{in_loop / total:.1%} of the samples; within it:")
    _print_reasons(loop, reason_cols, in_loop)


def _opcode(instr):
  words = instr["Source"].split()
  if not words:
    return "?"
  op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
  return op.split(".")[0]


def _print_reasons(instrs, reason_cols, total):
  """Each stall reason's share of ``total`` samples over ``instrs`` and its
  four largest opcodes."""
  by_op = collections.defaultdict(collections.Counter)
  for i in instrs:
    for c in reason_cols:
      by_op[_opcode(i)][c] += _number(i[c])
  reason_totals = collections.Counter()
  for counts in by_op.values():
    reason_totals.update(counts)
  for c, v in reason_totals.most_common(8):
    ops = sorted(((counts[c], op) for op, counts in by_op.items()),
                 reverse=True)[:4]
    print(f"   {c:28s} {v / total:6.1%}  "
          + ", ".join(f"{op} {x / total:.1%}" for x, op in ops if x))


def main(only=None):
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxattn import api, bench
  from jaxattn.tuning import packed_segments, random_btnh

  shape = (2, 8192, 32, 128)
  q, k, v = random_btnh(shape)
  lens = jnp.full((shape[0],), shape[1], jnp.int32)
  segs = packed_segments(np.random.default_rng(0), shape[0], shape[1], 8)
  variants = [v_ for v_ in bench.KERNEL_VARIANTS
              if v_[0] in ("kernel_fp8", "kernel_sage2-8b", "kernel_int8_full")]
  wanted = lambda name: only is None or name == only
  calls = []
  for name, setup in bench.kernel_alone(False, shape[-1], variants).items():
    if name.endswith("_mosaic") and wanted(name):
      calls.append((name, *setup(q, k, v)))
  for name, opts in (("fp32_causal", {}),
                     ("fp32_packed", {"q_segment_ids": segs})):
    fn = jax.jit(functools.partial(
        api.dot_product_attention, is_causal=True, method="fp32",
        implementation="mosaic", **opts))
    if wanted(name):
      calls.append((name, fn, (q, k, v)))
  if wanted("cudnn_fp8"):
    calls.append(("cudnn_fp8", jax.jit(functools.partial(
        bench.cudnn_fp8, is_causal=False)), (q, k, v)))
  del lens
  for name, fn, args in calls:
    compiled = fn.lower(*args).compile()
    print(f"=== {name}", flush=True)
    jax.block_until_ready(compiled(*args))
    print(f"=== end {name}", flush=True)


if __name__ == "__main__":
  if len(sys.argv) > 2 and sys.argv[1] == "--summarize":
    summarize(sys.argv[2])
  else:
    main(sys.argv[2] if len(sys.argv) > 2 and sys.argv[1] == "--only"
         else None)

"""Warp-state sampling per SASS instruction (Nsight Compute's
SourceCounters) of the Mosaic kernels and cuDNN's fp8 kernel, on
2x32x8192x128 float16: the Mosaic fp8, sage2-8b and full INT8 kernels
alone (non-causal, operands prepared beforehand, as ``bench`` times them),
the fp32 kernel causal and packed (8 documents of random lengths per
row), and cuDNN's fp8 kernel.  One launch of
each, after its compile, one ncu process per call (``--only NAME``): ncu
2025.3 with SourceCounters segfaults once the program goes on after the
profiled kernel, having written the report (for ``fp32_packed`` it
segfaulted before writing, rc 139)::

    ncu --clock-control none -k regex:"anonymous|sdpa" -c 1 \\
        --section SourceCounters --section WarpStateStats \\
        --import-source no -o NAME \\
        python benchmarks/stalls.py --only NAME
    ncu -i NAME.ncu-rep --page source --csv --print-source sass > NAME.csv
    python benchmarks/stalls.py --summarize NAME.csv \\
        [--parts fp8]

NAME is one of :data:`CALLS`.  ``--summarize`` reads the exported table (a
``Kernel Name`` row, then a header row and one row per instruction, for
each kernel) and prints the instructions with the most samples (addresses
as offsets from the kernel's first instruction), each stall reason's
largest shares by opcode over the kernel and over its hottest loop, and
with ``--parts fp8`` the loop's samples per part of the step
(:data:`FP8_STEP_PARTS`).
"""
import argparse
import collections
import csv
import functools

CALLS = ("kernel_fp8_mosaic", "kernel_sage2-8b_mosaic",
         "kernel_int8_full_mosaic", "fp32_causal", "fp32_packed",
         "cudnn_fp8")
SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
# The parts of the fp8 kernel's unmasked step, as SASS offsets from the
# kernel's first instruction, in the build profiled for
# ``results/2026-11-26_h100_step_stalls.log`` (other builds move them; read
# them off the loop's listing again).
FP8_STEP_PARTS = (
    ("QK issue", 0x6490, 0x6670),
    ("rendezvous after QK issue", 0x6680, 0x6680),
    ("wait for QK", 0x6690, 0x6690),
    ("row max and shuffles", 0x66A0, 0x6C20),
    ("scale and subtract (FFMA)", 0x6C30, 0x7090),
    ("ex2 and the row sum", 0x70A0, 0x78D0),
    ("a barrier wait, fp8 packing", 0x78E0, 0x7AF0),
    ("P's PRMT shuffle, PV issue", 0x7B00, 0x7DB0),
    ("wait for the next K", 0x7DC0, 0x7E90),
    ("wait for PV", 0x7EA0, 0x7EB0),
    ("O * alpha + P V", 0x7EC0, 0x8330),
)


def _number(text):
  return float(text.replace(",", "")) if text not in ("", "-") else 0.0


def _opcode(instr):
  words = instr["Source"].split()
  if not words:
    return "?"
  op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
  return op.split(".")[0]


def read_kernels(path):
  """``[(kernel name, [instruction rows as dicts])]`` of the CSV, each
  row with ``offset`` (from the kernel's first instruction) added."""
  with open(path, newline="") as f:
    rows = list(csv.reader(f))
  kernels, header = [], None
  for row in rows:
    if row[:1] == ["Kernel Name"]:
      kernels.append((row[1], []))
      header = None
    elif SAMPLES in row:
      header = row
    elif header is not None and len(row) == len(header):
      kernels[-1][1].append(dict(zip(header, row)))
  for _, instrs in kernels:
    base = int(instrs[0]["Address"], 16) if instrs else 0
    for i in instrs:
      i["offset"] = int(i["Address"], 16) - base
  return kernels


def _print_reasons(instrs, reason_cols, total, top=8):
  """The ``top`` stall reasons by share of ``total`` samples over
  ``instrs``, each with its four largest opcodes."""
  by_op = collections.defaultdict(collections.Counter)
  for i in instrs:
    for c in reason_cols:
      by_op[_opcode(i)][c] += _number(i[c])
  reason_totals = collections.Counter()
  for counts in by_op.values():
    reason_totals.update(counts)
  for c, v in reason_totals.most_common(top):
    ops = sorted(((counts[c], op) for op, counts in by_op.items()),
                 reverse=True)[:4]
    print(f"   {c:28s} {v / total:6.1%}  "
          + ", ".join(f"{op} {x / total:.1%}" for x, op in ops if x))


def hottest_loop(instrs):
  """The instructions from the first to the last address of those that
  share the execution count with the most samples: one loop, including
  its instructions that run one time fewer (a wait skipped on the last
  block)."""
  by_count = collections.Counter()
  for i in instrs:
    by_count[i[EXECUTED]] += _number(i[SAMPLES])
  count, _ = by_count.most_common(1)[0]
  offsets = [i["offset"] for i in instrs if i[EXECUTED] == count]
  return count, [i for i in instrs
                 if min(offsets) <= i["offset"] <= max(offsets)]


def summarize(path, parts=None, top=25):
  for name, instrs in read_kernels(path):
    reason_cols = [c for c in instrs[0]
                   if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(_number(i[SAMPLES]) for i in instrs) or 1.0
    print(f"=== {name}: {len(instrs)} instructions")
    for i in sorted(instrs, key=lambda i: -_number(i[SAMPLES]))[:top]:
      reasons = sorted(((_number(i[c]), c) for c in reason_cols),
                       reverse=True)[:3]
      print(f"{_number(i[SAMPLES]) / total:6.1%} {i['offset']:6x} "
            f"{i['Source'].strip()[:56]:56s} "
            + " ".join(f"{c}={v:.0f}" for v, c in reasons if v))
    print("   by reason and opcode (share of all samples):")
    _print_reasons(instrs, reason_cols, total)
    count, loop = hottest_loop(instrs)
    in_loop = sum(_number(i[SAMPLES]) for i in loop)
    print(f"   hottest loop: {len(loop)} instructions "
          f"({loop[0]['offset']:x}-{loop[-1]['offset']:x}, most executed "
          f"{count} times), {in_loop / total:.1%} of the samples; within it:")
    _print_reasons(loop, reason_cols, in_loop)
    for part, lo, hi in parts or ():
      mine = [i for i in loop if lo <= i["offset"] <= hi]
      print(f"   part {part:30s} {len(mine):4d} instructions "
            f"{sum(_number(i[SAMPLES]) for i in mine) / in_loop:6.1%}")


def run(only):
  """Compiles the calls (``only``: one of :data:`CALLS`, or all) and runs
  each once."""
  import jax
  import numpy as np

  import jax.numpy as jnp

  from jaxattn import api, bench

  shape = (2, 8192, 32, 128)
  q, k, v = (jax.random.normal(x, shape, jnp.float32).astype(jnp.float16)
             for x in jax.random.split(jax.random.key(0), 3))
  # 8 packed documents of random lengths per batch row
  rng = np.random.default_rng(0)
  segs = []
  for _ in range(shape[0]):
    cuts = np.sort(rng.choice(np.arange(1, shape[1]), 7, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [shape[1]]]))
    segs.append(np.repeat(np.arange(8), lengths))
  segs = jnp.asarray(np.stack(segs), jnp.int32)

  def wanted(name):
    return only is None or name == only

  kernels = [variant for variant in bench.KERNEL_VARIANTS
             if variant[0] in ("kernel_fp8", "kernel_sage2-8b",
                               "kernel_int8_full")]
  calls = []
  for name, setup in bench.kernel_alone(False, shape[-1], kernels).items():
    if name.endswith("_mosaic") and wanted(name):
      calls.append((name, *setup(q, k, v)))
  for name, opts in (("fp32_causal", {}),
                     ("fp32_packed", {"q_segment_ids": segs})):
    if wanted(name):
      calls.append((name, jax.jit(functools.partial(
          api.dot_product_attention, is_causal=True, method="fp32",
          implementation="mosaic", **opts)), (q, k, v)))
  if wanted("cudnn_fp8"):
    calls.append(("cudnn_fp8", jax.jit(functools.partial(
        bench.cudnn_fp8, is_causal=False)), (q, k, v)))
  for name, fn, args in calls:
    compiled = fn.lower(*args).compile()
    print(f"=== {name}", flush=True)
    jax.block_until_ready(compiled(*args))
    print(f"=== end {name}", flush=True)


if __name__ == "__main__":
  ap = argparse.ArgumentParser()
  group = ap.add_mutually_exclusive_group()
  group.add_argument("--only", choices=CALLS)
  group.add_argument("--summarize", metavar="CSV")
  ap.add_argument("--parts", choices=("fp8",))
  a = ap.parse_args()
  if a.summarize:
    summarize(a.summarize, FP8_STEP_PARTS if a.parts == "fp8" else None)
  else:
    run(a.only)

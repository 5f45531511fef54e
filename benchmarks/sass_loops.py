"""Instruction mix of each loop of a disassembled kernel (SASS).

    MOSAIC_GPU_DUMP_TO=dir MOSAIC_GPU_DUMP_PTX=1 python benchmarks/bench.py \
        --methods kernel_fp8_mosaic --no-accuracy --iters 1 --reps 1  # (GPU)
    ptxas -arch=sm_90a -O3 dir/anonymous_0.ptx -o k.cubin
    nvdisasm -c k.cubin > k.sass        # (triton ships nvdisasm)
    python benchmarks/sass_loops.py k.sass [more.sass ...]

A loop is the span from a label to a later branch back to it; nested
retry loops (barrier waits) show as loops too.  Prints each loop of 40 or
more instructions with its most frequent opcodes; ``docs/design.md`` used
it to find the PV accumulator zeroed every step (64 ``IMAD.MOV``).
"""
import collections
import re
import sys


def parse(path):
  """``(instructions, {label: index})`` of an ``nvdisasm -c`` listing."""
  ins, labels = [], {}
  for line in open(path).read().splitlines():
    m = re.match(r"^\s*(\.L_x_\d+):", line)
    if m:
      labels[m.group(1)] = len(ins)
      continue
    m = re.match(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
    if m:
      ins.append(m.group(2).strip())
  return ins, labels


def loops(path, min_size=40):
  """``[(start, end, size, Counter of opcodes)]``, one per backward branch."""
  ins, labels = parse(path)
  out = []
  for i, text in enumerate(ins):
    m = re.search(r"BRA\s+(?:`\()?(\.L_x_\d+)", text)
    if m and m.group(1) in labels and labels[m.group(1)] <= i:
      body = ins[labels[m.group(1)]:i + 1]
      if len(body) >= min_size:
        ops = collections.Counter(
            re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0]
            for x in body)
        out.append((labels[m.group(1)], i, len(body), ops))
  return out


def main(paths):
  for path in paths:
    print("==", path)
    for start, end, size, ops in loops(path):
      top = ", ".join(f"{k}:{v}" for k, v in ops.most_common(14))
      print(f"  loop [{start},{end}] n={size}: {top}")


if __name__ == "__main__":
  main(sys.argv[1:])

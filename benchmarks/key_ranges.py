"""A/B of how the Mosaic kernel masks a block, end to end on the H100 in
one process against cuDNN bfloat16, causal:

  git show REV:pallas_kernels/mosaic.py > /tmp/mosaic_before.py
  python benchmarks/key_ranges.py OUT.json --before /tmp/mosaic_before.py
      [--shape B,S,N,D]

``compare`` (the kernel module given by ``--before``): per score, a row
index, the row's four bounds (query length, key length, the window's or
the diagonal's two limits) and the segment ids.  ``ranges``: two compares
against each row's first and last key (``common.row_key_ranges``, computed
once per call) and the segment ids.  Packed rows (8 documents of random
lengths a row, ``q_segment_ids``) and plain causal calls (whose diagonal
blocks are masked).  The outputs must be the same bits (on ordinary inputs
and with a NaN and an Inf).
"""
import argparse
import importlib.util
import sys

import numpy as np

from jaxattn.tuning import (api_calls_per_setting, nonfinite_inputs,
                            packed_segments, random_btnh,
                            record_against_cudnn)
from pallas_kernels import mosaic


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("out")
  ap.add_argument("--before", required=True,
                  help="the kernel module to compare against (a path)")
  ap.add_argument("--shape", default="2,8192,32,128")
  a = ap.parse_args()
  shape = tuple(int(x) for x in a.shape.split(","))
  spec = importlib.util.spec_from_file_location("mosaic_before", a.before)
  before = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = before   # (its dataclasses look it up)
  spec.loader.exec_module(before)
  q, k, v = random_btnh(shape)
  segments = packed_segments(np.random.default_rng(0), shape[0], shape[1], 8)
  packed = dict(q_segment_ids=segments)
  methods = [("fp32_packed", "fp32", packed), ("fp8_packed", "fp8", packed),
             ("sage_packed", "sage", packed), ("fp32", "fp32", {}),
             ("fp8", "fp8", {})]
  calls, checks = api_calls_per_setting(
      mosaic, "mosaic_attention", (("compare", before.mosaic_attention),
                                   ("ranges", mosaic.mosaic_attention)),
      methods, [(q, k, v), nonfinite_inputs(q, k, v)], causal=True,
      log=lambda m: print(m, flush=True))
  record_against_cudnn(a.out, calls, (q, k, v), causal=True, checks=checks)


if __name__ == "__main__":
  main()

"""A/B of packed self-attention on the Mosaic kernel, end to end on the H100
in one process against cuDNN bfloat16:

  git show REV:pallas_kernels/mosaic.py > benchmarks/_mosaic_before.py
  python benchmarks/segment_runs.py OUT.json --before benchmarks/_mosaic_before.py
      [--causal] [--shape B,S,N,D]

``ids`` (the kernel module given by ``--before``): a masked block compares
each score's query and key segment ids, loading the key ids every masked
step.  ``runs``: where the ids are the same for queries and keys
(``kv_segment_ids`` left out) and every document is one run of positions
(``common.segment_runs``), each row's document is folded into its first
and last key and the masked blocks compare no ids.  Packed rows (8
documents of random lengths a row, ``q_segment_ids`` only, passed as the
jitted call's data: :func:`jaxattn.tuning.jit_with_array_options`), and a
plain call without segments as the control.  The outputs must be the same bits
(on ordinary inputs and with a NaN and an Inf).
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
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--shape", default="2,8192,32,128")
  ap.add_argument("--methods", default=None,
                  help="comma list of the rows to run (default all)")
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
             ("sage_packed", "sage", packed), ("int8_packed", "int8", packed),
             ("fp32", "fp32", {})]
  if a.methods:
    methods = [m for m in methods if m[0] in a.methods.split(",")]
  calls, checks = api_calls_per_setting(
      mosaic, "mosaic_attention", (("ids", before.mosaic_attention),
                                   ("runs", mosaic.mosaic_attention)),
      methods, [(q, k, v), nonfinite_inputs(q, k, v)], causal=a.causal,
      log=lambda m: print(m, flush=True))
  record_against_cudnn(a.out, calls, (q, k, v), causal=a.causal,
                       checks=checks)


if __name__ == "__main__":
  main()

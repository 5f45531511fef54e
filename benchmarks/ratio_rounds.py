"""End-to-end ratios to cuDNN bfloat16 of the methods as users call them
(``implementation=None``), in alternating rounds, non-causal and causal:
whether a ratio near a bar holds beyond one bench run's spread (the bench
times each call once).

  python benchmarks/ratio_rounds.py OUT.json [--rounds 5]
      [--shape B,S,N,D] [--methods int8_full,int8_half,fp8,...]

Each round times cuDNN bfloat16 first, then every method (the order
reversed every other round); the ratio of a round is cuDNN's time in that
round over the method's.  Prints the per-round ratios and their median per
method and mask.
"""
import statistics

import jax

from jaxattn import api, bench
from jaxattn.tuning import (alternating_rounds, benchmark_args,
                            cudnn_reference, random_btnh,
                            write_record)

# the bench's variants, named without its "jaxattn_" prefix
METHODS = {name.removeprefix("jaxattn_"): (method, opts)
           for name, method, opts in bench.JAXATTN_VARIANTS}


def main():
  a = benchmark_args(extra=(
      ("--rounds", dict(type=int, default=5)),
      ("--methods", dict(default="int8_full,int8_half,fp8,sage2-8b"))))
  shape = a.shape
  qkv = random_btnh(shape)
  log = lambda m: print(m, flush=True)
  rows, summary = [], {}
  for causal in (False, True):
    calls = {}
    for name in a.methods.split(","):
      method, opts = METHODS[name]
      fn = jax.jit(lambda q, k, v, method=method, opts=opts,
                   causal=causal: api.dot_product_attention(
                       q, k, v, is_causal=causal, method=method, **opts))
      calls[name] = (fn.lower(*qkv).compile(), qkv)
    for row in alternating_rounds(calls, rounds=a.rounds,
                                  reference=cudnn_reference(*qkv, causal),
                                  log=log):
      rows.append(dict(row, causal=causal))
    for name in calls:
      ratios = [r["ratio"] for r in rows
                if r["call"] == name and r["causal"] == causal]
      summary[f"{name} {'causal' if causal else 'non-causal'}"] = dict(
          median=statistics.median(ratios), low=min(ratios),
          high=max(ratios))
  log("\nmethod, mask: median ratio to cuDNN bf16 (lowest .. highest round)")
  for key, s in summary.items():
    log(f"{key:28s} {s['median']:.3f} ({s['low']:.3f} .. {s['high']:.3f})")
  b, s_len, h, d = shape
  write_record(a.out, shape=f"BTNH {b}x{s_len}x{h}x{d}", rounds=a.rounds,
               reference="cuDNN bf16", implementation=None, rows=rows,
               summary=summary)


if __name__ == "__main__":
  main()

"""What sharing quantization scales across packed documents costs.

A packed row (documents of random lengths, segment ids, causal) runs each
method once with its scales over the whole row (jaxattn's behaviour), and
each document alone (its own scales: what per-segment scales would give).
Both are compared with float32 attention per document: the relative L2
error over the row and the worst document's.  Two inputs:

* ``shared``: one ``data.channel_outlier`` draw for the row (the documents
  share the layer's statistics, keys with a per-channel bias);
* ``mixed``: as ``shared``, then each document's V and its keys' deviation
  from the bias scaled by its own factor, log-uniform in [1/8, 8].

Runs on the CPU with the reference implementations (bit-faithful to the
kernels); writes JSON to the directory given (default
``benchmarks/results``) and prints a table.

  python benchmarks/packed_scales.py [OUT_DIR]
"""
from __future__ import annotations

import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn
from jaxattn import data

S, N, D, DOCS = 2048, 4, 128, 8
# (label, method, options)
METHODS = (("sage", "sage", {}), ("int8", "int8", {}),
           ("int8 V/block", "int8", dict(v_granularity="block")),
           ("fp8", "fp8", {}), ("fp8 block", "fp8", dict(granularity="block")),
           ("fmha_int8", "fmha_int8", {}), ("pasa", "pasa", {}),
           ("fp16", "fp16", {}))


def documents(rng):
  cuts = np.sort(rng.choice(np.arange(16, S - 16), DOCS - 1, replace=False))
  return np.diff(np.concatenate([[0], cuts, [S]]))


def inputs(setting, lengths, seed):
  q, k, v = (np.array(x, np.float32) for x in data.channel_outlier(
      jax.random.key(seed), (1, S, N, D), jnp.float32))
  if setting == "mixed":
    rng = np.random.default_rng(seed + 1)
    bias = k.mean(axis=1, keepdims=True)
    start = 0
    for n in lengths:
      f = np.exp(rng.uniform(np.log(1 / 8), np.log(8)))
      sl = slice(start, start + n)
      k[:, sl] = bias + (k[:, sl] - bias) * f
      v[:, sl] *= np.exp(rng.uniform(np.log(1 / 8), np.log(8)))
      start += n
  return tuple(jnp.asarray(x, jnp.float16) for x in (q, k, v))


def rel_l2(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def run(method, q, k, v, **kw):
  return jaxattn.dot_product_attention(
      q, k, v, is_causal=True, method=method, implementation="reference",
      **kw)


def measure(setting, seed):
  lengths = documents(np.random.default_rng(seed))
  q, k, v = inputs(setting, lengths, seed)
  seg = jnp.asarray(np.repeat(np.arange(DOCS), lengths)[None], jnp.int32)
  bounds = np.concatenate([[0], np.cumsum(lengths)])
  docs = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
  truth = [run("fp32", *(x[:, d].astype(jnp.float32) for x in (q, k, v)))
           for d in docs]
  rows = []
  for label, method, options in METHODS:
    packed = run(method, q, k, v, q_segment_ids=seg, **options)
    alone = [run(method, q[:, d], k[:, d], v[:, d], **options) for d in docs]
    err_packed = [rel_l2(packed[:, d], t) for d, t in zip(docs, truth)]
    err_alone = [rel_l2(a, t) for a, t in zip(alone, truth)]
    cat = lambda xs: np.concatenate([np.asarray(x, np.float64) for x in xs],
                                    axis=1)
    rows.append(dict(
        setting=setting, seed=seed, method=label,
        lengths=[int(n) for n in lengths],
        packed_rel_l2=rel_l2(packed, cat(truth)),
        alone_rel_l2=rel_l2(cat(alone), cat(truth)),
        packed_worst_doc=max(err_packed), alone_worst_doc=max(err_alone)))
  return rows


def main(out_dir="benchmarks/results"):
  rows = [r for setting in ("shared", "mixed") for seed in (0, 1)
          for r in measure(setting, seed)]
  stamp = datetime.date.today().isoformat()
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, f"{stamp}_cpu_packed_scales.json")
  with open(path, "w") as f:
    json.dump(dict(shape=dict(S=S, N=N, D=D, docs=DOCS),
                   jax=jax.__version__, rows=rows), f, indent=1)
  print(f"{'setting':8} {'seed':4} {'method':12} {'packed':>9} {'alone':>9} "
        f"{'packed worst doc':>17} {'alone worst doc':>16}")
  for r in rows:
    print(f"{r['setting']:8} {r['seed']:<4} {r['method']:12} "
          f"{r['packed_rel_l2']:9.2e} {r['alone_rel_l2']:9.2e} "
          f"{r['packed_worst_doc']:17.2e} {r['alone_worst_doc']:16.2e}")
  print("wrote", path)


if __name__ == "__main__":
  main(*sys.argv[1:])

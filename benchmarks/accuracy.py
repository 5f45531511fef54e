"""Error against float32 attention of jaxattn's quantized methods (both GPU
backends) and of SageAttention 1.0.6's Triton kernels, on the same float16
inputs, on the GPU:

    python3 benchmarks/accuracy.py [B H S D]     (default 1 8 8192 128)

Two inputs: N(0, 1) Q, K, V, and the same with a channel offset on K (every
key shares a per-channel bias of std 8, the "channel outlier" keys that
SageAttention's smoothing of K is for).  Ground truth: float32 attention at
``precision="highest"``.  Prints cosine similarity, relative L1 and RMSE per
method; ``--json F`` also writes them.  The SageAttention peer needs its wheel
(``.whl/``, installed to ``/tmp/site`` as in ``benchmarks/run_gpu.sh``).
"""
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn
from jaxattn import api, bench, metrics

# (name, method, options): float16-in fp32 and the benchmark's quantized
# variants (jaxattn.bench.KERNEL_VARIANTS)
METHODS = [("fp32", "fp32", {})] + [
    (name.removeprefix("kernel_"), method, opts)
    for name, method, opts in bench.KERNEL_VARIANTS]


def inputs(shape, outliers, seed=0):
  b, h, s, d = shape
  kq, kk, kv, ko = jax.random.split(jax.random.key(seed), 4)
  q, k, v = (jax.random.normal(x, (b, s, h, d), jnp.float32)
             for x in (kq, kk, kv))
  if outliers:
    k = k + 8.0 * jax.random.normal(ko, (1, 1, h, d), jnp.float32)
  return [x.astype(jnp.float16) for x in (q, k, v)]


def sageattention_out(q, k, v):
  import torch
  from sageattention import sageattn
  t = [torch.from_numpy(np.asarray(x.astype(jnp.float32))).cuda().half()
       for x in (q, k, v)]
  return sageattn(*t, tensor_layout="NHD", is_causal=False).float().cpu(
  ).numpy()


def show(r):
  if "error" in r:
    print(f"{r['inputs']:17s} {r['method']:20s} {r['impl']:15s} "
          f"ERROR {r['error']}", flush=True)
  else:
    print(f"{r['inputs']:17s} {r['method']:20s} {r['impl']:15s} "
          f"{r['cos_sim']:9.6f} {r['rel_l1']:9.2e} {r['rmse']:9.2e}",
          flush=True)


def main(argv):
  out_json = None
  if "--json" in argv:
    i = argv.index("--json")
    out_json = argv[i + 1]
    argv = argv[:i] + argv[i + 2:]
  shape = tuple(int(x) for x in argv) if argv else (1, 8, 8192, 128)
  impls = ["triton"] + (["mosaic"] if api.BACKENDS["mosaic"].native() else [])
  rows = []
  for outliers in (False, True):
    q, k, v = inputs(shape, outliers)
    with jax.default_matmul_precision("highest"):
      ref = np.asarray(jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, implementation="xla"))(*(x.astype(jnp.float32)
                                            for x in (q, k, v))))
    label = "K channel offset" if outliers else "N(0,1)"
    for name, method, opts in METHODS:
      for impl in impls:
        try:
          out = jax.jit(lambda q, k, v: jaxattn.dot_product_attention(
              q, k, v, method=method, implementation=impl, **opts))(q, k, v)
          rows.append(dict(inputs=label, method=name, impl=impl,
                           **metrics.summary(out, ref)))
        except Exception as e:  # noqa: BLE001  (a variant without a kernel)
          rows.append(dict(inputs=label, method=name, impl=impl,
                           error=f"{type(e).__name__}: {str(e)[:120]}"))
        show(rows[-1])
    try:
      rows.append(dict(inputs=label, method="SageAttention 1.0.6",
                       impl="triton (torch)",
                       **metrics.summary(sageattention_out(q, k, v), ref)))
    except Exception as e:  # noqa: BLE001
      rows.append(dict(inputs=label, method="SageAttention 1.0.6",
                       impl="triton (torch)", error=str(e)[:120]))
    show(rows[-1])
  print(f"shape B H S D = {shape}, float16 inputs, error vs float32")
  print(f"{'inputs':17s} {'method':20s} {'impl':15s} {'cos_sim':>9s} "
        f"{'rel_l1':>9s} {'rmse':>9s}")
  for r in rows:
    show(r)
  if out_json:
    with open(out_json, "w") as f:
      json.dump(dict(shape=shape, rows=rows), f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1:])

"""``python -m jaxattn bench --grid``: the shapes models run, every method
against cuDNN bf16 in one process (GPU).

The grid (:data:`GRID`, ``B x S x N/K x D``):

* LLM prefill at a budget of 8k tokens per call (``B = 8192 / S``, at
  least 1): S = 512, 1k, 2k, 4k, 8k, 32k; 32 query / 8 KV heads, D = 128,
  causal; and the same 4 x 2048 with 32 KV heads (multi-head);
* diffusion transformers, not causal, D = 64: image 2 x 4096 x 24,
  video 1 x 17776 x 48;
* long sequences: 2 x 8192 x 32 x 128 (and causal), 1 x 32768 x 16 x 128
  (and causal), 4 x 8192 x 32 x 64.

Rows: ``cudnn_bf16`` (the reference of every ratio), ``cudnn_fp8`` (cuDNN's
fp8 attention after XLA's per-tensor quantization), SageAttention2's own
``sageattn`` (torch, where ``import sageattention`` works), and jaxattn's
methods end to end from float16 inputs with ``implementation=None``.  Each
row records ``ms`` (host-timed, back-to-back calls), ``device_ms`` (one
call's period on the GPU, jax's profiler), the ratios to cuDNN bf16, and
``first_call_s``: trace, compile and the first run of a fresh jitted call.

``--timeline``: for each quantized method at 4 x 2048 x 32 x 128 causal,
the kernels of one call with their GPU time and the idle gaps between
them.  ``--accuracy``: sage's and SageAttention2's error against float32
on inputs with real-model structure (:func:`jaxattn.data.channel_outlier`)
at 1 x 8192 x 16 x 128.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
import traceback
import warnings

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import bench, data, metrics
from jaxattn.timing import device_kernels, device_period_ms, split_calls
from jaxattn.timing import time_call
from pallas_kernels import common

TOKENS_PER_CALL = 8192


def _llm(s):
  return dict(name=f"llm_{s // 1024}k" if s >= 1024 else f"llm_{s}",
              b=max(1, TOKENS_PER_CALL // s), s=s, n=32, k=8, d=128,
              causal=True)


GRID = ([_llm(s) for s in (512, 1024, 2048, 4096, 8192, 32768)] + [
    dict(name="llm_2k_mha", b=4, s=2048, n=32, k=32, d=128, causal=True),
    dict(name="dit_image", b=2, s=4096, n=24, k=24, d=64, causal=False),
    dict(name="dit_video", b=1, s=17776, n=48, k=48, d=64, causal=False),
    dict(name="long_2x8k", b=2, s=8192, n=32, k=32, d=128, causal=False),
    dict(name="long_2x8k_causal", b=2, s=8192, n=32, k=32, d=128,
         causal=True),
    dict(name="long_32k", b=1, s=32768, n=16, k=16, d=128, causal=False),
    dict(name="long_32k_causal", b=1, s=32768, n=16, k=16, d=128,
         causal=True),
    dict(name="long_4x8k_d64", b=4, s=8192, n=32, k=32, d=64, causal=False),
])
METHODS = ("fp32", "pasa", "sage", "int8", "fp8", "fmha_int8")
QUANTIZED = ("sage", "int8", "fp8", "fmha_int8")
TIMELINE_SHAPE = dict(name="llm_2k_mha", b=4, s=2048, n=32, k=32, d=128,
                      causal=True)


def _inputs(p, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  shapes = [(p["b"], p["s"], p["n"], p["d"])] + [(p["b"], p["s"], p["k"],
                                                    p["d"])] * 2
  return [jax.random.normal(k, sh, jnp.float32).astype(dtype)
          for k, sh in zip(keys, shapes)]


def jax_rows(p):
  """name -> (input dtype, function of q, k, v)."""
  causal = p["causal"]
  rows = {"cudnn_bf16": (jnp.bfloat16, lambda q, k, v: (
      jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                   implementation="cudnn")))}
  rows["cudnn_fp8"] = (jnp.float16, lambda q, k, v: bench.cudnn_fp8(
      q, k, v, is_causal=causal))
  for m in METHODS:
    rows[m] = (jnp.float16, lambda q, k, v, m=m: (
        jaxattn.dot_product_attention(q, k, v, is_causal=causal, method=m)))
  return rows


@contextlib.contextmanager
def _recorded(out, name, log):
  """Runs the block; an exception in it becomes ``out[name] = {"error":
  ...}`` with its traceback in ``log`` (one row's failure must not stop
  the run)."""
  try:
    yield
  except Exception as e:  # noqa: BLE001
    out[name] = dict(error=f"{type(e).__name__}: {e}"[:400])
    log.write(traceback.format_exc())


def _sageattention():
  """SageAttention2's ``sageattn`` (torch), or None where it does not
  import."""
  try:
    from sageattention import sageattn
    return sageattn
  except Exception:  # noqa: BLE001
    return None


def run_point(p, iters, reps, log):
  rows = {}
  inputs = {}
  for name, (dtype, fn) in jax_rows(p).items():
    with _recorded(rows, name, log):
      if dtype not in inputs:
        inputs[dtype] = jax.block_until_ready(_inputs(p, dtype))
      args = inputs[dtype]
      f = jax.jit(fn)
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      first = time.perf_counter() - t0
      t = time_call(f, args, iters, reps)
      rows[name] = dict(ms=t * 1e3, first_call_s=first,
                        device_ms=device_period_ms(f, args))
  sageattn = _sageattention()
  if sageattn is not None:
    with _recorded(rows, "sageattention2", log):
      import torch
      import triton.testing
      q, k, v = (torch.randn(*x.shape, device="cuda", dtype=torch.float16)
                 for x in _inputs(p, jnp.float16))
      fn = lambda: sageattn(q, k, v, tensor_layout="NHD",   # noqa: E731
                            is_causal=p["causal"])
      ms = triton.testing.do_bench(fn, warmup=50, rep=300,
                                   return_mode="median")
      rows["sageattention2"] = dict(ms=ms)
      del q, k, v
  ref = rows.get("cudnn_bf16", {})
  for r in rows.values():
    if ref.get("ms") and r.get("ms"):
      r["ratio"] = ref["ms"] / r["ms"]
    if ref.get("device_ms") and r.get("device_ms"):
      r["device_ratio"] = ref["device_ms"] / r["device_ms"]
  return rows


def timeline(p, log):
  """Per quantized method: the kernels of one call at ``p``, their GPU
  time, and the idle time between the first's start and the last's end."""
  out = {}
  args = jax.block_until_ready(_inputs(p, jnp.float16))
  for m in QUANTIZED:
    with _recorded(out, m, log):
      f = jax.jit(lambda q, k, v, m=m: jaxattn.dot_product_attention(
          q, k, v, is_causal=p["causal"], method=m))
      calls = split_calls(device_kernels(f, args, calls=5), 5)
      if calls is None:
        out[m] = dict(error="the calls' kernels did not split evenly")
        continue
      call = calls[-1]
      busy = sum(k[2] for k in call) / 1e3
      span = (call[-1][1] + call[-1][2] - call[0][1]) / 1e3
      out[m] = dict(kernels=len(call), busy_us=busy, span_us=span,
                    idle_us=span - busy,
                    list=[(k[0][:60], k[2] / 1e3) for k in call])
  return out


def accuracy(log, shape=(1, 8192, 16, 128)):
  """cos and relative L2 against float32 of sage (and SageAttention2) on
  :func:`jaxattn.data.channel_outlier` inputs (keys with a per-channel
  bias and outlier channels)."""
  q, k, v = data.channel_outlier(jax.random.key(1), shape, jnp.float32)
  ref = bench.accuracy_reference((q, k, v), False)
  out = {}
  fns = {"sage": lambda a, b, c: jaxattn.dot_product_attention(
      a, b, c, method="sage")}
  for m in ("fp8", "int8"):
    fns[m] = lambda a, b, c, m=m: jaxattn.dot_product_attention(
        a, b, c, method=m)
  for name, fn in fns.items():
    with _recorded(out, name, log):
      out[name] = bench.accuracy(fn, jnp.float16, (q, k, v), False, ref=ref)
  sageattn = _sageattention()
  if sageattn is not None:
    with _recorded(out, "sageattention2", log):
      job = lambda a, b, c: sageattn(a, b, c, tensor_layout="NHD")  # noqa
      out["sageattention2"] = bench.accuracy(bench._torch_fn(job),
                                             jnp.float16, (q, k, v), False,
                                             ref=ref)
  return {n: r if "error" in r else {k: float(v) for k, v in r.items()}
          for n, r in out.items()}


def table(doc):
  """The short table: per point, each row's ratio to cuDNN bf16."""
  names = ["cudnn_fp8", "sageattention2", *METHODS]
  lines = ["point".ljust(18) + "cudnn_ms " + " ".join(n[:9].rjust(9)
                                                   for n in names)]
  for point, rows in doc["points"].items():
    ref = rows.get("cudnn_bf16", {}).get("ms")
    cells = [f"{rows.get(n, {}).get('ratio', float('nan')):9.2f}"
             for n in names]
    lines.append(point.ljust(18) + (f"{ref:8.3f} " if ref else "    ---  ")
                 + " ".join(cells))
  return "\n".join(lines)


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m jaxattn bench --grid",
                              description=__doc__.split("\n")[0])
  p.add_argument("--points", default="", help="comma list of grid names")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--timeline", action="store_true")
  p.add_argument("--accuracy", action="store_true")
  p.add_argument("--budget-s", type=float, default=1e9,
                 help="skip the points left once this much time passed")
  p.add_argument("--out", default="")
  p.add_argument("--log", default=os.devnull)
  a = p.parse_args(argv)
  if not common.has_gpu():
    print(bench.NO_GPU_MESSAGE.format(devices="cpu"), file=sys.stderr)
    raise SystemExit(bench.NO_GPU_EXIT_CODE)
  warnings.filterwarnings("ignore", category=DeprecationWarning)
  wanted = [n for n in a.points.split(",") if n]
  points = [g for g in GRID if not wanted or g["name"] in wanted]
  dev = jax.devices()[0]
  doc = dict(meta=dict(device=getattr(dev, "device_kind", str(dev)),
                       jax=jax.__version__,
                       date=datetime.datetime.now().isoformat(),
                       tokens_per_call=TOKENS_PER_CALL),
             grid=points, points={})
  start = time.time()

  def save():
    if a.out:
      os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
      with open(a.out, "w") as f:
        json.dump(doc, f, indent=1, default=str)

  with open(a.log, "a") as log:
    for g in points:
      if time.time() - start > a.budget_s:
        doc["points"][g["name"]] = {"skipped": "budget"}
        continue
      doc["points"][g["name"]] = run_point(g, a.iters, a.reps, log)
      print(g["name"], {n: round(r.get("ratio", float("nan")), 3)
                        for n, r in doc["points"][g["name"]].items()},
            flush=True)
      save()
    if a.timeline:
      doc["timeline"] = dict(point=TIMELINE_SHAPE,
                             methods=timeline(TIMELINE_SHAPE, log))
      save()
    if a.accuracy:
      doc["accuracy"] = accuracy(log)
      save()
  print(table(doc))
  if a.timeline:
    for m, r in doc["timeline"]["methods"].items():
      print(f"timeline {m:10s} " + (
          f"{r['kernels']} kernels, busy {r['busy_us']:.1f} us, idle "
          f"{r['idle_us']:.1f} us" if "kernels" in r else r["error"]))
  if a.accuracy:
    for m, r in doc["accuracy"].items():
      print(f"accuracy {m:14s} {r}")
  return doc


if __name__ == "__main__":
  main()

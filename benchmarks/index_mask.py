"""Packed sequences and a sliding window, computed from indices in the
kernels, against the same kernels unmasked and against cuDNN.

Two workloads (bfloat16/float16 inputs, causal):

* ``packed``: B x S = 2 x 8192, 32 heads of 128, each row 8 documents of
  random lengths summing to 8192 (``q_segment_ids``);
* ``window``: 1 x 32768, 32 heads of 128, a 4096-key window
  (``local_window_size=(4095, 0)``), with cuDNN's sliding window as the
  peer.

For each method: the time, and its throughput on the work it does, the
FLOPs of the 128 x 128 tiles that some score of is visible
(``4 D`` per score), relative to the same method's throughput on the
unmasked causal call of the same shape (the issue's bar: at least 0.95).
For the methods with a quantizer (two stages), the kernels alone as well,
on operands prepared beforehand: the quantizers read every row whatever
the mask, so end to end they weigh on the masked call's efficiency.

    python benchmarks/index_mask.py [--methods fp32,sage,...] [--out F.json]
"""
from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, ".")
import jaxattn  # noqa: E402
from jaxattn.tuning import (jit_with_array_options,  # noqa: E402
                            packed_segments, time_call)
from pallas_kernels import common  # noqa: E402

TILE = 128
METHODS = ("fp32", "fp16_fp32", "pasa", "sage", "int8", "fp8")


def visible_tile_flops(b, n, t, s, d, *, is_causal, index_mask=None):
  """FLOPs (``4 d`` per score) of the ``TILE x TILE`` tiles with a visible
  score: the work a kernel that skips hidden tiles must do."""
  im = index_mask or common.IndexMask()
  bounds = common.row_bounds(jnp.full((b,), s, jnp.int32), im, t=t,
                             is_causal=is_causal)
  ranges = np.asarray(common.block_ranges(
      bounds, im.q_segments, im.kv_segments, n_row_blocks=-(-t // TILE),
      block_r=TILE, block_c=TILE, has_mask=False))
  # (block_ranges is exact for sorted segment ids and a band)
  tiles = int((ranges[..., 3] - ranges[..., 0]).sum())
  return 4.0 * d * tiles * TILE * TILE * n


def workloads(rng):
  segs = packed_segments(rng, 2, 8192, 8)
  return {
      "packed": dict(shape=(2, 8192, 32, 128), kw=dict(q_segment_ids=segs),
                     index_mask=common.IndexMask(q_segments=segs,
                                                 kv_segments=segs),
                     cudnn=None),
      "window": dict(shape=(1, 32768, 32, 128),
                     kw=dict(local_window_size=(4095, 0)),
                     index_mask=common.IndexMask(window=(4095, 0)),
                     cudnn=dict(local_window_size=(4095, 0))),
  }


def kernels_alone(method, impl, x, w, iters, reps):
  """``(unmasked, masked)`` seconds of the method's kernel alone, on
  operands its adapter prepared (the quantizers' time, which the mask does
  not change, left out), or None for a method without the two stages."""
  adapter = jaxattn.api.BACKENDS[impl].ADAPTERS[method]
  if getattr(adapter, "prepare", None) is None:
    return None
  q, k, v = x
  b, t = q.shape[:2]
  lens = jnp.full((b,), t, jnp.int32)
  scale = 1.0 / np.sqrt(q.shape[-1])
  im = w["index_mask"]
  segments = (None if im.q_segments is None
              else (im.q_segments, im.kv_segments))
  out = []
  for index_mask, segs in ((None, None), (im, segments)):
    # (each call's own config: the backend's defaults may follow the mask)
    cfg = jaxattn.api.config_for(
        method, impl, masked=jaxattn.api.skips_key_blocks(index_mask))
    ops = jax.block_until_ready(jax.jit(functools.partial(
        adapter.prepare, scale=scale, config=cfg, segments=segs))(
            q, k, v, lens))
    # (per-segment V scales leave the output's row scale to the epilogue,
    # which takes float32 from the kernel, as the method's run does)
    out_dtype = (jnp.float32 if getattr(ops, "out_row_scale", None)
                 is not None else jnp.float16)
    # (the index mask as the call's data, not constants of it)
    fn = jax.jit(lambda ops, lens, index_mask, dt=out_dtype:
                 adapter.kernel(ops, lens, is_causal=True, config=cfg,
                                out_dtype=dt, index_mask=index_mask))
    out.append(time_call(fn, (ops, lens, index_mask), iters, reps))
  return tuple(out)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--methods", default=",".join(METHODS))
  ap.add_argument("--workloads", default="packed,window")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--reps", type=int, default=5)
  ap.add_argument("--out")
  args = ap.parse_args(argv)
  rng = np.random.default_rng(0)
  rows = []
  for name, w in workloads(rng).items():
    if name not in args.workloads.split(","):
      continue
    b, t, n, d = w["shape"]
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(x, (b, t, n, d), jnp.bfloat16) for x in keys)
    flops_full = visible_tile_flops(b, n, t, t, d, is_causal=True)
    flops_masked = visible_tile_flops(b, n, t, t, d, is_causal=True,
                                      index_mask=w["index_mask"])
    peers = {"cudnn_bf16": lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn")}
    if w["cudnn"] is not None:
      peers["cudnn_bf16_masked"] = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, implementation="cudnn", **w["cudnn"])
    times = {}
    for peer, fn in peers.items():
      times[peer] = time_call(jax.jit(fn), (q, k, v), args.iters, args.reps)
    for method in args.methods.split(","):
      x = (q, k, v) if method == "fp32" else tuple(
          a.astype(jnp.float16) for a in (q, k, v))
      run = functools.partial(jaxattn.dot_product_attention, method=method,
                              is_causal=True)
      row = dict(workload=name, shape=list(w["shape"]), method=method,
                 backend=jaxattn.api.resolve_implementation(
                     *x, is_causal=True, method=method, **w["kw"]))
      try:
        t_full = time_call(jax.jit(run), x, args.iters, args.reps)
        # (the segment ids as the call's data, not constants of it)
        masked, arrays = jit_with_array_options(run, w["kw"])
        t_mask = time_call(masked, (*x, arrays), args.iters, args.reps)
        kernel_times = kernels_alone(method, row["backend"], x, w,
                                     args.iters, args.reps)
      except Exception as e:  # noqa: BLE001  (recorded, not hidden)
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(json.dumps(row), flush=True)
        continue
      if kernel_times:
        k_full, k_mask = kernel_times
        row.update(kernel_unmasked_ms=k_full * 1e3,
                   kernel_masked_ms=k_mask * 1e3,
                   kernel_work_efficiency=(flops_masked / k_mask)
                   / (flops_full / k_full))
      row.update(
          unmasked_ms=t_full * 1e3, masked_ms=t_mask * 1e3,
          visible_flops_ratio=flops_masked / flops_full,
          work_efficiency=(flops_masked / t_mask) / (flops_full / t_full),
          ratio_to_cudnn_bf16_unmasked=times["cudnn_bf16"] / t_full,
          **{f"{p}_ms": tp * 1e3 for p, tp in times.items()})
      if "cudnn_bf16_masked" in times:
        row["ratio_to_cudnn_bf16_masked"] = times["cudnn_bf16_masked"] / t_mask
      rows.append(row)
      print(json.dumps(row), flush=True)
      if args.out:   # after every row, so that a cut run keeps its rows
        write(args.out, rows)
  print(f"\n{'workload':8} {'method':10} {'backend':9} {'unmasked':>9} "
        f"{'masked':>8} {'vis.':>5} {'eff.':>5} {'vs cuDNN':>8} "
        f"{'kernel eff.':>11}")
  for r in rows:
    if "error" in r:
      print(f"{r['workload']:8} {r['method']:10} error: {r['error'][:80]}")
      continue
    vs = r.get("ratio_to_cudnn_bf16_masked",
               r["cudnn_bf16_ms"] / r["masked_ms"] * r["visible_flops_ratio"])
    print(f"{r['workload']:8} {r['method']:10} {r['backend']:9} "
          f"{r['unmasked_ms']:9.2f} {r['masked_ms']:8.2f} "
          f"{r['visible_flops_ratio']:5.2f} {r['work_efficiency']:5.2f} "
          f"{vs:8.2f} {r.get('kernel_work_efficiency', float('nan')):11.2f}")
  if args.out:
    write(args.out, rows)


def write(path, rows):
  with open(path, "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f,
              indent=1)


if __name__ == "__main__":
  main()

"""Times jaxattn's kernels and the peers on the same inputs, in one process on
the GPU, and writes the results as JSON (``--out``) and PNG plots (``--plot``).

    python -m jaxattn bench [--shapes 2x32x8192x128,...] [--methods ...]
        [--causal both|yes|no] [--out benchmarks/results/NAME.json]
        [--plot DIR] [--backward]
    python -m jaxattn bench --plot DIR --from-json FILE...   (no GPU needed)

Peers: cuDNN through
``jax.nn.dot_product_attention(implementation="cudnn")`` in bfloat16 (the
reference point of every ratio) and float16, jax's own Pallas attention
(``jax.experimental.pallas.ops.gpu.attention.mha``), and, where they import,
SageAttention's Triton kernels (torch) and tokamax.  FLOPs are
``4 B H Sq Skv D`` (halved for causal).  ``--backward`` times
``jax.value_and_grad`` of each JAX row (forward plus backward, FLOPs 3.5x
the forward's) against cuDNN bf16's, without the error columns.  Times are
the median over ``--reps``
timed groups of ``--iters`` back-to-back calls after warm-up, synchronised on
the device.  Each JAX and kernel row also has ``device_ms`` and its
``device_ratio_vs_cudnn_bf16``: the GPU's time from one call's first kernel
to the next call's over 6 traced calls after the timed groups
(:func:`jaxattn.timing.device_period_ms`, jax's profiler).

The plots: one PNG per (causal, head dim), TFLOP/s (left) and ratio to cuDNN
bf16 (right) against the sequence length, one line per method.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import api, data, metrics, operands, pasa
from jaxattn.report import Progress, new_figure, require_matplotlib
from jaxattn.timing import device_period_ms, time_call
from pallas_kernels import common

DEFAULT_SHAPES = "4x32x2048x128,2x32x8192x128,1x32x16384x128,4x32x4096x64"
REFERENCE = "cudnn_bf16"  # every ratio is to this method, always timed
NO_GPU_EXIT_CODE = 1

# jaxattn's methods, end to end from float16 inputs: (benchmark name, method,
# options of jaxattn.dot_product_attention).  Append a row to time another
# method or configuration.  Each row is timed on the Triton kernel (the name
# as it is) and, on a Hopper GPU, on the Mosaic kernel (the name + "_mosaic")
# where the method has one.
JAXATTN_VARIANTS = [
    ("jaxattn_fp32", "fp32", {}),
    ("jaxattn_fp16_fp32", "fp16_fp32", {}),
    ("jaxattn_fp16", "fp16", {}),
    ("jaxattn_pasa", "pasa", {}),
    ("jaxattn_pasa_algorithm1", "pasa", pasa.ALGORITHM1),
    ("jaxattn_sage2-8b", "sage", {"preset": "sage2-8b"}),
    ("jaxattn_sage2-4b", "sage", {"preset": "sage2-4b"}),
    ("jaxattn_sage1", "sage", {"preset": "sage1"}),
    ("jaxattn_int8_full", "int8", {}),
    ("jaxattn_int8_full_vblock", "int8", {"v_granularity": "block"}),
    ("jaxattn_int8_half", "int8", {"pv_dtype": "fp16"}),
    ("jaxattn_fmha_int8", "fmha_int8", {}),
    ("jaxattn_fp8", "fp8", {}),
    ("jaxattn_fp8_block", "fp8", {"granularity": "block"}),
]
# The quantized variants also timed kernel alone, on pre-quantized inputs.
KERNEL_VARIANTS = [
    ("kernel_sage2-8b", "sage", {"preset": "sage2-8b"}),
    ("kernel_sage2-4b", "sage", {"preset": "sage2-4b"}),
    ("kernel_sage1", "sage", {"preset": "sage1"}),
    ("kernel_int8_full", "int8", {}),
    ("kernel_int8_half", "int8", {"pv_dtype": "fp16"}),
    ("kernel_fp8", "fp8", {}),
    ("kernel_fp8_block", "fp8", {"granularity": "block"}),
]


def _backends(method):
  """``[(name suffix, implementation)]`` of the method's GPU kernels: the
  Triton kernel (no suffix) and, on Hopper, the Mosaic kernel."""
  out = [("", "triton")] if method in api.BACKENDS["triton"].ADAPTERS else []
  if (method in api.BACKENDS["mosaic"].ADAPTERS
      and api.BACKENDS["mosaic"].native()):
    out.append(("_mosaic", "mosaic"))
  return out


def parse_shapes(text):
  return [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s]


def jax_methods(causal, d):
  """name -> (dtype of inputs, function(q, k, v))."""
  scale = 1.0 / math.sqrt(d)
  out = {
      "cudnn_bf16": (jnp.bfloat16, lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn")),
      "cudnn_fp16": (jnp.float16, lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation="cudnn")),
      "cudnn_fp8": (jnp.float16, functools.partial(cudnn_fp8, is_causal=causal)),
  }
  try:
    from jax.experimental.pallas.ops.gpu import attention as jax_pallas
    out["jax_pallas_mha"] = (jnp.float16, lambda q, k, v: jax_pallas.mha(
        q, k, v, None, sm_scale=scale, causal=causal))
  except Exception:  # noqa: BLE001
    pass
  try:
    import tokamax
    for impl in ("mosaic", "triton"):
      out[f"tokamax_{impl}_bf16"] = (
          jnp.bfloat16, lambda q, k, v, impl=impl: tokamax.dot_product_attention(
              q, k, v, is_causal=causal, implementation=impl))
  except Exception:  # noqa: BLE001
    pass
  for name, m, opts in JAXATTN_VARIANTS:
    for suffix, impl in _backends(m):
      out[name + suffix] = (jnp.float16, lambda q, k, v, m=m, opts=opts,
                            impl=impl: jaxattn.dot_product_attention(
                                q, k, v, is_causal=causal, method=m,
                                implementation=impl, **opts))
  if _backends("fp32")[-1][1] == "mosaic":
    out["jaxattn_fp32_bf16_mosaic"] = (
        jnp.bfloat16, lambda q, k, v: jaxattn.dot_product_attention(
            q, k, v, is_causal=causal, method="fp32", implementation="mosaic"))
  return out


def cudnn_fp8(q, k, v, *, is_causal):
  """cuDNN's fp8 flash attention (jax's private cuDNN module, ``use_fp8``)
  on Q, K, V quantized to float8_e4m3fn by XLA with one scale per tensor
  (``amax / 448``), P scaled by 448 and the fp8 output by ``1 / s_v``:
  the peer "cuDNN fp8 + XLA quantization".  Returns float32 ``[B, T, N,
  H]``."""
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
  f32 = jnp.float32

  def quantize(x):
    s = jnp.max(jnp.abs(x.astype(f32))) / common.FP8_MAX
    s = jnp.where(s > 0, s, 1.0)
    return (x.astype(f32) / s).astype(jnp.float8_e4m3fn), s
  (q8, sq), (k8, sk), (v8, sv) = quantize(q), quantize(k), quantize(v)
  one = jnp.ones((1, 1, 1, 1), f32)
  params = {name: one for name in cudnn_attention.fp8_params_keys}
  params.update(descale_q=sq * one, descale_k=sk * one, descale_v=sv * one,
                descale_s=one / common.FP8_MAX, scale_s=common.FP8_MAX * one,
                scale_o=one / sv)
  mask = (cudnn_attention.MaskType.CAUSAL if is_causal
          else cudnn_attention.MaskType.NO_MASK)
  out, _, _ = cudnn_attention.dot_product_attention(
      q8, k8, v8, fp8_params=params, scale=1.0 / math.sqrt(q.shape[-1]),
      mask_type=mask, use_fp8=True)
  return out.astype(f32) * sv


# Error against float32 attention, per end-to-end row, on inputs with the
# structure of real models' keys (jaxattn.data.channel_outlier: a per-channel
# bias shared by every token, a few outlier channels), at one batch and up to
# ACCURACY_HEADS heads of each benchmarked shape.
ACCURACY_HEADS = 8


def accuracy_inputs(shape):
  """``(float32 q, k, v, their float32 attention)`` for ``shape`` (B, H, S,
  D): one batch, ``min(H, ACCURACY_HEADS)`` heads."""
  _, h, s, d = shape
  q, k, v = data.channel_outlier(jax.random.key(1),
                                 (1, s, min(h, ACCURACY_HEADS), d),
                                 jnp.float32)
  return q, k, v


def _torch_fn(job):
  """A torch peer (float16 NHD tensors on the GPU) as a function of jax
  arrays, for :func:`accuracy` (outside jit: the values go through the
  host)."""
  import numpy as np
  import torch

  def fn(q, k, v):
    t = [torch.from_numpy(np.asarray(x, np.float32)).cuda().half()
         for x in (q, k, v)]
    return jnp.asarray(job(*t).float().cpu().numpy())
  fn.eager = True
  return fn


def accuracy_reference(inputs, causal):
  """Float32 attention of the float32 ``inputs`` (XLA's, dense scores)."""
  with jax.default_matmul_precision("highest"):
    return jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="xla"))(*inputs)


def accuracy(fn, dtype, inputs, causal, ref=None):
  """``{"cos_sim", "rel_l2"}`` of ``fn`` on ``inputs`` (float32, rounded
  to ``dtype``) against ``ref``, by default :func:`accuracy_reference`."""
  if ref is None:
    ref = accuracy_reference(inputs, causal)
  run = fn if getattr(fn, "eager", False) else jax.jit(fn)
  out = run(*(x.astype(dtype) for x in inputs))
  return dict(cos_sim=metrics.cosine_similarity(out, ref),
              rel_l2=metrics.relative_rmse(out, ref))


# The quantizers alone ("prep_" + the method's name): the kernels' BTNH
# quantizer (jaxattn.operands), and SageAttention's reference quantizer (per
# head through vmap) that it replaces.
PREP_VARIANTS = [  # (name, method, options)
    ("prep_sage2-8b", "sage", {"preset": "sage2-8b"}),
    ("prep_int8_full", "int8", {}),
    ("prep_fp8", "fp8", {}),
    ("prep_fp8_block", "fp8", {"granularity": "block"}),
    ("prep_int8_full_vblock", "int8", {"v_granularity": "block"}),
]


def quantizers_alone(d):
  """name -> setup(q, k, v) -> (jitted quantizer, its arguments)."""
  scale = 1.0 / math.sqrt(d)
  out = {}
  for name, method, opts in PREP_VARIANTS:
    # the options of the backend the default path takes here
    impl = (_backends(method) or [("", "reference")])[-1][1]
    cfg = api.config_for(method, impl, **opts)
    fns = {name: lambda q, k, v, lens, method=method, cfg=cfg: (
        operands.quantized_operands(method, q, k, v, lens, scale=scale,
                                    config=cfg))}
    if name == "prep_sage2-8b":
      fns[name + "_reference"] = lambda q, k, v, lens, cfg=cfg: (
          jaxattn.sage.sage_quantize(q, k, v, lens, scale=scale, config=cfg))
    for n, fn in fns.items():
      def setup(q, k, v, fn=fn):
        lens = jnp.full((q.shape[0],), k.shape[1], jnp.int32)
        return jax.jit(fn), (q, k, v, lens)
      out[n] = setup
  return out


def kernel_alone(causal, d, variants=KERNEL_VARIANTS):
  """name -> setup(q, k, v) -> (jitted kernel, its arguments): the kernels
  of ``variants`` (``[(name, method, options)]``) timed on pre-quantized
  inputs (the quantizer's time excluded), made by the backends' own
  adapters (``prepare``, then ``kernel``), as the methods run."""
  scale = 1.0 / math.sqrt(d)
  out = {}
  for name, method, opts in variants:
    for suffix, impl in _backends(method):
      adapter = api.BACKENDS[impl].ADAPTERS[method]
      cfg = api.config_for(method, impl, is_causal=causal, **opts)

      def setup(q, k, v, cfg=cfg, adapter=adapter):
        lens = jnp.full((q.shape[0],), k.shape[1], jnp.int32)
        ops = jax.jit(functools.partial(adapter.prepare, scale=scale,
                                        config=cfg))(q, k, v, lens)
        fn = jax.jit(lambda ops, lens: adapter.kernel(
            ops, lens, is_causal=causal, config=cfg, out_dtype=jnp.float16))
        # the kernel the call without key lengths gets
        return fn, jax.block_until_ready(
            (ops, None if adapter.all_keys else lens))
      out[name + suffix] = setup
  return out


def torch_methods(causal):
  out = {}
  try:
    import torch
    from sageattention import sageattn
    out["sageattention_triton"] = lambda q, k, v: sageattn(
        q, k, v, tensor_layout="NHD", is_causal=causal)
    del torch
  except Exception:  # noqa: BLE001
    pass
  return out


def method_jobs(causal, d, names, backward=False):
  """``[(name, kind, job)]`` of the methods to time, in the JSON's order:
  kind "jax" (job: dtype, fn), "kernel" (setup(q, k, v) -> (fn, args)) or
  "torch" (fn); with ``backward`` the "jax" ones only.
  ``names`` empty means all; the reference is always included."""
  def wanted(name):
    return not names or name in names or name == REFERENCE
  jax_jobs = [(n, "jax", j) for n, j in jax_methods(causal, d).items()
              if wanted(n)]
  if backward:
    return jax_jobs
  return (jax_jobs
          + [(n, "kernel", j) for n, j in kernel_alone(causal, d).items()
             if wanted(n)]
          + [(n, "kernel", j) for n, j in quantizers_alone(d).items()
             if wanted(n)]
          + [(n, "torch", j) for n, j in torch_methods(causal).items()
             if wanted(n)])


def _with_gradient(fn):
  """``value_and_grad`` of ``sum(fn(q, k, v) * w)`` in q, k, v."""
  def loss(q, k, v, w):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) * w)
  return jax.value_and_grad(loss, argnums=(0, 1, 2))


def bench_shape(shape, causal, names, iters, reps, log, progress=None,
                with_accuracy=True, backward=False):
  """``{name: {ms, tflops, [temp_bytes], ratio_vs_cudnn_bf16, [cos_sim,
  rel_l2]} or {error}}`` of every selected method on one shape (the error
  against float32 of the end-to-end rows with ``with_accuracy``; forward
  plus backward with ``backward``)."""
  b, h, s, d = shape
  flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0)
  if backward:
    flops *= 3.5
    with_accuracy = False
  key = jax.random.key(0)
  kq, kk, kv = jax.random.split(key, 3)
  base = {dt: [jax.random.normal(x, (b, s, h, d), jnp.float32).astype(dt)
               for x in (kq, kk, kv)]
          for dt in (jnp.float16, jnp.bfloat16)}
  torch_inputs = None
  acc_inputs = accuracy_inputs(shape) if with_accuracy else None
  # The float32 reference once per shape; where it fails (its dense scores
  # take 64 GiB at 1x16x32768), every row records why, without retrying.
  acc_ref, acc_error = None, None
  if with_accuracy:
    try:
      acc_ref = accuracy_reference(acc_inputs, causal)
    except Exception as e:  # noqa: BLE001  (keep the timings)
      acc_error = f"reference: {type(e).__name__}: {e}"[:400]
      log.write(traceback.format_exc())

  def row_accuracy(fn, dtype):
    if acc_error is not None:
      return dict(accuracy_error=acc_error)
    try:
      return accuracy(fn, dtype, acc_inputs, causal, ref=acc_ref)
    except Exception as e:  # noqa: BLE001  (keep the timing)
      log.write(traceback.format_exc())
      return dict(accuracy_error=f"{type(e).__name__}: {e}"[:400])

  rows = {}
  cotangent = jax.random.normal(key, (b, s, h, d), jnp.float32)
  for name, kind, job in method_jobs(causal, d, names, backward):
    try:
      if kind == "jax":
        dt, fn = job
        f = jax.jit(_with_gradient(fn) if backward else fn)
        args = (*base[dt], cotangent) if backward else base[dt]
        t = time_call(f, args, iters, reps)
        mem = f.lower(*args).compile().memory_analysis()
        temp = getattr(mem, "temp_size_in_bytes", None)
        rows[name] = dict(ms=t * 1e3, tflops=flops / t / 1e12, temp_bytes=temp,
                          device_ms=device_period_ms(f, args))
        if with_accuracy:
          rows[name].update(row_accuracy(fn, dt))
      elif kind == "kernel":
        fn, args = job(*base[jnp.float16])
        t = time_call(fn, args, iters, reps)
        rows[name] = dict(ms=t * 1e3, tflops=flops / t / 1e12,
                          device_ms=device_period_ms(fn, args))
      else:
        import torch
        import triton.testing
        if torch_inputs is None:
          torch_inputs = [torch.randn(b, s, h, d, device="cuda",
                                      dtype=torch.float16) for _ in range(3)]
        ms = triton.testing.do_bench(lambda: job(*torch_inputs), warmup=50,
                                     rep=300, return_mode="median")
        rows[name] = dict(ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
        if with_accuracy:
          rows[name].update(row_accuracy(_torch_fn(job), jnp.float16))
    except Exception as e:  # noqa: BLE001
      rows[name] = dict(error=f"{type(e).__name__}: {e}"[:400])
      log.write(traceback.format_exc())
    if progress is not None:
      progress.step(f"{'x'.join(map(str, shape))} "
                    f"{'causal' if causal else 'non-causal'} {name}")
  ref = rows.get(REFERENCE, {}).get("ms")
  ref_device = rows.get(REFERENCE, {}).get("device_ms")
  for r in rows.values():
    if ref and "ms" in r:
      r["ratio_vs_cudnn_bf16"] = ref / r["ms"]
    if ref_device and r.get("device_ms"):
      r["device_ratio_vs_cudnn_bf16"] = ref_device / r["device_ms"]
  return rows


def format_rows(shape, causal, rows):
  """The text printed for one shape: a header and one line per method."""
  lines = [f"# B,H,S,D={shape} causal={causal}"]
  for n, r in rows.items():
    if "ms" in r:
      line = (f"  {n:28s} {r['ms']:8.3f} ms {r['tflops']:7.1f} TFLOP/s "
              f"x{r.get('ratio_vs_cudnn_bf16', float('nan')):.3f}")
      if r.get("device_ms"):
        line += (f"  GPU {r['device_ms']:.3f} ms "
                 f"x{r.get('device_ratio_vs_cudnn_bf16', float('nan')):.3f}")
      if "rel_l2" in r:
        line += f"  cos {r['cos_sim']:.6f} rel_l2 {r['rel_l2']:.2e}"
      lines.append(line)
    else:
      lines.append(f"  {n:28s} ERROR {r['error'][:200]}")
  return "\n".join(lines)


def speed_series(docs):
  """``{(causal, head_dim): {method: {seq_len: row}}}`` of the rows with a
  time in ``docs`` (bench JSON documents); a later document's row replaces
  an earlier one's at the same point.  cuDNN bf16 comes first."""
  series = {}
  for doc in docs:
    for res in doc["results"]:
      b, h, s, d = res["shape"]
      methods = series.setdefault((bool(res["causal"]), d), {})
      for name, row in res["rows"].items():
        if "tflops" in row:
          methods.setdefault(name, {})[s] = dict(row, shape=(b, h, s, d))
  return {key: dict(sorted(methods.items(), key=lambda kv: kv[0] != REFERENCE))
          for key, methods in series.items()}


def plot(docs, out_dir):
  """Writes ``bench_d{D}_{causal,noncausal}.png`` into ``out_dir`` from bench
  JSON documents: TFLOP/s and ratio to cuDNN bf16 against the sequence
  length, one line per method; and the speed-against-accuracy charts of
  :func:`plot_speed_accuracy` where the rows have an error against float32.
  Returns the paths."""
  import matplotlib
  os.makedirs(out_dir, exist_ok=True)
  devices = sorted({doc.get("meta", {}).get("device", "?") for doc in docs})
  colours = matplotlib.colormaps["tab20"].colors
  markers = "osD^v<>phX*"
  paths = []
  for (causal, d), series in sorted(speed_series(docs).items()):
    fig, (ax_speed, ax_ratio) = new_figure(2, width=5.5, height=4.8)
    seq_lens = sorted({s for pts in series.values() for s in pts})
    for i, (name, pts) in enumerate(series.items()):
      xs = sorted(pts)
      ratio_xs = [s for s in xs if "ratio_vs_cudnn_bf16" in pts[s]]
      if name == REFERENCE:
        style = dict(color="black", linestyle="--", linewidth=2.5, marker="o")
      else:
        style = dict(color=colours[i % len(colours)], linewidth=1.3,
                     marker=markers[i % len(markers)], markersize=5)
      ax_speed.plot(xs, [pts[s]["tflops"] for s in xs], label=name, **style)
      ax_ratio.plot(ratio_xs, [pts[s]["ratio_vs_cudnn_bf16"] for s in ratio_xs],
                    **style)
    batch_heads = {}
    for pts in series.values():
      for s, row in pts.items():
        batch_heads[s] = row["shape"][:2]
    ticks = [f"{s}\nB{batch_heads[s][0]} H{batch_heads[s][1]}"
             for s in seq_lens]
    for ax, ylabel in ((ax_speed, "TFLOP/s"),
                       (ax_ratio, "speed / cuDNN bf16 (same run)")):
      ax.set_xscale("log", base=2)
      ax.set_xticks(seq_lens, ticks, fontsize=8)
      ax.minorticks_off()
      ax.set_xlabel("sequence length S")
      ax.set_ylabel(ylabel)
      ax.grid(True, alpha=0.3)
    ax_speed.set_ylim(bottom=0)
    ax_ratio.set_ylim(bottom=0)
    kind = "causal" if causal else "non-causal"
    fig.suptitle(f"{kind}, head dim {d}: {', '.join(devices)}")
    fig.legend(loc="outside right upper", fontsize=8)
    path = os.path.join(
        out_dir, f"bench_d{d}_{'causal' if causal else 'noncausal'}.png")
    fig.savefig(path, dpi=100)
    paths.append(path)
  return paths + plot_speed_accuracy(docs, out_dir)


def _label(name):
  """A row name as a point label: ``jaxattn_sage2-8b_mosaic`` ->
  ``sage2-8b (mosaic)``."""
  label = name.removeprefix("jaxattn_")
  if label.endswith("_mosaic"):
    return label.removesuffix("_mosaic") + " (mosaic)"
  return label + (" (triton)" if name.startswith("jaxattn_") else "")


def _place_labels(fig, ax, points, fontsize=7):
  """Labels ``(text, x, y)`` beside their points, each at the first of a
  few offsets whose box (estimated from the text length) overlaps no label
  placed before it."""
  fig.canvas.draw()
  to_px = ax.transData.transform
  char_w, line_h = 0.62 * fontsize, 1.3 * fontsize   # in points ~ pixels/dpi
  scale = fig.dpi / 72.0
  boxes = []
  offsets = [(4, 3), (4, -10), (-4, 3), (-4, -10), (4, 12), (4, -19)]
  for text, x, y in sorted(points, key=lambda p: (p[1], p[2])):
    px, py = to_px((x, y))
    w, h = len(text) * char_w * scale, line_h * scale
    for dx, dy in offsets:
      x0 = px + dx * scale - (w if dx < 0 else 0)
      y0 = py + dy * scale
      box = (x0, y0, x0 + w, y0 + h)
      if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3]
                 and b[1] < box[3] for b in boxes):
        break
    boxes.append(box)
    ax.annotate(text, (x, y), textcoords="offset points", xytext=(dx, dy),
                ha="right" if dx < 0 else "left", fontsize=fontsize)


def plot_speed_accuracy(docs, out_dir):
  """Writes ``speed_accuracy_{B}x{H}x{S}x{D}_{causal,noncausal}.png`` for
  every result of ``docs`` whose rows carry an error against float32: one
  point per end-to-end row, x its ratio to cuDNN bf16, y its relative L2
  error (log scale); cuDNN's rows in black.  Returns the paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for doc in docs:
    device = doc.get("meta", {}).get("device", "?")
    for res in doc["results"]:
      pts = {n: r for n, r in res["rows"].items()
             if "rel_l2" in r and "ratio_vs_cudnn_bf16" in r
             and r["rel_l2"] > 0}
      if not pts:
        continue
      fig, (ax,) = new_figure(1, width=7.5, height=5.5)
      for name, r in pts.items():
        peer = not name.startswith("jaxattn_")
        style = (dict(color="black", marker="s") if peer else
                 dict(color="tab:blue" if name.endswith("_mosaic")
                      else "tab:orange", marker="o"))
        ax.scatter(r["ratio_vs_cudnn_bf16"], r["rel_l2"], s=36, **style)
      ax.set_yscale("log")
      _place_labels(fig, ax, [(_label(n), r["ratio_vs_cudnn_bf16"],
                               r["rel_l2"]) for n, r in pts.items()])
      ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
      for colour, marker, text in (("tab:blue", "o", "jaxattn, Mosaic"),
                                   ("tab:orange", "o", "jaxattn, Triton"),
                                   ("black", "s", "peers")):
        ax.scatter([], [], color=colour, marker=marker, label=text)
      ax.legend(loc="best", fontsize=8)  # (clear of the points)
      ax.set_xlabel("speed / cuDNN bf16 (same run, end to end)")
      ax.set_ylabel("relative L2 error vs float32 (channel-outlier keys)")
      ax.grid(True, alpha=0.3)
      b, h, s, d = res["shape"]
      kind = "causal" if res["causal"] else "non-causal"
      ax.set_title(f"{b}x{h}x{s}x{d} {kind}: {device}", fontsize=9)
      path = os.path.join(out_dir, f"speed_accuracy_{b}x{h}x{s}x{d}_"
                          f"{'causal' if res['causal'] else 'noncausal'}.png")
      fig.savefig(path, dpi=110)
      paths.append(path)
  return paths


NO_GPU_MESSAGE = (
    "python -m jaxattn bench: no GPU (jax sees only {devices}).\n"
    "The benchmark times the Pallas GPU kernels against cuDNN: run it on a "
    "CUDA machine with jaxattn[gpu] installed.\n"
    "Without a GPU, plot recorded results: python -m jaxattn bench --plot DIR "
    "--from-json benchmarks/results/FILE.json ...")


def main(argv=None, prog="python -m jaxattn bench"):
  """Runs the benchmark and returns its JSON document; with ``--from-json``
  only plots the recorded documents and returns None.  Without a GPU (and
  without ``--from-json``) prints why and exits with NO_GPU_EXIT_CODE."""
  p = argparse.ArgumentParser(
      prog=prog, description=__doc__.split("\n")[0],
      epilog="--grid (jaxattn/bench_grid.py: the shapes models run) and "
      "--torch (jaxattn/bench_torch.py: jaxattn.torch's host time, CPU too) "
      "are benchmarks of their own, with their own options")
  p.add_argument("--shapes", default=DEFAULT_SHAPES)
  p.add_argument("--methods", default="", help="comma list; default all")
  p.add_argument("--causal", default="both", choices=["both", "yes", "no"])
  p.add_argument("--iters", type=int, default=50)
  p.add_argument("--reps", type=int, default=7)
  p.add_argument("--out", default="")
  p.add_argument("--log", default=os.devnull)
  p.add_argument("--backward", action="store_true",
                 help="time forward plus backward (jax.value_and_grad)")
  p.add_argument("--no-accuracy", action="store_true",
                 help="skip the error against float32 of the end-to-end rows")
  p.add_argument("--plot", default="", metavar="DIR",
                 help="write PNG plots here (needs matplotlib)")
  p.add_argument("--from-json", nargs="+", default=[], metavar="FILE",
                 help="plot these recorded results instead of running "
                 "(with --plot; no GPU needed)")
  a = p.parse_args(argv)
  if a.plot:
    require_matplotlib()
  if a.from_json:
    if not a.plot:
      p.error("--from-json needs --plot DIR")
    docs = []
    for path in a.from_json:
      try:
        with open(path) as f:
          docs.append(json.load(f))
      except (OSError, ValueError) as e:
        p.error(f"cannot read {path}: {e}")
    for path in plot(docs, a.plot):
      print(f"wrote {path}")
    return None
  if not common.has_gpu():
    devices = ", ".join(sorted({d.platform for d in jax.devices()}))
    print(NO_GPU_MESSAGE.format(devices=devices), file=sys.stderr)
    raise SystemExit(NO_GPU_EXIT_CODE)
  warnings.filterwarnings("ignore", category=DeprecationWarning)
  names = [n for n in a.methods.split(",") if n]
  causals = {"both": [False, True], "yes": [True], "no": [False]}[a.causal]
  shapes = parse_shapes(a.shapes)
  dev = jax.devices()[0]
  meta = dict(device=getattr(dev, "device_kind", str(dev)),
              jax=jax.__version__, backward=a.backward,
              date=datetime.datetime.now().isoformat(), host=platform.node())
  progress = Progress(sum(len(method_jobs(c, s[3], names, a.backward))
                          for s in shapes for c in causals))
  results = []
  with open(a.log, "a") as log:
    for shape in shapes:
      for causal in causals:
        rows = bench_shape(shape, causal, names, a.iters, a.reps, log,
                           progress, with_accuracy=not a.no_accuracy,
                           backward=a.backward)
        results.append(dict(shape=shape, causal=causal, rows=rows))
        progress.write(format_rows(shape, causal, rows))
  progress.close()
  doc = dict(meta=meta, results=results)
  if a.out:
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
      json.dump(doc, f, indent=1)
  if a.plot:
    for path in plot([doc], a.plot):
      print(f"wrote {path}")
  return doc

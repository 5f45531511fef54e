"""PyTorch interop: jaxattn's methods on ``torch.Tensor`` inputs and outputs,
without copies, through DLPack (``jax.dlpack.from_dlpack`` in,
``torch.from_dlpack`` out), on the tensors' device (CPU, or CUDA with a CUDA
build of jax).

* :func:`sageattn` has SageAttention's signature (``sageattn(q, k, v,
  tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True)``):
  switching is a change of import.
* :func:`attention` runs any method of ``jaxattn.dot_product_attention``.

Layouts: ``"HND"`` is ``[batch, heads, seq, head_dim]`` (torch SDPA,
SageAttention), ``"NHD"`` is ``[batch, seq, heads, head_dim]`` (jaxattn's
BTNH).  Every transpose happens inside the one jitted JAX call.

What crosses DLPack and how:

* A contiguous tensor, or a permuted view of one (``x.transpose(1, 2)``), is
  shared without a copy; its axis order is restored in the jitted call.  Any
  other view (a slice with gaps, an ``expand``) is copied once with
  ``.contiguous()``: DLPack and XLA take dense buffers only.  (JAX itself
  copies a buffer that is not 16-byte aligned.)
* float8 tensors (``float8_e4m3fn``, ``float8_e5m2`` and the ``fnuz``
  variants) travel as a ``uint8`` view and are bitcast back in JAX, then
  widened exactly to float16: a float8 input is float16 data that happens to
  be stored in 8 bits (no scale), and the output is float16.
* int4 / uint4 / quint4x2 tensors are refused: DLPack has no 4-bit type, and
  attention takes float values (``method="sage"`` with
  ``preset="sage2-4b"`` quantises to int4 itself).

Autograd and ``torch.compile``: :func:`attention` is the custom operator
``torch.ops.jaxattn.attention`` (``torch.library.custom_op``, with a fake
implementation for tracing), so ``torch.compile`` keeps it as one opaque
call instead of tracing DLPack.  Its backward is the operator
``jaxattn::attention_backward``, which runs jaxattn's VJP
(:func:`jaxattn.grad.attention_vjp`: the exact gradient of attention at the
inputs, straight through the quantization) on the saved inputs and the
forward's log-sum-exp.  A float ``attn_mask`` (a bias) gets a gradient too.

CUDA streams: nothing synchronises the device.  ``jax.dlpack.from_dlpack``
passes jax's stream to the tensor's ``__dlpack__``, and torch makes that
stream wait for its current stream (an event), so jax reads the inputs
after the torch work that wrote them; ``torch.from_dlpack`` passes torch's
current stream to the jax array's ``__dlpack__``, and jax makes it wait
until the result is ready.  Calls are therefore ordered on whichever torch
stream is current (``with torch.cuda.stream(s):``).
"""
from __future__ import annotations

import contextlib
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxattn
from jaxattn import api, base, grad

LAYOUTS = {"HND": (0, 2, 1, 3), "NHD": (0, 1, 2, 3)}  # to BTNH, self-inverse
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT8 = {torch.float8_e4m3fn: "float8_e4m3fn",
           torch.float8_e5m2: "float8_e5m2",
           torch.float8_e4m3fnuz: "float8_e4m3fnuz",
           torch.float8_e5m2fnuz: "float8_e5m2fnuz"}
_INT4 = tuple(getattr(torch, n) for n in ("int4", "uint4", "quint4x2")
              if hasattr(torch, n))
_QK_QUANT_GRAN = {"per_warp": "warp", "per_block": "block",
                  "per_token": "token", "per_tensor": "tensor"}


def _check_dtype(tensor: torch.Tensor, name: str, allowed=_FLOAT) -> None:
  if tensor.dtype in _INT4:
    raise TypeError(
        f"{name} is {tensor.dtype}: 4-bit tensors cannot cross DLPack (it has "
        "no 4-bit type) and attention takes float inputs; pass the float "
        "values (method='sage', preset='sage2-4b' quantises to int4 itself)")
  if tensor.dtype == torch.float64 and not jax.config.jax_enable_x64:
    raise TypeError(f"{name} is float64 but jax_enable_x64 is off; pass "
                    "float32 or enable x64")
  if tensor.dtype not in allowed and tensor.dtype not in _FLOAT8:
    kinds = "bool, " * (torch.bool in allowed) + "float16, bfloat16, float32"
    raise TypeError(f"{name} must be {kinds} or float8, got {tensor.dtype}")


@torch.compiler.assume_constant_result
def _jax_has_gpu() -> bool:
  """(A constant to ``torch.compile``, which cannot trace ``jax.devices``.)"""
  return any(d.platform == "gpu" for d in jax.devices())


def _jax_device_kind(device: torch.device) -> None:
  """Raises unless jax can take tensors from ``device`` through DLPack."""
  if device.type == "cpu":
    return
  if device.type != "cuda":
    raise ValueError(f"tensors on {device} cannot cross DLPack to jax; use "
                     "CPU or CUDA tensors")
  if not _jax_has_gpu():
    raise RuntimeError(f"tensors are on {device} but jax has no GPU backend; "
                       "install a CUDA build of jax (jaxattn[gpu])")


def _jax_device(device: torch.device):
  """A context in which jax computes on ``device``'s kind: the CPU for CPU
  tensors even where jax's default backend is a GPU (so that no GPU kernel
  is picked for arrays that live on the CPU)."""
  if device.type == "cpu":
    return jax.default_device(jax.devices("cpu")[0])
  return contextlib.nullcontext()


def _import_tensor(tensor: torch.Tensor):
  """A tensor as a jax array that shares its memory.

  Returns ``(array, (axes, float8))``: ``jnp.transpose(array, axes)`` has
  the tensor's axis order, and ``float8`` names the float8 dtype of a
  ``uint8`` array (None otherwise).  A permuted view of a contiguous tensor
  is shared as its contiguous buffer; any other view is copied once.
  """
  tensor = tensor.detach()
  order = list(range(tensor.ndim))
  if not tensor.is_contiguous():
    order.sort(key=lambda i: -tensor.stride(i))
    if not tensor.permute(order).is_contiguous():
      tensor, order = tensor.contiguous(), list(range(tensor.ndim))
  view = tensor.permute(order)
  float8 = _FLOAT8.get(tensor.dtype)
  if float8 is not None:
    view = view.view(torch.uint8)
  axes = tuple(order.index(i) for i in range(tensor.ndim))
  return jax.dlpack.from_dlpack(view), (axes, float8)


def _restore(array, axes, float8):
  """Inside jit: the float8 bitcast (widened to float16) and the transpose."""
  if float8 is not None:
    array = jax.lax.bitcast_convert_type(array, jnp.dtype(float8))
    array = array.astype(jnp.float16)
  return jnp.transpose(array, axes)


def _export_array(array: jax.Array) -> torch.Tensor:
  return torch.from_dlpack(array)


def _freeze(value):
  """Options as a hashable static argument (dicts and lists to tuples)."""
  if isinstance(value, dict):
    return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
  if isinstance(value, list):
    return tuple(_freeze(v) for v in value)
  return value


def _bias_and_mask(attn_mask, mask_meta):
  if attn_mask is None:
    return None, None
  attn_mask = _restore(attn_mask, *mask_meta)
  if attn_mask.dtype == jnp.bool_:
    return None, attn_mask
  return attn_mask, None


def _index_kwargs(index, index_static):
  """``dot_product_attention``'s index keywords from the operator's
  ``(q_lens, q_segment_ids, kv_segment_ids)`` arrays and the static
  ``(local_window_size, causal_alignment)``."""
  q_lens, q_seg, kv_seg = index
  window, alignment = index_static
  return dict(query_seq_lengths=q_lens, q_segment_ids=q_seg,
              kv_segment_ids=kv_seg, local_window_size=window,
              causal_alignment=alignment)


@functools.partial(jax.jit, static_argnames=(
    "qkv_meta", "mask_meta", "layout", "method", "implementation", "scale",
    "is_causal", "options", "index_static", "return_residual"))
def _run(qkv, attn_mask, kv_lens, index, *, qkv_meta, mask_meta, layout,
         method, implementation, scale, is_causal, options, index_static,
         return_residual=False):
  q, k, v = (_restore(x, *meta) for x, meta in zip(qkv, qkv_meta))
  bias, mask = _bias_and_mask(attn_mask, mask_meta)
  out = jaxattn.dot_product_attention(
      q, k, v, bias, mask, scale=scale, is_causal=is_causal,
      key_value_seq_lengths=kv_lens, method=method,
      implementation=implementation, return_residual=return_residual,
      **_index_kwargs(index, index_static), **dict(options))
  if return_residual:   # (output, log-sum-exp [B, T, N])
    return jnp.transpose(out[0], LAYOUTS[layout]), out[1]
  if isinstance(out, tuple):  # (int8 output, its scale)
    return (jnp.transpose(out[0], LAYOUTS[layout]), *out[1:])
  return jnp.transpose(out, LAYOUTS[layout])


def _sum_to(x, shape):
  """``x`` summed over the axes that broadcasting ``shape`` to it added."""
  lead = x.ndim - len(shape)
  x = x.sum(axis=tuple(range(lead))) if lead else x
  axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
  return x.sum(axis=axes, keepdims=True) if axes else x


@functools.partial(jax.jit, static_argnames=(
    "qkv_meta", "mask_meta", "dout_meta", "out_meta", "layout", "scale",
    "is_causal", "index_static", "on_gpu"))
def _run_backward(qkv, attn_mask, kv_lens, index, lse, dout, out, *,
                  qkv_meta, mask_meta, dout_meta, out_meta, layout, scale,
                  is_causal, index_static, on_gpu):
  """``(dq, dk, dv, dbias)`` in the tensors' layout (dbias shaped like the
  float ``attn_mask``, or None); ``out``, the forward's output, or None."""
  q, k, v = (_restore(x, *meta) for x, meta in zip(qkv, qkv_meta))
  dout = _restore(dout, *dout_meta)
  if out is not None:
    out = _restore(out, *out_meta)
  bias, mask = _bias_and_mask(attn_mask, mask_meta)
  b, t, n, d = q.shape
  full = (b, n, t, k.shape[1])
  bias_shape = None if bias is None else bias.shape
  if bias is not None:
    bias = jnp.broadcast_to(bias, full)
  if mask is not None:
    mask = jnp.broadcast_to(mask, full)
  kv_lens = (jnp.full((b,), k.shape[1], jnp.int32) if kv_lens is None
             else jnp.asarray(kv_lens, jnp.int32))
  index_mask, _ = api.build_index_mask(q, k, kv_lens,
                                 **_index_kwargs(index, index_static))
  scale = base.default_scale(d) if scale is None else scale
  dq, dk, dv, dbias = grad.attention_vjp(
      q, k, v, bias, mask, kv_lens, None if lse.size == 0 else lse, dout,
      scale=scale, is_causal=is_causal, on_gpu=on_gpu, out=out,
      index_mask=index_mask)
  to_layout = lambda x: jnp.transpose(x, LAYOUTS[layout])
  return (to_layout(dq), to_layout(dk), to_layout(dv),
          None if dbias is None else _sum_to(dbias, bias_shape))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              method: str = "fp32", tensor_layout: str = "HND",
              is_causal: bool = False, sm_scale: float | None = None,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              key_value_seq_lengths=None, implementation: str | None = None,
              return_lse: bool = False, query_seq_lengths=None,
              local_window_size: int | tuple[int, int] | None = None,
              q_segment_ids=None, kv_segment_ids=None,
              causal_alignment: str = "top_left", **options):
  """``jaxattn.dot_product_attention`` on torch tensors, without copies.

  Args:
    q: ``[B, N, T, H]`` ("HND") or ``[B, T, N, H]`` ("NHD"); float16,
      bfloat16, float32 or float8 (read as float16).
    k, v: ``[B, K, S, H]`` / ``[B, S, K, H]``, ``N`` a multiple of ``K``;
      same device as ``q``.
    method: one of ``jaxattn.METHODS``; ``options`` are its config fields.
    is_causal: top-left aligned, as torch SDPA.
    sm_scale: softmax scale, default ``1/sqrt(H)``.
    attn_mask: as torch SDPA, broadcastable to ``[B, N, T, S]`` in either
      layout: bool (True takes part) or float (added to the scaled scores).
    dropout_p: must be 0 (no dropout).
    key_value_seq_lengths: ints ``[B]`` (tensor or sequence); keys at or
      beyond are masked.
    implementation: None, "reference", "triton" or "mosaic" (as
      ``jaxattn.dot_product_attention``).
    return_lse: also return the float32 log-sum-exp ``[B, N, T]``
      (``dot_product_attention``'s ``return_residual``).
    query_seq_lengths: ints ``[B]``; query rows at or beyond return 0.
    local_window_size: an int or ``(left, right)``: sliding-window
      attention, as ``jaxattn.dot_product_attention``.
    q_segment_ids, kv_segment_ids: int tensors ``[B, T]`` / ``[B, S]``
      (in either layout): packed sequences, a score is kept only where the
      ids are equal; ``kv_segment_ids`` defaults to ``q_segment_ids``.
    causal_alignment: ``"top_left"`` (torch SDPA's ``is_causal``) or
      ``"bottom_right"`` (the last query sees the last key: chunked
      prefill).

  Returns:
    The output in ``q``'s layout and dtype (float16 for float8 ``q``), on
    ``q``'s device, sharing the memory of jax's result.  ``fmha_int8`` with
    ``return_int8=True`` returns ``(int8 output, float32 scale)``.
  """
  if tensor_layout not in LAYOUTS:
    raise ValueError(f"tensor_layout must be 'HND' or 'NHD', got "
                     f"{tensor_layout!r}")
  if dropout_p:
    raise NotImplementedError(f"dropout_p={dropout_p}: jaxattn has no dropout")
  tensors = {"q": q, "k": k, "v": v}
  if attn_mask is not None:
    tensors["attn_mask"] = attn_mask
  for name, x in tensors.items():
    if not isinstance(x, torch.Tensor):
      raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      dims = "[batch, heads, seq, head_dim]" if tensor_layout == "HND" else \
             "[batch, seq, heads, head_dim]"
      raise ValueError(f"{name} must have rank 4 {dims} for tensor_layout="
                       f"{tensor_layout!r}, got shape {tuple(x.shape)}")
    _check_dtype(x, name)
  if attn_mask is not None:
    _check_dtype(attn_mask, "attn_mask", _FLOAT + (torch.bool,))
  devices = {name: x.device for name, x in tensors.items()}
  if len(set(devices.values())) > 1:
    raise ValueError("q, k, v (and attn_mask) must be on one device, got "
                     + ", ".join(f"{n} on {d}" for n, d in devices.items()))
  _jax_device_kind(q.device)
  kv_lens = None
  if key_value_seq_lengths is not None:
    kv_lens = np.asarray(_integer_tensor(
        key_value_seq_lengths, "key_value_seq_lengths").cpu())
    s = k.shape[2 if tensor_layout == "HND" else 1]
    if kv_lens.size and (kv_lens.min() < 0 or kv_lens.max() > s):
      raise ValueError(f"key_value_seq_lengths must lie in [0, {s}], got "
                       f"{kv_lens.tolist()}")

  index = _index_tensors(q, tensor_layout, query_seq_lengths, q_segment_ids,
                         kv_segment_ids)
  window = local_window_size
  if isinstance(window, (tuple, list)):
    window = [None if w is None else int(w) for w in window]
  elif window is not None:
    window = int(window)
  index_static = _encode([window, causal_alignment])
  if options.get("return_int8"):   # an int8 output: no autograd
    out = _forward(q, k, v, attn_mask, kv_lens, index, layout=tensor_layout,
                   method=method, implementation=implementation,
                   sm_scale=sm_scale, is_causal=is_causal, options=options,
                   index_static=index_static, need_lse=False)
    return tuple(_export_array(x) for x in out)
  lens = None if kv_lens is None else torch.as_tensor(kv_lens,
                                                      dtype=torch.int32)
  indexed = (any(x is not None for x in index) or local_window_size is not None
             or causal_alignment != "top_left")
  need_lse = return_lse or (
      torch.is_grad_enabled()
      and any(x is not None and x.requires_grad for x in (q, k, v, attn_mask))
      and (_backward_path(q, attn_mask, indexed) == "xla"
           or _keeps_output(q, attn_mask, method, indexed)))
  out, lse = torch.ops.jaxattn.attention(
      q, k, v, attn_mask, lens, *index, tensor_layout, method,
      implementation, None if sm_scale is None else float(sm_scale),
      bool(is_causal), _encode(options), index_static, need_lse)
  return (out, lse.transpose(1, 2)) if return_lse else out


@torch.compiler.assume_constant_result
def _encode(options) -> str:
  """The options as the operator's string argument (JSON; a constant to
  ``torch.compile``, which does not trace ``json``)."""
  return json.dumps(options, sort_keys=True)


def _integer_tensor(x, name: str, device=None) -> torch.Tensor:
  """``x`` as a tensor (on ``device``), TypeError unless it holds
  integers."""
  x = torch.as_tensor(x, device=device)
  if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
    raise TypeError(f"{name} must hold integers, got {x.dtype}")
  return x


def _index_tensors(q, layout, query_seq_lengths, q_segment_ids,
                   kv_segment_ids):
  """The index arrays as int32 tensors on ``q``'s device (or None)."""
  out = []
  for name, x in (("query_seq_lengths", query_seq_lengths),
                  ("q_segment_ids", q_segment_ids),
                  ("kv_segment_ids", kv_segment_ids)):
    if x is not None:
      x = _integer_tensor(x, name, device=q.device).to(
          torch.int32).contiguous()
    out.append(x)
  # checked here as key_value_seq_lengths are, except under torch.compile
  # (no data-dependent branch there): jax clips them to [0, T]
  if query_seq_lengths is not None and not torch.compiler.is_compiling():
    t = q.shape[2] if layout == "HND" else q.shape[1]
    lens = out[0].cpu().numpy()
    if lens.size and (lens.min() < 0 or lens.max() > t):
      raise ValueError(f"query_seq_lengths must lie in [0, {t}], got "
                       f"{lens.tolist()}")
  return tuple(out)


def _backward_path(q, attn_mask, indexed=False) -> str:
  """Which backward :func:`jaxattn.grad.attention_vjp` will take: "xla"
  needs the forward's log-sum-exp, "cudnn" recomputes its own."""
  dtype = jnp.float16 if q.dtype in _FLOAT8 else jnp.dtype(
      str(q.dtype).split(".")[1])
  has_bias = attn_mask is not None and attn_mask.dtype != torch.bool
  has_mask = attn_mask is not None and attn_mask.dtype == torch.bool
  return grad.backward_path(dtype, q.shape[-1], has_bias, has_mask,
                            on_gpu=q.device.type == "cuda",
                            has_index_mask=indexed)


@torch.compiler.assume_constant_result
def _takes_residuals(path: str, method: str) -> bool:
  """(A constant to ``torch.compile``: it inspects jax's cuDNN module.)"""
  return grad.takes_residuals(path, method)


def _keeps_output(q, attn_mask, method, indexed=False) -> bool:
  """Whether the backward takes the forward's output and log-sum-exp as
  its residuals (an exact method), as :func:`jaxattn.dot_product_attention`
  does."""
  return _takes_residuals(_backward_path(q, attn_mask, indexed), method)


def _import_index(index):
  return tuple(None if x is None else _import_tensor(x)[0] for x in index)


def _forward(q, k, v, attn_mask, kv_lens, index, *, layout, method,
             implementation, sm_scale, is_causal, options, index_static,
             need_lse):
  """The jitted call on the tensors' buffers (jax arrays out)."""
  to_btnh = LAYOUTS[layout]
  qkv, qkv_meta = [], []
  for x in (q, k, v):
    array, (axes, float8) = _import_tensor(x)
    qkv.append(array)
    qkv_meta.append((tuple(axes[i] for i in to_btnh), float8))
  mask_array, mask_meta = (None, None) if attn_mask is None else \
      _import_tensor(attn_mask)
  if kv_lens is not None:
    kv_lens = np.asarray(torch.as_tensor(kv_lens).cpu())
  with _jax_device(q.device):
    return _run(tuple(qkv), mask_array, kv_lens, _import_index(index),
                qkv_meta=tuple(qkv_meta), mask_meta=mask_meta, layout=layout,
                method=method, implementation=implementation,
                scale=None if sm_scale is None else float(sm_scale),
                is_causal=bool(is_causal), options=_freeze(options),
                index_static=_freeze(json.loads(index_static)),
                return_residual=need_lse)


_INDEX_SCHEMA = "Tensor? q_lens, Tensor? q_segment_ids, Tensor? kv_segment_ids"
_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? kv_lens, "
           f"{_INDEX_SCHEMA}, str layout, str method, str? implementation, "
           "float? sm_scale, bool is_causal, str options, str index_static, "
           "bool need_lse) -> (Tensor, Tensor)")


@torch.library.custom_op("jaxattn::attention", mutates_args=(),
                         schema=_SCHEMA)
def _attention_op(q, k, v, attn_mask, kv_lens, q_lens, q_segment_ids,
                  kv_segment_ids, layout, method, implementation, sm_scale,
                  is_causal, options, index_static, need_lse):
  """``(output in q's layout, float32 log-sum-exp [B, T, N] or an empty
  tensor)``; ``index_static``: JSON ``[local_window_size,
  causal_alignment]``."""
  out = _forward(q, k, v, attn_mask, kv_lens,
                 (q_lens, q_segment_ids, kv_segment_ids), layout=layout,
                 method=method, implementation=implementation,
                 sm_scale=sm_scale, is_causal=is_causal,
                 options=json.loads(options), index_static=index_static,
                 need_lse=need_lse)
  if need_lse:
    return _export_array(out[0]), _export_array(out[1])
  return _export_array(out), q.new_empty((0,), dtype=torch.float32)


def _shapes(q, v, layout):
  b = q.shape[0]
  t, n = (q.shape[2], q.shape[1]) if layout == "HND" else (q.shape[1],
                                                           q.shape[2])
  return (*q.shape[:3], v.shape[3]), (b, t, n)


@_attention_op.register_fake
def _attention_fake(q, k, v, attn_mask, kv_lens, q_lens, q_segment_ids,
                    kv_segment_ids, layout, method, implementation, sm_scale,
                    is_causal, options, index_static, need_lse):
  out_shape, lse_shape = _shapes(q, v, layout)
  dtype = torch.float16 if q.dtype in _FLOAT8 else q.dtype
  return (q.new_empty(out_shape, dtype=dtype),
          q.new_empty(lse_shape if need_lse else (0,), dtype=torch.float32))


_BACKWARD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? kv_lens, "
    f"{_INDEX_SCHEMA}, Tensor lse, Tensor dout, Tensor? out, str layout, "
    "float? sm_scale, bool is_causal, str index_static) "
    "-> (Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("jaxattn::attention_backward", mutates_args=(),
                         schema=_BACKWARD_SCHEMA)
def _attention_backward_op(q, k, v, attn_mask, kv_lens, q_lens,
                           q_segment_ids, kv_segment_ids, lse, dout, out,
                           layout, sm_scale, is_causal, index_static):
  """``(dq, dk, dv, dbias)`` shaped like q, k, v and a float attn_mask
  (an empty tensor without one); ``out``, the forward's output as cuDNN's
  residual, or None."""
  to_btnh = LAYOUTS[layout]
  arrays, metas = [], []
  for x in (q, k, v, dout) + (() if out is None else (out,)):
    array, (axes, float8) = _import_tensor(x)
    arrays.append(array)
    metas.append((tuple(axes[i] for i in to_btnh), float8))
  mask_array, mask_meta = (None, None) if attn_mask is None else \
      _import_tensor(attn_mask)
  lens = None if kv_lens is None else np.asarray(kv_lens.cpu())
  with _jax_device(q.device):
    grads = _run_backward(
        tuple(arrays[:3]), mask_array, lens,
        _import_index((q_lens, q_segment_ids, kv_segment_ids)),
        _import_tensor(lse)[0],
        arrays[3], None if out is None else arrays[4],
        qkv_meta=tuple(metas[:3]), mask_meta=mask_meta, dout_meta=metas[3],
        out_meta=None if out is None else metas[4], layout=layout,
        scale=sm_scale, is_causal=is_causal,
        index_static=_freeze(json.loads(index_static)),
        on_gpu=q.device.type == "cuda")
  dbias = (q.new_empty((0,)) if grads[3] is None
           else _export_array(grads[3]))
  return (*(_export_array(g) for g in grads[:3]), dbias)


@_attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, attn_mask, kv_lens, q_lens,
                             q_segment_ids, kv_segment_ids, lse, dout, out,
                             layout, sm_scale, is_causal, index_static):
  has_bias = attn_mask is not None and attn_mask.dtype != torch.bool
  return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
          torch.empty_like(attn_mask) if has_bias else q.new_empty((0,)))


def _setup_context(ctx, inputs, output):
  (q, k, v, attn_mask, kv_lens, q_lens, q_seg, kv_seg, layout, method, _,
   sm_scale, is_causal, _, index_static, _) = inputs
  indexed = (any(x is not None for x in (q_lens, q_seg, kv_seg))
             or index_static != _encode([None, "top_left"]))
  keep = output[1].numel() > 0 and _keeps_output(q, attn_mask, method,
                                                 indexed)
  ctx.save_for_backward(q, k, v, attn_mask, kv_lens, q_lens, q_seg, kv_seg,
                        output[1], output[0] if keep else None)
  ctx.static = (layout, sm_scale, is_causal, index_static)
  ctx.bias = attn_mask is not None and attn_mask.dtype != torch.bool


def _backward(ctx, dout, _):
  q, k, v, attn_mask, kv_lens, q_lens, q_seg, kv_seg, lse, out = \
      ctx.saved_tensors
  layout, sm_scale, is_causal, index_static = ctx.static
  dq, dk, dv, dbias = torch.ops.jaxattn.attention_backward(
      q, k, v, attn_mask, kv_lens, q_lens, q_seg, kv_seg, lse, dout, out,
      layout, sm_scale, is_causal, index_static)
  return (dq, dk, dv, dbias if ctx.bias else None, *(None,) * 12)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def sageattn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             tensor_layout: str = "HND", is_causal: bool = False,
             sm_scale: float | None = None, smooth_k: bool = True,
             return_lse: bool = False, qk_quant_gran: str | None = None,
             **options) -> torch.Tensor:
  """SageAttention's ``sageattn`` on jaxattn's ``method="sage"``.

  Same arguments and shapes as SageAttention (1.0.6 and 2.x): ``q``
  ``[B, N, T, H]`` ("HND") or ``[B, T, N, H]`` ("NHD"), float16, bfloat16 or
  float32; ``k``, ``v`` with ``K`` heads (``N`` a multiple of ``K``).
  Returns the output in ``q``'s layout and dtype.

  The default algorithm is jaxattn's ``preset="sage2-8b"`` (SageAttention2:
  int8 per-warp QK, fp8 PV); ``preset="sage1"`` is SageAttention 1.0.6's.
  ``smooth_k`` and ``qk_quant_gran`` ("per_warp", "per_block", "per_token",
  "per_tensor") map onto :class:`jaxattn.sage.SageConfig`; other options are
  its fields (``smooth_v``, ``pv_dtype``, ...) or :func:`attention`'s
  (``attn_mask``, ``key_value_seq_lengths``, ``implementation``).
  ``return_lse=True`` also returns the float32 log-sum-exp of each row of
  the scaled scores, ``[B, N, T]`` (natural log), as SageAttention does
  for ring attention: ``(output, lse)``.
  """
  if qk_quant_gran is not None:
    if qk_quant_gran not in _QK_QUANT_GRAN:
      raise ValueError(f"qk_quant_gran must be one of {tuple(_QK_QUANT_GRAN)}"
                       f", got {qk_quant_gran!r}")
    options["qk_granularity"] = _QK_QUANT_GRAN[qk_quant_gran]
  return attention(q, k, v, method="sage", tensor_layout=tensor_layout,
                   is_causal=is_causal, sm_scale=sm_scale, smooth_k=smooth_k,
                   return_lse=return_lse, **options)

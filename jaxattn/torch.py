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
* Inputs are detached: this is a forward pass, without autograd.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxattn

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


def _jax_device_kind(device: torch.device) -> None:
  """Raises unless jax can take tensors from ``device`` through DLPack."""
  if device.type == "cpu":
    return
  if device.type != "cuda":
    raise ValueError(f"tensors on {device} cannot cross DLPack to jax; use "
                     "CPU or CUDA tensors")
  if not any(d.platform == "gpu" for d in jax.devices()):
    raise RuntimeError(f"tensors are on {device} but jax has no GPU backend; "
                       "install a CUDA build of jax (jaxattn[gpu])")


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


@functools.partial(jax.jit, static_argnames=(
    "qkv_meta", "mask_meta", "layout", "method", "implementation", "scale",
    "is_causal", "options"))
def _run(qkv, attn_mask, kv_lens, *, qkv_meta, mask_meta, layout, method,
         implementation, scale, is_causal, options):
  q, k, v = (_restore(x, *meta) for x, meta in zip(qkv, qkv_meta))
  bias = mask = None
  if attn_mask is not None:
    attn_mask = _restore(attn_mask, *mask_meta)
    if attn_mask.dtype == jnp.bool_:
      mask = attn_mask
    else:
      bias = attn_mask
  out = jaxattn.dot_product_attention(
      q, k, v, bias, mask, scale=scale, is_causal=is_causal,
      key_value_seq_lengths=kv_lens, method=method,
      implementation=implementation, **dict(options))
  if isinstance(out, tuple):  # (int8 output, its scale)
    return (jnp.transpose(out[0], LAYOUTS[layout]), *out[1:])
  return jnp.transpose(out, LAYOUTS[layout])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              method: str = "fp32", tensor_layout: str = "HND",
              is_causal: bool = False, sm_scale: float | None = None,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              key_value_seq_lengths=None, implementation: str | None = None,
              **options):
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
    kv_lens = np.asarray(torch.as_tensor(key_value_seq_lengths).cpu())
    s = k.shape[2 if tensor_layout == "HND" else 1]
    if kv_lens.size and (kv_lens.min() < 0 or kv_lens.max() > s):
      raise ValueError(f"key_value_seq_lengths must lie in [0, {s}], got "
                       f"{kv_lens.tolist()}")

  to_btnh = LAYOUTS[tensor_layout]
  qkv, qkv_meta = [], []
  for x in (q, k, v):
    array, (axes, float8) = _import_tensor(x)
    qkv.append(array)
    qkv_meta.append((tuple(axes[i] for i in to_btnh), float8))
  mask_array, mask_meta = (None, None) if attn_mask is None else \
      _import_tensor(attn_mask)
  out = _run(tuple(qkv), mask_array, kv_lens, qkv_meta=tuple(qkv_meta),
             mask_meta=mask_meta, layout=tensor_layout, method=method,
             implementation=implementation,
             scale=None if sm_scale is None else float(sm_scale),
             is_causal=bool(is_causal), options=_freeze(options))
  if isinstance(out, tuple):
    return tuple(_export_array(x) for x in out)
  return _export_array(out)


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
  ``return_lse=True`` raises ``NotImplementedError``: jaxattn's methods do
  not return the log-sum-exp.
  """
  if return_lse:
    raise NotImplementedError("return_lse=True: jaxattn's methods do not "
                              "return the log-sum-exp")
  if qk_quant_gran is not None:
    if qk_quant_gran not in _QK_QUANT_GRAN:
      raise ValueError(f"qk_quant_gran must be one of {tuple(_QK_QUANT_GRAN)}"
                       f", got {qk_quant_gran!r}")
    options["qk_granularity"] = _QK_QUANT_GRAN[qk_quant_gran]
  return attention(q, k, v, method="sage", tensor_layout=tensor_layout,
                   is_causal=is_causal, sm_scale=sm_scale, smooth_k=smooth_k,
                   **options)

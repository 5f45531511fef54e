"""The quantized methods' kernel inputs, shared by both GPU backends (the
Triton kernel of :mod:`pallas_kernels.quantized` and the Hopper kernel of
:mod:`pallas_kernels.mosaic`) and by the benchmark's kernel-alone timings.

:func:`kernel_inputs` runs the method's jitted quantizer (the reference's
own, so both kernels see bit-identical quantized values) and lays its output
out the way the kernels take it: per-row query scales with
``scale * log2 e`` folded in (the softmax runs in base 2), per-key K scales,
an 8-bit V transposed once to ``[B, K, D, S]`` (the key dimension contiguous,
as the 8-bit tensor-core PV operand wants), and the per-channel epilogue
``O / l * out_scale + out_shift``.  SageAttention2's int4 Q and K go to the
Triton kernel packed two per byte (:func:`jaxattn.quant.pack_int4_halves`:
half the bytes moved and held; the H100 has no int4 tensor cores, the kernel
unpacks to int8 in registers); ``pack_int4=False`` keeps them in int8
containers (the Mosaic kernel's int8 path).
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from jaxattn import fp8 as fp8_ref
from jaxattn import int_flash as int8_ref
from jaxattn import quant
from jaxattn import sage as sage_ref

LOG2E = math.log2(math.e)


def kv_heads_last(x):
  """``[B, S, K, D] -> [B, K, D, S]`` (the 8-bit PV operand layout)."""
  return x.transpose(0, 2, 3, 1)


def _channels(x, shape):
  """A per-head scale ``[B, K]`` (or per-channel ``[B, K, D]``) as
  ``[B, K, D]`` float32."""
  x = x.astype(jnp.float32)
  return jnp.broadcast_to(x[..., None] if x.ndim == 2 else x, shape)


def _pack_int4(x):
  """int4 values in int8 containers ``[..., D]`` -> int8 ``[..., ceil(D /
  2)]`` packed in halves (an odd ``D`` gets a zero channel first)."""
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, x.shape[-1] % 2)])
  return quant.pack_int4_halves(x)


def kernel_inputs(method: str, q, k, v, kv_lens, *, scale: float,
                  config, pack_int4: bool = True) -> dict:
  """Quantized inputs of ``method`` ("sage", "int8" or "fp8").

  Returns a dict: ``q8`` ``[B, T, N, D]`` and ``k8`` ``[B, S, K, D]`` (int8,
  or float8_e4m3fn for "fp8"), ``q_scale`` float32 ``[B, T, N]`` (times
  ``scale * log2 e``), ``k_scale`` ``[B, S, K]``, ``v`` (float16 ``[B, S, K,
  D]`` for ``pv="fp16"``, else 8-bit ``[B, K, D, S]``), ``qk`` and ``pv``
  (the operand types: ``qk`` "int8", "fp8", or "int4" for "sage" with
  ``qk_dtype="int4"`` and ``pack_int4``: then ``q8`` ``[B, T, N, D / 2]``
  and ``k8`` ``[B, S, K, D / 2]`` int8 hold the values packed two per byte
  by :func:`jaxattn.quant.pack_int4_halves`, ``ceil(D / 2)`` for an odd
  ``D``; with ``pack_int4=False`` int4 values stay in int8 containers,
  ``qk="int8"``), and the optional (None when unused)
  ``q_block_bias`` ``[B, N, nqb, S]`` with ``bias_rows``, ``v_block_scale``
  ``[B, K, nb]``, ``out_scale`` and ``out_shift`` ``[B, K, D]``.
  """
  b, t, n, d = q.shape
  s_len, nk = k.shape[1], k.shape[2]
  kv_shape = (b, nk, v.shape[-1])
  out = dict(qk="int8", q_block_bias=None, bias_rows=None, v_block_scale=None,
             out_scale=None, out_shift=None)
  if method == "sage":
    z = sage_ref.sage_quantize(q, k, v, kv_lens, scale=scale, config=config)
    fp8 = config.pv_dtype == "fp8"
    q8, k8 = z["q"], z["k"]
    if config.qk_dtype == "int4" and pack_int4:
      q8, k8, out["qk"] = _pack_int4(q8), _pack_int4(k8), "int4"
    out.update(q8=q8, q_scale=z["q_scale_folded"], k8=k8,
               k_scale=z["k_scale"], pv=config.pv_dtype,
               v=kv_heads_last(z["v"]) if fp8 else z["v"],
               out_scale=(z["v_scale"] / quant.FP8_MAX if fp8
                          else jnp.ones(kv_shape, jnp.float32)),
               out_shift=z["v_mean"])
    if config.smooth_q:
      out["q_block_bias"] = (z["smooth_bias"] * sage_ref.log2_scale(scale)
                             ).transpose(0, 2, 1, 3)
      out["bias_rows"] = config.block_q
  elif method == "int8":
    z = int8_ref.int8_quantize(q, k, v, kv_lens, config=config)
    full = config.pv_dtype == "int8"
    out.update(q8=z["q"], q_scale=z["q_scale"] * (scale * LOG2E), k8=z["k"],
               k_scale=z["k_scale"], pv=config.pv_dtype,
               v=kv_heads_last(z["v"]) if full else z["v"])
    if full and config.v_granularity == "block":
      out["v_block_scale"] = z["v_scale"].transpose(0, 2, 1)
    elif full:
      out["out_scale"] = _channels(z["v_scale"], kv_shape)
      out["out_shift"] = jnp.zeros(kv_shape, jnp.float32)
  elif method == "fp8":
    z = fp8_ref.fp8_quantize(q, k, v, kv_lens, config=config)
    if config.granularity == "block":  # scales [B, groups, heads]
      q_scale = jnp.repeat(z["q_scale"], config.block_q, axis=1)[:, :t]
      k_scale = jnp.repeat(z["k_scale"], config.block_k, axis=1)[:, :s_len]
      out["v_block_scale"] = z["v_scale"].transpose(0, 2, 1)
      out["out_scale"] = jnp.full(kv_shape, 1.0 / quant.FP8_MAX, jnp.float32)
    else:                              # scales [B, heads]
      q_scale = jnp.broadcast_to(z["q_scale"][:, None, :], (b, t, n))
      k_scale = jnp.broadcast_to(z["k_scale"][:, None, :], (b, s_len, nk))
      out["out_scale"] = _channels(z["v_scale"] / quant.FP8_MAX, kv_shape)
    out.update(qk="fp8", pv="fp8", q8=z["q"],
               q_scale=q_scale * (scale * LOG2E), k8=z["k"], k_scale=k_scale,
               v=kv_heads_last(z["v"]),
               out_shift=jnp.zeros(kv_shape, jnp.float32))
  else:
    raise ValueError(f"no quantized kernel inputs for method {method!r}")
  return out

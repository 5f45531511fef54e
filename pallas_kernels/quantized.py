"""Quantized flash-attention forward kernel (Pallas, Triton lowering).

One kernel body, per head and per query block, with static flags:

* ``qk``: the QK^T operands, ``"int8"`` (int8 x int8 -> int32 on the tensor
  cores) or ``"int4"`` (int4 values packed two per byte in halves of the
  head dim: the kernel loads half the bytes and unpacks them in registers
  with two shifts into int8 halves ``lo``, ``hi``
  (:func:`pallas_kernels.common.int4_halves`), then ``Q K^T = Q_lo K_lo^T +
  Q_hi K_hi^T`` in int32, exactly the int8 product; the H100 has no int4
  tensor cores, the gain is bytes moved and memory held);
* ``pv``: how P is quantized for the PV matmul,
  ``"int8"``  ``P = round(127 exp(S - m))``, int8 x int8 -> int32;
  ``"fp8"``   ``P * 448`` in float8_e4m3fn, fp8 x fp8 -> float32;
  ``"fp16"``  ``P = fl16(exp(S - m))``, float16 x float16 -> float32;
  ``"uint8"`` ``P = round(255 exp(S - m_block))`` anchored at the block's own
  row max (8-bit FMHA), computed with int8 operands only through
  ``P_u8 V = (P_u8 - 128) V + 128 colsum(V)`` (the Triton lowering rejects
  unsigned matmuls; the identity is exact);
* optional per-block V scales, a per-query-block score bias (SageAttention2's
  smoothing bias), a per-channel output scale and shift, causal masking, a
  user bias or mask.

Scores: ``S = (Q_i8 K_i8^T)_int32 * q_scale[:, None] * k_scale[None, :]`` with
``sm_scale * log2(e)`` folded into the per-row query scale, so the softmax
runs in base 2 (``exp2``).  An 8-bit V is laid out transposed, ``[B, K, D,
S]`` (key dimension contiguous), by the quantizer: the layout the 8-bit
tensor-core path wants for the PV operand.  Batch and heads are grid axes
over the BTNH arrays; query heads of a group share their key/value head.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.common import FP8_MAX, LOG2E

QK_TYPES = ("int8", "int4")
PV_TYPES = ("int8", "fp8", "fp16", "uint8")

# (head_dim_padded, block_k) -> (block_q, num_warps, num_stages): the best of
# the tile sweep (7928894) on an H100 at B=2 H=32 S=8192 D=128 (half-INT8 and
# full INT8).  block_k is not a knob here: it belongs to the method (V block
# scales, SageAttention's K scales).
_TABLE = {
    (64, 64): (128, 4, 3), (64, 128): (64, 4, 3),
    (128, 64): (128, 4, 3), (128, 128): (64, 4, 3),
    (256, 64): (64, 8, 2), (256, 128): (32, 8, 2),
}


def default_params(head_dim: int, block_k: int) -> common.KernelParams:
  """The tuned query block, warps and stages for ``head_dim`` (padded to a
  power of two, 64 to 256) and the method's ``block_k``."""
  d = min(max(pl.next_power_of_2(head_dim), 64), 256)
  bq, warps, stages = _TABLE.get((d, block_k), _TABLE[(d, 64)])
  return common.KernelParams(block_q=bq, block_k=block_k, num_warps=warps,
                             num_stages=stages)


def _dot(a, b, acc, contract_b):
  """``a @ b^T`` (contract_b=1) or ``a @ b`` (contract_b=0) with the
  accumulator ``acc``."""
  return lax.dot_general(a, b, (((1,), (contract_b,)), ((), ())),
                         preferred_element_type=acc)


def _quant_kernel(q_ref, qs_ref, k_ref, ks_ref, v_ref, bounds_ref, range_ref,
                  *refs, qk, pv, block_q, block_k, has_segments, has_vbs,
                  has_colsum,
                  has_qbias, has_epilogue, has_bias, has_mask, fp8_dot_in_f32):
  """One query block of one head.

  q_ref int8 ``[bq, D]``; qs_ref ``[bq]`` (query scale * sm_scale * log2 e);
  k_ref int8 ``[S, D]``; ks_ref ``[S]`` (``qk="int4"``: q_ref ``[bq, D / 2]``
  and k_ref ``[S, D / 2]``, packed in halves); v_ref: int8 ``[Dv, S]``
  (transposed)
  or float16 ``[S, Dv]``; bounds_ref ``[4]`` (:func:`common.row_bounds`)
  and range_ref ``[4]`` (this block's key blocks, :func:`common.
  block_ranges`) int32; optional segment ids ``[bq]``, ``[S]``; then
  optional per-block V
  scales ``[nb]``, V column sums ``[nb, Dv]`` int32 (uint8 P), bias
  ``[bq, S]`` (natural log units), mask ``[bq, S]`` int8; output ``[bq, Dv]``
  float32 ``O / l`` (the caller applies the output scale).
  """
  refs = list(refs)
  qseg_ref, kseg_ref = ((refs.pop(0), refs.pop(0)) if has_segments
                        else (None, None))
  vbs_ref = refs.pop(0) if has_vbs else None
  colsum_ref = refs.pop(0) if has_colsum else None
  qbias_ref = refs.pop(0) if has_qbias else None
  scale_ref, shift_ref = (refs.pop(0), refs.pop(0)) if has_epilogue else (
      None, None)
  bias_ref = refs.pop(0) if has_bias else None
  mask_ref = refs.pop(0) if has_mask else None
  (o_ref,) = refs
  f32, i32 = jnp.float32, jnp.int32
  i = pl.program_id(0)
  bounds = tuple(bounds_ref[c] for c in range(4))
  q_seg = qseg_ref[...] if has_segments else None
  q = q_ref[...]
  if qk == "int4":  # unpacked once per query block
    q_lo, q_hi = common.int4_halves(q)
  qs = qs_ref[...]
  dv = o_ref.shape[-1]

  def scores(ks):  # (Q K_j^T)_int32
    if qk == "int4":
      k_lo, k_hi = common.int4_halves(k_ref[ks, :])
      return _dot(q_lo, k_lo, i32, 1) + _dot(q_hi, k_hi, i32, 1)
    return _dot(q, k_ref[ks, :], i32, 1)

  def body(j, carry, masked):
    m, l, o = carry
    ks = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    s = scores(ks).astype(f32)
    s = s * qs[:, None] * ks_ref[ks][None, :]
    if has_qbias:  # SageAttention's smoothing bias q_mean K^T of the block
      s = s + qbias_ref[ks][None, :]
    if has_bias:
      s = s + bias_ref[:, ks] * LOG2E
    if masked:
      rows, cols = common.block_indices(i, j, block_q, block_k)
      vis = common.visible(
          rows, cols, bounds, row_segments=q_seg,
          col_segments=kseg_ref[ks] if has_segments else None,
          mask=mask_ref[:, ks] if has_mask else None)
      s = jnp.where(vis, s, -jnp.inf)
    if pv == "uint8":  # P anchored at the block's own row max (8-bit FMHA)
      mt = jnp.max(s, axis=1)
      e = jnp.exp2(s - jnp.where(mt == -jnp.inf, 0.0, mt)[:, None])
      lt = jnp.sum(e, axis=1)
      p = (common.round_probability(e, 255) - 128.0).astype(jnp.int8)
      pv_blk = _dot(p, v_ref[:, ks], i32, 1) + 128 * colsum_ref[j, :][None, :]
      m_new = jnp.maximum(m, mt)
      m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      a_prev, a_cur = jnp.exp2(m - m_ref), jnp.exp2(mt - m_ref)
      return (m_new, a_prev * l + a_cur * lt,
              a_prev[:, None] * o + a_cur[:, None] * pv_blk.astype(f32))
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    e = jnp.exp2(s - m_ref[:, None])
    alpha = jnp.exp2(m - m_ref)
    if pv == "int8":
      p = common.round_probability(e, 127)
      l = alpha * l + jnp.sum(p, axis=1)
      pv_blk = _dot(p.astype(jnp.int8), v_ref[:, ks], i32, 1).astype(f32)
      if has_vbs:
        pv_blk = pv_blk * vbs_ref[j]
    elif pv == "fp8":  # P * 448 and V per channel in float8_e4m3fn
      l = alpha * l + jnp.sum(e, axis=1)
      p8, v8 = (e * FP8_MAX).astype(jnp.float8_e4m3fn), v_ref[:, ks]
      if fp8_dot_in_f32:  # the CPU has no fp8 dot (values are exact in f32)
        p8, v8 = p8.astype(f32), v8.astype(f32)
      pv_blk = _dot(p8, v8, f32, 1)
    else:  # "fp16"
      l = alpha * l + jnp.sum(e, axis=1)
      pv_blk = _dot(e.astype(jnp.float16), v_ref[ks, :], f32, 0)
    return m_new, l, alpha[:, None] * o + pv_blk

  lo, full_lo, full_hi, hi = (range_ref[c] for c in range(4))
  init = (jnp.full((block_q,), -jnp.inf, f32), jnp.zeros((block_q,), f32),
          jnp.zeros((block_q, dv), f32))
  masked = functools.partial(body, masked=True)
  carry = lax.fori_loop(lo, full_lo, masked, init)
  carry = lax.fori_loop(full_lo, full_hi,
                        functools.partial(body, masked=False), carry)
  _, l, o = lax.fori_loop(full_hi, hi, masked, carry)
  empty = l == 0
  out = o / jnp.where(empty, 1.0, l)[:, None]
  if has_epilogue:  # per-channel output scale and shift (e.g. V's mean)
    scaled = out * scale_ref[...][None, :]
    if common.interpret():
      # XLA:CPU contracts the product into the add or not as the program
      # around the kernel lets it fuse (a shard_map body and the whole call
      # differed by an ulp); rounded once there, the same in every program
      scaled = jax.lax.optimization_barrier(scaled)
    out = scaled + shift_ref[...][None, :]
  o_ref[...] = jnp.where(empty[:, None], 0.0, out).astype(o_ref.dtype)


def quantized_attention(q8, q_scale, k8, k_scale, v, kv_lens, bias, mask, *,
                        pv, is_causal, params, qk="int8", v_block_scale=None,
                        v_colsum=None, q_block_bias=None, bias_rows=None,
                        out_scale=None, out_shift=None,
                        out_dtype=jnp.float32, index_mask=None):
  """Runs the kernel on quantized BTNH inputs.

  Args:
    q8: int8 ``[B, T, N, D]``; q_scale float32 ``[B, T, N]`` (times
      ``sm_scale * log2 e``); k8: int8 ``[B, S, K, D]``; k_scale ``[B, S, K]``;
      for ``qk="int4"`` q8 and k8 are int4 values packed in halves,
      ``[..., D / 2]`` (unpacked by :func:`common.int4_halves`).
    v: int8 / float8_e4m3fn ``[B, K, Dv, S]`` (transposed) for ``pv``
      "int8"/"uint8" / "fp8", float16
      ``[B, S, K, Dv]`` for "fp16"; kv_lens int32 ``[B]``; bias/mask
      ``[B, N, T, S]`` or None.
    v_block_scale: float32 ``[B, K, S / block_k]`` or None.
    v_colsum: int32 ``[B, K, S / block_k, Dv]`` (column sums of each int8 V
      block), needed for ``pv="uint8"``.
    q_block_bias: float32 ``[B, N, ceil(T / bias_rows), S]``, a score bias
      (base 2) shared by each block of ``bias_rows`` query rows
      (SageAttention's ``q_mean K^T``; ``bias_rows`` a power of two), or None.
    out_scale, out_shift: float32 ``[B, K, Dv]``: the output is
      ``O / l * out_scale + out_shift`` (rows that see no key stay 0).
    index_mask: query lengths, alignment, window and segment ids
      (:class:`common.IndexMask`), or None.
  Returns:
    ``[B, T, N, Dv]`` in ``out_dtype``.
  """
  if qk not in QK_TYPES or pv not in PV_TYPES:
    raise ValueError(f"qk must be one of {QK_TYPES} and pv one of "
                     f"{PV_TYPES}, got {qk!r}, {pv!r}")
  b, t, n, d = q8.shape
  s_len, nk = k8.shape[1], k8.shape[2]
  group = n // nk
  dv = v.shape[2] if pv != "fp16" else v.shape[3]
  bq = min(params.block_q, max(16, pl.next_power_of_2(t)))
  if q_block_bias is not None:  # a kernel block must not straddle two
    bq = min(bq, bias_rows)
  bk = params.block_k
  # int4: d is the packed width; zero bytes pad both halves (the product is
  # unchanged), to at least one 8-bit tensor-core K step (32) per half.
  d_pad = max(pl.next_power_of_2(d), 16 if qk == "int8" else 32)
  dv_pad = max(pl.next_power_of_2(dv), 16)
  t_pad, s_pad = common.round_up(t, bq), common.round_up(s_len, bk)
  pad = common.pad_axis
  q8 = pad(pad(q8, 1, t_pad), 3, d_pad)
  qs = pad(q_scale, 1, t_pad).transpose(0, 2, 1)          # [B, N, T]
  k8 = pad(pad(k8, 1, s_pad), 3, d_pad)
  ks = pad(k_scale, 1, s_pad).transpose(0, 2, 1)          # [B, K, S]
  if pv == "fp16":
    v = pad(pad(v, 1, s_pad), 3, dv_pad)
    v_spec = pl.BlockSpec((None, s_pad, None, dv_pad),
                          lambda i, bi, h: (bi, 0, h // group, 0))
  else:
    v = pad(pad(v, 3, s_pad), 2, dv_pad)
    v_spec = pl.BlockSpec((None, None, dv_pad, s_pad),
                          lambda i, bi, h: (bi, h // group, 0, 0))
  bounds, ranges, segments = common.index_operands(
      kv_lens, index_mask, t=t, s=s_len, is_causal=is_causal, t_pad=t_pad,
      s_pad=s_pad, block_q=bq, block_k=bk, has_mask=mask is not None)
  args = [q8, qs, k8, ks, v, bounds, ranges, *segments]
  in_specs = [
      pl.BlockSpec((None, bq, None, d_pad), lambda i, bi, h: (bi, i, h, 0)),
      pl.BlockSpec((None, None, bq), lambda i, bi, h: (bi, h, i)),
      pl.BlockSpec((None, s_pad, None, d_pad),
                   lambda i, bi, h: (bi, 0, h // group, 0)),
      pl.BlockSpec((None, None, s_pad), lambda i, bi, h: (bi, h // group, 0)),
      v_spec,
      pl.BlockSpec((None, 4), lambda i, bi, h: (bi, 0)),
      pl.BlockSpec((None, None, 4), lambda i, bi, h: (bi, i, 0)),
  ]
  if segments:
    in_specs += [pl.BlockSpec((None, bq), lambda i, bi, h: (bi, i)),
                 pl.BlockSpec((None, s_pad), lambda i, bi, h: (bi, 0))]
  nb = s_pad // bk
  if v_block_scale is not None:
    args.append(pad(v_block_scale, 2, nb))
    in_specs.append(pl.BlockSpec((None, None, nb),
                                 lambda i, bi, h: (bi, h // group, 0)))
  if v_colsum is not None:
    args.append(pad(pad(v_colsum, 2, nb), 3, dv_pad))
    in_specs.append(pl.BlockSpec((None, None, nb, dv_pad),
                                 lambda i, bi, h: (bi, h // group, 0, 0)))
  if q_block_bias is not None:
    per = bias_rows // bq  # kernel blocks per bias row
    args.append(pad(q_block_bias, 3, s_pad))
    in_specs.append(pl.BlockSpec((None, None, None, s_pad),
                                 lambda i, bi, h: (bi, h, i // per, 0)))
  if out_scale is not None:
    for x in (out_scale, out_shift):
      args.append(pad(x.astype(jnp.float32), 2, dv_pad))
      in_specs.append(pl.BlockSpec((None, None, dv_pad),
                                   lambda i, bi, h: (bi, h // group, 0)))
  for x, dtype in ((bias, jnp.float32), (mask, jnp.int8)):
    if x is not None:
      args.append(pad(pad(x.astype(dtype), 2, t_pad), 3, s_pad))
      in_specs.append(pl.BlockSpec((None, None, bq, s_pad),
                                   lambda i, bi, h: (bi, h, i, 0)))
  kernel = functools.partial(
      _quant_kernel, qk=qk, pv=pv, block_q=bq, block_k=bk,
      has_segments=bool(segments), has_vbs=v_block_scale is not None,
      has_colsum=v_colsum is not None, has_qbias=q_block_bias is not None,
      has_epilogue=out_scale is not None,
      has_bias=bias is not None, has_mask=mask is not None,
      fp8_dot_in_f32=common.interpret())
  out = pl.pallas_call(
      kernel, grid=(t_pad // bq, b, n), in_specs=in_specs,
      out_specs=pl.BlockSpec((None, bq, None, dv_pad),
                             lambda i, bi, h: (bi, i, h, 0)),
      out_shape=jax.ShapeDtypeStruct((b, t_pad, n, dv_pad), out_dtype),
      compiler_params=plgpu.CompilerParams(num_warps=params.num_warps,
                                           num_stages=params.num_stages),
      interpret=common.interpret(), name=f"jaxattn_quant_{pv}_fwd")(*args)
  return out[:, :t, :, :dv]


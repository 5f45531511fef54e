"""The quantized methods' kernel inputs, shared by both GPU backends (the
Triton kernel of :mod:`pallas_kernels.quantized` and the Hopper kernel of
:mod:`pallas_kernels.mosaic`) and by the benchmark's kernel-alone timings.

:func:`kernel_inputs` quantizes with the references' arithmetic, bit for
bit, and lays the result out the way the kernels take it.  Q and K go
through one Pallas kernel (:func:`rows_operand`, by way of
:func:`fused_qk`): each read once after its mean, with per-row query scales
that fold in ``scale * log2 e`` (the softmax runs in base 2), per-key K
scales, and SageAttention2's smoothing bias from the same key tiles.  The
8-bit V is written once by another (:func:`v_operand`), transposed to ``[B,
K, D, S]`` (the key dimension contiguous, as the 8-bit tensor-core PV
operand wants), beside the per-channel epilogue ``O / l * out_scale +
out_shift``.  Per-tensor ("tensor") scales keep the BTNH XLA quantizers
(:func:`sage_inputs`, :func:`int8_inputs`, :func:`fp8_inputs`, also the
bit-for-bit checks of the kernels).  SageAttention2's int4 Q and K go to
the Triton kernel packed two per byte
(:func:`jaxattn.quant.pack_int4_halves`: half the bytes moved and held; the
H100 has no int4 tensor cores, the kernel unpacks to int8 in registers);
``pack_int4=False`` keeps them in int8 containers (the Mosaic kernel's int8
path).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from jaxattn import fp8 as fp8_ref
from jaxattn import int_flash as int8_ref
from jaxattn import quant
from jaxattn import sage as sage_ref
from pallas_kernels import common

LOG2E = math.log2(math.e)


def kv_heads_last(x):
  """``[B, S, K, D] -> [B, K, D, S]`` (the 8-bit PV operand layout)."""
  return x.transpose(0, 2, 3, 1)


def _v_kernel(v_ref, len_ref, shift_ref, inv_c_ref, inv_r_ref, o_ref, *,
              block_s, key_order):
  """One ``[block_s, D]`` tile of V: ``y = (where(visible, v, 0) - shift) *
  inv_c * inv_r``, quantized and stored transposed ``[D, block_s]``; with
  ``key_order`` the keys of each 16-key chunk in the Mosaic kernel's
  register-operand order (key ``8h + 2t + l`` to position ``4t + 2h + l``,
  :data:`pallas_kernels.mosaic.KEY_PERMUTATION`)."""
  j = pl.program_id(2)
  rows = j * block_s + jnp.arange(block_s)
  visible = (rows < len_ref[0])[:, None]
  x = jnp.where(visible, v_ref[...].astype(jnp.float32), 0.0)
  y = jnp.where(visible, x - shift_ref[...][None, :], 0.0)
  y = y * inv_c_ref[...][None, :] * inv_r_ref[...][:, None]
  if o_ref.dtype == jnp.int8:
    y = jnp.clip(common.round_half_even(y), -127.0, 127.0)
  else:                         # float8_e4m3fn
    y = jnp.clip(y, -quant.FP8_MAX, quant.FP8_MAX)
  if key_order:
    d = y.shape[1]
    y = y.reshape(block_s // 16, 2, 4, 2, d).transpose(0, 2, 1, 3, 4)
    y = y.reshape(block_s, d)
  o_ref[...] = y.T.astype(o_ref.dtype)


def v_operand(v, kv_lens, *, shift, inv_channel, inv_row, dtype,
              key_order=False, block_s=128):
  """The 8-bit V of the PV matmul in one pass (a Pallas kernel): ``[B, S, K,
  D]`` float -> ``[B, K, D, S]`` ``dtype`` (int8: ``clip(round(y), -127,
  127)``; float8_e4m3fn: ``fl(clip(y, -448, 448))``) with ``y = (v - shift)
  * inv_channel * inv_row`` for keys below ``kv_lens`` and 0 beyond: the
  quantizers' V values bit for bit (one of the two factors is 1; the
  rounding is :func:`common.round_half_even`, which no fused multiply-add
  can absorb).
  ``shift``, ``inv_channel``: float32 ``[B, K, D]``; ``inv_row``: ``[B, K,
  S]``.  XLA's transpose of the 8-bit result cost 0.2-0.47 ms at
  2x32x8192x128 (run20): this reads V once and writes its 8-bit copy.
  ``key_order``: the keys in the Mosaic kernel's register-operand order
  (:func:`pallas_kernels.mosaic.key_order`), ``S`` padded to a multiple of
  16."""
  b, s, nk, v_dim = v.shape
  s_pad = common.round_up(s, block_s)
  d_pad = pl.next_power_of_2(v_dim)  # blocks: powers of two, none crosses
  v = common.pad_axis(common.pad_axis(v, 1, s_pad), 3, d_pad)  # an edge
  inv_row = common.pad_axis(inv_row.astype(jnp.float32), 2, s_pad)
  shift, inv_channel = (common.pad_axis(x.astype(jnp.float32), 2, d_pad)
                        for x in (shift, inv_channel))
  d = d_pad
  chan = pl.BlockSpec((None, None, d), lambda bi, h, j: (bi, h, 0))
  out = pl.pallas_call(
      functools.partial(_v_kernel, block_s=block_s, key_order=key_order),
      grid=(b, nk, s_pad // block_s),
      in_specs=[pl.BlockSpec((None, block_s, None, d),
                             lambda bi, h, j: (bi, j, h, 0)),
                pl.BlockSpec((None, 1), lambda bi, h, j: (bi, 0)),
                chan, chan,
                pl.BlockSpec((None, None, block_s), lambda bi, h, j: (bi, h, j))],
      out_specs=pl.BlockSpec((None, None, d, block_s),
                             lambda bi, h, j: (bi, h, 0, j)),
      out_shape=jax.ShapeDtypeStruct((b, nk, d, s_pad), dtype),
      compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
      interpret=common.interpret(), name="jaxattn_v_operand",
  )(v, jnp.asarray(kv_lens, jnp.int32).reshape(b, 1),
    shift.astype(jnp.float32), inv_channel.astype(jnp.float32), inv_row)
  return out[:, :, :v_dim, :common.round_up(s, 16) if key_order else s]


def _rows_kernel(x_ref, len_ref, *refs, group, qmax, shift, bias_chunk):
  """One ``[block, D]`` tile: ``y = where(row < len, x - shift, 0)``; per
  group of ``group`` rows ``scale = fl(amax|y| * fl(1 / qmax))``; the 8-bit
  ``y * fl(1 / scale)`` (int8: ``clip(rint(.), -qmax, qmax)``; fp8:
  ``fl(clip(., -448, 448))``); with ``bias_chunk`` also ``q_m y^T`` in
  float32 (SageAttention2's ``dS = q_m K_smoothed^T``) for every query
  block mean ``q_m`` of the key head, ``bias_chunk`` rows at a time."""
  refs = list(refs)
  shift_ref = refs.pop(0) if shift else None
  qm_ref = refs.pop(0) if bias_chunk else None
  o_ref, scale_ref, *bias_ref = refs
  block = x_ref.shape[0]
  rows = pl.program_id(1) * block + jnp.arange(block)
  keep = (rows < len_ref[0])[:, None]
  y = jnp.where(keep, x_ref[...].astype(jnp.float32), 0.0)
  if shift:
    y = jnp.where(keep, y - shift_ref[...][None, :], 0.0)
  amax = jnp.abs(y).max(axis=1)
  if group > 1:
    per_group = amax.reshape(block // group, group).max(axis=1)
    amax = jnp.broadcast_to(per_group[:, None],
                            (block // group, group)).reshape(block)
  scale = amax * np.float32(1.0 / qmax)
  z = y * common.reciprocal_rn(scale)[:, None]
  if o_ref.dtype == jnp.int8:
    z = jnp.clip(common.round_half_even(z), -qmax, qmax)
  else:
    z = jnp.clip(z, -quant.FP8_MAX, quant.FP8_MAX)
  o_ref[...] = z.astype(o_ref.dtype)
  scale_ref[...] = scale
  if bias_chunk:
    # Three TF32 tensor-core products (hi*hi + hi*lo + lo*hi): float32
    # accuracy; Triton's IEEE float32 dot runs on the FMA units at a few
    # percent of their peak (11.4 ms for this kernel at 2x32x8192x128, run26).
    precision = (jax.lax.Precision.HIGHEST if common.interpret()
                 else jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3)

    def chunk(c, carry):
      at = pl.ds(pl.multiple_of(c * bias_chunk, bias_chunk), bias_chunk)
      bias_ref[0][at, :] = jax.lax.dot_general(
          qm_ref[at, :], y, (((1,), (1,)), ((), ())),
          preferred_element_type=jnp.float32, precision=precision)
      return carry
    jax.lax.fori_loop(0, qm_ref.shape[0] // bias_chunk, chunk, 0)


def rows_operand(x, lens, *, group: int, dtype, bits: int = 8, shift=None,
                 bias_q_mean=None, block: int = 128,
                 num_warps: int | None = None, bias_chunk: int | None = None):
  """Q or K quantized per group of rows in one pass (a Pallas kernel).

  ``x`` ``[B, L, H, D]`` float; ``lens`` int32 ``[B]`` (rows at or beyond
  are zeros: the key padding, or ``L`` for queries); ``group`` rows per
  scale, a power of two dividing ``block`` (1: per token); ``dtype`` int8
  (``qmax = 2^(bits-1) - 1``) or float8_e4m3fn (``qmax = 448``); ``shift``
  float32 ``[B, 1, H, D]`` (the key mean) or ``[B, L / block, H, D]`` (one
  per tile: the query-block means, ``block = block_q``), subtracted before
  the scales.  The values and scales of the references' quantizers bit for
  bit (``jaxattn.quant.quantize_int`` / ``quantize_fp8`` of ``fl(amax *
  fl(1/qmax))``; exact rounding on the GPU through
  :func:`common.round_half_even` and :func:`common.reciprocal_rn`).

  ``bias_q_mean`` float32 ``[B, H, R, D]`` (SageAttention2's query-block
  means, ``R`` rows per key head): also returns ``bias`` ``[B, H, R, L]`` =
  ``q_m y^T`` in float32 (accumulation order aside, the reference's
  ``q_m K_smoothed^T``) from the same tile, so the smoothed float32 keys
  never reach memory.

  ``num_warps`` (default 4, 8 with the bias) and ``bias_chunk`` (query-mean
  rows per bias product, 16 to 64; default the largest that divides) are
  the kernel's knobs: run28 at 2x32x8192x128 timed the key pass with the
  bias at 0.52 / 0.41 ms (4 / 8 warps, 64 rows), 0.63-0.95 ms with 16 or
  32 rows, against 0.10 ms without the bias.

  Returns ``(x8 [B, L, H, D], scale [B, L, H] float32 per row, bias or
  None)``.
  """
  b, n_rows, h, d = x.shape
  d_block = pl.next_power_of_2(d)
  # Rows padded to whole tiles and D to a power of two (copies only then):
  # the Triton lowering does not mask the stores of a tile past the end of
  # an axis (run27: a partial last tile wrote over the next batch's first
  # rows), so no tile may cross one.
  rows_pad = common.round_up(n_rows, block)
  x = common.pad_axis(common.pad_axis(x, 1, rows_pad), 3, d_block)
  grid = (b, rows_pad // block, h)
  qmax = quant.FP8_MAX if dtype == jnp.float8_e4m3fn else quant.qmax(bits)
  in_specs = [pl.BlockSpec((None, block, None, d_block),
                           lambda bi, j, hi: (bi, j, hi, 0)),
              pl.BlockSpec((None, 1), lambda bi, j, hi: (bi, 0))]
  args = [x, jnp.minimum(jnp.asarray(lens, jnp.int32), n_rows).reshape(b, 1)]
  if shift is not None:
    per_tile = shift.shape[1] > 1
    in_specs.append(pl.BlockSpec(
        (None, None, None, d_block),
        lambda bi, j, hi: (bi, j if per_tile else 0, hi, 0)))
    args.append(common.pad_axis(shift.astype(jnp.float32), 3, d_block))
  out_specs = [pl.BlockSpec((None, block, None, d_block),
                            lambda bi, j, hi: (bi, j, hi, 0)),
               pl.BlockSpec((None, block, None), lambda bi, j, hi: (bi, j, hi))]
  out_shape = [jax.ShapeDtypeStruct(x.shape, dtype),
               jax.ShapeDtypeStruct((b, rows_pad, h), jnp.float32)]
  if bias_q_mean is None:
    bias_chunk = 0
  else:
    r = bias_q_mean.shape[2]
    r_pad = common.round_up(r, 16)
    bias_chunk = bias_chunk or next(c for c in (64, 32, 16) if r_pad % c == 0)
    r_pad = common.round_up(r_pad, bias_chunk)
    in_specs.append(pl.BlockSpec((None, None, r_pad, d_block),
                                 lambda bi, j, hi: (bi, hi, 0, 0)))
    args.append(common.pad_axis(common.pad_axis(
        bias_q_mean.astype(jnp.float32), 2, r_pad), 3, d_block))
    out_specs.append(pl.BlockSpec((None, None, r_pad, block),
                                  lambda bi, j, hi: (bi, hi, 0, j)))
    out_shape.append(jax.ShapeDtypeStruct((b, h, r_pad, rows_pad),
                                          jnp.float32))
  outs = pl.pallas_call(
      functools.partial(_rows_kernel, group=group, qmax=qmax,
                        shift=shift is not None, bias_chunk=bias_chunk),
      grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=pl_triton.CompilerParams(
          num_warps=num_warps or (8 if bias_chunk else 4), num_stages=2),
      interpret=common.interpret(), name="jaxattn_rows_operand",
  )(*args)
  bias = (outs[2][:, :, :bias_q_mean.shape[2], :n_rows] if bias_chunk
          else None)
  return outs[0][:, :n_rows, :, :d], outs[1][:, :n_rows], bias


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


# The quantizers below are the references' (jaxattn.sage.sage_quantize,
# jaxattn.int_flash.int8_quantize, jaxattn.fp8.fp8_quantize) written on the
# BTNH arrays directly instead of per head through vmap: the same values
# (tests/test_prepare.py checks them bit for bit), in fewer passes over
# memory and without the transposes that vmap's head axis costs.


def _group_amax(x, group: int):
  """``max |x|`` of ``x`` ``[B, L, H, D]`` over groups of ``group`` rows (and
  ``D``): ``[B, ceil(L / group), H]`` (a group longer than ``L`` is one)."""
  n = x.shape[1]
  group = max(1, min(group, n))
  amax = jnp.abs(x).max(axis=-1)                         # [B, L, H]
  amax = jnp.pad(amax, [(0, 0), (0, -n % group), (0, 0)])
  return amax.reshape(amax.shape[0], -1, group, amax.shape[2]).max(axis=2)


def _expand(per_group, group: int, n: int):
  """``[B, G, H]`` per-group values as one per row ``[B, n, H]``."""
  return jnp.repeat(per_group, max(1, min(group, n)), axis=1)[:, :n]


def _group_scales(x, group: int, bits: int):
  """Per-row scales ``fl(amax * fl(1/qmax))`` of ``x`` ``[B, L, H, D]`` over
  groups of rows: ``[B, L, H]`` (:func:`jaxattn.sage._row_scales`)."""
  rcp = np.float32(1.0 / quant.qmax(bits))
  per_group = sage_ref._rounded(_group_amax(x, group) * rcp)
  return _expand(per_group, group, x.shape[1])


def _valid_keys(k, kv_lens):
  """``[B, S, 1, 1]``: key ``s`` of batch ``b`` is below ``kv_lens[b]``."""
  kv_lens = jnp.asarray(kv_lens, jnp.int32)
  return (jnp.arange(k.shape[1])[None, :] < kv_lens[:, None])[:, :, None, None]


def _key_mean(x, kv_lens):
  """SageAttention2's token mean ``fl(sum_s x * fl(1 / n))`` over the ``n =
  min(kv_len, S)`` visible keys of ``x`` ``[B, S, K, D]``: ``[B, K, D]``
  float32 (:func:`jaxattn.sage.quantize_kv_head`'s ``k_mean``)."""
  s = x.shape[1]
  kv_lens = jnp.asarray(kv_lens, jnp.int32)
  count = quant.reciprocal(jnp.maximum(jnp.minimum(kv_lens, s), 1))
  visible = jnp.where(_valid_keys(x, kv_lens), x.astype(jnp.float32), 0.0)
  return sage_ref._rounded(visible.sum(axis=1) * count[:, None, None])


def _query_block_means(q, block_q: int):
  """SageAttention2's query-block means ``fl(sum x * fl(1 / count))`` of
  ``q`` ``[B, T, N, D]`` over blocks of ``block_q`` rows (the last one
  partial): ``[B, ceil(T / block_q), N, D]`` float32, and ``q`` float32
  padded to whole blocks ``[B, nqb, block_q, N, D]``."""
  b, t, n, d = q.shape
  nqb = -(-t // block_q)
  qf = jnp.pad(q.astype(jnp.float32),
               [(0, 0), (0, nqb * block_q - t), (0, 0), (0, 0)])
  qf = qf.reshape(b, nqb, block_q, n, d)
  counts = jnp.clip(t - jnp.arange(nqb) * block_q, 1, block_q)
  rcp = quant.reciprocal(counts.astype(jnp.float32))[None, :, None, None]
  return sage_ref._rounded(qf.sum(axis=2) * rcp), qf


def int8_inputs(q, k, v, kv_lens, *, config, v_values: bool = True,
                qk_values: bool = True) -> dict:
  """:func:`jaxattn.int_flash.int8_quantize` on BTNH arrays (same entries;
  ``v_values=False`` leaves out the int8 V, keeping its scale: the kernels
  take V from :func:`v_operand`; ``qk_values=False`` leaves out Q and K and
  their scales: :func:`fused_qk` makes them)."""
  f32 = jnp.float32
  valid = _valid_keys(k, kv_lens)
  out = {}
  if qk_values:
    q8, q_scale = int8_ref._per_token(q)
    k8, k_scale = int8_ref._per_token(jnp.where(valid, k.astype(f32), 0.0))
    out = dict(q=q8, q_scale=q_scale, k=k8, k_scale=k_scale)
  vf = jnp.where(valid, v.astype(f32), 0.0)
  if config.pv_dtype == "fp16":
    out["v"] = vf.astype(jnp.float16)
    return out
  if config.v_granularity == "tensor":
    out["v_scale"] = jnp.abs(vf).max(axis=(1, 3)) * int8_ref.RCP_R  # [B, K]
    rows = out["v_scale"][:, None, :, None]
  else:                                                     # [B, nb, K]
    out["v_scale"] = _group_amax(vf, config.block_k) * int8_ref.RCP_R
    rows = _expand(out["v_scale"], config.block_k, vf.shape[1])[..., None]
  if v_values:
    out["v"] = int8_ref._quantize(vf, rows)
  return out


def fp8_inputs(q, k, v, kv_lens, *, config, v_values: bool = True,
               qk_values: bool = True) -> dict:
  """:func:`jaxattn.fp8.fp8_quantize` on BTNH arrays (same entries;
  ``v_values=False`` leaves out the fp8 V, keeping its scale;
  ``qk_values=False`` leaves out Q, K and their scales)."""
  f32 = jnp.float32
  valid = _valid_keys(k, kv_lens)
  block = config.granularity == "block"

  def quantize(x, group, values=True):
    if not block:
      sc = jnp.abs(x).max(axis=(1, 3)) * fp8_ref.RCP_FP8_MAX   # [B, H]
      inv = quant.reciprocal(sc)[:, None, :, None]
    else:
      sc = _group_amax(x, group) * fp8_ref.RCP_FP8_MAX         # [B, G, H]
      inv = quant.reciprocal(_expand(sc, group, x.shape[1]))[..., None]
    return (quant.quantize_fp8(x, inv) if values else None), sc

  v8, sv = quantize(jnp.where(valid, v.astype(f32), 0.0), config.block_k,
                    v_values)
  out = dict(v_scale=sv)
  if qk_values:
    q8, sq = quantize(q.astype(f32), config.block_q)
    k8, sk = quantize(jnp.where(valid, k.astype(f32), 0.0), config.block_k)
    out.update(q=q8, q_scale=sq, k=k8, k_scale=sk)
  return {**out, "v": v8} if v_values else out


def sage_inputs(q, k, v, kv_lens, *, scale: float, config,
                v_values: bool = True) -> dict:
  """SageAttention2's pre-processing written on the BTNH arrays directly:
  the same quantized values and scales as :func:`jaxattn.sage.sage_quantize`
  (the reference, per head through ``vmap``), in fewer passes and without
  its per-head layouts, the float32 smoothed-key copy or the transposes.

  Returns ``q`` int8 ``[B, T, N, D]``, ``q_scale_folded`` ``[B, T, N]``,
  ``k`` int8 ``[B, S, K, D]``, ``k_scale`` ``[B, S, K]``, ``v``
  (float8_e4m3fn or float16 ``[B, S, K, D]``), ``v_scale`` (fp8) and
  ``v_mean`` ``[B, K, D]``, and ``smooth_bias`` ``[B, N, nqb, S]`` (base e,
  ``q_m K_smoothed^T``) when ``smooth_q``.  ``v_values=False`` leaves out
  the fp8 V, keeping its scale and mean.
  """
  f32 = jnp.float32
  b, t, n, d = q.shape
  s, nk = k.shape[1], k.shape[2]
  g = n // nk
  bits = config.bits
  kv_lens = jnp.asarray(kv_lens, jnp.int32)
  valid = _valid_keys(k, kv_lens)
  out = {}

  k_mean = (_key_mean(k, kv_lens) if config.smooth_k
            else jnp.zeros((b, nk, d), f32))             # [B, K, D]
  ks = jnp.where(valid, k.astype(f32) - k_mean[:, None], 0.0)
  k_scale = _group_scales(ks, sage_ref._k_group(config, s), bits)
  out["k"] = quant.quantize_int(ks, quant.reciprocal(k_scale)[..., None], bits)
  out["k_scale"] = k_scale
  out.update(sage_v_stats(v, kv_lens, config))
  if config.pv_dtype == "fp8" and v_values:
    vs = jnp.where(valid, v.astype(f32) - out["v_mean"][:, None], 0.0)
    out["v"] = quant.quantize_fp8(vs, quant.reciprocal(out["v_scale"])[:, None])

  bq = config.block_q
  q_mean, qf = _query_block_means(q, bq)                 # [B, nqb, N, D]
  nqb = qf.shape[1]
  if config.smooth_q:
    qm = q_mean.reshape(b, nqb, nk, g, d)
    out["smooth_bias"] = jnp.einsum(
        "bqkgd,bskd->bkgqs", qm, ks, precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=f32).reshape(b, n, nqb, s)
    real = (jnp.arange(nqb * bq) < t).reshape(1, nqb, bq, 1, 1)
    qf = jnp.where(real, qf - q_mean[:, :, None], 0.0)
  qs = qf.reshape(b, nqb * bq, n, d)
  q_scale = _group_scales(qs, sage_ref._q_group(config, nqb * bq), bits)
  q_scale, qs = q_scale[:, :t], qs[:, :t]
  out["q"] = quant.quantize_int(qs, quant.reciprocal(q_scale)[..., None], bits)
  out["q_scale_folded"] = q_scale * sage_ref.log2_scale(scale)
  return out


def _fits_rows_kernel(*groups) -> bool:
  """:func:`rows_operand` takes groups of 1 to 128 rows (powers of two);
  "tensor" scales (one amax over the whole sequence) stay with XLA."""
  return all(g in (1, 2, 4, 8, 16, 32, 64, 128) for g in groups)


def fused_qk(method: str, q, k, kv_lens, *, scale: float,
             config) -> dict | None:
  """The 8-bit (or int4-valued) Q and K of ``method`` by :func:`rows_operand`:
  each read once after its mean (SageAttention2's smoothing; XLA's reduction
  pass), the SageAttention2 bias from the same key tiles.  The values and
  scales of :func:`sage_inputs` / :func:`int8_inputs` / :func:`fp8_inputs`
  bit for bit; ``q_block_bias`` (``c q_m K_smoothed^T``, ``c = scale log2
  e`` folded into ``q_m``) to float32 accumulation order.  None where a
  granularity needs a whole-sequence amax ("tensor"): the XLA quantizers
  then.

  Returns ``q8``, ``q_scale`` ``[B, T, N]`` (unfolded), ``k8``, ``k_scale``
  ``[B, S, K]``, and for "sage" ``q_block_bias`` ``[B, N, nqb, S]`` or
  None.
  """
  b, t, n, d = q.shape
  s, nk = k.shape[1], k.shape[2]
  kv_lens = jnp.asarray(kv_lens, jnp.int32)
  q_lens = jnp.full((b,), t, jnp.int32)
  if method == "int8":
    q8, q_scale, _ = rows_operand(q, q_lens, group=1, dtype=jnp.int8)
    k8, k_scale, _ = rows_operand(k, kv_lens, group=1, dtype=jnp.int8)
    return dict(q8=q8, q_scale=q_scale, k8=k8, k_scale=k_scale)
  if method == "fp8":
    if config.granularity != "block" or not _fits_rows_kernel(
        config.block_q, config.block_k):
      return None
    fp8 = jnp.float8_e4m3fn
    q8, q_scale, _ = rows_operand(q, q_lens, group=config.block_q, dtype=fp8,
                                  block=max(128, config.block_q))
    k8, k_scale, _ = rows_operand(k, kv_lens, group=config.block_k, dtype=fp8,
                                  block=max(128, config.block_k))
    return dict(q8=q8, q_scale=q_scale, k8=k8, k_scale=k_scale)
  if method != "sage":
    raise ValueError(f"no quantized kernel inputs for method {method!r}")
  bq = config.block_q
  q_group = sage_ref._q_group(config, common.round_up(t, bq))
  k_group = sage_ref._k_group(config, s)
  if not _fits_rows_kernel(q_group, k_group, bq):
    return None
  f32 = jnp.float32
  k_mean = _key_mean(k, kv_lens) if config.smooth_k else jnp.zeros(
      (b, nk, d), f32)
  q_mean = bias_q = None
  if config.smooth_q:
    q_mean, _ = _query_block_means(q, bq)             # [B, nqb, N, D]
    nqb, g = q_mean.shape[1], n // nk  # [B, K, g * nqb, D]: a group's heads
    bias_q = (q_mean * sage_ref.log2_scale(scale)).reshape(
        b, nqb, nk, g, d).transpose(0, 2, 3, 1, 4).reshape(b, nk, g * nqb, d)
  bits = config.bits
  q8, q_scale, _ = rows_operand(
      q, q_lens, group=q_group, dtype=jnp.int8, bits=bits, shift=q_mean,
      block=bq if config.smooth_q else max(128, q_group))
  k8, k_scale, bias = rows_operand(
      k, kv_lens, group=k_group, dtype=jnp.int8, bits=bits,
      shift=k_mean[:, None] if config.smooth_k else None, bias_q_mean=bias_q,
      block=max(128, k_group))
  if bias is not None:                              # [B, N, nqb, S]
    bias = bias.reshape(b, n, -1, s)
  return dict(q8=q8, q_scale=q_scale, k8=k8, k_scale=k_scale,
              q_block_bias=bias)


def sage_v_stats(v, kv_lens, config) -> dict:
  """SageAttention2's V statistics in one reduction pass: ``v_mean``
  ``[B, K, D]`` (zeros without ``smooth_v``) and, for ``pv_dtype="fp8"``,
  ``v_scale = fl(max_s |fl(v - v_mean)| * fl(1/448))`` per channel, the
  same values as :func:`sage_inputs` from the channel's max and min
  (``fl(. - m)`` is monotonic, so ``max |fl(v - m)| = max(fl(v_max - m),
  fl(m - v_min))``) instead of a second pass over the smoothed V; with
  ``pv_dtype="fp16"`` the smoothed float16 ``v``."""
  f32 = jnp.float32
  b, s, nk, d = v.shape
  kv_lens = jnp.asarray(kv_lens, jnp.int32)
  valid = _valid_keys(v, kv_lens)
  vf = v.astype(f32)
  mean = _key_mean(v, kv_lens) if config.smooth_v else jnp.zeros(
      (b, nk, d), f32)
  if config.pv_dtype != "fp8":
    return dict(v_mean=mean, v=jnp.where(valid, vf - mean[:, None], 0.0)
                .astype(jnp.float16))
  hi = jnp.where(valid, vf, -jnp.inf).max(axis=1)
  lo = jnp.where(valid, vf, jnp.inf).min(axis=1)
  amax = jnp.maximum(jnp.maximum(hi - mean, mean - lo), 0.0)
  return dict(v_mean=mean,
              v_scale=sage_ref._rounded(amax * sage_ref.RCP_FP8_MAX))


def kernel_inputs(method: str, q, k, v, kv_lens, *, scale: float,
                  config, pack_int4: bool = True,
                  v_key_order: bool = False, fuse_qk: bool = True) -> dict:
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
  ``v_key_order``: an 8-bit V's keys in the Mosaic kernel's register-operand
  order (``v_keys_ordered`` then says True; see :func:`v_operand`).
  ``fuse_qk=False`` quantizes Q and K with the XLA quantizers instead of
  :func:`fused_qk` (the same values; kept for measurement).
  """
  b, t, n, d = q.shape
  s_len, nk = k.shape[1], k.shape[2]
  kv_shape = (b, nk, v.shape[-1])
  ones = lambda *shape: jnp.ones(shape, jnp.float32)

  def v8(dtype, shift=None, inv_channel=None, inv_row=None):
    """The 8-bit V ``[B, K, D, S]`` in one pass (:func:`v_operand`)."""
    return v_operand(
        v, kv_lens, dtype=dtype,
        shift=jnp.zeros(kv_shape, jnp.float32) if shift is None else shift,
        inv_channel=ones(*kv_shape) if inv_channel is None else inv_channel,
        inv_row=ones(b, nk, s_len) if inv_row is None else inv_row,
        key_order=v_key_order)

  def per_row(per_group, group):  # [B, G, K] -> one per key [B, K, S]
    return _expand(per_group, group, s_len).transpose(0, 2, 1)

  out = dict(qk="int8", q_block_bias=None, bias_rows=None, v_block_scale=None,
             out_scale=None, out_shift=None, v_keys_ordered=False)
  fused = (fused_qk(method, q, k, kv_lens, scale=scale, config=config)
           if fuse_qk else None)
  if method == "sage":
    fp8 = config.pv_dtype == "fp8"
    if fused is None:
      z = sage_inputs(q, k, v, kv_lens, scale=scale, config=config,
                      v_values=False)
      z["q_block_bias"] = (z["smooth_bias"] * sage_ref.log2_scale(scale)
                           if config.smooth_q else None)
    else:
      z = dict(q=fused["q8"], k=fused["k8"], k_scale=fused["k_scale"],
               q_scale_folded=fused["q_scale"] * sage_ref.log2_scale(scale),
               q_block_bias=fused["q_block_bias"],
               **sage_v_stats(v, kv_lens, config))
    q8, k8 = z["q"], z["k"]
    if config.qk_dtype == "int4" and pack_int4:
      q8, k8, out["qk"] = _pack_int4(q8), _pack_int4(k8), "int4"
    out.update(q8=q8, q_scale=z["q_scale_folded"], k8=k8,
               k_scale=z["k_scale"], pv=config.pv_dtype,
               v=(v8(jnp.float8_e4m3fn, shift=z["v_mean"],
                     inv_channel=quant.reciprocal(z["v_scale"]))
                  if fp8 else z["v"]),
               out_scale=(z["v_scale"] / quant.FP8_MAX if fp8
                          else jnp.ones(kv_shape, jnp.float32)),
               out_shift=z["v_mean"])
    if config.smooth_q:
      out["q_block_bias"] = z["q_block_bias"]
      out["bias_rows"] = config.block_q
  elif method == "int8":
    z = int8_inputs(q, k, v, kv_lens, config=config, v_values=False,
                    qk_values=fused is None)
    if fused is not None:
      z.update(q=fused["q8"], q_scale=fused["q_scale"], k=fused["k8"],
               k_scale=fused["k_scale"])
    out.update(q8=z["q"], q_scale=z["q_scale"] * (scale * LOG2E), k8=z["k"],
               k_scale=z["k_scale"], pv=config.pv_dtype, v=z.get("v"))
    if config.pv_dtype == "int8" and config.v_granularity == "block":
      out["v"] = v8(jnp.int8, inv_row=per_row(
          quant.reciprocal(z["v_scale"]), config.block_k))
      out["v_block_scale"] = z["v_scale"].transpose(0, 2, 1)
    elif config.pv_dtype == "int8":
      out["v"] = v8(jnp.int8, inv_channel=_channels(
          quant.reciprocal(z["v_scale"]), kv_shape))
      out["out_scale"] = _channels(z["v_scale"], kv_shape)
      out["out_shift"] = jnp.zeros(kv_shape, jnp.float32)
  elif method == "fp8":
    z = fp8_inputs(q, k, v, kv_lens, config=config, v_values=False,
                   qk_values=fused is None)
    inv_v = quant.reciprocal(z["v_scale"])
    if config.granularity == "block":  # scales [B, groups, heads]
      out["v"] = v8(jnp.float8_e4m3fn, inv_row=per_row(inv_v, config.block_k))
      if fused is None:
        q_scale = jnp.repeat(z["q_scale"], config.block_q, axis=1)[:, :t]
        k_scale = jnp.repeat(z["k_scale"], config.block_k, axis=1)[:, :s_len]
      else:                           # already one per row
        q_scale, k_scale = fused["q_scale"], fused["k_scale"]
        z.update(q=fused["q8"], k=fused["k8"])
      out["v_block_scale"] = z["v_scale"].transpose(0, 2, 1)
      out["out_scale"] = jnp.full(kv_shape, 1.0 / quant.FP8_MAX, jnp.float32)
    else:                              # scales [B, heads]
      out["v"] = v8(jnp.float8_e4m3fn, inv_channel=_channels(inv_v, kv_shape))
      q_scale = jnp.broadcast_to(z["q_scale"][:, None, :], (b, t, n))
      k_scale = jnp.broadcast_to(z["k_scale"][:, None, :], (b, s_len, nk))
      out["out_scale"] = _channels(z["v_scale"] / quant.FP8_MAX, kv_shape)
    out.update(qk="fp8", pv="fp8", q8=z["q"],
               q_scale=q_scale * (scale * LOG2E), k8=z["k"], k_scale=k_scale,
               out_shift=jnp.zeros(kv_shape, jnp.float32))
  else:
    raise ValueError(f"no quantized kernel inputs for method {method!r}")
  out["v_keys_ordered"] = v_key_order and out["pv"] != "fp16"
  return out

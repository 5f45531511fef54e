"""The one-pass quantizer kernels (Pallas, Triton lowering; interpret mode
on CPU) that make the quantized attention kernels' operands:

* :func:`rows_operand`: Q or K, each row tile read once, shifted (a mean),
  scaled per group of rows and rounded to int8 (int4 values) or
  float8_e4m3fn; optionally the score bias ``q_m y^T`` of SageAttention2's
  query smoothing from the same tile;
* :func:`column_stats`: a tensor's sum, max and min per channel over the
  keys (SageAttention2's V mean and per-channel scale);
* :func:`v_operand`: V, read once, shifted and scaled, written 8-bit and
  transposed to ``[B, K, D, S]`` (the key dimension contiguous, as the 8-bit
  tensor-core PV operand wants), optionally with each 16-key chunk in the
  Mosaic kernel's register-operand order.

Rounding is exact on the GPU (:func:`common.round_half_even`,
:func:`common.reciprocal_rn`), so the values equal an XLA quantizer's that
multiplies by a correctly rounded reciprocal and rounds half to even.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import common
from pallas_kernels.common import FP8_MAX

# P's key order as the 8-bit wgmma reads it from registers in the Mosaic
# kernel: within each chunk of 16 keys, thread t of a quad holds keys (2t,
# 2t+1, 8+2t, 9+2t) in the accumulator layout and the wgmma reads them as
# keys 4t..4t+3; V's keys are stored in this order.
KEY_PERMUTATION = np.array([0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14,
                            15])


def key_order(n):
  """Key indices of ``n`` keys (a multiple of 16) in the register-operand
  P's order: ``16c + KEY_PERMUTATION[i]`` at position ``16c + i``."""
  return (np.arange(n) // 16) * 16 + KEY_PERMUTATION[np.arange(n) % 16]


def _v_kernel(v_ref, len_ref, shift_ref, inv_c_ref, inv_r_ref, o_ref,
              *bad_ref, block_s, key_order):
  """One ``[block_s, D]`` tile of V: ``y = (where(visible, v, 0) - shift) *
  inv_c * inv_r``, quantized and stored transposed ``[D, block_s]``; with
  ``key_order`` the keys of each 16-key chunk in the Mosaic kernel's
  register-operand order (key ``8h + 2t + l`` to position ``4t + 2h + l``,
  :data:`KEY_PERMUTATION`).  With ``bad_ref``, non-finite elements count as
  0 and ``bad_ref`` flags the keys that hold one."""
  j = pl.program_id(2)
  rows = j * block_s + jnp.arange(block_s)
  visible = (rows < len_ref[0])[:, None]
  x = v_ref[...].astype(jnp.float32)
  if bad_ref:
    finite = jnp.isfinite(x)
    bad_ref[0][...] = jnp.where(finite, 0.0, 1.0).max(axis=1)
    x = jnp.where(finite, x, 0.0)
  x = jnp.where(visible, x, 0.0)
  y = jnp.where(visible, x - shift_ref[...][None, :], 0.0)
  y = y * inv_c_ref[...][None, :] * inv_r_ref[...][:, None]
  if o_ref.dtype == jnp.int8:
    y = jnp.clip(common.round_half_even(y), -127.0, 127.0)
  else:                         # float8_e4m3fn
    y = jnp.clip(y, -FP8_MAX, FP8_MAX)
  if key_order:
    d = y.shape[1]
    y = y.reshape(block_s // 16, 2, 4, 2, d).transpose(0, 2, 1, 3, 4)
    y = y.reshape(block_s, d)
  o_ref[...] = y.T.astype(o_ref.dtype)


# The passes' default tiles, the fastest by GPU time on the H100
# (023694b; docs/design.md):
# Q/K passes in tiles of 32 rows (or one group, where a group is larger),
# since the per-token and given-scale passes ran near a cast's time in
# 32-row tiles and slower in 128-row ones.  Sage's query-block means
# (``shift="tile_mean"``) and per-tile shifts need one block of rows per
# tile, which their callers give; the key pass with the bias keeps 128 rows
# (da375f1).  V: (keys per tile, warps) per dtype.
# In the interpreter every program is one more step of a loop, so there the
# defaults are the large tiles (the same bits:
# tests/test_prepare.py::test_quantizer_tiles_do_not_change_the_bits).
ROWS_TILE = 32
# Rows the pass with the query-block means (``shift="tile_mean"``, sage's Q:
# 128-row tiles for the means, 32-row scale groups) shifts, scales and stores
# at once after it has summed the whole tile: 0.165 -> 0.125 ms at
# 2x8192x32x128 on the H100.  The other 128-row tiles (the key pass with the
# bias, groups of 128 rows) ran slower in chunks, which would read them
# twice or split the bias products (3dd41f5).
CHUNK_ROWS = 64
V_TILES = {"int8": (64, 8), "float8_e4m3fn": (128, 4)}
INTERPRET_TILES = (128, (128, 4))   # rows; V's (keys, warps)


def _default_tiles():
  """``(rows per Q/K tile, {V dtype: (keys per tile, warps)})`` where the
  kernels run now."""
  if common.interpret():
    rows, v_tiles = INTERPRET_TILES
    return rows, {name: v_tiles for name in V_TILES}
  return ROWS_TILE, V_TILES


def v_operand(v, kv_lens, *, shift, inv_channel, inv_row, dtype,
              key_order=False, flag_nonfinite=False, block_s=None,
              num_warps=None):
  """The 8-bit V of the PV matmul in one pass (a Pallas kernel): ``[B, S, K,
  D]`` float -> ``[B, K, D, S]`` ``dtype`` (int8: ``clip(round(y), -127,
  127)``; float8_e4m3fn: ``fl(clip(y, -448, 448))``) with ``y = (v - shift)
  * inv_channel * inv_row`` for keys below ``kv_lens`` and 0 beyond: the
  quantizers' V values bit for bit (one of the two factors is 1; the
  rounding is :func:`common.round_half_even`, which no fused multiply-add
  can absorb).
  ``shift``, ``inv_channel``: float32 ``[B, K, D]``; ``inv_row``: ``[B, K,
  S]``.  One read of V and one write of its 8-bit copy: XLA would
  transpose the 8-bit result in a second pass.  ``key_order``: the keys in
  the Mosaic kernel's register-operand order (:func:`key_order`), ``S``
  padded to a multiple of 16.

  ``flag_nonfinite``: NaN/Inf elements of ``v`` count as 0, and the second
  result flags the keys that hold one (bool ``[B, K, S]``; else None).
  ``block_s`` (keys per tile) and ``num_warps`` are the kernel's knobs;
  by default :data:`V_TILES` for ``dtype`` on the GPU.

  Returns ``(v8, flags)``."""
  b, s, nk, v_dim = v.shape
  default_block_s, default_warps = _default_tiles()[1].get(
      jnp.dtype(dtype).name, (128, 4))
  block_s, num_warps = block_s or default_block_s, num_warps or default_warps
  if key_order and block_s % 16:
    raise ValueError(f"key_order reorders chunks of 16 keys: block_s must be "
                     f"a multiple of 16, got {block_s}")
  s_pad = common.round_up(s, block_s)
  d_pad = pl.next_power_of_2(v_dim)  # blocks: powers of two, none crosses
  v = common.pad_axis(common.pad_axis(v, 1, s_pad), 3, d_pad)  # an edge
  inv_row = common.pad_axis(inv_row.astype(jnp.float32), 2, s_pad)
  shift, inv_channel = (common.pad_axis(x.astype(jnp.float32), 2, d_pad)
                        for x in (shift, inv_channel))
  d = d_pad
  chan = pl.BlockSpec((None, None, d), lambda bi, h, j: (bi, h, 0))
  per_key = pl.BlockSpec((None, None, block_s), lambda bi, h, j: (bi, h, j))
  out_specs = [pl.BlockSpec((None, None, d, block_s),
                            lambda bi, h, j: (bi, h, 0, j))]
  out_shape = [jax.ShapeDtypeStruct((b, nk, d, s_pad), dtype)]
  if flag_nonfinite:
    out_specs.append(per_key)
    out_shape.append(jax.ShapeDtypeStruct((b, nk, s_pad), jnp.float32))
  outs = pl.pallas_call(
      functools.partial(_v_kernel, block_s=block_s, key_order=key_order),
      grid=(b, nk, s_pad // block_s),
      in_specs=[pl.BlockSpec((None, block_s, None, d),
                             lambda bi, h, j: (bi, j, h, 0)),
                pl.BlockSpec((None, 1), lambda bi, h, j: (bi, 0)),
                chan, chan, per_key],
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps,
                                               num_stages=2),
      interpret=common.interpret(), name="jaxattn_v_operand",
  )(v, jnp.asarray(kv_lens, jnp.int32).reshape(b, 1),
    shift.astype(jnp.float32), inv_channel.astype(jnp.float32), inv_row)
  v8 = outs[0][:, :, :v_dim, :common.round_up(s, 16) if key_order else s]
  return v8, (outs[1][:, :, :s] > 0 if flag_nonfinite else None)


def _column_stats_kernel(x_ref, len_ref, sum_ref, *extrema_refs, chunk):
  """One split of the keys, ``[rows, D]``, ``chunk`` rows at a time: each
  thread adds its elements into a ``[chunk, D]`` accumulator (and keeps
  their max and min), which are reduced over the rows once at the end."""
  rows = x_ref.shape[0]
  first = pl.program_id(2) * rows
  f32 = jnp.float32

  def step(c, carry):
    start = pl.multiple_of(c * chunk, chunk)
    x = x_ref[pl.ds(start, chunk), :].astype(f32)
    visible = ((first + start + jnp.arange(chunk)) < len_ref[0])[:, None]
    x = jnp.where(visible & jnp.isfinite(x), x, 0.0)
    total = carry[0] + x
    if not extrema_refs:
      return (total,)
    return (total, jnp.maximum(carry[1], jnp.where(visible, x, -jnp.inf)),
            jnp.minimum(carry[2], jnp.where(visible, x, jnp.inf)))

  shape = (chunk, x_ref.shape[1])
  init = (jnp.zeros(shape, f32),)
  if extrema_refs:
    init += (jnp.full(shape, -jnp.inf, f32), jnp.full(shape, jnp.inf, f32))
  out = jax.lax.fori_loop(0, rows // chunk, step, init)
  sum_ref[...] = out[0].sum(axis=0)
  if extrema_refs:
    extrema_refs[0][...] = out[1].max(axis=0)
    extrema_refs[1][...] = out[2].min(axis=0)


# (most splits of the keys per head, rows per step, warps) of
# :func:`column_stats`: V's sum, max and min at 2x8192x32x128 in 0.061 ms on
# the H100, where XLA's column reduction took 0.138
# (8ec7a27).
COLUMN_STATS_TILES = (8, 32, 4)


def _column_splits(steps: int) -> int:
  """The most ranges, up to ``COLUMN_STATS_TILES[0]``, that split ``steps``
  steps of keys evenly."""
  return max(n for n in range(1, COLUMN_STATS_TILES[0] + 1)
             if steps % n == 0)


def column_stats_fits(s: int, d: int) -> bool:
  """Whether :func:`column_stats` reads ``[B, s, H, d]`` in place and in
  at least half its ranges: whole steps of keys, a head dim that is a
  power of two (else it copies the tensor padded, which costs more than
  the pass saves) and a step count with a divisor that large (else too
  few programs read the tensor)."""
  max_splits, chunk, _ = COLUMN_STATS_TILES
  return (s % chunk == 0 and d == pl.next_power_of_2(d)
          and 2 * _column_splits(s // chunk) >= max_splits)


def column_stats(x, lens, *, extrema: bool):
  """Per channel over the keys of ``x`` ``[B, S, H, D]`` below ``lens``
  (int32 ``[B]``), NaN/Inf counted as 0 (:func:`jaxattn.nonfinite.finite`),
  in one pass (a Pallas kernel): the float32 sum ``[B, H, D]`` and, with
  ``extrema``, the max and min (-inf and inf where no key is visible).

  The sum's order is the kernel's: each of up to ``splits`` equal ranges
  of keys accumulates elementwise, ``chunk`` rows at a time, then reduces
  its rows; the ranges are added after.  (XLA's column reduction orders it
  otherwise, so the two sums may differ in the last bits.)  Shapes that
  :func:`column_stats_fits` refuses are padded (a copy)."""
  b, s, h, d = x.shape
  _, chunk, num_warps = COLUMN_STATS_TILES
  d_pad = pl.next_power_of_2(d)
  x = common.pad_axis(common.pad_axis(x, 1, common.round_up(s, chunk)), 3,
                      d_pad)
  splits = _column_splits(x.shape[1] // chunk)
  rows = x.shape[1] // splits
  part = pl.BlockSpec((None, None, None, d_pad),
                      lambda bi, hi, j: (bi, hi, j, 0))
  n_out = 3 if extrema else 1
  outs = pl.pallas_call(
      functools.partial(_column_stats_kernel, chunk=chunk),
      grid=(b, h, splits),
      in_specs=[pl.BlockSpec((None, rows, None, d_pad),
                             lambda bi, hi, j: (bi, j, hi, 0)),
                pl.BlockSpec((None, 1), lambda bi, hi, j: (bi, 0))],
      out_specs=[part] * n_out,
      out_shape=[jax.ShapeDtypeStruct((b, h, splits, d_pad),
                                      jnp.float32)] * n_out,
      compiler_params=pl_triton.CompilerParams(num_warps=num_warps,
                                               num_stages=2),
      interpret=common.interpret(), name="jaxattn_column_stats",
  )(x, jnp.minimum(jnp.asarray(lens, jnp.int32), s).reshape(b, 1))
  # the ranges added in order (a reduce would leave the order to XLA,
  # which may change it with the program around it, e.g. per shard)
  total = functools.reduce(jnp.add, [outs[0][:, :, i]
                                     for i in range(splits)])[..., :d]
  if not extrema:
    return total, None, None
  return total, outs[1].max(axis=2)[..., :d], outs[2].min(axis=2)[..., :d]


def _rows_kernel(x_ref, len_ref, *refs, group, qmax, shift, bias_chunk,
                 flag_nonfinite, given_scale, chunk):
  """One ``[block, D]`` tile: ``y = where(row < len, x - shift, 0)``; per
  group of ``group`` rows ``scale = fl(amax|y| * fl(1 / qmax))``; the 8-bit
  ``y * fl(1 / scale)`` (int8: ``clip(rint(.), -qmax, qmax)``; fp8:
  ``fl(clip(., -448, 448))``); with ``bias_chunk`` also ``q_m y^T`` in
  float32 (SageAttention2's ``dS = q_m K_smoothed^T``) for every query
  block mean ``q_m`` of the key head, ``bias_chunk`` rows at a time.
  ``shift="tile_mean"``: the shift is the tile's own mean
  (:func:`_tile_mean`), written to the output after the scales instead of
  the bias.  With ``flag_nonfinite``, NaN/Inf elements count as 0 and the
  last output flags the rows that hold one.  ``given_scale``: one scale
  for the tile, given (the head's, from a whole-sequence amax), in place
  of the groups' own.

  ``chunk`` rows (whole groups, a divisor of the tile) are shifted, scaled
  and stored at a time: with ``shift="tile_mean"`` the tile is read whole
  for its mean and then again a chunk at a time (smaller chunks than the
  tile), so that the threads do not hold the whole tile through the
  quantization."""
  refs = list(refs)
  shift_ref = refs.pop(0) if shift == "given" else None
  given_ref = refs.pop(0) if given_scale else None
  qm_ref = refs.pop(0) if bias_chunk else None
  bad_ref = refs.pop() if flag_nonfinite else None
  o_ref, scale_ref, *extra_ref = refs   # extra: the bias or the tile mean
  block = x_ref.shape[0]
  first_row = pl.program_id(1) * block
  tile = None      # the whole tile, where it is read whole anyway
  if shift == "tile_mean":
    tile = x_ref[...].astype(jnp.float32)
    keep = ((first_row + jnp.arange(block)) < len_ref[0])[:, None]
    shift_row = _tile_mean(tile, keep, len_ref[0] - first_row)
    extra_ref[0][...] = shift_row
  elif shift:
    shift_row = shift_ref[...]

  def rows(start, size):
    """The shifted rows ``[start, start + size)`` of the tile, their amax
    and (with ``flag_nonfinite``) their flags."""
    if size == block and tile is not None:
      x = tile
    else:
      x = x_ref[pl.ds(start, size), :].astype(jnp.float32)
    keep = ((first_row + start + jnp.arange(size)) < len_ref[0])[:, None]

    def shifted(x):
      y = jnp.where(keep, x, 0.0)
      if shift:
        y = jnp.where(keep, y - shift_row[None, :], 0.0)
      return y, jnp.abs(y).max(axis=1)

    if not flag_nonfinite:
      return (*shifted(x), None)
    # One reduction gives the amax of rows without NaN/Inf: with NaN
    # counted as inf, the largest row max is inf where the rows hold one
    # (or where x - shift overflows, for float32 inputs).  Only such rows
    # take a second pass, with them counted as 0, and are flagged.
    y = x - shift_row[None, :] if shift else x
    row_max = jnp.where(y == y, jnp.abs(y), jnp.inf).max(axis=1)

    def second_pass():
      finite = jnp.isfinite(x)
      return (*shifted(jnp.where(finite, x, 0.0)),
              jnp.where(finite, 0.0, 1.0).max(axis=1))

    return jax.lax.cond(
        row_max.max() == jnp.inf, second_pass,
        lambda: (jnp.where(keep, y, 0.0), jnp.where(keep[:, 0], row_max, 0.0),
                 jnp.zeros_like(row_max)))

  def store(start, y, scale):
    at = pl.ds(start, y.shape[0])
    z = y * common.reciprocal_rn(scale)[:, None]
    if o_ref.dtype == jnp.int8:
      z = jnp.clip(common.round_half_even(z), -qmax, qmax)
    else:
      z = jnp.clip(z, -FP8_MAX, FP8_MAX)
    o_ref[at, :] = z.astype(o_ref.dtype)
    scale_ref[at] = scale

  def own_scales(amax):  # [n] row amax -> [n] group scales (groups <= n)
    n = amax.shape[0]
    if group > 1:
      per_group = amax.reshape(n // group, group).max(axis=1)
      amax = jnp.broadcast_to(per_group[:, None],
                              (n // group, group)).reshape(n)
    return amax * np.float32(1.0 / qmax)

  def given():
    return jnp.broadcast_to(given_ref[...], (chunk,))

  def quantize(start):
    y, amax, bad = rows(start, chunk)
    if flag_nonfinite:
      bad_ref[pl.ds(start, chunk)] = bad
    store(start, y, given() if given_scale else own_scales(amax))
    if bias_chunk:                       # (the whole tile: start = 0)
      _store_bias(qm_ref, extra_ref[0], y, amax, bias_chunk)

  if chunk == block:
    quantize(0)
  else:
    def step(c, carry):
      quantize(pl.multiple_of(c * chunk, chunk))
      return carry
    jax.lax.fori_loop(0, block // chunk, step, 0)


def _store_bias(qm_ref, bias_ref, y, amax, bias_chunk):
  """``q_m y^T`` in float32 for the tile's rows ``y`` (row amax ``amax``)
  into ``bias_ref`` ``[R, block]``, ``bias_chunk`` query means at a time.

  The float32 products run on the tensor cores at float16's rate: each row
  scaled into [-1, 1] by its amax and split into float16 hi + lo
  (:func:`_f16_split`), then three products (hi*hi + hi*lo + lo*hi).  The
  same three products in TF32 made the key pass 0.41 ms against 0.33 at
  2x8192x32x128 on the H100 (8 warps); Triton's IEEE float32 dot runs on
  the FMA units at a few percent of their peak."""
  y_unit, y_norm = _f16_split(y, amax)
  precision = jax.lax.Precision.HIGHEST if common.interpret() else None

  def part(c, carry):
    at = pl.ds(pl.multiple_of(c * bias_chunk, bias_chunk), bias_chunk)
    qm = qm_ref[at, :]
    dot = functools.partial(_rows_dot, precision=precision)
    q_unit, q_norm = _f16_split(qm, jnp.abs(qm).max(axis=1))
    unit = (dot(q_unit[0], y_unit[0]) + dot(q_unit[0], y_unit[1])
            + dot(q_unit[1], y_unit[0]))
    bias_ref[at, :] = (unit * q_norm[:, None]) * y_norm[None, :]
    return carry
  jax.lax.fori_loop(0, qm_ref.shape[0] // bias_chunk, part, 0)


def _rows_dot(a, b, precision):
  """``a b^T`` in float32.  Float16 products are exact in float32; in the
  interpreter they are taken in float32, since XLA:CPU's float16 dot need
  not keep them so."""
  if common.interpret():
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32,
                             precision=precision)


def _f16_split(x, amax):
  """float32 rows ``x`` as ``amax * (hi + lo)``: ``(hi, lo)`` float16 with
  ``|hi| <= 1`` and ``hi + lo`` within ``2^-22`` of ``x / amax`` (a row of
  zeros keeps ``amax = 0``)."""
  # (an amax below float32's smallest normal would overflow 1 / amax: such
  # a row's products are below float32's range anyway, so they become 0)
  amax = jnp.where(amax >= np.float32(np.finfo(np.float32).tiny), amax, 0.0)
  unit = x * common.reciprocal_rn(amax)[:, None]
  hi = unit.astype(jnp.float16)
  if common.interpret():  # XLA would fold f32(f16(unit)) into unit (its
    # excess precision), which zeroes lo
    hi = jax.lax.optimization_barrier(hi)
  lo = (unit - hi.astype(jnp.float32)).astype(jnp.float16)
  return (hi, lo), amax


def _tile_mean(x, keep, count):
  """``fl(sum x * fl(1 / count))`` over the tile's kept rows (SageAttention2's
  query-block mean, the sum in the kernel's order), NaN/Inf counted as 0
  (as :func:`jaxattn.nonfinite.finite` does for the XLA means);
  ``count``: the rows below the length."""
  total = jnp.where(keep, x, 0.0).sum(axis=0)
  # A finite sum holds no NaN/Inf (a float32 overflow takes the second sum
  # too, with the same result); NaN counts as inf here, since the GPU's
  # max passes over NaN.
  total = jax.lax.cond(
      jnp.where(total == total, jnp.abs(total), jnp.inf).max() < jnp.inf,
      lambda: total,
      lambda: jnp.where(keep & jnp.isfinite(x), x, 0.0).sum(axis=0))
  rcp = common.reciprocal_rn(jnp.clip(count, 1, x.shape[0]).astype(
      jnp.float32) * jnp.ones_like(total))
  return common.multiply_rn(total, rcp)


def rows_operand(x, lens, *, group: int, dtype, bits: int = 8, shift=None,
                 scale=None, bias_q_mean=None, block: int | None = None,
                 num_warps: int | None = None, bias_chunk: int | None = None,
                 chunk: int | None = None, flag_nonfinite: bool = False):
  """Q or K quantized per group of rows in one pass (a Pallas kernel).

  ``x`` ``[B, L, H, D]`` float; ``lens`` int32 ``[B]`` (rows at or beyond
  are zeros: the key padding, or ``L`` for queries); ``group`` rows per
  scale, a power of two dividing ``block`` (1: per token); ``dtype`` int8
  (``qmax = 2^(bits-1) - 1``) or float8_e4m3fn (``qmax = 448``); ``shift``
  float32 ``[B, 1, H, D]`` (the key mean) or ``[B, L / block, H, D]`` (one
  per tile: the query-block means, ``block = block_q``), or
  ``"tile_mean"``: each tile's own mean over its rows below ``lens``
  (SageAttention2's query-block means, from the tile the pass reads
  anyway; returned in place of the bias), subtracted before the scales.
  Scales are ``fl(amax * fl(1/qmax))``, values
  ``clip(rint(y * fl(1/scale)))`` (int8) or ``fl(clip(y * fl(1/scale)))``
  (fp8), rounded exactly on the GPU through :func:`common.round_half_even`
  and :func:`common.reciprocal_rn`.  ``scale`` float32 ``[B, H]``: one
  given scale per head instead (per-tensor granularity: the amax over the
  whole sequence is another pass's), which ``group`` then does not change.

  ``bias_q_mean`` float32 ``[B, H, R, D]`` (SageAttention2's query-block
  means, ``R`` rows per key head): also returns ``bias`` ``[B, H, R, L]`` =
  ``q_m y^T`` in float32 (accumulation order aside, the reference's
  ``q_m K_smoothed^T``) from the same tile, so the smoothed float32 keys
  never reach memory.

  ``block`` (rows per tile; default ``max(ROWS_TILE, group)`` on the GPU,
  128 with the bias or in the interpreter), ``num_warps`` (default 4),
  ``bias_chunk`` (query-mean rows per bias product, 16 to 64; default the
  largest that divides) and ``chunk`` (rows shifted, scaled and stored at
  once, a power of two dividing ``block`` into whole groups; default
  :data:`CHUNK_ROWS` or one group with ``shift="tile_mean"``, else the
  whole tile) are speed knobs (4 warps and 64-row products were the
  fastest for the key pass with the bias on an H100:
  da375f1).  They leave the values as they are,
  except that on the GPU a tile mean's float32 sum may take another order
  in Triton's layout.

  ``flag_nonfinite``: NaN/Inf elements of ``x`` count as 0 (in the
  scales, the values and the bias), and the rows that hold one are
  flagged.

  Returns ``(x8 [B, L, H, D], scale [B, L, H] float32 per row, bias, or
  with ``shift="tile_mean"`` the means ``[B, ceil(L / block), H, D]``, or
  None, flags bool [B, L, H] or None)``.
  """
  b, n_rows, h, d = x.shape
  if group not in (1, 2, 4, 8, 16, 32, 64, 128):
    raise ValueError(f"group must be a power of two up to 128, got {group}")
  tile_mean = isinstance(shift, str)
  per_tile_shift = tile_mean or (
      shift is not None and shift.shape[1] > 1)
  if block is None:
    if per_tile_shift:   # the shift's rows are the caller's blocks
      raise ValueError("a per-tile shift (shift='tile_mean' or one row per "
                       "block) needs its block given")
    block = (128 if bias_q_mean is not None
             else max(_default_tiles()[0], group))
  if scale is None and block % group:
    raise ValueError(f"a tile of {block} rows does not hold whole groups of "
                     f"{group}")
  d_block = pl.next_power_of_2(d)
  # Rows padded to whole tiles and D to a power of two (copies only then):
  # the Triton lowering does not mask the stores of a tile past the end of
  # an axis (a partial last tile wrote over the next batch's first rows on
  # the GPU), so no tile may cross one.
  rows_pad = common.round_up(n_rows, block)
  x = common.pad_axis(common.pad_axis(x, 1, rows_pad), 3, d_block)
  grid = (b, rows_pad // block, h)
  qmax = FP8_MAX if dtype == jnp.float8_e4m3fn else 2 ** (bits - 1) - 1
  in_specs = [pl.BlockSpec((None, block, None, d_block),
                           lambda bi, j, hi: (bi, j, hi, 0)),
              pl.BlockSpec((None, 1), lambda bi, j, hi: (bi, 0))]
  args = [x, jnp.minimum(jnp.asarray(lens, jnp.int32), n_rows).reshape(b, 1)]
  if tile_mean and (shift != "tile_mean" or bias_q_mean is not None):
    raise ValueError(f"shift is an array or 'tile_mean' (without the bias),"
                     f" got {shift!r}")
  if chunk is None:
    chunk = min(block, max(CHUNK_ROWS, group)) if tile_mean else block
  whole_groups = scale is not None or chunk % group == 0
  if (chunk < 1 or chunk & (chunk - 1) or chunk > block or block % chunk
      or not whole_groups):
    raise ValueError(
        f"chunk must be a power of two that divides the tile's {block} rows"
        + ("" if scale is not None else f" into whole groups of {group}")
        + f", got {chunk}")
  if bias_q_mean is not None and chunk != block:
    raise ValueError("the key pass with the bias takes its tile whole")
  if shift is not None and not tile_mean:
    per_tile = shift.shape[1] > 1
    in_specs.append(pl.BlockSpec(
        (None, None, None, d_block),
        lambda bi, j, hi: (bi, j if per_tile else 0, hi, 0)))
    args.append(common.pad_axis(shift.astype(jnp.float32), 3, d_block))
  if scale is not None:
    if bias_q_mean is not None or tile_mean:
      raise ValueError("a given scale goes without the bias and tile means")
    in_specs.append(pl.BlockSpec((None, None, 1),
                                 lambda bi, j, hi: (bi, hi, 0)))
    args.append(jnp.asarray(scale, jnp.float32).reshape(b, h, 1))
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
  if tile_mean:
    out_specs.append(pl.BlockSpec((None, None, None, d_block),
                                  lambda bi, j, hi: (bi, j, hi, 0)))
    out_shape.append(jax.ShapeDtypeStruct((b, rows_pad // block, h, d_block),
                                          jnp.float32))
  if flag_nonfinite:
    out_specs.append(out_specs[1])
    out_shape.append(out_shape[1])
  outs = pl.pallas_call(
      functools.partial(_rows_kernel, group=group, qmax=qmax,
                        shift=("tile_mean" if tile_mean else
                               "given" if shift is not None else None),
                        bias_chunk=bias_chunk, chunk=chunk,
                        flag_nonfinite=flag_nonfinite,
                        given_scale=scale is not None),
      grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
      compiler_params=pl_triton.CompilerParams(
          num_warps=num_warps or 4, num_stages=2),
      interpret=common.interpret(), name="jaxattn_rows_operand",
  )(*args)
  bias = (outs[2][:, :, :bias_q_mean.shape[2], :n_rows] if bias_chunk
          else outs[2][..., :d] if tile_mean else None)
  flags = outs[-1][:, :n_rows] > 0 if flag_nonfinite else None
  return outs[0][:, :n_rows, :, :d], outs[1][:, :n_rows], bias, flags

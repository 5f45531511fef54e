"""Block-shifted keys in one pass (Pallas, Triton lowering; interpret mode on
CPU): each block of ``block_k`` keys minus ``beta`` times its mean, scaled
and rounded to float16, as the shifted-key attention kernels take them
(:func:`pallas_kernels.flash.flash_attention` with ``precision="pasa"``,
:func:`pallas_kernels.mosaic.mosaic_attention` with ``pasa_inva``).

Per block ``j`` of one head, with ``M = I - beta J / n`` rounded to float16
(``n = block_k``)::

    K_j   = the block, keys at or past kv_len replaced by fl16(mean of the
            visible keys) (0 when none is visible)
    X_j   = scale * (M^T K_j)               float32 accumulation
    out_j = fl16(fl16(M^T K_j) * fl16(scale))        rounding="nearest"
          = sum_preserving(X_j)                       rounding="sum_preserving"

With ``shift`` (one flag per block and head, :func:`large_mean_blocks`
for the adaptive shift) a block whose flag is 0 is only scaled, ``out_j =
scale * K_j``: exact when ``scale`` is a power of two, and without the
rounding's work.

``scale`` is a Python float (a constant of the kernel) or a float32 scalar
array that the kernel reads at run time (PASA's keys' factor chosen per
call on the device): the same products either way.

``sum_preserving`` rounds each element to one of its two float16
neighbours so that each column's sum over the block stays within about
half an ulp of ``X_j``'s (:func:`_sum_preserving_round`): the kernels
recover the scores from the block means of the shifted keys, magnified by
``beta / (1 - beta)``, and rounding to nearest would leave up to
``block_k / 2`` ulps in each column sum.

One read of the float16 keys and one write: for 2 x 8192 x 32 heads x 128
on an H100, 0.16 ms ("nearest") and 0.85 ms ("sum_preserving" on every
block), where the XLA formulation of the same steps (a batched matmul, a
transposing vmap, reductions and a cumulative sum) took 0.36 ms and 3.5 ms.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

from pallas_kernels import common

ROUNDINGS = ("nearest", "sum_preserving")
# Columns per tile with sum-preserving rounding, which keeps about ten
# [block_k, columns] arrays live: all 128 columns at once took 3.5-4.2 ms
# for 2 x 8192 x 32 heads x 128 on an H100, 32 columns 0.92 ms.  Rounding
# to nearest takes whole rows (0.13 ms; 0.25 ms in 32-column tiles).
SUM_PRESERVING_COLUMNS = 32
# the [block_k, block_k] shift matrix lives in registers
BLOCK_KS = (16, 32, 64, 128)


def _f16_neighbour(r, down):
  """The float16 next to ``r`` towards -inf (``down``) or +inf, from the
  bits (``jnp.nextafter`` has no float16 lowering in Triton)."""
  bits = jax.lax.bitcast_convert_type(r, jnp.uint16).astype(jnp.int32)
  negative = bits >= 0x8000
  mag = bits & 0x7FFF
  away = down == negative                      # magnitude grows
  toward = jnp.where(mag == 0, jnp.where(negative, 0x0001, 0x8001),
                     bits - 1)                 # from a zero: flip the sign
  out = jnp.where(away, bits + 1, toward)
  return jax.lax.bitcast_convert_type(out.astype(jnp.uint16), jnp.float16)


def _sum_preserving_round(x, rounds: int, col0=0):
  """``x`` ``[bk, D]`` float32 rounded to float16 with each column's sum
  kept: in each of ``rounds`` passes, ``n`` of the elements that rounded in
  the direction of their column's error and have the column's largest
  such ulp move to their other neighbour, ``n`` the error in that ulp.
  Which candidates move rotates with the column (``rank - 37 col``, ``col``
  counted from ``col0``), so that equal keys move in equally many
  columns."""
  f32 = jnp.float32
  r = x.astype(jnp.float16)
  col37 = ((col0 + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)) * 37
           ).astype(f32)
  rows = jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], x.shape[0]), 0)
  cols = jax.lax.broadcasted_iota(jnp.int32, (x.shape[0], x.shape[0]), 1)
  tri = (cols <= rows).astype(jnp.float16)                 # lower, inclusive
  for _ in range(rounds):
    d = r.astype(f32) - x
    err = d.sum(axis=0, keepdims=True)
    other = _f16_neighbour(r, d > 0)
    ulp = jnp.abs(other.astype(f32) - r.astype(f32))
    candidate = (d * err > 0) & jnp.isfinite(ulp)
    col_ulp = jnp.where(candidate, ulp, 0.0).max(axis=0, keepdims=True)
    candidate &= ulp == col_ulp
    n = common.round_half_even(
        jnp.abs(err) / jnp.maximum(col_ulp, np.finfo(np.float32).tiny))
    cand = candidate.astype(jnp.float16)
    count = jnp.maximum(cand.astype(f32).sum(axis=0, keepdims=True), 1.0)
    # the rank among the column's candidates: a cumulative sum as a product
    # with a triangular matrix (exact: at most bk ones) on the tensor cores
    # instead of a scan across the warps that hold the tile's rows
    rank = jax.lax.dot_general(tri, cand, (((1,), (0,)), ((), ())),
                               preferred_element_type=f32) - 1.0
    # (rank - 37 col) mod count in float32 (an int32 % is a long emulated
    # sequence; measured 0.10 of the kernel's 0.95 ms): the integers are
    # exact, and the quotient of t + 1/2 lies at least 1/(2 count) from an
    # integer, so floor() is right whatever the division's rounding
    t = rank - col37
    t = t - jnp.floor((t + 0.5) / count) * count
    moved = candidate & (t < n)
    r = jnp.where(moved, other, r)
  return r


def _filled_block(x, valid):
  """NaN/Inf as 0, keys past kv_len replaced by fl16 of the visible keys'
  mean: ``(filled block, its non-finite mask)``."""
  f32, f16 = jnp.float32, jnp.float16
  finite = jnp.isfinite(x)
  x = jnp.where(finite, x, jnp.zeros_like(x))
  count = jnp.maximum(valid.astype(jnp.int32).sum(), 1)
  mean = jnp.where(valid, x.astype(f32), 0.0).sum(axis=0) / count.astype(f32)
  return jnp.where(valid, x, mean.astype(f16)[None, :]), finite


def _visible_block(k_ref, len_ref):
  """This program's key tile, filled (:func:`_filled_block`)."""
  bk = k_ref.shape[0]
  rows = pl.program_id(1) * bk + jnp.arange(bk)
  return _filled_block(k_ref[...].astype(jnp.float16),
                       (rows < len_ref[0])[:, None])


def _padded_keys(k, kv_lens, block_k: int):
  """``(k, lens)`` as both kernels take them: float16 keys padded to
  ``[B, S_pad, K, D_pad]`` (whole blocks, a power-of-two ``D_pad >= 16``)
  and the lengths clipped to ``S``, int32 ``[B, 1]``."""
  if block_k not in BLOCK_KS:
    raise ValueError(f"block_k must be one of {BLOCK_KS}, got {block_k}")
  b, s, _, d = k.shape
  k = common.pad_axis(k.astype(jnp.float16), 1, common.round_up(s, block_k))
  k = common.pad_axis(k, 3, max(16, pl.next_power_of_2(d)))
  return k, jnp.minimum(jnp.asarray(kv_lens, jnp.int32), s).reshape(b, 1)


def _kernel(k_ref, len_ref, *refs, diag, off, scale, rounds, has_shift, dc):
  """``scale``: the factor, or None where it is the runtime operand that
  follows ``len_ref`` (float32 ``[1]``)."""
  f32, f16 = jnp.float32, jnp.float16
  refs = list(refs)
  if scale is None:    # read at run time: the same products as a constant
    scale_ref = refs.pop(0)
    scale32 = scale_ref[0]
    scale16 = scale32.astype(f16)
  else:
    scale32, scale16 = np.float32(scale), np.float16(scale)
  shift_ref = refs.pop(0) if has_shift else None
  o_ref = refs.pop(0)
  bad_ref = refs.pop(0) if refs else None
  bk = k_ref.shape[0]
  # every step is per column: the tile is a block of keys and a slice of
  # the columns (fewer live registers than the whole row)
  kb, finite = _visible_block(k_ref, len_ref)
  if bad_ref is not None:   # NaN/Inf count as 0; flag the keys with one
    bad_ref[...] = jnp.where(finite, 0.0, 1.0).max(axis=1)
  col0 = pl.program_id(3) * dc   # outside the branches (interpret mode)

  def shifted():
    ii = jax.lax.broadcasted_iota(jnp.int32, (bk, bk), 0)
    jj = jax.lax.broadcasted_iota(jnp.int32, (bk, bk), 1)
    m = jnp.where(ii == jj, np.float16(diag), np.float16(off)).astype(f16)
    x = jax.lax.dot_general(m, kb, (((0,), (0,)), ((), ())),
                            preferred_element_type=f32)   # M^T K_j
    if rounds:
      out = _sum_preserving_round(x * scale32, rounds, col0=col0)
    else:
      out = x.astype(f16) * scale16
    o_ref[...] = out.astype(f16)

  if shift_ref is None:
    shifted()
    return
  moved = shift_ref[0] > 0.0
  pl.when(moved)(shifted)

  @pl.when(jnp.logical_not(moved))
  def _():   # only scaled: exact when scale is a power of two
    o_ref[...] = (kb.astype(f32) * scale32).astype(f16)


def _large_mean_kernel(k_ref, len_ref, o_ref, *, beta, ratio):
  f32 = jnp.float32
  bk = k_ref.shape[0]
  kb, _ = _visible_block(k_ref, len_ref)
  # column sums on the tensor cores: a float32 copy of the tile costs more
  ones = jnp.ones((16, bk), jnp.float16)
  colsum = jax.lax.dot_general(ones, kb, (((1,), (0,)), ((), ())),
                               preferred_element_type=f32).max(axis=0)
  c = jnp.float32(beta / bk) * colsum
  a = jnp.maximum(kb.max(axis=0).astype(f32) - c,
                  c - kb.min(axis=0).astype(f32))
  moved = jnp.sum(c * c) > jnp.float32(ratio * ratio) * jnp.sum(a * a)
  o_ref[...] = jnp.full((1,), moved.astype(f32))


def large_mean_blocks(k, kv_lens, *, beta: float, min_ratio: float,
                      block_k: int):
  """Which key blocks have a large mean against the spread that removing
  it leaves: ``|c|^2 > min_ratio^2 |A|^2`` with ``c = beta mean(K_j)`` and
  ``A_d = max_i |k_id - c_d|``, in float32 over the block filled as the
  key kernel fills it (NaN/Inf as 0, keys past kv_len as the visible
  keys' mean).

  Args: k ``[B, S, K, D]`` float16; kv_lens int32 ``[B]``.
  Returns: float32 ``[B, K, S_pad / block_k]``, 1 for such a block, else
  0: the ``shift`` of :func:`shifted_key_blocks` and the block weights of
  the shifted-key attention kernels.  One read of K (0.1 ms for 2 x 8192 x
  32 heads x 128 on an H100).
  """
  b, nk = k.shape[0], k.shape[2]
  k, lens = _padded_keys(k, kv_lens, block_k)
  nb, d_pad = k.shape[1] // block_k, k.shape[3]
  out = pl.pallas_call(
      functools.partial(_large_mean_kernel, beta=beta, ratio=min_ratio),
      grid=(b, nb, nk),
      in_specs=[pl.BlockSpec((None, block_k, None, d_pad),
                             lambda bi, j, h: (bi, j, h, 0)),
                pl.BlockSpec((None, 1), lambda bi, j, h: (bi, 0))],
      out_specs=pl.BlockSpec((None, None, None, 1),
                             lambda bi, j, h: (bi, h, j, 0)),
      out_shape=jax.ShapeDtypeStruct((b, nk, nb, 1), jnp.float32),
      compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
      interpret=common.interpret(), name="jaxattn_large_mean_blocks",
  )(k, lens)
  return out[..., 0]


def shifted_key_blocks(k, kv_lens, *, beta: float, scale,
                       block_k: int, rounding: str = "sum_preserving",
                       rounds: int = 2, flag_nonfinite: bool = False,
                       shift=None):
  """Shifted, scaled float16 key blocks (see the module docstring).

  Args:
    k: ``[B, S, K, D]`` float16 keys.
    kv_lens: int32 ``[B]``.
    beta: the shift's weight; ``M``'s entries are ``fl16(1 - beta / n)``
      and ``fl16(-beta / n)``.
    scale: the factor on the shifted keys: a float (a constant of the
      kernel), or a float32 scalar array read at run time (one compiled
      kernel for any value; for ``rounding="nearest"`` it must be a
      float16 value, as a power of two is, since that rounding multiplies
      in float16).
    block_k: keys per block (a power of two, 16 to 128).
    rounding: ``"nearest"`` or ``"sum_preserving"`` (``rounds`` passes).
    flag_nonfinite: NaN/Inf elements count as 0, and the keys that hold
      one are flagged.
    shift: None (shift every block) or float32 ``[B, K, S_pad /
      block_k]`` (:func:`large_mean_blocks`): the blocks to shift (1); the
      others (0) are only scaled, without the rounding's work.
  Returns:
    ``([B, S_pad, K, D] float16, flags)``, ``S_pad = round_up(S,
    block_k)``; flags bool ``[B, S, K]`` or None.
  """
  if rounding not in ROUNDINGS:
    raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
  b, s, nk, d = k.shape
  k, lens = _padded_keys(k, kv_lens, block_k)
  s_pad, d_pad = k.shape[1], k.shape[3]
  diag = float(np.float16(1.0 - beta / block_k))
  off = float(np.float16(-beta / block_k))
  dc = (min(SUM_PRESERVING_COLUMNS, d_pad) if rounding == "sum_preserving"
        else d_pad)
  nc = d_pad // dc
  nb = s_pad // block_k
  tile = pl.BlockSpec((None, block_k, None, dc),
                      lambda bi, j, h, c: (bi, j, h, c))
  in_specs = [tile, pl.BlockSpec((None, 1), lambda bi, j, h, c: (bi, 0))]
  args = [k, lens]
  runtime_scale = not isinstance(scale, (int, float, np.floating))
  if runtime_scale:
    scale = jnp.asarray(scale, jnp.float32)
    if scale.shape:
      raise ValueError(f"scale must be a scalar, got shape {scale.shape}")
    in_specs.append(pl.BlockSpec((1,), lambda bi, j, h, c: (0,)))
    args.append(scale.reshape(1))
  out_specs = [tile]
  out_shape = [jax.ShapeDtypeStruct(k.shape, jnp.float16)]
  if shift is not None:
    if shift.shape != (b, nk, nb):
      raise ValueError(f"shift must be [B, K, S_pad / block_k] = "
                       f"{(b, nk, nb)}, got {shift.shape}")
    in_specs.append(pl.BlockSpec((None, None, None, 1),
                                 lambda bi, j, h, c: (bi, h, j, 0)))
    args.append(shift.astype(jnp.float32)[..., None])
  if flag_nonfinite:       # per column slice; any over the slices below
    out_specs.append(pl.BlockSpec((None, block_k, None, None),
                                  lambda bi, j, h, c: (bi, j, h, c)))
    out_shape.append(jax.ShapeDtypeStruct((b, s_pad, nk, nc), jnp.float32))
  outs = pl.pallas_call(
      functools.partial(_kernel, diag=diag, off=off,
                        scale=None if runtime_scale else float(scale),
                        rounds=rounds if rounding == "sum_preserving" else 0,
                        has_shift=shift is not None, dc=dc),
      grid=(b, nb, nk, nc), in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=pl_triton.CompilerParams(num_warps=4, num_stages=2),
      interpret=common.interpret(), name="jaxattn_shifted_key_blocks",
  )(*args)
  flags = (outs[1][:, :s] > 0).any(axis=-1) if flag_nonfinite else None
  return outs[0][..., :d], flags

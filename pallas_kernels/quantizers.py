"""The one-pass quantizer kernels that make the quantized attention
kernels' operands: plain ``@triton.jit`` kernels launched by
:func:`pallas_kernels.triton_call.launch` (``jax_triton`` on a GPU, Triton's
interpreter on the CPU).

Three passes, each a ``@triton.jit`` helper with its static flags in one
constexpr spec (a namedtuple):

* the rows pass (:func:`rows_pass`, :func:`rows_operand`): Q or K, each row
  tile read once, shifted (a mean), scaled per group of rows and rounded to
  int8 (int4 values) or float8_e4m3fn; optionally the score bias ``q_m
  y^T`` of SageAttention2's query smoothing from the same tile, or the
  tile's own mean (SageAttention2's query-block means);
* the statistics pass (:func:`stats_pass`, :func:`column_stats`): a
  tensor's sum, max and min per channel over the keys (the key mean, V's
  mean and per-channel scale), or its amax per head (per-tensor and
  per-head scales);
* the V pass (:func:`v_pass`, :func:`v_operand`): V, read once, shifted and
  scaled (given scales, or each group of keys its own), written 8-bit and
  transposed to ``[B, K, D, S]`` (the key dimension contiguous, as the
  8-bit tensor-core PV operand wants), optionally with each 16-key chunk in
  the Mosaic kernel's register-operand order and the int8 column sums of
  each key block.

:func:`run_passes` runs up to three passes, those of one kind and warp
count in one launch, whose programs take their roles by program id (the
first pass's programs first): a method's operands take two phases
(``jaxattn.operands``), and the passes that need a whole-sequence
statistic run in the second, after the first has computed it.

Rounding is exact: a correctly rounded reciprocal (``div.rn``), products
rounded once (the launch disables FMA contraction), round half to even by
the float32 magic number ``1.5 * 2^23`` (|y| < 2^22), and float8 by the
GPU's ``cvt.rn.satfinite`` (in the interpreter, whose own float8 cast does
not round to nearest even, by an exact integer emulation).  The values
therefore equal an XLA quantizer's that multiplies by a correctly rounded
reciprocal and rounds half to even, bit for bit; float32 sums (tile
means, column sums, the bias products) are the kernel's own order.

Nothing is padded or copied: tails of rows, keys and head dims that are
not whole tiles (or powers of two) are masked loads and stores, and the
outputs have their exact shapes.  Row strides are whole rows of the
constexpr head count and head dim (16-byte aligned for vector loads: a
run-time stride lost that, ``pallas_kernels/paged.py``), and the shapes are
constexprs, compiled per shape as jax compiles per shape anyway.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import common, triton_call
from pallas_kernels.common import FP8_MAX
from pallas_kernels.triton_call import tl, triton

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


# The passes' default tiles on the GPU.  Q/K passes in tiles of 32 rows (or
# one group, where a group is larger); sage's query-block means and
# per-tile shifts need one block of rows per tile, which their callers
# give; the key pass with the bias takes 128 rows.  ``CHUNK_ROWS``: rows the
# pass with the query-block means shifts, scales and stores at a time after
# it has summed the tile (it reads them again, from L2); the whole tile at
# once keeps it in registers.  V: (keys per tile, warps) per dtype.
# (Measured on the H200 at 4x2048x32x128 against 16-128 rows or keys and
# 2-16 warps: each pass alone, its bytes over its GPU time.)
# In the interpreter every program is one more step of a loop, so there the
# defaults are the large tiles (the same bits:
# tests/test_prepare.py::test_quantizer_tiles_do_not_change_the_bits).
ROWS_TILE = 32
CHUNK_ROWS = 32
V_TILES = {"int8": (64, 8), "float8_e4m3fn": (128, 4)}
INTERPRET_TILES = (128, (128, 4))   # rows; V's (keys per tile, warps)
# Warps of the rows pass: 4, or 8 where a step holds more than 64 x 128
# values (its chunk of rows).  The query-block means' pass in 32-row chunks
# on 4 warps: 66.0 -> 57.9 us at 4x2048x32x128 (H200, against 64 rows on
# 8).  The key pass with the bias: 8, or 4 where it has at most
# BIAS_FEW_ROWS query means (at 4 its 128 x 128 float32 tile takes all 255
# registers, which pays only where the products are few).  H200, the pass
# at 8 -> 4 warps, sage's query blocks of 128: 4x2048x32x128 causal (16
# means) 100 -> 77 us; 8x1024 GQA 32/8 (32) 25.2 -> 27.1; 2x4096x24x64
# (32) 35.1 -> 34.7; 2x8192x32x128 causal (64) 234 -> 244.
ROWS_WARPS = 4
LARGE_TILE_WARPS = 8
BIAS_FEW_ROWS = 16
# Query means per product of the key pass's bias: 16 (mma.sync) keeps the
# key pass at 128 registers on 8 warps, two CTAs an SM (64, wgmma: 162
# registers, one CTA; Triton 3.6); 32 took 71 -> 108 us at 4x2048x32x128
# (H200).
BIAS_CHUNK = 16
# (most splits of the keys per head, rows per step, warps) of the
# statistics pass (16 rows against 32: the amax 19.6 -> 18.7 us, sums and
# extrema unchanged, at 4x2048x32x128 on the H200; more splits or 8 warps
# were slower); the interpreter steps 128 rows at a time.
COLUMN_STATS_TILES = (8, 16, 4)
INTERPRET_STATS_CHUNK = 128

# The passes' kinds (a spec's ``kind``).
_NONE, _ROWS, _V, _STATS = 0, 1, 2, 3
# The statistics pass's modes.
STATS_SUM, STATS_EXTREMA, STATS_AMAX = 1, 2, 3

# The passes' static flags, each a constexpr of the launch (the field names
# are the kernels' vocabulary; see the pass builders).
_Empty = collections.namedtuple("_Empty", "kind programs")
RowsSpec = collections.namedtuple("RowsSpec", [
    "kind", "programs", "batch", "rows", "heads", "dim", "dim_block",
    "block", "chunk", "group", "rcp_qmax", "qmax", "fp8", "hw_fp8",
    "shift", "given_scale", "bias_rows", "bias_chunk", "flags"])
VSpec = collections.namedtuple("VSpec", [
    "kind", "programs", "batch", "rows", "heads", "dim", "dim_block",
    "block", "out_keys", "key_order", "shift", "scale_c", "scale_r",
    "group", "rcp_qmax", "qmax", "fp8", "hw_fp8", "flags", "colsum"])
StatsSpec = collections.namedtuple("StatsSpec", [
    "kind", "programs", "batch", "rows", "heads", "dim", "dim_block",
    "chunk", "split_rows", "splits", "mode"])
_EMPTY = _Empty(_NONE, 0)

# Row shifts of the rows pass (a spec's ``shift``).
_SHIFT_NONE, _SHIFT_HEAD, _SHIFT_TILE, _SHIFT_TILE_MEAN = 0, 1, 2, 3
_FLT_MIN = float(np.finfo(np.float32).tiny)


# ----------------------------------------------------------------------------
# Element helpers.


@triton.jit
def _reciprocal(s):
  """``fl(1 / s)`` correctly rounded (``div.rn``), ``1 / 0 := 0``
  (``jaxattn.quant.reciprocal``)."""
  safe = tl.where(s == 0.0, 1.0, s)
  return tl.where(s == 0.0, 0.0, tl.math.div_rn(1.0, safe))


@triton.jit
def _e4m3_bits(z):
  """The float8_e4m3fn bits (int8) of float32 ``z``, ``|z| <= 448``, rounded
  to nearest even: the interpreter's stand-in for the GPU's ``cvt.rn``.
  ``|z|`` is rounded to its binade's quantum ``2^(e-3)`` (``2^-9`` below
  the smallest normal ``2^-6``) by adding and subtracting ``2^(e+20)``,
  whose float32 ulp that quantum is, then encoded."""
  a = tl.abs(z)
  e = tl.maximum((a.to(tl.int32, bitcast=True) >> 23) & 255, 127 - 6)
  c = ((e + 20) << 23).to(tl.float32, bitcast=True)
  r = (a + c) - c
  code = tl.where(r < 0.015625, (r * 512.0).to(tl.int32),
                  ((r.to(tl.int32, bitcast=True) >> 20) & 2047) - 960)
  sign = (z.to(tl.int32, bitcast=True) >> 24) & 128
  return (code | sign).to(tl.int8)


@triton.jit
def _to_8bit(z, QMAX: tl.constexpr, FP8: tl.constexpr, HW_FP8: tl.constexpr):
  """int8: ``clip(rint(z), -QMAX, QMAX)`` (round half to even by the magic
  number: exact for ``|z| < 2^22``, never contracted into the product that
  made ``z``); float8_e4m3fn: ``fl(clip(z, -448, 448))``."""
  if FP8:
    z = tl.minimum(tl.maximum(z, -448.0), 448.0)
    if HW_FP8:
      out = z.to(tl.float8e4nv)
    else:
      out = _e4m3_bits(z).to(tl.float8e4nv, bitcast=True)
  else:
    z = (z + 12582912.0) - 12582912.0
    out = tl.minimum(tl.maximum(z, -QMAX), QMAX).to(tl.int8)
  return out


@triton.jit
def _group_max(amax, N: tl.constexpr, GROUP: tl.constexpr):
  """Per-row ``amax`` ``[N]`` -> each row its group's max (groups of
  ``GROUP`` consecutive rows).  (``N`` is given: the interpreter's
  ``x.shape`` holds tensors.)"""
  if GROUP > 1:
    g = tl.max(tl.reshape(amax, [N // GROUP, GROUP]), axis=1)
    amax = tl.reshape(tl.broadcast_to(g[:, None], [N // GROUP, GROUP]), [N])
  return amax


@triton.jit
def _load_rows(x_ptr, b, rows, h, cols, mask, P: tl.constexpr):
  """Rows ``rows`` of head ``h`` of batch row ``b`` of ``[B, P.rows,
  P.heads, P.dim]`` as float32 ``[n, P.dim_block]`` (0 where ``mask`` is
  off).  The row offset is whole rows of constexpr size: 16-byte aligned
  for vector loads."""
  off = ((b * P.rows + rows).to(tl.int64) * P.heads + h) * P.dim
  return tl.load(x_ptr + off[:, None] + cols[None, :], mask=mask,
                 other=0.0).to(tl.float32)


# ----------------------------------------------------------------------------
# The rows pass (Q or K).


@triton.jit
def _shifted(x, ptrs, mask, keep, shift_row, N: tl.constexpr,
             SHIFT: tl.constexpr, FLAGS: tl.constexpr):
  """``(y, row amax, row flags)``: ``y = where(keep, x - shift, 0)``.

  With ``FLAGS``, NaN/Inf count as 0 and the flags mark the rows that hold
  one (whatever ``keep``).  One reduction finds them: a row's max of
  ``|y|`` with NaN as inf is inf exactly where it holds a NaN/Inf (or
  where ``x - shift`` overflows, for float32 inputs); only a tile with
  such a row takes the second pass, which loads ``x`` again (``ptrs``,
  ``mask``: holding it beside ``y`` for that rare pass cost the common
  one its registers) and zeroes them."""
  if SHIFT:
    y = x - shift_row[None, :]
  else:
    y = x
  if FLAGS:
    row_max = tl.max(tl.where(y == y, tl.abs(y), float("inf")), axis=1)
    amax = tl.where(keep, row_max, 0.0)
    bad = tl.full([N], 0.0, tl.float32)
    y = tl.where(keep[:, None], y, 0.0)
    if tl.max(row_max, axis=0) == float("inf"):
      x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
      finite = tl.abs(x) < float("inf")
      bad = tl.max(tl.where(finite, 0.0, 1.0), axis=1)
      x = tl.where(finite, x, 0.0)
      if SHIFT:
        y = x - shift_row[None, :]
      else:
        y = x
      y = tl.where(keep[:, None], y, 0.0)
      amax = tl.max(tl.abs(y), axis=1)
  else:
    y = tl.where(keep[:, None], y, 0.0)
    amax = tl.max(tl.abs(y), axis=1)
    bad = amax
  return y, amax, bad


@triton.jit
def _tile_sum(x, keep):
  """The column sums of the rows ``keep`` of ``x``, NaN/Inf counted as 0:
  a finite sum holds none (a float32 overflow takes the second sum too,
  with the same result)."""
  total = tl.sum(tl.where(keep[:, None], x, 0.0), axis=0)
  nan_as_inf = tl.where(total == total, tl.abs(total), float("inf"))
  if tl.max(nan_as_inf, axis=0) == float("inf"):
    total = tl.sum(tl.where(keep[:, None] & (tl.abs(x) < float("inf")), x,
                            0.0), axis=0)
  return total


@triton.jit
def _mean(total, count, BLOCK: tl.constexpr):
  """``fl(total * fl(1 / n))``, ``n = clip(count, 1, BLOCK)``."""
  n = tl.minimum(tl.maximum(count, 1), BLOCK).to(tl.float32)
  return total * _reciprocal(n)


@triton.jit
def _tile_mean_chunked(x_ptr, b, h, first, length, cols, col_ok,
                       P: tl.constexpr):
  """:func:`_tile_sum`'s mean over the tile, read ``P.chunk`` rows at a
  time (each thread adds its elements, the rows are reduced once)."""
  CHUNK: tl.constexpr = P.chunk
  DIM_BLOCK: tl.constexpr = P.dim_block
  acc = tl.full([CHUNK, DIM_BLOCK], 0.0, tl.float32)
  for c in tl.static_range(P.block // P.chunk):
    rows = first + c * P.chunk + tl.arange(0, P.chunk)
    x = _load_rows(x_ptr, b, rows, h, cols,
                   (rows < P.rows)[:, None] & col_ok[None, :], P)
    acc += tl.where((rows < length)[:, None], x, 0.0)
  total = tl.sum(acc, axis=0)
  nan_as_inf = tl.where(total == total, tl.abs(total), float("inf"))
  if tl.max(nan_as_inf, axis=0) == float("inf"):
    acc = tl.full([CHUNK, DIM_BLOCK], 0.0, tl.float32)
    for c in tl.static_range(P.block // P.chunk):
      rows = first + c * P.chunk + tl.arange(0, P.chunk)
      x = _load_rows(x_ptr, b, rows, h, cols,
                     (rows < P.rows)[:, None] & col_ok[None, :], P)
      acc += tl.where((rows < length)[:, None] & (tl.abs(x) < float("inf")),
                      x, 0.0)
    total = tl.sum(acc, axis=0)
  return _mean(total, length - first, P.block)


@triton.jit
def _f16_split(x, amax):
  """float32 rows ``x`` as ``norm * (hi + lo)``: ``(hi, lo, norm)``, float16
  ``|hi| <= 1`` and ``hi + lo`` within ``2^-22`` of ``x / amax`` (a row of
  zeros, or one below float32's smallest normal, keeps ``norm = 0``: its
  products are below float32's range)."""
  norm = tl.where(amax >= 1.1754943508222875e-38, amax, 0.0)
  unit = x * _reciprocal(norm)[:, None]
  hi = unit.to(tl.float16)
  lo = (unit - hi.to(tl.float32)).to(tl.float16)
  return hi, lo, norm


@triton.jit
def _store_bias(qm_ptr, bias_ptr, y, amax, b, h, rows, cols, col_ok,
                P: tl.constexpr):
  """``q_m y^T`` in float32 for the tile's rows ``y`` (row amax ``amax``)
  into ``bias`` ``[B, H, R, L]``, ``P.bias_chunk`` of the head's ``R =
  P.bias_rows`` query means ``[B, H, R, D]`` at a time.

  The float32 products run on the tensor cores at float16's rate: each row
  scaled into [-1, 1] by its amax and split into float16 hi + lo, then
  three products (hi*hi + hi*lo + lo*hi) accumulated in float32 (about
  1e-6 of max |bias|; Triton's IEEE float32 dot runs on the FMA units)."""
  y_hi, y_lo, y_norm = _f16_split(y, amax)
  y_hi = tl.trans(y_hi)
  y_lo = tl.trans(y_lo)
  row_ok = (rows < P.rows)[None, :]
  for c in range(0, (P.bias_rows + P.bias_chunk - 1) // P.bias_chunk):
    r = c * P.bias_chunk + tl.arange(0, P.bias_chunk)
    r_ok = r < P.bias_rows
    head_row = ((b * P.heads + h) * P.bias_rows + r).to(tl.int64)
    qm = tl.load(qm_ptr + head_row[:, None] * P.dim + cols[None, :],
                 mask=r_ok[:, None] & col_ok[None, :], other=0.0)
    q_hi, q_lo, q_norm = _f16_split(qm, tl.max(tl.abs(qm), axis=1))
    acc = tl.dot(q_hi, y_hi)
    acc = tl.dot(q_hi, y_lo, acc)
    acc = tl.dot(q_lo, y_hi, acc)
    tl.store(bias_ptr + head_row[:, None] * P.rows + rows[None, :],
             (acc * q_norm[:, None]) * y_norm[None, :],
             mask=r_ok[:, None] & row_ok)


@triton.jit
def _quantize_rows(x_ptr, x, rows, length, b, h, cols, col_ok, shift_row,
                   given_ptr, qm_ptr, o_ptr, scale_ptr, extra_ptr, flag_ptr,
                   N: tl.constexpr, P: tl.constexpr):
  """Rows ``rows`` (``N``, whole groups) of the tile, loaded as ``x``: shifted,
  scaled (each group's own scale, or the head's given one), rounded and
  stored with their scales and flags (and the bias)."""
  keep = rows < length
  in_rows = rows < P.rows
  off = ((b * P.rows + rows).to(tl.int64) * P.heads + h) * P.dim
  mask = in_rows[:, None] & col_ok[None, :]
  y, amax, bad = _shifted(x, x_ptr + off[:, None] + cols[None, :], mask, keep,
                          shift_row, N, P.shift != 0, P.flags)
  if P.given_scale:
    scale = tl.full([N], 0.0, tl.float32) + tl.load(given_ptr + b * P.heads
                                                     + h)
  elif P.group > 1:
    scale = _group_max(amax, N, P.group) * P.rcp_qmax
  else:
    scale = amax * P.rcp_qmax
  z = _to_8bit(y * _reciprocal(scale)[:, None], P.qmax, P.fp8, P.hw_fp8)
  tl.store(o_ptr + off[:, None] + cols[None, :], z, mask=mask)
  per_row = (b * P.rows + rows) * P.heads + h
  tl.store(scale_ptr + per_row, scale, mask=in_rows)
  if P.flags:
    tl.store(flag_ptr + per_row, bad > 0.0, mask=in_rows)
  if P.bias_rows > 0:
    _store_bias(qm_ptr, extra_ptr, y, amax, b, h, rows, cols, col_ok, P)


@triton.jit
def _rows_pass(pid, x_ptr, len_ptr, shift_ptr, given_ptr, qm_ptr,
               o_ptr, scale_ptr, extra_ptr, flag_ptr, P: tl.constexpr):
  """Program ``pid``: one ``[P.block, D]`` tile (batch row, tile, head; the
  head fastest, so that neighbouring programs read neighbouring memory)
  of ``x`` ``[B, L, H, D]`` (:func:`rows_pass`)."""
  n_tiles = (P.rows + P.block - 1) // P.block
  h = pid % P.heads
  t = (pid // P.heads) % n_tiles
  b = pid // (P.heads * n_tiles)
  first = t * P.block
  length = tl.minimum(tl.load(len_ptr + b), P.rows)
  cols = tl.arange(0, P.dim_block)
  col_ok = cols < P.dim
  tile_row = ((b * n_tiles + t) * P.heads + h) * P.dim   # per-tile rows
  if P.shift == 1:
    shift_row = tl.load(shift_ptr + (b * P.heads + h) * P.dim + cols,
                        mask=col_ok, other=0.0)
  elif P.shift == 2:
    shift_row = tl.load(shift_ptr + tile_row + cols, mask=col_ok, other=0.0)
  else:
    DIM_BLOCK: tl.constexpr = P.dim_block
    shift_row = tl.full([DIM_BLOCK], 0.0, tl.float32)
  if P.chunk == P.block:   # the tile read once, held in registers
    rows = first + tl.arange(0, P.block)
    x = _load_rows(x_ptr, b, rows, h, cols,
                   (rows < P.rows)[:, None] & col_ok[None, :], P)
    if P.shift == 3:
      shift_row = _mean(_tile_sum(x, rows < length), length - first, P.block)
      tl.store(extra_ptr + tile_row + cols, shift_row, mask=col_ok)
    _quantize_rows(x_ptr, x, rows, length, b, h, cols, col_ok, shift_row,
                   given_ptr, qm_ptr, o_ptr, scale_ptr, extra_ptr, flag_ptr,
                   P.block, P)
  else:
    if P.shift == 3:
      shift_row = _tile_mean_chunked(x_ptr, b, h, first, length, cols, col_ok,
                                     P)
      tl.store(extra_ptr + tile_row + cols, shift_row, mask=col_ok)
    for c in tl.static_range(P.block // P.chunk):
      rows = first + c * P.chunk + tl.arange(0, P.chunk)
      x = _load_rows(x_ptr, b, rows, h, cols,
                     (rows < P.rows)[:, None] & col_ok[None, :], P)
      _quantize_rows(x_ptr, x, rows, length, b, h, cols, col_ok, shift_row,
                     given_ptr, qm_ptr, o_ptr, scale_ptr, extra_ptr, flag_ptr,
                     P.chunk, P)


# ----------------------------------------------------------------------------
# The V pass.


@triton.jit
def _v_pass(pid, v_ptr, len_ptr, shift_ptr, inv_c_ptr, inv_r_ptr,
            o_ptr, flag_ptr, scale_ptr, colsum_ptr, P: tl.constexpr):
  """Program ``pid``: ``P.block`` output positions of one head of ``v``
  ``[B, S, K, D]`` (:func:`v_pass`), stored transposed into ``[B, K, D,
  P.out_keys]``; position ``16c + i`` holds key ``16c +
  KEY_PERMUTATION[i]`` with ``P.key_order`` (rows gathered as they load,
  each still a contiguous vector)."""
  n_tiles = (P.out_keys + P.block - 1) // P.block
  h = pid % P.heads
  t = (pid // P.heads) % n_tiles
  b = pid // (P.heads * n_tiles)
  head = b * P.heads + h
  pos = t * P.block + tl.arange(0, P.block)
  if P.key_order:   # position 4t + 2h + l holds key 8h + 2t + l
    i = pos % 16
    key = pos - i + 8 * ((i // 2) % 2) + 2 * (i // 4) + i % 2
  else:
    key = pos
  cols = tl.arange(0, P.dim_block)
  col_ok = cols < P.dim
  length = tl.minimum(tl.load(len_ptr + b), P.rows)
  in_keys = key < P.rows
  x = _load_rows(v_ptr, b, key, h, cols, in_keys[:, None] & col_ok[None, :],
                 P)
  visible = (key < length)[:, None]
  if P.flags:
    finite = tl.abs(x) < float("inf")
    bad = tl.max(tl.where(finite, 0.0, 1.0), axis=1)
    x = tl.where(finite, x, 0.0)
  if P.shift:
    shift = tl.load(shift_ptr + head * P.dim + cols, mask=col_ok, other=0.0)
    y = tl.where(visible, x - shift[None, :], 0.0)
  else:
    y = tl.where(visible, x, 0.0)
  if P.scale_c:
    inv_c = tl.load(inv_c_ptr + head * P.dim + cols, mask=col_ok, other=0.0)
    y = y * inv_c[None, :]
  if P.scale_r:
    inv_r = tl.load(inv_r_ptr + head * P.rows + key, mask=in_keys, other=0.0)
    y = y * inv_r[:, None]
  if P.group > 0:   # each group of keys its own scale
    scale = (_group_max(tl.max(tl.abs(y), axis=1), P.block, P.group)
             * P.rcp_qmax) if P.group > 1 else (tl.max(tl.abs(y), axis=1)
                                                * P.rcp_qmax)
    y = y * _reciprocal(scale)[:, None]
    PER_TILE: tl.constexpr = P.block // P.group
    GROUP: tl.constexpr = P.group
    n_groups = (P.out_keys + P.group - 1) // P.group
    g = t * PER_TILE + tl.arange(0, PER_TILE)
    tl.store(scale_ptr + head * n_groups + g,
             tl.max(tl.reshape(scale, [PER_TILE, GROUP]), axis=1),
             mask=g < n_groups)
  z = _to_8bit(y, P.qmax, P.fp8, P.hw_fp8)
  out = (head * P.dim + cols).to(tl.int64)[:, None] * P.out_keys + pos[None, :]
  tl.store(o_ptr + out, tl.trans(z),
           mask=col_ok[:, None] & (pos < P.out_keys)[None, :])
  if P.flags:
    tl.store(flag_ptr + head * P.rows + key, bad > 0.0, mask=in_keys)
  if P.colsum > 0:   # int8 column sums of each block of P.colsum keys
    BLOCKS: tl.constexpr = P.block // P.colsum
    KEYS: tl.constexpr = P.colsum
    DIM_BLOCK: tl.constexpr = P.dim_block
    n_blocks = (P.out_keys + P.colsum - 1) // P.colsum
    sums = tl.sum(tl.reshape(z.to(tl.int32), [BLOCKS, KEYS, DIM_BLOCK]),
                  axis=1)
    blk = t * BLOCKS + tl.arange(0, BLOCKS)
    tl.store(colsum_ptr + (head * n_blocks + blk).to(tl.int64)[:, None]
             * P.dim + cols[None, :], sums,
             mask=(blk < n_blocks)[:, None] & col_ok[None, :])


# ----------------------------------------------------------------------------
# The statistics pass.


@triton.jit
def _stats_step(acc0, acc1, acc2, x, visible, MASKED: tl.constexpr,
                MODE: tl.constexpr):
  """One step of rows into the elementwise accumulators: the sum (or amax)
  of the finite values, and their max and min (``MODE == 2``); rows off
  ``visible`` take no part where ``MASKED``."""
  a = tl.abs(x)
  keep = a < float("inf")
  if MASKED:
    keep = keep & visible[:, None]
  if MODE == 3:
    acc0 = tl.maximum(acc0, tl.where(keep, a, 0.0))
  else:
    xz = tl.where(keep, x, 0.0)
    acc0 = acc0 + xz
    if MODE == 2:
      if MASKED:
        acc1 = tl.maximum(acc1, tl.where(visible[:, None], xz, float("-inf")))
        acc2 = tl.minimum(acc2, tl.where(visible[:, None], xz, float("inf")))
      else:
        acc1 = tl.maximum(acc1, xz)
        acc2 = tl.minimum(acc2, xz)
  return acc0, acc1, acc2


@triton.jit
def _stats_pass(pid, x_ptr, len_ptr, sum_ptr, max_ptr, min_ptr,
                P: tl.constexpr):
  """Program ``pid``: one range of ``P.split_rows`` keys of one head of
  ``x`` ``[B, L, H, D]`` (:func:`stats_pass`), ``P.chunk`` rows a step
  (each thread accumulates its elements; the rows are reduced once at the
  end); the keys at or past the length take no part."""
  h = pid % P.heads
  split = (pid // P.heads) % P.splits
  b = pid // (P.heads * P.splits)
  length = tl.minimum(tl.load(len_ptr + b), P.rows)
  start = split * P.split_rows
  end = tl.minimum(start + P.split_rows, length)
  cols = tl.arange(0, P.dim_block)
  col_ok = cols < P.dim
  steps = tl.maximum(end - start, 0) // P.chunk
  CHUNK: tl.constexpr = P.chunk
  DIM_BLOCK: tl.constexpr = P.dim_block
  acc0 = tl.full([CHUNK, DIM_BLOCK], 0.0, tl.float32)
  acc1 = tl.full([CHUNK, DIM_BLOCK], float("-inf"), tl.float32)
  acc2 = tl.full([CHUNK, DIM_BLOCK], float("inf"), tl.float32)
  # (the row offsets inline: in the interpreter a nested call per step
  # costs more than the step)
  row = ((b * P.rows + start + tl.arange(0, P.chunk)).to(tl.int64) * P.heads
         + h) * P.dim
  for i in range(0, steps):   # whole steps, unmasked rows
    x = tl.load(x_ptr + (row + i * (P.chunk * P.heads * P.dim))[:, None]
                + cols[None, :], mask=col_ok[None, :],
                other=0.0).to(tl.float32)
    acc0, acc1, acc2 = _stats_step(acc0, acc1, acc2, x, col_ok, False,
                                   P.mode)
  rows = start + steps * P.chunk + tl.arange(0, P.chunk)   # the rest
  visible = rows < end
  x = _load_rows(x_ptr, b, rows, h, cols, visible[:, None] & col_ok[None, :],
                 P)
  acc0, acc1, acc2 = _stats_step(acc0, acc1, acc2, x, visible, True, P.mode)
  out = (b * P.heads + h) * P.splits + split
  if P.mode == 3:
    tl.store(sum_ptr + out, tl.max(tl.max(acc0, axis=1), axis=0))
  else:
    tl.store(sum_ptr + out * P.dim + cols, tl.sum(acc0, axis=0), mask=col_ok)
    if P.mode == 2:
      tl.store(max_ptr + out * P.dim + cols, tl.max(acc1, axis=0),
               mask=col_ok)
      tl.store(min_ptr + out * P.dim + cols, tl.min(acc2, axis=0),
               mask=col_ok)


# ----------------------------------------------------------------------------
# One launch of up to three passes.


@triton.jit
def _run(pid, x, lens, a, b, c, o0, o1, o2, o3, P: tl.constexpr):
  if P.kind == 1:
    _rows_pass(pid, x, lens, a, b, c, o0, o1, o2, o3, P)
  elif P.kind == 2:
    _v_pass(pid, x, lens, a, b, c, o0, o1, o2, o3, P)
  elif P.kind == 3:
    _stats_pass(pid, x, lens, o0, o1, o2, P)


@triton.jit
def _passes_kernel(x0, l0, a0, b0, c0, x1, l1, a1, b1, c1, x2, l2, a2, b2, c2,
                   o00, o01, o02, o03, o10, o11, o12, o13,
                   o20, o21, o22, o23,
                   P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr):
  """Up to three passes, each with five inputs (the tensor, the lengths and
  three of the pass's own) and four outputs: program ``pid`` runs pass 0
  below ``P0.programs``, then pass 1, then pass 2 (a branch on the program
  id; each pass's code is its spec's)."""
  pid = tl.program_id(0)
  if P1.kind == 0:
    _run(pid, x0, l0, a0, b0, c0, o00, o01, o02, o03, P0)
  elif P2.kind == 0:
    if pid < P0.programs:
      _run(pid, x0, l0, a0, b0, c0, o00, o01, o02, o03, P0)
    else:
      _run(pid - P0.programs, x1, l1, a1, b1, c1, o10, o11, o12, o13, P1)
  else:
    if pid < P0.programs:
      _run(pid, x0, l0, a0, b0, c0, o00, o01, o02, o03, P0)
    elif pid < P0.programs + P1.programs:
      _run(pid - P0.programs, x1, l1, a1, b1, c1, o10, o11, o12, o13, P1)
    else:
      _run(pid - P0.programs - P1.programs, x2, l2, a2, b2, c2, o20, o21,
           o22, o23, P2)


@dataclasses.dataclass(frozen=True)
class Pass:
  """One pass of a launch (:func:`run_passes`): its static flags, its five
  inputs and four outputs (None: a dummy), the warps it runs best on, and
  ``finish``, which maps its four raw outputs to its results."""
  spec: tuple
  inputs: tuple
  outputs: tuple
  warps: int
  finish: Callable


def run_passes(*passes, num_warps: int | None = None, num_stages: int = 2):
  """Runs ``passes`` (up to three besides None entries), none of which
  reads another's results; returns each pass's results, in a list aligned
  with ``passes`` (None for a None entry).

  Passes of one kind (rows, V, statistics) and warp count share a launch
  of :func:`_passes_kernel`; other kinds take launches of their own.  A
  launch's kernel has the most registers and warps of all its roles, so a
  V pass (173 registers at 128 keys on 4 warps) beside the rows passes
  (56) ran them at its occupancy: fp8's quantizing launch took 120 us,
  its three passes alone 94.  The operands' kernels, all passes in one
  launch against a launch per kind (4x2048x32x128, H200): sage 301 ->
  271 us, fp8 176 -> 147, the FMHA 248 -> 190, int8 123 -> 126 (its
  whole call 456 -> 454 us).  ``num_warps`` overrides the passes' own.
  (In the interpreter, which has no occupancy and spends about 25 ms a
  launch, they share one.)"""
  given = passes
  passes = [p for p in passes if p is not None]
  if not 1 <= len(passes) <= 3:
    raise ValueError(f"run_passes runs one to three passes, got "
                     f"{len(passes)}")
  results = {}
  for group in launch_groups(passes, num_warps):
    for p, r in zip(group, _launch(group, num_warps, num_stages)):
      results[id(p)] = r
  return [None if p is None else results[id(p)] for p in given]


def launch_groups(passes, num_warps: int | None = None) -> list:
  """The launches of :func:`run_passes` for ``passes`` (no None entries),
  each a list of passes: one per kind and warp count on the GPU, one in
  all in the interpreter."""
  if common.interpret():
    return [list(passes)]
  launches: dict = {}
  for p in passes:
    launches.setdefault((p.spec.kind, num_warps or p.warps), []).append(p)
  return list(launches.values())


def _launch(passes, num_warps, num_stages):
  """``passes`` in one launch of :func:`_passes_kernel`: their results."""
  dummy = jnp.zeros((1,), jnp.float32)
  dummy_out = jax.ShapeDtypeStruct((1,), jnp.float32)
  slots = passes + [None] * (3 - len(passes))
  args, shapes = [], []
  for p in slots:
    args += [dummy if p is None or a is None else a
             for a in (p.inputs if p else (None,) * 5)]
  for p in slots:
    shapes += [dummy_out if p is None or s is None else s
               for s in (p.outputs if p else (None,) * 4)]
  specs = [p.spec if p else _EMPTY for p in slots]
  outs = triton_call.launch(
      _passes_kernel, *args, out_shape=tuple(shapes),
      grid=(sum(s.programs for s in specs),),
      num_warps=num_warps or max(p.warps for p in passes),
      num_stages=num_stages, P0=specs[0], P1=specs[1], P2=specs[2])
  return [p.finish(*outs[4 * i:4 * i + 4]) for i, p in enumerate(passes)]


# ----------------------------------------------------------------------------
# The passes.


def _next_power_of_2(n: int) -> int:
  return 1 << max(0, int(n) - 1).bit_length()


def _dim_block(d: int) -> int:
  """Channels a program holds: a power of two, at least 16 (the bias's
  products need 16)."""
  return max(16, _next_power_of_2(d))


def _default_tiles():
  """``(rows per Q/K tile, {V dtype: (keys per tile, warps)})`` where the
  kernels run now."""
  if common.interpret():
    rows, v_tiles = INTERPRET_TILES
    return rows, {name: v_tiles for name in V_TILES}
  return ROWS_TILE, V_TILES


def _lengths(lens, b: int):
  return jnp.broadcast_to(jnp.asarray(lens, jnp.int32), (b,))


def _qmax(dtype, bits: int):
  """``(qmax, fl(1 / qmax), fp8)`` of the 8-bit ``dtype``."""
  fp8 = jnp.dtype(dtype) == jnp.float8_e4m3fn
  if not fp8 and jnp.dtype(dtype) != jnp.int8:
    raise ValueError(f"dtype must be int8 or float8_e4m3fn, got {dtype}")
  qmax = FP8_MAX if fp8 else float(2 ** (bits - 1) - 1)
  return qmax, float(np.float32(1.0 / qmax)), bool(fp8)


def rows_pass(x, lens, *, group: int, dtype, bits: int = 8, shift=None,
              scale=None, bias_q_mean=None, block: int | None = None,
              num_warps: int | None = None, bias_chunk: int | None = None,
              chunk: int | None = None, flag_nonfinite: bool = False) -> Pass:
  """:func:`rows_operand` as a pass of a launch (:func:`run_passes`); its
  results are :func:`rows_operand`'s."""
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
  if block & (block - 1):
    raise ValueError(f"block must be a power of two, got {block}")
  if tile_mean and (shift != "tile_mean" or bias_q_mean is not None):
    raise ValueError(f"shift is an array or 'tile_mean' (without the bias),"
                     f" got {shift!r}")
  if chunk is None:   # (the interpreter: the whole tile, fewer steps)
    chunk = (min(block, max(CHUNK_ROWS, group))
             if tile_mean and not common.interpret() else block)
  whole_groups = scale is not None or chunk % group == 0
  if (chunk < 1 or chunk & (chunk - 1) or chunk > block or block % chunk
      or not whole_groups):
    raise ValueError(
        f"chunk must be a power of two that divides the tile's {block} rows"
        + ("" if scale is not None else f" into whole groups of {group}")
        + f", got {chunk}")
  if bias_q_mean is not None and chunk != block:
    raise ValueError("the key pass with the bias takes its tile whole")
  if scale is not None and (bias_q_mean is not None or tile_mean):
    raise ValueError("a given scale goes without the bias and tile means")
  n_tiles = -(-n_rows // block)
  qmax, rcp_qmax, fp8 = _qmax(dtype, bits)
  shift_kind, shift_arr = _SHIFT_NONE, None
  if tile_mean:
    shift_kind = _SHIFT_TILE_MEAN
  elif shift is not None:
    per_tile = shift.shape[1] > 1
    if per_tile and shift.shape[1] != n_tiles:
      raise ValueError(f"a per-tile shift has one row per tile of {block} "
                       f"rows: {n_tiles}, got {shift.shape[1]}")
    shift_kind = _SHIFT_TILE if per_tile else _SHIFT_HEAD
    shift_arr = jnp.asarray(shift, jnp.float32)
  r = 0 if bias_q_mean is None else bias_q_mean.shape[2]
  if r:
    bias_chunk = bias_chunk or BIAS_CHUNK
    if bias_chunk not in (16, 32, 64, 128):
      raise ValueError(f"bias_chunk must be 16, 32, 64 or 128, got "
                       f"{bias_chunk}")
  spec = RowsSpec(
      kind=_ROWS, programs=b * n_tiles * h, batch=b, rows=n_rows, heads=h,
      dim=d, dim_block=_dim_block(d), block=block, chunk=chunk,
      group=group, rcp_qmax=rcp_qmax, qmax=qmax, fp8=fp8,
      hw_fp8=not common.interpret(), shift=shift_kind,
      given_scale=scale is not None, bias_rows=r,
      bias_chunk=bias_chunk if r else 0, flags=bool(flag_nonfinite))
  # (with the bias the chunk is the whole tile: its rows decide)
  large_tile = (r > BIAS_FEW_ROWS if r
                else chunk * _dim_block(d) > 64 * 128)
  f32 = jnp.float32
  extra = None
  if r:
    extra = jax.ShapeDtypeStruct((b, h, r, n_rows), f32)
  elif tile_mean:
    extra = jax.ShapeDtypeStruct((b, n_tiles, h, d), f32)
  per_row = jax.ShapeDtypeStruct((b, n_rows, h), f32)

  def finish(x8, sc, extra_out, flags):
    return (x8, sc, extra_out if extra is not None else None,
            flags if flag_nonfinite else None)

  return Pass(
      spec=spec,
      inputs=(x, _lengths(lens, b), shift_arr,
              None if scale is None else jnp.broadcast_to(
                  jnp.asarray(scale, f32), (b, h)),
              None if not r else jnp.asarray(bias_q_mean, f32)),
      outputs=(jax.ShapeDtypeStruct(x.shape, dtype), per_row, extra,
               jax.ShapeDtypeStruct((b, n_rows, h), jnp.bool_)
               if flag_nonfinite else None),
      warps=num_warps or (LARGE_TILE_WARPS if large_tile else ROWS_WARPS),
      finish=finish)


def rows_operand(x, lens, *, group: int, dtype, bits: int = 8, shift=None,
                 scale=None, bias_q_mean=None, block: int | None = None,
                 num_warps: int | None = None, bias_chunk: int | None = None,
                 chunk: int | None = None, flag_nonfinite: bool = False):
  """Q or K quantized per group of rows in one pass (a Triton kernel).

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
  (fp8), rounded exactly (the module docstring).  ``scale`` float32 ``[B,
  H]``: one given scale per head instead (per-tensor granularity: the
  amax over the whole sequence is another pass's), which ``group`` then
  does not change.

  ``bias_q_mean`` float32 ``[B, H, R, D]`` (SageAttention2's query-block
  means, ``R`` rows per key head): also returns ``bias`` ``[B, H, R, L]`` =
  ``q_m y^T`` in float32 (accumulation order aside, the reference's
  ``q_m K_smoothed^T``) from the same tile, so the smoothed float32 keys
  never reach memory.

  ``block`` (rows per tile, a power of two; default ``max(ROWS_TILE,
  group)`` on the GPU, 128 with the bias or in the interpreter),
  ``num_warps`` (default :data:`ROWS_WARPS`; :data:`LARGE_TILE_WARPS`
  with more than :data:`BIAS_FEW_ROWS` bias rows or, without the bias, a
  ``chunk`` of more than 64 x 128), ``bias_chunk`` (query-mean rows per
  bias product: 16, 32, 64 or 128; default :data:`BIAS_CHUNK`) and
  ``chunk`` (rows shifted, scaled and stored at once, a power of two
  dividing ``block`` into whole groups; default :data:`CHUNK_ROWS` or one
  group with ``shift="tile_mean"`` on the GPU, which then reads the tile
  twice, else the whole tile) are speed knobs.  They leave the values as
  they are, except that a tile mean's float32 sum takes the order of its
  chunks (and on the GPU of Triton's layout), and the bias's the order of
  its products.

  ``flag_nonfinite``: NaN/Inf elements of ``x`` count as 0 (in the
  scales, the values and the bias), and the rows that hold one are
  flagged.

  Returns ``(x8 [B, L, H, D], scale [B, L, H] float32 per row, bias, or
  with ``shift="tile_mean"`` the means ``[B, ceil(L / block), H, D]``, or
  None, flags bool [B, L, H] or None)``.
  """
  p = rows_pass(x, lens, group=group, dtype=dtype, bits=bits, shift=shift,
                scale=scale, bias_q_mean=bias_q_mean, block=block,
                num_warps=num_warps, bias_chunk=bias_chunk, chunk=chunk,
                flag_nonfinite=flag_nonfinite)
  return run_passes(p)[0]


def v_pass(v, kv_lens, *, dtype, shift=None, inv_channel=None,
           inv_row=None, group: int | None = None, colsum: int | None = None,
           key_order=False, flag_nonfinite=False, block_s=None,
           num_warps=None) -> Pass:
  """:func:`v_operand` as a pass of a launch, with these options besides:
  ``shift``, ``inv_channel``, ``inv_row`` may be None (0, 1, 1: the
  operations are left out, which changes no value); ``group``: each group
  of ``group`` keys (a power of two, with ``key_order`` at least 16) scaled
  by its own ``fl(amax * fl(1/qmax))`` (the amax over the group's finite
  visible values, after the given shift and scales), returned as
  ``[B, K, ceil(S / group)]``; ``colsum`` (int8): the column sums of each
  block of ``colsum`` keys, int32 ``[B, K, ceil(S / colsum), D]``.

  Results: ``(v8, flags or None, group scales or None, column sums or
  None)``."""
  b, s, nk, v_dim = v.shape
  default_block_s, default_warps = _default_tiles()[1].get(
      jnp.dtype(dtype).name, (128, 4))
  block_s = block_s or max(default_block_s, group or 1, colsum or 1)
  if block_s & (block_s - 1) or block_s < 16:
    raise ValueError(f"block_s must be a power of two of at least 16, got "
                     f"{block_s}")
  for name, n in (("group", group), ("colsum", colsum)):
    if n and (n & (n - 1) or block_s % n or (key_order and n % 16)):
      raise ValueError(f"{name} must be a power of two dividing block_s "
                       f"({block_s}), a multiple of 16 with key_order, got "
                       f"{n}")
  qmax, rcp_qmax, fp8 = _qmax(dtype, 8)
  if colsum and fp8:
    raise ValueError("column sums are int8's")
  out_keys = common.round_up(s, 16) if key_order else s
  n_tiles = -(-out_keys // block_s)
  f32 = jnp.float32
  spec = VSpec(
      kind=_V, programs=b * nk * n_tiles, batch=b, rows=s, heads=nk,
      dim=v_dim, dim_block=_dim_block(v_dim), block=block_s,
      out_keys=out_keys, key_order=bool(key_order), shift=shift is not None,
      scale_c=inv_channel is not None, scale_r=inv_row is not None,
      group=group or 0, rcp_qmax=rcp_qmax, qmax=qmax, fp8=fp8,
      hw_fp8=not common.interpret(), flags=bool(flag_nonfinite),
      colsum=colsum or 0)
  as_f32 = lambda a: None if a is None else jnp.asarray(a, f32)

  def finish(v8, flags, scales, sums):
    return (v8, flags if flag_nonfinite else None,
            scales if group else None, sums if colsum else None)

  return Pass(
      spec=spec,
      inputs=(v, _lengths(kv_lens, b), as_f32(shift), as_f32(inv_channel),
              as_f32(inv_row)),
      outputs=(jax.ShapeDtypeStruct((b, nk, v_dim, out_keys), dtype),
               jax.ShapeDtypeStruct((b, nk, s), jnp.bool_)
               if flag_nonfinite else None,
               jax.ShapeDtypeStruct((b, nk, -(-out_keys // group)), f32)
               if group else None,
               jax.ShapeDtypeStruct((b, nk, -(-out_keys // colsum), v_dim),
                                    jnp.int32) if colsum else None),
      warps=num_warps or default_warps, finish=finish)


def v_operand(v, kv_lens, *, shift, inv_channel, inv_row, dtype,
              key_order=False, flag_nonfinite=False, block_s=None,
              num_warps=None):
  """The 8-bit V of the PV matmul in one pass (a Triton kernel): ``[B, S,
  K, D]`` float -> ``[B, K, D, S]`` ``dtype`` (int8: ``clip(round(y), -127,
  127)``; float8_e4m3fn: ``fl(clip(y, -448, 448))``) with ``y = (v - shift)
  * inv_channel * inv_row`` for keys below ``kv_lens`` and 0 beyond: the
  quantizers' V values bit for bit (one of the two factors is 1; the
  rounding is exact, the module docstring).
  ``shift``, ``inv_channel``: float32 ``[B, K, D]``; ``inv_row``: ``[B, K,
  S]``.  One read of V and one write of its 8-bit copy: XLA would
  transpose the 8-bit result in a second pass.  ``key_order``: the keys in
  the Mosaic kernel's register-operand order (:func:`key_order`), ``S``
  padded to a multiple of 16.

  ``flag_nonfinite``: NaN/Inf elements of ``v`` count as 0, and the second
  result flags the keys that hold one (bool ``[B, K, S]``; else None).
  ``block_s`` (keys per tile, a power of two of at least 16) and
  ``num_warps`` are the kernel's knobs; by default :data:`V_TILES` for
  ``dtype`` on the GPU.

  Returns ``(v8, flags)``."""
  p = v_pass(v, kv_lens, dtype=dtype, shift=shift, inv_channel=inv_channel,
             inv_row=inv_row, key_order=key_order,
             flag_nonfinite=flag_nonfinite, block_s=block_s,
             num_warps=num_warps)
  return run_passes(p)[0][:2]


def _column_splits(steps: int) -> int:
  """The most ranges, up to ``COLUMN_STATS_TILES[0]``, that split ``steps``
  steps of keys evenly."""
  return max(n for n in range(1, COLUMN_STATS_TILES[0] + 1)
             if steps % n == 0)


def column_stats_fits(s: int, d: int) -> bool:
  """Whether :func:`column_stats` reads ``[B, s, H, d]`` in whole steps of
  keys split evenly into at least half its ranges, with a head dim that
  is a power of two: the shapes at which :func:`jaxattn.operands.
  sage_v_stats` takes the kernel's statistics (the XLA reduction's
  elsewhere).  Every shape is read in place (masked tails)."""
  max_splits, chunk, _ = COLUMN_STATS_TILES
  return (s % chunk == 0 and d == _next_power_of_2(d)
          and 2 * _column_splits(s // chunk) >= max_splits)


def stats_pass(x, lens, *, mode: int, num_warps: int | None = None,
               chunk: int | None = None) -> Pass:
  """Per head over the rows of ``x`` ``[B, L, H, D]`` below ``lens``,
  NaN/Inf counted as 0, as a pass of a launch; ``mode``:

  * :data:`STATS_SUM`: the float32 sum per channel ``[B, H, D]``;
  * :data:`STATS_EXTREMA`: ``(sum, max, min)`` per channel (-inf and inf
    where no row is visible);
  * :data:`STATS_AMAX`: ``max |x|`` per head ``[B, H]`` (0 where no row
    is visible).

  The rows split into up to ``COLUMN_STATS_TILES[0]`` ranges per head
  (programs), each ``chunk`` rows a step: each thread accumulates its
  elements, the rows are reduced once at the end, and the ranges are added
  in order after (XLA's reduction orders the sum otherwise: the two may
  differ in the last bits; max, min and amax are exact)."""
  b, n_rows, h, d = x.shape
  max_splits, gpu_chunk, warps = COLUMN_STATS_TILES
  chunk = chunk or (INTERPRET_STATS_CHUNK if common.interpret()
                    else gpu_chunk)
  split_rows = common.round_up(max(1, -(-n_rows // max_splits)), chunk)
  splits = max(1, -(-n_rows // split_rows))
  spec = StatsSpec(kind=_STATS, programs=b * h * splits, batch=b,
                   rows=n_rows, heads=h, dim=d, dim_block=_dim_block(d),
                   chunk=chunk, split_rows=split_rows, splits=splits,
                   mode=mode)
  f32 = jnp.float32
  part = jax.ShapeDtypeStruct((b, h, splits, d), f32)
  if mode == STATS_AMAX:
    outputs = (jax.ShapeDtypeStruct((b, h, splits), f32), None, None, None)
  elif mode == STATS_EXTREMA:
    outputs = (part, part, part, None)
  elif mode == STATS_SUM:
    outputs = (part, None, None, None)
  else:
    raise ValueError(f"unknown statistics mode {mode!r}")

  def finish(total, hi, lo, _):
    if mode == STATS_AMAX:
      return total.max(axis=2)
    # the ranges added in order (a reduce would leave the order to XLA,
    # which may change it with the program around it, e.g. per shard)
    total = functools.reduce(jnp.add, [total[:, :, i] for i in range(splits)])
    if mode == STATS_SUM:
      return total
    return total, hi.max(axis=2), lo.min(axis=2)

  return Pass(spec=spec, inputs=(x, _lengths(lens, b), None, None, None),
              outputs=outputs, warps=num_warps or warps, finish=finish)


def column_stats(x, lens, *, extrema: bool):
  """Per channel over the keys of ``x`` ``[B, S, H, D]`` below ``lens``
  (int32 ``[B]``), NaN/Inf counted as 0 (:func:`jaxattn.nonfinite.finite`),
  in one pass (a Triton kernel, :func:`stats_pass`): the float32 sum ``[B,
  H, D]`` and, with ``extrema``, the max and min (-inf and inf where no key
  is visible).

  The sum's order is the kernel's: each of up to ``COLUMN_STATS_TILES[0]``
  equal ranges of keys accumulates elementwise, a step of rows at a time,
  then reduces its rows; the ranges are added after.  (XLA's column
  reduction orders it otherwise, so the two sums may differ in the last
  bits.)"""
  out = run_passes(stats_pass(
      x, lens, mode=STATS_EXTREMA if extrema else STATS_SUM))[0]
  return out if extrema else (out, None, None)

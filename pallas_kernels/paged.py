"""Attention of a few query tokens against a paged (or dense) KV cache in 8
or 16 bits: decode, and chunked prefill against what is already cached.

One Triton kernel (:func:`_kernel`, called through :mod:`triton_call`) with
static flags for the cache's dtypes and scales.  Per program: one (batch
row, KV head), one tile of ``block_m`` packed query rows (row ``t * G + g``
is new token ``t`` of query head ``k G + g``: the GQA group shares every
key tile it reads), and one split of the row's keys.  It walks its keys
``block_n`` at a time through the page table, so each page of a KV head is
read once per row tile (once in all for decode, where every row fits one
tile):

* ``S = Q K^T`` on the tensor cores in float16 (bfloat16 for a bfloat16
  cache), an 8-bit K converted exactly in registers (int8 by an integer add
  and a float16 subtract, ``(k + 1152)_f16 - 1152``, which avoids the
  quarter-rate int -> float conversion); PASA's scores rounded to float16;
  with an int8 query (``Q_INT8``: per-row scales) and an int8 K, an int8
  dot on the stored K, times the row scales, which frees the registers of
  the converted tile;
* ``S * (k_scale * c)`` per key (``c = scale log2 e``, the softmax in base
  2), the visibility mask (keys below the row's length, and new token ``t``
  sees keys up to ``length - T + t``: bottom-right causal);
* the online softmax; ``P`` times V's per-token scale over the largest
  scale of the split's keys so far (an 8-bit V), rounded to the compute
  dtype; the 8-bit V converted exactly; ``O = alpha O + P V`` in float32
  (alpha also carries that largest scale's growth), times the split's
  largest scale at its end.

The outputs are each split's unnormalised ``O``, row max ``m`` and sum
``l`` (base 2), merged by :func:`combine`.  Keys at or past a row's length
are never loaded (masked loads), so pages the table names past the length
may hold anything, and a page index is clamped into the pool.

Layouts: ``k``, ``v`` are addressed as ``((page + head * head_pages) *
PAGE + slot) * D + channel``, which covers the paged pool ``[K, P, page,
D]`` (``head_pages = P``) and the dense cache ``[B, K, S, D]`` (a row's
pages are its consecutive ``page``-key chunks, :func:`dense_table`, and
``head_pages = S / page``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import common, triton_call
from pallas_kernels.common import LOG2E
from pallas_kernels.triton_call import tl, triton

MAX_ROWS_PER_TILE = 64
# By the cache's bytes per value and whether a tile holds more than 16 rows
# (T * G > 16: several new tokens): (keys per block, warps, stages,
# programs per SM), the fastest measured on the H200 at B = 8 and 32, 32k
# keys, 32/8 heads, D=128.  8-bit, T=1: 0.19-0.22 ms (B=8) and 0.67-0.75
# (B=32) against 0.30-0.33 and 0.94-1.46 for (32 keys, 2 warps, 4 stages);
# 4 programs per SM against 8: 0.181-0.198 ms against 0.193-0.206 at B=8,
# 0.655-0.701 against 0.661-0.709 at B=32.  8-bit, T=16 (64 rows): 0.43 ms
# at B=8 against 1.04 for the T=1 tile (2 warps spill a 64-row
# accumulator).  The splits are rounded down to whole waves: 1280 programs
# (5 splits at B=32, T=1) ran 20-40% slower than 1024.  16-bit: 0.30 /
# 1.01 ms (T=1).
DEFAULT_TILES = {(1, False): (64, 2, 5, 4), (1, True): (64, 4, 4, 4),
                 (2, False): (128, 8, 3, 6), (2, True): (128, 8, 3, 6)}
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 128
CACHE_DTYPES = ("int8", "float8_e4m3fn", "float16", "bfloat16")
INT8_Q_MIN_DIM = 32   # an int8 query's QK is Triton's 8-bit dot


# int8 -> float16, four at a time: x ^ 0x80 is x + 128 as a byte; written
# under the byte 0x64 it is the float16 1024 + x + 128, and one packed
# subtraction of 1152 leaves x.  Five instructions per four values, where
# the generic path takes about three per value.
_INT8_TO_F16_ASM = tl.constexpr("""{
.reg .b32 u, c;
xor.b32 u, $2, 0x80808080;
prmt.b32 $0, u, 0x64646464, 0x5140;
prmt.b32 $1, u, 0x64646464, 0x7362;
mov.b32 c, 0x64806480;
sub.f16x2 $0, $0, c;
sub.f16x2 $1, $1, c;
}""")


@triton.jit
def _to_compute(x, X_INT8: tl.constexpr, BF16: tl.constexpr,
                ASM: tl.constexpr):
  """A key or value tile in the compute dtype (bfloat16 or float16),
  exactly.  int8 becomes float16 by placing ``x + 128`` in the mantissa of
  1024 and subtracting 1152 (packed inline PTX on the GPU; the same values
  by integer and float16 arithmetic in the interpreter)."""
  if X_INT8:
    if ASM:
      return tl.inline_asm_elementwise(
          _INT8_TO_F16_ASM, "=r,=r,r", [x], dtype=tl.float16, is_pure=True,
          pack=4)
    else:
      bits = x.to(tl.int16) + 0x6480
      return bits.to(tl.float16, bitcast=True) - 1152.0
  elif BF16:
    return x.to(tl.bfloat16)
  else:
    return x.to(tl.float16)


@triton.jit
def _kernel(q_ptr, qs_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, len_ptr,
            head_pages, max_page, pages_per_seq, kv_heads, t_new, group,
            score_factor,
            o_ptr, m_ptr, l_ptr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
            HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
            NUM_SPLITS: tl.constexpr, ROW_TILES: tl.constexpr,
            K_INT8: tl.constexpr, V_INT8: tl.constexpr,
            K_SCALED: tl.constexpr, V_SCALED: tl.constexpr,
            BF16: tl.constexpr, F16_SCORES: tl.constexpr,
            V_FP8: tl.constexpr, Q_INT8: tl.constexpr, ASM: tl.constexpr):
  """q ``[B, K, ROW_TILES * BLOCK_M, HEAD_DIM]`` packed rows in the compute
  dtype, or (``Q_INT8``, with an int8 K) in int8 with float32 row scales
  qs ``[B, K, ROW_TILES * BLOCK_M]``; k, v the cache (module docstring);
  ks, vs float32 scales (or dummies); table int32 ``[B, pages_per_seq]``;
  len int32 ``[B]``; o float32 ``[B, K, NUM_SPLITS, ROW_TILES * BLOCK_M,
  HEAD_DIM]``, m, l float32 ``[B, K, NUM_SPLITS, ROW_TILES * BLOCK_M]``."""
  bh = tl.program_id(0)
  tile = tl.program_id(1)
  split = tl.program_id(2)
  b = bh // kv_heads
  h = bh % kv_heads
  rows_total = ROW_TILES * BLOCK_M
  length = tl.load(len_ptr + b)

  rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
  chans = tl.arange(0, HEAD_DIM)
  q = tl.load(q_ptr + (bh * rows_total + rows)[:, None] * HEAD_DIM
              + chans[None, :])
  if Q_INT8:
    q_scale = tl.load(qs_ptr + bh * rows_total + rows)
  else:
    q_scale = tl.full([BLOCK_M], 1.0, tl.float32)
  # the last key each row sees (bottom-right causal among the new tokens)
  limit = length - t_new + rows // group
  tile_limit = length - t_new + (tile * BLOCK_M + BLOCK_M - 1) // group

  per = tl.cdiv(tl.cdiv(length, NUM_SPLITS), BLOCK_N) * BLOCK_N
  start = split * per
  end = tl.minimum(tl.minimum(start + per, length), tile_limit + 1)
  lo = start // BLOCK_N
  hi = tl.where(end > start, tl.cdiv(end, BLOCK_N), lo)

  m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
  l_i = tl.zeros([BLOCK_M], tl.float32)
  acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
  v_max = tl.full([], 0.0, tl.float32)   # the split's largest V scale
  keys = tl.arange(0, BLOCK_N)
  for j in range(lo, hi):
    first = j * BLOCK_N
    page = tl.load(table_ptr + b * pages_per_seq + first // PAGE)
    # The head's own pages are head_pages apart: the offset is whole pages
    # of a constant size (16-byte aligned, so the loads are vectors; a
    # run-time head stride lost that), in 64 bits (a pool may pass 2^31
    # elements).
    page = (tl.minimum(tl.maximum(page, 0), max_page).to(tl.int64)
            + h.to(tl.int64) * head_pages)
    slot = tl.multiple_of(first % PAGE, BLOCK_N) + keys
    cols = first + keys
    valid = cols < length
    kv_off = (page * (PAGE * HEAD_DIM) + slot[:, None] * HEAD_DIM
              + chans[None, :])
    # (the page is in the pool, so K loads unmasked: the scores of keys past
    # the length are masked below; V's are zero-filled, since 0 * NaN in
    # a slot nobody wrote would reach the output)
    k = tl.load(k_ptr + kv_off)
    if Q_INT8:   # an int8 dot on the stored K: no conversion
      s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
      s = s * q_scale[:, None]
    else:
      s = tl.dot(q, tl.trans(_to_compute(k, K_INT8, BF16, ASM)),
                 out_dtype=tl.float32)
    if F16_SCORES:   # PASA: the float16 score matrix
      s = s.to(tl.float16).to(tl.float32)
    if K_SCALED:
      ks = tl.load(ks_ptr + page * PAGE + slot,
                   mask=valid, other=0.0)
      s = s * (ks * score_factor)[None, :]
    else:
      s = s * score_factor
    visible = valid[None, :] & (cols[None, :] <= limit[:, None])
    s = tl.where(visible, s, float("-inf"))
    if V_FP8:   # (zero-filled as bytes: the interpreter fills no float8)
      v = tl.load(v_ptr.to(tl.pointer_type(tl.int8)) + kv_off,
                  mask=valid[:, None], other=0).to(tl.float8e4nv,
                                                   bitcast=True)
    else:
      v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0)
    if Q_INT8:   # (beside an int8 QK dot the integer path converts V
      # faster than the PTX: 0.197 against 0.208 ms at B=8, 0.673 against
      # 0.718 at B=32; the table's tile)
      v = _to_compute(v, V_INT8, BF16, False)
    else:
      v = _to_compute(v, V_INT8, BF16, ASM)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = alpha * l_i + tl.sum(p, axis=1)
    if V_SCALED:
      # V's per-token scale on P's columns (one product per score, where
      # dequantizing V would take one per value and a float32 copy of the
      # tile in registers), relative to the largest scale so far, so that
      # P keeps its float16 range (the scale itself, ~amax / 127, would
      # push the small P of long rows into float16's subnormals); when
      # that maximum grows, O is rescaled with alpha.  (A scalar per
      # program: the row's keys are the same for every query row.)
      vs = tl.load(vs_ptr + page * PAGE + slot,
                   mask=valid, other=0.0)
      v_new = tl.maximum(v_max, tl.max(vs, axis=0))
      alpha = alpha * tl.where(v_new > 0, v_max / v_new, 1.0)
      p = p * (vs * tl.where(v_new > 0, 1.0 / v_new, 0.0))[None, :]
      v_max = v_new
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32)
    m_i = m_new

  if V_SCALED:   # (in float32: the split's O at V's true scale)
    acc = acc * v_max
  out = (bh * NUM_SPLITS + split) * rows_total + rows
  tl.store(o_ptr + out[:, None] * HEAD_DIM + chans[None, :], acc)
  tl.store(m_ptr + out, m_i)
  tl.store(l_ptr + out, l_i)


def combine(o, m, l):
  """Merges the splits (axis 2) of ``o [B, K, P, R, D]``, ``m, l [B, K, P,
  R]`` (base 2): ``sum_p 2^(m_p - M) o_p / sum_p 2^(m_p - M) l_p``; rows
  that see no key are 0."""
  mx = m.max(axis=2, keepdims=True)
  w = jnp.exp2(m - jnp.where(mx == -jnp.inf, 0.0, mx))
  den = (w * l).sum(axis=2)
  num = (w[..., None] * o).sum(axis=2)
  return jnp.where(den[..., None] > 0,
                   num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def dense_table(batch: int, kv_heads: int, capacity: int, page: int):
  """int32 ``[B, capacity / page]``: a dense cache ``[B, K, S, D]`` as
  pages of ``page`` keys: page ``i`` of row ``b`` is ``b K S / page + i``,
  and head ``h``'s pages are ``S / page`` further."""
  pages = capacity // page
  return (jnp.arange(batch, dtype=jnp.int32)[:, None] * (kv_heads * pages)
          + jnp.arange(pages, dtype=jnp.int32)[None, :])


def sm_count() -> int | None:
  """Multiprocessors of the default GPU (None without one)."""
  if not common.has_gpu():
    return None
  return getattr(common.default_device(), "core_count", None)


def choose_splits(programs: int, max_keys: int, block_n: int, *,
                  per_sm: int, rows: int = 16) -> int:
  """Splits of each program's keys: ``per_sm`` programs per multiprocessor
  (rounded down: a partial last wave costs a whole one), with at least
  ``max(MIN_KEYS_PER_SPLIT, 16 * rows, block_n)`` keys each, so that the
  float32 partials (``rows x D`` per split) stay small against an 8-bit
  cache's bytes.  In the interpreter (no GPU) at most 4: each program costs
  time there."""
  blocks = max(1, -(-max_keys // block_n))
  sms = sm_count()
  if sms is None:
    return max(1, min(4, -(-blocks // 4)))
  want = per_sm * sms // max(1, programs)
  per_split = max(MIN_KEYS_PER_SPLIT, 16 * rows, block_n)
  most = max(1, min(MAX_SPLITS, max_keys // per_split, blocks))
  return int(max(1, min(want, most)))


def pack_queries(q, kv_heads: int, rows_pad: int, d_pad: int):
  """``[B, T, N, D]`` -> ``[B, K, rows_pad, d_pad]``: row ``t * G + g`` is
  token ``t`` of query head ``k * G + g`` (zeros past the rows and
  channels)."""
  b, t, n, d = q.shape
  g = n // kv_heads
  q = q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 1, 3, 4)
  q = q.reshape(b, kv_heads, t * g, d)
  return common.pad_axis(common.pad_axis(q, 2, rows_pad), 3, d_pad)


def unpack_rows(o, t: int, n: int, d: int):
  """Inverse of :func:`pack_queries` on the output ``[B, K, R, D_pad]``."""
  b, nk = o.shape[:2]
  g = n // nk
  o = o[:, :, :t * g, :d].reshape(b, nk, t, g, d).transpose(0, 2, 1, 3, 4)
  return o.reshape(b, t, n, d)


def paged_attention(q, k, v, table, lengths, k_scale=None, v_scale=None, *,
                    q_scale=None, layout: str, page: int, scale: float,
                    compute_dtype,
                    f16_scores: bool = False, block_n: int | None = None,
                    num_splits: int | None = None,
                    num_warps: int | None = None,
                    num_stages: int | None = None, out_dtype=None):
  """Attention of ``q`` ``[B, T, N, D]`` (the newest ``T`` keys of each row
  are its own tokens) against the cache.

  Args:
    q: ``[B, T, N, D]``; PASA passes ``fl16(q * scale)`` with ``scale=1``
      and ``f16_scores``; int8 with ``q_scale``.
    k, v: ``layout="paged"``: pools ``[K, P, page, D]``; ``"dense"``:
      ``[B, K, S, D]`` with ``page`` dividing ``S``.  int8, float8_e4m3fn,
      float16 or bfloat16.
    table: int32 ``[B, pages]`` (:func:`dense_table` for a dense cache).
    lengths: int32 ``[B]``, each row's keys, the new tokens included.
    k_scale, v_scale: float32 per-token scales shaped like ``k`` without
      ``D``, or None.
    q_scale: float32 ``[B, T, N]``, the row scales of an int8 ``q`` (an
      int8 ``k`` only, ``D >= 32``): the scores are ``(q k^T)_int32 *
      q_scale``.
    compute_dtype: float16 or bfloat16, the dots' operand dtype (but an
      int8 ``q``'s QK dot, which is int8).
  Returns:
    ``[B, T, N, D]`` in ``out_dtype`` (default q's; float32 for an int8
    ``q``).
  """
  b, t, n, d = q.shape
  if layout == "paged":
    nk, head_pages, page_k, d_k = k.shape
    if page_k != page:
      raise ValueError(f"page {page} does not match the pool {k.shape}")
    max_page = head_pages - 1   # (a table entry is clamped into the pool)
  elif layout == "dense":
    _, nk, cap, d_k = k.shape
    if cap % page:
      raise ValueError(f"page {page} must divide the capacity {cap}")
    head_pages = cap // page
    max_page = (b - 1) * nk * head_pages + head_pages - 1
  else:
    raise ValueError(f"layout must be 'paged' or 'dense', got {layout!r}")
  if d_k != d:
    raise ValueError(f"q's head dim {d} differs from the cache's {d_k}")
  q_int8 = q_scale is not None
  if q_int8 != (jnp.dtype(q.dtype) == jnp.int8) or (
      q_int8 and jnp.dtype(k.dtype) != jnp.int8):
    raise ValueError(f"an int8 q needs q_scale and an int8 k, got q "
                     f"{q.dtype}, k {k.dtype}, q_scale "
                     f"{'given' if q_int8 else None}")
  if q_int8 and d < INT8_Q_MIN_DIM:
    raise ValueError(f"an int8 q needs a head dim of at least "
                     f"{INT8_Q_MIN_DIM}, got {d}")
  if q_int8 and tuple(q_scale.shape) != (b, t, n):
    raise ValueError(f"q_scale must be [B, T, N] = {(b, t, n)}, got "
                     f"{tuple(q_scale.shape)}")
  if d not in (16, 32, 64, 128, 256):
    raise NotImplementedError(f"head dim {d}: the kernel takes 16, 32, 64, "
                              "128 or 256")
  g = n // nk
  rows = t * g
  block_m = max(16, min(MAX_ROWS_PER_TILE, 1 << (rows - 1).bit_length()))
  row_tiles = -(-rows // block_m)
  tiles = DEFAULT_TILES[max(1, min(2, jnp.dtype(k.dtype).itemsize)),
                        block_m > 16]
  block_n = min(block_n or tiles[0], page)
  if page % block_n:
    raise ValueError(f"block_n {block_n} must divide the page {page}")
  max_keys = table.shape[1] * page
  splits = num_splits or choose_splits(b * nk * row_tiles, max_keys, block_n,
                                       rows=block_m, per_sm=tiles[3])
  cdt = jnp.dtype(compute_dtype)
  qp = pack_queries(q if q_int8 else q.astype(cdt), nk, row_tiles * block_m,
                   d)
  dummy = jnp.zeros((1,), jnp.float32)
  qs = dummy
  if q_int8:   # [B, T, N] -> [B, K, rows] as the rows are packed
    qs = pack_queries(q_scale.astype(jnp.float32)[..., None], nk,
                      row_tiles * block_m, 1)[..., 0]
  o, m, l = triton_call.launch(
      _kernel, qp, qs, k, v,
      dummy if k_scale is None else k_scale,
      dummy if v_scale is None else v_scale,
      table.astype(jnp.int32), lengths.astype(jnp.int32),
      int(head_pages), int(max_page), int(table.shape[1]), int(nk),
      int(t), int(g), np.float32(LOG2E if f16_scores else scale * LOG2E),
      out_shape=(
          jax.ShapeDtypeStruct((b, nk, splits, row_tiles * block_m, d),
                               jnp.float32),
          jax.ShapeDtypeStruct((b, nk, splits, row_tiles * block_m),
                               jnp.float32),
          jax.ShapeDtypeStruct((b, nk, splits, row_tiles * block_m),
                               jnp.float32)),
      grid=(b * nk, row_tiles, splits),
      num_warps=num_warps or tiles[1],
      num_stages=num_stages or tiles[2],
      BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=d, PAGE=page,
      NUM_SPLITS=splits, ROW_TILES=row_tiles,
      K_INT8=jnp.dtype(k.dtype) == jnp.int8,
      V_INT8=jnp.dtype(v.dtype) == jnp.int8,
      K_SCALED=k_scale is not None, V_SCALED=v_scale is not None,
      BF16=cdt == jnp.bfloat16, F16_SCORES=bool(f16_scores),
      V_FP8=jnp.dtype(v.dtype) == jnp.float8_e4m3fn, Q_INT8=q_int8,
      ASM=not common.interpret())
  out = combine(o, m, l)
  out = unpack_rows(out, t, n, d)
  return out.astype(out_dtype or (jnp.float32 if q_int8 else q.dtype))

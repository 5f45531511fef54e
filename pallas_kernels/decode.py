"""Split-K decode kernel (flash-decoding; Pallas, Triton lowering).

A few new query tokens (1 to 16) against a long key/value cache that is
already quantized: int8 or float8_e4m3fn K and V with one float32 scale per
token and head, or a float16/bfloat16 cache without scales.  Decode is
memory-bound, so the kernel is built to read the cache once and nothing
else:

* grid ``(batch, kv_head, split)``: each program owns one chunk of one
  row's keys (the chunks split the row's *length*, not the capacity, so
  rows of any length keep every split busy and nothing past the length is
  read);
* the query rows of a GQA group are packed into one tile: ``rows = T *
  (N / K)`` (row ``r`` is new token ``r // G`` of query head ``kv_head * G
  + r % G``), padded to a power of two >= 16 for the tensor-core dot, so
  each key block is loaded once for the whole group;
* per key block: ``S = (q_c K_c^T)_f32 * k_scale[None, :] * c`` with
  ``q_c`` the query and ``K_c`` the stored keys converted in registers to
  the compute dtype (int8 and e4m3 values are exact in float16), ``c =
  scale * log2 e`` (the softmax runs in base 2); V is dequantized in
  registers, ``fl_c(v * v_scale[:, None])``, and ``P = fl_c(exp2(S - m))``
  meets it in a float32-accumulated dot;
* the last (partial) blocks of a row are masked from indices: key ``j`` is
  seen by new token ``t`` iff ``j <= length - T + t`` (bottom-right causal
  among the new tokens, which are already in the cache), and V rows at or
  beyond the length are zeroed, so whatever the unused slots hold (NaN
  included) never reaches the output;
* each program writes its unnormalised ``(o, m, l)`` in float32;
  :func:`combine` merges the splits through the log-sum-exp (plain jnp:
  the partials are tiny next to the cache).

``f16_scores`` (PASA's float16 score matrix): the query is pre-multiplied
by the softmax scale in float16 and the scores are rounded to float16 as
they leave the dot; they overflow to inf where float16 would.

Nothing here imports jaxattn: the kernel takes arrays and static flags.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.common import LOG2E

MAX_NEW_TOKENS = 16
DEFAULT_BLOCK_K = 64
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3
# Programs per SM the split count aims at (several resident programs per SM
# keep enough loads in flight to saturate HBM).
PROGRAMS_PER_SM = 4
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 128


def sm_count() -> int | None:
  """Streaming multiprocessors of the default GPU (None without one)."""
  if not common.has_gpu():
    return None
  return getattr(common.default_device(), "core_count", None)


def choose_splits(batch: int, kv_heads: int, capacity: int,
                  block_k: int, rows: int = 16) -> int:
  """Splits per (batch row, KV head): enough programs to fill the GPU
  (:data:`PROGRAMS_PER_SM` per SM), with at least one block and
  ``max(MIN_KEYS_PER_SPLIT, 16 * rows)`` keys each, so that the float32
  partials (``rows x D`` per split) stay under 1/8 of the bytes of an
  8-bit cache read.  Without a GPU (interpret mode) one program per 4
  blocks of ``capacity``, at most 4: each program costs time there."""
  blocks = max(1, -(-capacity // block_k))
  sms = sm_count()
  if sms is None:
    return max(1, min(4, -(-blocks // 4)))
  want = -(-PROGRAMS_PER_SM * sms // max(1, batch * kv_heads))
  per_split = max(MIN_KEYS_PER_SPLIT, 16 * rows, block_k)
  most = max(1, min(MAX_SPLITS, capacity // per_split, blocks))
  return max(1, min(want, most))


def _int8_as(x, dtype):
  """int8 -> float16 / float32 exactly without the int-to-float converter
  (a quarter-rate unit): ``x ^ 0x80`` is ``x + 128`` as a byte; placed in
  the mantissa of ``1024`` (float16) or ``2^23`` (float32) it is that float
  plus ``x + 128``, and one subtraction leaves ``x``."""
  u = lax.bitcast_convert_type(x, jnp.uint8) ^ jnp.uint8(0x80)
  if jnp.dtype(dtype) == jnp.float16:
    h = u.astype(jnp.uint16) | jnp.uint16(0x6400)
    return lax.bitcast_convert_type(h, jnp.float16) - jnp.float16(1152.0)
  w = u.astype(jnp.uint32) | jnp.uint32(0x4B000000)
  return lax.bitcast_convert_type(w, jnp.float32) - jnp.float32(8388736.0)


def _convert(x, dtype):
  if x.dtype == jnp.int8 and jnp.dtype(dtype) in (jnp.float16, jnp.float32):
    return _int8_as(x, dtype)
  return x.astype(dtype)


def _decode_kernel(len_ref, q_ref, k_ref, v_ref, *refs, block_k, num_splits,
                   group, t_new, k_scaled, v_scaled, compute_dtype,
                   f16_scores, score_factor):
  """One split of one (batch row, KV head).

  len_ref int32 ``[1]`` (the row's length, new tokens included); q_ref
  ``[R, D]`` packed query rows in the compute dtype; k_ref, v_ref ``[S,
  D]`` (storage dtype); optional ks_ref, vs_ref float32 ``[S]``; outputs
  o ``[R, D]``, m ``[R]``, l ``[R]`` float32 (unnormalised, base 2).
  """
  refs = list(refs)
  ks_ref = refs.pop(0) if k_scaled else None
  vs_ref = refs.pop(0) if v_scaled else None
  o_ref, m_ref, l_ref = refs
  f32 = jnp.float32
  split = pl.program_id(2)
  length = len_ref[0]
  rows, dv = o_ref.shape
  q = q_ref[...]

  per = lax.div(lax.div(length + (num_splits - 1), num_splits)
                + (block_k - 1), block_k) * block_k        # keys per split
  start = split * per
  end = jnp.minimum(start + per, length)
  lo = lax.div(start, block_k)
  hi = jnp.where(end > start, lax.div(end + (block_k - 1), block_k), lo)
  # blocks every new token sees whole: keys <= length - T
  full = lax.div(jnp.maximum(length - t_new + 1, 0), block_k)
  full_hi = jnp.clip(full, lo, hi)
  # the last key each packed row sees (bottom-right causal)
  limit = length - t_new + lax.div(
      lax.broadcasted_iota(jnp.int32, (rows, block_k), 0), group)

  def body(j, carry, masked):
    m, l, o = carry
    ks = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    k = _convert(k_ref[ks, :], compute_dtype)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                        preferred_element_type=f32)
    if f16_scores:   # PASA: the float16 score matrix
      s = s.astype(jnp.float16).astype(f32)
    if k_scaled:
      s = s * (ks_ref[ks] * score_factor)[None, :]
    else:
      s = s * score_factor
    v = v_ref[ks, :]
    if v_scaled:
      v = _convert(v, f32) * vs_ref[ks][:, None]
    if masked:
      cols = j * block_k + lax.broadcasted_iota(jnp.int32, (rows, block_k), 1)
      s = jnp.where((cols <= limit) & (cols < length), s, -jnp.inf)
      key = j * block_k + lax.broadcasted_iota(jnp.int32, (block_k, dv), 0)
      v = jnp.where(key < length, v, 0)
    v = v.astype(compute_dtype)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp2(s - m_sub[:, None])
    alpha = jnp.exp2(m - m_sub)
    l = alpha * l + jnp.sum(p, axis=1)
    pv = lax.dot_general(p.astype(compute_dtype), v,
                         (((1,), (0,)), ((), ())), preferred_element_type=f32)
    return m_new, l, alpha[:, None] * o + pv

  init = (jnp.full((rows,), -jnp.inf, f32), jnp.zeros((rows,), f32),
          jnp.zeros((rows, dv), f32))
  carry = lax.fori_loop(lo, full_hi, functools.partial(body, masked=False),
                        init)
  m, l, o = lax.fori_loop(full_hi, hi, functools.partial(body, masked=True),
                          carry)
  o_ref[...] = o
  m_ref[...] = m
  l_ref[...] = l


def combine(o, m, l):
  """Merges the splits (axis 2) of the partials ``o [B, K, P, R, D]``, ``m,
  l [B, K, P, R]`` (base 2): ``sum_p 2^(m_p - M) o_p / sum_p 2^(m_p - M)
  l_p``; rows that see no key are 0."""
  mx = m.max(axis=2, keepdims=True)
  w = jnp.exp2(m - jnp.where(mx == -jnp.inf, 0.0, mx))
  den = (w * l).sum(axis=2)
  num = (w[..., None] * o).sum(axis=2)
  return jnp.where(den[..., None] > 0,
                   num / jnp.where(den > 0, den, 1.0)[..., None], 0.0)


def pack_queries(q, kv_heads: int, rows_pad: int, d_pad: int):
  """``[B, T, N, D]`` -> ``[B, K, rows_pad, d_pad]``: row ``t * G + g`` is
  token ``t`` of query head ``k * G + g`` (zeros below)."""
  b, t, n, d = q.shape
  g = n // kv_heads
  q = q.reshape(b, t, kv_heads, g, d).transpose(0, 2, 1, 3, 4)
  q = q.reshape(b, kv_heads, t * g, d)
  return common.pad_axis(common.pad_axis(q, 2, rows_pad), 3, d_pad)


def unpack_rows(o, t: int, n: int):
  """Inverse of :func:`pack_queries` on the output ``[B, K, R, D]``."""
  b, nk, _, d = o.shape
  g = n // nk
  o = o[:, :, :t * g].reshape(b, nk, t, g, d).transpose(0, 2, 1, 3, 4)
  return o.reshape(b, t, n, d)


def decode_attention(q, k, v, lengths, k_scale=None, v_scale=None, *,
                     scale: float, compute_dtype=jnp.float16,
                     f16_scores: bool = False, block_k: int | None = None,
                     num_splits: int | None = None,
                     num_warps: int | None = None,
                     num_stages: int | None = None, out_dtype=jnp.float32,
                     return_partials: bool = False):
  """Attention of ``T`` new query tokens against a KV cache.

  Args:
    q: ``[B, T, N, D]`` (``T <= 16``), any float dtype; rounded to
      ``compute_dtype`` (with ``f16_scores``: ``fl16(q * scale)``).
    k, v: ``[B, K, S, D]`` cache (head-major), int8, float8_e4m3fn,
      float16 or bfloat16; ``N`` a multiple of ``K``.
    lengths: int ``[B]``: valid keys of each row, the ``T`` new tokens
      included (they are the row's last ``T`` keys).
    k_scale, v_scale: float32 ``[B, K, S]`` per-token scales, or None (the
      stored values are the keys / values).
    scale: the softmax scale.
    compute_dtype: float16 or bfloat16, the dtype of both dots' operands.
    f16_scores: round the scores to float16 (PASA).
    block_k, num_splits, num_warps, num_stages: kernel knobs (None: the
      defaults, and :func:`choose_splits`).
    return_partials: also return the partials ``(o, m, l)`` before
      :func:`combine` (for tests).
  Returns:
    ``[B, T, N, D]`` in ``out_dtype``.
  """
  b, t, n, d = q.shape
  _, nk, s_len, dv = v.shape
  if not 1 <= t <= MAX_NEW_TOKENS:
    raise ValueError(f"decode takes 1 to {MAX_NEW_TOKENS} new tokens, got {t}")
  group = n // nk
  block_k = block_k or DEFAULT_BLOCK_K
  while block_k > 16 and s_len % block_k:   # no padding copy of the cache
    block_k //= 2
  s_pad = common.round_up(s_len, block_k)
  d_pad = max(pl.next_power_of_2(d), 16)
  dv_pad = max(pl.next_power_of_2(dv), 16)
  rows = max(16, pl.next_power_of_2(t * group))
  splits = num_splits or choose_splits(b, nk, s_len, block_k, rows)
  if f16_scores:
    q = (q.astype(jnp.float32) * scale).astype(jnp.float16)
    factor = LOG2E
  else:
    factor = float(scale) * LOG2E
  qp = pack_queries(q.astype(compute_dtype), nk, rows, d_pad)
  pad = common.pad_axis
  k = pad(pad(k, 2, s_pad), 3, d_pad)
  v = pad(pad(v, 2, s_pad), 3, dv_pad)
  lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, s_len).reshape(b, 1)
  kv_spec = lambda width: pl.BlockSpec((None, None, s_pad, width),
                                       lambda bi, h, sp: (bi, h, 0, 0))
  args = [lengths, qp, k, v]
  in_specs = [pl.BlockSpec((None, 1), lambda bi, h, sp: (bi, 0)),
              pl.BlockSpec((None, None, rows, d_pad),
                           lambda bi, h, sp: (bi, h, 0, 0)),
              kv_spec(d_pad), kv_spec(dv_pad)]
  for x in (k_scale, v_scale):
    if x is not None:
      args.append(pad(x.astype(jnp.float32), 2, s_pad))
      in_specs.append(pl.BlockSpec((None, None, s_pad),
                                   lambda bi, h, sp: (bi, h, 0)))
  kernel = functools.partial(
      _decode_kernel, block_k=block_k, num_splits=splits, group=group,
      t_new=t, k_scaled=k_scale is not None, v_scaled=v_scale is not None,
      compute_dtype=compute_dtype, f16_scores=f16_scores,
      score_factor=factor)
  part = lambda *shape: jax.ShapeDtypeStruct((b, nk, splits, *shape),
                                             jnp.float32)
  o, m, l = pl.pallas_call(
      kernel, grid=(b, nk, splits), in_specs=in_specs,
      out_specs=[pl.BlockSpec((None, None, None, rows, dv_pad),
                              lambda bi, h, sp: (bi, h, sp, 0, 0)),
                 pl.BlockSpec((None, None, None, rows),
                              lambda bi, h, sp: (bi, h, sp, 0)),
                 pl.BlockSpec((None, None, None, rows),
                              lambda bi, h, sp: (bi, h, sp, 0))],
      out_shape=[part(rows, dv_pad), part(rows), part(rows)],
      compiler_params=plgpu.CompilerParams(
          num_warps=num_warps or DEFAULT_NUM_WARPS,
          num_stages=num_stages or DEFAULT_NUM_STAGES),
      interpret=common.interpret(), name="jaxattn_decode")(*args)
  out = unpack_rows(combine(o, m, l)[..., :dv], t, n).astype(out_dtype)
  return (out, (o, m, l)) if return_partials else out

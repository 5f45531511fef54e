"""Non-finite inputs confined to the rows they reach.

The methods that take statistics across rows or keys (quantization scales,
smoothing means, PASA's key-block shift) would let one NaN/Inf reach rows
that float32 attention keeps finite, and their quantizers would turn it
into a finite, wrong number.  They run as if every non-finite element were
0 and then set NaN in exactly the rows it reaches (:func:`rows_reached`).

The fast paths do both inside the kernels that already read each operand
(:func:`pallas_kernels.quantizers.rows_operand`, ``v_operand``,
:func:`pallas_kernels.key_shift.shifted_key_blocks`, ``flag_nonfinite``),
which return per-row flags; :func:`confined` does the same for any
backend function with one pass of XLA over the inputs.

Nothing here branches on the data (no ``lax.cond``, whose predicate the
host would wait for with the GPU idle): what finite inputs need is
computed anyway, at the costs stated in :func:`rows_reached`.
"""
from __future__ import annotations

import jax.numpy as jnp

from jaxattn import base
from pallas_kernels import common


def finite(x):
  """``x`` with NaN/Inf elements set to 0."""
  return jnp.where(jnp.isfinite(x), x, jnp.zeros_like(x))


def row_flags(x):
  """Bool ``[B, L, H]``: the rows of ``x`` ``[B, L, H, D]`` holding a
  NaN/Inf."""
  return ~jnp.isfinite(x).all(axis=-1)


def rows_reached(bad_q, bad_kv, mask, kv_lens, *, is_causal, q_shape,
                 index_mask=None):
  """Bool ``[B, T, N]`` (``q_shape``): the rows a non-finite input
  reaches, as in float32 attention.  A row is reached when its query has a
  NaN/Inf (``bad_q`` ``[B, T, N]``, or None) and it sees a key, or when it
  sees a key whose key or value vector has one (``bad_kv`` ``[B, S, K]``).
  ``kv_lens``, causality and ``mask`` ``[B, N, T, S]`` decide what a row
  sees.  (Float32 attention also ignores an infinite key in the rows where
  its score is ``-inf``; here every row that sees it is reached.)
  ``index_mask`` (:class:`pallas_kernels.common.IndexMask`): query lengths,
  alignment, window and segment ids, as the kernels see them.

  Cost, whatever the inputs hold: with a dense ``mask`` one reduction
  over it (``B N T S`` bytes read, as the kernel reads it); otherwise
  reductions over the ``[B, S, K]`` flags and per-row indices, no ``[B,
  T, S]`` array (with segment ids a sort of each batch row's key ids and
  a binary search per query row, :func:`_rows_reached_in_segments`)."""
  if index_mask is not None:
    return _rows_reached_indexed(bad_q, bad_kv, mask, kv_lens, index_mask,
                                 is_causal=is_causal, q_shape=q_shape)
  b, t, n = q_shape[:3]
  s, nk = bad_kv.shape[1], bad_kv.shape[2]
  bad_key = jnp.repeat(bad_kv, n // nk, axis=2)                # [B, S, N]
  cols = jnp.arange(s)
  seen = cols[None, :] < kv_lens[:, None]                      # [B, S]
  if mask is None:
    sees_any = (kv_lens > 0)[:, None, None]    # causal rows all see key 0
    if is_causal:   # row i sees keys j <= i: reached from the first bad key
      first = jnp.where(bad_key & seen[..., None], cols[None, :, None],
                        s).min(axis=1)                         # [B, N]
      reached = ((jnp.arange(t)[None, :, None] >= first[:, None, :])
                 & (first < s)[:, None, :])
    else:
      reached = (bad_key & seen[..., None]).any(axis=1)[:, None, :]
  else:
    vis = mask & seen[:, None, None, :]                        # [B, N, T, S]
    if is_causal:
      vis = vis & (cols[None, :] <= jnp.arange(t)[:, None])
    reached = (vis & jnp.transpose(bad_key, (0, 2, 1))[:, :, None, :]).any(-1)
    reached = jnp.transpose(reached, (0, 2, 1))
    sees_any = jnp.transpose(vis.any(-1), (0, 2, 1))
  reached = jnp.broadcast_to(reached, (b, t, n))
  if bad_q is None:
    return reached
  return (bad_q & sees_any) | reached


def _rows_reached_indexed(bad_q, bad_kv, mask, kv_lens, index_mask, *,
                          is_causal, q_shape):
  """:func:`rows_reached` with an index mask.  Without a dense mask each
  row sees one range of keys (:func:`common.row_key_ranges`), so a prefix
  count of the non-finite keys answers it, within the row's segment where
  there are segment ids (:func:`_rows_reached_in_segments`); with one,
  the dense rule on it and the index mask's visibility, one reduction
  over the mask (the index part computed in the same pass).  No
  ``lax.cond``: the earlier form built the dense visibility only when
  some input was not finite, and the host waited for that predicate."""
  t = q_shape[1]
  if mask is None and not index_mask.has_segments:
    return _rows_reached_in_ranges(bad_q, bad_kv, kv_lens, index_mask,
                                   is_causal=is_causal, q_shape=q_shape)
  if mask is None:
    return _rows_reached_in_segments(bad_q, bad_kv, kv_lens, index_mask,
                                     is_causal=is_causal, q_shape=q_shape)
  bounds = common.row_bounds(kv_lens, index_mask, t=t, is_causal=is_causal)
  vis = base.index_visibility(bounds, index_mask.q_segments,
                              index_mask.kv_segments, t=t,
                              s=bad_kv.shape[1])[:, None]  # [B, 1, T, S]
  return rows_reached(bad_q, bad_kv, vis & mask, kv_lens, is_causal=False,
                      q_shape=q_shape)


def _rows_reached_in_ranges(bad_q, bad_kv, kv_lens, index_mask, *,
                            is_causal, q_shape):
  """:func:`rows_reached` where row ``i`` sees the keys ``first_i ..
  last_i``: reached where that range holds a non-finite key (the count
  of them before ``last_i + 1`` less that before ``first_i``), or the
  row's own query is non-finite and the range is not empty."""
  b, t, n = q_shape[:3]
  s, nk = bad_kv.shape[1], bad_kv.shape[2]
  bounds = common.row_bounds(kv_lens, index_mask, t=t, is_causal=is_causal)
  first, last = (x[..., None] for x in jnp.moveaxis(
      common.row_key_ranges(bounds, t_pad=t), 1, 0))          # [B, T, 1]
  sees_any = last >= first
  before = jnp.pad(jnp.cumsum(bad_kv.astype(jnp.int32), axis=1),
                   ((0, 0), (1, 0), (0, 0)))                   # [B, S + 1, K]
  count = lambda at: jnp.take_along_axis(
      before, jnp.broadcast_to(jnp.clip(at, 0, s), (b, t, nk)), axis=1)
  reached = sees_any & (count(last + 1) > count(first))         # [B, T, K]
  reached = jnp.repeat(reached, n // nk, axis=2)
  if bad_q is None:
    return reached
  return reached | (bad_q & sees_any)


def _count_before(seg_sorted, pos_sorted, seg, pos):
  """Per query row, how many keys come before ``(seg, pos)`` in the keys'
  order by (segment id, position): ``seg_sorted``, ``pos_sorted`` int32
  ``[B, S]`` in that order, ``seg``, ``pos`` int32 ``[B, T]``.  A binary
  search unrolled to ``S.bit_length()`` steps of gathers (no loop whose
  predicate the host would read)."""
  s = seg_sorted.shape[1]
  lo = jnp.zeros(seg.shape, jnp.int32)
  hi = jnp.full(seg.shape, s, jnp.int32)
  for _ in range(s.bit_length()):
    mid = (lo + hi) // 2
    at = jnp.minimum(mid, s - 1)
    g = jnp.take_along_axis(seg_sorted, at, axis=1)
    p = jnp.take_along_axis(pos_sorted, at, axis=1)
    before = (g < seg) | ((g == seg) & (p < pos))
    active = lo < hi
    lo = jnp.where(active & before, mid + 1, lo)
    hi = jnp.where(active & ~before, mid, hi)
  return lo


def _rows_reached_in_segments(bad_q, bad_kv, kv_lens, index_mask, *,
                              is_causal, q_shape):
  """:func:`rows_reached` where row ``i`` sees the keys ``first_i ..
  last_i`` of its own segment (any ids, sorted or not).  The keys ordered
  by (segment id, position), a stable sort of each batch row's ids, put
  the keys a row sees in one run: from the first key at or after
  ``(q_seg_i, first_i)`` to the last before ``(q_seg_i, last_i + 1)``
  (:func:`_count_before`); a prefix count of the non-finite keys in that
  order answers it.

  Cost per call, whatever the inputs hold: a sort of ``[B, S]`` int32 ids,
  ``2 S.bit_length()`` gathers of ``[B, T]`` int32 and a prefix count and
  two gathers over ``[B, S, K]`` (at 2 x 8192 keys and 32 heads about 6 MB
  moved in all, against 134 MB for a ``[B, T, S]`` boolean mask)."""
  b, t, n = q_shape[:3]
  s, nk = bad_kv.shape[1], bad_kv.shape[2]
  bounds = common.row_bounds(kv_lens, index_mask, t=t, is_causal=is_causal)
  first, last = jnp.moveaxis(common.row_key_ranges(bounds, t_pad=t), 1, 0)
  q_seg = index_mask.q_segments.astype(jnp.int32)                # [B, T]
  kv_seg = index_mask.kv_segments.astype(jnp.int32)              # [B, S]
  order = jnp.argsort(kv_seg, axis=1, stable=True).astype(jnp.int32)
  seg_sorted = jnp.take_along_axis(kv_seg, order, axis=1)
  lo = _count_before(seg_sorted, order, q_seg, first)
  hi = _count_before(seg_sorted, order, q_seg, last + 1)
  sees_any = hi > lo                                             # [B, T]
  bad_sorted = jnp.take_along_axis(bad_kv, order[..., None], axis=1)
  before = jnp.pad(jnp.cumsum(bad_sorted.astype(jnp.int32), axis=1),
                   ((0, 0), (1, 0), (0, 0)))                     # [B, S + 1, K]
  count = lambda at: jnp.take_along_axis(
      before, jnp.broadcast_to(at[..., None], (b, t, nk)), axis=1)
  reached = sees_any[..., None] & (count(hi) > count(lo))        # [B, T, K]
  reached = jnp.repeat(reached, n // nk, axis=2)
  if bad_q is None:
    return reached
  return reached | (bad_q & sees_any[..., None])


def poison(out, rows):
  """NaN in the output ``rows`` (``[B, T, N]``).  An int8 output (a tuple:
  one scale for the tensor) gets a NaN scale when any row is reached."""
  if isinstance(out, tuple):
    return (out[0], jnp.where(rows.any(), jnp.nan, out[1]), *out[2:])
  return jnp.where(rows[..., None], jnp.nan, out)


def confined(run, q, k, v, bias, mask, kv_lens, *, is_causal,
             index_mask=None, **kwargs):
  """``run(q, k, v, bias, mask, kv_lens, is_causal=..., **kwargs)`` on the
  inputs with NaN/Inf set to 0, NaN in the rows they reach: one XLA pass
  over Q, K and V (the backends whose kernels flag non-finite rows
  themselves need none).  ``kv_lens`` None: every key."""
  bad_q = row_flags(q)
  bad_kv = row_flags(k) | row_flags(v)
  if index_mask is not None:
    kwargs["index_mask"] = index_mask
  out = run(finite(q), finite(k), finite(v), bias, mask, kv_lens,
            is_causal=is_causal, **kwargs)
  lens = base.kv_lengths(kv_lens, q.shape[0], k.shape[1])
  return poison(out, rows_reached(bad_q, bad_kv, mask, lens,
                                  is_causal=is_causal, q_shape=q.shape,
                                  index_mask=index_mask))

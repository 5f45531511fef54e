"""Flash-attention backward kernels (Pallas, Triton lowering; interpret mode
on CPU): the gradients of softmax attention from the log-sum-exp, without
the ``[T, S]`` score matrix in memory (FlashAttention-2, Algorithm 2).

With ``s = scale q k^T``, ``P = exp(s - lse)`` and ``delta = rowsum(dO *
O)`` given::

    dV = P^T dO      dP = dO V^T      dS = P * (dP - delta)
    dQ = scale dS K                    dK = scale dS^T Q

Two kernels, so that no two programs add into the same rows (no atomics):
``_dkdv_kernel`` owns a block of keys and walks the query blocks that see
it; ``_dq_kernel`` owns a block of queries and walks the key blocks it
sees.  Both skip the blocks that causality, the window, segment ids or the
lengths hide (:func:`common.block_ranges`), as the
forward does.  Grouped-query attention: each query head writes its own dK,
dV, summed over the group by the caller.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common


def _probabilities(q, k, lse, *, scale, i, j, bounds, q_seg, k_seg, block_q,
                   block_k):
  """``P = exp(scale q k^T - lse)`` of query block ``i`` and key block
  ``j``, ``[block_q, block_k]`` float32, 0 where hidden (``bounds``:
  :func:`common.row_bounds`; segment ids or None)."""
  s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                      preferred_element_type=jnp.float32) * scale
  rows, cols = common.block_indices(i, j, block_q, block_k)
  vis = common.visible(rows, cols, bounds, row_segments=q_seg,
                       col_segments=k_seg)
  return jnp.where(vis, jnp.exp(s - lse[:, None]), 0.0)


def _segments(refs, has_segments):
  return (refs[0], refs[1]) if has_segments else (None, None)


def _dkdv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bounds_ref,
                 range_ref, *refs, scale, block_q, block_k, has_segments):
  """One key block of one query head: its dK, dV ``[block_k, D]``, from the
  query blocks ``range_ref`` names (:func:`common.block_ranges` of the
  transposed bounds)."""
  qseg_ref, kseg_ref = _segments(refs, has_segments)
  dk_ref, dv_ref = refs[-2:]
  j = pl.program_id(0)
  bounds = tuple(bounds_ref[c] for c in range(4))
  k, v = k_ref[...], v_ref[...]
  k_seg = kseg_ref[...] if has_segments else None

  def body(i, carry):
    dk, dv = carry
    rows = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
    q, do = q_ref[rows, :], do_ref[rows, :]
    p = _probabilities(q, k, lse_ref[rows], scale=scale, i=i, j=j,
                       bounds=bounds,
                       q_seg=qseg_ref[rows] if has_segments else None,
                       k_seg=k_seg, block_q=block_q, block_k=block_k)
    dv = dv + lax.dot_general(p.astype(do.dtype), do,
                              (((0,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)
    ds = p * (dp - delta_ref[rows][:, None])
    dk = dk + lax.dot_general(ds.astype(q.dtype), q,
                              (((0,), (0,)), ((), ())),
                              preferred_element_type=jnp.float32)
    return dk, dv

  zeros = jnp.zeros(dk_ref.shape, jnp.float32)
  dk, dv = lax.fori_loop(range_ref[0], range_ref[3], body, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bounds_ref,
               range_ref, *refs, scale, block_q, block_k, has_segments):
  """One query block of one query head: its dQ ``[block_q, D]``, from the
  key blocks ``range_ref`` names."""
  qseg_ref, kseg_ref = _segments(refs, has_segments)
  dq_ref = refs[-1]
  i = pl.program_id(0)
  bounds = tuple(bounds_ref[c] for c in range(4))
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  q_seg = qseg_ref[...] if has_segments else None

  def body(j, dq):
    cols = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    k, v = k_ref[cols, :], v_ref[cols, :]
    p = _probabilities(q, k, lse, scale=scale, i=i, j=j, bounds=bounds,
                       q_seg=q_seg,
                       k_seg=kseg_ref[cols] if has_segments else None,
                       block_q=block_q, block_k=block_k)
    dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)
    ds = p * (dp - delta[:, None])
    return dq + lax.dot_general(ds.astype(k.dtype), k,
                                (((1,), (0,)), ((), ())),
                                preferred_element_type=jnp.float32)

  dq = lax.fori_loop(range_ref[0], range_ref[3], body,
                     jnp.zeros(dq_ref.shape, jnp.float32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def flash_backward(q, k, v, kv_lens, lse, delta, dout, *, scale, is_causal,
                   params: common.KernelParams, index_mask=None):
  """``(dq, dk, dv)`` float32 of softmax attention.

  Args:
    q: ``[B, T, N, D]``; k, v: ``[B, S, K, D]`` (``N`` a multiple of ``K``),
      float16, bfloat16 or float32 (the products take that dtype, float32
      accumulation); dout ``[B, T, N, D]``; kv_lens int32 ``[B]``.
    lse: float32 ``[B, N, T]``, the natural-log log-sum-exp of each row's
      visible scores (finite: a row that sees no key gets P = 0 anyway).
    delta: float32 ``[B, N, T]``, ``rowsum(dO * O)``.
    params: ``block_q``, ``block_k``, ``num_warps``, ``num_stages``.
    index_mask: query lengths, alignment, window and segment ids
      (:class:`common.IndexMask`), or None.
  Returns: dq ``[B, T, N, D]``, dk, dv ``[B, S, K, D]``, float32.
  """
  b, t, n, d = q.shape
  s_len, nk = k.shape[1], k.shape[2]
  group = n // nk
  d_pad = max(pl.next_power_of_2(d), 16)
  bq = min(params.block_q, max(16, pl.next_power_of_2(t)))
  bk = min(params.block_k, max(16, pl.next_power_of_2(s_len)))
  t_pad, s_pad = common.round_up(t, bq), common.round_up(s_len, bk)
  dt = q.dtype
  pad = common.pad_axis
  q, dout = (pad(pad(x.astype(dt), 1, t_pad), 3, d_pad) for x in (q, dout))
  k, v = (pad(pad(x.astype(dt), 1, s_pad), 3, d_pad) for x in (k, v))
  lse, delta = (pad(x.astype(jnp.float32), 2, t_pad) for x in (lse, delta))
  # (the element mask decides in every block: no unmasked blocks here)
  bounds, q_ranges, segments = common.index_operands(
      kv_lens, index_mask, t=t, s=s_len, is_causal=is_causal, t_pad=t_pad,
      s_pad=s_pad, block_q=bq, block_k=bk, has_mask=True)
  im = index_mask or common.IndexMask()
  k_ranges = common.block_ranges(common.transpose_bounds(bounds),
                                 im.kv_segments, im.q_segments,
                                 n_row_blocks=s_pad // bk, block_r=bk,
                                 block_c=bq, has_mask=True)
  compiler = plgpu.CompilerParams(num_warps=params.num_warps,
                                  num_stages=params.num_stages)
  static = dict(scale=float(scale), block_q=bq, block_k=bk,
                has_segments=bool(segments))
  bounds_spec = pl.BlockSpec((None, 4), lambda j, bi, h: (bi, 0))
  range_spec = pl.BlockSpec((None, None, 4), lambda j, bi, h: (bi, j, 0))

  rows_all = pl.BlockSpec((None, t_pad, None, d_pad),
                          lambda j, bi, h: (bi, 0, h, 0))
  keys_blk = pl.BlockSpec((None, bk, None, d_pad),
                          lambda j, bi, h: (bi, j, h // group, 0))
  stats_all = pl.BlockSpec((None, None, t_pad), lambda j, bi, h: (bi, h, 0))
  out_keys = pl.BlockSpec((None, bk, None, d_pad),
                          lambda j, bi, h: (bi, j, h, 0))
  seg_specs = [pl.BlockSpec((None, t_pad), lambda j, bi, h: (bi, 0)),
               pl.BlockSpec((None, bk), lambda j, bi, h: (bi, j))]
  dk, dv = pl.pallas_call(
      functools.partial(_dkdv_kernel, **static),
      grid=(s_pad // bk, b, n),
      in_specs=[rows_all, keys_blk, keys_blk, rows_all, stats_all, stats_all,
                bounds_spec, range_spec, *seg_specs[:len(segments)]],
      out_specs=[out_keys, out_keys],
      out_shape=[jax.ShapeDtypeStruct((b, s_pad, n, d_pad), jnp.float32)] * 2,
      compiler_params=compiler, interpret=common.interpret(),
      name="jaxattn_flash_bwd_dkdv",
  )(q, k, v, dout, lse, delta, bounds, k_ranges, *segments)

  rows_blk = pl.BlockSpec((None, bq, None, d_pad),
                          lambda i, bi, h: (bi, i, h, 0))
  keys_all = pl.BlockSpec((None, s_pad, None, d_pad),
                          lambda i, bi, h: (bi, 0, h // group, 0))
  stats_blk = pl.BlockSpec((None, None, bq), lambda i, bi, h: (bi, h, i))
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, **static),
      grid=(t_pad // bq, b, n),
      in_specs=[rows_blk, keys_all, keys_all, rows_blk, stats_blk, stats_blk,
                bounds_spec, range_spec,
                *[pl.BlockSpec((None, bq), lambda i, bi, h: (bi, i)),
                  pl.BlockSpec((None, s_pad), lambda i, bi, h: (bi, 0))
                  ][:len(segments)]],
      out_specs=rows_blk,
      out_shape=jax.ShapeDtypeStruct((b, t_pad, n, d_pad), jnp.float32),
      compiler_params=compiler, interpret=common.interpret(),
      name="jaxattn_flash_bwd_dq",
  )(q, k, v, dout, lse, delta, bounds, q_ranges, *segments)

  per_group = lambda x: x[:, :s_len, :, :d].reshape(
      b, s_len, nk, group, d).sum(axis=3)
  return dq[:, :t, :, :d], per_group(dk), per_group(dv)

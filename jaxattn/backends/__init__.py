"""The backends that run the methods: one module per backend.

Each backend module has

* ``NAME`` and ``TITLE`` (for messages);
* ``native()``: whether ``implementation=None`` may pick it on this machine
  (an explicit ``implementation=NAME`` runs anywhere: the kernels run in
  interpret mode without a GPU);
* ``ADAPTERS``: the table from method name to :class:`Adapter`, which checks
  that the backend can honour the call and maps the method's configuration
  to the kernel's operands and flags.

:mod:`jaxattn.api` holds the table of backends and the order in which
``implementation=None`` tries them.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxattn import base, nonfinite
from pallas_kernels import common


@dataclasses.dataclass(frozen=True)
class Call:
  """What a support check sees of one call: shapes, dtypes and static flags
  (bias and mask already broadcast; no array values)."""
  method: str
  config: Any
  q: jax.ShapeDtypeStruct   # [B, T, N, D]
  k: jax.ShapeDtypeStruct   # [B, S, K, D]
  has_bias: bool
  has_mask: bool
  is_causal: bool
  # what the index mask holds: a subset of INDEX_FEATURES
  index_features: frozenset = frozenset()


# The parts of :class:`pallas_kernels.common.IndexMask` a call may use.
INDEX_FEATURES = ("query_seq_lengths", "causal_alignment",
                  "local_window_size", "segment_ids")


def _accepts(call: Call) -> None:
  del call


@dataclasses.dataclass(frozen=True)
class Adapter:
  """One method on one backend.

  ``run(q, k, v, bias, mask, kv_lens, *, scale, is_causal, config)`` takes
  the normalised BTNH inputs (bias/mask ``[B, N, T, S]`` or None, kv_lens
  int32 ``[B]``; with ``index_mask`` true also the keyword ``index_mask``,
  a :class:`pallas_kernels.common.IndexMask` or None) and returns ``[B, T, N, Dv]`` (any float dtype; the API
  casts to the query dtype) or the method's tuple.  ``check(call)`` raises
  NotImplementedError with the reason when the backend cannot run the call
  as asked, including any option it cannot honour.

  ``confines_nonfinite``: ``run`` itself confines NaN/Inf inputs to the
  rows they reach (:mod:`jaxattn.nonfinite`), from flags its kernels
  return; otherwise the API wraps ``run`` in :func:`jaxattn.nonfinite.
  confined` for the methods that need it.

  ``segment_scales``: ``run`` (a reference, which takes the index mask as
  a dense mask) also takes ``segments=(q_segment_ids, kv_segment_ids)``,
  for a method whose quantization scales follow packed documents; the
  kernel adapters read them from ``index_mask``.

  Quantized adapters also expose their two stages, ``prepare(q, k, v,
  kv_lens, *, scale, config, segments=None)`` ->
  :class:`jaxattn.operands.QuantizedOperands`
  and ``kernel(operands, kv_lens, bias, mask, *, is_causal, config,
  out_dtype)``, so that the benchmark can time the kernel alone.

  ``defaults``: ``(option, value)`` pairs the backend runs the method
  with where neither the call nor the method's preset sets the option
  (:meth:`jaxattn.base.MethodConfig.fixed_fields`), e.g. the key block of
  its tiles; or a function ``(config, masked, is_causal) -> pairs`` where
  they depend on the config, on whether the call skips key blocks by an
  index mask (``masked``: segment ids or a local window) or on causality.
  The support check runs on the call's config before they are filled in,
  so a default must be a value the check accepts.

  ``run_lse``, where the kernel computes it, is ``run`` that also returns
  the float32 log-sum-exp ``[B, N, T]`` (natural log, ``-inf`` for a row
  that sees no key); without it the log-sum-exp comes from
  :func:`logsumexp`.

  ``run_output_lse``: ``run`` that also returns the log-sum-exp of the
  scores the kernel formed (the quantized ones, in the units of the
  method's scores), the normalizer of the output it returns.  Merging
  partial outputs (the ring's steps) needs that one; no gradient uses it,
  as it is not float attention's.

  ``all_keys``: ``run`` (and ``run_lse``, ``run_output_lse``) take
  ``kv_lens=None`` for a call without key lengths, whose every key is
  seen, a fact fixed at trace time: the Mosaic kernel then compiles no
  masked step on a call that needs none.
  """
  run: Callable[..., Any]
  check: Callable[[Call], None] = _accepts
  prepare: Callable[..., Any] | None = None
  kernel: Callable[..., Any] | None = None
  confines_nonfinite: bool = False
  run_lse: Callable[..., Any] | None = None
  run_output_lse: Callable[..., Any] | None = None
  index_mask: bool = False
  segment_scales: bool = False
  defaults: tuple = ()
  all_keys: bool = False


def with_defaults(adapter: Adapter, config, options, masked: bool = False,
                  is_causal: bool = False):
  """``config`` with ``adapter.defaults`` in the fields ``options`` (the
  call's, preset included) leave unset; ``masked``: the call has segment
  ids or a local window; ``is_causal``: the call's causality."""
  fixed = type(config).fixed_fields(options)
  pairs = (adapter.defaults(config, masked, is_causal)
           if callable(adapter.defaults) else adapter.defaults)
  changes = {k: v for k, v in pairs if k not in fixed}
  return dataclasses.replace(config, **changes) if changes else config


def two_stage(prepare, kernel, check=_accepts, defaults=(),
              kernel_lse: bool = False, kernel_nan_rows: bool = False,
              all_keys: bool = False, query_chunk=None) -> Adapter:
  """An adapter that quantizes (``prepare``, which flags the rows holding
  NaN/Inf) and then runs ``kernel`` on the operands, returning the query
  dtype with NaN in the rows a non-finite input reaches.  ``kernel_lse``:
  ``kernel`` takes ``return_lse`` (its log-sum-exp ``[B, N, T]``), which
  makes ``run_output_lse``.  ``kernel_nan_rows``: ``kernel`` takes
  ``nan_rows`` (bool ``[B, T, N]``) and writes those rows as NaN itself,
  which saves a pass over the output.  ``all_keys``: ``kernel`` takes
  ``kv_lens=None`` for every key (:attr:`Adapter.all_keys`).
  ``query_chunk(q, k, config)``: query rows per chunk where the operands of
  the whole call would hold too much (then each chunk is prepared and run
  as a call of its own: :func:`by_query_chunks`), or None."""
  def run(q, k, v, bias, mask, kv_lens, *, scale, is_causal, config,
          index_mask=None, return_lse=False):
    rows = query_chunk(q, k, config) if query_chunk is not None else None
    if rows is not None and rows < q.shape[1]:
      return by_query_chunks(
          functools.partial(run_whole, scale=scale, is_causal=is_causal,
                            config=config, return_lse=return_lse),
          rows, q, k, v, bias, mask, kv_lens, is_causal=is_causal,
          index_mask=index_mask, return_lse=return_lse)
    return run_whole(q, k, v, bias, mask, kv_lens, scale=scale,
                     is_causal=is_causal, config=config,
                     index_mask=index_mask, return_lse=return_lse)

  def run_whole(q, k, v, bias, mask, kv_lens, *, scale, is_causal, config,
                index_mask=None, return_lse=False):
    kernel_lens = kv_lens
    if kv_lens is None:
      kv_lens = base.kv_lengths(None, q.shape[0], k.shape[1])
    segments = (None if index_mask is None or index_mask.q_segments is None
                else (index_mask.q_segments, index_mask.kv_segments))
    ops = prepare(q, k, v, kv_lens, scale=scale, config=config,
                  segments=segments)
    # per-segment V scales multiply the output rows after the kernel (in
    # float32 where the kernel writes it: one rounding, as the reference)
    row_scaled = ops.out_row_scale is not None
    reached = nonfinite.rows_reached(
        ops.q_nonfinite, ops.kv_nonfinite, mask, kv_lens,
        is_causal=is_causal, q_shape=q.shape, index_mask=index_mask)
    # (the row scaling is a pass over the output anyway: NaN joins it)
    in_kernel = kernel_nan_rows and not row_scaled
    out = kernel(ops, kernel_lens, bias, mask, is_causal=is_causal,
                 config=config,
                 out_dtype=jnp.float32 if row_scaled else q.dtype,
                 index_mask=index_mask,
                 **({"return_lse": True} if return_lse else {}),
                 **({"nan_rows": reached} if in_kernel else {}))
    out, lse = out if return_lse else (out, None)
    if row_scaled:
      out = (out.astype(jnp.float32)
             * ops.out_row_scale[..., None]).astype(q.dtype)
    if not in_kernel:
      out = nonfinite.poison(out, reached)
    if not return_lse:
      return out
    if ops.k_shift is not None:   # the scores the smoothing took away
      # (NaN/Inf count as 0, as in the quantizers; a row that sees no key
      # keeps -inf, whatever its query holds)
      shift = scale * _row_dot(nonfinite.finite(q), ops.k_shift)
      lse = jnp.where(jnp.isneginf(lse), lse, lse + shift)
    return out, jnp.where(reached.transpose(0, 2, 1), jnp.nan, lse)
  return Adapter(run=run, check=check, prepare=prepare, kernel=kernel,
                 confines_nonfinite=True, index_mask=True, defaults=defaults,
                 all_keys=all_keys,
                 run_output_lse=(functools.partial(run, return_lse=True)
                                 if kernel_lse else None))


def by_query_chunks(run, rows: int, q, k, v, bias, mask, kv_lens, *,
                    is_causal: bool, index_mask, return_lse: bool):
  """``run(q, k, v, bias, mask, kv_lens, index_mask=...)`` on blocks of
  ``rows`` query rows, each as a call of its own, the outputs (and
  log-sum-exps) joined: query row ``c0 + i`` is the chunk's row ``i``, so
  its diagonal offset grows by ``c0`` and its query length and segment ids
  are the chunk's (:meth:`pallas_kernels.common.IndexMask.query_rows`).  A bias or
  mask ``[..., T, S]`` is sliced with the rows.  Each chunk starts after
  the one before has its output, so that only one chunk's operands are
  held at a time."""
  b, t = q.shape[:2]
  im = index_mask
  if im is None and is_causal:
    im = common.IndexMask()
  outs = []
  for c0 in range(0, t, rows):
    c1 = min(c0 + rows, t)
    q_rows, k_c, v_c = q[:, c0:c1], k, v
    if outs:   # one chunk after the other: the chunks are independent, and
      # XLA would otherwise run every chunk's quantizers first and hold all
      # their operands at once
      _, q_rows, k_c, v_c = lax.optimization_barrier(
          (outs[-1], q_rows, k, v))
    rows_of = lambda x: (x if x is None or x.shape[-2] != t
                         else x[..., c0:c1, :])
    part = None if im is None else im.query_rows(c0, c1, b)
    outs.append(run(q_rows, k_c, v_c, rows_of(bias), rows_of(mask), kv_lens,
                    index_mask=part))
  if not return_lse:
    return jnp.concatenate(outs, axis=1)
  return (jnp.concatenate([o for o, _ in outs], axis=1),
          jnp.concatenate([l for _, l in outs], axis=2))


def _row_dot(q, k_rows):
  """``q . k_rows`` of each query row with its key head's row: float32
  ``[B, N, T]`` from q ``[B, T, N, D]`` and ``k_rows`` ``[B, K, D]``."""
  b, t, n, d = q.shape
  nk = k_rows.shape[1]
  qg = q.astype(jnp.float32).reshape(b, t, nk, n // nk, d)
  dots = jnp.einsum("btkgd,bkd->bkgt", qg, k_rows.astype(jnp.float32),
                    precision=jax.lax.Precision.HIGHEST)
  return dots.reshape(b, n, t)


def refuse_options(config, names, why: str) -> None:
  """NotImplementedError naming the options of ``names`` that ``config``
  sets (not None): the backend cannot honour them."""
  given = [n for n in names if getattr(config, n, None) is not None]
  if given:
    raise NotImplementedError(
        f"{', '.join(f'{n}={getattr(config, n)!r}' for n in given)}: {why}")

"""Machinery shared by every method: configuration objects, per-head
vmapping, key lengths and the key-block / mask helpers of the references.

Conventions used throughout jaxattn:

* Public layout is BTNH: ``[batch, seq, heads, head_dim]`` (as
  ``jax.nn.dot_product_attention``).
* A *per-head* reference function works on one head::

      fn(q[T, D], k[S, D], v[S, Dv], bias[T, S] | None, mask[T, S] | None,
         kv_len: int32[], *, scale, is_causal, config, shared) -> float32[T, Dv]

  and :func:`vmap_heads` lifts it to BTNH arrays, mapping query heads onto
  key/value heads for grouped-query attention without repeating K and V.
* A key ``j`` is visible to query ``i`` iff ``j < kv_len`` and (not causal or
  ``j <= i``) and ``mask[i, j]``.  A query row that sees no key returns zeros
  (its log-sum-exp is ``-inf``).
"""
from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import common
from pallas_kernels.common import LOG2E

DEFAULT_BLOCK_K = 128


class MethodConfig:
  """Base class of the per-method configuration dataclasses (frozen, hashable).

  Subclasses are ``@dataclasses.dataclass(frozen=True)``; their fields are the
  method's ``**options``.  ``RENAMED`` maps an old option name to its new
  one: :meth:`from_options` still takes it, with a ``DeprecationWarning``.
  """
  RENAMED: ClassVar[dict[str, str]] = {}

  @classmethod
  def from_options(cls, **options) -> "MethodConfig":
    for old, new in cls.RENAMED.items():
      if old in options:
        if new in options:
          raise TypeError(f"pass {new} only ({old} is its old name)")
        warnings.warn(f"option {old!r} of {cls.__name__} is now {new!r}",
                      DeprecationWarning, stacklevel=3)
        options[new] = options.pop(old)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(names))
    if unknown:
      raise TypeError(
          f"unknown option(s) {unknown} for {cls.__name__}; valid options: "
          f"{names}")
    return cls(**options)

  @classmethod
  def fixed_fields(cls, options) -> set[str]:
    """The fields that the call's ``options`` set (under their current
    names); a backend's preferred values apply only to the others."""
    return {cls.RENAMED.get(name, name) for name in options}


def check_kernel_knobs(config) -> None:
  """Validates the optional block sizes / warps / stages of a config."""
  for name in ("block_q", "block_k", "tile_q", "num_warps", "num_stages"):
    value = getattr(config, name, None)
    if value is not None and (not isinstance(value, int) or value < 1):
      raise ValueError(f"{name} must be a positive int, got {value!r}")
  for name in ("block_q", "block_k", "tile_q"):
    value = getattr(config, name, None)
    if value is not None and value & (value - 1):
      raise ValueError(f"{name} must be a power of two, got {value}")


# ----------------------------------------------------------------------------
# Per-head vmapping.


def vmap_heads(per_head: Callable[..., Any]) -> Callable[..., Any]:
  """Lifts a per-head function to BTNH arrays (batch and heads by ``jax.vmap``).

  Query heads ``h`` use key/value head ``h // (Nq // Nk)`` (grouped-query
  attention); K and V are never repeated.  ``shared`` is passed unmapped;
  ``segments`` (``(q_segment_ids [B, T], kv_segment_ids [B, S])``, for a
  method whose scales follow packed documents) per batch row as the
  keyword ``segments=(q_ids [T], kv_ids [S])``.  Returns ``[B, T, Nq, Dv]`` (every leaf of the per-head result gets its
  ``[T, ...]`` axis moved to position 1 and heads to position 2).
  """

  def batched(q, k, v, bias, mask, kv_lens, *, shared=None, segments=None,
              **static):
    b, t, nq, _ = q.shape
    nk = k.shape[2]
    g = nq // nk
    qh = q.transpose(0, 2, 1, 3).reshape(b, nk, g, t, q.shape[-1])
    kh = k.transpose(0, 2, 1, 3)
    vh = v.transpose(0, 2, 1, 3)

    def split(x):  # [B, Nq, T, S] -> [B, Nk, G, T, S]
      return None if x is None else x.reshape(b, nk, g, *x.shape[2:])

    def head(q1, k1, v1, bias1, mask1, kv_len, seg):
      extra = {} if seg is None else dict(segments=seg)
      return per_head(q1, k1, v1, bias1, mask1, kv_len, shared=shared,
                      **extra, **static)

    bias_ax = None if bias is None else 0
    mask_ax = None if mask is None else 0
    seg_ax = None if segments is None else 0
    f = jax.vmap(head, in_axes=(0, None, None, bias_ax, mask_ax, None, None))
    f = jax.vmap(f, in_axes=(0, 0, 0, bias_ax, mask_ax, None, None))
    f = jax.vmap(f, in_axes=(0, 0, 0, bias_ax, mask_ax, 0, seg_ax))
    out = f(qh, kh, vh, split(bias), split(mask), kv_lens, segments)

    def to_btnh(x):  # [B, Nk, G, T, ...] -> [B, T, Nq, ...]
      x = x.reshape(b, nq, *x.shape[3:])
      return jnp.moveaxis(x, 2, 1)

    return jax.tree_util.tree_map(to_btnh, out)

  return batched


# ----------------------------------------------------------------------------
# Key lengths, key blocks and masks for the blocked (flash) references.


def kv_lengths(kv_len, batch: int, s: int):
  """``kv_len`` as int32 ``[batch]``; None means every key (``s``)."""
  if kv_len is None:
    return jnp.full((batch,), s, jnp.int32)
  return jnp.asarray(kv_len, jnp.int32)


def zero_beyond(x, kv_len, axis: int = 0):
  """``x`` with the rows at or beyond ``kv_len`` along ``axis`` set to zero.

  Per head (``axis=0``, ``kv_len`` a scalar) or BTNH (``axis=1``,
  ``kv_len`` ``[B]``).  Keys beyond the length then quantize to zero, never
  reach a scale, and garbage (even NaN) in them cannot reach the output."""
  rows = jnp.arange(x.shape[axis])
  kv_len = jnp.asarray(kv_len)
  if axis == 1:
    valid = rows[None, :] < kv_len[:, None]
  else:
    valid = rows < kv_len
  valid = valid.reshape(valid.shape + (1,) * (x.ndim - axis - 1))
  return jnp.where(valid, x, jnp.zeros_like(x))


def pad_to_multiple(x, axis: int, multiple: int, value=0):
  """Pads ``axis`` of ``x`` up to a multiple of ``multiple`` with ``value``."""
  n = x.shape[axis]
  extra = -n % multiple
  if extra == 0:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad, constant_values=value)


def key_blocks(x, block_k: int):
  """``[S, D] -> [S_pad / block_k, block_k, D]`` (zero padded)."""
  x = pad_to_multiple(x, 0, block_k)
  return x.reshape(-1, block_k, *x.shape[1:])


def column_blocks(x, block_k: int, value=0):
  """``[T, S] -> [S_pad / block_k, T, block_k]`` padded with ``value``."""
  x = pad_to_multiple(x, 1, block_k, value)
  t = x.shape[0]
  return x.reshape(t, -1, block_k).transpose(1, 0, 2)


def visible_blocks(t: int, s: int, block_k: int, kv_len, is_causal: bool,
                   mask=None):
  """Boolean ``[S_pad / block_k, T, block_k]``: query ``i`` sees key ``j``."""
  n_blocks = -(-s // block_k)
  cols = jnp.arange(n_blocks * block_k).reshape(n_blocks, 1, block_k)
  rows = jnp.arange(t).reshape(1, t, 1)
  vis = cols < kv_len
  if is_causal:
    vis = vis & (cols <= rows)
  vis = jnp.broadcast_to(vis, (n_blocks, t, block_k))
  if mask is not None:
    vis = vis & column_blocks(mask, block_k, False)
  return vis


def block_inputs(k, v, bias, mask, kv_len, *, t: int, block_k: int,
                 is_causal: bool):
  """The ``xs`` of a ``lax.scan`` over key blocks.

  Returns a dict with ``k`` ``[nb, bk, D]``, ``v`` ``[nb, bk, Dv]``,
  ``visible`` ``[nb, T, bk]`` and, when given, ``bias`` ``[nb, T, bk]``.
  """
  xs = dict(
      k=key_blocks(k, block_k),
      v=key_blocks(v, block_k),
      visible=visible_blocks(t, k.shape[0], block_k, kv_len, is_causal, mask),
  )
  if bias is not None:
    xs["bias"] = column_blocks(bias.astype(jnp.float32), block_k)
  return xs


def index_visibility(bounds, q_segments=None, kv_segments=None, *, t: int,
                     s: int, t0=0):
  """bool ``[B, t, s]``: query rows ``t0 .. t0 + t`` see key ``j``, from the
  bounds of :func:`pallas_kernels.common.row_bounds` and segment ids
  (``[B, t]`` of those rows and ``[B, s]``, or None): the dense form of what
  the kernels compute from indices."""
  rows = t0 + jax.lax.broadcasted_iota(jnp.int32, (1, t, s), 1)
  cols = jax.lax.broadcasted_iota(jnp.int32, (1, t, s), 2)
  vis = common.visible(rows, cols,
                       tuple(bounds[:, c, None, None] for c in range(4)))
  if q_segments is not None:
    vis = vis & (q_segments[:, :, None] == kv_segments[:, None, :])
  return vis


def softmax_state(t: int, dv: int, dtype=jnp.float32):
  """The initial online-softmax state ``(m, l, O)`` of ``t`` query rows:
  ``(-inf, 0, 0)`` with ``O`` of width ``dv``."""
  return (jnp.full((t,), -jnp.inf, dtype), jnp.zeros((t,), dtype),
          jnp.zeros((t, dv), dtype))


def visible_scores(s, visible):
  """``s`` with the hidden scores at ``-inf``, materialised once behind an
  optimisation barrier, so that the row max and the exponent read the same
  float32 value of each score.  Without it a fusion may recompute the
  score in each consumer, rounded differently (a multiply and an add
  contracted in one of them); at scores near 1e10, where an ulp is ~1000,
  that puts ``s - m`` above 0 and P overflows."""
  return jax.lax.optimization_barrier(jnp.where(visible, s, -jnp.inf))


def safe_max(m):
  """``m`` with ``-inf`` replaced by 0, so that ``exp(s - m)`` of a row that
  has seen no key yet is ``exp(-inf) = 0`` rather than NaN."""
  return jnp.where(m == -jnp.inf, jnp.zeros_like(m), m)


def finalize(o, l):
  """``o / l`` with rows that saw no key (``l == 0``) set to zero."""
  l = l[:, None]
  safe_l = jnp.where(l == 0, jnp.ones_like(l), l)
  return jnp.where(l == 0, jnp.zeros_like(o), o / safe_l)


def exp_f32(x, acc=jnp.float32, scale: float = 1.0):
  """``exp(scale * x)`` as the kernels compute it: ``exp2(x * (scale
  log2(e)))`` in float32 (``acc``), the factor one constant, whatever the
  dtype of ``x``; round the result where needed."""
  return jnp.exp2(x.astype(acc) * jnp.asarray(scale * LOG2E, acc))


def max_row_norm(x) -> jax.Array:
  """``max_i |x_i|`` (Euclidean norms over the last axis) in float32, of
  ``x``'s finite entries: a NaN/Inf poisons its own rows anyway, and must
  not change a path that the others take."""
  x = jnp.where(jnp.isfinite(x), x, 0).astype(jnp.float32)
  return jnp.sqrt(jnp.max(jnp.sum(x * x, axis=-1)))


def default_scale(head_dim: int) -> float:
  return 1.0 / math.sqrt(head_dim)


def softmax_scale(scale, head_dim: int) -> float:
  """``scale`` as a finite float (None: :func:`default_scale`); TypeError
  for a value not known at trace time, ValueError for NaN or inf."""
  if scale is None:
    return default_scale(head_dim)
  try:
    scale = float(scale)
  except (TypeError, ValueError) as e:  # (a tracer's error is a TypeError)
    raise TypeError(f"scale must be a real number known at trace time, got "
                    f"{scale!r}") from e
  if not math.isfinite(scale):
    raise ValueError(f"scale must be finite, got {scale}")
  return scale


def as_numpy_dtype(dtype) -> np.dtype:
  return np.dtype(jnp.dtype(dtype))

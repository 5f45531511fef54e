"""INT-FlashAttention (Algorithm 1 of Chen et al., arXiv 2409.16997):
flash attention with token-level INT8 Q and K, INT8 V and INT8 P.

Quantisation (per head, ``R = 127``, round to nearest even,
:func:`jaxattn.quant.quantize_int`)::

    S_Q = rowmax(|Q|) / R            (one scale per query token)
    S_K = rowmax(|K|) / R            (one scale per key token)
    S_V = max(|V|) / R               (per tensor: the visible rows of the head)
    X_i8 = clip(round(X / S_X), -R, R)

computed exactly as ``S = amax * fl(1/R)`` and ``X_i8 = clip(round(X *
fl(1/S)))`` in float32 (what XLA makes of the divisions anyway; written out
so that every backend and kernel rounds the same way).

``v_granularity="block"`` (the paper's stated future work) gives V one scale
per key block of ``block_k`` rows instead.

Per key block ``j`` (paper lines 10-14), ``(m, l, O)`` starting at
``(-inf, 0, 0)``::

    S   = (Q_i8 K_j,i8^T)_int32 * S_Q[:, None] * S_K,j[None, :] * scale (+ bias)
    m'  = max(m, rowmax S)                     (invisible keys are -inf)
    P   = floor(R exp(S - m') + 1/2)           int8 in [0, R]
    l   = l exp(m - m') + rowsum P             float32
    O   = exp(m - m') O + (P V_j,i8)_int32     float32 (block V: * S_V,j)

and finally ``O = O / l * S_V`` (``O / l`` with per-block V scales).

Half-INT8 (``pv_dtype="fp16"``, the paper's "half-INT8" variant): Q and K as
above, V in float16 (not quantised), ``P = fl16(exp(S - m'))``,
``l = l exp(m - m') + rowsum(exp(S - m'))`` (float32, before rounding P),
``O = exp(m - m') O + (P_f16 V_f16)`` accumulated in float32, final ``O / l``.

Decisions beyond the paper:

* Inputs of any float dtype are converted to float32 before quantisation.
* Key/value rows at or beyond ``kv_len`` quantise to zero (scale 0, values 0,
  and zero float16 V in the half-INT8 variant), so padding never reaches a
  scale or the output, whatever it holds (even NaN).
* An all-zero group has scale 0 and quantises to zeros; a row that sees no
  key returns zeros.  A key block in which a row sees no key leaves that
  row's ``(m, l, O)`` unchanged bit for bit (``exp(0) = 1``, ``P = 0``), so
  a kernel may skip it.
* Half-INT8 keeps V in float16 as the paper does: bfloat16/float32 values
  beyond the float16 range (65504) become inf.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import base, quant

R = 127
RCP_R = np.float32(1.0 / R)  # scales are amax * fl(1/127)
V_GRANULARITIES = ("tensor", "block")
PV_DTYPES = ("int8", "fp16")


@dataclasses.dataclass(frozen=True)
class Int8Config(base.MethodConfig):
  """Options of ``method="int8"``.

  Attributes:
    block_k: keys per block of the online softmax (a power of two); also the
      group size of the per-block V scales.  Left unset, the Mosaic kernel
      runs full INT8 with one V scale per tensor in 256-key blocks on
      calls that are not causal and have no segment ids or window
      (``api.backend_options`` says which).
    v_granularity: ``"tensor"`` (one V scale per head, the paper) or
      ``"block"`` (one per key block).
    pv_dtype: ``"int8"`` (full INT8: int8 P and V) or ``"fp16"`` (half-INT8:
      float16 P and V).
    tile_q, num_warps, num_stages: Triton kernel knobs (None = the tuned
      table in :mod:`pallas_kernels.quantized`); the reference ignores them
      and the Mosaic kernel refuses them.
  """
  block_k: int = base.DEFAULT_BLOCK_K
  v_granularity: str = "tensor"
  pv_dtype: str = "int8"
  tile_q: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  RENAMED = {"block_q": "tile_q"}

  def __post_init__(self):
    base.check_kernel_knobs(self)
    if self.v_granularity not in V_GRANULARITIES:
      raise ValueError(f"v_granularity must be one of {V_GRANULARITIES}, got "
                       f"{self.v_granularity!r}")
    if self.pv_dtype not in PV_DTYPES:
      raise ValueError(f"pv_dtype must be one of {PV_DTYPES}, got "
                       f"{self.pv_dtype!r}")


def quantize_scaled(x, s):
  """``clip(round(x * fl(1/s)), -R, R)`` as int8 (``s`` broadcasts)."""
  return quant.quantize_int(x, quant.reciprocal(s))


def quantize_per_token(x):
  """``(clip(round(x * fl(1/s))), s)`` with ``s = rowmax|x| * fl(1/R)`` over
  the last axis (float32)."""
  x = x.astype(jnp.float32)
  s = jnp.abs(x).max(axis=-1) * RCP_R
  return quantize_scaled(x, s[..., None]), s


def quantize_kv_head(k, v, kv_len, *, config: Int8Config,
                     segments=None) -> dict:
  """The K and V quantisation of one key/value head.

  Args:
    k: ``[S, D]``; v: ``[S, Dv]``; kv_len: int32 scalar.
    segments: ``(q_ids [T], kv_ids [S])`` of a packed row, or None: with
      ``v_granularity="tensor"`` V's scale is then one per segment, the
      amax of that segment's keys (``v_scale`` ``[S]`` per key, and
      ``v_row_scale`` ``[T]``, each query row's segment's, which multiplies
      the output: a row sees only its own segment's keys).
  Returns:
    dict with ``k`` int8 ``[S, D]``, ``k_scale`` float32 ``[S]`` and ``v``:
    int8 ``[S, Dv]`` with ``v_scale`` float32 ``[]`` (tensor) or
    ``[ceil(S / block_k)]`` (block) for ``pv_dtype="int8"``; float16
    ``[S, Dv]`` (no ``v_scale``) for ``pv_dtype="fp16"``.  Rows at or beyond
    ``kv_len`` are zero (scales included).
  """
  f32 = jnp.float32
  k = base.zero_beyond(k.astype(f32), kv_len)
  v = base.zero_beyond(v.astype(f32), kv_len)
  k_i8, sk = quantize_per_token(k)
  out = dict(k=k_i8, k_scale=sk)
  if config.pv_dtype == "fp16":
    out["v"] = v.astype(jnp.float16)
    return out
  if config.v_granularity == "tensor" and segments is not None:
    per_key, per_row = quant.segment_absmax(jnp.abs(v).max(axis=1),
                                            segments[1], segments[0])
    sv = per_key * RCP_R
    out["v"] = quantize_scaled(v, sv[:, None])
    out["v_row_scale"] = per_row * RCP_R
  elif config.v_granularity == "tensor":
    sv = jnp.abs(v).max() * RCP_R
    out["v"] = quantize_scaled(v, sv)
  else:
    sv = quant.group_absmax(v, config.block_k) * RCP_R
    rows = quant.expand_groups(sv, config.block_k, v.shape[0])
    out["v"] = quantize_scaled(v, rows[:, None])
  out["v_scale"] = sv
  return out


def quantize_head(q, k, v, kv_len, *, config: Int8Config,
                  segments=None) -> dict:
  """The quantisation of one head: :func:`quantize_kv_head`'s dict plus
  ``q`` int8 ``[T, D]`` and ``q_scale`` float32 ``[T]``."""
  q_i8, sq = quantize_per_token(q)
  return dict(q=q_i8, q_scale=sq,
              **quantize_kv_head(k, v, kv_len, config=config,
                                 segments=segments))


def int8_quantize(q, k, v, kv_len, *, config: Int8Config) -> dict:
  """INT-FlashAttention's quantisation of Q, K and V.

  Per head: ``q``/``k``/``v`` of shapes ``[T, D]``/``[S, D]``/``[S, Dv]`` and
  a scalar ``kv_len`` give :func:`quantize_head`'s dict.  Batched: BTNH
  arrays ``[B, T, N, D]``/``[B, S, K, D]``/``[B, S, K, Dv]`` (``N`` a
  multiple of ``K``) and ``kv_len`` ``[B]`` (or None = S) give the same
  entries in BTNH layout: ``q`` ``[B, T, N, D]``, ``q_scale`` ``[B, T, N]``,
  ``k``/``v`` ``[B, S, K, .]``, ``k_scale`` ``[B, S, K]``, ``v_scale``
  ``[B, K]`` (tensor) or ``[B, ceil(S / block_k), K]`` (block).  These are
  exactly the values :func:`int8_head` computes with.
  """
  if q.ndim == 2:
    return quantize_head(q, k, v, jnp.asarray(kv_len, jnp.int32),
                         config=config)
  kv_len = base.kv_lengths(kv_len, k.shape[0], k.shape[1])

  def one(k1, v1, n):
    return quantize_kv_head(k1, v1, n, config=config)

  f = jax.vmap(jax.vmap(one, in_axes=(1, 1, None), out_axes=-1),
               in_axes=(0, 0, 0))
  kv = f(k, v, kv_len)  # head axis last
  out = {name: jnp.moveaxis(x, -1, 2) if x.ndim > 3 else x
         for name, x in kv.items()}
  q_i8, sq = quantize_per_token(q)
  return dict(q=q_i8, q_scale=sq, **out)


def int8_head(q, k, v, bias, mask, kv_len, *, scale, is_causal, config,
              shared=None, segments=None):
  """One head of INT-FlashAttention (see the module docstring); with
  ``segments`` (a packed row, :func:`quantize_kv_head`) V's tensor scale
  is one per segment.

  Returns float32 ``[T, Dv]``.
  """
  del shared
  f32, i32 = jnp.float32, jnp.int32
  bk = config.block_k
  t, dv = q.shape[0], v.shape[-1]
  qz = quantize_head(q, k, v, kv_len, config=config, segments=segments)
  xs = base.block_inputs(qz["k"], qz["v"], bias, mask, kv_len, t=t,
                         block_k=bk, is_causal=is_causal)
  xs["k_scale"] = base.pad_to_multiple(qz["k_scale"], 0, bk).reshape(-1, bk)
  full = config.pv_dtype == "int8"
  per_block_v = full and config.v_granularity == "block"
  if per_block_v:
    xs["v_scale"] = qz["v_scale"]
  q_i8, sq = qz["q"], qz["q_scale"]

  def step(carry, x):
    m, l, o = carry
    s_int = jnp.dot(q_i8, x["k"].T, preferred_element_type=i32)
    s = s_int.astype(f32) * sq[:, None] * x["k_scale"][None, :] * scale
    if "bias" in x:
      s = s + x["bias"]
    s = base.visible_scores(s, x["visible"])
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_ref = base.safe_max(m_new)
    e = jnp.exp(s - m_ref[:, None])
    alpha = jnp.exp(m - m_ref)
    if full:
      p = quant.round_probability(e, R).astype(jnp.int8)
      l = l * alpha + p.astype(i32).sum(axis=-1).astype(f32)
      pv = jnp.dot(p, x["v"], preferred_element_type=i32).astype(f32)
      if per_block_v:
        pv = pv * x["v_scale"]
    else:
      l = l * alpha + e.sum(axis=-1)
      pv = jnp.dot(e.astype(jnp.float16), x["v"], preferred_element_type=f32)
    o = alpha[:, None] * o + pv
    return (m_new, l, o), None

  init = base.softmax_state(t, dv)
  (_, l, o), _ = jax.lax.scan(step, init, xs)
  out = base.finalize(o, l)
  if full and "v_row_scale" in qz:
    out = out * qz["v_row_scale"][:, None]
  elif full and not per_block_v:
    out = out * qz["v_scale"]
  return out


reference = base.vmap_heads(int8_head)


__all__ = ["Int8Config", "quantize_per_token", "quantize_scaled",
           "quantize_kv_head", "quantize_head", "int8_quantize",
           "int8_head", "reference"]

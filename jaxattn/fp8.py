"""FlashAttention-3-style FP8 attention (the comparison baseline of the
INT-FlashAttention paper): Q, K, V and P in float8 e4m3 with descale factors,
float32 accumulation and softmax.

Quantisation (per head, :func:`jaxattn.quant.quantize_fp8`)::

    s_X = amax(|X|) / 448;   X8 = fl_e4m3(X / s_X)

computed exactly as ``s_X = amax * fl(1/448)``, ``X8 = fl_e4m3(clip(X *
fl(1/s_X), -448, 448))`` in float32, with ``granularity="tensor"`` one
scale per head tensor (K and V: the rows before ``kv_len``), or
``granularity="block"`` one scale per block of ``block_q`` query rows /
``block_k`` key rows / ``block_k`` value rows.
Per key block ``j``, with ``(m, l, O)`` starting at ``(-inf, 0, 0)``::

    S   = (Q8 K8_j^T)_f32 * s_Q[:, None] * s_K,j * scale (+ bias)
    m'  = max(m, rowmax S)                     (invisible keys are -inf)
    P   = exp(S - m');  l = exp(m - m') l + rowsum P      (float32)
    P8  = fl_e4m3(448 P)
    O   = exp(m - m') O + (P8 V8_j)_f32                   (block: * s_V,j)

and finally ``O / l / 448 * s_V`` (``O / l / 448`` with per-block V scales).

Decisions: inputs are converted to float32 before quantisation; K/V rows at
or beyond ``kv_len`` quantise to zero (so padding never reaches a scale or
the output); an all-zero group has scale 0 and quantises to zeros; a row that
sees no key returns zeros.  The fp8 x fp8 matmuls run with float32
accumulation (every product of two e4m3 values is exact in float32).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import base, quant

FP8 = jnp.float8_e4m3fn
GRANULARITIES = ("tensor", "block")
RCP_FP8_MAX = np.float32(1.0 / quant.FP8_MAX)  # scales: amax * fl(1/448)


@dataclasses.dataclass(frozen=True)
class Fp8Config(base.MethodConfig):
  """Options of ``method="fp8"``.

  Attributes:
    block_k: keys per block of the online softmax (a power of two); also the
      K/V scale group with ``granularity="block"``.  Left unset, the Mosaic
      kernel runs per-tensor calls in 256-key blocks, except where segment
      ids or a window hide key blocks (``api.backend_options`` says which).
    granularity: ``"tensor"`` (one scale per head tensor) or ``"block"``.
    block_q: query rows per Q scale with ``granularity="block"``.
  """
  block_k: int = base.DEFAULT_BLOCK_K
  granularity: str = "tensor"
  block_q: int = 128

  def __post_init__(self):
    base.check_kernel_knobs(self)
    if self.granularity not in GRANULARITIES:
      raise ValueError(f"granularity must be one of {GRANULARITIES}, got "
                       f"{self.granularity!r}")


def _quantize(x, group: int | None):
  """``(x8, scale)``: one scale (``group`` None) or one per ``group`` rows."""
  if group is None:
    sc = jnp.abs(x).max() * RCP_FP8_MAX
    return quant.quantize_fp8(x, quant.reciprocal(sc)), sc
  sc = quant.group_absmax(x, group) * RCP_FP8_MAX
  rows = quant.expand_groups(sc, group, x.shape[0])
  return quant.quantize_fp8(x, quant.reciprocal(rows[:, None])), sc


def quantize_head(q, k, v, kv_len, *, config: Fp8Config) -> dict:
  """The FP8 quantisation of one head.

  Args:
    q: ``[T, D]``; k: ``[S, D]``; v: ``[S, Dv]``; kv_len: int32 scalar.
  Returns:
    dict with ``q``, ``k``, ``v`` float8_e4m3fn (K/V rows at or beyond
    ``kv_len`` zero) and float32 ``q_scale``, ``k_scale``, ``v_scale``:
    scalars (tensor) or ``[ceil(T / block_q)]``, ``[ceil(S / block_k)]``,
    ``[ceil(S / block_k)]`` (block).
  """
  f32 = jnp.float32
  block = config.granularity == "block"
  q = q.astype(f32)
  k = base.zero_beyond(k.astype(f32), kv_len)
  v = base.zero_beyond(v.astype(f32), kv_len)
  q8, sq = _quantize(q, config.block_q if block else None)
  k8, sk = _quantize(k, config.block_k if block else None)
  v8, sv = _quantize(v, config.block_k if block else None)
  return dict(q=q8, q_scale=sq, k=k8, k_scale=sk, v=v8, v_scale=sv)


def fp8_quantize(q, k, v, kv_len, *, config: Fp8Config) -> dict:
  """FP8 quantisation of Q, K and V.

  Per head (2-D inputs, scalar ``kv_len``): :func:`quantize_head`'s dict.
  Batched BTNH inputs (``kv_len`` ``[B]`` or None = S): the same entries with
  ``q``/``k``/``v`` in BTNH layout and the scales ``[B, N]`` / ``[B, K]``
  (tensor) or ``[B, groups, N]`` / ``[B, groups, K]`` (block).
  """
  if q.ndim == 2:
    return quantize_head(q, k, v, jnp.asarray(kv_len, jnp.int32),
                         config=config)
  kv_len = base.kv_lengths(kv_len, k.shape[0], k.shape[1])
  block = config.granularity == "block"

  def one_q(q1):
    return _quantize(q1.astype(jnp.float32), config.block_q if block else None)

  def one_kv(k1, v1, n):
    d = quantize_head(k1[:1], k1, v1, n, config=config)
    return {name: d[name] for name in ("k", "k_scale", "v", "v_scale")}

  fq = jax.vmap(jax.vmap(one_q, in_axes=1, out_axes=-1))
  fkv = jax.vmap(jax.vmap(one_kv, in_axes=(1, 1, None), out_axes=-1),
                 in_axes=(0, 0, 0))
  q8, sq = fq(q)
  out = dict(q=q8, q_scale=sq, **fkv(k, v, kv_len))
  return {name: jnp.moveaxis(x, -1, 2) if name in ("q", "k", "v") else x
          for name, x in out.items()}


def fp8_head(q, k, v, bias, mask, kv_len, *, scale, is_causal, config,
             shared=None):
  """One head of FP8 flash attention (see the module docstring).

  Returns float32 ``[T, Dv]``.
  """
  del shared
  f32 = jnp.float32
  bk = config.block_k
  block = config.granularity == "block"
  t, dv = q.shape[0], v.shape[-1]
  qz = quantize_head(q, k, v, kv_len, config=config)
  xs = base.block_inputs(qz["k"], qz["v"], bias, mask, kv_len, t=t,
                         block_k=bk, is_causal=is_causal)
  if block:
    sq = quant.expand_groups(qz["q_scale"], config.block_q, t)
    xs["k_scale"] = qz["k_scale"]
    xs["v_scale"] = qz["v_scale"]
  else:
    sq = jnp.broadcast_to(qz["q_scale"], (t,))
  q8 = qz["q"]

  def step(carry, x):
    m, l, o = carry
    s = jnp.dot(q8, x["k"].T, preferred_element_type=f32)
    sk = x["k_scale"] if block else qz["k_scale"]
    s = s * sq[:, None] * sk * scale
    if "bias" in x:
      s = s + x["bias"]
    s = base.visible_scores(s, x["visible"])
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_ref = base.safe_max(m_new)
    p = jnp.exp(s - m_ref[:, None])
    alpha = jnp.exp(m - m_ref)
    l = alpha * l + p.sum(axis=-1)
    p8 = (p * quant.FP8_MAX).astype(FP8)
    pv = jnp.dot(p8, x["v"], preferred_element_type=f32)
    if block:
      pv = pv * x["v_scale"]
    o = alpha[:, None] * o + pv
    return (m_new, l, o), None

  init = base.softmax_state(t, dv)
  (_, l, o), _ = jax.lax.scan(step, init, xs)
  out = base.finalize(o, l) / quant.FP8_MAX
  if not block:
    out = out * qz["v_scale"]
  return out


reference = base.vmap_heads(fp8_head)


__all__ = ["Fp8Config", "quantize_head", "fp8_quantize", "fp8_head",
           "reference"]

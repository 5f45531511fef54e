"""Flash attention and its precision allocations (PASA paper, section 1).

One blocked online-softmax reference, written per head and vmapped over batch
and heads, with a static ``precision`` flag:

* ``"fp32"``: float16/bfloat16/float32 matmul inputs; scores, softmax
  statistics and the output accumulator in float32; P is cast to the value
  dtype for the PV matmul (as FlashAttention-2 does).
* ``"fp16_fp32"``: inputs converted to float16; the score matrix
  ``S = Q K^T`` leaves the matmul in float16 (``|S| > 65504`` becomes ``inf``,
  which turns its row into NaN), everything after it in float32.
* ``"fp16"``: scores, statistics, P and the PV accumulator all in float16.

Every method takes its exponentials in float32 (``exp2(x log2 e)``, as the
kernels do) of the difference ``s - m`` formed in the statistics dtype, sums
them in float32 for ``l`` and rounds them to the value dtype for the PV
matmul.

Per key block ``j`` (block of ``block_k`` keys):
``m_j = max(m_{j-1}, rowmax S)``, ``P = exp(S - m_j)``,
``l_j = exp(m_{j-1} - m_j) l_{j-1} + rowsum P``,
``O_j = exp(m_{j-1} - m_j) O_{j-1} + P V_j``; finally ``O / l``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxattn import base

PRECISIONS = ("fp32", "fp16_fp32", "fp16")


@dataclasses.dataclass(frozen=True)
class FlashConfig(base.MethodConfig):
  """Options of the ``"fp32"``, ``"fp16_fp32"`` and ``"fp16"`` methods.

  Attributes:
    block_k: keys per block of the online softmax; None = 128 in the
      reference and the Mosaic kernel, the tuned table value in the Triton
      kernel.
    tile_q, num_warps, num_stages: Triton kernel knobs (None = the tuned
      table in :mod:`pallas_kernels.flash`); the reference ignores them and
      the Mosaic kernel refuses them.
  """
  block_k: int | None = None
  tile_q: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  RENAMED = {"block_q": "tile_q"}

  def __post_init__(self):
    base.check_kernel_knobs(self)


def flash_head(q, k, v, bias, mask, kv_len, *, scale, is_causal, config,
               precision, shared=None, return_lse=False):
  """One head of blocked flash attention.

  Args:
    q: ``[T, D]``; k: ``[S, D]``; v: ``[S, Dv]`` (float16/bfloat16/float32).
    bias: float ``[T, S]`` added to the scaled scores, or None.
    mask: bool ``[T, S]`` (True = visible), or None.
    kv_len: int32 scalar, keys at or beyond it are masked.
    precision: one of :data:`PRECISIONS` (static).

  Returns:
    float32 ``[T, Dv]`` (and the float32 log-sum-exp ``[T]`` of the scaled
    scores if ``return_lse``).
  """
  del shared
  f32, f16 = jnp.float32, jnp.float16
  if precision not in PRECISIONS:
    raise ValueError(f"precision must be one of {PRECISIONS}")
  if precision != "fp32":
    q, k, v = q.astype(f16), k.astype(f16), v.astype(f16)
  stat = f16 if precision == "fp16" else f32
  t, dv = q.shape[0], v.shape[-1]
  xs = base.block_inputs(k, v, bias, mask, kv_len, t=t,
                         block_k=config.block_k or base.DEFAULT_BLOCK_K,
                         is_causal=is_causal)

  def step(carry, x):
    m, l, o = carry
    s = jnp.dot(q, x["k"].T, preferred_element_type=f32)
    if precision != "fp32":
      s = s.astype(f16)  # the score matrix leaves the matmul unit in fp16
    s = s.astype(stat) * jnp.asarray(scale, stat)
    if "bias" in x:
      s = s + x["bias"].astype(stat)
    s = base.visible_scores(s, x["visible"])
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_ref = base.safe_max(m_new)
    e = base.exp_f32(s - m_ref[:, None])   # float32 exponentials
    alpha = base.exp_f32(m - m_ref).astype(stat)
    l = alpha * l + e.sum(axis=-1).astype(stat)
    pv = jnp.dot(e.astype(v.dtype), x["v"], preferred_element_type=f32)
    o = alpha[:, None] * o + pv.astype(stat)
    return (m_new, l, o), None

  init = base.softmax_state(t, dv, stat)
  (m, l, o), _ = jax.lax.scan(step, init, xs)
  out = base.finalize(o, l).astype(f32)
  if return_lse:
    lse = m.astype(f32) + jnp.log(l.astype(f32))
    return out, jnp.where(l == 0, -jnp.inf, lse)
  return out


def reference(precision: str):
  """The batched reference of ``precision`` (BTNH in, float32 out)."""
  return base.vmap_heads(functools.partial(flash_head, precision=precision))

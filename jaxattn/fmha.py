"""8-bit FMHA (jundaf2/INT8-Flash-Attention-FMHA-Quantization): int8 Q, K, V
and output with static (predetermined) or dynamic (measured) amax, uint8 P.

Quantisation with one amax per tensor (``a_q, a_k, a_v, a_o``)::

    X_i8 = clip(round(X / (a_x / 127)), -127, 127)

computed exactly as ``s_x = a_x * fl(1/127)``, ``X_i8 = clip(round(X *
fl(1/s_x)))`` in float32 (:func:`jaxattn.quant.quantize_int`).  Static amax
comes from the ``amax`` option; dynamic amax is ``max|X|`` over the whole
batched tensor (every batch and head; only keys before ``kv_len`` for K and
V).  Per key block ``i`` (the "8-bit Flash-Attention" equations)::

    S     = (Q_i8 K_i,i8^T)_int32 * (scale * a_q/127 * a_k/127) (+ bias)
    mt    = rowmax S          (invisible keys are -inf)
    P     = exp(S - mt);  lt = rowsum P
    P_u8  = clip(floor(255 P + 1/2), 0, 255)                     uint8
    Ot    = (P_u8 V_i,i8)_int32 / (255 lt) * a_v/127
    m_i   = max(m_{i-1}, mt)
    l_i   = e^{m_{i-1} - m_i} l_{i-1} + e^{mt - m_i} lt
    O_i   = (l_{i-1} e^{m_{i-1} - m_i} O_{i-1} + lt e^{mt - m_i} Ot) / l_i

and the output ``O_i8 = clip(round(O / (a_o / 127)), -127, 127)`` with
``a_o`` static or ``max|O|`` of the whole batched float output (a second
pass).  The method returns ``O_i8 * a_o/127`` as float32, or with
``return_int8=True`` the tuple ``(O_i8 [B, T, N, Dv] int8, a_o/127)``.

The uint8 x int8 product is computed with int8 operands only, by
``P_u8 V = (P_u8 - 128) V + 128 colsum(V)`` (:func:`uint8_matmul_by_identity`),
exactly as a GPU kernel must (Triton rejects unsigned matmuls).

Decisions beyond the source:

* A block in which a row sees no key leaves that row's state unchanged
  (``lt = 0``, ``Ot = 0``); a row that never sees a key returns zeros.
* K and V rows at or beyond ``kv_len`` quantise to zero, so padding never
  reaches an amax or the output.
* A partial ``amax`` dict is allowed: the missing tensors use dynamic amax.
  A dynamic amax of zero (an all-zero tensor) quantises to zeros.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import base, quant

QMAX = 127
RCP_QMAX = np.float32(1.0 / QMAX)  # scales are amax * fl(1/127)
AMAX_KEYS = ("q", "k", "v", "o")


@dataclasses.dataclass(frozen=True)
class FmhaConfig(base.MethodConfig):
  """Options of ``method="fmha_int8"``.

  Attributes:
    block_k: keys per block (a power of two).
    amax: static amax values, a dict (or pairs) with keys among ``"q"``,
      ``"k"``, ``"v"``, ``"o"`` and positive finite values; stored as a
      sorted tuple of ``(name, float)`` pairs so the config stays hashable.
      None (or a missing key) = dynamic amax.
    return_int8: return ``(o_int8, o_scale)`` instead of the dequantised
      output.
    tile_q, num_warps, num_stages: Triton kernel knobs (None = the tuned
      table in :mod:`pallas_kernels.quantized`); the reference ignores them.
  """
  block_k: int = base.DEFAULT_BLOCK_K
  amax: tuple | None = None
  return_int8: bool = False
  tile_q: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  RENAMED = {"block_q": "tile_q"}

  def __post_init__(self):
    base.check_kernel_knobs(self)
    if self.amax is not None:
      object.__setattr__(self, "amax", normalize_amax(self.amax))
    if not isinstance(self.return_int8, bool):
      raise ValueError(f"return_int8 must be a bool, got {self.return_int8!r}")

  @property
  def amax_dict(self) -> dict[str, float]:
    return dict(self.amax or ())


def normalize_amax(amax) -> tuple[tuple[str, float], ...] | None:
  """A dict (or ``(name, value)`` pairs) -> sorted ``((name, float), ...)``.

  Raises ValueError on unknown names or non-positive / non-finite values.
  """
  if amax is None:
    return None
  try:
    items = dict(amax).items()
  except (TypeError, ValueError) as e:
    raise ValueError(f"amax must be a dict like {{'q': 3.0, 'k': 3.0, "
                     f"'v': 3.0, 'o': 1.0}}, got {amax!r}") from e
  out = []
  for name, value in items:
    if name not in AMAX_KEYS:
      raise ValueError(f"amax keys must be among {AMAX_KEYS}, got {name!r}")
    try:
      value = float(value)
    except (TypeError, ValueError) as e:
      raise ValueError(f"amax[{name!r}] must be a number, got {value!r}") from e
    if not (math.isfinite(value) and value > 0):
      raise ValueError(f"amax[{name!r}] must be positive and finite, got "
                       f"{value}")
    out.append((name, value))
  if not out:
    raise ValueError("amax must not be empty (use None for dynamic amax)")
  return tuple(sorted(out))


def fmha_amax(q, k, v, kv_lens=None, *, config: FmhaConfig) -> dict:
  """``{"q", "k", "v"}`` float32 scalars: static values from the config or
  ``max|x|`` over the batched tensor (visible key rows only for k and v)."""
  static = config.amax_dict
  kv_lens = base.kv_lengths(kv_lens, k.shape[0], k.shape[1])
  f32 = jnp.float32
  tensors = dict(q=q.astype(f32),
                 k=base.zero_beyond(k.astype(f32), kv_lens, axis=1),
                 v=base.zero_beyond(v.astype(f32), kv_lens, axis=1))
  return {name: (jnp.asarray(static[name], f32) if name in static
                 else jnp.abs(x).max()) for name, x in tensors.items()}


def fmha_quantize(q, k, v, kv_lens=None, *, config: FmhaConfig) -> dict:
  """8-bit FMHA's quantisation of BTNH ``q``, ``k``, ``v``.

  Returns a dict with ``q``, ``k``, ``v`` int8 (same shapes; K/V rows at or
  beyond ``kv_lens[b]`` zero), their amax ``a_q``, ``a_k``, ``a_v`` and
  scales ``q_scale = a_q * fl(1/127)`` etc. (float32 scalars).  These are
  exactly the values the reference computes with.
  """
  kv_lens = base.kv_lengths(kv_lens, k.shape[0], k.shape[1])
  amax = fmha_amax(q, k, v, kv_lens, config=config)
  out = {}
  for name, x in (("q", q), ("k", k), ("v", v)):
    x = x.astype(jnp.float32)
    if name != "q":
      x = base.zero_beyond(x, kv_lens, axis=1)
    sc = amax[name] * RCP_QMAX
    out[name] = quant.quantize_int(x, quant.reciprocal(sc))
    out[f"a_{name}"] = amax[name]
    out[f"{name}_scale"] = sc
  return out


def fmha_quantize_output(o, *, config: FmhaConfig, row_amax=None):
  """``(O_i8, o_scale)``: ``a_o`` static or ``max|O|`` of the whole float
  output, ``o_scale = a_o * fl(1/127)`` (float32 scalar).  ``row_amax``:
  ``max|O|`` per row where the kernel gave it (then O is not read for
  it)."""
  o = o.astype(jnp.float32)
  static = config.amax_dict
  if "o" in static:
    a_o = jnp.asarray(static["o"], jnp.float32)
  elif row_amax is not None:
    a_o = row_amax.max()
  else:
    a_o = jnp.abs(o).max()
  sc = a_o * RCP_QMAX
  return quant.quantize_int(o, quant.reciprocal(sc)), sc


def method_output(o, *, config: FmhaConfig, row_amax=None):
  """The method's result from the float output ``o`` before output
  quantization: ``(O_i8, o_scale)`` with ``return_int8``, else ``O_i8 *
  o_scale`` in float32 (what every backend returns); ``row_amax`` as
  :func:`fmha_quantize_output`'s."""
  o_i8, o_scale = fmha_quantize_output(o, config=config, row_amax=row_amax)
  if config.return_int8:
    return o_i8, o_scale
  return o_i8.astype(jnp.float32) * o_scale


def uint8_matmul_by_identity(p_u8, v_i8):
  """Exact ``(P_u8 V_i8)_int32`` with int8 operands only:
  ``(P_u8 - 128) V + 128 colsum(V)``, ``P_u8 - 128`` in ``[-128, 127]``."""
  p_s8 = (p_u8.astype(jnp.int32) - 128).astype(jnp.int8)
  main = jnp.dot(p_s8, v_i8, preferred_element_type=jnp.int32)
  colsum = v_i8.astype(jnp.int32).sum(axis=0)
  return main + 128 * colsum[None, :]


def fmha_head(q, k, v, bias, mask, kv_len, *, scale, is_causal, config,
              shared):
  """One head of 8-bit FMHA on quantised inputs.

  Args:
    q, k, v: int8 ``[T, D]``, ``[S, D]``, ``[S, Dv]`` (:func:`fmha_quantize`).
    shared: dict of float32 scalars ``q_scale``, ``k_scale``, ``v_scale``.
  Returns:
    the float32 output ``[T, Dv]`` before output quantisation.
  """
  f32, i32 = jnp.float32, jnp.int32
  t, dv = q.shape[0], v.shape[-1]
  xs = base.block_inputs(k, v, bias, mask, kv_len, t=t,
                         block_k=config.block_k, is_causal=is_causal)
  s_factor = jnp.asarray(scale, f32) * shared["q_scale"] * shared["k_scale"]
  v_scale = shared["v_scale"]

  def step(carry, x):
    m, l, o = carry
    s_int = jnp.dot(q, x["k"].T, preferred_element_type=i32)
    s = s_int.astype(f32) * s_factor
    if "bias" in x:
      s = s + x["bias"]
    s = base.visible_scores(s, x["visible"])
    mt = s.max(axis=-1)
    p = jnp.exp(s - base.safe_max(mt)[:, None])
    lt = p.sum(axis=-1)
    p_u8 = jnp.clip(quant.round_probability(p, 255), 0, 255).astype(jnp.uint8)
    pv = uint8_matmul_by_identity(p_u8, x["v"])
    lt_safe = jnp.where(lt == 0, jnp.ones_like(lt), lt)
    ot = pv.astype(f32) / (255.0 * lt_safe)[:, None] * v_scale
    m_new = jnp.maximum(m, mt)
    m_ref = base.safe_max(m_new)
    a_prev = jnp.exp(m - m_ref)
    a_cur = jnp.exp(mt - m_ref)
    l_new = a_prev * l + a_cur * lt
    l_safe = jnp.where(l_new == 0, jnp.ones_like(l_new), l_new)
    o_new = ((l * a_prev)[:, None] * o + (lt * a_cur)[:, None] * ot) / \
        l_safe[:, None]
    # A row with no (finite-score) visible key in this block keeps its state
    # bit for bit, so a kernel may skip the block; a row that never sees a
    # key stays zero.
    seen = lt > 0
    return (jnp.where(seen, m_new, m), jnp.where(seen, l_new, l),
            jnp.where(seen[:, None], o_new, o)), None

  init = base.softmax_state(t, dv)
  (_, _, o), _ = jax.lax.scan(step, init, xs)
  return o


_heads = base.vmap_heads(fmha_head)


def reference(q, k, v, bias, mask, kv_lens, *, scale, is_causal, config):
  """Batched 8-bit FMHA: quantise (one amax per batched tensor), run the
  blocked loop per head, quantise the output."""
  qz = fmha_quantize(q, k, v, kv_lens, config=config)
  shared = {f"{n}_scale": qz[f"{n}_scale"] for n in ("q", "k", "v")}
  o = _heads(qz["q"], qz["k"], qz["v"], bias, mask, kv_lens, shared=shared,
             scale=scale, is_causal=is_causal, config=config)
  return method_output(o, config=config)


__all__ = ["FmhaConfig", "normalize_amax", "fmha_amax", "fmha_quantize",
           "fmha_quantize_output", "method_output",
           "uint8_matmul_by_identity", "fmha_head", "reference"]

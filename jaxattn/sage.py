"""SageAttention2: smoothed int8/int4 Q K^T and float8 P V (Algorithm 1 of
the SageAttention2 technical report, Zhang et al., arXiv 2411.10958).

A bit-exact emulation of the kernel's arithmetic with jax/ml_dtypes types
(int8, float8_e4m3fn, float16, float32), written per head, in two parts:

(a) :func:`sage_quantize` (per head: :func:`quantize_head`), the
    pre-processing: smoothing, the smoothing bias and the quantisation;
(b) :func:`sage_head`, the blocked online softmax consuming its outputs.

Pre-processing (paper Eq. 2-6, Figure 3; all in float32 from the input
dtype; only visible keys, rows ``< kv_len``, count towards K and V means and
amaxes)::

    K   <- K - mean_tokens(K)                         (softmax unchanged)
    q_m,i = mean_rows(Q_i)      for each query block Q_i of block_q rows
    Q_i <- Q_i - q_m,i
    dS_i  = q_m,i K^T           (1 x S per block, the smoothing bias)
    V_m = mean_tokens(V),  V <- V - V_m

    (dQ, Qhat) = psi_Q(Q),  (dK, Khat) = psi_K(K)     int8: s = amax/127,
                                                      int4: s = amax/7
    (dV, Vhat) = psi_V(V)   per channel: dV[c] = max_t |V[t, c]| / 448,
                            Vhat = fl_e4m3(V / dV)      (pv_dtype="fp8")
                            Vhat = fl16(V), no scale    (pv_dtype="fp16")

Kernel, per key block ``j`` of ``block_k`` keys, in base 2 with the softmax
scale folded into the query scale (``c = float32(scale * log2(e))``, one
rounding of the float64 product)::

    S2  = float32((Qhat Khat_j^T)_int32) * (dQ c)[:, None] * dK_j[None, :]
          + dS_j c  (+ bias_j * float32(log2 e))      invisible keys: -inf
    m'  = max(m, rowmax S2)
    P   = exp2(S2 - m')                                float32, unquantised
    l   = exp2(m - m') l + rowsum P
    O   = exp2(m - m') O + (fl_e4m3(P * 448) Vhat_j)   fp8 operands, float32
                                                       accumulation per block
          (pv_dtype="fp16": O = exp2(m - m') O + fl16(P) Vhat_j)

and finally ``O = O / l / 448 * dV + V_m`` (``O / l + V_m`` for fp16).  The
per-block product is added into a separate float32 buffer: the two-level
accumulation the paper uses because the fp8 tensor-core accumulator of
Ada/Hopper keeps only about 13 mantissa bits.

Quantisation granularity of Q and K (``qk_granularity``):

* ``"warp"`` (SageAttention2): one scale per ``warp_rows`` (32) consecutive
  query rows, i.e. a 128-row query block split over 4 warps as on the GPU;
  K one scale per key block of ``block_k`` rows.
* ``"token"``: one scale per row of Q and per row of K.
* ``"block"`` (SageAttention1): one per ``block_q`` Q rows and per
  ``block_k`` K rows.
* ``"tensor"``: one per head (the per-head ``[T, D]`` / ``[S, D]`` slice).

SAGE_PRESETS (:data:`PRESETS`; ``method="sage"`` without options is
``"sage2-8b"``):

============  =========  ===========  ========  ===============  =========
preset        qk_dtype   granularity  pv_dtype  smoothing        block_k
============  =========  ===========  ========  ===============  =========
"sage2-8b"    int8       warp         fp8       Q, K and V       backend's
"sage2-4b"    int4       warp         fp8       Q, K and V       backend's
"sage1"       int8       block        fp16      K only           64
============  =========  ===========  ========  ===============  =========

``block_k`` left unset is 64, except where the call runs on the Mosaic
(Hopper) kernel, which takes 128: SageAttention2's own kernels do the same
(64-key blocks on sm80/sm89, 128 on sm90).  It is part of the numerics (the
K scale groups and the online softmax's blocks), so pass it to pin it.

Decisions beyond the paper:

* Means are ``sum * fl(1/count)`` in float32 (``count`` = visible keys, or real
  rows of the query block: the zero padding of a partial last query block
  does not count).  A head with ``kv_len = 0`` has zero K and V means.
* Smoothed K and V rows at or beyond ``kv_len``, and the padding rows of Q,
  are set to zero before quantisation: they quantise to zero, never reach a
  scale, and garbage (even NaN) in padded keys cannot reach the output.
* A zero amax (an all-zero group or channel) gives scale 0 and zero values.
* Divisions are written as multiplications by float32 reciprocals, the
  convention of :mod:`jaxattn.quant`'s ``*_rcp`` quantisers shared by all
  quantised methods (XLA compiles a division by a broadcast operand that way
  anyway, depending on jit/vmap context; a kernel multiplies by a reciprocal
  too): ``scale = amax * fl(1/qmax)`` (``fl(1/127)``, ``fl(1/7)``,
  ``fl(1/448)`` are constants), ``x_q = round(x * fl(1/scale))``, means
  ``sum * fl(1/count)``, and at the end ``O * fl(1/l) * fl(1/448) * dV``;
  each ``fl(1/y)`` is one IEEE division (:func:`jaxattn.quant.reciprocal`,
  ``1/0 := 0``).  Means and scales are rounded to float32 before any
  further use (no fused multiply-add of ``sum * fl(1/count)`` into
  ``x - mean``, no reassociation of ``amax * fl(1/qmax) * c``).  The sums of
  the means are XLA reductions whose order is unspecified: means can differ
  by an ulp between contexts (batched or per head) unless the sums are
  exact.
* int4 values are held in int8 containers (range [-7, 7]).  The Triton
  kernel takes them packed two per byte in halves of the head dim
  (:func:`jaxattn.quant.pack_int4_halves`, through
  :func:`jaxattn.operands.quantized_operands`) and unpacks them to int8 in
  registers: the same values, half the bytes.
* The user ``bias`` (natural-log units, as ``jax.nn.dot_product_attention``)
  is multiplied by ``float32(log2 e)`` and added after ``dS``.
* A row that sees no key returns zeros (``V_m`` is not added to it).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import base, quant

QK_DTYPES = {"int8": 8, "int4": 4}
QK_GRANULARITIES = ("token", "warp", "block", "tensor")
PV_DTYPES = ("fp8", "fp16")
FP8_MAX = quant.FP8_MAX
RCP_FP8_MAX = np.float32(1.0 / FP8_MAX)  # V scales: amax * fl(1/448)

PRESETS: dict[str, dict] = {
    "sage2-8b": dict(qk_dtype="int8", qk_granularity="warp", pv_dtype="fp8",
                     smooth_q=True, smooth_k=True, smooth_v=True),
    "sage2-4b": dict(qk_dtype="int4", qk_granularity="warp", pv_dtype="fp8",
                     smooth_q=True, smooth_k=True, smooth_v=True),
    "sage1": dict(qk_dtype="int8", qk_granularity="block", pv_dtype="fp16",
                  smooth_q=False, smooth_k=True, smooth_v=False, block_k=64),
}
SAGE_PRESETS = PRESETS  # alias, the name used in the docs


@dataclasses.dataclass(frozen=True)
class SageConfig(base.MethodConfig):
  """Options of ``method="sage"``.

  Build it with :meth:`from_options` (what ``dot_product_attention`` does):
  ``preset`` sets the base values, explicitly passed options override them.
  The constructor takes every field literally (``preset`` is then only a
  label, checked to be a valid name).  ``preset`` takes no part in equality
  or hashing: configs with the same resolved fields are equal (and share
  compiled code), e.g. ``from_options() == from_options(preset="sage2-8b")``.

  Attributes:
    preset: None, or one of :data:`PRESETS` ("sage2-8b", "sage2-4b",
      "sage1").
    qk_dtype: "int8" (scale amax/127) or "int4" (amax/7, held in int8).
    qk_granularity: "warp", "token", "block" or "tensor" (see the module
      docstring).
    pv_dtype: "fp8" (P and per-channel-scaled V in float8_e4m3fn) or "fp16"
      (float16 P and V, V not quantised).
    smooth_q, smooth_k, smooth_v: subtract the per-block query mean (and add
      the bias ``q_m K^T``), the key mean, the value mean (added back to the
      output).
    block_q: query rows per block (the Q mean and "block" scales); a power
      of two.
    block_k: keys per block of the online softmax and of the "warp"/"block"
      K scales; a power of two (unset: 64, or 128 on the Mosaic kernel).
    warp_rows: query rows per "warp" scale; must divide ``block_q``.
  """
  preset: str | None = dataclasses.field(default=None, compare=False)
  qk_dtype: str = "int8"
  qk_granularity: str = "warp"
  pv_dtype: str = "fp8"
  smooth_q: bool = True
  smooth_k: bool = True
  smooth_v: bool = True
  block_q: int = 128
  block_k: int = 64
  warp_rows: int = 32

  def __post_init__(self):
    if self.preset is not None and self.preset not in PRESETS:
      raise ValueError(f"unknown preset {self.preset!r}; valid presets: "
                       f"{sorted(PRESETS)}")
    if self.qk_dtype not in QK_DTYPES:
      raise ValueError(f"qk_dtype must be one of {tuple(QK_DTYPES)}, got "
                       f"{self.qk_dtype!r}")
    if self.qk_granularity not in QK_GRANULARITIES:
      raise ValueError(f"qk_granularity must be one of {QK_GRANULARITIES}, "
                       f"got {self.qk_granularity!r}")
    if self.pv_dtype not in PV_DTYPES:
      raise ValueError(f"pv_dtype must be one of {PV_DTYPES}, got "
                       f"{self.pv_dtype!r}")
    for name in ("smooth_q", "smooth_k", "smooth_v"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a bool, got "
                         f"{getattr(self, name)!r}")
    base.check_kernel_knobs(self)
    w = self.warp_rows
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
      raise ValueError(f"warp_rows must be a positive int, got {w!r}")
    if self.block_q % w:
      raise ValueError(f"warp_rows ({w}) must divide block_q "
                       f"({self.block_q})")

  @classmethod
  def from_options(cls, **options) -> "SageConfig":
    preset = options.get("preset")
    if preset is not None and preset not in PRESETS:
      raise ValueError(f"unknown preset {preset!r}; valid presets: "
                       f"{sorted(PRESETS)}")
    return super().from_options(**{**PRESETS.get(preset, {}), **options})

  @classmethod
  def fixed_fields(cls, options) -> set[str]:
    """The options given and those their preset sets."""
    return (super().fixed_fields(options)
            | set(PRESETS.get(options.get("preset"), {})))

  @property
  def bits(self) -> int:
    return QK_DTYPES[self.qk_dtype]


def log2_scale(scale: float) -> jax.Array:
  """``c = float32(scale * log2(e))`` (one rounding of the float64 product),
  the factor folded into the query scales and the smoothing bias."""
  return jnp.float32(float(scale) * base.LOG2E)


def rounded(x):
  """``x`` materialised behind an optimisation barrier, so that later uses
  see the float32-rounded value: XLA would otherwise contract ``y - a * b``
  into a fused multiply-add, or reassociate ``(amax * fl(1/7)) * c`` into
  ``amax * fl(fl(1/7) * c)``, changing quantised values and scales."""
  return jax.lax.optimization_barrier(x)


# The most bytes of the smoothing bias ``q_m K^T`` (float32 ``[B, N,
# ceil(T / block_q), S]``, which the kernels read) that one kernel call may
# hold; a call beyond it runs by chunks of query rows
# (:func:`query_chunk_rows`).  The bias grows with ``T x S``: 537 MB at
# 1x16x32768, 17 GB at 1x32x131072 (docs/design.md, "The smoothing bias is
# held in memory").
BIAS_BYTES_LIMIT = 1 << 30


def query_chunk_rows(q, k, config: SageConfig) -> int | None:
  """Query rows per chunk for a kernel call on q ``[B, T, N, D]`` and k
  ``[B, S, K, D]`` whose smoothing bias would pass
  :data:`BIAS_BYTES_LIMIT`, or None (no bias, or within it).  A chunk is
  whole blocks of ``block_q`` rows, so every query scale and mean is the
  unchunked call's; the key and value side does not depend on
  the queries.  Not for "tensor" granularity (one Q scale over all rows):
  those calls keep the whole bias."""
  if not config.smooth_q or config.qk_granularity == "tensor":
    return None
  (b, t, n, _), s = q.shape, k.shape[1]
  per_block = 4 * b * n * s            # bytes of one bias row per head
  if per_block * -(-t // config.block_q) <= BIAS_BYTES_LIMIT:
    return None
  return max(BIAS_BYTES_LIMIT // per_block, 1) * config.block_q


def q_group_rows(config: SageConfig, t_pad: int) -> int:
  """Query rows per Q scale of ``config``'s granularity (``t_pad``: the
  padded query length, one group for "tensor")."""
  return {"token": 1, "warp": config.warp_rows, "block": config.block_q,
          "tensor": t_pad}[config.qk_granularity]


def k_group_rows(config: SageConfig, s: int) -> int:
  """Keys per K scale of ``config``'s granularity (``s`` for "tensor")."""
  return {"token": 1, "warp": config.block_k, "block": config.block_k,
          "tensor": s}[config.qk_granularity]


def _row_scales(x, group: int, bits: int):
  """Per-row expanded scales ``amax(group) / qmax`` of ``x`` ``[n, D]``."""
  n = x.shape[0]
  rcp_qmax = np.float32(1.0 / quant.qmax(bits))  # amax * fl(1/qmax)
  per_group = rounded(quant.group_absmax(x, group) * rcp_qmax)
  return quant.expand_groups(per_group, max(1, min(group, n)), n)


def quantize_kv_head(k, v, kv_len, *, config: SageConfig) -> dict:
  """Smoothing and quantisation of one key/value head.

  Args:
    k: ``[S, D]``; v: ``[S, Dv]`` (any float dtype); kv_len: int32 scalar.
  Returns:
    dict with ``k`` int8 ``[S, D]`` (int4 values in [-7, 7] for int4),
    ``k_scale`` float32 ``[S]`` (one per key row, expanded), ``k_mean``
    float32 ``[D]`` (zeros when ``smooth_k`` is off), ``k_smoothed`` float32
    ``[S, D]`` (the smoothed keys, zero at rows ``>= kv_len``), ``v``
    float8_e4m3fn (fp8) or float16 ``[S, Dv]``, ``v_scale`` float32 ``[Dv]``
    (fp8 only) and ``v_mean`` float32 ``[Dv]`` (zeros when ``smooth_v`` is
    off).
  """
  f32 = jnp.float32
  s = k.shape[0]
  kv_len = jnp.asarray(kv_len, jnp.int32)
  valid = (jnp.arange(s) < kv_len)[:, None]
  rcp_count = quant.reciprocal(jnp.maximum(jnp.minimum(kv_len, s), 1))
  k = jnp.where(valid, k.astype(f32), 0.0)
  v = jnp.where(valid, v.astype(f32), 0.0)
  zeros_k = jnp.zeros((k.shape[1],), f32)
  zeros_v = jnp.zeros((v.shape[1],), f32)
  k_mean = rounded(k.sum(axis=0) * rcp_count) if config.smooth_k else zeros_k
  v_mean = rounded(v.sum(axis=0) * rcp_count) if config.smooth_v else zeros_v
  ks = jnp.where(valid, k - k_mean, 0.0)
  vs = jnp.where(valid, v - v_mean, 0.0)
  k_scale = _row_scales(ks, k_group_rows(config, s), config.bits)
  out = dict(k=quant.quantize_int(
                 ks, quant.reciprocal(k_scale)[:, None], config.bits),
             k_scale=k_scale, k_mean=k_mean, k_smoothed=ks, v_mean=v_mean)
  if config.pv_dtype == "fp8":
    v_scale = rounded(jnp.abs(vs).max(axis=0) * RCP_FP8_MAX)
    out["v"] = quant.quantize_fp8(vs, quant.reciprocal(v_scale)[None, :])
    out["v_scale"] = v_scale
  else:
    out["v"] = vs.astype(jnp.float16)
  return out


def quantize_q_head(q, k_smoothed, *, scale: float, config: SageConfig
                    ) -> dict:
  """Smoothing and quantisation of one query head.

  Args:
    q: ``[T, D]`` (any float dtype); k_smoothed: float32 ``[S, D]`` from
      :func:`quantize_kv_head` (for the smoothing bias).
  Returns:
    dict with ``q`` int8 ``[T, D]``, ``q_scale`` float32 ``[T]`` (``dQ``,
    one per query row, expanded), ``q_scale_folded`` float32 ``[T]``
    (``dQ * c``, ``c = log2_scale(scale)``: the factor the kernel uses),
    ``q_mean`` float32 ``[ceil(T / block_q), D]`` and ``smooth_bias``
    float32 ``[ceil(T / block_q), S]`` (``dS = q_m K_smoothed^T``; zeros
    when ``smooth_q`` is off).
  """
  f32 = jnp.float32
  t, d = q.shape
  bq = config.block_q
  qp = base.pad_to_multiple(q.astype(f32), 0, bq)
  nqb = qp.shape[0] // bq
  real = (jnp.arange(nqb * bq) < t).reshape(nqb, bq, 1)
  qb = jnp.where(real, qp.reshape(nqb, bq, d), 0.0)
  if config.smooth_q:
    counts = jnp.clip(t - jnp.arange(nqb) * bq, 1, bq).astype(f32)
    q_mean = rounded(qb.sum(axis=1) * quant.reciprocal(counts)[:, None])
    smooth_bias = jnp.dot(q_mean, k_smoothed.T,
                          precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=f32)
  else:
    q_mean = jnp.zeros((nqb, d), f32)
    smooth_bias = jnp.zeros((nqb, k_smoothed.shape[0]), f32)
  qs = jnp.where(real, qb - q_mean[:, None, :], 0.0).reshape(nqb * bq, d)
  q_scale = _row_scales(qs, q_group_rows(config, nqb * bq), config.bits)[:t]
  qs = qs[:t]
  return dict(q=quant.quantize_int(
                  qs, quant.reciprocal(q_scale)[:, None], config.bits),
              q_scale=q_scale, q_scale_folded=q_scale * log2_scale(scale),
              q_mean=q_mean, smooth_bias=smooth_bias)


def quantize_head(q, k, v, kv_len, *, scale: float, config: SageConfig
                  ) -> dict:
  """The whole pre-processing of one head: :func:`quantize_q_head`'s and
  :func:`quantize_kv_head`'s entries (without ``k_smoothed``)."""
  kv = quantize_kv_head(k, v, kv_len, config=config)
  qz = quantize_q_head(q, kv.pop("k_smoothed"), scale=scale, config=config)
  return {**qz, **kv}


def sage_quantize(q, k, v, kv_len=None, *, scale: float | None = None,
                  config: SageConfig | None = None) -> dict:
  """SageAttention2's pre-processing: exactly the tensors and scales that
  :func:`sage_head` computes with (the ground truth of a kernel).

  Per head: ``q`` ``[T, D]``, ``k`` ``[S, D]``, ``v`` ``[S, Dv]`` and a
  scalar ``kv_len`` (None = S) give :func:`quantize_head`'s dict:

  ==================  ===================  =================================
  entry               dtype, shape         meaning
  ==================  ===================  =================================
  ``q``               int8 ``[T, D]``      Qhat (int4 values in [-7, 7])
  ``q_scale``         f32 ``[T]``          dQ per row (expanded groups)
  ``q_scale_folded``  f32 ``[T]``          dQ * float32(scale log2 e)
  ``q_mean``          f32 ``[nqb, D]``     q_m per query block
  ``smooth_bias``     f32 ``[nqb, S]``     dS = q_m K_smoothed^T
  ``k``               int8 ``[S, D]``      Khat
  ``k_scale``         f32 ``[S]``          dK per row (expanded groups)
  ``k_mean``          f32 ``[D]``          mean of the visible keys
  ``v``               fp8 / f16 ``[S,Dv]`` Vhat (smoothed V)
  ``v_scale``         f32 ``[Dv]``         dV per channel (fp8 only)
  ``v_mean``          f32 ``[Dv]``         V_m
  ==================  ===================  =================================

  (``nqb = ceil(T / block_q)``.)  Batched: BTNH arrays ``[B, T, N, D]``,
  ``[B, S, K, D]``, ``[B, S, K, Dv]`` (``N`` a multiple of ``K``) and
  ``kv_len`` ``[B]`` (or None) give the same entries with the batch first,
  a sequence/block axis (when the entry has one) second and the head axis
  next: ``q`` ``[B, T, N, D]``, ``q_scale`` ``[B, T, N]``, ``q_mean``
  ``[B, nqb, N, D]``, ``smooth_bias`` ``[B, nqb, N, S]``, ``k`` ``[B, S, K,
  D]``, ``k_scale`` ``[B, S, K]``, ``k_mean`` ``[B, K, D]``, ``v`` ``[B, S,
  K, Dv]``, ``v_scale`` / ``v_mean`` ``[B, K, Dv]``.

  ``scale`` defaults to ``1/sqrt(D)``; ``config`` to ``SageConfig()``
  ("sage2-8b").
  """
  config = SageConfig.from_options() if config is None else config
  scale = base.default_scale(q.shape[-1]) if scale is None else float(scale)
  return _sage_quantize(q, k, v, kv_len, scale=scale, config=config)


@functools.partial(jax.jit, static_argnames=("scale", "config"))
def _sage_quantize(q, k, v, kv_len, *, scale, config):
  if q.ndim == 2:
    kv_len = k.shape[0] if kv_len is None else kv_len
    return quantize_head(q, k, v, jnp.asarray(kv_len, jnp.int32),
                         scale=scale, config=config)
  b, t, nq, d = q.shape
  s, nk = k.shape[1], k.shape[2]
  kv_len = base.kv_lengths(kv_len, b, s)
  kv_fn = lambda k1, v1, n: quantize_kv_head(k1, v1, n, config=config)
  kv = jax.vmap(jax.vmap(kv_fn, in_axes=(1, 1, None)))(k, v, kv_len)
  ksm = kv.pop("k_smoothed")  # [B, K, S, D]
  qh = q.reshape(b, t, nk, nq // nk, d)
  q_fn = lambda q1, k1: quantize_q_head(q1, k1, scale=scale, config=config)
  qz = jax.vmap(jax.vmap(jax.vmap(q_fn, in_axes=(1, None)),
                         in_axes=(1, 0)))(qh, ksm)  # [B, K, G, ...]
  qz = {name: x.reshape(b, nq, *x.shape[3:]) for name, x in qz.items()}
  out = {}
  for name, x in {**qz, **kv}.items():  # head axis at 1
    if name in ("k_mean", "v_mean", "v_scale"):
      out[name] = x                      # [B, K, D]
    else:                                # [B, N, L, ...] -> [B, L, N, ...]
      out[name] = jnp.moveaxis(x, 1, 2)
  return out


def sage_head(q, k, v, bias, mask, kv_len, *, scale, is_causal, config,
              shared=None):
  """One head of SageAttention2 (see the module docstring for the
  equations).

  Args:
    q: ``[T, D]``; k: ``[S, D]``; v: ``[S, Dv]`` (float16/bfloat16/float32).
    bias: float ``[T, S]`` added to the scaled scores, or None.
    mask: bool ``[T, S]`` (True = visible), or None.
    kv_len: int32 scalar, keys at or beyond it are masked.
  Returns:
    float32 ``[T, Dv]``.
  """
  del shared
  f32, i32 = jnp.float32, jnp.int32
  t, dv = q.shape[0], v.shape[-1]
  bq, bk = config.block_q, config.block_k
  fp8 = config.pv_dtype == "fp8"
  z = quantize_head(q, k, v, kv_len, scale=scale, config=config)
  c = log2_scale(scale)
  xs = base.block_inputs(z["k"], z["v"], None, mask, kv_len, t=t, block_k=bk,
                         is_causal=is_causal)
  xs["k_scale"] = base.pad_to_multiple(z["k_scale"], 0, bk).reshape(-1, bk)
  if config.smooth_q:
    ds_rows = jnp.repeat(z["smooth_bias"] * c, bq, axis=0)[:t]  # [T, S]
    xs["ds"] = base.column_blocks(ds_rows, bk)
  if bias is not None:
    xs["bias"] = base.column_blocks(
        bias.astype(f32) * f32(base.LOG2E), bk)
  q_i8, q_sc = z["q"], z["q_scale_folded"]

  def step(carry, x):
    m, l, o = carry
    s_int = jnp.dot(q_i8, x["k"].T, preferred_element_type=i32)
    s = s_int.astype(f32) * q_sc[:, None] * x["k_scale"][None, :]
    if "ds" in x:
      s = s + x["ds"]
    if "bias" in x:
      s = s + x["bias"]
    s = base.visible_scores(s, x["visible"])
    m_new = jnp.maximum(m, s.max(axis=-1))
    m_ref = base.safe_max(m_new)
    p = jnp.exp2(s - m_ref[:, None])
    alpha = jnp.exp2(m - m_ref)
    l = alpha * l + p.sum(axis=-1)
    if fp8:
      p_lo = (p * f32(FP8_MAX)).astype(jnp.float8_e4m3fn)
    else:
      p_lo = p.astype(jnp.float16)
    o_blk = jnp.dot(p_lo, x["v"], preferred_element_type=f32)
    o = alpha[:, None] * o + o_blk
    return (m_new, l, o), None

  init = base.softmax_state(t, dv)
  (_, l, o), _ = jax.lax.scan(step, init, xs)
  seen = (l > 0)[:, None]  # base.finalize, as a reciprocal (1/0 := 0)
  out = jnp.where(seen, o * quant.reciprocal(l)[:, None], 0.0)
  if fp8:
    out = out * RCP_FP8_MAX * z["v_scale"][None, :]
  return out + jnp.where(seen, z["v_mean"][None, :], 0.0)


reference = base.vmap_heads(sage_head)

__all__ = ["SageConfig", "PRESETS", "SAGE_PRESETS", "log2_scale", "rounded",
           "q_group_rows", "k_group_rows", "quantize_kv_head",
           "quantize_q_head", "quantize_head", "sage_quantize", "sage_head",
           "reference"]

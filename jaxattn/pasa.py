"""PASA: online pseudo-average shifting attention (Algorithm 1 of the PASA
paper, arXiv 2503.01873), float16 end to end without overflow.

Pre-processing (a batched matmul per key block, paper lines 5-7):
``K'_j^T = K_j^T M`` with the shifting matrix ``M = I - beta J / s2`` rounded
to the compute dtype exactly as the optimal-beta solver assumes (diagonal
``fl(1 - beta/s2)``, off-diagonal ``fl(-beta/s2)``), then scaled by the softmax
scale ``1/alpha``.  Then for each key block, all in the compute dtype:

1. ``S' = Q K'^T``; ``m' = rowmax S'``; ``P = exp(S' - m')``; ``l' = rowsum P``
2. ``Sbar' = rowmean S'`` over all ``s2`` columns, before any mask
3. ``F_j = ((j-1) F_{j-1} + Sbar') / j``
4. ``dm'_{j-1} = beta (F_{j-1} - F_j)/(1-beta)``, ``dm'_j = beta (Sbar' - F_j)/(1-beta)``
5. ``m_j = max(m_{j-1} + dm'_{j-1}, m' + dm'_j)``,
   ``dm_{j-1} = m_{j-1} - m_j + dm'_{j-1}``, ``dm_j = m' - m_j + dm'_j``
6. ``l_j = e^{dm_{j-1}} l_{j-1} + e^{dm_j} l'``, ``O_j = e^{dm_j} P V_j + e^{dm_{j-1}} O_{j-1}``

and finally ``O / l``.  ``beta / (1 - beta)`` is the constant ``fl(beta/(1-beta))``
(63.5 exactly for the paper's beta = 0.984497).

Precision allocation.  The recovery multiplies every error in ``Sbar'`` by
``beta / (1 - beta)`` (63.5), and ``Sbar'`` is the mean of ``S'`` over a
block, so two errors that are tiny elsewhere move whole blocks' weights:
(a) ``Sbar'`` and ``F`` rounded to float16 (half an ulp of values in the
hundreds) and (b) the rounding of the shifted keys ``K'``, whose column sums
no longer equal ``(1 - beta)`` times the keys' (a random walk of 128
roundings).  :class:`PasaConfig` therefore offers, besides the literal
Algorithm 1 (``state_dtype="float16"``, ``key_rounding="nearest"``):

* ``state_dtype="float32"``: ``m, l, Sbar', F``, the corrections and the
  accumulator ``O`` in float32 (``S'`` and ``P`` stay float16, so what can
  overflow in Algorithm 1 is unchanged; float32 state cannot overflow);
* ``key_rounding="sum_preserving"``: ``K' = scale (M^T K)`` computed in
  float32 and rounded so that each key block's column sums stay within
  about half an ulp (:func:`_sum_preserving_round`).

* ``adaptive_shift=True``: a key block is shifted only where its mean is
  large against its spread (:func:`block_shifted`); the others keep their
  keys exactly (but for entries below ``2^-14 / p``, which float16's
  subnormals hold to ``2^-24``), because the softmax scale is folded into
  the keys only as a power of two (:func:`key_factor`) and the rest of
  it, ``scale / p``, into the exponent.  Where the shift removes nothing
  (keys of mean 0) it would only round every key once more than
  ``fp16_fp32`` does.  An unshifted block contributes no correction
  (``dm'_j = -inva F_j``) and no ``Sbar'`` to ``F``.
* ``scale_in_keys=None``: the power of two ``p`` is folded into the keys
  only where the call needs it.  ``p < 1`` is what keeps the float16
  scores of large inputs finite, but it rounds key entries below
  ``2^-14 / p`` to float16 subnormals; where a bound from the call's Q and
  K row norms (:func:`unscaled_keys_fit`) shows that no score can reach
  float16's limit with ``p = 1``, the keys stay exact and the exponent
  takes the whole ``scale`` (:func:`with_key_factor`).  The choice is
  made on the device, without a ``lax.cond`` (whose predicate the host
  would wait for): ``p`` is a float32 scalar, 1 or the power of two, that
  the key kernel multiplies the keys by, and the attention kernels take
  the exponent's factor ``scale / p`` as a runtime scalar, so one kernel
  of each serves both choices (:func:`key_factor_value`).
* ``online_softmax="running"``: FlashAttention-2's form of the online
  softmax, ``P = exp(scale/p S' + dm_j - m_j)`` against the running max
  (which the corrections move), where Algorithm 1 takes ``exp(S' - m')``
  against the block's max and scales the block's ``l'`` and ``P V`` by
  ``e^{dm_j}``.  The values are the same; with every correction 0 (no
  block shifted) the arithmetic is ``fp16_fp32``'s op for op, and the
  kernels accumulate ``P V`` in the tensor cores as for ``fp16_fp32``.

The default uses all five; ``docs/design.md`` has the sweeps behind it.

Decisions beyond the paper (documented in the README):

* A row for which a key block holds no visible key (causal blocks above the
  diagonal, blocks past ``kv_len``) leaves its state, including its block count
  ``j``, unchanged, so a kernel that skips such blocks computes the same thing.
* Keys at or beyond ``kv_len`` (and the zero padding of a partial last block)
  are replaced, before shifting, by the mean of the visible keys of their
  block.  They are masked anyway; this keeps padding zeros from cancelling the
  shift of the real keys (exactness does not depend on the fill value).
* A bias is added after the pseudo-average is taken (the recovery only adds a
  per-row constant, so this stays exact).
* Rounding points, chosen to be what a GPU kernel computes for free: ``S'``
  is rounded to the compute dtype as it leaves the matmul; ``Sbar'`` is the
  float32 sum of the matmul accumulator, divided by ``s2`` and rounded to
  the state dtype; ``S' - m'`` is a compute-dtype subtraction whose result
  feeds a float32 ``exp`` (``exp2(x log2 e)``, as the kernel computes it;
  every ``exp`` here is taken that way and rounded to the state dtype);
  ``l'`` is the float32 sum of those exponentials, rounded; ``P`` is the
  exponential rounded to the compute dtype (the PV matmul operand), and the
  block's ``P V`` is rounded to the state dtype.  ``m``, ``l``, ``F``, the
  corrections and ``O`` are state-dtype values, every operation rounded.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers float16/bfloat16 rounding in numpy)
import numpy as np

from jaxattn import base

DEFAULT_BETA0 = 1.0 - 2.0**-6
KEY_ROUNDINGS = ("sum_preserving", "nearest")
# The options that make PasaConfig the paper's Algorithm 1 literally.
ALGORITHM1 = {"state_dtype": "float16", "key_rounding": "nearest",
              "adaptive_shift": False, "online_softmax": "per_block",
              "scale_in_keys": True}
ONLINE_SOFTMAXES = ("running", "per_block")
# A block is shifted when |c| > SHIFT_MIN_RATIO |A| (block_shifted); the
# keys' factor p <= scale / (1 + SHIFT_MIN_RATIO) then keeps every block's
# float16 scores within the paper's bound (README, "PASA's bound").
SHIFT_MIN_RATIO = 0.25
# The most a float16 score S' may reach, by the bound of unscaled_keys_fit,
# for keys without the softmax scale: float16's largest finite value less
# a margin for the rounding of the shifted keys (at most one ulp each
# with sum-preserving rounding) and of the float32 product.
UNSCALED_SCORE_LIMIT = 65504.0 / (1.0 + 2.0 ** -8)


def _invariance(beta: float, n: int, dtype) -> float:
  """The practical invariance ``Inva1`` of Appendix A for one ``beta``."""
  dt = base.as_numpy_dtype(dtype)
  m0 = np.asarray(1.0 - beta / n, np.float64).astype(dt)
  m1 = np.asarray(-beta / n, np.float64).astype(dt)
  b = -np.float64(m1)
  a = np.float64(m0) + b
  return float(b * n / (a * (a - b * n)) + (1.0 - a) / a)


def optimal_beta(beta0: float = DEFAULT_BETA0, n: int = base.DEFAULT_BLOCK_K,
                 dtype=jnp.float16, tol: float = 1e-8,
                 max_iter: int = 1000) -> float:
  """The PASA fixed-point solver (paper Appendix C, Eq. 22).

  With ``b = fl(beta/n)`` and ``a = fl(1 - beta/n) + b`` (``fl`` rounds to
  ``dtype``; ``a``, ``b`` then in float64), iterates
  ``beta <- f / (1 + f)``, ``f = b n / (a (a - b n)) + (1 - a)/a``, until the
  relative change is below ``tol``.  For float16 and ``n = 128`` the starts
  ``1-2^-4, 1-2^-5, 1-2^-6`` give 0.937500, 0.968994, 0.984497 (Table 3).
  """
  if not 0.0 < beta0 < 1.0:
    raise ValueError(f"beta0 must be in (0, 1), got {beta0}")
  if n < 1:
    raise ValueError(f"n must be >= 1, got {n}")
  beta = float(beta0)
  for _ in range(max_iter):
    f = _invariance(beta, n, dtype)
    new = f / (1.0 + f)
    if abs(new - beta) <= tol * abs(beta):
      return new
    beta = new
  raise RuntimeError(f"optimal_beta did not converge from {beta0}")


@dataclasses.dataclass(frozen=True)
class PasaConfig(base.MethodConfig):
  """Options of ``method="pasa"``.

  Attributes:
    beta: shifting strength in [0, 1); ``None`` = ``optimal_beta(1 - 2^-6,
      block_k, compute_dtype)`` (0.984497 for float16 and 128-key blocks).
      ``beta = 0`` is plain flash attention in the compute dtype.
    block_k: keys per block (``s2``, the size of the shifting matrix).
    compute_dtype: ``"float16"`` (the paper), or ``"float32"``/``"float64"``
      to check the mathematical equivalence (reference only).
    state_dtype: dtype of the running state ``m, l, O``, PASA's ``F`` and
      ``Sbar'`` and the corrections: ``"float32"`` (default) or
      ``"float16"`` (Algorithm 1 literally).  ``S'`` and ``P`` are in
      ``compute_dtype`` either way.
    key_rounding: how the shifted keys ``K' = p M^T K`` become float16:
      ``"sum_preserving"`` (default; one rounding, then each block's column
      sums corrected, see the module docstring) or ``"nearest"`` (Algorithm
      1 literally: ``fl(fl(M^T K) fl(scale))``).
    adaptive_shift: shift only the key blocks whose mean is large against
      their spread, and fold the softmax scale into the keys as a power of
      two ``p`` (default True; False: every block, ``p = scale``, as
      Algorithm 1).  Needs the float32 state.
    online_softmax: ``"running"`` (FlashAttention-2's form: ``P``
      against the running max, the corrections folded into it, so that
      with no block shifted the arithmetic is exactly ``fp16_fp32``'s) or
      ``"per_block"`` (Algorithm 1: ``P`` against the block's own max,
      then scaled by ``e^{dm_j}``); None (default): ``"running"`` with the
      float32 state, ``"per_block"`` with the float16 one, which
      ``"running"`` does not take.
    scale_in_keys: whether the softmax scale, as the power of two ``p``
      of :func:`key_factor`, is folded into the shifted keys: True (the
      paper; what keeps large inputs' float16 scores finite), False
      (``p = 1``: the keys exact, the exponent takes all of ``scale``; the
      float16 scores are ``1 / p`` times larger), or None (default): per
      call, False where :func:`unscaled_keys_fit` shows that no score can
      overflow without it, else True (with the adaptive shift; without
      it, True).
    tile_q, num_warps, num_stages: Triton kernel knobs (None = the tuned
      table in :mod:`pallas_kernels.flash`); the reference ignores them and
      the Mosaic kernel refuses them.
  """
  beta: float | None = None
  block_k: int = base.DEFAULT_BLOCK_K
  compute_dtype: str = "float16"
  state_dtype: str = "float32"
  key_rounding: str = "sum_preserving"
  adaptive_shift: bool = True
  online_softmax: str | None = None
  scale_in_keys: bool | None = None
  tile_q: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None
  RENAMED = {"block_q": "tile_q"}

  def __post_init__(self):
    base.check_kernel_knobs(self)
    if self.compute_dtype not in ("float16", "float32", "float64"):
      raise ValueError("compute_dtype must be float16, float32 or float64")
    if self.state_dtype not in ("float16", "float32"):
      raise ValueError("state_dtype must be 'float16' or 'float32', got "
                       f"{self.state_dtype!r}")
    if self.key_rounding not in KEY_ROUNDINGS:
      raise ValueError(f"key_rounding must be one of {KEY_ROUNDINGS}, got "
                       f"{self.key_rounding!r}")
    if (self.adaptive_shift and self.compute_dtype == "float16"
        and self.state_dtype != "float32"):
      raise ValueError("adaptive_shift needs state_dtype='float32' (an "
                       "unshifted block's mean score can overflow a float16 "
                       "state); PasaConfig.algorithm1() turns both off")
    if self.online_softmax not in (None, *ONLINE_SOFTMAXES):
      raise ValueError(f"online_softmax must be one of {ONLINE_SOFTMAXES}, "
                       f"got {self.online_softmax!r}")
    if (self.online_softmax == "running" and self.compute_dtype == "float16"
        and self.state_dtype != "float32"):
      raise ValueError("online_softmax='running' needs state_dtype="
                       "'float32' (its max carries the corrections); "
                       "PasaConfig.algorithm1() sets 'per_block'")
    if self.scale_in_keys not in (None, True, False):
      raise ValueError("scale_in_keys must be True, False or None, got "
                       f"{self.scale_in_keys!r}")
    if self.beta is not None and not 0.0 <= self.beta < 1.0:
      raise ValueError(f"beta must be in [0, 1), got {self.beta}")

  @classmethod
  def algorithm1(cls, **options) -> "PasaConfig":
    """Algorithm 1 of the paper literally: float16 state, keys rounded to
    nearest (the default allocation is more accurate, see the module
    docstring)."""
    return cls(**{**ALGORITHM1, **options})

  @property
  def running_softmax(self) -> bool:
    """Whether the online softmax takes FlashAttention-2's form."""
    if self.online_softmax is not None:
      return self.online_softmax == "running"
    return (self.state_dtype == "float32"
            or self.compute_dtype != "float16")

  @property
  def resolved_beta(self) -> float:
    if self.beta is not None:
      return float(self.beta)
    return optimal_beta(DEFAULT_BETA0, self.block_k, self.compute_dtype)


def shifting_matrix(beta: float, n: int, dtype) -> jax.Array:
  """``M = I - beta J / n`` rounded to ``dtype`` (paper Eq. 10 without the
  ``1/alpha`` factor, which :func:`shift_keys` applies afterwards)."""
  dt = base.as_numpy_dtype(dtype)
  diag = np.asarray(1.0 - beta / n, np.float64).astype(dt)
  off = np.asarray(-beta / n, np.float64).astype(dt)
  m = np.full((n, n), off, dt)
  np.fill_diagonal(m, diag)
  return jnp.asarray(m)


def _sum_preserving_round(x, dtype, rounds: int = 2):
  """``x`` ``[nb, bk, D]`` (float32) rounded to ``dtype`` so that each key
  block's column sums stay within about half an ulp of ``x``'s.

  Rounding to nearest leaves a column-sum error of up to ``bk / 2`` ulps
  (all elements alike round one way), which PASA's recovery multiplies by
  ``beta / (1 - beta)``.  Here, in each of ``rounds``, ``n`` of the elements
  that rounded in the direction of their column's error and have the
  column's largest such ulp move to their other neighbour, ``n`` the error
  in that ulp (every element stays within one ulp of ``x``).  Which
  candidates move rotates with the column, so that equal keys move in
  equally many columns.  Reductions and a cumulative sum over the block:
  no sort, no search.
  """
  f32 = x.dtype
  r = x.astype(dtype)
  col = jnp.arange(x.shape[2])
  for _ in range(rounds):
    d = r.astype(f32) - x                               # rounding errors
    err = d.sum(axis=1, keepdims=True)                  # column errors
    other = jnp.nextafter(r, jnp.where(d > 0, -jnp.inf, jnp.inf).astype(
        dtype))
    ulp = jnp.abs(other.astype(f32) - r.astype(f32))
    candidate = (d * err > 0) & jnp.isfinite(ulp)
    col_ulp = jnp.where(candidate, ulp, 0.0).max(axis=1, keepdims=True)
    candidate &= ulp == col_ulp
    n = jnp.round(jnp.abs(err) / jnp.maximum(col_ulp,
                                             np.finfo(np.float32).tiny))
    count = jnp.maximum(candidate.sum(axis=1, keepdims=True), 1)
    rank = jnp.cumsum(candidate, axis=1) - 1            # among candidates
    moved = candidate & ((rank - col * 37) % count < n)
    r = jnp.where(moved, other, r)
  return r


def key_factor(scale: float, adaptive: bool,
               scale_in_keys: bool | None = True) -> float:
  """The factor ``p`` folded into the shifted keys: ``scale`` (Algorithm 1),
  or with ``adaptive`` the largest power of two ``<= scale / (1 +
  SHIFT_MIN_RATIO)``, which multiplies float16 keys exactly; 1 where
  ``scale_in_keys`` is False (None counts as True).  The exponent then
  takes ``scale / p`` (the kernels' ``exp2`` factor)."""
  if scale_in_keys is False:
    return 1.0
  if not adaptive:
    return float(scale)
  return float(2.0 ** math.floor(math.log2(abs(scale)
                                          / (1.0 + SHIFT_MIN_RATIO))))


# The softmax scales for which the keys' factor may be chosen on the
# device: there every constant the kernels derive from ``scale / p``
# (``scale / p * log2 e``, ``p / scale``, ``scale / p * inva``) is a
# float32 normal number for ``p = 1`` and for the power of two, so that
# multiplying the ``p = 1`` constant by ``1 / p`` at run time gives the
# static constant of either choice bit for bit.  Outside it (no real
# call) the keys keep the scale.
RUNTIME_FACTOR_SCALES = (2.0 ** -100, 2.0 ** 100)


def _is_static(scale_in_keys) -> bool:
  return scale_in_keys is None or isinstance(scale_in_keys, (bool, np.bool_))


def key_factor_value(scale: float, adaptive: bool, scale_in_keys=True,
                     f=None, dtype=jnp.float32):
  """``f(p)`` (default ``p``) of the keys' factor ``p =
  key_factor(scale, adaptive, scale_in_keys)``.  ``scale_in_keys`` a bool,
  None (as True) or a bool scalar array, the call's choice made on the
  device (:func:`with_key_factor`): for a static choice the Python float
  ``f(p)`` itself (the caller rounds it as before); for an array a
  ``dtype`` scalar, ``where(scale_in_keys, f(p), f(1))`` with each
  candidate computed in float64 and rounded to ``dtype`` as its static
  value is, so that the result is bit for bit the static one of either
  choice."""
  f = (lambda p: p) if f is None else f
  if _is_static(scale_in_keys):
    return f(key_factor(scale, adaptive, scale_in_keys))
  dt = base.as_numpy_dtype(dtype)
  scaled = np.asarray(f(key_factor(scale, adaptive, True)), np.float64)
  unscaled = np.asarray(f(key_factor(scale, adaptive, False)), np.float64)
  return jnp.where(jnp.asarray(scale_in_keys, bool), scaled.astype(dt),
                   unscaled.astype(dt))


def fill_blocks(kb, valid, axis=-2):
  """Key blocks ``kb`` (keys of a block along ``axis``, channels last) with
  the keys where ``valid`` (broadcastable) is False replaced by the mean of
  the valid ones, rounded to ``kb``'s dtype (0 where none is valid)."""
  count = jnp.broadcast_to(valid, kb.shape[:-1] + (1,)).sum(
      axis=axis, keepdims=True)
  acc = jnp.promote_types(kb.dtype, jnp.float32)
  mean = (jnp.where(valid, kb, 0).astype(acc).sum(axis=axis, keepdims=True)
          / jnp.maximum(count, 1)).astype(kb.dtype)
  return jnp.where(valid, kb, mean)


def block_shifted(kb, beta: float, axis=-2):
  """Which key blocks ``kb`` (keys along ``axis``, channels last; filled,
  :func:`fill_blocks`)
  the adaptive shift moves: those whose shift ``c = beta mean(K_j)`` is
  large against the spread it leaves, ``|c|^2 > SHIFT_MIN_RATIO^2 |A|^2``
  with ``A_d = max_i |k_id - c_d|`` (per channel, over the block), all in
  float32.  Returns bool, ``kb``'s shape without ``axis`` and channels.  An unshifted block's scores are then
  at most ``(1 + ratio)`` times the bound of its shifted ones
  (Cauchy-Schwarz)."""
  kb = kb.astype(jnp.float32)
  c = jnp.float32(beta) * kb.mean(axis=axis)
  a = jnp.maximum(kb.max(axis=axis) - c, c - kb.min(axis=axis))
  return ((c * c).sum(axis=-1)
          > jnp.float32(SHIFT_MIN_RATIO ** 2) * (a * a).sum(axis=-1))


def unscaled_keys_fit(q_norm, k_norm, beta: float) -> jax.Array:
  """Whether keys with no scale folded in (``p = 1``) keep every float16
  score ``S' = q . k'`` of a call finite, from the row norms' maxima
  (:func:`jaxattn.base.max_row_norm`): ``|q . k'| <= |q| |k'|``
  (Cauchy-Schwarz), and a shifted key ``k - beta mean(K_j)`` has a norm of
  at most ``(1 + beta) max |k|``; both below
  :data:`UNSCALED_SCORE_LIMIT`.  bool scalar."""
  k_bound = (1.0 + beta) * k_norm
  return ((q_norm * k_bound <= UNSCALED_SCORE_LIMIT)
          & (k_bound <= UNSCALED_SCORE_LIMIT))


def with_key_factor(run, q_norm, k_norm, config, *, scale: float,
                    has_bias=False):
  """``run(scale_in_keys)`` with the call's choice of the keys' factor:
  ``config.scale_in_keys`` where given; else (None, with the adaptive
  shift) the bool scalar array ``~unscaled_keys_fit(...)`` of the largest
  row norms of Q and K in the compute dtype
  (:func:`jaxattn.base.max_row_norm`), decided on the device: ``run``
  is traced once, and passes it on as a runtime scalar
  (:func:`key_factor_value`; the kernels multiply the keys by ``p`` and
  take the exponent's factor ``scale / p`` at run time), where a
  ``lax.cond`` between two traced paths would make the host wait for its
  predicate and compile every kernel twice.  The choice is per call (per
  shard under sharding, so a row's last bits can depend on the other
  rows of its call).  True (the scale in the keys) without the adaptive
  shift, for a ``scale`` outside :data:`RUNTIME_FACTOR_SCALES`, and for
  Algorithm 1's per-block softmax with a bias, which it adds to ``S'`` in
  float16 in units of ``p / scale``: ``p = 1`` would make it ``1 / scale``
  times larger."""
  if config.scale_in_keys is not None:
    return run(config.scale_in_keys)
  lo, hi = RUNTIME_FACTOR_SCALES
  if (not config.adaptive_shift or (has_bias and not config.running_softmax)
      or not lo <= abs(scale) <= hi):
    return run(True)
  return run(jnp.logical_not(
      unscaled_keys_fit(q_norm, k_norm, config.resolved_beta)))


def shift_keys(k, kv_len, *, beta: float, scale: float, block_k: int,
               compute_dtype, key_rounding: str, adaptive: bool = False,
               scale_in_keys=True):
  """PASA's key pre-processing: ``K'_j = p * (M^T K_j)`` per key block
  (``p = key_factor(scale, adaptive, scale_in_keys)``; ``scale_in_keys``
  may be a bool scalar array, the call's choice on the device,
  :func:`key_factor_value`); with ``adaptive`` a block that
  :func:`block_shifted` leaves is ``p K_j``, exact.

  Args:
    k: ``[S, D]`` keys of one head.
    kv_len: int32 scalar; keys at or beyond it, and the padding of the last
      block, are replaced by the mean of the block's visible keys.
    key_rounding: ``"nearest"`` (``fl(fl(M^T K) fl(p))``) or
      ``"sum_preserving"`` (see :func:`_sum_preserving_round`).
  Returns:
    ``([S_pad / block_k, block_k, D]`` keys in ``compute_dtype``, bool
    ``[S_pad / block_k]``: which blocks are shifted).
  """
  cd = jnp.dtype(compute_dtype)
  acc = jnp.float64 if cd == jnp.float64 else jnp.float32
  p = key_factor_value(scale, adaptive, scale_in_keys, dtype=acc)
  p_cd = key_factor_value(scale, adaptive, scale_in_keys, dtype=cd)
  kb = base.key_blocks(k.astype(cd), block_k)
  rows = jnp.arange(kb.shape[0] * block_k).reshape(kb.shape[0], block_k, 1)
  kb = fill_blocks(kb, rows < jnp.minimum(kv_len, k.shape[0]))
  m = shifting_matrix(beta, block_k, cd)
  shifted = jnp.einsum("nm,jnd->jmd", m, kb, preferred_element_type=acc)
  if key_rounding == "sum_preserving" and cd != acc:
    out = _sum_preserving_round(shifted * jnp.asarray(p, acc), cd)
  else:
    out = (shifted.astype(cd) * jnp.asarray(p_cd, cd)).astype(cd)
  if not adaptive:
    return out, jnp.ones(out.shape[0], bool)
  moved = block_shifted(kb, beta)
  return (jnp.where(moved[:, None, None], out,
                    (kb.astype(acc) * jnp.asarray(p, acc)).astype(cd)),
          moved)


def pasa_head(q, k, v, bias, mask, kv_len, *, scale, is_causal, config,
              shared=None, return_lse=False, scale_in_keys=None):
  """One head of PASA (see the module docstring for the equations).

  Args:
    q: ``[T, D]``; k: ``[S, D]``; v: ``[S, Dv]``, any float dtype (converted
      to the compute dtype, float16 by default, as the paper prescribes for
      bfloat16).
    scale_in_keys: the call's choice of the keys' factor
      (:func:`with_key_factor`: a bool, or a bool scalar array decided on
      the device); None: ``config.scale_in_keys`` (None as True).
  Returns:
    ``[T, Dv]`` holding the compute-dtype result, in float32 (float64 when
    computing in float64).
  """
  del shared
  cd = jnp.dtype(config.compute_dtype)
  if cd == jnp.float64 and not jax.config.read("jax_enable_x64"):
    raise ValueError("compute_dtype='float64' needs jax_enable_x64 "
                     "(jax.config.update('jax_enable_x64', True))")
  acc = jnp.float64 if cd == jnp.float64 else jnp.float32
  sd = jnp.promote_types(cd, config.state_dtype)   # the state's dtype
  beta = config.resolved_beta
  bk = config.block_k
  inva = jnp.asarray(np.asarray(beta / (1.0 - beta), np.float64)
                     .astype(base.as_numpy_dtype(cd)), sd)
  if scale_in_keys is None:
    scale_in_keys = config.scale_in_keys
  static = _is_static(scale_in_keys)
  # S' is in units of the keys' factor p; the exponent takes scale / p
  # (a Python float, or with the choice made on the device a scalar of
  # ``dtype`` equal to the static value of either choice)
  of_res = lambda f, dtype: key_factor_value(
      scale, config.adaptive_shift, scale_in_keys,
      lambda p: f(scale / p), dtype)
  res = of_res(lambda r: r, sd)          # scale / p
  res_acc = of_res(lambda r: r, acc)
  # exp(res x) as base.exp_f32 takes it: exp2(x fl(res log2 e))
  exp_factor = of_res(lambda r: r * base.LOG2E, acc)
  exp = lambda x: jnp.exp2(x.astype(acc) * jnp.asarray(exp_factor, acc))
  q, v = q.astype(cd), v.astype(cd)
  t, dv = q.shape[0], v.shape[-1]
  xs = base.block_inputs(k, v, bias, mask, kv_len, t=t, block_k=bk,
                         is_causal=is_causal)
  xs["k"], xs["shifted"] = shift_keys(
      k, kv_len, beta=beta, scale=scale, block_k=bk, compute_dtype=cd,
      key_rounding=config.key_rounding, adaptive=config.adaptive_shift,
      scale_in_keys=scale_in_keys)

  def block_scores(x):
    """Steps 1-2's inputs: ``Sbar'``, the float32 product's row mean over
    all ``s2`` columns, and ``S'`` as it leaves the matmul in fp16."""
    s_acc = jnp.dot(q, x["k"].T, preferred_element_type=acc)
    return (s_acc.sum(axis=-1) / bk).astype(sd), s_acc.astype(cd)

  def corrections(x, s_mean, seen, f, count):
    """Steps 3-4: the new ``F`` and block count, and the corrections
    ``dm'_{j-1}``, ``dm'_j`` (in the units of ``S'``).  A row that sees no
    key of the block keeps ``F`` and its count, and gets ``dm'_{j-1} =
    0``; with the adaptive shift an unshifted block adds no ``Sbar'``."""
    moved = seen & x["shifted"] if config.adaptive_shift else seen
    j = count + moved.astype(jnp.int32)
    f_new = jnp.where(moved, (((j - 1).astype(sd) * f) + s_mean)
                      / jnp.maximum(j, 1).astype(sd), f)
    s_in_f = (jnp.where(x["shifted"], s_mean, 0.0).astype(sd)
              if config.adaptive_shift else s_mean)
    return f_new, j, inva * (f - f_new), inva * (s_in_f - f_new)

  def step_running(carry, x):
    """Steps 1-6 in FlashAttention-2's form of the online softmax: ``P``
    against the running max with the corrections folded into it,
    ``P = exp(res S' + dm_j - m_j)``.  The same values as Algorithm 1's
    ``e^{dm_j} exp(S' - m')``, one rounding fewer for ``P``; and where
    every correction is 0 (no block shifted) it is ``fp16_fp32``'s
    arithmetic op for op (``res S'`` equals ``scale S`` exactly, ``p``
    being a power of two)."""
    m, l, o, f, count = carry
    s_mean, s = block_scores(x)
    u = s.astype(sd) * jnp.asarray(res, sd)   # scaled scores, minus beta F
    if "bias" in x:
      u = u + x["bias"].astype(sd)
    u = jnp.where(x["visible"], u, -jnp.inf)
    f_new, j, dmp_prev, dmp_cur = corrections(
        x, s_mean, x["visible"].any(axis=-1), f, count)
    d_prev = dmp_prev * jnp.asarray(res, sd)
    d_cur = dmp_cur * jnp.asarray(res, sd)
    m_new = jnp.maximum(m + d_prev, u.max(axis=-1) + d_cur)   # step 5
    m_ref = base.safe_max(m_new)
    e = base.exp_f32(u - (m_ref - d_cur)[:, None], acc=acc)
    alpha = base.exp_f32((m + d_prev) - m_ref, acc=acc).astype(sd)
    l = alpha * l + e.sum(axis=-1).astype(sd)                 # step 6
    pv = jnp.dot(e.astype(cd), x["v"], preferred_element_type=acc)
    o = alpha[:, None] * o + pv.astype(sd)
    return (m_new, l, o, f_new, j), None

  def step(carry, x):
    """Steps 1-6 as Algorithm 1 states them: ``P`` against the block's own
    max, the block's ``l'`` and ``P V`` then scaled by ``e^{dm_j}``."""
    m, l, o, f, count = carry
    s_mean, s = block_scores(x)
    if "bias" in x:
      if static:
        b = (x["bias"] if res == 1.0
             else x["bias"] * jnp.float32(1.0 / res))
      else:   # (times 1.0 where p = 1: the same bits)
        b = x["bias"] * of_res(lambda r: 1.0 / r, jnp.float32)
      s = s + b.astype(cd)
    s = base.visible_scores(s, x["visible"])
    m_loc = s.max(axis=-1)                                   # step 1
    # S' - m' in the state dtype (Algorithm 1: float16, rounded)
    e = exp(s.astype(sd) - base.safe_max(m_loc).astype(sd)[:, None])
    m_loc = m_loc.astype(sd)
    l_loc = e.sum(axis=-1).astype(sd)
    p = e.astype(cd)
    seen = x["visible"].any(axis=-1)
    f_new, j, dmp_prev, dmp_cur = corrections(x, s_mean, seen, f, count)
    m_new = jnp.maximum(m + dmp_prev, m_loc + dmp_cur)       # step 5
    # a row whose scores so far are all -inf (a bias of -1e5 in float16)
    # gets 0 weights, not -inf - -inf = NaN
    m_ref = base.safe_max(m_new)
    dm_prev = (m - m_ref) + dmp_prev
    dm_cur = (m_loc - m_ref) + dmp_cur
    e_prev = exp(dm_prev).astype(sd)
    e_cur = exp(dm_cur).astype(sd)
    l_new = e_prev * l + e_cur * l_loc                        # step 6
    pv = jnp.dot(p, x["v"], preferred_element_type=acc).astype(sd)
    o_new = e_cur[:, None] * pv + e_prev[:, None] * o
    keep = lambda new, old: jnp.where(seen.reshape(-1, *[1] * (old.ndim - 1)),
                                      new, old)
    return (keep(m_new, m), keep(l_new, l), keep(o_new, o), f_new, j), None

  init = (*base.softmax_state(t, dv, sd), jnp.zeros((t,), sd),
          jnp.zeros((t,), jnp.int32))
  running = config.running_softmax
  (m, l, o, f, _), _ = jax.lax.scan(step_running if running else step, init,
                                    xs)
  out = base.finalize(o, l)
  out_dtype = jnp.promote_types(sd, jnp.float32)  # float64 stays float64
  if return_lse:
    # Scores are relative to the common reference beta F / (1 - beta) (m in
    # units of p in the per-block form).
    lse = jnp.log(l.astype(acc)) + (
        m.astype(acc) + jnp.asarray(res_acc, acc) * inva.astype(acc)
        * f.astype(acc) if running
        else jnp.asarray(res_acc, acc) * (m.astype(acc)
                                          + inva.astype(acc) * f.astype(acc)))
    return out.astype(out_dtype), jnp.where(l == 0, -jnp.inf, lse).astype(
        out_dtype)
  return out.astype(out_dtype)


_heads = base.vmap_heads(pasa_head)


def reference(q, k, v, bias, mask, kv_lens, *, config, **options):
  """:func:`pasa_head` over batch and heads, the keys' factor chosen per
  call (:func:`with_key_factor`) as the kernels choose it."""
  cd = jnp.dtype(config.compute_dtype)
  return with_key_factor(
      lambda sik: _heads(q, k, v, bias, mask, kv_lens, config=config,
                         scale_in_keys=sik, **options),
      base.max_row_norm(q.astype(cd)), base.max_row_norm(k.astype(cd)),
      config, scale=options["scale"], has_bias=bias is not None)


__all__ = ["PasaConfig", "optimal_beta", "shifting_matrix", "key_factor",
           "key_factor_value", "unscaled_keys_fit", "with_key_factor",
           "fill_blocks", "block_shifted", "shift_keys",
           "pasa_head", "reference"]

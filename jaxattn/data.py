"""Benchmark inputs of the papers jaxattn reproduces.

Every generator takes a jax PRNG ``key`` (``jax.random.key`` or the legacy
``jax.random.PRNGKey``), a ``shape`` ``(B, S, N, D)`` in BTNH layout (batch,
sequence, heads, head_dim) and a ``dtype`` (default ``jnp.float16``), and
returns the triple ``(q, k, v)`` of jax arrays of that shape and dtype.
Values are drawn in float32 and rounded to ``dtype`` at the end.

The draws use numpy generators seeded by the bits of ``key`` (q, k and v
from independent child seeds): the same key gives the same inputs on every
platform, and no XLA program is compiled per shape (jax.random's threefry
takes seconds to compile on CPU).  The generators therefore run outside
``jax.jit``.

* :func:`pasa_uniform`, :func:`pasa_hybrid`: the PASA paper's random inputs
  (its Eqs. 17 and 18), with :data:`PASA_TABLE4_CASES` / :func:`pasa_case`
  for the cases of its Table 4.
* :func:`normal`, :func:`uniform`: INT-FlashAttention's inputs.
* :func:`channel_outlier`: keys with a large per-channel bias shared by all
  tokens, the structure SageAttention reports for real models' keys.
* :func:`resonance`: the PASA paper's overflow mechanism (large bias along the
  sequence plus an in-phase oscillation of q and k along head_dim).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["pasa_uniform", "pasa_hybrid", "normal", "uniform",
           "channel_outlier", "resonance", "PASA_TABLE4_CASES", "pasa_case"]

Shape = Sequence[int]


def _check_shape(shape) -> tuple[int, int, int, int]:
  try:
    dims = tuple(shape)
  except TypeError:
    raise ValueError(
        f"shape must be a (B, S, N, D) sequence of 4 positive ints, got "
        f"{shape!r}") from None
  if len(dims) != 4 or not all(
      isinstance(d, numbers.Integral) and not isinstance(d, bool) and d > 0
      for d in dims):
    raise ValueError(
        f"shape must be a (B, S, N, D) sequence of 4 positive ints "
        f"(batch, seq, heads, head_dim), got {shape!r}")
  return tuple(int(d) for d in dims)  # type: ignore[return-value]


def _check_real(name: str, value, *, min_value=None, finite=True) -> float:
  if not isinstance(value, numbers.Real) or isinstance(value, bool):
    raise ValueError(f"{name} must be a real number, got {value!r}")
  value = float(value)
  if finite and not math.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value!r}")
  if min_value is not None and value < min_value:
    raise ValueError(f"{name} must be >= {min_value}, got {value!r}")
  return value


def _rngs(key, n: int = 3) -> list[np.random.Generator]:
  """``n`` independent numpy generators seeded by the bits of ``key``."""
  try:
    words = np.asarray(jax.random.key_data(key))
  except jax.errors.TracerArrayConversionError:
    raise ValueError("jaxattn.data generators run outside jax.jit: pass a "
                     "concrete PRNG key") from None
  except (TypeError, ValueError) as e:
    raise ValueError(f"key must be a jax PRNG key (jax.random.key or "
                     f"jax.random.PRNGKey), got {key!r}") from e
  if words.ndim != 1:
    raise ValueError(f"key must be a single PRNG key, got a batch of shape "
                     f"{words.shape[:-1]}")
  seq = np.random.SeedSequence([int(w) for w in words.astype(np.uint32)])
  return [np.random.default_rng(c) for c in seq.spawn(n)]


def _cast(dtype, *xs):
  """float32 numpy arrays -> jax arrays of ``dtype`` (round to nearest)."""
  dt = jnp.dtype(dtype)
  return tuple(jnp.asarray(np.asarray(x, np.float32).astype(dt)) for x in xs)


def _normal(rng, shape, std=1.0):
  return rng.standard_normal(shape, dtype=np.float32) * np.float32(std)


def _uniform(rng, shape, low, high):
  u = rng.random(shape, dtype=np.float32)
  return (np.float32(low) + np.float32(high - low) * u).astype(np.float32)


def pasa_uniform(key, shape: Shape, x0: float, am: float,
                 dtype=jnp.float16):
  """``(q, k, v)``, each element i.i.d. ``U(x0 - am, x0 + am)`` (PASA Eq. 17).

  ``x0`` is the mean, ``am >= 0`` the half-width (std ``am / sqrt(3)``)."""
  shape = _check_shape(shape)
  x0 = _check_real("x0", x0)
  am = _check_real("am", am, min_value=0.0)
  return _cast(dtype, *(_uniform(r, shape, x0 - am, x0 + am)
                        for r in _rngs(key)))


def pasa_hybrid(key, shape: Shape, x0: float, am: float, dtype=jnp.float16,
                p: float = 0.001):
  """``(q, k, v)``, each element i.i.d. ``N(x0, 1) + N(0, am^2) * Bernoulli(p)``
  (PASA Eq. 18): a unit normal around ``x0`` plus, with probability ``p``, a
  large outlier of std ``am``.  Mean ``x0``, variance ``1 + p * am^2``."""
  shape = _check_shape(shape)
  x0 = _check_real("x0", x0)
  am = _check_real("am", am, min_value=0.0)
  p = _check_real("p", p, min_value=0.0)
  if p > 1.0:
    raise ValueError(f"p must be in [0, 1], got {p!r}")

  def draw(rng):
    x = np.float32(x0) + _normal(rng, shape)
    hit = rng.random(shape, dtype=np.float32) < p
    x[hit] += _normal(rng, int(hit.sum()), am)
    return x

  return _cast(dtype, *(draw(r) for r in _rngs(key)))


def normal(key, shape: Shape, dtype=jnp.float16):
  """``(q, k, v)``, each element i.i.d. ``N(0, 1)`` (INT-FlashAttention)."""
  shape = _check_shape(shape)
  return _cast(dtype, *(_normal(r, shape) for r in _rngs(key)))


def uniform(key, shape: Shape, dtype=jnp.float16):
  """``(q, k, v)``, each element i.i.d. ``U(-0.5, 0.5)`` (INT-FlashAttention)."""
  shape = _check_shape(shape)
  return _cast(dtype, *(_uniform(r, shape, -0.5, 0.5) for r in _rngs(key)))


# Defaults of channel_outlier: 8 of the head_dim channels of every
# (batch, head) carry a key bias of std 20 (the rest std 1), so a per-block
# absmax scale of K is set by the bias (|bias| up to ~50) and int4's 7 levels
# leave about one step for the N(0, 1) content of the keys.
CHANNEL_OUTLIER_SCALE = 20.0
CHANNEL_OUTLIER_COUNT = 8
CHANNEL_BASE_SCALE = 1.0


def channel_outlier(key, shape: Shape, dtype=jnp.float16, *,
                    outlier_scale: float = CHANNEL_OUTLIER_SCALE,
                    n_outlier_channels: int = CHANNEL_OUTLIER_COUNT,
                    base_scale: float = CHANNEL_BASE_SCALE):
  """``(q, k, v)`` with outlier channels in the keys (SageAttention's finding).

  ``q, v ~ N(0, 1)``; ``k[b, s, n, c] = z[b, s, n, c] + bias[b, n, c]`` with
  ``z ~ N(0, 1)`` and a bias shared by every token ``s``: for each
  ``(b, n)``, ``n_outlier_channels`` channels chosen at random get
  ``bias ~ N(0, outlier_scale^2)`` and the others ``bias ~ N(0,
  base_scale^2)``.

  The bias adds ``q . bias`` to every score of a query row, so it leaves the
  softmax (and the exact attention output) unchanged, but it dominates the
  absmax of per-block K quantization.  Smoothing K (subtracting its mean over
  tokens, as SageAttention does) removes it exactly.

  Defaults: ``outlier_scale=20``, ``n_outlier_channels=8``, ``base_scale=1``.
  At ``(1, 256, 2, 128)``, int4 Q per 32-token block and K per 64-token block
  (symmetric absmax / 7) give an attention-output cosine similarity of about
  0.5 (0.48-0.56 for keys 0-3) unsmoothed and 0.975 with K smoothed -- the
  same as int4 on plain N(0, 1) inputs, int4's floor for Gaussian data; int8
  gives 0.992-0.997 unsmoothed and 0.9999 smoothed (see
  tests/test_metrics_data.py).
  """
  shape = _check_shape(shape)
  b, s, n, d = shape
  outlier_scale = _check_real("outlier_scale", outlier_scale, min_value=0.0)
  base_scale = _check_real("base_scale", base_scale, min_value=0.0)
  if (not isinstance(n_outlier_channels, numbers.Integral)
      or isinstance(n_outlier_channels, bool)
      or not 0 <= n_outlier_channels <= d):
    raise ValueError(f"n_outlier_channels must be an int in [0, head_dim="
                     f"{d}], got {n_outlier_channels!r}")
  rq, rk, rv, rb = _rngs(key, 4)
  q = _normal(rq, shape)
  v = _normal(rv, shape)
  # A random set of n_outlier_channels channels for each (batch, head).
  rank = np.argsort(rb.random((b, 1, n, d)), axis=-1).argsort(axis=-1)
  std = np.where(rank < n_outlier_channels, outlier_scale, base_scale)
  bias = (_normal(rb, (b, 1, n, d)) * std).astype(np.float32)
  k = _normal(rk, shape) + bias
  return _cast(dtype, q, k, v)


# Defaults of resonance: bias alone gives q.k ~ D * bias^2 = 32768 at D = 128
# (no fp16 overflow); the in-phase oscillation adds D * amplitude^2 / 2 =
# 36864, so q.k ~ 69632 > 65504 for every pair.  Out of phase the two cancel
# to ~ -4096.
RESONANCE_BIAS = 16.0
RESONANCE_AMPLITUDE = 24.0
RESONANCE_PERIOD = 16.0
RESONANCE_NOISE = 1.0


def resonance(key, shape: Shape, dtype=jnp.float16, *,
              bias: float = RESONANCE_BIAS,
              amplitude: float = RESONANCE_AMPLITUDE,
              period: float = RESONANCE_PERIOD,
              out_of_phase: bool = False,
              noise: float = RESONANCE_NOISE):
  """``(q, k, v)`` reproducing the PASA paper's overflow mechanism (Qwen2,
  Stable-Video-Diffusion): a large bias along the sequence plus a resonance
  of q and k along the head dimension.

  ``q[b, s, n, d] = bias + amplitude * cos(2 pi d / period) + noise * z``,
  ``k[b, s, n, d] = bias + amplitude * cos(2 pi d / period + phi) + noise *
  z'`` with ``phi = 0`` (in phase) or ``pi`` (``out_of_phase=True``), the same
  ``bias`` for every token, ``z, z' ~ N(0, 1)``; ``v ~ N(0, 1)``.

  When ``period`` divides ``D`` the cross terms cancel and the unscaled score
  is ``q . k ~ D * bias^2 +- D * amplitude^2 / 2`` (+ noise of std about
  ``noise * sqrt(2 D (bias^2 + amplitude^2 / 2))``).  Defaults (``bias=16``,
  ``amplitude=24``, ``period=16``, ``noise=1``) give ``q . k ~ 69632 +- 400``
  at ``D = 128``: every unscaled score is above float16's 65504, so a float16
  score matrix overflows to inf, while the bias alone (32768) or the
  out-of-phase inputs (~ -4096) do not.  Elements stay below ~45 in
  magnitude.
  """
  shape = _check_shape(shape)
  d = shape[-1]
  bias = _check_real("bias", bias)
  amplitude = _check_real("amplitude", amplitude)
  period = _check_real("period", period)
  noise = _check_real("noise", noise, min_value=0.0)
  if period <= 0:
    raise ValueError(f"period must be > 0, got {period!r}")
  rq, rk, rv = _rngs(key)
  phase = 2.0 * np.pi * np.arange(d) / period
  phi = np.pi if out_of_phase else 0.0
  wave_q = (bias + amplitude * np.cos(phase)).astype(np.float32)
  wave_k = (bias + amplitude * np.cos(phase + phi)).astype(np.float32)
  q = wave_q + _normal(rq, shape, noise)
  k = wave_k + _normal(rk, shape, noise)
  v = _normal(rv, shape)
  return _cast(dtype, q, k, v)


PASA_TABLE4_CASES: list[dict[str, Any]] = [
    {"name": "uniform_x0=30_am=0.5", "dist": "uniform", "x0": 30.0,
     "am": 0.5, "paper_nan_pct": 100.0},
    {"name": "uniform_x0=20_am=15", "dist": "uniform", "x0": 20.0,
     "am": 15.0, "paper_nan_pct": 0.12},
    {"name": "uniform_x0=20_am=20", "dist": "uniform", "x0": 20.0,
     "am": 20.0, "paper_nan_pct": 8.14},
    {"name": "hybrid_x0=30_am=10", "dist": "hybrid", "x0": 30.0,
     "am": 10.0, "paper_nan_pct": 100.0},
    {"name": "hybrid_x0=20_am=50", "dist": "hybrid", "x0": 20.0,
     "am": 50.0, "paper_nan_pct": 0.04},
    {"name": "hybrid_x0=20_am=100", "dist": "hybrid", "x0": 20.0,
     "am": 100.0, "paper_nan_pct": 1.11},
]
"""The PASA paper's Table 4: inputs on which float16-score attention returns
NaN, with the percentage of NaN outputs the paper reports for it (at
``(B, N, S, D) = (1, 16, 1280, 128)``; hybrid cases use ``p = 0.001``)."""


def pasa_case(key, case, shape: Shape, dtype=jnp.float16):
  """``(q, k, v)`` for one :data:`PASA_TABLE4_CASES` entry (a dict, or its
  ``name``), via :func:`pasa_uniform` or :func:`pasa_hybrid`."""
  if isinstance(case, str):
    by_name = {c["name"]: c for c in PASA_TABLE4_CASES}
    if case not in by_name:
      raise ValueError(f"unknown PASA case {case!r}; known: {sorted(by_name)}")
    case = by_name[case]
  dist = case.get("dist")
  if dist == "uniform":
    return pasa_uniform(key, shape, case["x0"], case["am"], dtype)
  if dist == "hybrid":
    return pasa_hybrid(key, shape, case["x0"], case["am"], dtype,
                       p=case.get("p", 0.001))
  raise ValueError(f"case['dist'] must be 'uniform' or 'hybrid', got {dist!r}")

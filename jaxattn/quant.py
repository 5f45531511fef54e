"""Symmetric quantizers shared by the quantized methods.

All quantizers are round-to-nearest-even and symmetric: ``x_q = round(x / s)``
clipped to ``[-qmax, qmax]`` with ``qmax = 2^(bits-1) - 1`` (127 for int8, 7
for int4), ``s = amax / qmax``.  A zero scale (an all-zero group) quantizes to
zeros, never NaN.  float8_e4m3fn quantization uses ``s = amax / 448``.

The division is written as a multiplication by the float32 reciprocal,
``x * fl(1/s)``: XLA compiles ``x / s`` with a broadcast ``s`` that way anyway
(depending on jit/vmap context), and a GPU kernel multiplies by a reciprocal
too; writing it out makes the quantized values the same on every backend, so
kernels can be checked against them bit for bit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

# Shared with the kernels, which compute the same values.
from pallas_kernels.common import FP8_MAX, int4_halves, round_probability


def qmax(bits: int) -> int:
  """Largest symmetric integer level: 127 for 8 bits, 7 for 4 bits."""
  if bits not in (4, 8):
    raise ValueError(f"bits must be 4 or 8, got {bits}")
  return 2 ** (bits - 1) - 1


def group_absmax(x, group: int, axis: int = 0):
  """``max |x|`` over consecutive groups of ``group`` entries along ``axis``
  and over every other axis; shape ``[ceil(n / group)]``.  ``group`` larger
  than the axis gives one group (a per-tensor amax)."""
  x = jnp.moveaxis(jnp.abs(x.astype(jnp.float32)), axis, 0)
  n = x.shape[0]
  group = max(1, min(group, n))
  rows = x.reshape(n, -1).max(axis=1)
  rows = jnp.pad(rows, (0, -n % group))
  return rows.reshape(-1, group).max(axis=1)


def expand_groups(per_group, group: int, n: int):
  """Repeats ``[ceil(n / group)]`` per-group values to ``[n]`` (one per row)."""
  return jnp.repeat(per_group, group, axis=0, total_repeat_length=(
      per_group.shape[0] * group))[:n]


def segment_absmax(x, kv_segments, q_segments):
  """Per packed document: the largest value of ``x`` over the keys of each
  key's segment and of each query row's segment.

  Args:
    x: float ``[S, ...]`` (e.g. ``max |v|`` over channels, per KV head).
    kv_segments: int ``[S]``; q_segments: int ``[T]`` (any ids; a query
      row whose id no key has gets 0).
  Returns:
    ``(per_key [S, ...], per_row [T, ...])``.  Ids need not be sorted or
    contiguous: a segment is an id.
  """
  s = kv_segments.shape[0]
  # padding with the largest id keeps ids sorted for searchsorted
  ids, inverse = jnp.unique(kv_segments, size=s, fill_value=kv_segments.max(),
                            return_inverse=True)
  inverse = inverse.reshape(s)
  amax = jax.ops.segment_max(x, inverse, num_segments=s)
  at = jnp.clip(jnp.searchsorted(ids, q_segments), 0, s - 1)
  found = (ids[at] == q_segments).reshape((-1,) + (1,) * (x.ndim - 1))
  return amax[inverse], jnp.where(found, amax[at], 0.0)


def pack_int4(x):
  """Packs int8 values in ``[-8, 7]`` two per byte along the last axis
  (even index in the low nibble).  The last axis must be even."""
  if x.shape[-1] % 2:
    raise ValueError(f"last axis must be even to pack int4, got {x.shape}")
  u = x.astype(jnp.uint8) & 0xF
  return (u[..., 0::2] | (u[..., 1::2] << 4)).astype(jnp.uint8)


def unpack_int4(packed):
  """Inverse of :func:`pack_int4`: uint8 ``[..., n/2]`` -> int8 ``[..., n]``."""
  p = packed.astype(jnp.uint8)
  lo = (p & 0xF).astype(jnp.int8)
  hi = (p >> 4).astype(jnp.int8)
  lo = jnp.where(lo > 7, lo - 16, lo)
  hi = jnp.where(hi > 7, hi - 16, hi)
  return jnp.stack([lo, hi], axis=-1).reshape(*p.shape[:-1], -1)


def pack_int4_halves(x):
  """Packs int8 values in ``[-8, 7]`` two per byte along the last axis (of
  even length ``n``) in halves: byte ``j`` holds ``x[..., j]`` in its low
  nibble and ``x[..., j + n/2]`` in its high nibble, two's complement;
  int8 ``[..., n/2]``.

  The layout of the int4 Q and K of the Triton kernel: a block of bytes
  unpacks with two shifts into the two halves of the head dim
  (:func:`int4_halves`, no interleaving), and ``Q K^T = Q_lo K_lo^T +
  Q_hi K_hi^T``.  Zero bytes appended to the packed axis append zeros to
  both halves: zero-padding the packed head dim pads each half, and the
  product is unchanged.
  """
  n = x.shape[-1]
  if n % 2:
    raise ValueError(f"last axis must be even to pack int4, got {x.shape}")
  x = x.astype(jnp.int8)
  return (x[..., :n // 2] & 0xF) | (x[..., n // 2:] << 4)


def unpack_int4_halves(packed):
  """Inverse of :func:`pack_int4_halves`: int8 ``[..., n/2]`` -> int8
  ``[..., n]``."""
  return jnp.concatenate(int4_halves(packed.astype(jnp.int8)), axis=-1)


def _fields(x):
  """``(biased exponent, 24-bit integer mantissa)`` of normal float32 ``x``:
  ``|x| = m 2^(e - 150)``."""
  bits = jax.lax.bitcast_convert_type(x, jnp.int32)
  return (bits >> 23) & 0xFF, (bits & 0x7FFFFF) | 0x800000


def _above_next_midpoint(s, u):
  """``1 / s > (u + next(u)) / 2`` for positive normal float32 ``s``, ``u``
  near ``1 / s``, decided exactly in int32 arithmetic: with ``s = ms 2^es``
  and ``u = mu 2^eu`` the midpoint is ``(2 mu + 1) 2^(eu - 1)``, so the test
  is ``ms (2 mu + 1) < 2^(1 - es - eu)``, a 49-bit product compared through
  12-bit limbs."""
  es, ms = _fields(s)
  eu, mu = _fields(u)
  e = 301 - es - eu                      # 1 - (es - 150) - (eu - 150)
  b = 2 * mu + 1
  a1, a0, b1, b0 = ms >> 12, ms & 0xFFF, b >> 12, b & 0xFFF
  mid = a1 * b0 + a0 * b1                # < 2^26
  carry = (((mid & 0xFFF) << 12) + a0 * b0) >> 24
  top = a1 * b1 + (mid >> 12) + carry    # floor(ms * b / 2^24)
  shift = jnp.clip(e - 24, 0, 30)
  return top < (jnp.int32(1) << shift)


def reciprocal(scale):
  """``fl(1 / scale)`` in float32, correctly rounded, with ``1 / 0 := 0``.

  XLA's float32 division on the GPU is not correctly rounded (about 14% of
  ``1 / s`` one ulp off on an H100), which flipped quantized values against
  the Pallas kernels' ``div.rn``; there the quotient is corrected by up to
  two ulps with an exact integer midpoint test (:func:`_above_next_midpoint`;
  a no-op where the division already rounds correctly).  XLA:CPU's division
  is IEEE's, correctly rounded, so a CPU program divides: the same bits
  (``tests/test_prepare.py`` compares both forms), and its quantized programs
  a third fewer operations to compile.  Subnormal or infinite scales keep the
  division's value."""
  scale = jnp.asarray(scale, jnp.float32)
  safe = jnp.where(scale == 0, jnp.ones_like(scale), scale)
  r = jax.lax.platform_dependent(safe, cpu=lambda s: 1.0 / s,
                                 default=_correctly_rounded_reciprocal)
  return jnp.where(scale == 0, jnp.zeros_like(scale), r)


def _correctly_rounded_reciprocal(safe):
  """``fl(1 / safe)`` for nonzero float32 ``safe`` from a division that may
  be up to two ulps off (see :func:`reciprocal`)."""
  r = 1.0 / safe
  mag, rmag = jnp.abs(safe), jnp.abs(r)
  tiny = jnp.finfo(jnp.float32).tiny
  normal = ((mag >= tiny) & jnp.isfinite(mag) & (rmag >= tiny)
            & jnp.isfinite(rmag))
  u = correct_reciprocal(jnp.where(normal, mag, 1.0),
                         jnp.where(normal, rmag, 1.0))
  return jnp.where(normal, jnp.where(safe < 0, -u, u), r)


def correct_reciprocal(s, u):
  """``fl(1 / s)`` from ``u`` within two ulps of it (positive normal
  float32 ``s``, ``u``): two steps of the exact midpoint test."""
  for _ in range(2):
    up = jnp.nextafter(u, jnp.float32(jnp.inf))
    down = jnp.nextafter(u, jnp.float32(0))
    u = jnp.where(_above_next_midpoint(s, u), up,
                  jnp.where(_above_next_midpoint(s, down), u, down))
  return u


def quantize_int(x, inv_scale, bits: int = 8):
  """``clip(round(x * inv_scale), -qmax, qmax)`` as int8, round half to even
  (``inv_scale = reciprocal(scale)`` broadcasts against x; 0 gives zeros)."""
  m = qmax(bits)
  y = jnp.round(x.astype(jnp.float32) * inv_scale.astype(jnp.float32))
  return jnp.clip(y, -m, m).astype(jnp.int8)


def quantize_fp8(x, inv_scale):
  """``fl_e4m3(clip(x * inv_scale, -448, 448))`` (round to nearest even)."""
  y = x.astype(jnp.float32) * inv_scale.astype(jnp.float32)
  return jnp.clip(y, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)


__all__ = ["FP8_MAX", "qmax", "round_probability", "reciprocal",
           "quantize_int", "quantize_fp8", "group_absmax", "expand_groups",
           "pack_int4", "unpack_int4", "pack_int4_halves", "int4_halves",
           "unpack_int4_halves"]

"""Decode against a quantized KV cache: the cache type, quantize-on-append,
the references and :func:`decode_attention`.

::

  cache = jaxattn.KVCache.create(batch=8, capacity=32768, kv_heads=8,
                                 head_dim=128, method="int8")
  append = jax.jit(jaxattn.decode.append, donate_argnums=0)   # in place
  cache = append(cache, k_prompt, v_prompt, jnp.zeros(8, jnp.int32),
                 prompt_lengths)                  # prefill: [B, P, K, D]
  lengths = prompt_lengths
  # each step: append the new tokens first, then attend with lengths that
  # include them
  cache = append(cache, k_new, v_new, lengths)    # [B, T, K, D], T <= 16
  lengths = lengths + T
  out = jaxattn.decode_attention(q_new, cache, lengths, method="int8")

**Contract.**  The ``T`` new tokens (1 to 16: one step, or the draft of
speculative decoding) are appended to the cache *before* the call, and
``lengths`` (int ``[B]``, per batch row) counts them: they are keys
``lengths - T .. lengths - 1`` of their row.  New token ``t`` sees keys
``0 .. lengths - T + t`` (causal among the new tokens, aligned bottom
right).  Keys at or beyond a row's length are never read into the output,
whatever the slots hold (NaN included).  A row with ``lengths < T`` has
tokens that see no key; they return 0.

**Cache formats.**  Keys and values are stored head-major, ``[B, K, S, D]``
(``S`` the capacity), each in one of int8, float8_e4m3fn, float16 or
bfloat16.  An 8-bit array comes with one float32 scale per token and head
(``[B, K, S]``: ``amax / 127`` or ``amax / 448`` of the token's ``D``
values), written once with the token.  ``k_mean`` (``[B, K, D]`` float32,
``smooth_k=True``) is the key shift of SageAttention's smoothing: the
mean of the keys of the first append to an empty row (the prompt), kept
for the life of the row and subtracted from every key before it is
stored.  Subtracting one vector from every key of a row adds the same
number to every score of a query, so the softmax is unchanged exactly; it
removes the per-channel key bias of real models, which would otherwise set
every token's scale.  The mean is frozen rather than running: a mean that
moved would leave the tokens stored earlier shifted by a different vector.

=========  ==========================================  =====================
method     cache (:data:`METHOD_CACHES`, default first)  kernel arithmetic
=========  ==========================================  =====================
"fp32"     bfloat16 or float16 K and V                 dots in the cache
                                                       dtype, float32 softmax
"pasa"     float16 K (shifted by k_mean) and V         float16 scores
"int8"     int8 K (smoothed) and int8 V                dots in float16
"fp8"      e4m3 K (smoothed) and e4m3 V                dots in float16
"sage"     int8 K (smoothed) and e4m3 V                dots in float16
=========  ==========================================  =====================

``"fp16_fp32"``, ``"fp16"`` and ``"fmha_int8"`` have no decode path
(NotImplementedError says why).  The query is not quantized: decode is
memory-bound, the query is a few rows, and an 8-bit query would only add
error.  Values stored in 8 bits are exact in float16, so the kernel converts
them in registers and applies the key scale to the score columns; values are
dequantized to float16 before the PV dot (a per-token scale cannot be taken
out of a sum over tokens).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import api, base, int_flash, quant
from pallas_kernels import common
from pallas_kernels import decode as kernel
from pallas_kernels.common import FP8_MAX, LOG2E

FP8 = jnp.float8_e4m3fn
STORAGE_DTYPES = ("int8", "float8_e4m3fn", "float16", "bfloat16")
MAX_NEW_TOKENS = kernel.MAX_NEW_TOKENS
IMPLEMENTATIONS = (None, "triton", "reference")

# method -> the cache formats it reads, (k_dtype, v_dtype, smooth_k), the
# default first; smooth_k None: either.
METHOD_CACHES: dict[str, tuple[tuple[str, str, bool | None], ...]] = {
    "fp32": (("bfloat16", "bfloat16", None), ("float16", "float16", None)),
    "pasa": (("float16", "float16", True),),
    "int8": (("int8", "int8", None),),
    "fp8": (("float8_e4m3fn", "float8_e4m3fn", None),),
    "sage": (("int8", "float8_e4m3fn", True),),
}
NO_DECODE = {
    "fp16_fp32": "its float16 score matrix is a prefill baseline of the PASA "
                 "paper; decode with method='pasa' (float16 scores without "
                 "overflow) or 'fp32'",
    "fp16": "fully float16 attention is a prefill baseline; decode with "
            "method='pasa' or 'fp32'",
    "fmha_int8": "its static per-tensor scales and uint8 P belong to a "
                 "prefill FMHA; decode with method='int8' (an int8 cache)",
}


def _dtype_name(dtype) -> str:
  return jnp.dtype(dtype).name


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """A key/value cache, quantized once per token when appended.

  A frozen pytree dataclass: it passes through ``jax.jit`` and ``append``
  returns a new one (in place when the old one is donated).

  Attributes:
    k, v: ``[B, K, S, D]`` int8, float8_e4m3fn, float16 or bfloat16 (head
      major; ``S`` is the capacity).
    k_scale, v_scale: float32 ``[B, K, S]`` per-token scales of an 8-bit
      ``k`` / ``v`` (value ``x * scale``), else None.
    k_mean: float32 ``[B, K, D]``, the key shift (``smooth_k``), else None:
      stored keys are ``k - k_mean``.
  """
  k: jax.Array
  v: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  k_mean: jax.Array | None = None

  @classmethod
  def create(cls, batch: int, capacity: int, kv_heads: int, head_dim: int,
             *, method: str = "fp32", k_dtype=None, v_dtype=None,
             smooth_k: bool | None = None) -> "KVCache":
    """An empty cache for ``method`` (its default format,
    :data:`METHOD_CACHES`), or the format given by ``k_dtype``, ``v_dtype``
    and ``smooth_k`` (default: on for 8-bit keys and PASA).  A capacity
    that is a multiple of 64 lets the kernel read the cache without a
    padding copy."""
    if method in NO_DECODE:
      raise NotImplementedError(f"method {method!r} has no decode: "
                                f"{NO_DECODE[method]}")
    if method not in METHOD_CACHES:
      raise ValueError(f"unknown decode method {method!r}; available: "
                       f"{sorted(METHOD_CACHES)}")
    dk, dv, sm = METHOD_CACHES[method][0]
    dk = _dtype_name(k_dtype) if k_dtype is not None else dk
    dv = _dtype_name(v_dtype) if v_dtype is not None else dv
    for name, d in (("k_dtype", dk), ("v_dtype", dv)):
      if d not in STORAGE_DTYPES:
        raise ValueError(f"{name} must be one of {STORAGE_DTYPES}, got {d!r}")
    if smooth_k is None:
      smooth_k = sm if sm is not None else dk in ("int8", "float8_e4m3fn")
    for name, n in (("batch", batch), ("capacity", capacity),
                    ("kv_heads", kv_heads), ("head_dim", head_dim)):
      if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    shape = (batch, kv_heads, capacity, head_dim)
    scaled = lambda d: (jnp.zeros(shape[:3], jnp.float32)
                        if d in ("int8", "float8_e4m3fn") else None)
    cache = cls(k=jnp.zeros(shape, dk), v=jnp.zeros(shape, dv),
                k_scale=scaled(dk), v_scale=scaled(dv),
                k_mean=(jnp.zeros((batch, kv_heads, head_dim), jnp.float32)
                        if smooth_k else None))
    check_cache(method, cache)
    return cache

  @property
  def batch(self) -> int:
    return self.k.shape[0]

  @property
  def kv_heads(self) -> int:
    return self.k.shape[1]

  @property
  def capacity(self) -> int:
    return self.k.shape[2]

  @property
  def head_dim(self) -> int:
    return self.k.shape[3]

  @property
  def smooth_k(self) -> bool:
    return self.k_mean is not None

  @property
  def format(self) -> tuple[str, str, bool]:
    """``(k_dtype, v_dtype, smooth_k)``."""
    return (_dtype_name(self.k.dtype), _dtype_name(self.v.dtype),
            self.smooth_k)

  def bytes_per_token(self) -> int:
    """Bytes one token occupies over all KV heads (values and scales): what
    attention reads per key."""
    n = self.kv_heads * self.head_dim
    total = n * (self.k.dtype.itemsize + self.v.dtype.itemsize)
    return total + 4 * self.kv_heads * ((self.k_scale is not None)
                                        + (self.v_scale is not None))

  def append(self, k_new, v_new, lengths, counts=None) -> "KVCache":
    """:func:`append`."""
    return append(self, k_new, v_new, lengths, counts)

  def dequantize(self):
    """float32 ``(k, v)`` ``[B, S, K, D]`` as stored (the key shift added
    back): what the cache holds, for checks."""
    k = self.k.astype(jnp.float32)
    v = self.v.astype(jnp.float32)
    if self.k_scale is not None:
      k = k * self.k_scale[..., None]
    if self.v_scale is not None:
      v = v * self.v_scale[..., None]
    if self.k_mean is not None:
      k = k + self.k_mean[:, :, None, :]
    return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def check_cache(method: str, cache: KVCache) -> None:
  """ValueError when ``cache``'s format is not one ``method`` reads."""
  if not isinstance(cache, KVCache):
    raise TypeError(f"cache must be a jaxattn.KVCache, got "
                    f"{type(cache).__name__}")
  dk, dv, sm = cache.format
  for k_dtype, v_dtype, smooth in METHOD_CACHES[method]:
    if (dk, dv) == (k_dtype, v_dtype) and smooth in (None, sm):
      break
  else:
    wanted = ", ".join(
        f"{a} K / {b} V" + ("" if s is None else
                            (" with smooth_k" if s else " without smooth_k"))
        for a, b, s in METHOD_CACHES[method])
    raise ValueError(
        f"method {method!r} reads a cache of {wanted}; this cache holds "
        f"{dk} K / {dv} V{' with' if sm else ' without'} smooth_k: create it "
        f"with KVCache.create(..., method={method!r})")
  for name, x, d in (("k", cache.k_scale, dk), ("v", cache.v_scale, dv)):
    if (x is not None) != (d in ("int8", "float8_e4m3fn")):
      raise ValueError(f"an {d} {name} needs {name}_scale exactly when it "
                       "is 8-bit")


def _quantize_tokens(x, dtype):
  """float32 ``[..., D]`` -> ``(values, scale [...] or None)``: per token
  ``scale = amax * fl(1/qmax)``, ``x * fl(1/scale)`` rounded (int8: to
  nearest even, clipped to 127; e4m3: clipped to 448), the quantizers of
  :mod:`jaxattn.quant`; float caches round to their dtype."""
  dtype = jnp.dtype(dtype)
  if dtype == jnp.int8:   # INT-FlashAttention's per-token quantizer
    return int_flash.quantize_per_token(x)
  if dtype == FP8:
    scale = jnp.abs(x).max(-1) * np.float32(1.0 / FP8_MAX)
    return quant.quantize_fp8(x, quant.reciprocal(scale)[..., None]), scale
  return x.astype(dtype), None


def _concrete_ints(x):
  return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def append(cache: KVCache, k_new, v_new, lengths, counts=None) -> KVCache:
  """Writes new tokens into the cache, quantized once.

  Args:
    cache: the :class:`KVCache`.
    k_new, v_new: ``[B, T, K, D]`` float (any ``T``: a prompt or new
      tokens).
    lengths: int ``[B]``: tokens already in each row; token ``t`` goes to
      slot ``lengths + t``.
    counts: int ``[B]`` (default ``T``): how many of the ``T`` tokens each
      row takes (a batch of prompts of different lengths); the others are
      not written.
  Returns:
    the new cache (under ``jax.jit(append, donate_argnums=0)`` the update
    is in place).  A row that was empty (``lengths == 0``) and takes a
    token sets its key shift (``smooth_k``) to the mean of the keys it
    takes.  Writes past the capacity are dropped (ValueError where
    ``lengths``/``counts`` are concrete).
  """
  b, nk, s_cap = cache.batch, cache.kv_heads, cache.capacity
  k_new, v_new = jnp.asarray(k_new), jnp.asarray(v_new)
  want = (b, k_new.shape[1] if k_new.ndim == 4 else -1, nk, cache.head_dim)
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if x.ndim != 4 or x.shape != want:
      raise ValueError(f"{name} must be [batch, T, kv_heads, head_dim] = "
                       f"{want}, got {x.shape}")
  t = k_new.shape[1]
  lengths = jnp.asarray(lengths)
  counts = jnp.full((b,), t, jnp.int32) if counts is None else jnp.asarray(
      counts)
  for name, x in (("lengths", lengths), ("counts", counts)):
    if x.shape != (b,) or not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must be an integer array of shape ({b},), "
                       f"got {x.dtype}{x.shape}")
  cl, cc = _concrete_ints(lengths), _concrete_ints(counts)
  if cl is not None and cc is not None:
    if cl.min() < 0 or cc.min() < 0 or cc.max() > t:
      raise ValueError(f"lengths must be >= 0 and counts in [0, {t}]")
    if (cl + cc).max() > s_cap:
      raise ValueError(f"appending {cc.tolist()} tokens at lengths "
                       f"{cl.tolist()} goes past the cache capacity {s_cap}")
  lengths, counts = lengths.astype(jnp.int32), counts.astype(jnp.int32)
  tok = jnp.arange(t, dtype=jnp.int32)[None, :]
  valid = tok < counts[:, None]                                 # [B, T]
  pos = jnp.where(valid, lengths[:, None] + tok, s_cap)         # dropped
  k = k_new.astype(jnp.float32)
  k_mean = cache.k_mean
  if k_mean is not None:
    w = valid[:, :, None, None].astype(jnp.float32)
    n = jnp.maximum(counts, 1).astype(jnp.float32)[:, None, None]
    first = (w * k).sum(1) * quant.reciprocal(n)                # [B, K, D]
    fresh = ((lengths == 0) & (counts > 0))[:, None, None]
    k_mean = jax.lax.optimization_barrier(jnp.where(fresh, first, k_mean))
    k = k - k_mean[:, None]
  k = jnp.where(valid[:, :, None, None], k, 0.0)
  v = jnp.where(valid[:, :, None, None], v_new.astype(jnp.float32), 0.0)
  k8, ks = _quantize_tokens(k, cache.k.dtype)
  v8, vs = _quantize_tokens(v, cache.v.dtype)
  bi = jnp.arange(b)[:, None]

  def put(dst, x):  # dst [B, K, S, ...] at slots pos, x [B, T, K, ...]
    return dst.at[bi, :, pos].set(x.astype(dst.dtype), mode="drop")

  return KVCache(k=put(cache.k, k8), v=put(cache.v, v8),
                 k_scale=None if ks is None else put(cache.k_scale, ks),
                 v_scale=None if vs is None else put(cache.v_scale, vs),
                 k_mean=k_mean)


@dataclasses.dataclass(frozen=True)
class DecodeConfig(base.MethodConfig):
  """Options of :func:`decode_attention` (the Triton kernel's knobs; the
  reference ignores them).

  Attributes:
    block_k: keys per block (a power of two, >= 16; halved until it divides
      the capacity).
    num_splits: splits per (row, KV head); None: enough to fill the GPU
      (:func:`pallas_kernels.decode.choose_splits`).
    num_warps, num_stages: Triton knobs.
  """
  block_k: int | None = None
  num_splits: int | None = None
  num_warps: int | None = None
  num_stages: int | None = None

  def __post_init__(self):
    base.check_kernel_knobs(self)
    for name in ("num_splits",):
      x = getattr(self, name)
      if x is not None and (not isinstance(x, int) or x < 1):
        raise ValueError(f"{name} must be a positive int, got {x!r}")
    if self.block_k is not None and self.block_k < 16:
      raise ValueError(f"block_k must be >= 16, got {self.block_k}")


def compute_dtype(method: str, cache: KVCache):
  """The dtype of both dots' operands: the cache's for "fp32", float16
  otherwise."""
  if method == "fp32":
    return jnp.dtype(cache.k.dtype)
  return jnp.dtype(jnp.float16)


def reference(q, cache: KVCache, lengths, *, method: str,
              scale: float | None = None):
  """The method's decode arithmetic without blocking: the query rounded to
  the compute dtype (PASA: ``fl16(q * scale)``), scores ``(q_c K_c^T)_f32
  * k_scale * c`` in base 2 (PASA: rounded to float16 first), the masks of
  :func:`decode_attention`, a float32 softmax, ``P`` and the dequantized V
  rounded to the compute dtype, float32 accumulation.  Returns float32
  ``[B, T, N, D]``."""
  b, t, n, d = q.shape
  nk, s_cap = cache.kv_heads, cache.capacity
  g = n // nk
  f32 = jnp.float32
  cdt = compute_dtype(method, cache)
  scale = base.default_scale(d) if scale is None else float(scale)
  pasa = method == "pasa"
  if pasa:
    qc = (q.astype(f32) * scale).astype(jnp.float16)
    factor = f32(LOG2E)
  else:
    qc = q.astype(cdt)
    factor = f32(scale * LOG2E)
  qc = qc.reshape(b, t, nk, g, d)
  s = jnp.einsum("btkgd,bksd->bkgts", qc, cache.k.astype(cdt),
                 preferred_element_type=f32,
                 precision=jax.lax.Precision.HIGHEST)
  if pasa:
    s = s.astype(jnp.float16).astype(f32)
  if cache.k_scale is None:
    s = s * factor
  else:
    s = s * (cache.k_scale * factor)[:, :, None, None, :]
  lengths = jnp.clip(jnp.asarray(lengths, jnp.int32), 0, s_cap)
  cols = jnp.arange(s_cap)[None, :]
  limit = (lengths[:, None, None] - t
           + jnp.arange(t)[None, :, None])                     # [B, T, 1]
  vis = (cols <= limit) & (cols < lengths[:, None, None])       # [B, T, S]
  s = jnp.where(vis[:, None, None], s, -jnp.inf)
  m = s.max(-1, keepdims=True)
  p = jnp.exp2(s - jnp.where(m == -jnp.inf, 0.0, m))
  l = p.sum(-1)
  v = cache.v.astype(f32)
  if cache.v_scale is not None:
    v = v * cache.v_scale[..., None]
  v = jnp.where((cols < lengths[:, None])[:, None, :, None], v, 0.0)
  o = jnp.einsum("bkgts,bksd->bkgtd", p.astype(cdt), v.astype(cdt),
                 preferred_element_type=f32,
                 precision=jax.lax.Precision.HIGHEST)
  o = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None],
                0.0)
  return o.transpose(0, 3, 1, 2, 4).reshape(b, t, n, d)


def float_reference(q, k, v, lengths, *, scale: float | None = None):
  """Float32 attention of the new tokens ``q [B, T, N, D]`` against the
  float keys and values ``[B, S, K, D]`` (the new tokens among them) under
  the decode contract: the ground truth the methods approximate."""
  f32 = jnp.float32
  return api.dot_product_attention(
      q.astype(f32), k.astype(f32), v.astype(f32), scale=scale,
      is_causal=True, causal_alignment="bottom_right",
      key_value_seq_lengths=lengths, implementation="reference")


def _check_call(q, cache, lengths, method, implementation):
  """The checked lengths (int32 ``[B]``); a clear error for anything the
  decode path cannot take."""
  if method in NO_DECODE:
    raise NotImplementedError(f"method {method!r} has no decode: "
                              f"{NO_DECODE[method]}")
  if method not in METHOD_CACHES:
    raise ValueError(f"unknown decode method {method!r}; available: "
                     f"{sorted(METHOD_CACHES)}")
  if implementation not in IMPLEMENTATIONS:
    if implementation in ("mosaic", "pallas"):
      raise NotImplementedError(
          f"decode has no {implementation!r} kernel; use "
          "implementation='triton' (any GPU) or 'reference'")
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, "
                     f"got {implementation!r}")
  check_cache(method, cache)
  if not hasattr(q, "shape") or q.ndim != 4:
    raise ValueError(f"q must be [batch, T, heads, head_dim], got "
                     f"{getattr(q, 'shape', type(q).__name__)}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise TypeError(f"q must be floating, got {q.dtype}")
  b, t, n, d = q.shape
  if not 1 <= t <= MAX_NEW_TOKENS:
    raise ValueError(f"decode takes 1 to {MAX_NEW_TOKENS} new query tokens "
                     f"per call, got {t}; run a longer prompt through "
                     "jaxattn.dot_product_attention (prefill)")
  if b != cache.batch or d != cache.head_dim:
    raise ValueError(f"q {q.shape} does not match the cache (batch "
                     f"{cache.batch}, head_dim {cache.head_dim})")
  if n % cache.kv_heads:
    raise ValueError(f"query heads ({n}) must be a multiple of the cache's "
                     f"KV heads ({cache.kv_heads})")
  lengths = jnp.asarray(lengths)
  if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths must be an integer array of shape ({b},), got "
                     f"{lengths.dtype}{lengths.shape}")
  cl = _concrete_ints(lengths)
  if cl is not None and (cl.min() < 0 or cl.max() > cache.capacity):
    raise ValueError(f"lengths must lie in [0, {cache.capacity}] (the cache "
                     f"capacity), got values in [{cl.min()}, {cl.max()}]")
  return lengths.astype(jnp.int32)


def decode_attention(q, cache: KVCache, lengths, *, method: str = "fp32",
                     scale: float | None = None,
                     implementation: str | None = None, **options: Any):
  """Attention of 1 to 16 new query tokens against a :class:`KVCache`.

  Args:
    q: ``[B, T, N, D]`` float, ``T <= 16``; ``N`` a multiple of the cache's
      KV heads (grouped-query attention).
    cache: a :class:`KVCache` in a format ``method`` reads
      (:data:`METHOD_CACHES`; ``KVCache.create(..., method=method)``), the
      ``T`` new tokens already appended (:func:`append`).
    lengths: int ``[B]``: each row's keys, the new tokens included.  New
      token ``t`` sees keys ``0 .. lengths - T + t``.
    method: "fp32", "pasa", "int8", "fp8" or "sage".
    scale: softmax scale, default ``1 / sqrt(D)``; finite (ValueError
      otherwise).
    implementation: None (the Triton kernel on a GPU, else the reference),
      "triton" (interpret mode without a GPU) or "reference".
    **options: :class:`DecodeConfig` (``block_k``, ``num_splits``,
      ``num_warps``, ``num_stages``).
  Returns:
    ``[B, T, N, D]`` in the query dtype.

  Concrete ``lengths`` are checked against the capacity (one host sync);
  in a generation loop call it under ``jax.jit``, where lengths past the
  capacity are clipped.
  """
  config = DecodeConfig.from_options(**options)
  lengths = _check_call(q, cache, lengths, method, implementation)
  scale = base.softmax_scale(scale, q.shape[-1])
  if implementation is None:
    implementation = "triton" if common.has_gpu() else "reference"
  return _decode(q, cache, lengths, method=method, scale=scale,
                 implementation=implementation, config=config)


@functools.partial(jax.jit, static_argnames=("method", "scale",
                                             "implementation", "config"))
def _decode(q, cache, lengths, *, method, scale, implementation, config):
  if implementation == "reference":
    return reference(q, cache, lengths, method=method,
                     scale=scale).astype(q.dtype)
  # (the kernel's wrapper computes its indices in 32 bits: traced with x64
  # off, as the API's kernels are)
  with jax.enable_x64(False):
    return kernel.decode_attention(
        q, cache.k, cache.v, lengths, cache.k_scale, cache.v_scale,
        scale=scale, compute_dtype=compute_dtype(method, cache),
        f16_scores=method == "pasa", block_k=config.block_k,
        num_splits=config.num_splits, num_warps=config.num_warps,
        num_stages=config.num_stages, out_dtype=q.dtype)


__all__ = ["KVCache", "append", "decode_attention", "reference",
           "float_reference", "check_cache", "DecodeConfig", "METHOD_CACHES"]

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
"int8"     int8 K (smoothed) and int8 V                int8 QK (the query
                                                       per row, D >= 32),
                                                       float16 PV
"fp8"      e4m3 K (smoothed) and e4m3 V                dots in float16
"sage"     int8 K (smoothed) and e4m3 V                dots in float16
=========  ==========================================  =====================

**Paged cache** (continuous batching): :class:`PagedKVCache` keeps K and V
in a pool of fixed-size pages, ``[K, P, page_size, D]`` as jax Pallas's
``paged_attention``, with the same formats, scales and per-sequence key
shift; the caller owns the page tables and lengths::

  cache = jaxattn.decode.PagedKVCache.create(
      num_pages=4096, page_size=16, kv_heads=8, head_dim=128, num_seqs=64,
      method="int8")
  append = jax.jit(jaxattn.decode.append_paged, donate_argnums=0)
  cache = append(cache, k_new, v_new, lengths, page_indices,
                 seq_ids=slots)                   # any subset of sequences
  out = jaxattn.decode_attention(q_new, cache, lengths + T,
                                 page_indices=page_indices, method="int8")

A paged cache stores the bits a dense one stores (the same quantizer) and
attends with the same arithmetic (:func:`paged_to_dense` gathers it).

``"fp16_fp32"``, ``"fp16"`` and ``"fmha_int8"`` have no decode path
(NotImplementedError says why).  ``"int8"`` quantizes the query per row
as its prefill does (INT-FlashAttention's ``S_Q``; head dims of 32 or
more), so QK is an int8 dot on the stored keys: 6-12% faster than
converting K (H200, B=8 and 32, 32k keys, dense and paged), at cosine
0.99998 to the float16 query's output.
Elsewhere the query stays in the compute dtype.  Other 8-bit values are
exact in float16, so the kernel converts them in registers (K for the
other methods' QK, V for every PV dot); the key scale multiplies the score
columns, and V's its P columns (a per-token scale cannot be taken out of
a sum over tokens).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import api, base, int_flash, quant
from pallas_kernels import common, paged
from pallas_kernels.common import FP8_MAX, LOG2E

FP8 = jnp.float8_e4m3fn
STORAGE_DTYPES = ("int8", "float8_e4m3fn", "float16", "bfloat16")
# New tokens per decode step (1, or a speculative draft), and per call at
# most: a prompt chunk of up to MAX_CHUNK_TOKENS attends to the cache the
# same way (chunked prefill).
MAX_NEW_TOKENS = 16
MAX_CHUNK_TOKENS = 2048
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
# methods whose query is quantized per row to int8 (their prefill's
# quantizer) for an int8 QK dot, at head dims of at least
# INT8_QUERY_MIN_DIM: Triton's 8-bit dots need 32 channels, and the int8
# query's float16 dot below that was 1.16 off the reference on the H200
# (D=16), so smaller heads keep the float query.
INT8_QUERY = ("int8",)
INT8_QUERY_MIN_DIM = paged.INT8_Q_MIN_DIM
NO_DECODE = {
    "fp16_fp32": "its float16 score matrix is a prefill baseline of the PASA "
                 "paper; decode with method='pasa' (float16 scores without "
                 "overflow) or 'fp32'",
    "fp16": "fully float16 attention is a prefill baseline; decode with "
            "method='pasa' or 'fp32'",
    "fmha_int8": "its static per-tensor scales and uint8 P belong to a "
                 "prefill FMHA; decode with method='int8' (an int8 cache)",
}


def _int8_query(method: str, head_dim: int) -> bool:
  """Whether ``method``'s decode quantizes a query of ``head_dim``
  channels to int8 (:data:`INT8_QUERY`)."""
  return method in INT8_QUERY and head_dim >= INT8_QUERY_MIN_DIM


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
    dk, dv, smooth_k = _cache_format(method, k_dtype, v_dtype, smooth_k)
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


def check_cache(method: str, cache: "KVCache | PagedKVCache") -> None:
  """ValueError when ``cache``'s format is not one ``method`` reads."""
  if not isinstance(cache, (KVCache, PagedKVCache)):
    raise TypeError(f"cache must be a jaxattn.KVCache or "
                    f"jaxattn.decode.PagedKVCache, got "
                    f"{type(cache).__name__}")
  if isinstance(cache, PagedKVCache):
    _check_paged_layout(cache)
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
        f"with {type(cache).__name__}.create(..., method={method!r})")
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


def _check_new_tokens(k_new, v_new, b, nk, d, lengths, counts):
  """The checked ``(k_new, v_new, lengths, counts)`` of an append (int32
  lengths and counts) and their concrete values (or None)."""
  k_new, v_new = jnp.asarray(k_new), jnp.asarray(v_new)
  want = (b, k_new.shape[1] if k_new.ndim == 4 else -1, nk, d)
  for name, x in (("k_new", k_new), ("v_new", v_new)):
    if x.ndim != 4 or x.shape != want:
      raise ValueError(f"{name} must be [batch, T, kv_heads, head_dim] = "
                       f"{want}, got {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be floating, got {x.dtype}")
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
  return (k_new, v_new, lengths.astype(jnp.int32), counts.astype(jnp.int32),
          cl, cc)


def _quantize_new(k_new, v_new, lengths, counts, k_mean, k_dtype, v_dtype):
  """The arithmetic of an append, shared by the dense and the paged cache
  (so that both store the same bits): ``(valid [B, T], k8, k_scale, v8,
  v_scale, k_mean, fresh [B])``, the values ``[B, T, K, D]`` and scales
  ``[B, T, K]`` (None unless 8-bit) of the tokens each row takes (the
  others zero), ``k_mean`` ``[B, K, D]`` the rows' key shift after the
  append (None without smooth_k) and ``fresh`` the rows that set it."""
  t = k_new.shape[1]
  tok = jnp.arange(t, dtype=jnp.int32)[None, :]
  valid = tok < counts[:, None]                                 # [B, T]
  fresh = (lengths == 0) & (counts > 0)
  k = k_new.astype(jnp.float32)
  if k_mean is not None:
    w = valid[:, :, None, None].astype(jnp.float32)
    n = jnp.maximum(counts, 1).astype(jnp.float32)[:, None, None]
    first = (w * k).sum(1) * quant.reciprocal(n)                # [B, K, D]
    k_mean = jax.lax.optimization_barrier(
        jnp.where(fresh[:, None, None], first, k_mean))
    k = k - k_mean[:, None]
  k = jnp.where(valid[:, :, None, None], k, 0.0)
  v = jnp.where(valid[:, :, None, None], v_new.astype(jnp.float32), 0.0)
  k8, ks = _quantize_tokens(k, k_dtype)
  v8, vs = _quantize_tokens(v, v_dtype)
  return valid, k8, ks, v8, vs, k_mean, fresh


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
  k_new, v_new, lengths, counts, cl, cc = _check_new_tokens(
      k_new, v_new, b, nk, cache.head_dim, lengths, counts)
  if cl is not None and cc is not None and (cl + cc).max() > s_cap:
    raise ValueError(f"appending {cc.tolist()} tokens at lengths "
                     f"{cl.tolist()} goes past the cache capacity {s_cap}")
  valid, k8, ks, v8, vs, k_mean, _ = _quantize_new(
      k_new, v_new, lengths, counts, cache.k_mean, cache.k.dtype,
      cache.v.dtype)
  tok = jnp.arange(k_new.shape[1], dtype=jnp.int32)[None, :]
  pos = jnp.where(valid, lengths[:, None] + tok, s_cap)         # dropped
  bi = jnp.arange(b)[:, None]

  def put(dst, x):  # dst [B, K, S, ...] at slots pos, x [B, T, K, ...]
    return dst.at[bi, :, pos].set(x.astype(dst.dtype), mode="drop")

  return KVCache(k=put(cache.k, k8), v=put(cache.v, v8),
                 k_scale=None if ks is None else put(cache.k_scale, ks),
                 v_scale=None if vs is None else put(cache.v_scale, vs),
                 k_mean=k_mean)


# ----------------------------------------------------------------------------
# The paged cache (continuous batching).


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """A pool of fixed-size pages of quantized keys and values shared by many
  sequences, in the layout of jax Pallas's ``paged_attention``.

  The caller owns the page table (``page_indices`` int32 ``[B,
  pages_per_seq]``: row ``b``'s ``i``-th page holds its tokens ``i *
  page_size .. (i + 1) * page_size - 1``) and the ``lengths`` (int32
  ``[B]``); the cache holds only the pool.  Contract: a page belongs to at
  most one sequence at a time; entries past a sequence's last used page
  may hold anything (e.g. 0) and are never read past ``lengths``; a page
  freed and given to another sequence need not be cleared (nothing past a
  length is read, and a fresh sequence's first append sets its key shift).
  Page indices are checked against the pool where they are concrete; under
  ``jax.jit`` an index outside ``[0, num_pages)`` is clipped when read and
  its writes are dropped.

  Attributes:
    k_pages, v_pages: ``[K, P, page_size, D]`` int8, float8_e4m3fn,
      float16 or bfloat16 (``K`` KV heads, ``P`` pages in the pool).
    k_scale, v_scale: float32 ``[K, P, page_size]`` per-token scales of an
      8-bit ``k_pages`` / ``v_pages``, else None.
    k_mean: float32 ``[num_seqs, K, D]`` (``smooth_k``): one key shift per
      sequence slot, set by the first append to the slot while it is empty
      (``lengths == 0``) and frozen after, as :class:`KVCache`'s per row;
      else None.
  """
  k_pages: jax.Array
  v_pages: jax.Array
  k_scale: jax.Array | None = None
  v_scale: jax.Array | None = None
  k_mean: jax.Array | None = None

  @classmethod
  def create(cls, num_pages: int, page_size: int, kv_heads: int,
             head_dim: int, *, num_seqs: int, method: str = "fp32",
             k_dtype=None, v_dtype=None,
             smooth_k: bool | None = None) -> "PagedKVCache":
    """An empty pool of ``num_pages`` pages of ``page_size`` tokens for up
    to ``num_seqs`` sequence slots (rows of ``k_mean``), in ``method``'s
    default format or the one given, as :meth:`KVCache.create`.

    ``page_size`` is a power of two >= 16: the decode kernel reads a page
    as one key tile, and Pallas/Triton tiles have power-of-two dimensions,
    at least 16 for a tensor-core dot."""
    dk, dv, smooth_k = _cache_format(method, k_dtype, v_dtype, smooth_k)
    for name, n in (("num_pages", num_pages), ("page_size", page_size),
                    ("kv_heads", kv_heads), ("head_dim", head_dim),
                    ("num_seqs", num_seqs)):
      if not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{name} must be a positive int, got {n!r}")
    shape = (kv_heads, num_pages, page_size, head_dim)
    scaled = lambda d: (jnp.zeros(shape[:3], jnp.float32)
                        if d in ("int8", "float8_e4m3fn") else None)
    cache = cls(k_pages=jnp.zeros(shape, dk), v_pages=jnp.zeros(shape, dv),
                k_scale=scaled(dk), v_scale=scaled(dv),
                k_mean=(jnp.zeros((num_seqs, kv_heads, head_dim),
                                  jnp.float32) if smooth_k else None))
    check_cache(method, cache)
    return cache

  @property
  def kv_heads(self) -> int:
    return self.k_pages.shape[0]

  @property
  def num_pages(self) -> int:
    return self.k_pages.shape[1]

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[2]

  @property
  def head_dim(self) -> int:
    return self.k_pages.shape[3]

  @property
  def num_seqs(self) -> int | None:
    """Sequence slots (rows of ``k_mean``); None without smooth_k (any
    number)."""
    return None if self.k_mean is None else self.k_mean.shape[0]

  @property
  def smooth_k(self) -> bool:
    return self.k_mean is not None

  @property
  def format(self) -> tuple[str, str, bool]:
    """``(k_dtype, v_dtype, smooth_k)``."""
    return (_dtype_name(self.k_pages.dtype), _dtype_name(self.v_pages.dtype),
            self.smooth_k)

  def bytes_per_token(self) -> int:
    """Bytes one token occupies over all KV heads (values and scales)."""
    n = self.kv_heads * self.head_dim
    total = n * (self.k_pages.dtype.itemsize + self.v_pages.dtype.itemsize)
    return total + 4 * self.kv_heads * ((self.k_scale is not None)
                                        + (self.v_scale is not None))

  def append(self, k_new, v_new, lengths, page_indices, *, seq_ids=None,
             counts=None) -> "PagedKVCache":
    """:func:`append_paged`."""
    return append_paged(self, k_new, v_new, lengths, page_indices,
                        seq_ids=seq_ids, counts=counts)

  def to_dense(self, page_indices, lengths, *, seq_ids=None) -> KVCache:
    """:func:`paged_to_dense`."""
    return paged_to_dense(self, page_indices, lengths, seq_ids=seq_ids)


def _cache_format(method, k_dtype, v_dtype, smooth_k):
  """``(k_dtype, v_dtype, smooth_k)`` names of the cache ``create`` makes:
  the method's default format, overridden by the arguments given."""
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
  return dk, dv, bool(smooth_k)


def _check_paged_layout(cache: PagedKVCache) -> None:
  """ValueError unless the pool's arrays agree with one another."""
  if not isinstance(cache, PagedKVCache):
    raise TypeError(f"cache must be a jaxattn.decode.PagedKVCache, got "
                    f"{type(cache).__name__}")
  shape = cache.k_pages.shape
  if len(shape) != 4:
    raise ValueError(f"k_pages must be [kv_heads, num_pages, page_size, "
                     f"head_dim], got {shape}")
  if cache.v_pages.shape != shape:
    raise ValueError(f"v_pages {cache.v_pages.shape} must have k_pages's "
                     f"shape {shape}")
  ps = shape[2]
  if ps < 16 or ps & (ps - 1):
    raise ValueError(f"page_size must be a power of two >= 16 (the kernel "
                     f"reads a page as one tile), got {ps}")
  for name in ("k_scale", "v_scale"):
    x = getattr(cache, name)
    if x is not None and (x.shape != shape[:3] or x.dtype != jnp.float32):
      raise ValueError(f"{name} must be float32 {shape[:3]}, got "
                       f"{x.dtype}{x.shape}")
  m = cache.k_mean
  if m is not None and (m.ndim != 3 or m.shape[1:] != (shape[0], shape[3])
                        or m.dtype != jnp.float32):
    raise ValueError(f"k_mean must be float32 [num_seqs, {shape[0]}, "
                     f"{shape[3]}], got {m.dtype}{m.shape}")


def _check_page_table(cache: PagedKVCache, page_indices, b: int | None):
  """The int32 page table ``[B, pages_per_seq]`` (ValueError otherwise)."""
  page_indices = jnp.asarray(page_indices)
  if (page_indices.ndim != 2 or (b is not None and page_indices.shape[0] != b)
      or not jnp.issubdtype(page_indices.dtype, jnp.integer)):
    want = "batch" if b is None else b
    raise ValueError(f"page_indices must be an integer array [{want}, "
                     f"pages_per_seq], got {page_indices.dtype}"
                     f"{page_indices.shape}")
  return page_indices.astype(jnp.int32)


def _check_used_pages(cache: PagedKVCache, page_indices, start, end):
  """Where concrete: ValueError if a page table entry holding a position in
  ``[start, end)`` of its row (numpy ``[B]``) is not a page of the pool.
  Entries outside those positions may hold anything."""
  pi = _concrete_ints(page_indices)
  if pi is None:
    return
  ps, p = cache.page_size, cache.num_pages
  col = np.arange(pi.shape[1])[None, :]
  used = ((col >= start[:, None] // ps) & (col < -(-end[:, None] // ps))
          & (end > start)[:, None])
  bad = used & ((pi < 0) | (pi >= p))
  if bad.any():
    row, i = np.argwhere(bad)[0]
    raise ValueError(f"page_indices[{row}, {i}] = {pi[row, i]} is not a page "
                     f"of the pool [0, {p}) (row {row} uses it)")


def _check_seq_ids(cache: PagedKVCache, seq_ids, b: int, counts=None, *,
                   append: bool = False):
  """The int32 sequence slots ``[B]`` (default ``arange(B)``); an append's
  rows that take tokens must name distinct slots."""
  n = cache.num_seqs
  if seq_ids is None:
    if n is not None and b > n:
      raise ValueError(f"{b} rows but the cache has {n} sequence slots: "
                       "pass seq_ids")
    return jnp.arange(b, dtype=jnp.int32)
  seq_ids = jnp.asarray(seq_ids)
  if seq_ids.shape != (b,) or not jnp.issubdtype(seq_ids.dtype, jnp.integer):
    raise ValueError(f"seq_ids must be an integer array of shape ({b},), got "
                     f"{seq_ids.dtype}{seq_ids.shape}")
  ids = _concrete_ints(seq_ids)
  if ids is not None and n is not None:
    if ids.min() < 0 or ids.max() >= n:
      raise ValueError(f"seq_ids must lie in [0, {n}) (the cache's sequence "
                       f"slots), got {ids.tolist()}")
    writes = ids if counts is None else ids[counts > 0]
    if append and len(np.unique(writes)) != len(writes):
      raise ValueError(f"seq_ids {ids.tolist()} name a sequence slot twice "
                       "among the rows that append")
  return seq_ids.astype(jnp.int32)


def append_paged(cache: PagedKVCache, k_new, v_new, lengths, page_indices, *,
                 seq_ids=None, counts=None) -> PagedKVCache:
  """Writes new tokens of ``B`` sequences into their pages, quantized once
  (the bits :func:`append` stores in a :class:`KVCache`).

  Args:
    cache: the :class:`PagedKVCache`.
    k_new, v_new: ``[B, T, K, D]`` float (any ``T``: a prompt or new
      tokens).
    lengths: int ``[B]``: tokens already in each sequence; token ``t`` of
      row ``b`` goes to position ``pos = lengths[b] + t``: page
      ``page_indices[b, pos // page_size]``, slot ``pos % page_size``.
    page_indices: int ``[B, pages_per_seq]``, the rows' page tables.
    seq_ids: int ``[B]`` (default ``arange(B)``): the sequence slots (rows
      of ``k_mean``) the rows are, so that any subset of the sequences
      appends in one call; distinct among rows that take tokens.
    counts: int ``[B]`` (default ``T``): how many of the ``T`` tokens each
      row takes (0: the row and its slot are untouched).
  Returns:
    the new cache; ``jax.jit(append_paged, donate_argnums=0)`` updates the
    pool in place (one compiled scatter per shape).  A slot that was empty
    (``lengths == 0``) and takes a token sets its key shift (smooth_k).
    Writes past the page table (``lengths + counts > pages_per_seq *
    page_size``) or to a page outside the pool are dropped; ValueError
    where ``lengths``/``counts``/``page_indices`` are concrete.
  """
  _check_paged_layout(cache)
  nk, ps = cache.kv_heads, cache.page_size
  b = jnp.shape(k_new)[0] if jnp.ndim(k_new) == 4 else -1
  k_new, v_new, lengths, counts, cl, cc = _check_new_tokens(
      k_new, v_new, b, nk, cache.head_dim, lengths, counts)
  page_indices = _check_page_table(cache, page_indices, b)
  pps = page_indices.shape[1]
  cap = pps * ps
  if cl is not None and cc is not None:
    if (cl + cc).max() > cap:
      raise ValueError(f"appending {cc.tolist()} tokens at lengths "
                       f"{cl.tolist()} goes past the pages given "
                       f"(pages_per_seq * page_size = {pps} * {ps} = {cap})")
    _check_used_pages(cache, page_indices, cl, cl + cc)
  seq_ids = _check_seq_ids(cache, seq_ids, b, cc, append=True)
  return _append_pages(cache, k_new, v_new, lengths, counts, page_indices,
                       seq_ids)


@jax.jit
def _append_pages(cache, k_new, v_new, lengths, counts, page_indices,
                  seq_ids):
  # (jitted: one program for an eager call too; inlined under the caller's
  # jit, whose donation then makes the scatter in place)
  ps, p = cache.page_size, cache.num_pages
  pps = page_indices.shape[1]
  cap = pps * ps
  k_mean = cache.k_mean
  rows_mean = None
  if k_mean is not None:   # (a slot outside the pool under jit: clipped)
    rows_mean = k_mean[jnp.clip(seq_ids, 0, k_mean.shape[0] - 1)]
  valid, k8, ks, v8, vs, rows_mean, fresh = _quantize_new(
      k_new, v_new, lengths, counts, rows_mean, cache.k_pages.dtype,
      cache.v_pages.dtype)
  tok = jnp.arange(k_new.shape[1], dtype=jnp.int32)[None, :]
  pos = lengths[:, None] + tok                                  # [B, T]
  page = jnp.take_along_axis(page_indices, jnp.clip(pos // ps, 0, pps - 1),
                             axis=1)
  # dropped writes go to page P (out of the pool, mode="drop"); a negative
  # index would wrap around, so every bad one is mapped to P explicitly
  keep = valid & (pos < cap) & (page >= 0) & (page < p)
  page = jnp.where(keep, page, p)
  slot = pos % ps

  def put(dst, x):  # dst [K, P, ps, ...] at (page, slot), x [B, T, K, ...]
    x = jnp.moveaxis(x, 2, 0)                         # [K, B, T, ...]
    return dst.at[:, page, slot].set(x.astype(dst.dtype), mode="drop")

  if k_mean is not None:   # only the slots this append starts
    n = k_mean.shape[0]
    fresh = fresh & (seq_ids >= 0) & (seq_ids < n)
    k_mean = k_mean.at[jnp.where(fresh, seq_ids, n)].set(rows_mean,
                                                         mode="drop")
  return PagedKVCache(
      k_pages=put(cache.k_pages, k8), v_pages=put(cache.v_pages, v8),
      k_scale=None if ks is None else put(cache.k_scale, ks),
      v_scale=None if vs is None else put(cache.v_scale, vs), k_mean=k_mean)


def paged_to_dense(cache: PagedKVCache, page_indices, lengths, *,
                   seq_ids=None) -> KVCache:
  """The rows' pages gathered into the dense layout: a :class:`KVCache` of
  ``B`` rows and capacity ``pages_per_seq * page_size`` holding the bits
  the pages hold (``k_mean`` the slots' ``seq_ids``, default
  ``arange(B)``).  Slots at or past a row's length are zero (values and
  scales), so what a reused page held before never shows.  For the
  reference and checks: it copies the rows' caches."""
  _check_paged_layout(cache)
  page_indices = _check_page_table(cache, page_indices, None)
  b = page_indices.shape[0]
  lengths = _check_paged_lengths(cache, page_indices, lengths, b)
  seq_ids = _check_seq_ids(cache, seq_ids, b)
  return _gather_pages(cache, page_indices, lengths, seq_ids)


@jax.jit
def _gather_pages(cache, page_indices, lengths, seq_ids):
  b, pps = page_indices.shape
  cap = pps * cache.page_size
  pi = jnp.clip(page_indices, 0, cache.num_pages - 1)
  live = jnp.arange(cap)[None, :] < jnp.clip(lengths, 0, cap)[:, None]

  def gather(x):   # [K, P, ps, ...] -> [B, K, pps * ps, ...]
    if x is None:
      return None
    x = jnp.moveaxis(x[:, pi], 0, 1)                  # [B, K, pps, ps, ...]
    x = x.reshape(b, x.shape[1], cap, *x.shape[4:])
    where = live[:, None] if x.ndim == 3 else live[:, None, :, None]
    return jnp.where(where, x, jnp.zeros((), x.dtype))

  k_mean = cache.k_mean
  if k_mean is not None:
    k_mean = k_mean[jnp.clip(seq_ids, 0, k_mean.shape[0] - 1)]
  return KVCache(k=gather(cache.k_pages), v=gather(cache.v_pages),
                 k_scale=gather(cache.k_scale), v_scale=gather(cache.v_scale),
                 k_mean=k_mean)


def _check_paged_lengths(cache, page_indices, lengths, b):
  """int32 ``lengths [B]`` of a paged read; where concrete, ValueError past
  the pages given or for a used page outside the pool."""
  lengths = jnp.asarray(lengths)
  if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
    raise ValueError(f"lengths must be an integer array of shape ({b},), got "
                     f"{lengths.dtype}{lengths.shape}")
  cap = page_indices.shape[1] * cache.page_size
  cl = _concrete_ints(lengths)
  if cl is not None:
    if cl.min() < 0 or cl.max() > cap:
      raise ValueError(
          f"lengths must lie in [0, {cap}] (the pages given: pages_per_seq "
          f"* page_size = {page_indices.shape[1]} * {cache.page_size}), got "
          f"values in [{cl.min()}, {cl.max()}]")
    _check_used_pages(cache, page_indices, np.zeros_like(cl), cl)
  return lengths.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class DecodeConfig(base.MethodConfig):
  """Options of :func:`decode_attention` (the Triton kernel's knobs; the
  reference ignores them).

  Attributes:
    block_k: keys per block (a power of two, >= 16, at most the page:
      the dense cache's is the largest power of two up to 128 dividing the
      capacity).
    num_splits: splits per (row, KV head); None: enough to fill the GPU
      (:func:`pallas_kernels.paged.choose_splits`).
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


def reference(q, cache: "KVCache | PagedKVCache", lengths, *, method: str,
              scale: float | None = None, page_indices=None):
  """The method's decode arithmetic without blocking: the query rounded to
  the compute dtype (PASA: ``fl16(q * scale)``), scores ``(q_c K_c^T)_f32
  * k_scale * c`` in base 2 (PASA: rounded to float16 first; ``"int8"``:
  ``(q_8 K^T)_int32 * s_q * k_scale * c``, the query quantized per row by
  :func:`jaxattn.int_flash.quantize_per_token`, from 32 channels), the
  masks of
  :func:`decode_attention`, a float32 softmax, ``P`` times V's per-token
  scale over the row's largest, rounded to the compute dtype, against V's
  stored values (exact in float16), float32 accumulation, times that
  largest scale.  A
  :class:`PagedKVCache` (with ``page_indices``) is gathered first
  (:func:`paged_to_dense`): the same arithmetic on the same bits.  Returns
  float32 ``[B, T, N, D]``."""
  if isinstance(cache, PagedKVCache):
    # (k_mean is not read: a key shift leaves the softmax unchanged)
    cache = paged_to_dense(cache, page_indices, lengths,
                           seq_ids=jnp.zeros(q.shape[0], jnp.int32))
  elif page_indices is not None:
    raise ValueError("page_indices is for a PagedKVCache; this cache is a "
                     "dense KVCache")
  b, t, n, d = q.shape
  nk, s_cap = cache.kv_heads, cache.capacity
  g = n // nk
  f32 = jnp.float32
  cdt = compute_dtype(method, cache)
  scale = base.default_scale(d) if scale is None else float(scale)
  pasa = method == "pasa"
  factor = f32(LOG2E if pasa else scale * LOG2E)
  if _int8_query(method, d):   # (q8 K^T)_int32 * s_q: exact in float32
    q8, q_scale = int_flash.quantize_per_token(q)
    s = jnp.einsum("btkgd,bksd->bkgts", q8.reshape(b, t, nk, g, d),
                   cache.k, preferred_element_type=jnp.int32).astype(f32)
    s = s * q_scale.reshape(b, t, nk, g).transpose(0, 2, 3, 1)[..., None]
  else:
    qc = ((q.astype(f32) * scale).astype(jnp.float16) if pasa
          else q.astype(cdt))
    s = jnp.einsum("btkgd,bksd->bkgts", qc.reshape(b, t, nk, g, d),
                   cache.k.astype(cdt), preferred_element_type=f32,
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
  stored = (cols < lengths[:, None])[:, None, :]                # [B, 1, S]
  v_max = None
  if cache.v_scale is not None:
    # V's per-token scale on P's columns, relative to the row's largest
    # (P keeps float16's range), which multiplies the output (the kernel
    # divides by the largest so far: P rounds alike to float16's relative
    # precision)
    vs = jnp.where(stored, cache.v_scale, 0.0)                  # [B, K, S]
    v_max = vs.max(axis=-1)                                     # [B, K]
    inv = jnp.where(v_max > 0, 1.0 / jnp.where(v_max > 0, v_max, 1.0), 0.0)
    p = p * (vs * inv[..., None])[:, :, None, None, :]
  v = jnp.where(stored[..., None], cache.v.astype(cdt), 0.0)
  o = jnp.einsum("bkgts,bksd->bkgtd", p.astype(cdt), v.astype(cdt),
                 preferred_element_type=f32,
                 precision=jax.lax.Precision.HIGHEST)
  o = jnp.where(l[..., None] > 0, o / jnp.where(l > 0, l, 1.0)[..., None],
                0.0)
  if v_max is not None:
    o = o * v_max[:, :, None, None, None]
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


def _check_call(q, cache, lengths, method, implementation, page_indices=None):
  """The checked lengths (int32 ``[B]``) and page table (or None); a clear
  error for anything the decode path cannot take."""
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
  if not 1 <= t <= MAX_CHUNK_TOKENS:
    raise ValueError(f"decode takes 1 to {MAX_CHUNK_TOKENS} new query tokens "
                     f"per call (a step, a draft or a prompt chunk), got {t}; "
                     "run a longer prompt in chunks, or through "
                     "jaxattn.dot_product_attention (prefill)")
  if isinstance(cache, PagedKVCache):
    if page_indices is None:
      raise ValueError("a PagedKVCache needs page_indices [batch, "
                       "pages_per_seq] (the rows' page tables)")
    page_indices = _check_page_table(cache, page_indices, b)
    if d != cache.head_dim:
      raise ValueError(f"q {q.shape} does not match the cache (head_dim "
                       f"{cache.head_dim})")
    if n % cache.kv_heads:
      raise ValueError(f"query heads ({n}) must be a multiple of the "
                       f"cache's KV heads ({cache.kv_heads})")
    return (_check_paged_lengths(cache, page_indices, lengths, b),
            page_indices)
  if page_indices is not None:
    raise ValueError("page_indices is for a PagedKVCache; this cache is a "
                     "dense KVCache")
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
  return lengths.astype(jnp.int32), None


def decode_attention(q, cache: "KVCache | PagedKVCache", lengths, *,
                     page_indices=None, method: str = "fp32",
                     scale: float | None = None,
                     implementation: str | None = None, **options: Any):
  """Attention of 1 to 16 new query tokens against a :class:`KVCache` or a
  :class:`PagedKVCache`.

  Args:
    q: ``[B, T, N, D]`` float, ``T <= 16``; ``N`` a multiple of the cache's
      KV heads (grouped-query attention).
    cache: a :class:`KVCache` or :class:`PagedKVCache` in a format
      ``method`` reads (:data:`METHOD_CACHES`; ``create(...,
      method=method)``), the ``T`` new tokens already appended
      (:func:`append`, :func:`append_paged`).
    lengths: int ``[B]``: each row's keys, the new tokens included.  New
      token ``t`` sees keys ``0 .. lengths - T + t``.
    page_indices: int ``[B, pages_per_seq]``, the rows' page tables:
      required with a :class:`PagedKVCache` (the contract is its
      docstring's), ValueError with a :class:`KVCache`.
    method: "fp32", "pasa", "int8", "fp8" or "sage".
    scale: softmax scale, default ``1 / sqrt(D)``; finite (ValueError
      otherwise).
    implementation: None (the Triton kernel on a GPU, else the reference),
      "triton" (Triton's interpreter without a GPU) or "reference".
    **options: :class:`DecodeConfig` (``block_k``, ``num_splits``,
      ``num_warps``, ``num_stages``).
  Returns:
    ``[B, T, N, D]`` in the query dtype.

  ``T`` may also be a prompt chunk of up to :data:`MAX_CHUNK_TOKENS`
  (chunked prefill): the same contract, the chunk's rows tiled by the
  kernel, the cache read through the page table without a dense copy.

  Concrete ``lengths`` are checked against the capacity (one host sync),
  and concrete ``page_indices`` against the pool; in a generation loop
  call it under ``jax.jit``, where lengths past the capacity and page
  indices outside the pool are clipped.
  """
  config = DecodeConfig.from_options(**options)
  lengths, page_indices = _check_call(q, cache, lengths, method,
                                      implementation, page_indices)
  scale = base.softmax_scale(scale, q.shape[-1])
  if implementation is None:
    implementation = "triton" if common.has_gpu() else "reference"
  if page_indices is not None:
    return _decode_paged(q, cache, lengths, page_indices, method=method,
                         scale=scale, implementation=implementation,
                         config=config)
  return _decode(q, cache, lengths, method=method, scale=scale,
                 implementation=implementation, config=config)


@functools.partial(jax.jit, static_argnames=("method", "scale",
                                             "implementation", "config"))
def _decode(q, cache, lengths, *, method, scale, implementation, config):
  if implementation == "reference":
    return reference(q, cache, lengths, method=method,
                     scale=scale).astype(q.dtype)
  # a dense row as pages of the largest power of two up to 128 keys that
  # divides the capacity (a capacity off 16 is padded: one copy)
  cap = cache.capacity
  page = next((p for p in (128, 64, 32, 16) if cap % p == 0), None)
  if page is None:
    page, pad = 16, common.round_up(cap, 16)
    cache = KVCache(*(None if x is None else common.pad_axis(x, 2, pad)
                      for x in (cache.k, cache.v, cache.k_scale,
                                cache.v_scale)), k_mean=cache.k_mean)
  table = paged.dense_table(cache.batch, cache.kv_heads, cache.capacity, page)
  return _kernel(q, cache.k, cache.v, cache.k_scale, cache.v_scale, table,
                 lengths, layout="dense", page=page, method=method,
                 scale=scale, config=config, cdt=compute_dtype(method, cache))


def _kernel(q, k, v, k_scale, v_scale, table, lengths, *, layout, page,
            method, scale, config, cdt):
  """:func:`pallas_kernels.paged.paged_attention` with the method's query
  (PASA's ``fl16(q * scale)``, then float16 scores; int8 per row for
  :data:`INT8_QUERY` from :data:`INT8_QUERY_MIN_DIM` channels) and the
  config's knobs."""
  pasa = method == "pasa"
  qk, q_scale = q, None
  if pasa:
    qk = (q.astype(jnp.float32) * scale).astype(jnp.float16)
  elif _int8_query(method, q.shape[-1]):
    qk, q_scale = int_flash.quantize_per_token(q)
  # (the kernel's wrapper computes its indices in 32 bits: traced with x64
  # off, as the API's kernels are)
  with jax.enable_x64(False):
    return paged.paged_attention(
        qk, k, v, table, lengths, k_scale, v_scale, q_scale=q_scale,
        layout=layout, page=page,
        scale=1.0 if pasa else scale, compute_dtype=cdt, f16_scores=pasa,
        block_n=config.block_k, num_splits=config.num_splits,
        num_warps=config.num_warps, num_stages=config.num_stages,
        out_dtype=q.dtype)


@functools.partial(jax.jit, static_argnames=("method", "scale",
                                             "implementation", "config"))
def _decode_paged(q, cache, lengths, page_indices, *, method, scale,
                  implementation, config):
  if implementation == "reference":
    return reference(q, cache, lengths, method=method, scale=scale,
                     page_indices=page_indices).astype(q.dtype)
  return _paged_kernel(q, cache, lengths, page_indices, method=method,
                       scale=scale, config=config)


def _paged_kernel(q, cache: PagedKVCache, lengths, page_indices, *,
                  method: str, scale: float, config: DecodeConfig):
  """The paged kernel on the pool (``[K, P, page_size, D]`` pages): the
  reference's arithmetic, page indices clamped into the pool."""
  cdt = (jnp.dtype(cache.k_pages.dtype) if method == "fp32"
         else jnp.dtype(jnp.float16))
  return _kernel(q, cache.k_pages, cache.v_pages, cache.k_scale,
                 cache.v_scale, page_indices.astype(jnp.int32), lengths,
                 layout="paged", page=cache.page_size, method=method,
                 scale=scale, config=config, cdt=cdt)


__all__ = ["KVCache", "append", "decode_attention", "reference",
           "float_reference", "check_cache", "DecodeConfig", "METHOD_CACHES",
           "PagedKVCache", "append_paged", "paged_to_dense"]

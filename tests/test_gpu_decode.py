"""GPU tests of the decode kernel (marker ``gpu``) at serving sizes: every
cache format, dense and paged, against the reference on the same bits.

32 query and 8 KV heads, D=128, pages of 64 keys shuffled in a pool that
holds garbage; rows of 3001 keys (a partial last page), 1234 and 0; one new
token and 16 (bottom-right causal); the kernel's own tiles and the GPU's
splits; NaN in every slot past a row's length, and NaN-filled allocations
larger than the kernel's partial outputs before each call."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxattn import decode, metrics
# the interpret-mode tests' cache formats, bounds and garbage pool
from test_paged import FORMATS, KERNEL_ATOL, _ids, _poison

pytestmark = pytest.mark.gpu

B, NK, N, D, PS = 3, 8, 32, 128, 64
LENGTHS = (3001, 1234, 0)
# floats: more than the kernel's (o, m, l) partials, [B, K, splits, rows, D]
POISON = (B * NK * 64 * 32, D)


def _normal(key, shape, shift=0.0):
  return jax.random.normal(jax.random.key(key), shape, jnp.float32) + shift


def _bad(x, where):
  """``x`` with NaN (or -128 in int8) where ``where`` holds."""
  return jnp.where(where, jnp.asarray(-128 if x.dtype == jnp.int8
                                      else jnp.nan, x.dtype), x)


def _garbage_past(cache, lengths):
  """The dense cache with garbage in every slot at or past a row's
  length: the kernel must not read it."""
  past = jnp.arange(cache.capacity)[None, None, :] >= lengths[:, None, None]
  fill = lambda x: None if x is None else _bad(
      x, past if x.ndim == 3 else past[..., None])
  return decode.KVCache(k=fill(cache.k), v=fill(cache.v),
                        k_scale=fill(cache.k_scale),
                        v_scale=fill(cache.v_scale), k_mean=cache.k_mean)


@pytest.mark.parametrize("method,fmt", FORMATS, ids=_ids)
def test_decode_kernel_matches_reference(method, fmt, poison_allocator):
  """After a prompt (rows of 3001, 1234 and 0 keys) one new token; after
  a step of 16 tokens, those 16: the paged and the dense kernel against
  the reference on the same pool, no NaN, the empty row 0."""
  pps = -(-max(LENGTHS) // PS) + 1
  pool = B * pps + 5
  rng = np.random.default_rng(0)
  perm = rng.permutation(pool)
  table = np.zeros((B, pps), np.int32)
  at = 0
  for b, n in enumerate(LENGTHS):
    pages = -(-(n + 16) // PS)
    table[b, :pages] = perm[at:at + pages]
    at += pages
  table = jnp.asarray(table)
  paged = _poison(decode.PagedKVCache.create(pool, PS, NK, D, num_seqs=B,
                                               method=method, **fmt))
  dense = decode.KVCache.create(B, pps * PS, NK, D, method=method, **fmt)
  lengths = jnp.zeros(B, jnp.int32)
  for step, (t, counts) in enumerate(((max(LENGTHS), jnp.array(LENGTHS)),
                                      (16, jnp.full(B, 16)))):
    k = _normal(10 * step + 1, (B, t, NK, D), 2.0)   # keys with a bias
    v = _normal(10 * step + 2, (B, t, NK, D))
    paged = jax.jit(decode.append_paged)(paged, k, v, lengths, table,
                                         counts=counts)
    dense = jax.jit(decode.append)(dense, k, v, lengths, counts)
    lengths = lengths + counts
    t_new = (1, 16)[step]
    q = _normal(100 + t_new, (B, t_new, N, D))
    ref = decode.decode_attention(q, paged, lengths, page_indices=table,
                                  method=method, implementation="reference")
    poison_allocator(POISON)
    out = decode.decode_attention(q, paged, lengths, page_indices=table,
                                  method=method)
    poison_allocator(POISON)
    out_dense = decode.decode_attention(q, _garbage_past(dense, lengths),
                                        lengths, method=method)
    for got in (out, out_dense):
      assert got.shape == q.shape and got.dtype == q.dtype
      assert bool(jnp.isfinite(got).all()), (method, t_new)
      err = float(jnp.abs(got - ref).max())
      assert err < KERNEL_ATOL[method], (method, t_new, err)
    if step == 0:   # the empty row sees no key
      np.testing.assert_array_equal(np.asarray(out[2]), 0.0)
      np.testing.assert_array_equal(np.asarray(out_dense[2]), 0.0)
    assert metrics.cosine_similarity(out, out_dense) > 0.99999
  # a 16-bit query gives its dtype back, and the reference's values on the
  # same query to that dtype's rounding, twice (int8 quantizes the bf16 query
  # to other integers than the float32 one: 0.022 apart on the H200)
  q16 = q.astype(jnp.bfloat16)
  low = decode.decode_attention(q16, paged, lengths, page_indices=table,
                                method=method)
  ref16 = decode.decode_attention(q16, paged, lengths, page_indices=table,
                                  method=method, implementation="reference")
  assert low.dtype == jnp.bfloat16
  rounding = 2.0 ** -7 * float(jnp.abs(ref16.astype(jnp.float32)).max())
  assert float(jnp.abs(low.astype(jnp.float32)
                       - ref16.astype(jnp.float32)).max()) < (
                           KERNEL_ATOL[method] + rounding)


@pytest.mark.parametrize("d", [16, 32])
def test_int8_decode_at_small_head_dims(d, poison_allocator):
  """int8 at head dims 16 and 32: the int8 query's QK dot from 32
  channels (Triton's 8-bit dots need 32), the float query below."""
  b, s, nk, n = 2, 1000, 2, 8
  cache = decode.KVCache.create(b, 1024, nk, d, method="int8")
  lengths = jnp.array([s, 517])
  cache = jax.jit(decode.append)(cache, _normal(1, (b, s, nk, d), 2.0),
                                 _normal(2, (b, s, nk, d)),
                                 jnp.zeros(b, jnp.int32), lengths)
  q = _normal(3, (b, 1, n, d))
  ref = decode.decode_attention(q, cache, lengths, method="int8",
                                implementation="reference")
  poison_allocator(POISON)
  out = decode.decode_attention(q, _garbage_past(cache, lengths), lengths,
                                method="int8")
  assert bool(jnp.isfinite(out).all())
  assert float(jnp.abs(out - ref).max()) < KERNEL_ATOL["int8"]

"""GPU tests of the decode kernel (marker ``gpu``) at serving sizes: every
cache format, dense and paged, against the reference on the same bits.

32 query and 8 KV heads, D=128, pages of 64 keys shuffled in a pool that
holds garbage; rows of 3001 keys (a partial last page), 1234 and 0; one new
token and 16 (bottom-right causal); the kernel's own tiles and the GPU's
splits; NaN-filled allocations before each kernel call."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxattn import decode, metrics

pytestmark = pytest.mark.gpu

B, NK, N, D, PS = 3, 8, 32, 128, 64
LENGTHS = (3001, 1234, 0)
# the interpret-mode tests' bounds (tests/test_paged.py), and fp32's: a
# bfloat16 P over rows of thousands of keys
KERNEL_ATOL = {"fp32": 8e-3, "pasa": 1e-3, "int8": 1e-3, "fp8": 1e-3,
               "sage": 1e-3}
FORMATS = [(m, dict(k_dtype=k, v_dtype=v) | (
    {} if s is None else {"smooth_k": s}))
    for m, fmts in decode.METHOD_CACHES.items() for k, v, s in fmts]
_ids = [f"{m}-{o['k_dtype']}" for m, o in FORMATS]


def _normal(key, shape, shift=0.0):
  return jax.random.normal(jax.random.key(key), shape, jnp.float32) + shift


def _poisoned(cache):
  """Every page holds garbage (NaN, or -128 in int8), as pages freed by
  other sequences may."""
  bad = lambda x: None if x is None else jnp.full_like(
      x, -128 if x.dtype == jnp.int8 else jnp.nan)
  return decode.PagedKVCache(
      k_pages=bad(cache.k_pages), v_pages=bad(cache.v_pages),
      k_scale=bad(cache.k_scale), v_scale=bad(cache.v_scale),
      k_mean=cache.k_mean)


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
  paged = _poisoned(decode.PagedKVCache.create(pool, PS, NK, D, num_seqs=B,
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
    poison_allocator((B, t_new, N, D))
    out = decode.decode_attention(q, paged, lengths, page_indices=table,
                                  method=method)
    poison_allocator((B, t_new, N, D))
    out_dense = decode.decode_attention(q, dense, lengths, method=method)
    for got in (out, out_dense):
      assert got.shape == q.shape and got.dtype == q.dtype
      assert bool(jnp.isfinite(got).all()), (method, t_new)
      err = float(jnp.abs(got - ref).max())
      assert err < KERNEL_ATOL[method], (method, t_new, err)
    if step == 0:   # the empty row sees no key
      np.testing.assert_array_equal(np.asarray(out[2]), 0.0)
    assert metrics.cosine_similarity(out, out_dense) > 0.99999

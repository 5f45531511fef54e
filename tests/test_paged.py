"""jaxattn.decode's paged KV cache: the same tokens appended to a dense
KVCache and to a PagedKVCache (pages in shuffled order, partially filled
last pages, a pool that held garbage) store the same bits and give the same
decode outputs, for every cache format; subsets of sequences, long
prompts, the frozen key shift, the errors, the Flax module's paged mode and
examples/serving.py (continuous batching)."""
import functools
import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import decode, metrics

B, NK, N, D, PS = 3, 2, 4, 32, 16   # sequences, KV heads, heads, dim, page
# every cache format of every method (METHOD_CACHES), and 8-bit keys
# without the key shift
FORMATS = [(m, dict(k_dtype=k, v_dtype=v) | (
    {} if s is None else {"smooth_k": s}))
    for m, fmts in decode.METHOD_CACHES.items() for k, v, s in fmts]
FORMATS.append(("int8", {"smooth_k": False}))
_ids = [f"{m}-{o['k_dtype']}" if "k_dtype" in o else f"{m}-nosmooth"
        for m, o in FORMATS]

# jitted, as a serving loop runs them (eagerly every op compiles alone)
_append = jax.jit(decode.append)
_append_paged = jax.jit(decode.append_paged)
_to_dense = jax.jit(decode.paged_to_dense)
_reference = jax.jit(decode.reference, static_argnames="method")
_dequantize = jax.jit(lambda c: c.dequantize())


def _normal(seed, shape, shift=0.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape)
                     + shift, jnp.float32)


def _poison(cache):
  """Every page holds garbage (NaN, or -128 in int8), as pages freed by
  other sequences may: nothing past a length may be read."""
  def bad(x):
    if x is None:
      return None
    return jnp.full_like(x, -128 if x.dtype == jnp.int8 else jnp.nan)
  return decode.PagedKVCache(
      k_pages=bad(cache.k_pages), v_pages=bad(cache.v_pages),
      k_scale=bad(cache.k_scale), v_scale=bad(cache.v_scale),
      k_mean=cache.k_mean)


def _tables(rng, num_pages, pages_needed, pps, tail):
  """Page tables drawing distinct pages from a shuffled pool; entries past
  a row's pages hold ``tail[b]`` (anything: never read)."""
  perm = rng.permutation(num_pages)
  table = np.empty((len(pages_needed), pps), np.int32)
  at = 0
  for b, n in enumerate(pages_needed):
    table[b] = tail[b]
    table[b, :n] = perm[at:at + n]
    at += n
  return jnp.asarray(table)


def _bits(x):
  return None if x is None else np.asarray(x.astype(jnp.float32))


def _assert_same_cache(dense, paged, table, lengths):
  """The gathered pages hold the dense cache's bits (zero past lengths, as
  the dense cache, written only below them, holds) and dequantize alike."""
  got = _to_dense(paged, table, lengths)
  for name in ("k", "v", "k_scale", "v_scale", "k_mean"):
    want, have = getattr(dense, name), getattr(got, name)
    assert (want is None) == (have is None), name
    if want is not None:
      assert want.dtype == have.dtype, name
      np.testing.assert_array_equal(_bits(have), _bits(want), err_msg=name)
  for a, b in zip(_dequantize(dense), _dequantize(got)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _assert_same_decode(method, q, dense, paged, table, lengths):
  # The same numerics on the kernel path: the same key blocks and splits
  # (by default the dense cache takes longer blocks, and the splits follow
  # the GPU; then the outputs differ by P's float16 rounding).
  same = dict(block_k=PS, num_splits=2)
  want = decode.decode_attention(q, dense, lengths, method=method, **same)
  got = decode.decode_attention(q, paged, lengths, page_indices=table,
                                method=method, **same)
  assert got.shape == q.shape and got.dtype == q.dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  return got


@pytest.mark.parametrize("method,fmt", FORMATS, ids=_ids)
def test_paged_equals_dense_bit_for_bit(method, fmt):
  """Prompts of 37, 16 and 0 tokens (T=40 with counts) into a pool that
  held garbage, a step of T=16 (bottom-right causal; the empty sequence's
  first append sets its key shift), then one token of sequence 1 alone
  (seq_ids): after each, the caches' bits and the decode outputs equal
  the dense cache's, and the subset append leaves the others untouched."""
  pps, pool = 8, 30
  rng = np.random.default_rng(0)
  dense = decode.KVCache.create(B, pps * PS, NK, D, method=method, **fmt)
  paged = _poison(decode.PagedKVCache.create(pool, PS, NK, D, num_seqs=B,
                                             method=method, **fmt))
  assert paged.format == dense.format
  assert paged.bytes_per_token() == dense.bytes_per_token()
  # final lengths 53, 33, 16: partial last pages (5 and 1 tokens); tails
  # hold a page of another row, an index outside the pool, and 0
  table = _tables(rng, pool, [4, 3, 1], pps, tail=[0, pool + 5, 0])

  def step(seed, t, lengths, counts):
    nonlocal dense, paged
    k, v = _normal(seed, (B, t, NK, D), 2.0), _normal(seed + 1,
                                                      (B, t, NK, D))
    dense = _append(dense, k, v, lengths, counts)
    paged = _append_paged(paged, k, v, lengths, table, counts=counts)
    return lengths + counts

  lengths = step(1, 40, jnp.zeros(B, jnp.int32), jnp.array([37, 16, 0]))
  out = _assert_same_decode(method, _normal(9, (B, 1, N, D)), dense, paged,
                            table, lengths)
  assert float(jnp.abs(out[2]).max()) == 0.0    # length 0: sees no key
  assert bool(jnp.isfinite(out).all())
  lengths = step(5, 16, lengths, jnp.full(B, 16))
  assert lengths.tolist() == [53, 32, 16]
  _assert_same_cache(dense, paged, table, lengths)
  out = _assert_same_decode(method, _normal(11, (B, 16, N, D)), dense,
                            paged, table, lengths)
  assert bool(jnp.isfinite(out).all())
  if paged.k_mean is not None:   # the fresh sequence set its shift
    assert float(jnp.abs(paged.k_mean[2]).max()) > 0.5

  # sequence 1 alone, by seq_ids: the others' pages and shifts untouched
  before = jax.tree.map(np.asarray, paged)
  k, v = _normal(7, (1, 1, NK, D), 2.0), _normal(8, (1, 1, NK, D))
  paged = _append_paged(paged, k, v, lengths[1:2], table[1:2],
                        seq_ids=jnp.array([1]))
  pad = lambda x: jnp.zeros((B, 1, NK, D)).at[1].set(x[0])
  dense = _append(dense, pad(k), pad(v), lengths, jnp.array([0, 1, 0]))
  lengths = lengths + jnp.array([0, 1, 0])
  _assert_same_cache(dense, paged, table, lengths)
  _assert_same_decode(method, _normal(12, (B, 1, N, D)), dense, paged,
                      table, lengths)
  written = np.zeros((pool, PS), bool)
  written[int(table[1, 2]), 0] = True    # position 32: page 2, slot 0
  for name in ("k_pages", "v_pages", "k_scale", "v_scale"):
    old, new = getattr(before, name), getattr(paged, name)
    if old is not None:
      np.testing.assert_array_equal(_bits(new)[:, ~written],
                                    _bits(jnp.asarray(old))[:, ~written])
  if paged.k_mean is not None:
    np.testing.assert_array_equal(np.asarray(paged.k_mean), before.k_mean)


def test_prefill_long_prompt_then_decode(method="sage"):
  """Prompts of 300 and 137 tokens (T=300) into shuffled pages through the
  donated update, then three decode steps: the paged cache's outputs are
  the dense cache's, and close to float32 attention."""
  b, t, pps, pool = 2, 300, 20, 48
  rng = np.random.default_rng(1)
  table = _tables(rng, pool, [19, 9], pps, tail=[0, 0])
  append = jax.jit(decode.append_paged, donate_argnums=0)
  dense = decode.KVCache.create(b, pps * PS, NK, D, method=method)
  paged = decode.PagedKVCache.create(pool, PS, NK, D, num_seqs=b,
                                     method=method)
  k, v = _normal(0, (b, t + 3, NK, D), 1.0), _normal(1, (b, t + 3, NK, D))
  counts = jnp.array([300, 137])
  zero = jnp.zeros(b, jnp.int32)
  dense = _append(dense, k[:, :t], v[:, :t], zero, counts)
  paged = append(paged, k[:, :t], v[:, :t], zero, table, counts=counts)
  lengths = counts
  for i in range(3):
    k1 = jnp.stack([k[0, 300 + i], k[1, 137 + i]])[:, None]
    v1 = jnp.stack([v[0, 300 + i], v[1, 137 + i]])[:, None]
    dense = _append(dense, k1, v1, lengths)
    paged = append(paged, k1, v1, lengths, table)
    lengths = lengths + 1
    q = _normal(20 + i, (b, 1, N, D))
    out = _assert_same_decode(method, q, dense, paged, table, lengths)
  _assert_same_cache(dense, paged, table, lengths)
  ref = _reference(q, paged, lengths, method=method, page_indices=table)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-3)
  fl = decode.float_reference(q, k, v, lengths)   # rows' keys in order
  assert metrics.cosine_similarity(out, fl) > 0.999


def test_key_shift_frozen_at_first_append():
  """The first append to an empty slot sets its shift (the mean of the
  keys it takes); later appends keep it; a slot whose row takes no token
  keeps its shift; a slot reused for a new sequence (length 0 again, on
  the old sequence's pages, not cleared) takes the new prompt's mean."""
  cache = decode.PagedKVCache.create(8, PS, NK, D, num_seqs=2,
                                     method="sage")
  table = jnp.array([[3, 5], [1, 0]], jnp.int32)
  k, v = _normal(0, (2, 20, NK, D), 3.0), _normal(1, (2, 20, NK, D))
  cache = _append_paged(cache, k, v, jnp.zeros(2, jnp.int32), table,
                         counts=jnp.array([20, 0]))
  np.testing.assert_allclose(np.asarray(cache.k_mean[0]),
                             np.asarray(k[0].mean(0)), atol=1e-5)
  assert float(jnp.abs(cache.k_mean[1]).max()) == 0.0   # took no token
  mean = np.asarray(cache.k_mean)
  k2 = _normal(2, (2, 4, NK, D), -5.0)
  cache = _append_paged(cache, k2, k2, jnp.array([20, 0]), table,
                         counts=jnp.array([4, 0]))
  np.testing.assert_array_equal(np.asarray(cache.k_mean), mean)
  kd, _ = _dequantize(_to_dense(cache, table, jnp.array([24, 0])))
  np.testing.assert_allclose(np.asarray(kd[0, 20:24]), np.asarray(k2[0]),
                             rtol=0.05, atol=0.05)
  # slot 0 reused by a new sequence on the same pages, by seq_ids
  k3 = _normal(3, (1, 5, NK, D), -2.0)
  cache = jax.jit(lambda c, *a, **kw: c.append(*a, **kw))(
      cache, k3, k3, jnp.zeros(1, jnp.int32), table[:1],
      seq_ids=jnp.array([0]))
  np.testing.assert_allclose(np.asarray(cache.k_mean[0]),
                             np.asarray(k3[0].mean(0)), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(cache.k_mean[1]), mean[1])


def test_errors():
  pool = 8
  cache = decode.PagedKVCache.create(pool, PS, NK, D, num_seqs=2,
                                     method="int8")
  table = jnp.array([[0, 1], [2, 3]], jnp.int32)
  k = _normal(0, (2, 5, NK, D))
  lengths = jnp.array([5, 0])
  cache = decode.append_paged(cache, k, k, jnp.zeros(2, jnp.int32), table,
                              counts=lengths)
  q = _normal(1, (2, 1, N, D))
  call = lambda c=cache, q=q, lengths=lengths, **kw: decode.decode_attention(
      q, c, lengths, **{"page_indices": table, "method": "int8", **kw})
  call()
  # page indices outside the pool (concrete: checked where used)
  bad = table.at[1, 0].set(pool)
  with pytest.raises(ValueError, match=r"page_indices\[1, 0\] = 8 is not a "
                     r"page of the pool \[0, 8\)"):
    decode.append_paged(cache, k, k, lengths, bad)
  with pytest.raises(ValueError, match="is not a page of the pool"):
    call(lengths=jnp.array([5, 1]), page_indices=table.at[1, 0].set(-1))
  with pytest.raises(ValueError, match="is not a page of the pool"):
    decode.paged_to_dense(cache, bad, jnp.array([5, 1]))
  call(page_indices=table.at[0, 1].set(-7))   # an unused entry: anything
  # lengths past the pages given
  with pytest.raises(ValueError, match=r"lengths must lie in \[0, 32\] "
                     r"\(the pages given"):
    call(lengths=jnp.array([33, 0]))
  with pytest.raises(ValueError, match="goes past the pages given"):
    decode.append_paged(cache, k, k, jnp.array([30, 0]), table)
  # formats, page sizes, layouts
  with pytest.raises(ValueError, match="method 'fp8' reads a cache of .* "
                     r"PagedKVCache.create\(..., method='fp8'\)"):
    call(method="fp8")
  for ps in (24, 8):
    with pytest.raises(ValueError, match="power of two >= 16"):
      decode.PagedKVCache.create(pool, ps, NK, D, num_seqs=2, method="int8")
  with pytest.raises(ValueError, match="num_seqs must be a positive int"):
    decode.PagedKVCache.create(pool, PS, NK, D, num_seqs=0)
  with pytest.raises(ValueError, match="method 'sage' reads"):
    decode.PagedKVCache.create(pool, PS, NK, D, num_seqs=2, method="sage",
                               smooth_k=False)
  with pytest.raises(ValueError, match="v_pages .* must have k_pages's"):
    call(c=decode.PagedKVCache(
        k_pages=cache.k_pages, v_pages=cache.v_pages[:, :4],
        k_scale=cache.k_scale, v_scale=cache.v_scale, k_mean=cache.k_mean))
  with pytest.raises(ValueError, match="k_scale must be float32"):
    call(c=decode.PagedKVCache(
        k_pages=cache.k_pages, v_pages=cache.v_pages,
        k_scale=cache.k_scale.astype(jnp.float16), v_scale=cache.v_scale,
        k_mean=cache.k_mean))
  # shapes and dtypes of the arguments
  with pytest.raises(ValueError, match="needs page_indices"):
    call(page_indices=None)
  dense = decode.KVCache.create(2, 32, NK, D, method="int8")
  with pytest.raises(ValueError, match="page_indices is for a PagedKVCache"):
    call(c=dense)
  with pytest.raises(ValueError, match=r"page_indices must be an integer "
                     r"array \[2, pages_per_seq\]"):
    call(page_indices=table.astype(jnp.float32))
  with pytest.raises(ValueError, match="page_indices must be an integer"):
    decode.append_paged(cache, k, k, lengths, table[:1])
  with pytest.raises(ValueError, match=r"k_new must be \[batch, T, kv_heads, "
                     r"head_dim\]"):
    decode.append_paged(cache, k[..., :16], k, lengths, table)
  with pytest.raises(TypeError, match="k_new must be floating"):
    decode.append_paged(cache, k.astype(jnp.int32), k, lengths, table)
  with pytest.raises(ValueError, match="counts must be an integer array"):
    decode.append_paged(cache, k, k, lengths, table, counts=jnp.ones(3, int))
  with pytest.raises(ValueError, match="does not match the cache"):
    call(q=_normal(1, (2, 1, N, 16)))
  with pytest.raises(ValueError, match=r"seq_ids must lie in \[0, 2\)"):
    decode.append_paged(cache, k, k, lengths, table,
                        seq_ids=jnp.array([0, 2]))
  with pytest.raises(ValueError, match="name a sequence slot twice"):
    decode.append_paged(cache, k, k, lengths, table,
                        seq_ids=jnp.array([1, 1]))
  decode.append_paged(cache, k, k, lengths, table, seq_ids=jnp.array([1, 1]),
                      counts=jnp.array([1, 0]))   # a row taking no token
  with pytest.raises(ValueError, match="3 rows but the cache has 2 sequence"):
    decode.append_paged(cache, _normal(0, (3, 1, NK, D)),
                        _normal(0, (3, 1, NK, D)), jnp.zeros(3, int),
                        jnp.zeros((3, 2), int))


# the kernel against the reference (the same stored bits; the kernel's
# blocked softmax rounds P against a running max, the reference against the
# row's max: two roundings of each P, 2^-8 relative in bfloat16 (fp32's
# cache) and 2^-11 in float16, on V ~ N(0, 1) and rows of 5 keys): max
# |diff|, measured 5.4e-3 (fp32) and <= 3.5e-4 (the others)
KERNEL_ATOL = {"fp32": 8e-3, "pasa": 1e-3, "int8": 1e-3, "fp8": 1e-3,
               "sage": 1e-3}


@pytest.mark.parametrize("method,fmt", FORMATS, ids=_ids)
def test_kernel_matches_reference(method, fmt):
  """The Triton kernel (its interpreter here) reads the pages through the
  table: shuffled pages in a pool of garbage, partially filled last pages,
  an empty sequence, T=16 new tokens bottom-right causal and a prompt
  chunk of 40 tokens (two tiles of packed rows), against the reference on
  the same pool; every output element is written (the interpreter's
  outputs start as NaN) and none is NaN."""
  pps, pool = 6, 24
  rng = np.random.default_rng(3)
  paged = _poison(decode.PagedKVCache.create(pool, PS, NK, D, num_seqs=B,
                                             method=method, **fmt))
  table = _tables(rng, pool, [5, 2, 1], pps, tail=[1, pool + 3, 0])
  counts = jnp.array([71, 20, 0])
  k, v = _normal(5, (B, 80, NK, D), 2.0), _normal(6, (B, 80, NK, D))
  paged = _append_paged(paged, k, v, jnp.zeros(B, jnp.int32), table,
                        counts=counts)
  for t in (16, 40):
    lengths = jnp.maximum(counts, 0)
    q = _normal(7 + t, (B, t, N, D))
    ref = decode.decode_attention(q, paged, lengths, page_indices=table,
                                  method=method, implementation="reference")
    out = decode.decode_attention(q, paged, lengths, page_indices=table,
                                  method=method, implementation="triton",
                                  block_k=16)
    assert bool(jnp.isfinite(out).all())
    assert float(jnp.abs(out - ref).max()) < KERNEL_ATOL[method], t
    # tokens that see no key (the empty sequence, and row 1's first 20 of
    # 40: lengths - T + t < 0) are 0
    np.testing.assert_array_equal(np.asarray(out[2]), 0.0)


@pytest.mark.parametrize("method,fmt", FORMATS, ids=_ids)
def test_kernel_compiles_for_hopper(method, fmt):
  """The kernel as jax_triton would compile it for the H100 / H200 (sm_90)
  at pages of 64 keys: one new token at head dims 16 and 128, 16 tokens at
  128.  CI has no GPU, and the interpreter runs what the GPU's compiler
  may refuse (an 8-bit dot of 16 channels did)."""
  from triton.backends.compiler import GPUTarget
  from pallas_kernels import triton_call
  attend = jax.jit(functools.partial(decode.decode_attention, method=method,
                                     implementation="triton"))
  for d, t in ((16, 1), (128, 1), (128, 16)):
    pool = decode.PagedKVCache.create(8, 64, NK, d, num_seqs=B,
                                      method=method, **fmt)
    with triton_call.compiling_for(GPUTarget("cuda", 90, 32)) as compiled:
      jax.eval_shape(attend, jnp.zeros((B, t, N, d)), pool, jnp.full(B, 100),
                     page_indices=jnp.zeros((B, 2), jnp.int32))
    assert len(compiled) == 1 and compiled[0].asm["cubin"], (d, t)


def test_under_jit_bad_pages_are_clipped_or_dropped():
  """Traced page indices are not checked: writes to a page outside the
  pool are dropped (the pool is unchanged; a negative index does not wrap
  around) and reads are clipped."""
  cache = decode.PagedKVCache.create(4, PS, NK, D, num_seqs=2,
                                     method="fp8")
  k = _normal(0, (2, 2, NK, D))
  table = jnp.array([[-1, 0], [4, 1]], jnp.int32)
  out = _append_paged(cache, k, k, jnp.zeros(2, jnp.int32), table)
  for a, b in zip(jax.tree.leaves(out)[:-1], jax.tree.leaves(cache)[:-1]):
    np.testing.assert_array_equal(_bits(a), _bits(b))
  attend = jax.jit(lambda q, c, n, t: decode.decode_attention(
      q, c, n, page_indices=t, method="fp8"))
  o = attend(_normal(1, (2, 1, N, D)), out, jnp.array([2, 2]), table)
  assert bool(jnp.isfinite(o).all())


# --- Flax: the paged module against the dense one -------------------------

def test_flax_paged_module_matches_dense():
  """QuantizedCacheAttention with a paged cache (shuffled page table set
  through set_page_tables) gives the dense-cache module's outputs: a
  20-token prompt (the float prompt path), then one-token steps, then a
  step of sequence 2 alone (seq_ids) and one with an idle row (active)."""
  pytest.importorskip("flax")
  from flax import nnx
  import jaxattn.flax as jflax
  batch, feat, max_len, pool = 3, 64, 64, 11
  make = lambda **kw: jflax.QuantizedCacheAttention(
      num_heads=N, num_kv_heads=NK, in_features=feat, qkv_features=N * D,
      decode=True, rngs=nnx.Rngs(0), cache_method="sage",
      decode_options=dict(block_k=PS, num_splits=2), **kw)  # same numerics
  dense, paged = make(), make(num_pages=pool, page_size=PS)
  dense.init_cache((batch, max_len, feat))
  paged.init_cache((batch, max_len, feat))
  # the pool holds fewer pages than batch * 4: no page until set
  assert int(paged.page_indices[...].min()) == pool
  table = _tables(np.random.default_rng(2), pool, [4, 2, 3], 4,
                  tail=[0, 0, 0])
  assert jflax.QuantizedCacheAttention.set_page_tables(
      paged, table[:2], seq_ids=jnp.array([0, 1])) == 1
  # a shorter row: the missing entries are 0 (never read)
  paged.set_page_table(table[2:, :3], seq_ids=jnp.array([2]))
  np.testing.assert_array_equal(np.asarray(paged.page_indices[...]),
                                np.asarray(table))
  step = nnx.jit(lambda m, x: m(x))
  step_rows = nnx.jit(lambda m, x, ids, act: m(x, seq_ids=ids, active=act))
  x = _normal(0, (batch, 24, feat))
  for lo, hi in ((0, 20), (20, 21), (21, 22), (22, 23)):
    want, got = step(dense, x[:, lo:hi]), step(paged, x[:, lo:hi])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert paged.seq_lengths[...].tolist() == [23, 23, 23]
  # sequence 2 alone, then rows 0 and 2 with row 0 idle
  x2 = _normal(1, (1, 1, feat))
  # (one row, not three: the projections compile to another program,
  # whose float32 sums may round an ulp apart; at full float32 precision,
  # which a GPU's default, TF32, is not)
  with jax.default_matmul_precision("highest"):
    ref = step(dense, jnp.concatenate([x2, x2, x2]))[2:]
    got = step_rows(paged, x2, jnp.array([2]), jnp.array([True]))
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=1e-6)
  assert paged.seq_lengths[...].tolist() == [23, 23, 24]
  y = step_rows(paged, jnp.concatenate([x2, x2]), jnp.array([0, 2]),
                jnp.array([False, True]))
  np.testing.assert_array_equal(np.asarray(y[0, 0]),
                                np.asarray(paged.out.bias[...]))
  assert paged.seq_lengths[...].tolist() == [23, 23, 25]
  with pytest.raises(ValueError, match="seq_ids and active are for a paged"):
    dense(x2, active=jnp.array([True]))
  with pytest.raises(ValueError, match="page_size a power of two >= 16"):
    make(num_pages=pool, page_size=24)


# --- examples/serving.py ---------------------------------------------------

def _load_serving():
  spec = importlib.util.spec_from_file_location(
      "serving_example", Path(__file__).parents[1] / "examples" /
      "serving.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module   # (its dataclasses look the module up)
  spec.loader.exec_module(module)
  return module


def test_serving_example(capsys):
  """Continuous batching on a tiny configuration: requests of different
  prompt lengths join and leave, their pages are reused, and each
  request's tokens are those it gets when served alone."""
  serving = _load_serving()
  # (main's configuration is cfg: the jitted steps compile once)
  assert serving.main(["--requests", "4", "--max-batch", "3",
                       "--num-pages", "10", "--max-prompt", "60",
                       "--max-new", "6"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 5 and lines[-1].startswith("4 requests")
  cfg = serving.Config(num_pages=10, max_batch=3, max_seq_len=66)
  weights = serving.init_weights(jax.random.key(1), cfg)
  reqs = serving.random_requests(6, cfg, seed=3, max_prompt=60, max_new=6)
  done, stats = serving.serve(reqs, cfg, weights)
  assert sorted(done) == list(range(6))
  assert stats["pages_free_at_end"] == cfg.num_pages
  assert stats["peak_pages_in_use"] <= cfg.num_pages
  assert stats["pages_allocated"] > cfg.num_pages       # pages reused
  for r in reqs:   # alone: the other slots idle
    r.arrival = 0
    solo, _ = serving.serve([r], cfg, weights)
    assert solo[r.id] == done[r.id], r.id
    assert len(done[r.id]) == r.max_new_tokens
  a = serving.PageAllocator(3)
  assert a.allocate(4) is None and a.allocate(2) == [0, 1]
  a.free([1])
  assert a.num_free == 2 and a.allocate(2) == [2, 1]


def test_int8_query_needs_32_channels():
  """An int8 query's QK dot is Triton's 8-bit dot, which needs 32 channels:
  the kernel refuses fewer, and decode keeps the float query there (the
  kernel matches the reference at 16 channels)."""
  from pallas_kernels import paged
  cache = decode.KVCache.create(2, 64, 1, 16, method="int8")
  cache = decode.append(cache, _normal(1, (2, 40, 1, 16), 2.0),
                        _normal(2, (2, 40, 1, 16)), jnp.zeros(2, jnp.int32),
                        jnp.array([40, 17]))
  q8 = jnp.ones((2, 1, 2, 16), jnp.int8)
  with pytest.raises(ValueError, match="head dim of at least 32, got 16"):
    paged.paged_attention(
        q8, cache.k, cache.v, paged.dense_table(2, 1, 64, 16),
        jnp.array([40, 17]), cache.k_scale, cache.v_scale,
        q_scale=jnp.ones((2, 1, 2)), layout="dense", page=16, scale=0.25,
        compute_dtype=jnp.float16)
  q = _normal(3, (2, 1, 2, 16))
  lengths = jnp.array([40, 17])
  ref = decode.decode_attention(q, cache, lengths, method="int8",
                                implementation="reference")
  out = decode.decode_attention(q, cache, lengths, method="int8",
                                implementation="triton")
  assert float(jnp.abs(out - ref).max()) < KERNEL_ATOL["int8"]

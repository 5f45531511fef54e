"""The public API, ``jaxattn.dot_product_attention`` and the named functions:
drop-in parity with ``jax.nn.dot_product_attention``, dtypes, jit/vmap, input
validation, NaN propagation, degenerate inputs (zero queries/keys, rows that
see no key), the ``implementation`` switch, and property tests over shapes
against a float64 textbook attention.

XLA compiles each (method, shape, static options) once per process, ~1 s on
CPU, so most tests share the "standard" call (``std``: B=2 T=40 S=50 N=2
D=32, a boolean mask and the key lengths always passed as arrays): the named
functions, NaN propagation and the degenerate inputs all reuse its compiled
code.
"""
import functools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import api, methods, metrics
from jaxattn.metrics import exact_attention as textbook

F32 = np.float32
METHODS = sorted(jaxattn.METHODS)
B, T, S, N, D = 2, 40, 50, 2, 32


def qkv(seed, b=B, t=T, s=S, n=N, nk=None, d=D, dtype=F32):
  r = np.random.default_rng(seed)
  nk = n if nk is None else nk
  return tuple(jnp.asarray(r.standard_normal(sh, dtype=F32)).astype(dtype)
               for sh in ((b, t, n, d), (b, s, nk, d), (b, s, nk, d)))


def dpa(q, k, v, method="fp32", **kw):
  return jaxattn.dot_product_attention(q, k, v, method=method,
                                       implementation="reference", **kw)


def std(q, k, v, method, *, mask=None, lens=None, fn=None):
  """The standard call: mask [B, 1, T, S] and lengths [B] always arrays."""
  mask = np.ones((B, 1, T, S), bool) if mask is None else mask
  lens = np.full(B, S, np.int32) if lens is None else lens
  if fn is None:
    fn = functools.partial(jaxattn.dot_product_attention, method=method)
  return fn(q, k, v, mask=jnp.asarray(mask),
            key_value_seq_lengths=jnp.asarray(lens, jnp.int32),
            implementation="reference")


# ----------------------------------------------------------------------------
# Drop-in parity with jax.nn.dot_product_attention (float32, "fp32").

_r = np.random.default_rng(123)
_BIAS = _r.standard_normal((B, N, T, S)).astype(F32)
_MASK = _r.random((B, 1, T, S)) < 0.7

PARITY = {
    # name: (shape kwargs for qkv, call kwargs)
    "plain": ({}, {}),
    "causal": ({}, dict(is_causal=True)),
    "causal_cross_t_gt_s": (dict(t=60, s=40), dict(is_causal=True)),
    "bias": ({}, dict(bias=_BIAS)),
    "bias_broadcast": ({}, dict(bias=_BIAS[0, 0])),
    "mask": ({}, dict(mask=_MASK)),
    "kv_lengths": ({}, dict(key_value_seq_lengths=np.array([S, 17]))),
    "scale": ({}, dict(scale=0.3)),
    "gqa": (dict(n=4, nk=2), {}),
    "gqa_causal": (dict(n=4, nk=2, t=50, s=50), dict(is_causal=True)),
    "cross": (dict(t=23, s=70), {}),
}


@pytest.mark.parametrize("case", sorted(PARITY))
def test_parity_with_jax_nn(case):
  shape, kw = PARITY[case]
  q, k, v = qkv(7, **shape)
  kw = {name: jnp.asarray(x) if isinstance(x, np.ndarray) else x
        for name, x in kw.items()}
  out = dpa(q, k, v, **kw)
  ref = jax.nn.dot_product_attention(q, k, v, **kw)
  assert out.shape == ref.shape == q.shape and out.dtype == jnp.float32
  # Measured max abs diff 2.7e-7 - 8.3e-7 (outputs ~1).
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_parity_unbatched_3d():
  q, k, v = qkv(8, b=1)
  q, k, v = q[0], k[0], v[0]
  bias = jnp.asarray(_BIAS[0])                # [N, T, S]
  out = dpa(q, k, v, bias=bias, is_causal=True)
  ref = jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True)
  assert out.shape == ref.shape == (T, N, D)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------
# Dtypes, jit and vmap.

# Relative RMSE vs float64 of the rounded inputs (B=2 T=40 S=50 N=2 D=32);
# measured float16 / bfloat16 / float32: fp32 2.6e-4 / 2.1e-3 / 2.3e-7 (the
# output rounding), pasa 7.2e-4 / 1.8e-3 / 8.4e-4, int8 1.6e-2 / 1.5e-2 /
# 1.6e-2.
DTYPE_TOL = {"fp32": 5e-3, "pasa": 5e-3, "int8": 5e-2}


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("method", sorted(DTYPE_TOL))
def test_output_dtype_is_query_dtype(method, dtype):
  q, k, v = qkv(9, dtype=dtype)
  out = dpa(q, k, v, method)
  assert out.dtype == dtype and out.shape == q.shape
  err = metrics.relative_rmse(out, textbook(q, k, v))
  assert err < DTYPE_TOL[method], err


def test_jit_matches_eager():
  q, k, v = qkv(10)
  lens = jnp.array([S, 21])
  eager = dpa(q, k, v, is_causal=True, key_value_seq_lengths=lens)
  fn = jax.jit(lambda q, k, v, lens: jaxattn.dot_product_attention(
      q, k, v, is_causal=True, key_value_seq_lengths=lens,
      implementation="reference"))
  out = fn(q, k, v, lens)   # traced lengths: no range check, same numbers
  np.testing.assert_array_equal(out, eager)
  np.testing.assert_allclose(
      eager, textbook(q, k, v, is_causal=True, kv_lens=lens), atol=1e-5)


def test_vmap_matches_eager():
  q, k, v = qkv(11)
  qs = jnp.stack([q, 0.5 * q, -q])                # [3, B, T, N, D]
  fn = jax.vmap(lambda q: dpa(q, k, v, is_causal=True))
  out = fn(qs)
  assert out.shape == (3, B, T, N, D)
  for i in range(3):
    eager = dpa(qs[i], k, v, is_causal=True)
    np.testing.assert_allclose(out[i], eager, rtol=1e-6, atol=1e-6)
  # Mapped over the batch of every input (4-D slices of 5-D stacks).
  ks, vs = jnp.stack([k, k[::-1]]), jnp.stack([v, v[::-1]])
  out2 = jax.vmap(lambda q, k, v: dpa(q, k, v, is_causal=True))(qs[:2], ks, vs)
  np.testing.assert_allclose(
      out2[1], dpa(qs[1], k[::-1], v[::-1], is_causal=True), rtol=1e-6,
      atol=1e-6)


# ----------------------------------------------------------------------------
# Named functions.

NAMED = {
    "fp32": jaxattn.fp32_attention,
    "fp16_fp32": jaxattn.fp16_fp32_attention,
    "fp16": jaxattn.fp16_attention,
    "pasa": jaxattn.pasa_attention,
    "sage": jaxattn.sage_attention,
    "int8": jaxattn.int8_attention,
    "fmha_int8": jaxattn.fmha_int8,
    "fp8": jaxattn.fp8_attention,
}


def test_named_functions_cover_methods():
  assert sorted(NAMED) == METHODS


# Relative RMSE vs float64 of the standard call on N(0, 1) data; measured
# fp32 2.3e-7, fp16_fp32 6.0e-4, fp16 8.7e-4, pasa 8.6e-4, sage 3.4e-2,
# int8 1.5e-2, fmha_int8 1.9e-2, fp8 5.1e-2.
NAMED_TOL = {
    "fp32": 1e-6, "fp16_fp32": 1.5e-3, "fp16": 2e-3, "pasa": 2e-3,
    "sage": 8e-2, "int8": 4e-2, "fmha_int8": 5e-2, "fp8": 1.2e-1,
}


@pytest.mark.parametrize("method", METHODS)
def test_named_function_equals_method(method):
  q, k, v = qkv(12)
  named = std(q, k, v, method, fn=NAMED[method])
  ref = std(q, k, v, method)
  np.testing.assert_array_equal(named, ref)
  assert named.dtype == jnp.float32 and named.shape == q.shape
  assert metrics.relative_rmse(named, textbook(q, k, v)) < NAMED_TOL[method]
  # Options go through: an unknown one is refused by name.
  with pytest.raises(TypeError, match="unknown option"):
    NAMED[method](q, k, v, not_an_option=1)


# ----------------------------------------------------------------------------
# Bad input.

_q, _k, _v = (np.ones((2, 8, 2, 16), F32) for _ in range(3))


def _bad(**over):
  args = dict(query=_q, key=_k, value=_v)
  args.update(over)
  return args


BAD = [
    # (id, call kwargs, exception, match)
    ("query_rank2", _bad(query=_q[0, 0]), ValueError, "rank 4"),
    ("query_rank5", _bad(query=_q[None], key=_k[None], value=_v[None]),
     ValueError, "rank 4"),
    ("key_rank3", _bad(key=_k[0]), ValueError, "same rank"),
    ("batch_q", _bad(query=_q[:1]), ValueError, "batch sizes differ"),
    ("batch_v", _bad(value=_v[:1]), ValueError, "batch sizes differ"),
    ("head_dim_k", _bad(key=_k[..., :8]), ValueError,
     "query and key head dims differ"),
    ("head_dim_v", _bad(value=_v[..., :8]), ValueError, "value head dim"),
    ("seq_k_vs_v", _bad(value=_v[:, :5]), ValueError,
     "must agree on sequence length and heads"),
    ("heads_k_vs_v", _bad(value=_v[:, :, :1]), ValueError,
     "must agree on sequence length and heads"),
    ("int_query", _bad(query=_q.astype(np.int32)), TypeError,
     "query must be float"),
    ("int_value", _bad(value=_v.astype(np.int32)), TypeError,
     "value must be float"),
    ("not_array", _bad(key=[[1.0]]), TypeError, "key must be an array"),
    ("gqa_not_multiple", _bad(query=np.ones((2, 8, 3, 16), F32)), ValueError,
     r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
    ("head_dim_300", _bad(**{n: np.ones((1, 4, 1, 300), F32)
                            for n in ("query", "key", "value")}),
     ValueError, "head_dim 300 > 256"),
    ("empty_seq", _bad(query=_q[:, :0]), ValueError, "empty dimension"),
    ("kv_len_high", _bad(key_value_seq_lengths=np.array([8, 9])), ValueError,
     r"must lie in \[0, 8\]"),
    ("kv_len_negative", _bad(key_value_seq_lengths=np.array([-1, 3])),
     ValueError, r"must lie in \[0, 8\]"),
    ("kv_len_shape", _bad(key_value_seq_lengths=np.array([3])), ValueError,
     r"key_value_seq_lengths must be an integer array of shape \(2,\)"),
    ("kv_len_float", _bad(key_value_seq_lengths=np.array([3.0, 4.0])),
     ValueError, "key_value_seq_lengths must be an integer array"),
    ("bias_shape", _bad(bias=np.zeros((3, 8, 8), F32)), ValueError,
     "bias of shape .* does not broadcast"),
    ("bias_int", _bad(bias=np.zeros((8, 8), np.int32)), TypeError,
     "bias must be floating"),
    ("mask_shape", _bad(mask=np.ones((8, 7), bool)), ValueError,
     "mask of shape .* does not broadcast"),
    ("mask_not_bool", _bad(mask=np.ones((8, 8), np.int32)), TypeError,
     "mask must be boolean"),
    ("mask_float", _bad(mask=np.ones((8, 8), F32)), TypeError,
     "mask must be boolean"),
    ("unknown_method", _bad(method="fp64"), ValueError,
     r"unknown method 'fp64'; available: \[.*'fp32'.*'pasa'.*'sage'"),
    ("unknown_option", _bad(method="pasa", blockk=64), TypeError,
     r"unknown option\(s\) \['blockk'\].*valid options: \[.*'block_k'"),
    ("unknown_option_fp32", _bad(beta=0.5), TypeError,
     r"unknown option\(s\) \['beta'\] for FlashConfig"),
    ("implementation_xla", _bad(implementation="xla"), ValueError,
     "implementation must be one of"),
    ("implementation_case", _bad(implementation="Pallas"), ValueError,
     "implementation must be one of"),
    ("bad_beta", _bad(method="pasa", beta=1.0), ValueError,
     r"beta must be in \[0, 1\)"),
    ("bad_block_k", _bad(block_k=48), ValueError, "power of two"),
    ("scale_nan", _bad(scale=float("nan")), ValueError,
     "scale must be finite, got nan"),
    ("scale_inf", _bad(method="pasa", scale=-float("inf")), ValueError,
     "scale must be finite, got -inf"),
    ("scale_str", _bad(scale="a"), TypeError, "scale must be a real number"),
    # a 64-bit length is checked before int32 would wrap it to 5
    ("kv_len_wraps", _bad(key_value_seq_lengths=np.array([2**32 + 5, 3])),
     ValueError, r"must lie in \[0, 8\], got values in \[3, 4294967301\]"),
]


@pytest.mark.parametrize("kwargs, exc, match", [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])
def test_bad_input(kwargs, exc, match):
  kwargs = dict(kwargs)
  q, k, v = (kwargs.pop(n) for n in ("query", "key", "value"))
  with pytest.raises(exc, match=match):
    jaxattn.dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("impl", ["triton", "mosaic"])
def test_zero_and_negative_scales_on_the_kernels(impl):
  """jax.nn takes any finite scale.  The kernels need a positive one (the
  row max of the scaled scores): a negative scale negates the queries and a
  zero scale zeroes them, so both match float32 jax.nn (a zero scale
  weighs the visible keys equally; before, the kernels returned NaN rows
  or the wrong rows here)."""
  q, k, v = (jax.random.normal(x, (1, 40, 2, 64), F32).astype(jnp.float16)
             for x in jax.random.split(jax.random.key(3), 3))
  for scale, causal in ((0.0, True), (-0.125, False)):
    want = jax.nn.dot_product_attention(
        *(x.astype(F32) for x in (q, k, v)), scale=scale, is_causal=causal)
    got = jaxattn.dot_product_attention(q, k, v, scale=scale,
                                        is_causal=causal, implementation=impl)
    np.testing.assert_allclose(np.asarray(got, F32), np.asarray(want),
                               atol=2e-3)


def test_mosaic_fp32_takes_keys_of_another_dtype():
  """Mosaic's fp32 kernel multiplies 16-bit operands of one dtype: keys
  and values of another are cast to the query's, as Triton's kernel does
  (before, the call failed inside Mosaic on bfloat16 queries and float16
  keys)."""
  q, k, v = (jax.random.normal(x, (1, 40, 1, 64), F32).astype(jnp.float16)
             for x in jax.random.split(jax.random.key(5), 3))
  bf = jnp.bfloat16
  got = jaxattn.dot_product_attention(q.astype(bf), k, v,
                                      implementation="mosaic")
  want = jaxattn.dot_product_attention(q.astype(bf), k.astype(bf),
                                       v.astype(bf), implementation="mosaic")
  assert got.dtype == bf
  np.testing.assert_array_equal(np.asarray(got, F32), np.asarray(want, F32))


def test_kernels_under_x64_and_window_sides_beyond_int32():
  """With ``jax_enable_x64`` on, the kernels run on 16-bit inputs (they
  trace with x64 off) and give the x64-off bits; float64 inputs go to the
  reference.  A window side past int32 is clamped (it hides no key)."""
  q, k, v = (jax.random.normal(x, (1, 40, 2, 64), F32).astype(jnp.float16)
             for x in jax.random.split(jax.random.key(4), 3))
  lens = jnp.array([33], jnp.int32)
  call = functools.partial(jaxattn.dot_product_attention, q, k, v,
                           method="sage", implementation="triton",
                           key_value_seq_lengths=lens)
  want = call()
  with jax.enable_x64(True):
    got = call()
    f64 = [x.astype(jnp.float64) for x in (q, k, v)]
    assert jaxattn.dot_product_attention(*f64).dtype == jnp.float64
    with pytest.raises(NotImplementedError, match="take no float64 inputs"):
      jaxattn.dot_product_attention(*f64, implementation="triton")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  wide = jaxattn.dot_product_attention(q, k, v, local_window_size=(10**12, 1),
                                       implementation="reference")
  one_sided = jaxattn.dot_product_attention(
      q, k, v, local_window_size=(None, 1), implementation="reference")
  np.testing.assert_array_equal(np.asarray(wide), np.asarray(one_sided))


def test_unknown_method_lists_every_method():
  with pytest.raises(ValueError) as e:
    jaxattn.dot_product_attention(_q, _k, _v, method="nope")
  assert all(repr(m) in str(e.value) for m in METHODS)


def test_unknown_option_names_valid_options():
  with pytest.raises(TypeError) as e:
    jaxattn.dot_product_attention(_q, _k, _v, method="sage", bogus=True)
  for name in ("preset", "qk_dtype", "qk_granularity", "pv_dtype",
               "smooth_k"):
    assert name in str(e.value)


# ----------------------------------------------------------------------------
# NaN propagation and degenerate inputs (the standard call).


@pytest.mark.parametrize("method", ["fp32", "pasa"])
def test_nan_in_one_query_row_stays_in_that_row(method):
  q, k, v = qkv(13)
  q = q.at[1, 7, 1, 3].set(jnp.nan)
  out = np.asarray(std(q, k, v, method))
  bad = np.isnan(out).any(-1)                      # [B, T, N]
  assert np.argwhere(bad).tolist() == [[1, 7, 1]]
  assert np.isnan(out[1, 7, 1]).all()
  assert np.isfinite(np.delete(out.reshape(-1, D), 1 * T * N + 7 * N + 1,
                               axis=0)).all()


def _rows_seeing(t, s, kv_len, causal, mask, j):
  """numpy ``[T]``: which query rows see key ``j``."""
  rows = np.full(t, j < kv_len)
  if causal:
    rows &= np.arange(t) >= j
  if mask is not None:
    rows &= mask[:, j]
  return rows


# (tensor, value, causal, with a mask): one corrupted element each, in
# three kinds of call (each method compiles three, not four); the Mosaic
# kernel, which takes no mask, runs the five without one.
NONFINITE_CASES = [("q", np.inf, True, False), ("q", np.nan, False, False),
                   ("k", np.nan, True, False), ("k", np.inf, False, False),
                   ("v", np.nan, True, True), ("v", -np.inf, True, False)]


@pytest.mark.parametrize("method", list(jaxattn.METHODS))
@pytest.mark.parametrize("impl", ["reference", "triton", "mosaic"])
def test_nonfinite_reaches_the_rows_it_reaches_in_float32(method, impl):
  """The flash methods (fp32, fp16_fp32, fp16) poison the rows float32
  attention poisons.  In the others (``confine_nonfinite``), one NaN/Inf in
  Q, K or V (causal or not, with a mask or not) makes NaN exactly the rows
  it reaches: a query row that sees a key, or the rows
  that see the corrupted key or value (computed here in numpy).  Float32
  attention poisons the same rows, except two cases that are documented:
  an infinite key is ignored by float32 attention in the rows where its
  score is -inf (jaxattn: NaN there too, never a finite wrong row), and
  float32 flash attention also poisons rows that multiply a NaN value by a
  masked probability of 0 (jaxattn keeps those finite).  Every other row
  equals the same call with the corrupted element set to 0: one bad value
  does not move the scales, means or shifts of its neighbours."""
  b, t, s, n, d = 1, 90, 70, 2, 64   # t > s: causal rows past every key
  r = np.random.default_rng(3)
  base = {x: r.standard_normal((b, t if x == "q" else s, n if x == "q" else 1,
                                d)).astype(F32) for x in "qkv"}
  mask = r.random((t, s)) < 0.7
  for where, value, causal, with_mask in NONFINITE_CASES:
    m = mask if with_mask else None
    kw = dict(is_causal=causal, mask=None if m is None else jnp.asarray(m))
    pos = 13
    bad, zeroed = dict(base), dict(base)
    bad[where] = base[where].copy()
    bad[where][0, pos, 0, 5] = value
    zeroed[where] = base[where].copy()
    zeroed[where][0, pos, 0, 5] = 0.0
    as16 = lambda x: {n_: jnp.asarray(a, jnp.float16) for n_, a in x.items()}
    bad16, zero16 = as16(bad), as16(zeroed)
    try:
      api.resolve_implementation(bad16["q"], bad16["k"], bad16["v"],
                                 method=method, implementation=impl, **kw)
    except NotImplementedError:
      continue
    run = lambda x: np.asarray(jaxattn.dot_product_attention(
        x["q"], x["k"], x["v"], method=method, implementation=impl, **kw),
        np.float32)
    out, clean = run(bad16), run(zero16)
    got = ~np.isfinite(out).all(-1)[0]                       # [T, N]
    f32 = ~np.isfinite(np.asarray(jaxattn.dot_product_attention(
        *(jnp.asarray(a, jnp.float16).astype(jnp.float32)
          for a in (bad["q"], bad["k"], bad["v"])),
        implementation="reference", **kw))).all(-1)[0]
    want = np.zeros((t, n), bool)
    if where == "q":
      sees_any = np.array([_rows_seeing(t, s, s, causal, m, j)
                           for j in range(s)]).any(0)
      want[pos, 0] = sees_any[pos]
    else:
      want[:, :] = _rows_seeing(t, s, s, causal, m, pos)[:, None]
    case = (where, value, causal, with_mask)
    if not methods.get(method).confine_nonfinite:  # float32's own behaviour
      assert (got == f32).all(), (case, np.argwhere(got != f32).tolist())
      continue
    assert (got == want).all(), (case, np.argwhere(got != want).tolist())
    if where == "k" and np.isinf(value):
      assert (f32 <= want).all(), case
    elif where == "v":
      assert (want <= f32).all(), case
    else:
      assert (want == f32).all(), case
    np.testing.assert_array_equal(out[0][~got], clean[0][~got], err_msg=str(case))


# Relative RMSE of uniform attention (zero Q and K) against mean(V); the
# mean of 50 N(0, 1) values is small (~0.14), so V's quantization shows.
# Measured: fp32 3.6e-8, fp16_fp32 2.0e-4, fp16 4.3e-4, pasa 4.3e-4,
# sage 2.5e-2, int8 7.0e-3, fmha_int8 9.2e-3, fp8 2.7e-2.
DEGENERATE_TOL = {
    "fp32": 1e-6, "fp16_fp32": 1e-3, "fp16": 1e-3, "pasa": 1e-3,
    "sage": 6e-2, "int8": 2e-2, "fmha_int8": 2.5e-2, "fp8": 6e-2,
}


@pytest.mark.parametrize("method", METHODS)
def test_zero_query_key_and_rows_without_keys(method):
  """Batch 0: zero Q and K (uniform attention = mean of V), its row 3 fully
  masked; batch 1: key_value_seq_lengths = 0 (no row sees a key)."""
  _, _, v = qkv(14)
  q = jnp.zeros((B, T, N, D), F32)
  k = jnp.zeros((B, S, N, D), F32)
  mask = np.ones((B, 1, T, S), bool)
  mask[0, 0, 3, :] = False
  out = np.asarray(std(q, k, v, method, mask=mask, lens=np.array([S, 0])))
  assert out.dtype == np.float32 and out.shape == (B, T, N, D)
  assert not np.isnan(out).any()
  np.testing.assert_array_equal(out[0, 3], 0.0)        # all-False mask row
  np.testing.assert_array_equal(out[1], 0.0)           # kv length 0
  rows = np.delete(out[0], 3, axis=0)                  # [T-1, N, D]
  mean_v = np.broadcast_to(np.asarray(v[0]).mean(0), rows.shape)
  assert metrics.relative_rmse(rows, mean_v) < DEGENERATE_TOL[method]


# ----------------------------------------------------------------------------
# The implementation switch.


def test_pallas_fp32_interpret():
  q, k, v = qkv(15, b=1, t=20, s=30)
  out = jaxattn.dot_product_attention(q, k, v, method="fp32",
                                      implementation="triton")
  assert out.dtype == jnp.float32 and out.shape == q.shape
  # Measured max abs diff to float64 3.0e-7.
  np.testing.assert_allclose(out, textbook(q, k, v), atol=2e-6)


def test_triton_fp8_not_implemented():
  with pytest.raises(NotImplementedError, match="'fp8' has no Triton kernel"):
    jaxattn.dot_product_attention(_q, _k, _v, method="fp8",
                                  implementation="triton")


def test_methods_with_kernels():
  has = {m: m in jaxattn.api.BACKENDS["triton"].ADAPTERS for m in METHODS}
  assert not has["fp8"]
  assert has["fp32"] and has["pasa"]
  assert set(jaxattn.api.BACKENDS["reference"].ADAPTERS) == set(METHODS)


def test_backend_defaults_fill_only_unset_options():
  """sage runs 128-key blocks on the Mosaic kernel (SageAttention2's sm90
  block) unless the call or its preset sets block_k; other backends keep
  the config's 64."""
  def block_k(impl, **options):
    config = methods.get("sage").config_cls.from_options(**options)
    return api.backend_config("sage", impl, config, options).block_k
  assert block_k("mosaic") == block_k("mosaic", preset="sage2-4b") == 128
  assert block_k("mosaic", block_k=64) == 64
  assert block_k("mosaic", preset="sage1") == 64   # SageAttention 1.0.6's
  assert block_k("triton") == block_k("reference") == 64
  assert block_k("triton", block_k=128) == 128
  full = api.backend_config(
      "sage", "mosaic", methods.get("sage").config_cls(), {})
  assert full == methods.get("sage").config_cls(block_k=128)
  with pytest.warns(DeprecationWarning):   # the deprecated name resolves
    assert block_k("pallas") == 64
  with pytest.raises(ValueError, match="backend name"):
    block_k(None)
  # methods without defaults keep their config object, and so do calls
  # where a method's defaults change nothing (full INT8's 256-key blocks
  # are for calls that are not causal)
  cfg = methods.get("fmha_int8").config_cls()
  assert api.backend_config("fmha_int8", "mosaic", cfg, {}) is cfg
  cfg = methods.get("int8").config_cls()
  assert api.backend_config("int8", "mosaic", cfg, {}, is_causal=True) is cfg
  assert api.backend_config("int8", "mosaic", cfg, {}).block_k == 256


def test_pallas_is_the_deprecated_name_of_triton():
  with pytest.warns(DeprecationWarning, match="'pallas' is now 'triton'"):
    old = jaxattn.dot_product_attention(_q, _k, _v, method="int8",
                                        implementation="pallas")
  new = jaxattn.dot_product_attention(_q, _k, _v, method="int8",
                                      implementation="triton")
  np.testing.assert_array_equal(np.asarray(old), np.asarray(new))


# ----------------------------------------------------------------------------
# Property tests over shapes: "fp32" against float64 textbook attention.


@settings(max_examples=10, deadline=None, derandomize=True, database=None)
@given(b=st.integers(1, 2), t=st.integers(1, 70), s=st.integers(1, 70),
       nk=st.integers(1, 2), group=st.integers(1, 2),
       d=st.sampled_from([16, 32, 48, 64]), causal=st.booleans(),
       seed=st.integers(0, 2**16), data=st.data())
def test_fp32_matches_textbook_over_shapes(b, t, s, nk, group, d, causal,
                                           seed, data):
  lens = np.array(data.draw(st.lists(st.integers(0, s), min_size=b,
                                     max_size=b)), np.int32)
  q, k, v = qkv(seed, b=b, t=t, s=s, n=nk * group, nk=nk, d=d)
  out = np.asarray(dpa(q, k, v, is_causal=causal,
                       key_value_seq_lengths=jnp.asarray(lens)))
  ref = textbook(q, k, v, is_causal=causal, kv_lens=lens)
  assert out.shape == ref.shape == (b, t, nk * group, d)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=2e-6)
  # Rows that see no key are exactly zero (kv length 0; causal rows always
  # see key 0 otherwise).
  for i in range(b):
    if lens[i] == 0:
      np.testing.assert_array_equal(out[i], 0.0)
    else:
      assert np.abs(out[i]).max() > 0


# ----------------------------------------------------------------------------
# GQA equals repeating K and V.

# Max abs diff, grouped (vmapped, K/V shared) vs repeated heads: measured
# fp32 4.8e-7, pasa 6.0e-8 (1.2e-4 = one float16 ulp on other data: the
# matmul order differs), int8 0.
GQA_TOL = {"fp32": 2e-6, "pasa": 1e-3, "int8": 1e-6}


@pytest.mark.parametrize("method", sorted(GQA_TOL))
def test_gqa_equals_repeated_kv(method):
  q, k, v = qkv(16, n=4, nk=2)
  out = dpa(q, k, v, method, is_causal=True)
  rep = dpa(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), method,
            is_causal=True)
  assert out.shape == rep.shape == q.shape
  # (jnp.repeat gives heads [0, 0, 1, 1]: query heads 0, 1 use key head 0.)
  assert float(jnp.abs(out - rep).max()) <= GQA_TOL[method]


@pytest.mark.parametrize("method,impl", [
    ("sage", "reference"), ("sage", "triton"), ("int8", "reference"),
    ("int8", "triton"), ("fmha_int8", "reference"), ("fmha_int8", "triton"),
    ("fp8", "reference")])
def test_quantized_methods_propagate_nonfinite(method, impl):
  """Quantizers would turn NaN/Inf into finite integers: the API makes the
  rows a non-finite input reaches NaN instead of silently wrong numbers."""
  q = jax.random.normal(jax.random.key(11), (2, 32, 2, 64), jnp.float16)
  lens = jnp.array([32, 10])
  out = np.asarray(jaxattn.dot_product_attention(
      q.at[0, 3, 0, 5].set(jnp.nan), q, q, method=method,
      implementation=impl, key_value_seq_lengths=lens), np.float32)
  assert np.isnan(out[0, 3, 0]).all()
  assert np.isfinite(out[1]).all()          # another batch element: clean
  k_inf = q.at[1, 5, 1, 0].set(jnp.inf)      # a visible key of batch 1
  out = np.asarray(jaxattn.dot_product_attention(
      q, k_inf, q, method=method, implementation=impl,
      key_value_seq_lengths=lens), np.float32)
  assert np.isnan(out[1, :, 1]).all()
  k_pad = q.at[1, 20, 1, 0].set(jnp.nan)     # past kv_len: never seen
  out = np.asarray(jaxattn.dot_product_attention(
      q, k_pad, q, method=method, implementation=impl,
      key_value_seq_lengths=lens), np.float32)
  assert np.isfinite(out).all()

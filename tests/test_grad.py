"""Gradients and the log-sum-exp residual, for every method on every backend
(the kernels in interpret mode), against ``jax.grad`` of float32
``jax.nn.dot_product_attention``:

* the gradient is the exact gradient of attention at the inputs (straight
  through the quantization, :mod:`jaxattn.grad`), so every method matches
  float32 jax.nn to float32 rounding on float32 inputs, and to the float16
  rounding of the gradient itself on float16 inputs (the Mosaic kernel);
* with causal, grouped-query, padded (``key_value_seq_lengths``, a batch
  row with no key, which gets no gradient) and cross-attention inputs on
  every method and backend, and with a bias (whose gradient is checked
  too) and a dense mask on every reference and the Triton fp32 kernel;
* ``return_residual=True`` gives jax.nn's log-sum-exp, including its value
  for rows that see no key.
"""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import api, grad

F32 = jnp.float32
# methods whose log-sum-exp residual is their kernel's own, from float16
# scores on the Triton backend: P = exp(s - lse) carries its rounding
GRAD_TOL = {"fp16": 1e-3, "fp16_fp32": 1e-3, "pasa": 1e-3}
# float32 inputs: float32 rounding on the CPU; on a GPU the Triton kernels'
# float32 products (the forward's log-sum-exp) run in TF32 (measured on an
# H100 at 1x2048x8x64: 5.3e-4 against float32 jax.nn)
F32_TOL = 2e-3 if jax.default_backend() == "gpu" else 1e-5
B, T, S, N, K, D = 2, 37, 45, 4, 2, 32


def _combos():
  """(method, implementation) for every backend that has the method."""
  return [(m, impl) for impl in api.PREFERENCE for m in jaxattn.METHODS
          if m in api.BACKENDS[impl].ADAPTERS]


def _inputs(seed, *, t=T, s=S, d=D, dtype=F32):
  r = np.random.default_rng(seed)
  x = lambda *shape: jnp.asarray(r.standard_normal(shape), dtype)
  return x(B, t, N, d), x(B, s, K, d), x(B, s, K, d), x(B, t, N, d)


# The bias (with its gradient) and dense-mask cases, on every method's
# reference and on the Triton fp32 kernel (the Mosaic kernel refuses both;
# the backward does not depend on the method's forward, so these check the
# bias and mask plumbing); every (method, backend) runs
# test_gradient_and_residual_in_one_call.
CASES = {
    "bias": dict(bias=True, lens=(S, 20)),
    "mask": dict(mask=True, is_causal=True),
}


def _grad_params():
  return [(m, impl, case) for m, impl in _combos() for case in CASES
          if impl == "reference" or (impl, m) == ("triton", "fp32")]


def _call_kwargs(case, r):
  kw = {}
  if "lens" in case:
    kw["key_value_seq_lengths"] = jnp.asarray(case["lens"], jnp.int32)
  if case.get("is_causal"):
    kw["is_causal"] = True
  t, s = case.get("t", T), case.get("s", S)
  if case.get("mask"):
    # every row keeps its diagonal key: jax.nn attends uniformly in a row
    # that sees none, where jaxattn returns 0 (test_rows_without_keys...)
    keep = (r.random((B, 1, t, s)) < 0.7) | np.eye(t, s, dtype=bool)
    kw["mask"] = jnp.asarray(keep)
  if case.get("bias"):
    kw["bias"] = jnp.asarray(r.standard_normal((B, N, t, s)), F32)
  return kw


def _loss(fn, w, **kw):
  def loss(q, k, v, bias=None):
    extra = dict(kw)
    if bias is not None:
      extra["bias"] = bias
    return jnp.sum(fn(q, k, v, **extra).astype(F32) * w)
  return loss


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("method,impl,case", _grad_params())
def test_gradient_matches_float32_jax_nn(method, impl, case):
  c = CASES[case]
  r = np.random.default_rng(5)
  kw = _call_kwargs(c, r)
  bias = kw.pop("bias", None)
  # the Mosaic kernel takes float16 inputs; its gradient comes out float16
  dtype = jnp.float16 if impl == "mosaic" else F32
  q, k, v, w = _inputs(7, t=c.get("t", T), s=c.get("s", S), dtype=dtype)
  argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
  f32 = lambda x: x.astype(F32)
  with jax.default_matmul_precision("highest"):   # not TF32 on a GPU
    want = jax.grad(_loss(jax.nn.dot_product_attention, f32(w), **kw),
                    argnums=argnums)(f32(q), f32(k), f32(v), bias)
  got = jax.grad(_loss(
      lambda *a, **o: jaxattn.dot_product_attention(
          *a, method=method, implementation=impl, **o), f32(w), **kw),
                 argnums=argnums)(q, k, v, bias)
  tol = 2e-3 if dtype == jnp.float16 else GRAD_TOL.get(method, F32_TOL)
  for name, g, ref in zip("qkvb", got, want):
    assert g.dtype == (dtype if name != "b" else F32), (name, g.dtype)
    assert np.isfinite(np.asarray(g, np.float32)).all(), name
    err = _rel(g, ref)
    assert err < tol, (method, impl, case, name, err)


@pytest.mark.parametrize("method,impl", _combos())
def test_gradient_and_residual_in_one_call(method, impl):
  """``jax.vjp`` of ``return_residual=True`` (one forward): causal, GQA,
  T > S, batch rows with all keys, 20 keys and none.  The output equals
  the plain call's where a kernel writes the log-sum-exp itself; the
  log-sum-exp is float32 ``[B, T, N]`` equal to
  jax.nn's (its value, ``grad.MASK_VALUE``, in the row with no key); the
  gradients equal float32 jax.nn's in the rows with keys and are 0 in the
  row without (jaxattn outputs 0 there, jax.nn attends uniformly)."""
  dtype = jnp.float16 if impl == "mosaic" else F32
  r = np.random.default_rng(3)
  t, s = 50, 45
  x = lambda *shape: jnp.asarray(r.standard_normal(shape), dtype)
  q, k, v, w = x(3, t, N, D), x(3, s, K, D), x(3, s, K, D), x(3, t, N, D)
  lens = jnp.asarray([s, 20, 0], jnp.int32)
  kw = dict(is_causal=True, key_value_seq_lengths=lens)
  f32 = lambda a: a.astype(F32)
  (out, lse), vjp = jax.vjp(lambda q, k, v: jaxattn.dot_product_attention(
      q, k, v, method=method, implementation=impl, return_residual=True,
      **kw), q, k, v)
  got = vjp((w.astype(out.dtype), jnp.zeros_like(lse)))
  if api.BACKENDS[impl].ADAPTERS[method].run_lse is not None:
    # the kernel variant that also writes the log-sum-exp (other adapters
    # run the plain call and a separate float32 pass)
    plain = jaxattn.dot_product_attention(q, k, v, method=method,
                                          implementation=impl, **kw)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))
  with jax.default_matmul_precision("highest"):   # not TF32 on a GPU
    (_, want_lse), ref_vjp = jax.vjp(
        lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, return_residual=True, **kw), f32(q), f32(k), f32(v))
    want = ref_vjp((f32(w), jnp.zeros_like(want_lse)))
  assert lse.shape == (3, t, N) and lse.dtype == F32
  np.testing.assert_array_equal(np.asarray(lse[2]), np.asarray(want_lse[2]))
  assert float(lse[2, 0, 0]) == grad.MASK_VALUE
  # the float16-score kernels' own log-sum-exp carries float16 scores; on a
  # GPU the float32 ones TF32 products
  lse_tol = (2e-2 if method in ("fp16", "fp16_fp32", "pasa")
             else 1e-2 if jax.default_backend() == "gpu" else 1e-5)
  np.testing.assert_allclose(np.asarray(lse[:2]), np.asarray(want_lse[:2]),
                             atol=lse_tol, rtol=0)
  tol = 2e-3 if dtype == jnp.float16 else GRAD_TOL.get(method, F32_TOL)
  for name, g, ref in zip("qkv", got, want):
    assert g.dtype == dtype and np.all(np.asarray(g[2]) == 0), name
    err = _rel(g[:2], ref[:2])
    assert err < tol, (method, impl, name, err)


def test_residual_unbatched_and_named_function():
  q, k, v, _ = _inputs(4)
  out, lse = jaxattn.sage_attention(q[0], k[0], v[0], return_residual=True)
  assert out.shape == (T, N, D) and lse.shape == (T, N)


def test_xla_vjp_blocks_of_rows_agree():
  """The blocked XLA backward equals the one-block one (T not a multiple
  of the block)."""
  q, k, v, w = _inputs(9)
  lens = jnp.asarray([S, 11], jnp.int32)
  lse = grad.logsumexp(q, k, None, None, lens, scale=0.2, is_causal=True)
  one = grad.xla_vjp(q, k, v, None, None, lens, lse, w, scale=0.2,
                     is_causal=True, rows=T)
  blocked = grad.xla_vjp(q, k, v, None, None, lens, lse, w, scale=0.2,
                         is_causal=True, rows=8)
  for a, b in zip(one[:3], blocked[:3]):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-6)


def test_int8_output_is_not_differentiated_but_still_runs():
  q, k, v, _ = _inputs(2)
  o8, scale = jaxattn.dot_product_attention(q, k, v, method="fmha_int8",
                                            return_int8=True)
  assert o8.dtype == jnp.int8 and scale.dtype == F32


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("t,s,d", [(37, 45, 32), (50, 30, 40)])
def test_triton_backward_kernel_equals_xla_backward(t, s, d, is_causal):
  """The Pallas Triton backward (interpret mode here; the path of GPU calls
  cuDNN refuses) against the XLA form: GQA, a batch row with 11 keys and
  one with none, lengths that are not multiples of the blocks, a head dim
  that is not a power of two."""
  q, k, v, w = _inputs(8, t=t, s=s, d=d)
  lens = jnp.asarray([11, 0], jnp.int32)
  scale = 1.0 / np.sqrt(d)
  lse = grad.logsumexp(q, k, None, None, lens, scale=scale,
                       is_causal=is_causal)
  want = grad.xla_vjp(q, k, v, None, None, lens, lse, w, scale=scale,
                      is_causal=is_causal)[:3]
  got = grad.pallas_vjp(q, k, v, lens, w, scale=scale, is_causal=is_causal)
  # and from the residuals of an exact forward (what method="fp32" passes),
  # jax.nn's MASK_VALUE in the row with no key
  out, res = jaxattn.dot_product_attention(
      q, k, v, scale=scale, is_causal=is_causal, key_value_seq_lengths=lens,
      implementation="reference", return_residual=True)
  from_residuals = grad.pallas_vjp(q, k, v, lens, w, scale=scale,
                                   is_causal=is_causal, out=out, lse=res)
  for name, a, b in [*zip("qkv", got, want),
                     *zip("qkv", from_residuals, want)]:
    assert a.shape == b.shape, name
    # float32 sums in another order (on a GPU, the kernel's float32
    # products are TF32, as jax's default precision has them there):
    # elementwise, relative to the largest
    scale_b = float(np.abs(np.asarray(b)).max())
    assert float(np.abs(np.asarray(a) - np.asarray(b)).max()) < F32_TOL * scale_b
    assert _rel(a, b) < F32_TOL, name
  assert np.all(np.asarray(got[0][1]) == 0)   # the row with no key
  assert np.all(np.asarray(from_residuals[0][1]) == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [False, True])
def test_cudnn_backward_from_residuals_equals_its_recompute(is_causal):
  """On a GPU: cuDNN's backward from the fp32 kernel's output and
  log-sum-exp (what the VJP of ``method="fp32"`` runs) against cuDNN's
  backward after its own forward, and both against float32 jax.nn: GQA,
  lengths that are not multiples of the blocks, a batch row with 100 keys."""
  if grad.cudnn_residual_reason() is not None:
    pytest.fail(f"jax's cuDNN backward contract: {grad.cudnn_residual_reason()}")
  b, t, n, nk, d = 2, 300, 4, 2, 64
  ks = jax.random.split(jax.random.key(3), 4)
  q = jax.random.normal(ks[0], (b, t, n, d), F32).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, t, nk, d), F32).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, t, nk, d), F32).astype(jnp.bfloat16)
  w = jax.random.normal(ks[3], (b, t, n, d), F32).astype(jnp.bfloat16)
  lens = jnp.asarray([t, 100], jnp.int32)
  scale = d ** -0.5
  out, lse = jaxattn.dot_product_attention(
      q, k, v, is_causal=is_causal, key_value_seq_lengths=lens,
      return_residual=True)
  got = jax.jit(functools.partial(grad.cudnn_residual_vjp, scale=scale,
                                  is_causal=is_causal))(q, k, v, lens, out,
                                                        lse, w)
  want = jax.jit(functools.partial(grad.cudnn_vjp, scale=scale,
                                   is_causal=is_causal))(q, k, v, lens, w)
  f32 = lambda *a: jax.nn.dot_product_attention(
      *a, is_causal=is_causal, key_value_seq_lengths=lens)
  exact = jax.vjp(f32, *(x.astype(F32) for x in (q, k, v)))[1](w.astype(F32))
  for name, a, c, e in zip("qkv", got, want, exact):
    # bfloat16 gradients: both within bfloat16 rounding of float32's
    assert _rel(a, e) < 1e-2 and _rel(c, e) < 1e-2, name
    assert _rel(a, c) < 1e-2, name

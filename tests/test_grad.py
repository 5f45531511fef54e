"""Gradients and the log-sum-exp residual, for every method on every backend
(the kernels in interpret mode), against ``jax.grad`` of float32
``jax.nn.dot_product_attention``:

* the gradient is the exact gradient of attention at the inputs (straight
  through the quantization, :mod:`jaxattn.grad`), so every method matches
  float32 jax.nn to float32 rounding on float32 inputs, and to the float16
  rounding of the gradient itself on float16 inputs (the Mosaic kernel);
* with causal, grouped-query, padded (``key_value_seq_lengths``, a batch row
  with no key) and cross-attention inputs, and with a bias (whose gradient
  is checked too) and a dense mask;
* ``return_residual=True`` gives jax.nn's log-sum-exp, including its value
  for rows that see no key.
"""
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


# (name, call options, whether the bias is differentiated)
CASES = {
    "causal_gqa_lengths": dict(is_causal=True, lens=(S, 20)),
    "cross_t_gt_s": dict(t=50, s=30, lens=(30, 5)),
    "bias": dict(bias=True),
    "mask": dict(mask=True, is_causal=True),
}


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


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("method,impl", _combos())
def test_gradient_matches_float32_jax_nn(method, impl, case):
  c = CASES[case]
  r = np.random.default_rng(5)
  kw = _call_kwargs(c, r)
  bias = kw.pop("bias", None)
  # the Mosaic kernel takes float16 inputs; its gradient comes out float16
  dtype = jnp.float16 if impl == "mosaic" else F32
  q, k, v, w = _inputs(7, t=c.get("t", T), s=c.get("s", S), dtype=dtype)
  try:
    api.resolve_implementation(q, k, v, bias, kw.get("mask"), method=method,
                               implementation=impl,
                               is_causal=kw.get("is_causal", False))
  except NotImplementedError as e:   # the backend refuses bias/mask: said so
    assert "bias" in str(e) or "mask" in str(e), e
    return
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
def test_return_residual_is_jax_nn_log_sum_exp(method, impl):
  """Output equal to the plain call's; log-sum-exp float32 ``[B, T, N]``
  equal to jax.nn's (float32 inputs) within the kernel's score precision,
  and jax.nn's value for the batch row with no key."""
  dtype = jnp.float16 if impl == "mosaic" else F32
  q, k, v, _ = _inputs(3, dtype=dtype)
  lens = jnp.asarray([30, 0], jnp.int32)
  kw = dict(is_causal=True, key_value_seq_lengths=lens, method=method,
            implementation=impl)
  out, lse = jaxattn.dot_product_attention(q, k, v, return_residual=True,
                                           **kw)
  plain = jaxattn.dot_product_attention(q, k, v, **kw)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))
  f32 = lambda x: x.astype(F32)
  with jax.default_matmul_precision("highest"):
    _, want = jax.nn.dot_product_attention(
        f32(q), f32(k), f32(v), is_causal=True, key_value_seq_lengths=lens,
        return_residual=True)
  assert lse.shape == (B, T, N) and lse.dtype == F32
  np.testing.assert_array_equal(np.asarray(lse[1]), np.asarray(want[1]))
  assert float(lse[1, 0, 0]) == grad.MASK_VALUE
  # the float16-score kernels' own log-sum-exp carries float16 scores; on a
  # GPU the float32 ones TF32 products
  tol = (2e-2 if method in ("fp16", "fp16_fp32", "pasa")
         else 1e-2 if jax.default_backend() == "gpu" else 1e-5)
  np.testing.assert_allclose(np.asarray(lse[0]), np.asarray(want[0]),
                             atol=tol, rtol=0)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_rows_without_keys_have_zero_output_and_gradient(impl):
  """A batch row with no key: output 0 (jaxattn's documented value, where
  jax.nn attends uniformly), so no gradient reaches its Q, K or V."""
  q, k, v, w = _inputs(6)
  lens = jnp.asarray([S, 0], jnp.int32)
  f = lambda q, k, v: jnp.sum(jaxattn.dot_product_attention(
      q, k, v, key_value_seq_lengths=lens, implementation=impl,
      method="sage") * w)
  dq, dk, dv = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
  for g in (dq, dk, dv):
    assert np.all(np.asarray(g[1]) == 0) and np.any(np.asarray(g[0]) != 0)


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
  for name, a, b in zip("qkv", got, want):
    assert a.shape == b.shape, name
    # float32 sums in another order: elementwise, relative to the largest
    scale_b = float(np.abs(np.asarray(b)).max())
    assert float(np.abs(np.asarray(a) - np.asarray(b)).max()) < 1e-5 * scale_b
    assert _rel(a, b) < 1e-5, name
  assert np.all(np.asarray(got[0][1]) == 0)   # the row with no key

"""The flash / PASA Pallas kernels in interpret mode (CPU) against their
references on small shapes: odd lengths, causal, padding, GQA, bias, mask,
head dims 80 and 96, the log-sum-exp output."""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import metrics, operands
from jaxattn import flash as flash_ref
from jaxattn import pasa as pasa_ref
from jaxattn.backends import triton as triton_backend
from pallas_kernels import flash as flash_kernel

# Same arithmetic as the reference up to the accumulation order of the
# matmuls (and exp2 with the folded log2(e) for "fp32"/"fp16_fp32"): measured
# max relative RMSE (kernel vs reference) over these cases: 1.9e-4 (fp32),
# 2.0e-4 (fp16_fp32), 6.4e-4 (fp16), 3.6e-4 (pasa; float16 rounding is 4.9e-4).
TOL = {"fp32": 2e-3, "fp16_fp32": 2e-3, "fp16": 5e-3, "pasa": 5e-3}


def _inputs(seed, b, t, s, n, kh, d, dtype=jnp.float16):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (b, t, n, d), jnp.float32).astype(dtype),
          jax.random.normal(kk, (b, s, kh, d), jnp.float32).astype(dtype),
          jax.random.normal(kv, (b, s, kh, d), jnp.float32).astype(dtype))


def _both(q, k, v, **kw):
  out = jaxattn.dot_product_attention(q, k, v, implementation="triton", **kw)
  ref = jaxattn.dot_product_attention(q, k, v, implementation="reference",
                                      **kw)
  return out, ref


CASES = [
    # (b, t, s, n, kh, d, causal)
    (1, 37, 37, 2, 2, 64, False),
    (1, 130, 130, 2, 1, 64, True),     # GQA, tail blocks
    (2, 70, 150, 2, 2, 80, False),     # cross-attention, padded head dim
    (1, 150, 70, 4, 2, 96, True),      # causal cross-attention, Sq > Skv
]


@pytest.mark.parametrize("method", list(TOL))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_reference(method, case):
  b, t, s, n, kh, d, causal = case
  q, k, v = _inputs(sum(case), b, t, s, n, kh, d)
  out, ref = _both(q, k, v, method=method, is_causal=causal)
  assert out.shape == ref.shape == q.shape
  assert metrics.nonfinite_fraction(out) == 0.0
  assert metrics.relative_rmse(out, ref) < TOL[method]


@pytest.mark.parametrize("method", list(TOL))
def test_padding_bias_mask(method):
  q, k, v = _inputs(1, 2, 50, 90, 2, 2, 64)
  lens = jnp.array([90, 33])
  bias = jax.random.normal(jax.random.key(2), (2, 2, 50, 90)) * 0.5
  mask = jax.random.bernoulli(jax.random.key(3), 0.8, (2, 1, 50, 90))
  out, ref = _both(q, k, v, method=method, key_value_seq_lengths=lens,
                   bias=bias, mask=mask)
  assert metrics.relative_rmse(out, ref) < TOL[method]
  # Keys past the length are ignored: garbage there changes nothing.
  k2 = k.at[1, 33:].set(1e4)
  out2 = jaxattn.dot_product_attention(q, k2, v, method=method,
                                       implementation="triton",
                                       key_value_seq_lengths=lens, bias=bias,
                                       mask=mask)
  assert metrics.relative_rmse(out2[1], out[1]) < TOL[method]


@pytest.mark.parametrize("method", ["fp32", "pasa"])
def test_fully_masked_rows_are_zero(method):
  q, k, v = _inputs(4, 2, 20, 40, 2, 2, 64)
  out = jaxattn.dot_product_attention(
      q, k, v, method=method, implementation="triton",
      key_value_seq_lengths=jnp.array([40, 0]))
  assert np.all(np.asarray(out[1], np.float32) == 0.0)
  assert metrics.nonfinite_fraction(out) == 0.0


@pytest.mark.parametrize("precision", ["fp32", "fp16", "pasa"])
def test_log_sum_exp(precision):
  q, k, v = _inputs(5, 1, 60, 100, 1, 1, 64)
  q, k, v = q[0, :, 0], k[0, :, 0], v[0, :, 0]
  kw = dict(scale=0.125, is_causal=True, return_lse=True)
  if precision == "pasa":
    config = pasa_ref.PasaConfig()
    _, lse_ref = jax.jit(functools.partial(pasa_ref.pasa_head, config=config,
                                           **kw))(q, k, v, None, None,
                                                  jnp.int32(100))
  else:
    config = flash_ref.FlashConfig()
    _, lse_ref = jax.jit(functools.partial(
        flash_ref.flash_head, config=config, precision=precision, **kw))(
            q, k, v, None, None, jnp.int32(100))
  lens = jnp.array([100], jnp.int32)
  q4, k4, v4 = q[None, :, None], k[None, :, None], v[None, :, None]
  scale = kw.pop("scale")
  if precision == "pasa":  # the kernel takes the shifted keys
    ops = operands.pasa_operands(k4, v4, lens, scale=scale, config=config)
    k4, v4, scale = ops.k, ops.v, ops.inva
    kw.update(pasa_exp_scale=ops.exp_scale, pasa_shifted=ops.shifted,
              state_dtype=config.state_dtype)
  _, lse = flash_kernel.flash_attention(
      q4, k4, v4, lens, scale=scale, precision=precision,
      params=triton_backend.flash_params(precision, 64, config), **kw)
  lse = lse[0, 0]
  exact = jax.nn.logsumexp(
      jnp.where(jnp.tril(jnp.ones((60, 100), bool)),
                (q.astype(jnp.float32) @ k.astype(jnp.float32).T) * 0.125,
                -jnp.inf), axis=-1)
  np.testing.assert_allclose(lse, lse_ref, atol=2e-2)
  np.testing.assert_allclose(lse, exact, atol=5e-2)


def test_block_overrides_and_table():
  cfg = flash_ref.FlashConfig(tile_q=32, block_k=32, num_warps=4,
                              num_stages=2)
  p = triton_backend.flash_params("fp32", 128, cfg)
  assert (p.block_q, p.block_k, p.num_warps, p.num_stages) == (32, 32, 4, 2)
  p = triton_backend.flash_params("pasa", 128,
                                  pasa_ref.PasaConfig(block_k=64))
  assert p.block_k == 64  # PASA's block is the shifting matrix size
  q, k, v = _inputs(7, 1, 40, 70, 1, 1, 64)
  out, ref = _both(q, k, v, method="fp32", tile_q=16, block_k=16)
  assert metrics.relative_rmse(out, ref) < TOL["fp32"]
  with pytest.raises(ValueError, match="power of two"):
    jaxattn.dot_product_attention(q, k, v, method="fp32", tile_q=48)


def test_block_q_is_the_deprecated_name_of_tile_q():
  q, k, v = _inputs(7, 1, 40, 70, 1, 1, 64)
  with pytest.warns(DeprecationWarning, match="'block_q' .* is now 'tile_q'"):
    old = jaxattn.dot_product_attention(q, k, v, method="fp32", block_q=16,
                                        implementation="triton")
  new = jaxattn.dot_product_attention(q, k, v, method="fp32", tile_q=16,
                                      implementation="triton")
  np.testing.assert_array_equal(np.asarray(old), np.asarray(new))
  with pytest.raises(TypeError, match="pass tile_q only"):
    jaxattn.dot_product_attention(q, k, v, method="fp32", block_q=16,
                                  tile_q=16)


def test_pallas_under_jit_and_vmap():
  q, k, v = _inputs(8, 2, 33, 33, 2, 2, 64)
  f = jax.jit(functools.partial(jaxattn.dot_product_attention, method="fp32",
                                implementation="triton"))
  out = f(q, k, v)
  per = jax.vmap(lambda a, b_, c: jaxattn.dot_product_attention(
      a, b_, c, method="fp32", implementation="triton"))(q, k, v)
  ref = jaxattn.dot_product_attention(q, k, v, implementation="reference")
  assert metrics.relative_rmse(out, ref) < TOL["fp32"]
  assert metrics.relative_rmse(per, ref) < TOL["fp32"]


def test_pasa_kernel_rejects_non_fp16_compute():
  q, k, v = _inputs(9, 1, 16, 16, 1, 1, 64)
  with pytest.raises(NotImplementedError, match="float16"):
    jaxattn.dot_product_attention(q, k, v, method="pasa",
                                  implementation="triton",
                                  compute_dtype="float32")


def test_registered():
  for m in TOL:
    assert m in triton_backend.ADAPTERS

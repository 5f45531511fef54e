"""The kernels' quantizers (pallas_kernels/prepare.py, written on BTNH arrays
for speed) against the references' (per head through vmap): the same
quantized values and scales, bit for bit, over every granularity, with key
padding, GQA and lengths that are not multiples of the groups."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import fp8, int_flash, sage
from pallas_kernels import prepare


def _inputs(seed, b=2, t=300, s=260, n=4, kh=2, d=64):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (b, t, n, d), jnp.float16) * 2,
          jax.random.normal(kk, (b, s, kh, d), jnp.float16) + 1.5,
          jax.random.normal(kv, (b, s, kh, d), jnp.float16),
          jnp.array([s - 10, s][:b], jnp.int32))


def _assert_same(fast, ref, approx=()):
  assert set(fast) == set(ref), (set(fast), set(ref))
  for name in fast:
    a = np.asarray(fast[name].astype(jnp.float32))
    r = np.asarray(ref[name].astype(jnp.float32))
    assert a.shape == r.shape, (name, a.shape, r.shape)
    if name in approx:  # a float32 matmul: accumulation order
      np.testing.assert_allclose(a, r, rtol=1e-6, atol=1e-6 * np.abs(r).max())
    else:
      np.testing.assert_array_equal(a, r, err_msg=name)


@pytest.mark.parametrize("opts", [
    dict(preset="sage2-8b"), dict(preset="sage2-4b"), dict(preset="sage1"),
    dict(qk_granularity="token"), dict(qk_granularity="block"),
    dict(qk_granularity="tensor", qk_dtype="int4"),
    dict(smooth_q=False, smooth_k=False, smooth_v=False),
    dict(block_k=128, block_q=64, warp_rows=16),
], ids=str)
def test_sage_inputs_equal_reference(opts):
  q, k, v, lens = _inputs(len(str(opts)))
  cfg = sage.SageConfig.from_options(**opts)
  fast = jax.jit(lambda *a: prepare.sage_inputs(*a, scale=0.125, config=cfg))(
      q, k, v, lens)
  ref = sage.sage_quantize(q, k, v, lens, scale=0.125, config=cfg)
  ref = {n: x for n, x in ref.items() if n in fast or n == "smooth_bias"}
  if "smooth_bias" in ref:  # [B, nqb, N, S] -> the kernels' [B, N, nqb, S]
    ref["smooth_bias"] = jnp.moveaxis(ref["smooth_bias"], 1, 2)
    if not cfg.smooth_q:
      ref.pop("smooth_bias")
  for name in ("q_scale", "q_mean", "k_mean"):
    ref.pop(name, None)
  _assert_same(fast, ref, approx=("smooth_bias",))


@pytest.mark.parametrize("opts", [
    dict(), dict(v_granularity="block"), dict(pv_dtype="fp16"),
    dict(v_granularity="block", block_k=128)], ids=str)
def test_int8_inputs_equal_reference(opts):
  q, k, v, lens = _inputs(7)
  cfg = int_flash.Int8Config(**opts)
  fast = jax.jit(lambda *a: prepare.int8_inputs(*a, config=cfg))(q, k, v, lens)
  _assert_same(fast, int_flash.int8_quantize(q, k, v, lens, config=cfg))


@pytest.mark.parametrize("opts", [dict(), dict(granularity="block")], ids=str)
def test_fp8_inputs_equal_reference(opts):
  q, k, v, lens = _inputs(8)
  cfg = fp8.Fp8Config(**opts)
  fast = jax.jit(lambda *a: prepare.fp8_inputs(*a, config=cfg))(q, k, v, lens)
  _assert_same(fast, fp8.fp8_quantize(q, k, v, lens, config=cfg))


@pytest.mark.parametrize("method,opts", [
    ("sage", dict(preset="sage2-8b")), ("sage", dict(smooth_v=False)),
    ("int8", dict()), ("int8", dict(v_granularity="block")),
    ("fp8", dict()), ("fp8", dict(granularity="block", block_k=128))],
    ids=str)
def test_kernel_inputs_v_equals_reference_transposed(method, opts):
  """The 8-bit V of the kernels' inputs, written transposed by the one-pass
  Pallas kernel (prepare.v_operand), is the reference quantizer's V
  transposed, bit for bit (key padding, a length that is not a multiple of
  the kernel's 128-key tile)."""
  q, k, v, lens = _inputs(11, s=250)
  cfg = jaxattn.base.get_method(method).config_cls.from_options(**opts)
  p = prepare.kernel_inputs(method, q, k, v, lens, scale=0.1, config=cfg)
  ref = {"sage": lambda: sage.sage_quantize(q, k, v, lens, scale=0.1,
                                            config=cfg),
         "int8": lambda: int_flash.int8_quantize(q, k, v, lens, config=cfg),
         "fp8": lambda: fp8.fp8_quantize(q, k, v, lens, config=cfg)}[method]()
  assert p["v"].shape == (2, 2, 64, 250)
  np.testing.assert_array_equal(
      np.asarray(p["v"].astype(jnp.float32)),
      np.asarray(ref["v"].astype(jnp.float32)).transpose(0, 2, 3, 1))


@pytest.mark.parametrize("method", ["sage", "int8", "fp8"])
def test_v_in_mosaic_key_order(method):
  """With ``v_key_order`` the V kernel stores each 16-key chunk in the
  Mosaic kernel's register-operand order (S padded to 16)."""
  from pallas_kernels import mosaic
  q, k, v, lens = _inputs(12, s=250)
  cfg = jaxattn.base.get_method(method).config_cls.from_options()
  plain = prepare.kernel_inputs(method, q, k, v, lens, scale=0.1, config=cfg)
  ordered = prepare.kernel_inputs(method, q, k, v, lens, scale=0.1,
                                  config=cfg, v_key_order=True)
  assert ordered["v_keys_ordered"] and not plain["v_keys_ordered"]
  padded = np.pad(np.asarray(plain["v"].astype(jnp.float32)),
                  [(0, 0), (0, 0), (0, 0), (0, 6)])
  np.testing.assert_array_equal(np.asarray(ordered["v"].astype(jnp.float32)),
                                padded[..., mosaic.key_order(256)])

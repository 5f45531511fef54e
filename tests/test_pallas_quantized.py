"""The quantized Pallas kernel ("sage", "int8", "fmha_int8") in interpret
mode (CPU)
against the references: the same quantized values by construction (the
kernels call the references' quantizers), outputs to accumulation order.
SageAttention2's int4 Q and K reach the kernel packed two per byte."""
import dataclasses
import functools
import itertools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import fmha, metrics, quant, sage
from jaxattn import operands
from jaxattn.backends import triton as triton_backend

# Measured kernel-vs-reference relative RMSE on these cases: 0 to 1e-6
# (full INT8: the same int32 products; P rounding rarely flips), 3e-5
# (half-INT8), 6e-4 (fmha_int8: one int8 step of the output quantization),
# 4e-7 to 1.3e-5 (sage: same quantized values, fp8 P rounding rarely flips;
# int4 Q, K reach the kernel packed two per byte).
VARIANTS = [
    ("sage", {"preset": "sage2-8b"}, 1e-4),
    ("sage", {"preset": "sage2-4b"}, 1e-4),
    ("sage", {"preset": "sage1"}, 1e-4),
    ("sage", {"qk_granularity": "token", "qk_dtype": "int4"}, 1e-4),
    ("int8", {}, 1e-4),
    ("int8", {"v_granularity": "block"}, 1e-4),
    ("int8", {"pv_dtype": "fp16"}, 1e-3),
    ("fmha_int8", {}, 5e-3),
]


def _inputs(seed, b, t, s, n, kh, d):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (b, t, n, d), jnp.float16),
          jax.random.normal(kk, (b, s, kh, d), jnp.float16),
          jax.random.normal(kv, (b, s, kh, d), jnp.float16))


@pytest.mark.parametrize("method,opts,tol", VARIANTS, ids=str)
@pytest.mark.parametrize("case", [(1, 200, 300, 2, 2, 64, True),
                                  (2, 70, 150, 4, 2, 96, False)], ids=str)
def test_kernel_matches_reference(method, opts, tol, case):
  b, t, s, n, kh, d, causal = case
  q, k, v = _inputs(sum(case), b, t, s, n, kh, d)
  k = k + 2.0  # a key bias for the smoothing to remove
  kw = dict(method=method, is_causal=causal,
            key_value_seq_lengths=jnp.array([s - 5] * b), **opts)
  out = jaxattn.dot_product_attention(q, k, v, implementation="triton", **kw)
  ref = jaxattn.dot_product_attention(q, k, v, implementation="reference",
                                      **kw)
  assert metrics.nonfinite_fraction(out) == 0.0
  assert metrics.relative_rmse(out, ref) < tol


def test_fmha_int8_output_matches_reference():
  q, k, v = _inputs(3, 1, 64, 200, 2, 1, 64)
  amax = {"q": 4.0, "k": 4.0, "v": 4.0, "o": 1.0}
  o8, sc = jaxattn.fmha_int8(q, k, v, implementation="triton",
                             return_int8=True, amax=amax)
  r8, rsc = jaxattn.fmha_int8(q, k, v, implementation="reference",
                              return_int8=True, amax=amax)
  assert o8.dtype == jnp.int8 and float(sc) == float(rsc)
  diff = np.abs(np.asarray(o8, np.int32) - np.asarray(r8, np.int32))
  assert diff.max() <= 1 and diff.mean() < 0.01


@pytest.mark.slow
def test_bias_mask_and_empty_rows():
  q, k, v = _inputs(4, 2, 40, 90, 2, 2, 64)
  bias = jax.random.normal(jax.random.key(5), (2, 2, 40, 90))
  mask = jax.random.bernoulli(jax.random.key(6), 0.8, (2, 1, 40, 90))
  lens = jnp.array([90, 0])
  for method in ("sage", "int8", "fmha_int8"):
    kw = dict(method=method, bias=bias, mask=mask, key_value_seq_lengths=lens)
    out = jaxattn.dot_product_attention(q, k, v, implementation="triton", **kw)
    ref = jaxattn.dot_product_attention(q, k, v, implementation="reference",
                                        **kw)
    assert np.all(np.asarray(out[1], np.float32) == 0.0)
    assert metrics.relative_rmse(out, ref) < 5e-3


def test_uint8_identity_in_the_kernel_path():
  """The kernel's (P - 128) V + 128 colsum(V) equals the uint8 product."""
  p = jax.random.randint(jax.random.key(7), (64, 64), 0, 256).astype(jnp.uint8)
  p = p.at[0].set(255).at[1].set(0)
  v = jax.random.randint(jax.random.key(8), (64, 32), -127, 128).astype(jnp.int8)
  direct = p.astype(jnp.int32) @ v.astype(jnp.int32)
  np.testing.assert_array_equal(fmha.uint8_matmul_by_identity(p, v), direct)


def test_table_and_overrides():
  params = triton_backend.quantized_params(128, jaxattn.int_flash.Int8Config(
      tile_q=32, num_warps=4, num_stages=2, block_k=64))
  assert (params.block_q, params.block_k, params.num_warps,
          params.num_stages) == (32, 64, 4, 2)


def test_benchmark_kernel_alone_is_the_method_without_its_quantizer():
  """jaxattn.bench times the kernels on pre-quantized inputs made by the
  same backend adapter (prepare, then kernel) the methods use: same
  output."""
  from jaxattn import bench
  kq, kk, kv = jax.random.split(jax.random.key(5), 3)
  q = jax.random.normal(kq, (1, 80, 2, 64), jnp.float16)
  k = jax.random.normal(kk, (1, 96, 2, 64), jnp.float16)
  v = jax.random.normal(kv, (1, 96, 2, 64), jnp.float16)
  fn, args = bench.kernel_alone(False, 64)["kernel_int8_full"](q, k, v)
  want = jaxattn.dot_product_attention(q, k, v, method="int8",
                                       implementation="triton")
  np.testing.assert_array_equal(np.asarray(fn(*args), np.float32),
                                np.asarray(want, np.float32))



@pytest.mark.parametrize("d", [32, 96])
def test_pack_int4_halves_round_trip_and_layout(d):
  """Every pair of values in [-8, 7] (so every int4 pair of [-7, 7]) in
  every byte: byte j holds x[j] (low nibble) and x[j + d/2] (high)."""
  pairs = np.array(list(itertools.product(range(-8, 8), repeat=2)), np.int8)
  col = np.arange(d // 2)  # a different pair per byte column
  lo = (pairs[:, :1] + 8 + col) % 16 - 8
  hi = (pairs[:, 1:] + 8 + 3 * col) % 16 - 8
  x = jnp.asarray(np.concatenate([lo, hi], axis=1).astype(np.int8))
  packed = quant.pack_int4_halves(x)
  assert packed.dtype == jnp.int8 and packed.shape == (256, d // 2)
  u = np.asarray(packed).view(np.uint8)
  np.testing.assert_array_equal(u & 0xF, lo.astype(np.uint8) & 0xF)
  np.testing.assert_array_equal(u >> 4, hi.astype(np.uint8) & 0xF)
  np.testing.assert_array_equal(quant.unpack_int4_halves(packed), x)


@pytest.mark.slow
def test_int4_packed_path(monkeypatch):
  """sage2-4b through the kernel takes the packed path (D=96, odd lengths,
  causal, GQA): Q and K reach it as D/2 int8 bytes (half the bytes of the
  int8 containers) that unpack to exactly the int8-container values; it
  matches the reference, and equals bit for bit the kernel run on the int8
  containers (the int32 products are the same)."""
  quantized_operands, seen = operands.quantized_operands, []
  monkeypatch.setattr(operands, "quantized_operands",
                      lambda *a, **kw: seen.append(
                          quantized_operands(*a, **kw)) or seen[-1])
  q, k, v = _inputs(11, 1, 41, 67, 4, 2, 96)
  k = k + 2.0
  lens = jnp.array([61])
  kw = dict(method="sage", preset="sage2-4b", is_causal=True,
            key_value_seq_lengths=lens)
  out = jaxattn.dot_product_attention(q, k, v, implementation="triton", **kw)
  ref = jaxattn.dot_product_attention(q, k, v, implementation="reference",
                                      **kw)
  assert [(p.qk, p.q.shape, p.k.shape) for p in seen] == [
      ("int4", (1, 41, 4, 48), (1, 67, 2, 48))]
  assert metrics.nonfinite_fraction(out) == 0.0
  assert metrics.relative_rmse(out, ref) < 1e-4

  cfg = sage.SageConfig.from_options(preset="sage2-4b")
  args = (q, k, v, lens)
  quantize = lambda **kw: jax.jit(functools.partial(
      quantized_operands, "sage", scale=96 ** -0.5, config=cfg, **kw))(*args)
  packed, plain = quantize(), quantize(pack_int4=False)
  assert (packed.qk, plain.qk) == ("int4", "int8")
  for name, x in (("q", q), ("k", k)):
    assert getattr(packed, name).dtype == jnp.int8
    assert (getattr(packed, name).nbytes == x.size // 2
            == getattr(plain, name).nbytes // 2)
    np.testing.assert_array_equal(
        quant.unpack_int4_halves(getattr(packed, name)), getattr(plain, name))
  for field in dataclasses.fields(packed):
    a, b = getattr(packed, field.name), getattr(plain, field.name)
    if field.name not in ("q", "k", "qk") and isinstance(a, jax.Array):
      np.testing.assert_array_equal(a, b)
  unpacked = jax.jit(functools.partial(
      triton_backend.ADAPTERS["sage"].kernel, is_causal=True, config=cfg,
      out_dtype=q.dtype))(plain, lens)
  np.testing.assert_array_equal(np.asarray(out, np.float32),
                                np.asarray(unpacked, np.float32))

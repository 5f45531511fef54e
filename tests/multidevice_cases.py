"""Sharding and ring-attention checks on 4 virtual CPU devices.

Not collected by the suite (the name does not match ``test_*.py``):
``tests/test_sharding.py`` runs this file in a pytest subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``, which must be set
before jax starts.  Shapes are small: the Triton kernels run in interpret
mode.  The Mosaic interpreter cannot run partitioned (its ordered callbacks
do not lower inside custom_partitioning or shard_map); the GPU script
``benchmarks/sharding.py`` covers Mosaic.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxattn
from jaxattn import ring

if jax.device_count() < 4:
  pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=4",
              allow_module_level=True)

AUTO = (AxisType.Auto, AxisType.Auto)
B, T, N, K, D = 2, 64, 4, 2, 32   # GQA: 2 query heads per key/value head


def _inputs(dtype=jnp.float16, t=T, b=B, kv_heads=K):
  ks = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(ks[0], (b, t, N, D), dtype),
          jax.random.normal(ks[1], (b, t, kv_heads, D), dtype),
          jax.random.normal(ks[2], (b, t, kv_heads, D), dtype))


def _put(mesh, spec, *xs):
  return tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in xs)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _sharded_like(x, mesh, spec):
  return x.sharding.is_equivalent_to(NamedSharding(mesh, spec), x.ndim)


def _gathers(fn, *args):
  """The all-gathers in the compiled HLO of ``jax.jit(fn)(*args)``."""
  return jax.jit(fn).lower(*args).compile().as_text().count("all-gather")


# --- batch and head sharding: shard-local, every method and backend --------

BATCH_HEADS = [("reference", m) for m in ("fp16_fp32", "fp16", "pasa", "fp8")]
BATCH_HEADS += [("triton", m) for m in ("fp32", "fp16")]
# the quantized methods' operands come from Triton kernels (jax_triton),
# which run here in Triton's interpreter through host callbacks; those
# crash XLA:CPU inside custom_partitioning, so such calls run unpartitioned
# on the CPU (the GPU runs them shard-local: benchmarks/sharding.py)
UNPARTITIONED = [("triton", m) for m in ("sage", "int8", "fmha_int8")]


@pytest.mark.parametrize("impl,method", BATCH_HEADS)
def test_batch_and_head_sharding_is_shard_local(impl, method):
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=AUTO)
  spec = P("data", None, "model")
  q, k, v = _inputs()
  attend = functools.partial(jaxattn.dot_product_attention, method=method,
                             implementation=impl, is_causal=True)
  args = _put(mesh, spec, q, k, v)
  assert _gathers(attend, *args) == 0
  out = jax.jit(attend)(*args)
  assert _sharded_like(out, mesh, spec)
  want = attend(q, k, v)
  if method == "fmha_int8":   # dynamic amax: one per shard, not per tensor
    assert _rel(out, want) < 0.05
  else:                       # statistics per (batch, head): the same bits
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


@pytest.mark.parametrize("impl,method", UNPARTITIONED)
def test_interpreter_callbacks_run_unpartitioned(impl, method):
  """Calls whose kernels run in host callbacks (no GPU) keep their
  results on the mesh: the same bits as one device (the dynamic amax of
  fmha_int8 included: one call, one scale)."""
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=AUTO)
  spec = P("data", None, "model")
  q, k, v = _inputs()
  attend = functools.partial(jaxattn.dot_product_attention, method=method,
                             implementation=impl, is_causal=True)
  out = jax.jit(attend)(*_put(mesh, spec, q, k, v))
  np.testing.assert_array_equal(np.asarray(out),
                                np.asarray(attend(q, k, v)))


@pytest.mark.parametrize("spec", [P("x"), P(None, None, "x")])
def test_gradients_stay_shard_local(spec):
  """Batch, then heads, over 4 devices."""
  mesh = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,))
  q, k, v = _inputs(jnp.float32, b=4, kv_heads=4)

  def loss(q, k, v):
    out = jaxattn.dot_product_attention(q, k, v, is_causal=True,
                                        method="sage")
    return jnp.sum(out.astype(jnp.float32) ** 2)
  grad = jax.grad(loss, argnums=(0, 1, 2))
  args = _put(mesh, spec, q, k, v)
  assert _gathers(grad, *args) == 0
  got, want = jax.jit(grad)(*args), grad(q, k, v)
  for g, w in zip(got, want):
    assert _sharded_like(g, mesh, spec)
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5,
                               atol=1e-5)


def test_sharded_bias_segments_and_vmap():
  mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=AUTO)
  q, k, v = _inputs(jnp.float32)
  bias = jax.random.normal(jax.random.key(3), (B, N, T, T))
  seg = jnp.repeat(jnp.arange(4), T // 4)[None].repeat(B, 0)
  attend = functools.partial(jaxattn.dot_product_attention, bias=bias,
                             q_segment_ids=seg)
  want = attend(q, k, v)
  args = _put(mesh, P("data", None, "model"), q, k, v)
  assert _gathers(attend, *args) == 0
  np.testing.assert_allclose(jax.jit(attend)(*args), want, atol=1e-6)
  # vmap folds its axis into the batch, sharded or not
  vq, vk, vv = (jnp.stack([x, 2 * x]) for x in (q, k, v))
  got = jax.jit(jax.vmap(attend))(*_put(mesh, P(None, "data"), vq, vk, vv))
  np.testing.assert_allclose(got[1], attend(2 * q, 2 * k, 2 * v), atol=1e-6)


def test_explicit_mesh_axes():
  mesh = jax.make_mesh((2, 2), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2)
  q, k, v = _inputs(jnp.float32)
  args = _put(mesh, P("data", None, "model"), q, k, v)
  attend = functools.partial(jaxattn.dot_product_attention, is_causal=True)
  assert _gathers(attend, *args) == 0
  out = jax.jit(attend)(*args)
  assert _sharded_like(out, mesh, P("data", None, "model"))
  np.testing.assert_array_equal(out, attend(q, k, v))


def test_heads_not_divisible_by_the_mesh_axis():
  mesh = jax.make_mesh((4,), ("model",), axis_types=(AxisType.Auto,))
  q, k, v = _inputs(jnp.float32)   # 4 query heads, 2 key/value heads
  args = (*_put(mesh, P(None, None, "model"), q), k, v)
  with pytest.raises(Exception, match="must both be divisible"):
    jax.jit(jaxattn.dot_product_attention).lower(*args).compile()


# --- ring attention ----------------------------------------------------------

SEQ = jax.make_mesh((4,), ("sp",), axis_types=(AxisType.Auto,))


def _ring(q, k, v, *, layout="contiguous", **kw):
  """ring_attention in shard_map over the 4 devices; global in and out
  (``layout`` permuted and back)."""
  n = 4
  to, back = ((functools.partial(ring.to_zigzag, n=n),
               functools.partial(ring.from_zigzag, n=n))
              if layout == "zigzag" else (lambda x: x, lambda x: x))
  body = jax.shard_map(
      functools.partial(jaxattn.ring_attention, axis_name="sp", layout=layout,
                        **kw),
      mesh=SEQ, in_specs=P(None, "sp"), out_specs=P(None, "sp"),
      check_vma=False)
  return back(body(to(q), to(k), to(v)))


RING_METHODS = [(m, "reference", False) for m in jaxattn.METHODS]
RING_METHODS += [("pasa", "triton", True)]


@pytest.mark.parametrize("method,impl,causal", RING_METHODS)
def test_ring_attention_every_method(method, impl, causal):
  """The ring of each method (per chunk: its own quantization statistics)
  is as accurate against float32 attention as the single-device call, and
  close to it.  The causal steps are the same for every method: one
  causal case here, the rest below."""
  q, k, v = _inputs(t=128)
  k = k + 2.0   # a shared key bias, as PASA's inputs
  exact = jaxattn.dot_product_attention(
      *(x.astype(jnp.float32) for x in (q, k, v)), is_causal=causal)
  got = jax.jit(functools.partial(
      _ring, layout="zigzag", is_causal=causal, method=method,
      implementation=impl))(q, k, v)
  want = jaxattn.dot_product_attention(q, k, v, is_causal=causal,
                                       method=method, implementation=impl)
  assert _rel(got, exact) <= 1.2 * _rel(want, exact) + 2e-4
  assert _rel(got, want) <= 2 * _rel(want, exact) + 5e-4


@pytest.mark.parametrize("layout,causal", [("contiguous", False),
                                           ("zigzag", True)])
def test_ring_attention_gradients_and_lengths(layout, causal):
  q, k, v = _inputs(jnp.float32)
  lens = jnp.array([T, 37], jnp.int32)   # the second row's keys end in chunk 2
  weight = jnp.linspace(0.5, 2.0, T)[:, None, None]

  def loss(fn, q, k, v):
    return jnp.sum(fn(q, k, v) ** 2 * weight)
  ring_fn = functools.partial(_ring, layout=layout, is_causal=causal,
                              key_value_seq_lengths=lens)
  single = functools.partial(jaxattn.dot_product_attention, is_causal=causal,
                             key_value_seq_lengths=lens)
  np.testing.assert_allclose(jax.jit(ring_fn)(q, k, v), single(q, k, v),
                             atol=2e-6)
  got = jax.jit(jax.grad(functools.partial(loss, ring_fn), (0, 1, 2)))(q, k, v)
  want = jax.grad(functools.partial(loss, single), (0, 1, 2))(q, k, v)
  for g, w in zip(got, want):
    assert _rel(g, w) < 1e-5


def test_ring_attention_residual_and_errors():
  q, k, v = _inputs(jnp.float32)
  out, lse = jax.jit(functools.partial(_ring, return_residual=True,
                                       is_causal=True))(q, k, v)
  want, want_lse = jaxattn.dot_product_attention(q, k, v, is_causal=True,
                                                 return_residual=True)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
  with pytest.raises(ValueError, match="not bound"):
    jaxattn.ring_attention(q, k, v, axis_name="sp")
  with pytest.raises(ValueError, match="layout"):
    jax.jit(functools.partial(_ring, layout="striped"))(q, k, v)
  with pytest.raises(NotImplementedError, match="return_int8"):
    jax.jit(functools.partial(_ring, method="fmha_int8",
                              return_int8=True))(q, k, v)
  with pytest.raises(ValueError, match="check_vma=False"):
    jax.shard_map(functools.partial(jaxattn.ring_attention, axis_name="sp"),
                  mesh=SEQ, in_specs=P(None, "sp"),
                  out_specs=P(None, "sp"))(q, k, v)


def test_zigzag_round_trip():
  x = jnp.arange(2 * 16).reshape(2, 16)
  z = ring.to_zigzag(x, 4)
  assert z[0, :4].tolist() == [0, 1, 14, 15]   # device 0: chunks 0 and 7
  np.testing.assert_array_equal(ring.from_zigzag(z, 4), x)


# --- the sequence axis sharded under jit: the ring by itself ----------------

@pytest.mark.parametrize("causal", [False, True])
def test_sequence_sharding_under_jit_takes_the_ring(causal):
  q, k, v = _inputs(jnp.float32)
  attend = functools.partial(jaxattn.dot_product_attention, is_causal=causal)

  def loss(q, k, v):
    return jnp.sum(attend(q, k, v) ** 2)
  args = _put(SEQ, P(None, "sp"), q, k, v)
  text = jax.jit(attend).lower(*args).compile().as_text()
  assert "all-gather" not in text and "collective-permute" in text
  out = jax.jit(attend)(*args)
  assert _sharded_like(out, SEQ, P(None, "sp"))
  np.testing.assert_allclose(out, attend(q, k, v), atol=2e-6)
  grad = jax.grad(loss, (0, 1, 2))
  assert _gathers(grad, *args) == 0
  for g, w in zip(jax.jit(grad)(*args), grad(q, k, v)):
    assert _rel(g, w) < 1e-5


def test_sequence_sharding_refuses_what_the_ring_does_not_take():
  q, k, v = _inputs(jnp.float32)
  args = _put(SEQ, P(None, "sp"), q, k, v)
  seg = jnp.zeros((B, T), jnp.int32)
  with pytest.raises(Exception, match="ring"):
    jax.jit(functools.partial(jaxattn.dot_product_attention,
                              q_segment_ids=seg)).lower(*args).compile()

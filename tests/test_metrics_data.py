"""Tests of jaxattn.metrics (exact values on small arrays) and jaxattn.data
(shapes, dtypes and sample statistics of the benchmark inputs)."""
import math
import warnings

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxattn import data, metrics

F64 = np.float64


# --------------------------------------------------------------------------
# metrics


def test_metrics_exact_values():
  o = np.array([1.0, 2.0, 3.0])
  r = np.array([1.0, 2.0, 4.0])
  assert metrics.cosine_similarity(o, r) == pytest.approx(17 / math.sqrt(294),
                                                          rel=1e-15)
  assert metrics.relative_l1(o, r) == pytest.approx(1 / 7, rel=1e-15)
  assert metrics.rmse(o, r) == pytest.approx(math.sqrt(1 / 3), rel=1e-15)
  assert metrics.relative_rmse(o, r) == pytest.approx(1 / math.sqrt(21),
                                                      rel=1e-15)
  assert metrics.nonfinite_fraction(o) == 0.0
  assert metrics.nan_fraction(o) == 0.0


def test_metrics_any_shape_and_dtype():
  o = np.array([[1.0, -2.0], [0.5, 4.0]])
  r = np.array([[1.0, -1.0], [0.5, 2.0]])
  # |o - r| = [0, 1, 0, 2]; sum|r| = 4.5; sum (o-r)^2 = 5; sum r^2 = 6.25.
  assert metrics.relative_l1(o, r) == pytest.approx(3 / 4.5, rel=1e-15)
  assert metrics.rmse(o, r) == pytest.approx(math.sqrt(5 / 4), rel=1e-15)
  assert metrics.relative_rmse(o, r) == pytest.approx(math.sqrt(5 / 6.25),
                                                      rel=1e-15)
  # jax float16 / bfloat16 inputs (these values are exact in both) give the
  # same float64 numbers, as Python floats.
  for dt in (jnp.float16, jnp.bfloat16):
    got = metrics.relative_rmse(jnp.asarray(o, dt), jnp.asarray(r, dt))
    assert type(got) is float
    assert got == metrics.relative_rmse(o, r)


def test_cosine_orthogonal_and_opposite():
  assert metrics.cosine_similarity([1.0, 0.0], [0.0, 3.0]) == 0.0
  assert metrics.cosine_similarity([1.0, 2.0], [-2.0, -4.0]) == pytest.approx(
      -1.0, rel=1e-15)
  assert metrics.cosine_similarity([3.0, 4.0], [6.0, 8.0]) == pytest.approx(
      1.0, rel=1e-15)


def test_metrics_nan_is_reported_not_hidden():
  o = np.array([1.0, np.nan, 3.0, 4.0])
  r = np.array([1.0, 2.0, 3.0, 4.0])
  for fn in (metrics.cosine_similarity, metrics.relative_l1, metrics.rmse,
             metrics.relative_rmse):
    assert math.isnan(fn(o, r)), fn.__name__
  assert metrics.nan_fraction(o) == 0.25
  assert metrics.nonfinite_fraction(o) == 0.25
  s = metrics.summary(o, r)
  assert s["nan_frac"] == 0.25 and math.isnan(s["rel_rmse"])
  # A NaN in the reference poisons the metrics too.
  assert math.isnan(metrics.relative_rmse(r, o))


def test_metrics_inf():
  o = np.array([1.0, np.inf, -np.inf, 4.0])
  r = np.ones(4)
  assert metrics.nonfinite_fraction(o) == 0.5
  assert metrics.nan_fraction(o) == 0.0
  assert metrics.relative_l1(o, r) == math.inf
  assert metrics.rmse(o, r) == math.inf
  assert math.isnan(metrics.cosine_similarity(o, r))
  # float16 overflow -> inf is counted.
  assert metrics.nonfinite_fraction(
      jnp.array([70000.0, 1.0], jnp.float32).astype(jnp.float16)) == 0.5


def test_metrics_zero_reference_no_warnings():
  z = np.zeros((2, 3))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert metrics.relative_l1(z, z) == 0.0
    assert metrics.relative_rmse(z, z) == 0.0
    assert metrics.rmse(z, z) == 0.0
    assert metrics.cosine_similarity(z, z) == 1.0
    o = z.copy()
    o[0, 1] = 1e-3
    assert metrics.relative_l1(o, z) == math.inf
    assert metrics.relative_rmse(o, z) == math.inf
    assert metrics.cosine_similarity(o, z) == 0.0
    assert metrics.cosine_similarity(z, o) == 0.0
    assert metrics.rmse(o, z) == pytest.approx(math.sqrt(1e-6 / 6), rel=1e-15)
    e = np.zeros((0, 4))
    assert metrics.summary(e, e) == {"cos_sim": 1.0, "rel_l1": 0.0,
                                     "rmse": 0.0, "rel_rmse": 0.0,
                                     "nan_frac": 0.0}


def test_summary_and_shape_mismatch():
  o = np.array([1.0, 2.0, 3.0])
  r = np.array([1.0, 2.0, 4.0])
  s = metrics.summary(o, r)
  assert set(s) == {"cos_sim", "rel_l1", "rmse", "rel_rmse", "nan_frac"}
  assert s["cos_sim"] == metrics.cosine_similarity(o, r)
  assert s["rel_l1"] == metrics.relative_l1(o, r)
  assert s["rmse"] == metrics.rmse(o, r)
  assert s["rel_rmse"] == metrics.relative_rmse(o, r)
  assert s["nan_frac"] == 0.0
  assert all(type(x) is float for x in s.values())
  with pytest.raises(ValueError, match="same shape"):
    metrics.relative_rmse(np.ones(3), np.ones(4))


# --------------------------------------------------------------------------
# data

SHAPE = (2, 16, 3, 8)
KEY = jax.random.key(0)

GENERATORS = {
    "pasa_uniform": lambda k, s, **kw: data.pasa_uniform(k, s, 20.0, 15.0,
                                                         **kw),
    "pasa_hybrid": lambda k, s, **kw: data.pasa_hybrid(k, s, 20.0, 50.0, **kw),
    "normal": data.normal,
    "uniform": data.uniform,
    "channel_outlier": data.channel_outlier,
    "resonance": data.resonance,
}


@pytest.mark.parametrize("name", list(GENERATORS))
def test_shapes_dtypes_determinism(name):
  gen = GENERATORS[name]
  q, k, v = gen(KEY, SHAPE)
  for x in (q, k, v):
    assert x.shape == SHAPE and x.dtype == jnp.float16
    assert bool(jnp.all(jnp.isfinite(x)))
  assert not np.array_equal(np.asarray(q), np.asarray(v))
  assert not np.array_equal(np.asarray(k), np.asarray(v))
  q2, _, _ = gen(KEY, SHAPE)
  np.testing.assert_array_equal(np.asarray(q), np.asarray(q2))
  q3, _, _ = gen(jax.random.key(1), SHAPE)
  assert not np.array_equal(np.asarray(q), np.asarray(q3))
  for dt in (jnp.float32, jnp.bfloat16):
    out = gen(KEY, SHAPE, dtype=dt)
    assert all(x.dtype == dt and x.shape == SHAPE for x in out)
  # Legacy uint32 keys work too.
  assert gen(jax.random.PRNGKey(0), SHAPE)[0].shape == SHAPE


BIG = (1, 2048, 4, 128)  # 1M elements per array


def _f64(xs):
  return [np.asarray(x, F64) for x in xs]


def test_pasa_uniform_statistics():
  x0, am = 20.0, 15.0
  for x in _f64(data.pasa_uniform(KEY, BIG, x0, am)):
    assert x.min() >= x0 - am and x.max() <= x0 + am
    assert x.mean() == pytest.approx(x0, abs=0.05)
    assert x.std() == pytest.approx(am / math.sqrt(3), rel=0.01)
  # am = 0 is the constant x0.
  q, _, _ = data.pasa_uniform(KEY, SHAPE, 30.0, 0.0)
  assert np.all(np.asarray(q, F64) == 30.0)


def test_pasa_hybrid_statistics():
  x0, am, p = 20.0, 100.0, 0.001
  n = math.prod(BIG)
  # |N(0, am^2)| > 6 with probability 0.952 (an inlier is beyond 6 sigma with
  # probability 2e-9), so the outlier count is about p * 0.952 * n.
  expected = p * math.erfc(6 / am / math.sqrt(2)) * n
  for x in _f64(data.pasa_hybrid(KEY, BIG, x0, am, p=p)):
    out = np.abs(x - x0) > 6
    assert out.sum() == pytest.approx(expected, rel=0.15)
    inl = x[~out]
    assert inl.mean() == pytest.approx(x0, abs=0.01)
    assert inl.std() == pytest.approx(1.0, rel=0.01)
    assert x[out].std() == pytest.approx(am, rel=0.15)
  # p = 0 is a plain N(x0, 1).
  q, _, _ = _f64(data.pasa_hybrid(KEY, BIG, x0, am, p=0.0))
  assert np.abs(q - x0).max() < 6.0


def test_normal_uniform_statistics():
  for x in _f64(data.normal(KEY, BIG)):
    assert x.mean() == pytest.approx(0.0, abs=0.005)
    assert x.std() == pytest.approx(1.0, rel=0.005)
  for x in _f64(data.uniform(KEY, BIG)):
    assert x.min() >= -0.5 and x.max() <= 0.5
    assert x.mean() == pytest.approx(0.0, abs=0.002)
    assert x.std() == pytest.approx(1 / math.sqrt(12), rel=0.005)


def test_channel_outlier_key_bias():
  shape = (4, 64, 16, 128)
  q, k, v = _f64(data.channel_outlier(KEY, shape))
  for x in (q, v):
    assert x.mean() == pytest.approx(0.0, abs=0.01)
    assert x.std() == pytest.approx(1.0, rel=0.01)
  mean = k.mean(axis=1)  # [B, N, D]: the per-(batch, head, channel) bias
  # Tokens share the bias: what is left is N(0, 1) in every channel.
  assert (k - mean[:, None]).std() == pytest.approx(1.0, rel=0.01)
  # E[bias^2] = (8 * 20^2 + 120 * 1^2) / 128 = 25.9 (the token noise adds
  # 1 / 64).
  assert np.mean(mean ** 2) == pytest.approx(
      (8 * 400 + 120) / 128 + 1 / 64, rel=0.15)
  # At most 8 channels per head are large (|bias| > 5): P(|N(0, 20^2)| > 5)
  # = 0.80, so 6.4 on average; a N(0, 1) channel essentially never is.
  big = (np.abs(mean) > 5).sum(axis=-1)
  assert big.max() <= 8
  assert big.mean() == pytest.approx(8 * math.erfc(0.25 / math.sqrt(2)),
                                     abs=0.7)
  assert np.abs(mean).max(axis=-1).min() > 10  # every head has an outlier
  # No outlier channels: the bias is std 1 everywhere.
  _, k0, _ = _f64(data.channel_outlier(KEY, shape, n_outlier_channels=0))
  assert np.abs(k0.mean(axis=1)).max() < 5


def _int_quant(x, group, bits):
  """Symmetric per-(batch, head, block of ``group`` tokens) absmax quantize
  and dequantize ``x [B, S, N, D]``."""
  b, s, n, d = x.shape
  m = 2 ** (bits - 1) - 1
  xb = x.reshape(b, s // group, group, n, d)
  scale = np.abs(xb).max(axis=(2, 4), keepdims=True) / m
  scale = np.where(scale == 0, 1.0, scale)
  return (np.clip(np.round(xb / scale), -m, m) * scale).reshape(x.shape)


def _attention(q, k, v):
  s = np.einsum("btnd,bsnd->bnts", q, k) / np.sqrt(q.shape[-1])
  s -= s.max(-1, keepdims=True)
  p = np.exp(s)
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnd->btnd", p, v)


def test_channel_outlier_breaks_unsmoothed_int4():
  """The documented defaults: int4 Q per 32 tokens and K per 64 tokens.
  Unsmoothed, the key bias sets the K scale (cos sim ~0.48); with K smoothed
  the error is int4's floor on N(0, 1) inputs (~0.975)."""
  shape = (1, 256, 2, 128)
  q, k, v = _f64(data.channel_outlier(KEY, shape))
  ref = _attention(q, k, v)
  raw = _attention(_int_quant(q, 32, 4), _int_quant(k, 64, 4), v)
  k_smooth = k - k.mean(axis=1, keepdims=True)
  smooth = _attention(_int_quant(q, 32, 4), _int_quant(k_smooth, 64, 4), v)
  cos_raw = metrics.cosine_similarity(raw, ref)
  cos_smooth = metrics.cosine_similarity(smooth, ref)
  qn, kn, vn = _f64(data.normal(KEY, shape))
  cos_normal = metrics.cosine_similarity(
      _attention(_int_quant(qn, 32, 4), _int_quant(kn, 64, 4), vn),
      _attention(qn, kn, vn))
  assert cos_raw < 0.9
  assert cos_smooth > 0.97
  assert cos_smooth == pytest.approx(cos_normal, abs=0.005)
  # int8 unsmoothed is hurt too, smoothed is near exact.
  raw8 = _attention(_int_quant(q, 32, 8), _int_quant(k, 64, 8), v)
  smooth8 = _attention(_int_quant(q, 32, 8), _int_quant(k_smooth, 64, 8), v)
  assert metrics.cosine_similarity(raw8, ref) < 0.998
  assert metrics.cosine_similarity(smooth8, ref) > 0.9998


def _max_abs_score(q, k):
  q, k = np.asarray(q, F64), np.asarray(k, F64)
  return np.abs(np.einsum("btnd,bsnd->bnts", q, k)).max()


def test_resonance_overflows_fp16():
  shape = (1, 256, 1, 128)
  q, k, v = data.resonance(KEY, shape)
  assert _max_abs_score(q, k) > 65504
  qf, kf = np.asarray(q, F64), np.asarray(k, F64)
  s = np.einsum("btnd,bsnd->bnts", qf, kf)
  # Every pair overflows: q.k ~ 128 * 16^2 + 128 * 24^2 / 2 = 69632.
  assert s.min() > 65504
  assert s.mean() == pytest.approx(69632, rel=0.01)
  s16 = jnp.einsum("btnd,bsnd->bnts", q, k,
                   preferred_element_type=jnp.float16)
  assert bool(jnp.all(jnp.isinf(s16)))
  assert np.abs(np.asarray(q, F64)).max() < 60  # inputs themselves are fine
  vf = np.asarray(v, F64)
  assert abs(vf.mean()) < 0.1 and vf.std() == pytest.approx(1.0, rel=0.1)
  # The resonance is what overflows: out of phase, or without the
  # oscillation, the bias alone stays in range.
  qo, ko, _ = data.resonance(KEY, shape, out_of_phase=True)
  assert _max_abs_score(qo, ko) < 65504 / 4
  qb, kb, _ = data.resonance(KEY, shape, amplitude=0.0)
  assert _max_abs_score(qb, kb) < 65504


def test_pasa_table4_cases():
  got = [(c["dist"], c["x0"], c["am"], c["paper_nan_pct"])
         for c in data.PASA_TABLE4_CASES]
  assert got == [("uniform", 30, 0.5, 100), ("uniform", 20, 15, 0.12),
                 ("uniform", 20, 20, 8.14), ("hybrid", 30, 10, 100),
                 ("hybrid", 20, 50, 0.04), ("hybrid", 20, 100, 1.11)]
  assert len({c["name"] for c in data.PASA_TABLE4_CASES}) == 6
  for case in data.PASA_TABLE4_CASES:
    fn = data.pasa_uniform if case["dist"] == "uniform" else data.pasa_hybrid
    direct = fn(KEY, SHAPE, case["x0"], case["am"], jnp.float16)
    for a, b in zip(data.pasa_case(KEY, case, SHAPE), direct):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    by_name = data.pasa_case(KEY, case["name"], SHAPE, jnp.float32)
    assert by_name[0].dtype == jnp.float32
  # (30, 0.5) overflows float16 in every unscaled score: 128 * 29.5^2 > 65504.
  q, k, _ = data.pasa_case(KEY, data.PASA_TABLE4_CASES[0], (1, 64, 1, 128))
  qf, kf = np.asarray(q, F64), np.asarray(k, F64)
  assert np.einsum("btnd,bsnd->bnts", qf, kf).min() > 65504
  with pytest.raises(ValueError, match="unknown PASA case"):
    data.pasa_case(KEY, "nope", SHAPE)
  with pytest.raises(ValueError, match="dist"):
    data.pasa_case(KEY, {"dist": "gauss", "x0": 0, "am": 1}, SHAPE)


@pytest.mark.parametrize("shape", [
    (1, 2, 3), (1, 2, 3, 4, 5), (1, 0, 2, 2), (1, -1, 2, 2), (1, 2.0, 2, 2),
    (True, 2, 2, 2), "abcd", None, 7,
])
@pytest.mark.parametrize("name", list(GENERATORS))
def test_bad_shape(name, shape):
  with pytest.raises(ValueError, match="shape"):
    GENERATORS[name](KEY, shape)


def test_numpy_int_shape_ok():
  q, _, _ = data.normal(KEY, tuple(np.array([1, 4, 2, 8])))
  assert q.shape == (1, 4, 2, 8)


def test_bad_keys():
  with pytest.raises(ValueError, match="single PRNG key"):
    data.normal(jax.random.split(KEY, 2), SHAPE)
  with pytest.raises(ValueError, match="PRNG key"):
    data.normal(np.zeros(3), SHAPE)
  with pytest.raises(ValueError, match="outside jax.jit"):
    jax.jit(lambda k: data.normal(k, SHAPE)[0])(KEY)


def test_bad_parameters():
  with pytest.raises(ValueError, match="am"):
    data.pasa_uniform(KEY, SHAPE, 0.0, -1.0)
  with pytest.raises(ValueError, match="x0"):
    data.pasa_uniform(KEY, SHAPE, float("nan"), 1.0)
  with pytest.raises(ValueError, match="p must"):
    data.pasa_hybrid(KEY, SHAPE, 0.0, 1.0, p=1.5)
  with pytest.raises(ValueError, match="n_outlier_channels"):
    data.channel_outlier(KEY, SHAPE, n_outlier_channels=SHAPE[-1] + 1)
  with pytest.raises(ValueError, match="outlier_scale"):
    data.channel_outlier(KEY, SHAPE, outlier_scale=-1.0)
  with pytest.raises(ValueError, match="period"):
    data.resonance(KEY, SHAPE, period=0.0)


def test_device_times_from_the_traced_kernels(monkeypatch):
  """``timing.device_ms`` sums one call's kernel durations and
  ``device_period_ms`` takes one call's first kernel to the next call's
  (the gaps in), medians over the calls; None without GPU kernels."""
  from jaxattn import timing
  # three calls of two kernels each: (name, start_ns, duration_ns)
  kernels = [("a", 0, 100), ("b", 150, 1000), ("a", 1300, 100),
             ("b", 1420, 1000), ("a", 2600, 100), ("b", 2700, 1200)]
  monkeypatch.setattr(timing, "device_kernels",
                      lambda fn, args, calls: kernels)
  assert timing.device_ms(None, (), calls=3) == 1100 / 1e6
  assert timing.device_period_ms(None, (), calls=3) == 1300 / 1e6
  # kernels that do not split into equal calls: no number, not a wrong one
  assert timing.device_ms(None, (), calls=4) is None
  monkeypatch.setattr(timing, "device_kernels", lambda fn, args, calls: [])
  assert timing.device_period_ms(None, (), calls=3) is None

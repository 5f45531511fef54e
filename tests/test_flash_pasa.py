"""The flash references ("fp32", "fp16_fp32", "fp16") and PASA: every method's
reference against a float64 textbook attention, PASA's mathematical
equivalence in float64, the optimal-beta solver (PASA Table 3), the NaN
behaviour of the PASA paper's Table 4 on a reduced shape, the key shifting,
and the resonance overflow.

XLA takes ~1 s to compile each reference on CPU, so the accuracy outputs are
computed once per (method, causal) and shared (``functools.cache``).
"""
import contextlib
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import base, data, metrics, pasa
from jaxattn.metrics import exact_attention as textbook

F32 = np.float32


def attn(q, k, v, method, **kw):
  return jaxattn.dot_product_attention(q, k, v, method=method,
                                       implementation="reference", **kw)


@contextlib.contextmanager
def x64():
  """``jax_enable_x64`` on inside the block, restored afterwards."""
  if hasattr(jax, "enable_x64"):  # the config context manager (jax >= 0.8)
    with jax.enable_x64(True):
      yield
    return
  old = jax.config.read("jax_enable_x64")
  jax.config.update("jax_enable_x64", True)
  try:
    yield
  finally:
    jax.config.update("jax_enable_x64", old)


def textbook64(q, k, v, *, is_causal=False, kv_lens=None, scale=None):
  """Float64 textbook attention of float64 inputs (``exact_attention`` first
  rounds its inputs to float32, which would hide float64 equivalence)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  t, s, d = q.shape[1], k.shape[1], q.shape[-1]
  scale = 1.0 / np.sqrt(d) if scale is None else scale
  sc = np.einsum("btnd,bsnd->bnts", q, k) * scale
  vis = np.ones(sc.shape, bool)
  if kv_lens is not None:
    vis &= (np.arange(s)[None] < np.asarray(kv_lens)[:, None])[:, None, None]
  if is_causal:
    vis &= np.tril(np.ones((t, s), bool))
  sc = np.where(vis, sc, -np.inf)
  mx = sc.max(-1, keepdims=True)
  p = np.where(vis, np.exp(sc - np.where(np.isfinite(mx), mx, 0.0)), 0.0)
  den = p.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnd->btnd", p / np.where(den == 0, 1, den), v)


# ----------------------------------------------------------------------------
# Every method against float64 on N(0, 1) data.

B, T, S, N, D = 2, 150, 130, 2, 64   # cross-attention, odd key blocks
LENS = np.array([S, 77], np.int32)   # the causal variant also pads


@functools.cache
def _normal_qkv():
  r = np.random.default_rng(0)
  return (r.standard_normal((B, T, N, D), dtype=F32),
          r.standard_normal((B, S, N, D), dtype=F32),
          r.standard_normal((B, S, N, D), dtype=F32))


@functools.cache
def _normal_out(method, causal):
  q, k, v = _normal_qkv()
  kw = dict(is_causal=True, key_value_seq_lengths=LENS) if causal else {}
  return np.asarray(attn(q, k, v, method, **kw))


@functools.cache
def _normal_ref(causal):
  q, k, v = _normal_qkv()
  if causal:
    return textbook(q, k, v, is_causal=True, kv_lens=LENS)
  return textbook(q, k, v)


# Relative RMSE vs float64 at B=2 T=150 S=130 N=2 D=64, float32 inputs
# (default options).  Measured, seeds 0-3, non-causal / causal with lengths
# [130, 77]:
#   fp32       3.30e-7 - 3.37e-7 / 2.09e-7 - 2.19e-7
#   fp16_fp32  5.71e-4 - 5.83e-4 / 4.31e-4 - 4.52e-4
#   fp16       7.82e-4 - 8.13e-4 / 6.09e-4 - 6.29e-4
#   pasa       6.69e-4 / 5.06e-4 (seed 0; float16 state 9.2e-4 / 6.3e-4)
#   sage       3.50e-2 - 3.56e-2 / 3.18e-2 - 3.25e-2
#   int8       1.83e-2 - 1.89e-2 / 1.34e-2 - 1.42e-2
#   fmha_int8  2.10e-2 - 2.53e-2 / 2.67e-2 - 3.09e-2
#   fp8        5.03e-2 - 5.29e-2 / 4.21e-2 - 4.43e-2
# The bounds are ~2-3x the worst; the floors (~1/4 of the best) check that
# the low precision is really emulated.
ACCURACY = {  # method: (floor, bound)   seed 0 non-causal / causal
    "fp32": (0.0, 1e-6),                 # 3.32e-7 / 2.09e-7
    "fp16_fp32": (1e-4, 1.5e-3),         # 5.71e-4 / 4.31e-4
    "fp16": (1.5e-4, 2e-3),              # 7.82e-4 / 6.09e-4
    "pasa": (1.5e-4, 2.5e-3),            # 6.69e-4 / 5.06e-4
    "sage": (8e-3, 8e-2),                # 3.50e-2 / 3.18e-2
    "int8": (3e-3, 4.5e-2),              # 1.85e-2 / 1.37e-2
    "fmha_int8": (5e-3, 7e-2),           # 2.18e-2 / 2.67e-2
    "fp8": (1e-2, 1.2e-1),               # 5.17e-2 / 4.21e-2
}


def test_accuracy_table_covers_every_method():
  assert sorted(ACCURACY) == sorted(jaxattn.METHODS)
  assert len(jaxattn.METHODS) == 8


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal_pad"])
@pytest.mark.parametrize("method", sorted(ACCURACY))
def test_reference_accuracy_vs_float64(method, causal):
  out = _normal_out(method, causal)
  assert out.shape == (B, T, N, D) and out.dtype == np.float32
  assert metrics.nonfinite_fraction(out) == 0.0
  err = metrics.relative_rmse(out, _normal_ref(causal))
  lo, hi = ACCURACY[method]
  assert lo <= err < hi, (method, causal, err)


def test_fp16_agrees_with_fp32_on_benign_data():
  for causal in (False, True):
    o16, o32 = _normal_out("fp16", causal), _normal_out("fp32", causal)
    # Measured 7.8e-4 (full) / 6.1e-4 (causal, padded): float16 rounding.
    err = metrics.relative_rmse(o16, o32)
    assert 1e-4 < err < 2e-3, (causal, err)
    assert np.abs(o16 - o32).max() < 1e-2   # measured 1.1e-3 / 2.5e-3


# ----------------------------------------------------------------------------
# PASA in float64 is attention, exactly.

BETAS = (0.0, 0.3, 0.9, 0.984497)
# Odd lengths, 5 key blocks of 32 (the last one holds 5 keys), batch 1 padded
# to 50 keys (a partial block in the middle), 67 query rows (causal rows see
# 1..67 keys).
T64, S64, BK64 = 67, 133, 32
LENS64 = np.array([S64, 50], np.int32)


@functools.cache
def _pasa64(beta, causal):
  r = np.random.default_rng(64)
  q = r.standard_normal((2, T64, 2, 64))
  k = r.standard_normal((2, S64, 2, 64)) + 3.0   # a key mean to shift away
  v = r.standard_normal((2, S64, 2, 64))
  with x64():
    out = attn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), "pasa",
               beta=beta, compute_dtype="float64", block_k=BK64,
               is_causal=causal, key_value_seq_lengths=jnp.asarray(LENS64))
    dtype, out = out.dtype, np.asarray(out)
  assert not jax.config.read("jax_enable_x64")  # restored
  ref = textbook64(q, k, v, is_causal=causal, kv_lens=LENS64)
  return dtype, out, ref


@pytest.mark.parametrize("beta", BETAS)
def test_pasa_float64_equals_attention_to_1e_10(beta):
  """With compute_dtype=float64, PASA is attention for any beta (the paper's
  mathematical equivalence): measured max |out - ref| 1.7e-15 to 2.6e-14."""
  for causal in (False, True):
    dtype, out, ref = _pasa64(beta, causal)
    assert dtype == jnp.float64
    assert np.isfinite(out).all()
    assert np.abs(out - ref).max() < 1e-10, (beta, causal)


def test_pasa_float64_needs_x64():
  q = np.zeros((1, 4, 1, 16), F32)
  with pytest.raises(ValueError, match="jax_enable_x64"):
    attn(q, q, q, "pasa", compute_dtype="float64")


# ----------------------------------------------------------------------------
# optimal_beta: PASA Table 3.


@pytest.mark.parametrize("beta0, expected", [
    (1 - 2.0**-4, 0.937500),
    (1 - 2.0**-5, 0.968994),
    (1 - 2.0**-6, 0.984497),
])
def test_optimal_beta_table3(beta0, expected):
  beta = pasa.optimal_beta(beta0, 128, jnp.float16)
  assert round(beta, 6) == expected
  # A fixed point: one more iteration from it changes nothing.
  assert abs(pasa.optimal_beta(beta, 128, jnp.float16) - beta) < 1e-9


def test_optimal_beta_default_is_the_pasa_config_default():
  assert round(pasa.optimal_beta(), 6) == 0.984497
  assert pasa.PasaConfig().resolved_beta == pasa.optimal_beta(
      1 - 2.0**-6, 128, "float16")


@pytest.mark.parametrize("beta0", [0.0, 1.0, -0.5, 1.5])
def test_optimal_beta_bad_beta0(beta0):
  with pytest.raises(ValueError, match="beta0"):
    pasa.optimal_beta(beta0, 128, jnp.float16)


def test_optimal_beta_bad_n():
  with pytest.raises(ValueError, match="n must be"):
    pasa.optimal_beta(0.9, 0, jnp.float16)


# ----------------------------------------------------------------------------
# PASA Table 4, reduced to (B, S, N, D) = (1, 256, 2, 128).

T4_SHAPE = (1, 256, 2, 128)
# pasa relative RMSE vs float64 at T4_SHAPE, key 0 (keys 1, 2), and the bound
# (Algorithm 1 literally, float16 state: 3.5e-3, 2.0e-2, 3.3e-2, 1.5e-2,
# 3.9e-3, 3.1e-3 at key 0).
# fp16_fp32 NaN fraction at key 0: 100%, 0, 2.3%, 100%, 0, 0 (keys 1-2 give
# 0-11% on the x0=20 cases); fp32 relative RMSE <= 1.5e-4.
T4_PASA_BOUND = {
    "uniform_x0=30_am=0.5": 1e-3,   # 1.8e-4 (1.5e-4, 1.3e-4)
    "uniform_x0=20_am=15": 1e-2,    # 3.0e-3 (1.8e-3, 3.3e-3)
    "uniform_x0=20_am=20": 1e-2,    # 2.9e-3 (2.5e-3, 3.3e-3)
    "hybrid_x0=30_am=10": 2e-3,     # 3.5e-4 (1e-12, 1.6e-4)
    "hybrid_x0=20_am=50": 2e-3,     # 2.8e-4 (8.5e-8, 4.2e-6)
    "hybrid_x0=20_am=100": 3e-3,    # 7.8e-4 (0, 2.8e-6)
}


def test_table4_nan_behaviour():
  assert sorted(T4_PASA_BOUND) == sorted(
      c["name"] for c in data.PASA_TABLE4_CASES)
  for case in data.PASA_TABLE4_CASES:
    name = case["name"]
    q, k, v = data.pasa_case(jax.random.key(0), case, T4_SHAPE)
    ref = textbook(q, k, v)
    out = {m: attn(q, k, v, m) for m in ("fp16_fp32", "pasa", "fp32")}
    nan = {m: metrics.nan_fraction(o) for m, o in out.items()}
    if case["x0"] == 30.0:   # every unscaled score is ~ 115000 > 65504
      assert nan["fp16_fp32"] == 1.0, (name, nan)
    assert nan["pasa"] == 0.0 and nan["fp32"] == 0.0, (name, nan)
    assert metrics.nonfinite_fraction(out["pasa"]) == 0.0, name
    err = metrics.relative_rmse(out["pasa"], ref)
    assert err < T4_PASA_BOUND[name], (name, err)
    assert metrics.relative_rmse(out["fp32"], ref) < 5e-4, name
  # (uniform x0=20, am=20 overflows some rows of fp16_fp32 too: 2.3%.)


# ----------------------------------------------------------------------------
# shift_keys: K'_j = scale * M^T K_j.


def _explicit_shift(k, kv_len, beta, scale, bk, cd):
  """numpy float64 ``scale * M^T K_j`` per block, invisible rows (beyond
  kv_len, block padding) filled with the mean of the block's visible keys."""
  s, d = k.shape
  kc = np.asarray(k).astype(cd).astype(np.float64)
  m = np.asarray(pasa.shifting_matrix(beta, bk, cd)).astype(np.float64)
  nb = -(-s // bk)
  blocks, filled = [], []
  for j in range(nb):
    blk = np.zeros((bk, d))
    rows = kc[j * bk:(j + 1) * bk]
    blk[:len(rows)] = rows
    nvis = int(np.clip(min(kv_len, s) - j * bk, 0, bk))
    mean = blk[:nvis].mean(0) if nvis else np.zeros(d)
    blk[nvis:] = np.asarray(mean).astype(cd)
    filled.append(blk)
    blocks.append(m.T @ blk * scale)
  return np.stack(blocks), np.stack(filled)


def test_shifting_matrix_values():
  for cd in (np.float16, np.float32):
    m = np.asarray(pasa.shifting_matrix(0.984497, 128, cd))
    assert m.dtype == cd and m.shape == (128, 128)
    assert m[0, 0] == cd(1 - 0.984497 / 128) and m[3, 7] == cd(-0.984497 / 128)
    assert np.all(m == m.T)
    np.testing.assert_array_equal(np.diag(m), np.full(128, m[0, 0]))


@pytest.mark.parametrize("cd", ["float32", "float16"])
def test_shift_keys_is_explicit_shift(cd):
  r = np.random.default_rng(5)
  s, d, bk, beta, scale = 150, 64, 64, 0.984497, 0.125
  k = (r.standard_normal((s, d)) + 20.0).astype(F32)   # key mean ~20
  for kv_len in (s, 90):   # 3 blocks (the last partial); 90: block 1 partial
    out = np.asarray(pasa.shift_keys(
        jnp.asarray(k), jnp.int32(kv_len), beta=beta, scale=scale,
        block_k=bk, compute_dtype=cd, key_rounding="nearest")[0])
    assert out.dtype == np.dtype(cd) and out.shape == (3, bk, d)
    expected, filled = _explicit_shift(k, kv_len, beta, scale, bk, cd)
    # Max error relative to the block's largest shifted key; measured
    # float32 2.1e-6 - 5.4e-6, float16 2.5e-4 - 2.9e-4 (fp16 half ulp 4.9e-4).
    tol = 2e-5 if cd == "float32" else 1e-3
    for j in range(3):
      scale_j = max(np.abs(expected[j]).max(), 1e-30)
      assert np.abs(out[j] - expected[j]).max() <= tol * scale_j, (kv_len, j)
    # The shift removes beta times the block mean from every row:
    # K'/scale = K_j - beta mean(K_j)  (measured max abs error 1.9e-5 in
    # float32, 4.2e-3 in float16, on values ~1), so the block mean drops from
    # ~20 to (1 - beta) ~20 = ~0.31.
    shifted = out.astype(np.float64) / scale
    want = filled - beta * filled.mean(axis=1, keepdims=True)
    tol_rows = 1e-4 if cd == "float32" else 1.5e-2
    assert np.abs(shifted - want).max() < tol_rows, kv_len
    for j in range(2 if kv_len == 90 else 3):
      before = filled[j].mean(0)
      after = shifted[j].mean(0)
      np.testing.assert_allclose(after, (1 - beta) * before, rtol=0.05,
                                 atol=0.01)
      assert np.abs(before).min() > 15 and np.abs(after).max() < 0.5
    if kv_len == 90:   # block 2 sees no key: filled with zeros
      np.testing.assert_array_equal(out[2], 0)


def test_sum_preserving_keys_keep_the_block_sums():
  """``key_rounding="sum_preserving"``: every shifted key within one ulp of
  ``scale M^T K`` (float32), and each block's column sums within one ulp
  of its largest element, where rounding to nearest drifts by many (keys
  of mean 20, whose shifted values share a binade and round alike)."""
  r = np.random.default_rng(7)
  k = r.uniform(0, 40, (300, 64)).astype(F32)
  beta, scale, bk = 0.984497, 0.125, 128
  exact, _ = _explicit_shift(k, 300, beta, scale, bk, np.float16)
  ulp = np.spacing(np.abs(exact).max(axis=1, keepdims=True).astype(
      np.float16)).astype(np.float64)
  col_err = {}
  for rounding in ("nearest", "sum_preserving"):
    out = np.asarray(pasa.shift_keys(
        jnp.asarray(k), jnp.int32(300), beta=beta, scale=scale, block_k=bk,
        compute_dtype="float16", key_rounding=rounding)[0], np.float64)
    assert out.shape == exact.shape
    assert (np.abs(out - exact) <= ulp).all(), rounding
    col_err[rounding] = (np.abs((out - exact).sum(axis=1, keepdims=True))
                         / ulp).max()
  # measured: nearest 11.9 ulps, sum_preserving 0.51; each element within
  # one ulp of the exact value.
  assert col_err["sum_preserving"] <= 1.0, col_err
  assert col_err["nearest"] > 5.0, col_err


@pytest.mark.parametrize("rounding,adaptive", [
    ("nearest", False), ("sum_preserving", False), ("sum_preserving", True)])
def test_key_shift_kernel_matches_shift_keys(rounding, adaptive):
  """The one-pass kernel (interpret mode) against :func:`pasa.shift_keys`
  per head: keys with a per-channel bias (in every other block) and one
  outlier channel, lengths that are not whole blocks, a batch row with a
  shorter ``kv_len``; with the adaptive shift, the same blocks shifted.
  The values agree but for a rare one-ulp move where the float32
  accumulation order of ``M^T K`` differs (measured 0 or 1 of 8e4 -
  1.5e5)."""
  from pallas_kernels import key_shift
  for (b, s, h, d, bk) in [(2, 300, 3, 64, 128), (1, 257, 2, 128, 64)]:
    r = np.random.default_rng(s)
    biased = (np.arange(s) // bk % 2 == 0)[None, :, None, None]
    k = r.standard_normal((b, s, h, d)) * 3 + biased * np.linspace(-20, 20, d)
    k[..., 3] *= 30
    k = jnp.asarray(k, jnp.float16)
    lens = jnp.asarray([s, s // 2 + 3][:b], jnp.int32)
    beta, scale = pasa.optimal_beta(n=bk, dtype="float16"), d ** -0.5
    factor = pasa.key_factor(scale, adaptive)
    moved = key_shift.large_mean_blocks(k, lens, beta=beta, block_k=bk,
                                        min_ratio=pasa.SHIFT_MIN_RATIO)
    out = np.asarray(key_shift.shifted_key_blocks(
        k, lens, beta=beta, scale=factor, block_k=bk, rounding=rounding,
        shift=moved if adaptive else None)[0])
    refs = [[pasa.shift_keys(
        k[i, :, j], lens[i], beta=beta, scale=scale, block_k=bk,
        compute_dtype="float16", key_rounding=rounding, adaptive=adaptive)
        for j in range(h)] for i in range(b)]
    ref = np.stack([np.stack([np.asarray(x[0]).reshape(-1, d) for x in row],
                             axis=1) for row in refs])
    ref_moved = np.stack([np.stack([np.asarray(x[1]) for x in row])
                          for row in refs])
    if adaptive:
      # the same blocks shifted; the unbiased ones stay, exactly p K
      np.testing.assert_array_equal(np.asarray(moved) > 0, ref_moved)
      assert ref_moved.any() and not ref_moved.all(), ref_moved
      kb = np.asarray(k, np.float32)
      for j in np.flatnonzero(~ref_moved[0, 0]):
        rows = slice(j * bk, min((j + 1) * bk, s))   # batch row 0: all
        np.testing.assert_array_equal(out[0, rows, 0],
                                      (kb[0, rows, 0] * factor).astype(
                                          np.float16))
    assert out.shape == ref.shape == (b, -(-s // bk) * bk, h, d)
    differ = out != ref
    assert differ.mean() < 1e-4, (s, differ.sum())
    gap = np.abs(out.astype(np.float64) - ref.astype(np.float64))[differ]
    assert (gap <= np.spacing(np.abs(ref[differ])).astype(np.float64)).all()


@functools.cache
def sweep_errors(implementation="reference", shape=(1, 512, 2, 128)):
  """``{(dist, x0, am): {allocation: rel RMSE on fp16_fp32's finite rows}}``
  over the points of the PASA paper's Figures 9 and 10 where fp16_fp32 has
  finite rows, every allocation on ``implementation``."""
  from jaxattn import report
  allocations = {"fp16_fp32": dict(method="fp16_fp32"),
                 "pasa": dict(method="pasa"),
                 "algorithm1": dict(method="pasa", **pasa.ALGORITHM1)}
  out = {}
  for dist, x0, am in report.sweep_inputs(report.PASA_SWEEPS):
    q, k, v = data.pasa_case(jax.random.key(3), dict(dist=dist, x0=x0,
                                                      am=am), shape)
    ref = np.asarray(textbook(q, k, v))
    o = {n: np.asarray(jaxattn.dot_product_attention(
        q, k, v, implementation=implementation, **kw), np.float64)
         for n, kw in allocations.items()}
    assert metrics.nonfinite_fraction(o["pasa"]) == 0.0, (dist, x0, am)
    rows = np.broadcast_to(np.isfinite(o["fp16_fp32"]).all(-1, keepdims=True),
                           ref.shape)
    if rows.any():
      out[dist, x0, am] = {n: metrics.relative_rmse(x[rows], ref[rows])
                           for n, x in o.items()}
  return out


def check_sweep_ordering(errors):
  """The assertions of :func:`test_pasa_beats_fp16_fp32_on_the_papers_sweeps`
  (also run on the GPU kernels by tests/test_gpu_mosaic.py): PASA's error
  at most 0.6x fp16_fp32's at a non-zero mean, equal at x0 = 0."""
  assert len(errors) == 13, sorted(errors)   # 4 points have no finite row
  worse_literal = 0
  for (dist, x0, am), e in errors.items():
    if x0 == 0:  # no block shifted, exact keys: fp16_fp32's arithmetic
      assert e["pasa"] == e["fp16_fp32"], (dist, x0, am, e)
    else:        # the shift removes most of the error
      assert e["pasa"] <= 0.6 * e["fp16_fp32"], (dist, x0, am, e)
    worse_literal += e["algorithm1"] > e["fp16_fp32"]
  assert worse_literal >= 9, worse_literal


def test_pasa_beats_fp16_fp32_on_the_papers_sweeps():
  """The default allocation (float32 state, sum-preserving keys, adaptive
  shift, running online softmax) is at least as accurate as fp16_fp32 at
  every point of Figures 9 and 10, with no NaN anywhere: measured 0.04x to
  0.41x of its error with a non-zero mean, and the same at x0 = 0, where
  no block is shifted, the keys keep no scale, and PASA computes
  fp16_fp32's arithmetic
  (:func:`test_pasa_is_fp16_fp32_where_no_block_is_shifted`).  Algorithm 1 literally
  (float16 state) loses to fp16_fp32 at 11 of the 13 points (the paper's
  Figure 9b says otherwise)."""
  check_sweep_ordering(sweep_errors())


def test_online_softmax_follows_the_state_dtype():
  """``online_softmax=None`` is the running form with the float32 state and
  Algorithm 1's per-block form with the float16 one; the running form
  refuses the float16 state."""
  assert pasa.PasaConfig().running_softmax
  assert not pasa.PasaConfig(state_dtype="float16",
                             adaptive_shift=False).running_softmax
  assert not pasa.PasaConfig.algorithm1().running_softmax
  assert not pasa.PasaConfig(online_softmax="per_block").running_softmax
  with pytest.raises(ValueError, match="needs state_dtype='float32'"):
    pasa.PasaConfig(state_dtype="float16", adaptive_shift=False,
                    online_softmax="running")


def check_pasa_is_fp16_fp32(implementation, dist, am, shape):
  """PASA and fp16_fp32 give the same output, bit for bit, at x0 = 0 (see
  :func:`test_pasa_is_fp16_fp32_where_no_block_is_shifted`)."""
  q, k, v = data.pasa_case(jax.random.key(7), dict(dist=dist, x0=0.0, am=am),
                           shape)
  run = functools.partial(jaxattn.dot_product_attention,
                          implementation=implementation)
  want = {}
  for causal in (False, True):
    want[causal] = np.asarray(run(q, k, v, method="fp16_fp32",
                                  is_causal=causal))
    out = np.asarray(run(q, k, v, method="pasa", is_causal=causal))
    np.testing.assert_array_equal(out, want[causal])
  per_block = np.asarray(run(q, k, v, method="pasa",
                             online_softmax="per_block"))
  assert (per_block != want[False]).any()


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["reference", "triton", "mosaic"])
@pytest.mark.parametrize("dist, am", [("uniform", 0.5), ("hybrid", 10.0)])
def test_pasa_is_fp16_fp32_where_no_block_is_shifted(implementation, dist,
                                                     am):
  """At x0 = 0 the adaptive shift moves no key block, every correction is
  0, these scores cannot overflow so the keys keep no scale (exact), and
  PASA's running online softmax is fp16_fp32's arithmetic op for op: the
  same output, bit for bit, on every backend (causal and not, a length
  that is not a whole block).  Algorithm 1's per-block softmax is not
  identical."""
  check_pasa_is_fp16_fp32(implementation, dist, am, (1, 200, 1, 128))


def test_unscaled_keys_fit_bounds_the_scores():
  """p = 1 only where |q| (1 + beta) max|k| stays below the limit (and the
  shifted keys themselves do); a NaN/Inf does not count."""
  beta = pasa.PasaConfig().resolved_beta
  lim = pasa.UNSCALED_SCORE_LIMIT
  fit = lambda qn, kn: bool(pasa.unscaled_keys_fit(qn, kn, beta))
  assert fit(1.0, lim / (1 + beta)) and not fit(1.0, 1.001 * lim / (1 + beta))
  assert fit(1e-3, 0.9 * lim / (1 + beta))
  assert not fit(1e-3, 1.1 * lim / (1 + beta))   # k' itself overflows
  assert fit(100.0, 0.99 * lim / 100 / (1 + beta))
  assert not fit(100.0, 1.01 * lim / 100 / (1 + beta))
  x = jnp.asarray([[3.0, 4.0], [jnp.inf, 1e4], [jnp.nan, 0.0]], jnp.float16)
  assert float(base.max_row_norm(x)) == 1e4
  with pytest.raises(ValueError, match="scale_in_keys"):
    pasa.PasaConfig(scale_in_keys="auto")


@pytest.mark.parametrize("implementation", ["reference", "triton", "mosaic"])
def test_keys_keep_the_scale_only_where_scores_could_overflow(implementation):
  """``scale_in_keys=None`` is ``False`` (exact keys) on ordinary inputs;
  key entries below 2^-10 (float16 subnormals once scaled by p = 2^-4)
  make the two choices differ.  Where a score could overflow without the
  scale, None is True: :func:`test_pasa_bound_and_what_lies_beyond`."""
  run = functools.partial(jaxattn.dot_product_attention, method="pasa",
                          implementation=implementation, is_causal=True)
  q, k, v = data.pasa_case(jax.random.key(1), dict(dist="hybrid", x0=0.0,
                                                   am=10.0), (1, 192, 2, 64))
  k = k.at[:, ::3, :, ::5].set(3e-4)
  auto = np.asarray(run(q, k, v))
  exact = np.asarray(run(q, k, v, scale_in_keys=False))
  scaled = np.asarray(run(q, k, v, scale_in_keys=True))
  np.testing.assert_array_equal(auto, exact)
  assert (scaled != exact).any()


@pytest.mark.parametrize("implementation", ["reference", "triton"])
def test_keys_without_the_scale_stay_finite_at_the_limit(implementation):
  """The worst case of the bound: a block of keys -a 1 with one key +a 1
  (shifted, the key's norm 0.99 (1 + beta) |k|) and q = b 1 along it, with
  |q| (1 + beta) |k| at 0.995 and 1.01 of the limit: the first keeps no
  scale in the keys, the second does, and both are finite and the float32
  result (one-hot on the +a key)."""
  beta = pasa.PasaConfig().resolved_beta
  d = 128
  k = np.full((1, 128, 1, d), -16.0, np.float32)
  k[:, 0] = 16.0
  v = np.asarray(jax.random.normal(jax.random.key(0), (1, 128, 1, d)),
                 np.float32)
  for frac, fits in ((0.995, True), (1.01, False)):
    b = frac * pasa.UNSCALED_SCORE_LIMIT / (16.0 * d * (1 + beta))
    q = jnp.full((1, 4, 1, d), b, jnp.float16)
    kh = jnp.asarray(k, jnp.float16)
    assert bool(pasa.unscaled_keys_fit(base.max_row_norm(q),
                                       base.max_row_norm(kh), beta)) == fits
    out = np.asarray(jaxattn.dot_product_attention(
        q, kh, jnp.asarray(v, jnp.float16), method="pasa",
        implementation=implementation), np.float32)
    np.testing.assert_allclose(out, np.broadcast_to(v[:, :1], out.shape),
                               atol=2e-3)


@pytest.mark.parametrize("implementation", ["reference", "triton"])
def test_per_block_form_with_a_bias_stays_finite(implementation):
  """Algorithm 1's per-block softmax adds a bias in float16 units of
  ``p / scale``: with it the keys keep the scale (``p = 1`` would turn a
  -10000 padding bias into -inf, then NaN); and a block whose every score
  is -inf under the bias gives its rows 0 weight, not NaN."""
  q, k, v = (jax.random.normal(x, (1, 256, 1, 128), jnp.float16)
             for x in jax.random.split(jax.random.key(4), 3))
  ref = metrics.exact_attention
  for bias_value, keys in ((-10000.0, slice(0, 128)),
                           (6000.0, slice(5, 6)), (-1e5, slice(0, 128))):
    bias = jnp.zeros((1, 1, 256, 256), jnp.float32).at[..., keys].set(
        bias_value)
    out = jaxattn.dot_product_attention(
        q, k, v, bias=bias, method="pasa", online_softmax="per_block",
        implementation=implementation)
    want = ref(q, k, v, bias=bias)
    assert metrics.nonfinite_fraction(out) == 0.0, bias_value
    assert metrics.relative_rmse(out, want) < 1e-2, bias_value


# ----------------------------------------------------------------------------
# Resonance: the PASA paper's overflow mechanism.


def test_resonance_overflows_fp16_fp32_but_not_pasa():
  q, k, v = data.resonance(jax.random.key(0), T4_SHAPE)
  ref = textbook(q, k, v)
  o16 = attn(q, k, v, "fp16_fp32")
  assert metrics.nan_fraction(o16) == 1.0      # every score > 65504
  op = attn(q, k, v, "pasa")
  assert metrics.nonfinite_fraction(op) == 0.0
  # Measured 9.4e-3 (Algorithm 1 literally: 0.112): the softmax is nearly
  # one-hot and float16 scores decide the winner; fp32 3.6e-4.
  assert metrics.relative_rmse(op, ref) < 3e-2
  assert metrics.relative_rmse(attn(q, k, v, "fp32"), ref) < 1e-3
  # Out of phase the scores are ~ -4096: no overflow, no NaN.
  q2, k2, v2 = data.resonance(jax.random.key(0), T4_SHAPE, out_of_phase=True)
  assert metrics.nan_fraction(attn(q2, k2, v2, "fp16_fp32")) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", [32, 256])
def test_every_method_at_the_extreme_head_dims(head_dim):
  """Head dims 32 and 256 (the supported range's ends) for every reference,
  and the fp32 / pasa / sage kernels in interpret mode (256: padded
  power-of-two tiles).  Bounds: ACCURACY's, doubled (one seed, fewer
  rows; head dim changes the score spread)."""
  kq, kk, kv = jax.random.split(jax.random.key(head_dim), 3)
  q, k, v = (jax.random.normal(x, (1, 40, 2, head_dim), jnp.float32)
             for x in (kq, kk, kv))
  ref = textbook(q, k, v, is_causal=True)
  for method in jaxattn.METHODS:
    out = attn(q, k, v, method, is_causal=True)
    assert metrics.relative_rmse(out, ref) < 2 * ACCURACY[method][1], method
  for method in ("fp32", "pasa", "sage"):
    out = jaxattn.dot_product_attention(q, k, v, method=method, is_causal=True,
                                        implementation="triton")
    assert metrics.relative_rmse(out, ref) < 2 * ACCURACY[method][1], method


@pytest.mark.parametrize("implementation", ["reference", "triton", "mosaic"])
def test_pasa_bound_and_what_lies_beyond(implementation):
  """PASA is overflow-free while every score minus beta times its key
  block's mean score fits float16 (the README's bound).  Q = K = c (all
  scores equal, s = c^2 D / sqrt(D)): the shifted score is (1 - beta) s,
  finite at c = 300 (1.6e4) and equal to the mean of V as float32
  attention; past the bound, at c = 1000 (1.8e5), every row is NaN (never
  a finite wrong number), like fp16_fp32's overflow.  At c = 300 the keys
  must keep the softmax scale: without it (``scale_in_keys=False``) the
  shifted scores are (1 - beta) 300^2 128 = 1.8e5, all NaN, so the
  default (None) chooses it there."""
  v = jax.random.normal(jax.random.key(0), (1, 256, 1, 128), jnp.float16)
  beta = pasa.PasaConfig().resolved_beta
  for c, finite in ((300.0, True), (1000.0, False)):
    q = jnp.full((1, 256, 1, 128), c, jnp.float16)
    assert ((1 - beta) * c * c * 128 ** 0.5 < 65504) == finite
    out = np.asarray(jaxattn.dot_product_attention(
        q, q, v, method="pasa", implementation=implementation), np.float32)
    if finite:
      assert np.isnan(np.asarray(jaxattn.dot_product_attention(
          q, q, v, method="pasa", implementation=implementation,
          scale_in_keys=False), np.float32)).all()
      np.testing.assert_allclose(out, np.broadcast_to(
          np.asarray(v, np.float32).mean(axis=1, keepdims=True), out.shape),
          atol=2e-3)
    else:
      assert np.isnan(out).all()

"""Query lengths, the local window, bottom-right causal alignment and packed
sequences (segment ids), computed from indices in the kernels: against the
references with the equivalent dense mask (built here from the definition,
independently of the library), against float32 ``jax.nn`` where it has the
feature, and through the gradients."""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import metrics
from pallas_kernels import common

B, N, K, D = 2, 2, 1, 32
# float32 products are TF32 on a GPU (XLA's default precision and Triton's)
F32_TOL = 2e-3 if jax.default_backend() == "gpu" else 2e-5
GRAD_TOL = 5e-3 if jax.default_backend() == "gpu" else 2e-4


def dense_mask(t, s, *, q_lens=None, kv_lens=None, is_causal=False,
               window=None, alignment="top_left", q_seg=None, kv_seg=None):
  """bool ``[B, 1, T, S]`` straight from the definition."""
  q_lens = np.full(B, t) if q_lens is None else np.asarray(q_lens)
  kv_lens = np.full(B, s) if kv_lens is None else np.asarray(kv_lens)
  if isinstance(window, int):
    window = (window, window)
  out = np.zeros((B, 1, t, s), bool)
  for b in range(B):
    off = kv_lens[b] - q_lens[b] if alignment == "bottom_right" else 0
    for i in range(q_lens[b]):
      for j in range(kv_lens[b]):
        d = j - (i + off)          # distance from the aligned diagonal
        ok = not (is_causal and d > 0)
        if window is not None:
          ok &= -window[0] <= d <= window[1]
        if q_seg is not None:
          ok &= q_seg[b][i] == kv_seg[b][j]
        out[b, 0, i, j] = ok
  return out


def _inputs(seed, t, s, dtype=jnp.float16):
  """Activations with real structure: a per-channel key bias and an
  outlier channel in Q and K."""
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (B, t, N, D), jnp.float32)
  k = jax.random.normal(kk, (B, s, K, D), jnp.float32)
  v = jax.random.normal(kv, (B, s, K, D), jnp.float32)
  k = k + jnp.linspace(-2.0, 3.0, D)
  q, k = q.at[..., 5].multiply(8.0), k.at[..., 5].multiply(6.0)
  return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _segments(lengths):
  return np.concatenate([np.full(n, i) for i, n in enumerate(lengths)])


T, S = 96, 130
# segment 2 has keys and no queries; segment 4 queries and no keys
Q_SEG = np.stack([_segments([13, 40, 0, 43]),
                  np.array([0] * 20 + [1] * 30 + [4] * 11 + [3] * 35)])
KV_SEG = np.stack([_segments([20, 1, 50, 59]),
                   _segments([7, 60, 3, 60])])
PACKED = np.stack([_segments([1, 40, 0, 17, 72]), _segments([64, 66])])

CASES = {
    "bottom_right_lengths": dict(
        t=T, s=S, q_lens=[96, 57], kv_lens=[130, 88], is_causal=True,
        alignment="bottom_right"),
    "window_lengths": dict(t=T, s=S, q_lens=[90, 31], window=(17, 4)),
    "window_1": dict(t=T, s=S, window=1),
    "window_wider_than_sequence": dict(t=T, s=S, window=(500, 500),
                                       is_causal=True),
    "segments": dict(t=T, s=S, q_seg=Q_SEG, kv_seg=KV_SEG),
    "packed_causal_window": dict(t=130, s=130, q_seg=PACKED, kv_seg=PACKED,
                                 is_causal=True, window=(30, 0),
                                 kv_lens=[130, 120]),
    "bottom_right_window_segments": dict(
        t=T, s=S, q_seg=Q_SEG, kv_seg=KV_SEG, is_causal=True, window=(40, 0),
        alignment="bottom_right", q_lens=[80, 96]),
}


def _kwargs(case):
  """The case as dot_product_attention keywords."""
  c = dict(case)
  kw = dict(is_causal=c.get("is_causal", False))
  if c.get("q_lens") is not None:
    kw["query_seq_lengths"] = jnp.array(c["q_lens"], jnp.int32)
  if c.get("kv_lens") is not None:
    kw["key_value_seq_lengths"] = jnp.array(c["kv_lens"], jnp.int32)
  if c.get("window") is not None:
    kw["local_window_size"] = c["window"]
  if c.get("alignment"):
    kw["causal_alignment"] = c["alignment"]
  if c.get("q_seg") is not None:
    kw["q_segment_ids"] = jnp.array(c["q_seg"], jnp.int32)
    kw["kv_segment_ids"] = jnp.array(c["kv_seg"], jnp.int32)
  return kw


def _dense(case):
  c = {k: v for k, v in case.items() if k not in ("t", "s")}
  return dense_mask(case["t"], case["s"], **c)


# kernel vs reference (same quantized operands) relative RMSE bounds
# (on a GPU the fp8 P of sage rounds a few probabilities the other way)
METHODS = {"fp32": 1e-5, "fp16_fp32": 2e-3, "fp16": 5e-3, "pasa": 5e-3,
           "sage": 5e-4 if jax.default_backend() == "gpu" else 1e-4,
           "int8": 1e-4, "fmha_int8": 5e-3}


def _rel(a, b):
  """max |a - b| / max |b|."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


# every method on the cases that combine the most features; the rest on a
# float and a quantized method (CI time)
COMBINED = ["bottom_right_lengths", "packed_causal_window",
            "bottom_right_window_segments"]
MATRIX = ([(m, c) for m in METHODS for c in COMBINED]
          + [(m, c) for m in ("fp32", "sage") for c in CASES
             if c not in COMBINED])


@pytest.mark.parametrize("method,case", MATRIX)
def test_triton_kernels_match_reference_with_dense_mask(method, case):
  c = CASES[case]
  q, k, v = _inputs(len(case), c["t"], c["s"],
                    jnp.float32 if method == "fp32" else jnp.float16)
  kw = _kwargs(c)
  out = jaxattn.dot_product_attention(q, k, v, method=method,
                                      implementation="triton", **kw)
  mask = jnp.asarray(_dense(c))
  # the segment ids too: int8's V scales follow them (the mask decides
  # visibility either way)
  segments = {name: kw[name] for name in ("q_segment_ids", "kv_segment_ids")
              if name in kw}
  ref = jaxattn.dot_product_attention(
      q, k, v, mask=mask, method=method, implementation="reference",
      key_value_seq_lengths=kw.get("key_value_seq_lengths"), **segments)
  assert metrics.nonfinite_fraction(out) == 0.0
  assert metrics.relative_rmse(out, ref) < METHODS[method]
  # rows that see no key (padding, an empty segment) are exactly zero
  empty = ~np.asarray(mask).any(-1)[:, 0]                        # [B, T]
  np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)


JAX_NN_CASES = ["window_lengths", "window_1", "window_wider_than_sequence"]


@pytest.mark.parametrize("case", JAX_NN_CASES)
@pytest.mark.parametrize("implementation", ["reference", "triton"])
def test_float32_matches_jax_nn(case, implementation):
  c = CASES[case]
  q, k, v = _inputs(7, c["t"], c["s"], jnp.float32)
  kw = _kwargs(c)
  ref = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
  out = jaxattn.dot_product_attention(q, k, v, implementation=implementation,
                                      **kw)
  np.testing.assert_allclose(out, ref, atol=F32_TOL, rtol=F32_TOL)


def test_padded_query_rows_are_jax_nn_zeros():
  q, k, v = _inputs(3, T, S, jnp.float32)
  q_lens = jnp.array([T, 40], jnp.int32)
  ref = jax.nn.dot_product_attention(q, k, v, query_seq_lengths=q_lens)
  for impl in ("reference", "triton"):
    out, lse = jaxattn.dot_product_attention(
        q, k, v, query_seq_lengths=q_lens, implementation=impl,
        return_residual=True)
    np.testing.assert_array_equal(np.asarray(out)[1, 40:], 0.0)
    np.testing.assert_allclose(out, ref, atol=F32_TOL, rtol=F32_TOL)
    # a row that sees no key: jax.nn's log-sum-exp value for it
    assert np.all(np.asarray(lse)[1, 40:] == np.asarray(lse).min())
    assert np.all(np.isfinite(np.asarray(lse)[1, :40]))


@pytest.mark.parametrize("case", ["window_lengths", "packed_causal_window",
                                  "bottom_right_window_segments"])
@pytest.mark.parametrize("implementation", ["reference", "triton"])
def test_gradients_match_the_dense_mask(case, implementation):
  c = CASES[case]
  q, k, v = _inputs(11, c["t"], c["s"], jnp.float32)
  kw = _kwargs(c)
  mask = jnp.asarray(_dense(c))
  w = jax.random.normal(jax.random.key(1), q.shape)

  def loss(fn):
    return lambda q, k, v: jnp.sum(fn(q, k, v) * w)

  ours = jax.grad(loss(lambda q, k, v: jaxattn.dot_product_attention(
      q, k, v, implementation=implementation, **kw)), (0, 1, 2))(q, k, v)
  # jax.nn with the dense mask: zero the rows that see nothing, as we do
  seen = mask.any(-1)[:, 0, :, None, None]
  dense = jax.grad(loss(lambda q, k, v: jnp.where(
      seen, jax.nn.dot_product_attention(q, k, v, mask=mask), 0.0)),
                   (0, 1, 2))(q, k, v)
  errors = [_rel(a, b) for a, b in zip(ours, dense)]
  assert max(errors) < GRAD_TOL, errors


def test_triton_backward_kernel_skips_with_index_masks():
  """The Pallas backward kernels (interpret mode) with segments, window and
  bottom-right alignment equal the XLA backward."""
  from jaxattn import grad
  c = CASES["bottom_right_window_segments"]
  q, k, v = _inputs(5, c["t"], c["s"], jnp.float32)
  kw = _kwargs(c)
  im = common.IndexMask(
      q_lens=kw["query_seq_lengths"],
      offsets=jnp.full((B,), S, jnp.int32) - kw["query_seq_lengths"],
      q_segments=kw["q_segment_ids"], kv_segments=kw["kv_segment_ids"],
      window=(40, None))
  kv_lens = jnp.full((B,), S, jnp.int32)
  dout = jax.random.normal(jax.random.key(2), q.shape)
  static = dict(scale=D ** -0.5, is_causal=True, index_mask=im)
  lse = grad.logsumexp(q, k, None, None, kv_lens, **static)
  ref = grad.xla_vjp(q, k, v, None, None, kv_lens, lse, dout, **static)[:3]
  out = grad.pallas_vjp(q, k, v, kv_lens, dout, **static)
  errors = [_rel(a, b) for a, b in zip(out, ref)]
  assert max(errors) < GRAD_TOL, errors


def test_nonfinite_key_reaches_only_its_segment():
  c = CASES["segments"]
  q, k, v = _inputs(4, T, S)
  k = k.at[0, 20, 0, 3].set(jnp.nan)   # the one key of segment 1 (row 0)
  kw = _kwargs(c)
  for method in ("fp32", "sage", "pasa"):
    out = jaxattn.dot_product_attention(q, k, v, method=method,
                                        implementation="triton", **kw)
    bad = np.isnan(np.asarray(out)).any(-1)                # [B, T, N]
    expect = np.zeros_like(bad)
    expect[0, 13:53] = True                   # the queries of segment 1
    np.testing.assert_array_equal(bad, expect)


@functools.partial(jax.jit, static_argnames=(
    "t", "rows", "cols", "is_causal", "transpose", "n_row_blocks", "block_r",
    "block_c", "has_mask"))
def _ranges_and_visibility(kv_lens, im, row_seg, col_seg, *, t, rows, cols,
                           is_causal, transpose, n_row_blocks, block_r,
                           block_c, has_mask):
  """``common.block_ranges`` and the visibility it must cover, over rows
  (queries, or keys with ``transpose``), in one compile."""
  bounds = common.row_bounds(kv_lens, im, t=t, is_causal=is_causal)
  if transpose:
    bounds = common.transpose_bounds(bounds)
  ranges = common.block_ranges(bounds, row_seg, col_seg,
                               n_row_blocks=n_row_blocks, block_r=block_r,
                               block_c=block_c, has_mask=has_mask)
  vis = jaxattn.base.index_visibility(bounds, row_seg, col_seg, t=rows,
                                      s=cols)
  return ranges, vis


@pytest.mark.slow
def test_block_ranges_cover_every_visible_block():
  """Random bounds, lengths and (sorted or scattered) segment ids: no block
  a row sees is skipped, and no "full" block hides a masked score."""
  rng = np.random.default_rng(0)
  for _ in range(24):   # few distinct shapes: eager jax compiles per shape
    t, s = (int(x) for x in rng.choice([5, 23, 40], 2))
    br, bc = (int(x) for x in rng.choice([4, 8, 16], 2))
    window = None if rng.integers(2) else tuple(
        None if rng.integers(4) == 0 else int(rng.integers(0, 20))
        for _ in range(2))
    if rng.integers(2):
      q_seg = np.sort(rng.integers(0, 4, (B, t)), 1)
      kv_seg = np.sort(rng.integers(0, 4, (B, s)), 1)
    else:
      q_seg, kv_seg = rng.integers(0, 3, (B, t)), rng.integers(0, 3, (B, s))
    q_lens, kv_lens = rng.integers(0, t + 1, B), rng.integers(0, s + 1, B)
    offsets = rng.integers(-5, s + 5, B)
    is_causal, has_mask = bool(rng.integers(2)), bool(rng.integers(4) == 0)
    im = common.IndexMask(
        q_lens=jnp.array(q_lens, jnp.int32),
        offsets=jnp.array(offsets, jnp.int32),
        q_segments=jnp.array(q_seg, jnp.int32),
        kv_segments=jnp.array(kv_seg, jnp.int32), window=window)
    for transpose in (False, True):
      rs, cs = (kv_seg, q_seg) if transpose else (q_seg, kv_seg)
      rows, cols = (s, t) if transpose else (t, s)
      nrb = -(-rows // br)
      ranges, vis = (np.asarray(x) for x in _ranges_and_visibility(
          jnp.array(kv_lens, jnp.int32), im, jnp.array(rs, jnp.int32),
          jnp.array(cs, jnp.int32), t=t, rows=rows, cols=cols,
          is_causal=is_causal, transpose=transpose, n_row_blocks=nrb,
          block_r=br, block_c=bc, has_mask=has_mask))
      vis = np.pad(vis, ((0, 0), (0, nrb * br - rows),
                         (0, -(-cols // bc) * bc - cols)))
      for b in range(B):
        for rb in range(nrb):
          lo, flo, fhi, hi = ranges[b, rb]
          assert lo <= flo <= fhi <= hi
          blk = vis[b, rb * br:(rb + 1) * br]
          for cb in range(blk.shape[1] // bc):
            x = blk[:, cb * bc:(cb + 1) * bc]
            assert not x.any() or lo <= cb < hi
            assert not flo <= cb < fhi or (x.all() and not has_mask)


def test_row_key_ranges_are_the_visible_keys():
  """The Mosaic kernel's masked blocks: each row's first and last key
  (common.row_key_ranges) and the segment ids compared are the visibility
  of the bounds and ids; padded rows see nothing.  Random lengths,
  offsets, windows, causal or not, sorted or scattered ids."""
  rng = np.random.default_rng(1)
  t, s, t_pad = 37, 45, 64
  ranges = jax.jit(functools.partial(common.row_key_ranges, t_pad=t_pad))
  bounds_of = jax.jit(functools.partial(common.row_bounds, t=t),
                      static_argnames="is_causal")
  cols = np.arange(s)
  for trial in range(8):
    window = (None if trial % 2 else
              (int(rng.integers(0, 20)), int(rng.integers(0, 20))))
    im = common.IndexMask(
        q_lens=jnp.array(rng.integers(0, t + 1, B), jnp.int32),
        offsets=jnp.array(rng.integers(-5, s + 5, B), jnp.int32),
        window=window)
    bounds = bounds_of(jnp.array(rng.integers(0, s + 1, B), jnp.int32), im,
                       is_causal=bool(trial % 3))
    key_range = np.asarray(ranges(bounds))
    assert key_range.shape == (B, 2, t_pad)
    q_seg, kv_seg = rng.integers(0, 3, (B, t)), rng.integers(0, 3, (B, s))
    if trial % 4 < 2:
      q_seg, kv_seg = np.sort(q_seg, 1), np.sort(kv_seg, 1)
    vis = np.asarray(jaxattn.base.index_visibility(
        bounds, jnp.asarray(q_seg), jnp.asarray(kv_seg), t=t, s=s))
    in_range = ((cols >= key_range[:, 0, :t, None])
                & (cols <= key_range[:, 1, :t, None]))
    np.testing.assert_array_equal(
        in_range & (q_seg[:, :, None] == kv_seg[:, None, :]), vis)
    assert (key_range[:, 1, t:] == -1).all()     # padded rows see nothing


def test_bad_index_arguments_raise():
  q, k, v = _inputs(0, 8, 8, jnp.float32)
  cases = [
      (dict(query_seq_lengths=jnp.array([9, 1])), "query_seq_lengths"),
      (dict(query_seq_lengths=jnp.array([1.0, 2.0])), "query_seq_lengths"),
      (dict(local_window_size=-1), "local_window_size"),
      (dict(local_window_size=(1, 2, 3)), "local_window_size"),
      (dict(causal_alignment="top"), "causal_alignment"),
      (dict(kv_segment_ids=jnp.zeros((B, 8), jnp.int32)), "q_segment_ids"),
      (dict(q_segment_ids=jnp.zeros((B, 7), jnp.int32)), "q_segment_ids"),
      (dict(q_segment_ids=jnp.zeros((B, 8), jnp.float32)), "q_segment_ids"),
  ]
  for kw, word in cases:
    with pytest.raises(ValueError, match=word):
      jaxattn.dot_product_attention(q, k, v, **kw)
  with pytest.raises(ValueError, match="kv_segment_ids"):
    jaxattn.dot_product_attention(q, k[:, :6], v[:, :6],
                                  q_segment_ids=jnp.zeros((B, 8), jnp.int32))


@pytest.mark.parametrize("implementation", ["reference", "triton", "mosaic"])
def test_int8_v_scale_per_segment(implementation):
  """Packed documents whose values differ in magnitude: INT8's V scale is
  one per segment, so each document's output is as accurate as the
  document run alone (one V scale per head would make the small-V
  documents' error many times larger: 8x, measured in 1d6ab53)."""
  lengths, v_factors = [37, 90, 13, 60], [8.0, 0.125, 3.0, 0.3]
  q, k, v = _inputs(11, sum(lengths), sum(lengths))
  bounds = np.cumsum([0] + lengths)
  docs = [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
  factor = np.concatenate([np.full(n, f) for n, f in zip(lengths, v_factors)])
  v = (v.astype(jnp.float32) * factor[None, :, None, None]).astype(v.dtype)
  seg = jnp.asarray(np.tile(_segments(lengths), (B, 1)), jnp.int32)
  run = functools.partial(jaxattn.dot_product_attention, is_causal=True,
                          method="int8")
  packed = run(q, k, v, q_segment_ids=seg, implementation=implementation)
  f32 = lambda x: x.astype(jnp.float32)
  for d in docs:
    truth = jaxattn.dot_product_attention(f32(q[:, d]), f32(k[:, d]),
                                          f32(v[:, d]), is_causal=True)
    alone = run(q[:, d], k[:, d], v[:, d], implementation="reference")
    err_packed = metrics.relative_rmse(packed[:, d], truth)
    err_alone = metrics.relative_rmse(alone, truth)
    assert err_packed < 1.1 * err_alone + 1e-4, (d, err_packed, err_alone)


@pytest.mark.parametrize("is_causal,window,alignment", [
    (True, None, "bottom_right"), (False, (3, 0), "top_left"),
    (True, (1, 1), "bottom_right"), (False, (0, 0), "top_left"),
    (False, (50, 70), "bottom_right")])
def test_nonfinite_rows_from_key_ranges_equal_the_dense_rule(
    is_causal, window, alignment):
  """Without segment ids the rows a NaN/Inf input reaches come from each
  row's key range by a prefix count of the bad keys (no ``lax.cond``):
  the same rows as the dense definition, with GQA, query and key lengths,
  bottom-right offsets, a window of 1 and a row that sees nothing."""
  from jaxattn import nonfinite
  t, s, n, nk = 40, 64, 4, 2
  rng = np.random.default_rng(3)
  q_lens, kv_lens = np.asarray([40, 29]), np.asarray([64, 37])
  bad_q = jnp.asarray(rng.random((B, t, n)) < 0.05)
  bad_kv = jnp.asarray(rng.random((B, s, nk)) < 0.04)
  offsets = (kv_lens - q_lens) if alignment == "bottom_right" else 0 * q_lens
  im = common.IndexMask(q_lens=jnp.asarray(q_lens, jnp.int32),
                        offsets=jnp.asarray(offsets, jnp.int32),
                        window=window)
  vis = dense_mask(t, s, q_lens=q_lens, kv_lens=kv_lens, is_causal=is_causal,
                   window=window, alignment=alignment)[:, 0]   # [B, T, S]
  sees = vis.any(-1)[..., None]
  bad_key = np.repeat(np.asarray(bad_kv), n // nk, axis=2)     # [B, S, N]
  want = ((vis[..., None] & bad_key[:, None]).any(2)
          | (np.asarray(bad_q) & sees))
  assert want.any() and not want.all()
  for q_flags in (bad_q, None):
    got = jax.jit(functools.partial(
        nonfinite.rows_reached, is_causal=is_causal, q_shape=(B, t, n, D)))(
            q_flags, bad_kv, None, jnp.asarray(kv_lens, jnp.int32),
            index_mask=im)
    expect = want if q_flags is not None else (
        vis[..., None] & bad_key[:, None]).any(2)
    np.testing.assert_array_equal(np.asarray(got), expect)

"""The kernels' quantizers (jaxattn/operands.py and the Triton passes of
pallas_kernels/quantizers.py, written on BTNH arrays for speed) against the
references' (per head through vmap): the same quantized values and scales,
bit for bit given the same means, over every granularity, with key
padding, GQA and lengths that are not multiples of the groups.  The means
that the passes sum themselves (sage's key mean, query-block means and V
mean) are compared to float32 summation order."""
import contextlib
import functools
import os
import sys
import threading
from unittest import mock

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxattn import data, fmha, fp8, int_flash, nonfinite, quant, sage
from jaxattn import methods
from jaxattn import operands as prepare
from pallas_kernels import common, quantizers, triton_call


def _inputs(seed, b=2, t=300, s=260, n=4, kh=2, d=64):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (b, t, n, d), jnp.float16) * 2,
          jax.random.normal(kk, (b, s, kh, d), jnp.float16) + 1.5,
          jax.random.normal(kv, (b, s, kh, d), jnp.float16),
          jnp.array([s - 10, s][:b], jnp.int32))


@contextlib.contextmanager
def _given_means(k=None, k_mean=None, v_stats=None):
  """The XLA quantizers (:func:`prepare.sage_inputs`) given the kernels'
  statistics: ``k_mean`` as the mean of the traced keys ``k`` (other
  tensors' means are XLA's), ``v_stats`` (``v_mean``, ``v_scale``) as V's."""
  key_mean, v_stats_fn = prepare._key_mean, prepare.sage_v_stats
  with mock.patch.object(
      prepare, "_key_mean",
      lambda x, lens: k_mean if k_mean is not None and x is k
      else key_mean(x, lens)), \
      mock.patch.object(prepare, "sage_v_stats",
                        lambda *a, **kw: dict(v_stats) if v_stats is not None
                        else v_stats_fn(*a, **kw)):
    yield


def _assert_to_summation_order(got, want):
  """float32 sums of the same terms in another order: rtol 1e-6 relative
  to the largest |value|."""
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape, (got.shape, want.shape)
  np.testing.assert_allclose(got, want, rtol=1e-6,
                             atol=1e-6 * np.abs(want).max())


def _assert_same(fast, ref, approx=()):
  assert set(fast) == set(ref), (set(fast), set(ref))
  for name in fast:
    a = np.asarray(fast[name].astype(jnp.float32))
    r = np.asarray(ref[name].astype(jnp.float32))
    assert a.shape == r.shape, (name, a.shape, r.shape)
    if name in approx:  # float32 sums: accumulation order
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
  for name in ("q_scale", "q_mean"):
    ref.pop(name, None)
  # (the means are float32 reductions that XLA on the GPU orders
  # differently in the two computations: 1 ulp apart there)
  _assert_same(fast, ref, approx=("smooth_bias", "v_mean"))


@pytest.mark.parametrize("opts", [
    dict(), dict(v_granularity="block"), dict(pv_dtype="fp16"),
    dict(v_granularity="block", block_k=128)], ids=str)
def test_int8_inputs_equal_reference(opts):
  q, k, v, lens = _inputs(7)
  cfg = int_flash.Int8Config(**opts)
  fast = jax.jit(lambda *a: prepare.int8_inputs(*a, config=cfg))(q, k, v, lens)
  _assert_same(fast, jax.jit(lambda *a: int_flash.int8_quantize(
      *a, config=cfg))(q, k, v, lens))


@pytest.mark.parametrize("opts", [dict(), dict(granularity="block")], ids=str)
def test_fp8_inputs_equal_reference(opts):
  q, k, v, lens = _inputs(8)
  cfg = fp8.Fp8Config(**opts)
  fast = jax.jit(lambda *a: prepare.fp8_inputs(*a, config=cfg))(q, k, v, lens)
  _assert_same(fast, jax.jit(lambda *a: fp8.fp8_quantize(
      *a, config=cfg))(q, k, v, lens))


@pytest.mark.parametrize("method,opts", [
    ("sage", dict(preset="sage2-8b")), ("sage", dict(smooth_v=False)),
    ("int8", dict()), ("int8", dict(v_granularity="block")),
    ("fp8", dict()), ("fp8", dict(granularity="block", block_k=128))],
    ids=str)
def test_kernel_inputs_v_equals_reference_transposed(method, opts):
  """The 8-bit V of the kernels' inputs, written transposed by the one-pass
  Triton kernel (the V pass), is the reference quantizer's V transposed,
  bit for bit (sage's given the same V statistics, whose mean is the
  kernel's sum: to summation order; key padding, a length that is not a
  multiple of the kernel's 128-key tile)."""
  q, k, v, lens = _inputs(11, s=250)
  cfg = methods.get(method).config_cls.from_options(**opts)
  p = jax.jit(lambda *a: prepare.quantized_operands(
      method, *a, scale=0.1, config=cfg))(q, k, v, lens)
  ref = jax.jit({
      "sage": lambda *a: sage.sage_quantize(*a, scale=0.1, config=cfg),
      "int8": lambda *a: int_flash.int8_quantize(*a, config=cfg),
      "fp8": lambda *a: fp8.fp8_quantize(*a, config=cfg)}[method])(
          q, k, v, lens)
  if method == "sage":
    # V's statistics are the first phase's (its mean a float32 sum: to
    # summation order against the reference's); given them, the XLA
    # quantizer's V (sage_inputs, the reference's bit for bit) is V
    stats = jax.jit(lambda *a: prepare.fused_operands(
        method, *a, scale=0.1, config=cfg))(q, k, v, lens)
    stats = {n: stats[n] for n in ("v_mean", "v_scale")}
    np.testing.assert_array_equal(np.asarray(p.out_shift),
                                  np.asarray(stats["v_mean"]))
    _assert_to_summation_order(stats["v_mean"], ref["v_mean"])
    with _given_means(v_stats=stats):
      ref = jax.jit(lambda *a: prepare.sage_inputs(
          *a, scale=0.1, config=cfg))(q, k, v, lens)
  assert p.v.shape == (2, 2, 64, 250)
  np.testing.assert_array_equal(
      np.asarray(p.v.astype(jnp.float32)),
      np.asarray(ref["v"].astype(jnp.float32)).transpose(0, 2, 3, 1))


@pytest.mark.parametrize("amax,key_order", [(None, True),
                                             ({"k": 3.0, "v": 2.5}, False)],
                         ids=str)
def test_fmha_operands_equal_reference(amax, key_order):
  """The FMHA's Triton passes give :func:`fmha.fmha_quantize`'s values bit
  for bit (dynamic and static amax; V in the Mosaic key order or not, with
  its block column sums), with a NaN query row, an Inf key and a NaN value
  (those count as 0 in the amax and the values, and only their rows are
  flagged) and large keys and values past the length (not in the amax)."""
  q, k, v, lens = _inputs(13, s=250)
  k, v = k.at[0, 245].set(50.0), v.at[0, 245].set(-50.0)   # beyond lens[0]
  cfg = fmha.FmhaConfig(amax=amax)
  bad = (q.at[1, 7, 2, 3].set(jnp.nan), k.at[0, 30, 1, 0].set(jnp.inf),
         v.at[1, 100, 0, 5].set(jnp.nan))
  ops, v_scale = prepare.fmha_operands(*bad, lens, scale=0.1, config=cfg,
                                       block_k=64, v_key_order=key_order)
  ref = fmha.fmha_quantize(q.at[1, 7, 2, 3].set(0), k.at[0, 30, 1, 0].set(0),
                           v.at[1, 100, 0, 5].set(0), lens, config=cfg)
  same = lambda a, r: np.testing.assert_array_equal(np.asarray(a, np.float32),
                                                    np.asarray(r, np.float32))
  same(ops.q, ref["q"])
  same(ops.k, ref["k"])
  same(v_scale, ref["v_scale"])
  same(ops.q_scale[0, 0, 0], ref["q_scale"] * ref["k_scale"]
       * np.float32(0.1 * np.log2(np.e)))
  v_ref = np.pad(np.asarray(ref["v"], np.int32).transpose(0, 2, 3, 1),
                 [(0, 0)] * 3 + [(0, 6)])
  same(ops.v, v_ref[..., quantizers.key_order(256)] if key_order
       else v_ref[..., :250])
  colsum = v_ref.reshape(2, 2, 64, 4, 64)
  same(ops.v_colsum, colsum.sum(-1).transpose(0, 1, 3, 2))
  want_q = np.zeros(q.shape[:3], bool)
  want_q[1, 7, 2] = True
  want_kv = np.zeros(k.shape[:3], bool)
  want_kv[0, 30, 1] = want_kv[1, 100, 0] = True
  np.testing.assert_array_equal(np.asarray(ops.q_nonfinite), want_q)
  np.testing.assert_array_equal(np.asarray(ops.kv_nonfinite), want_kv)


@pytest.mark.parametrize("method", ["sage", "int8", "fp8"])
def test_v_in_mosaic_key_order(method):
  """With ``v_key_order`` the V kernel stores each 16-key chunk in the
  Mosaic kernel's register-operand order (S padded to 16)."""
  q, k, v, lens = _inputs(12, s=250)
  cfg = methods.get(method).config_cls.from_options()
  plain = prepare.quantized_operands(method, q, k, v, lens, scale=0.1,
                                    config=cfg)
  ordered = prepare.quantized_operands(method, q, k, v, lens, scale=0.1,
                                      config=cfg, v_key_order=True)
  assert ordered.v_keys_ordered and not plain.v_keys_ordered
  padded = np.pad(np.asarray(plain.v.astype(jnp.float32)),
                  [(0, 0), (0, 0), (0, 0), (0, 6)])
  np.testing.assert_array_equal(np.asarray(ordered.v.astype(jnp.float32)),
                                padded[..., quantizers.key_order(256)])


@pytest.mark.parametrize("method,opts,shape", [
    ("sage", dict(preset="sage2-8b"), dict()),
    ("sage", dict(preset="sage2-4b"), dict(n=8, kh=2, t=200)),   # GQA 4
    ("sage", dict(preset="sage1"), dict(d=96)),
    ("sage", dict(qk_granularity="token", smooth_v=False), dict()),
    ("sage", dict(block_k=128, block_q=64, warp_rows=16), dict(t=129)),
    ("sage", dict(qk_granularity="block"), dict()),   # Q groups of 128 rows
    ("int8", dict(), dict(d=96)),
    ("fp8", dict(), dict(s=77)),                       # per head
    ("fp8", dict(granularity="block"), dict()),
    ("fp8", dict(granularity="block", block_k=128, block_q=64), dict(s=77)),
], ids=str)
def test_fused_qk_equals_xla_quantizers(method, opts, shape):
  """The one-pass Triton quantizer of Q and K (quantizers.rows_operand through
  prepare.fused_qk) gives the XLA quantizers' values and scales bit for bit
  (sage's given the same key mean, which is the kernel's sum: to summation
  order), and the SageAttention2 bias to float32 accumulation order (key
  padding, lengths that are not multiples of the 128-row tile, head dim
  96)."""
  q, k, v, lens = _inputs(len(str(opts)) + len(str(shape)), **shape)
  if method == "fp8" and "granularity" not in opts:
    # per head: the amax must pass over NaN/Inf and keys past the length
    q = q.at[0, 3, 1, 5].set(jnp.nan).at[1, 7, 0, 2].set(jnp.inf)
    k = k.at[0, -3].set(100.0).at[1, 4, 1, 0].set(-jnp.inf)
  cfg = methods.get(method).config_cls.from_options(**opts)
  fused = jax.jit(lambda *a: prepare.fused_qk(
      method, *a, scale=0.125, config=cfg))(q, k, lens)
  if method == "sage":
    # the key mean is the first phase's column sums: to summation order
    # against XLA's; the XLA quantizers given it, bit for bit
    _assert_to_summation_order(
        fused["k_mean"], prepare._key_mean(k, lens) if cfg.smooth_k
        else np.zeros(fused["k_mean"].shape))

    def xla(q, k, v, lens):
      with _given_means(k=k, k_mean=fused["k_mean"]):
        return prepare.sage_inputs(q, k, v, lens, scale=0.125, config=cfg)
    ref = jax.jit(xla)(q, k, v, lens)
    ref_scale = ref["q_scale_folded"] / sage.log2_scale(0.125)
  else:
    quantizer = {"int8": prepare.int8_inputs, "fp8": prepare.fp8_inputs}
    # (the XLA quantizers read NaN/Inf as 0, as quantized_operands
    # hands them the inputs)
    ref = jax.jit(lambda q, k, v, lens: quantizer[method](
        nonfinite.finite(q), nonfinite.finite(k), v, lens, config=cfg))(
            q, k, v, lens)
    ref_scale = ref["q_scale"]
    if method == "fp8" and cfg.granularity == "block":  # per row
      ref_scale = jnp.repeat(ref_scale, cfg.block_q, axis=1)[:, :q.shape[1]]
      ref["k_scale"] = jnp.repeat(ref["k_scale"], cfg.block_k,
                                  axis=1)[:, :k.shape[1]]
    elif method == "fp8":                 # per head -> per row
      ref_scale = jnp.broadcast_to(ref_scale[:, None], q.shape[:3])
      ref["k_scale"] = jnp.broadcast_to(ref["k_scale"][:, None], k.shape[:3])
  got = {n: fused[n] for n in ("q8", "k8", "k_scale")}
  want = dict(q8=ref["q"], k8=ref["k"], k_scale=ref["k_scale"])
  _assert_same(got, want)
  np.testing.assert_allclose(np.asarray(fused["q_scale"]),
                             np.asarray(ref_scale), rtol=2e-7)
  if method == "sage" and cfg.smooth_q:
    np.testing.assert_allclose(
        np.asarray(fused["q_block_bias"]),
        np.asarray(ref["smooth_bias"] * sage.log2_scale(0.125)),
        rtol=1e-5, atol=1e-6 * float(jnp.abs(ref["smooth_bias"]).max()))
    assert fused["q_block_bias"].shape == ref["smooth_bias"].shape


@pytest.mark.parametrize("opts", [dict(), dict(smooth_v=False),
                                  dict(pv_dtype="fp16")], ids=str)
def test_sage_v_stats_equal_two_pass(opts):
  """V's mean and per-channel fp8 scale from one reduction pass (max and
  min) equal the reference's two-pass values of the smoothed V (per head
  through vmap), bit for bit (the mean, a float32 sum, to its summation
  order: XLA on the GPU orders the two computations' sums differently)."""
  q, k, v, lens = _inputs(21)
  cfg = sage.SageConfig.from_options(**opts)
  ref = sage.sage_quantize(q, k, v, lens, scale=0.1, config=cfg)
  got = jax.jit(lambda v, l: prepare.sage_v_stats(v, l, cfg))(v, lens)
  want = {n: ref[n] for n in got}
  _assert_same(got, want, approx=("v_mean",))  # (1 ulp apart on the GPU)


def test_rows_operand_poisoned_tail_and_int4():
  """Rows at and beyond the length are zeros whatever they held (NaN
  here), int4-valued scales use qmax 7, and groups of 32 rows share one
  scale."""
  x = jax.random.normal(jax.random.key(3), (1, 200, 2, 64), jnp.float32)
  x = x.at[:, 150:].set(jnp.nan)
  x8, sc, _, flags = quantizers.rows_operand(x, jnp.array([150]), group=32,
                                             dtype=jnp.int8, bits=4)
  assert flags is None
  x8, sc = np.asarray(x8), np.asarray(sc)
  assert not np.isnan(sc).any() and (x8[:, 150:] == 0).all()
  assert np.abs(x8).max() == 7
  assert (sc[:, 160:] == 0).all() and (sc[:, 128:160] > 0).all()  # groups
  assert len(np.unique(sc[0, :32, 0])) == 1 and sc[0, 0, 0] != sc[0, 32, 0]


def test_quantizer_tiles_do_not_change_the_bits():
  """The passes' tiles (rows per tile of ``rows_operand``, keys per tile
  and warps of ``v_operand``) are speed knobs only: the GPU's defaults
  and the large tiles (the interpreter's defaults) give the same values,
  scales and flags at a length that is no multiple of either tile, on
  inputs with outlier channels and a NaN (per token, a given scale,
  groups of 64 with the key mean and int4 values, groups of 128); a
  per-tile shift without its block, or a tile that splits a group, is
  refused."""
  x = data.channel_outlier(jax.random.key(6), (1, 200, 2, 64),
                           jnp.float32)[1].at[0, 77, 1, 3].set(jnp.nan)
  lens = jnp.array([171])
  key_mean = jnp.full((1, 1, 2, 64), 0.75, jnp.float32)
  for kw in (dict(group=1, dtype=jnp.int8),
             dict(group=1, dtype=jnp.float8_e4m3fn,
                  scale=jnp.full((1, 2), 0.02, jnp.float32)),
             dict(group=64, dtype=jnp.int8, bits=4, shift=key_mean),
             dict(group=128, dtype=jnp.float8_e4m3fn)):
    gpu_block = max(quantizers.ROWS_TILE, kw["group"])  # the GPU's default
    got = quantizers.rows_operand(x, lens, flag_nonfinite=True,
                                  block=gpu_block, **kw)
    old = quantizers.rows_operand(x, lens, flag_nonfinite=True, block=128,
                                  **kw)
    for g, r in zip(got, old):
      if r is not None:
        np.testing.assert_array_equal(np.asarray(g, np.float32),
                                      np.asarray(r, np.float32))
  with pytest.raises(ValueError, match="block given"):
    quantizers.rows_operand(x, lens, group=32, dtype=jnp.int8,
                            shift="tile_mean")
  with pytest.raises(ValueError, match="whole groups"):
    quantizers.rows_operand(x, lens, group=64, dtype=jnp.int8, block=32)
  ones = jnp.ones((1, 2, 64), jnp.float32)
  for dtype in (jnp.int8, jnp.float8_e4m3fn):
    vkw = dict(shift=ones * 0.5, inv_channel=ones * 20.0,
               inv_row=jnp.ones((1, 2, 200), jnp.float32), dtype=dtype,
               key_order=True, flag_nonfinite=True)
    block_s, warps = quantizers.V_TILES[jnp.dtype(dtype).name]
    got = quantizers.v_operand(x, lens, block_s=block_s, num_warps=warps,
                               **vkw)
    old = quantizers.v_operand(x, lens, block_s=128, num_warps=4, **vkw)
    for g, r in zip(got, old):
      np.testing.assert_array_equal(np.asarray(g, np.float32),
                                    np.asarray(r, np.float32))


@pytest.mark.parametrize("grouped", [True, False])
def test_quantizers_count_nonfinite_as_zero_and_flag_the_rows(grouped):
  """``flag_nonfinite``: a NaN/Inf element quantizes (scales, values, the
  smoothing bias) exactly as a 0 would, and only its row is flagged (also
  beyond the length), in Q/K (:func:`quantizers.rows_operand`, per group
  of 32 rows with a shift and the bias, or per row) and V (``v_operand``);
  a tile without one takes the one-reduction path."""
  x = jax.random.normal(jax.random.key(4), (1, 200, 2, 64), jnp.float32)
  bad = (x.at[0, 37, 1, 5].set(jnp.inf).at[0, 120, 0, 0].set(jnp.nan)
         .at[0, 190, 0, 3].set(-jnp.inf))
  zero = (x.at[0, 37, 1, 5].set(0.0).at[0, 120, 0, 0].set(0.0)
          .at[0, 190, 0, 3].set(0.0))
  shift = jnp.full((1, 1, 2, 64), 0.25, jnp.float32)
  qm = jax.random.normal(jax.random.key(5), (1, 2, 16, 64), jnp.float32)
  want = np.zeros((1, 200, 2), bool)
  want[0, 37, 1] = want[0, 120, 0] = want[0, 190, 0] = True
  kw = (dict(group=32, dtype=jnp.int8, shift=shift, bias_q_mean=qm)
        if grouped else dict(group=1, dtype=jnp.float8_e4m3fn))
  got = quantizers.rows_operand(bad, jnp.array([180]), flag_nonfinite=True,
                                **kw)
  ref = quantizers.rows_operand(zero, jnp.array([180]), **kw)
  for g, r in zip(got[:3], ref[:3]):
    if r is not None:
      np.testing.assert_array_equal(np.asarray(g, np.float32),
                                    np.asarray(r, np.float32))
  np.testing.assert_array_equal(np.asarray(got[3]), want)
  if not grouped:
    return
  ones = jnp.ones((1, 2, 64), jnp.float32)
  vkw = dict(shift=ones * 0.5, inv_channel=ones * 3.0,
             inv_row=jnp.ones((1, 2, 200), jnp.float32),
             dtype=jnp.float8_e4m3fn)
  v8, flags = quantizers.v_operand(bad, jnp.array([180]),
                                   flag_nonfinite=True, **vkw)
  v8_ref, none = quantizers.v_operand(zero, jnp.array([180]), **vkw)
  assert none is None
  np.testing.assert_array_equal(np.asarray(v8, np.float32),
                                np.asarray(v8_ref, np.float32))
  np.testing.assert_array_equal(np.asarray(flags),
                                want.transpose(0, 2, 1))


@pytest.mark.parametrize("flag,chunk", [(False, None), (True, None),
                                        (True, 16)])
def test_rows_operand_tile_mean_is_the_query_block_mean(flag, chunk):
  """``shift="tile_mean"``: each tile subtracts its own rows' mean, which
  it returns; both equal the XLA query-block means and the pass given
  them (a last tile of 8 rows, NaN/Inf counted as 0 in the mean as in the
  values, here bit for bit), whether the tile is quantized whole or in
  chunks of 16 rows; rows at or past a length are left out of the mean
  (numpy float64, to summation order) and quantize to 0."""
  x = jax.random.normal(jax.random.key(7), (2, 200, 2, 96), jnp.float16) + 2
  if flag:
    x = x.at[0, 70, 1, 5].set(jnp.inf).at[1, 199, 0, 0].set(jnp.nan)
  lens = jnp.array([200, 200])
  want_mean, _ = prepare._query_block_means(nonfinite.finite(x), 64)
  kw = dict(group=16, dtype=jnp.int8, block=64, flag_nonfinite=flag,
            chunk=chunk)
  got = quantizers.rows_operand(x, lens, shift="tile_mean", **kw)
  ref = quantizers.rows_operand(nonfinite.finite(x), lens, shift=want_mean,
                                **dict(kw, chunk=None))     # the whole tile
  assert got[2].shape == want_mean.shape == (2, 4, 2, 96)
  np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(want_mean))
  for g, r in zip(got[:2], ref[:2]):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
  if flag:
    assert np.asarray(got[3]).sum() == 2 and got[3][1, 199, 0]
  # rows at or past a length: out of the mean and the values (numpy, f64)
  short = jnp.array([150, 200])
  got = quantizers.rows_operand(x, short, shift="tile_mean", **kw)
  xf = np.asarray(x, np.float64)
  xf = np.where(np.isfinite(xf), xf, 0.0)
  rows = np.arange(256)[None, :, None, None] < np.asarray(short)[:, None,
                                                                 None, None]
  xf = np.where(rows, np.pad(xf, [(0, 0), (0, 56), (0, 0), (0, 0)]), 0.0)
  counts = np.clip(np.asarray(short)[:, None] - 64 * np.arange(4), 1, 64)
  want = xf.reshape(2, 4, 64, 2, 96).sum(2) / counts[:, :, None, None]
  np.testing.assert_allclose(np.asarray(got[2]), want, rtol=1e-6)
  assert (np.asarray(got[2])[0, 3] == 0).all()     # a tile past the length
  assert (np.asarray(got[0])[0, 150:] == 0).all()
  assert (np.asarray(got[1])[0, 160:] == 0).all()     # whole groups past it
  with pytest.raises(ValueError, match="tile_mean"):
    quantizers.rows_operand(x, lens, shift="tile_mean", bias_q_mean=x, **kw)
  for bad in (8, 0, 128, 48):   # splits groups, none, past the tile, odd
    with pytest.raises(ValueError, match="whole groups of 16"):
      quantizers.rows_operand(x, lens, shift="tile_mean",
                              **dict(kw, chunk=bad))
  with pytest.raises(ValueError, match="bias takes its tile whole"):
    quantizers.rows_operand(x, lens, group=16, dtype=jnp.int8, block=64,
                            chunk=32, bias_q_mean=jnp.zeros((2, 2, 4, 96)))


def test_rows_operand_flags_only_nonfinite_inputs():
  """A float32 row whose ``x - shift`` overflows holds no NaN/Inf: it is not
  flagged (as :func:`jaxattn.nonfinite.row_flags` would not), and it
  quantizes as without ``flag_nonfinite``."""
  x = jax.random.normal(jax.random.key(6), (1, 64, 1, 32), jnp.float32)
  x = x.at[0, 11, 0, 2].set(3e38)
  shift = jnp.full((1, 1, 1, 32), -1e38, jnp.float32)
  kw = dict(group=1, dtype=jnp.int8, shift=shift)
  got = quantizers.rows_operand(x, jnp.array([64]), flag_nonfinite=True, **kw)
  ref = quantizers.rows_operand(x, jnp.array([64]), **kw)
  for g, r in zip(got[:2], ref[:2]):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
  assert not np.asarray(got[3]).any()


def test_reciprocal_is_correctly_rounded_from_a_two_ulp_guess():
  """quant.reciprocal is IEEE's 1/s with 1/0 := 0, signs, zeros and powers
  of two included.  A CPU program divides (XLA:CPU's division is correctly
  rounded); the GPU form corrects the division by up to two ulps with an
  exact integer midpoint test (XLA's float32 division on the GPU is not
  correctly rounded: on an H100 about 14% of 1/s one ulp off; the kernels'
  div.rn is).  Both forms run here, and the correction recovers the exact
  quotient from guesses moved by -2..2 ulps."""
  rng = np.random.default_rng(0)
  s = np.concatenate([
      np.abs(rng.standard_normal(20000)).astype(np.float32) * 0.03 + 1e-3,
      (2.0 ** rng.integers(-60, 60, 500)).astype(np.float32),
      rng.uniform(1e-30, 1e30, 2000).astype(np.float32),
      -np.abs(rng.standard_normal(200)).astype(np.float32),
      np.array([0, 1, 3, 7, 127, 448, 1 / 448, 1 / 127], np.float32)])
  s = s.astype(np.float32)
  exact = np.where(s == 0, 0, np.float32(1) / np.where(s == 0, 1, s))
  np.testing.assert_array_equal(np.asarray(jax.jit(quant.reciprocal)(s)),
                                exact.astype(np.float32))
  nonzero = s[s != 0]
  np.testing.assert_array_equal(
      np.asarray(jax.jit(quant._correctly_rounded_reciprocal)(nonzero)),
      (np.float32(1) / nonzero).astype(np.float32))
  # the correction is the GPU's branch, not the CPU's
  lowered = lambda *p: jax.jit(quant.reciprocal).trace(s).lower(
      lowering_platforms=p).as_text()
  assert "next_after" in lowered("cuda")
  assert "next_after" not in lowered("cpu")
  pos = s[s > 0]
  want = (np.float32(1) / pos).astype(np.float32)
  for k in (-2, -1, 1, 2):
    guess = want.copy()
    for _ in range(abs(k)):
      guess = np.nextafter(guess, np.float32(np.inf if k > 0 else 0))
    np.testing.assert_array_equal(
        np.asarray(jax.jit(quant.correct_reciprocal)(
            pos, guess.astype(np.float32))), want)


def test_column_stats_sum_max_min_over_visible_finite_keys():
  """quantizers.column_stats: per channel over the keys below the length,
  NaN/Inf counted as 0: the sum (against float64 numpy, to float32
  summation order), the max and min exactly (-inf / inf where no key is
  visible), at a length that is no multiple of its steps and head dim 96
  (padded); sage's V statistics from it equal the XLA pass's, the mean to
  summation order, where it reads V in place, and are the XLA pass's
  elsewhere."""
  x = data.channel_outlier(jax.random.key(9), (3, 250, 2, 96),
                           jnp.float16)[1]
  x = x.at[0, 10, 1, 5].set(jnp.nan).at[1, 3, 0, 0].set(-jnp.inf)
  x = x.at[0, 240:].set(1e4)                         # past lens[0]
  lens = jnp.array([230, 250, 0], jnp.int32)
  total, hi, lo = quantizers.column_stats(x, lens, extrema=True)
  xf = np.asarray(x, np.float64)
  xf = np.where(np.isfinite(xf), xf, 0.0)
  visible = np.arange(250)[None, :, None, None] < np.asarray(lens)[:, None,
                                                                  None, None]
  want = np.where(visible, xf, 0.0).sum(1)
  np.testing.assert_allclose(np.asarray(total), want, rtol=1e-6,
                             atol=1e-6 * np.abs(want).max())
  np.testing.assert_array_equal(np.asarray(hi),
                                np.where(visible, xf, -np.inf).max(1))
  np.testing.assert_array_equal(np.asarray(lo),
                                np.where(visible, xf, np.inf).min(1))
  # the GPU's step of rows (the interpreter's is larger): the same extrema
  # and amax, the sum to its order
  gpu_chunk = quantizers.COLUMN_STATS_TILES[1]
  for mode in (quantizers.STATS_EXTREMA, quantizers.STATS_AMAX):
    got, ref = (quantizers.run_passes(quantizers.stats_pass(
        x, lens, mode=mode, chunk=c))[0] for c in (gpu_chunk, None))
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
      if mode == quantizers.STATS_EXTREMA and g is jax.tree.leaves(got)[0]:
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6,
                                   atol=1e-6 * float(jnp.abs(r).max()))
      else:
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
  assert quantizers.column_stats(x, lens, extrema=False)[1] is None
  assert not quantizers.column_stats_fits(250, 96)
  assert not quantizers.column_stats_fits(256, 96)
  assert not quantizers.column_stats_fits(32 * 11, 64)   # 2 of 8 ranges
  assert quantizers.column_stats_fits(256, 64)
  cfg = sage.SageConfig.from_options(preset="sage2-8b")
  for v in (x[..., :64].at[:, 250:].set(0.0), x):      # 256 keys / as is
    v = jnp.pad(v, [(0, 0), (0, 6), (0, 0), (0, 0)]) if v.shape[3] == 64 \
        else v
    got = prepare.sage_v_stats(v, lens, cfg, kernel=True)
    ref = prepare.sage_v_stats(nonfinite.finite(v), lens, cfg)
    for name in ("v_mean", "v_scale"):
      r = np.asarray(ref[name])
      if quantizers.column_stats_fits(v.shape[1], v.shape[3]):
        np.testing.assert_allclose(np.asarray(got[name]), r, rtol=1e-6,
                                   atol=1e-6 * np.abs(r).max())
      else:
        np.testing.assert_array_equal(np.asarray(got[name]), r)
    assert (np.asarray(got["v_scale"])[2] == 0).all()   # no visible key


@pytest.mark.parametrize("method,opts,launches", [
    ("sage", dict(preset="sage2-8b"), 2 + 2), ("sage", dict(preset="sage1"),
                                               2 + 1),
    ("int8", dict(), 2 + 1), ("int8", dict(v_granularity="block"), 2),
    ("fp8", dict(), 1 + 2), ("fp8", dict(granularity="block"), 2),
    ("fmha", dict(), 1 + 2), ("fmha", dict(amax={"q": 1.0, "k": 2.0, "v": 3.0}),
                              2)], ids=str)
def test_operands_take_one_launch_per_kind_of_pass(method, opts, launches,
                                                   monkeypatch):
  """The operands come from the Triton passes in two phases, each a launch
  per kind of pass (rows, V, statistics), counted as they are traced: a
  first that reads the tensors whose statistics the second needs (sage's
  key sums and V's sums and extrema, beside the Q pass; the per-head
  amax), then the rest; one phase where no pass needs another's statistic
  (per-block fp8, INT8's per-block V, the FMHA's static amax).  Each
  launch, with a GPU's flags, compiles for sm_90 (H100, H200)."""
  from triton.backends.compiler import GPUTarget
  grids = []
  launch = triton_call.launch
  monkeypatch.setattr(triton_call, "launch", lambda *a, **kw: grids.append(
      kw["grid"]) or launch(*a, **kw))
  q, k, v, lens = _inputs(1)
  if method == "fmha":
    cfg = fmha.FmhaConfig(**opts)
    f = lambda *a: prepare.fmha_operands(*a, scale=0.1, config=cfg,
                                         block_k=64, v_key_order=True)
  else:
    cfg = methods.get(method).config_cls.from_options(**opts)
    f = lambda *a: prepare.quantized_operands(method, *a, scale=0.1,
                                              config=cfg, v_key_order=True)
  with triton_call.compiling_for(GPUTarget("cuda", 90, 32)) as compiled:
    jax.eval_shape(f, q, k, v, lens)
  assert len(grids) == launches, grids
  assert len(compiled) == launches and all(c.asm["cubin"] for c in compiled)


def test_key_pass_with_few_bias_rows_takes_fewer_warps():
  """The key pass with the bias runs on 4 warps with at most
  ``BIAS_FEW_ROWS`` query means (sage's 4x2048 MHA: 16), on 8 with more
  (8x1024 GQA 32/8: 32), unless the caller gives its warps."""
  k = jax.ShapeDtypeStruct((2, 256, 2, 128), jnp.float16)
  lens = jnp.full((2,), 256, jnp.int32)
  def warps(rows, **kw):
    bias_q = jnp.zeros((2, 2, rows, 128), jnp.float32)
    return quantizers.rows_pass(k, lens, group=128, dtype=jnp.int8,
                                bias_q_mean=bias_q, **kw).warps
  few = quantizers.BIAS_FEW_ROWS
  assert warps(few) == quantizers.ROWS_WARPS == 4
  assert warps(2 * few) == quantizers.LARGE_TILE_WARPS == 8
  assert warps(few, num_warps=8) == 8


def test_run_passes_shares_launches_by_kind_and_warps(monkeypatch):
  """:func:`quantizers.run_passes`: on the GPU, passes of one kind and warp
  count share a launch (programs take their roles by program id), other
  passes take launches of their own; in the interpreter all share one.
  Each pass gives the bits it gives alone, in the order given (None
  entries kept): sage's first phase (the column sums and V's extrema, the
  Q pass with its tile means), INT8's rows passes beside a V pass, and
  rows passes of 4 and 8 warps around a statistics pass."""
  from triton.backends.compiler import GPUTarget
  q, k, v, lens = _inputs(2, t=100, s=90, n=2, kh=1)
  q_lens = jnp.full((2,), 100, jnp.int32)
  i8 = jnp.int8
  rows = functools.partial(quantizers.rows_pass, flag_nonfinite=True)
  ones = jnp.ones((2, 1, 64), jnp.float32)
  cases = {
      "sage first": (lambda: (
          quantizers.stats_pass(k, lens, mode=quantizers.STATS_SUM),
          quantizers.stats_pass(v, lens, mode=quantizers.STATS_EXTREMA),
          rows(q, q_lens, group=32, dtype=i8, block=64, shift="tile_mean")),
                     2),
      "rows beside V": (lambda: (
          rows(q, q_lens, group=1, dtype=i8, num_warps=4),
          quantizers.v_pass(v, lens, dtype=jnp.float8_e4m3fn,
                            shift=ones * 0.1, inv_channel=ones * 40.0,
                            key_order=True, flag_nonfinite=True),
          rows(k, lens, group=1, dtype=i8, num_warps=4)), 2),
      "warps apart": (lambda: (
          rows(q, q_lens, group=1, dtype=i8, num_warps=8), None,
          quantizers.stats_pass(v, lens, mode=quantizers.STATS_AMAX),
          rows(k, lens, group=16, dtype=i8, num_warps=4)), 3),
  }
  grids = []
  launch = triton_call.launch
  monkeypatch.setattr(triton_call, "launch", lambda *a, **kw: grids.append(
      kw["grid"]) or launch(*a, **kw))
  for name, (passes, launches) in cases.items():
    live = [p for p in passes() if p is not None]
    with triton_call.compiling_for(GPUTarget("cuda", 90, 32)):   # GPU flags
      assert len(quantizers.launch_groups(live)) == launches, name
    here = 1 if common.interpret() else launches   # (also run on a GPU)
    assert len(quantizers.launch_groups(live)) == here, name
    grids.clear()
    together = quantizers.run_passes(*passes())
    assert len(grids) == here, (name, grids)
    alone = [None if p is None else quantizers.run_passes(p)[0]
             for p in passes()]
    assert [r is None for r in together] == [r is None for r in alone]
    for g, r in zip(jax.tree.leaves(together), jax.tree.leaves(alone)):
      np.testing.assert_array_equal(np.asarray(g, np.float32),
                                    np.asarray(r, np.float32))


def test_float8_rounding_is_ml_dtypes():
  """The float8_e4m3fn values the passes store are ml_dtypes' (round to
  nearest, ties to even), on every e4m3 value, every midpoint and its
  float32 neighbours, subnormals, signed zeros and random values: in the
  interpreter an exact integer emulation stands in for the GPU's
  ``cvt.rn.satfinite`` (the interpreter's own cast rounds ties away from
  zero)."""
  import ml_dtypes
  e4 = ml_dtypes.float8_e4m3fn
  vals = np.arange(256, dtype=np.uint8).view(e4).astype(np.float32)
  vals = np.unique(vals[np.isfinite(vals)])
  mids = (vals[1:] + vals[:-1]) / 2
  rng = np.random.default_rng(0)
  x = np.concatenate([
      vals, mids, -mids, np.nextafter(mids, np.float32(np.inf)),
      np.nextafter(mids, np.float32(-np.inf)), [0.0, -0.0, 1e-30, -1e-30],
      np.exp(rng.uniform(-14, 6.1, 2000)) * rng.choice([-1, 1], 2000)])
  x = np.clip(x, -448, 448).astype(np.float32)
  x = np.pad(x, (0, -len(x) % 64)).reshape(1, -1, 1, 64)
  x8 = quantizers.rows_operand(
      jnp.asarray(x), jnp.array([x.shape[1]]), group=1,
      dtype=jnp.float8_e4m3fn, scale=jnp.ones((1, 1), jnp.float32))[0]
  np.testing.assert_array_equal(np.asarray(x8).view(np.uint8),
                                x.astype(e4).view(np.uint8))


def test_jax_triton_import_keeps_the_triton_cache(tmp_path, monkeypatch):
  """jax_triton's import sets TRITON_CACHE_DIR to "" (Triton's cache off
  for the whole process: torch.compile then fails on a GPU);
  ``triton_call.jax_triton`` imports it and puts the variable back, set or
  unset.  A stand-in module with that side effect plays jax_triton."""
  (tmp_path / "jax_triton.py").write_text(
      "import os\nos.environ['TRITON_CACHE_DIR'] = ''\nmarker = 1\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  for before in ("/some/cache", None):
    monkeypatch.delitem(sys.modules, "jax_triton", raising=False)
    monkeypatch.setattr(triton_call, "_JAX_TRITON", [])
    if before is None:
      monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    else:
      monkeypatch.setenv("TRITON_CACHE_DIR", before)
    assert triton_call.jax_triton().marker == 1
    assert os.environ.get("TRITON_CACHE_DIR") == before
    assert "jax_triton" in sys.modules   # (the stand-in ran its import)


class _FakeTritonLib:
  """Plays ``jax_triton.triton_lib`` for :class:`triton_call.CompileAhead`:
  records each compile's thread and returns its arguments."""

  def __init__(self, fail=False):
    self.threads = []
    self.fail = fail
    self.get_or_create_triton_kernel = self._compile

  @staticmethod
  def get_cuda_backend(device, compute_capability):
    return (device, compute_capability)

  @staticmethod
  def get_triton_type(x):
    if isinstance(x, jax.core.ShapedArray):
      return "*" + x.dtype.name
    return {bool: "B", int: "i32", float: "fp64",
            np.float32: "fp32"}[type(x)]

  def _compile(self, backend_init_func, platform, fn, arg_dtypes, scalar_args,
               **options):
    self.threads.append(threading.current_thread().name)
    if self.fail:
      raise ValueError("TTIR->TTGIR pass failed!")
    return (fn, tuple(arg_dtypes), scalar_args, options)


def _lowering_request(lib, kernel, arrays, scalars, outs, constexprs,
                      num_warps):
  """What jax_triton's lowering asks ``get_or_create_triton_kernel`` for
  (``triton_kernel_call_lowering``): the arrays' types, each scalar's type
  inserted at its index, then the outputs'."""
  arg_dtypes = [lib.get_triton_type(jax.core.ShapedArray(a.shape, a.dtype))
                for a in arrays]
  for i, dtype, _ in scalars:
    arg_dtypes.insert(i, dtype)
  arg_dtypes += [lib.get_triton_type(jax.core.ShapedArray(o.shape, o.dtype))
                 for o in outs]
  return lib.get_or_create_triton_kernel(
      lib.get_cuda_backend, "cuda", kernel, arg_dtypes, tuple(scalars),
      num_warps=num_warps, num_stages=2, num_ctas=1, compute_capability=None,
      enable_fp_fusion=False, metaparams=dict(sorted(constexprs.items())),
      dump=False)


def test_compile_ahead_serves_the_lowering_from_the_trace_time_compile():
  """A launch's compile starts on a worker at trace time, once per kernel
  and arguments (a scalar by type and whether it is 1, as jax_triton
  specialises); the lowering's request with the same arguments takes its
  result once, later and different requests compile on their own (in
  jax_triton: its cache), and a failed compile raises at the lowering."""
  lib = _FakeTritonLib()
  ahead = triton_call.CompileAhead(lib, workers=2)
  x = jax.ShapeDtypeStruct((4, 64), jnp.float16)
  out = jax.ShapeDtypeStruct((4, 64), jnp.int8)
  constexprs = dict(BLOCK=16, ASM=False)
  for n in (3, 5):   # (traced twice, another value: one compile)
    ahead.submit("kernel", (x, n, np.float32(0.5), x, True), (out,), 4, 2,
                 False, constexprs)
  scalars = [(1, "i32", 5), (2, "fp32", 0.5), (4, "B", True)]
  got = _lowering_request(lib, "kernel", [x, x], scalars, [out], constexprs,
                          num_warps=4)
  assert got == ("kernel", ("*float16", "i32", "fp32", "*float16", "B",
                            "*int8"), ((1, "i32", 3), (2, "fp32", 0.5),
                                       (4, "B", True)),
                 dict(num_warps=4, num_stages=2, num_ctas=1,
                      compute_capability=None, enable_fp_fusion=False,
                      metaparams=dict(ASM=False, BLOCK=16), dump=False))
  assert len(lib.threads) == 1
  assert lib.threads[0].startswith("jaxattn-triton-compile")
  here = threading.current_thread().name
  # taken once; another configuration; a scalar equal to 1 (a constant in
  # jax_triton's kernel): each compiles on the lowering's thread
  _lowering_request(lib, "kernel", [x, x], scalars, [out], constexprs,
                    num_warps=4)
  _lowering_request(lib, "kernel", [x, x], scalars, [out], constexprs,
                    num_warps=8)
  ahead.submit("kernel", (x, 1, np.float32(0.5), x, True), (out,), 4, 2,
               False, constexprs)
  ahead.pool.shutdown(wait=True)
  assert lib.threads[1:3] == [here, here]
  assert lib.threads[3].startswith("jaxattn-triton-compile")

  lib = _FakeTritonLib(fail=True)
  ahead = triton_call.CompileAhead(lib, workers=1)
  ahead.submit("kernel", (x, 3, np.float32(0.5), x, True), (out,), 4, 2,
               False, constexprs)
  with pytest.raises(ValueError, match="TTGIR pass failed"):
    _lowering_request(lib, "kernel", [x, x], scalars, [out], constexprs,
                      num_warps=4)
  assert len(lib.threads) == 1


def test_triton_specialize_set_up_without_torch(tmp_path, monkeypatch):
  """Triton's native specialisation imports torch in its one-time set-up
  (4 s of a JAX process's first compile): ``init_specialize_without``
  runs that set-up with the module refused to its own thread only, puts
  the import machinery back, and leaves a process that has the module
  alone."""
  name = "jaxattn_probe_module"
  (tmp_path / f"{name}.py").write_text("VALUE = 7\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delitem(sys.modules, name, raising=False)
  seen = {}

  class Lib:
    @staticmethod
    def native_specialize_impl(backend, arg, is_const, value, align):
      seen["args"] = (backend, arg, is_const, value, align)
      try:
        __import__(name)
        seen["here"] = "imported"
      except ImportError:
        seen["here"] = "refused"
      other = threading.Thread(
          target=lambda: seen.update(other=__import__(name).VALUE))
      other.start()
      other.join()
      return ("i32", None)

  before = list(sys.meta_path)
  triton_call.init_specialize_without(Lib, name)
  assert seen == dict(args=(None, 2, False, False, False), here="refused",
                      other=7)
  assert sys.meta_path == before
  seen.clear()   # the module is imported now (by the other thread)
  triton_call.init_specialize_without(Lib, name)
  assert seen == {}

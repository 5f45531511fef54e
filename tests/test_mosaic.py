"""The Hopper (Mosaic GPU) kernel on CPU, in Mosaic GPU's interpreter
(``implementation="mosaic"`` without a GPU): every method it serves against
its reference with the same quantization choices, on small shapes with odd
lengths, key padding, causal masking and GQA.  The interpreter implements
wgmma with shared-memory operands only, so here the 16-bit P also goes
through shared memory and a separate accumulator (on the GPU it stays in
registers and accumulates in the tensor cores); the rest of the kernel,
barriers and the producer/consumer protocol included, is what runs on the
GPU (the interpreter checks that every barrier phase is observed)."""
import functools

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import api

VARIANTS = [  # measured max rel RMSE on these cases: 1.6e-5 (fp32, f16 out)
    ("fp32", {}),
    ("fp16_fp32", {}),
    ("sage", {}),                                   # sage2-8b
    ("sage", {"preset": "sage1"}),
    ("int8", {}),
    ("int8", {"v_granularity": "block", "block_k": 128}),
    ("int8", {"pv_dtype": "fp16"}),
    ("fp8", {}),
    ("fp8", {"granularity": "block", "block_k": 128}),
]
# The outputs are float16: rounding the same float32 value gives rel ~1e-5;
# the kernel equals the reference up to accumulation order otherwise.  The
# 8-bit P of fp8 (e4m3, step 1/16) and full INT8 (round(127 p)) can flip
# where the accumulation order moves a score across a rounding boundary:
# one flip of a large P measured 1.4e-4 (fp8, 1 seed in 60; the others 2e-6
# to 2.4e-5) and 2.2e-4 (int8 seed 958592335, where the Mosaic and Triton
# kernels agree exactly; 40 other seeds at most 6e-5).  The kernel forms
# fp8 P as exp2(s - m + log2 448) where the references round p * 448, so
# SageAttention2's fp8 P can flip too.
TOL = 1e-4
TOL_8BIT_P = 5e-4
# A P on an 8-bit rounding boundary can round one way in the kernel and the
# other in the reference, which moves that one output row: seed 114345094
# (fp8) moved one row by 2.8e-2, the others 1.4e-5 (one e4m3 step is up to
# 1/8 of the P it rounds).  So 8-bit P allows one row up to this.
TOL_FLIPPED_ROW = 5e-2


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _rel_without_worst_row(a, b):
  """(relative error of every output row but the worst, the worst row's
  own relative error)."""
  a, b = (np.asarray(x, np.float64).reshape(-1, x.shape[-1]) for x in (a, b))
  rows = np.linalg.norm(a - b, axis=1) / np.linalg.norm(b, axis=1)
  worst = int(np.argmax(rows))
  return _rel(np.delete(a, worst, 0), np.delete(b, worst, 0)), rows[worst]


@pytest.mark.parametrize("method,opts", VARIANTS, ids=str)
def test_mosaic_interpreted_matches_reference(method, opts):
  seed = np.random.randint(1 << 30)
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  causal = method in ("sage", "int8") and not opts
  q = jax.random.normal(kq, (1, 150, 2, 64), jnp.float16)
  k = jax.random.normal(kk, (1, 200, 1, 64), jnp.float16) + 0.5
  v = jax.random.normal(kv, (1, 200, 1, 64), jnp.float16)
  kw = dict(method=method, is_causal=causal, key_value_seq_lengths=[170])
  out = jaxattn.dot_product_attention(q, k, v, implementation="mosaic", **kw,
                                      **opts)
  # the options the Mosaic backend filled in (sage: 128-key blocks)
  ref = jaxattn.dot_product_attention(
      q, k, v, implementation="reference", **kw,
      **api.backend_options(method, "mosaic", is_causal=causal, **opts))
  assert out.shape == ref.shape and out.dtype == ref.dtype
  assert bool(jnp.isfinite(out).all())
  eight_bit_p = (method == "fp8" or (method == "int8"
                                     and opts.get("pv_dtype") != "fp16")
                 or (method == "sage" and opts.get("preset") != "sage1"))
  if eight_bit_p:
    rest, worst = _rel_without_worst_row(out, ref)
    assert rest < TOL_8BIT_P and worst < TOL_FLIPPED_ROW, (seed, rest, worst)
  else:
    assert _rel(out, ref) < TOL, (seed, _rel(out, ref))


@pytest.mark.parametrize("method", ["fp8", "int8", "fmha_int8"])
def test_mosaic_256_key_blocks_match_reference(method):
  """256-key blocks (8-bit K and V only; per-tensor fp8's default): several
  blocks, the last one partial, key lengths and causality, on keys with a
  per-channel bias and outlier channels."""
  from jaxattn import data
  q, k, v = data.channel_outlier(jax.random.key(2), (1, 600, 2, 64))
  kw = dict(method=method, is_causal=True, block_k=256,
            key_value_seq_lengths=[530])
  out = jaxattn.dot_product_attention(q, k, v, implementation="mosaic", **kw)
  ref = jaxattn.dot_product_attention(q, k, v, implementation="reference",
                                      **kw)
  at_128 = jaxattn.dot_product_attention(
      q, k, v, implementation="mosaic", **dict(kw, block_k=128))
  out, ref, at_128 = (x[0] if isinstance(x, tuple) else x
                      for x in (out, ref, at_128))
  assert bool(jnp.isfinite(out).all())
  rest, worst = _rel_without_worst_row(out, ref)
  assert rest < TOL_8BIT_P and worst < TOL_FLIPPED_ROW, (rest, worst)
  # (the blocks are 256 keys: P is rounded against other block maxima)
  assert not np.array_equal(np.asarray(out), np.asarray(at_128))


def test_mosaic_fp8_key_block_follows_the_call(monkeypatch):
  """Per-tensor fp8 runs 256-key blocks unless segment ids or a window hide
  key blocks (then 128): each call builds the kernel at that block."""
  assert api.config_for("fp8", "mosaic").block_k == 256
  assert api.config_for("fp8", "mosaic", masked=True).block_k == 128
  assert api.config_for("fp8", "mosaic", granularity="block").block_k == 128
  assert api.config_for("fp8", "mosaic", block_k=64).block_k == 64
  assert api.config_for("fp8", "reference").block_k == 128
  with pytest.raises(NotImplementedError, match="256 needs 8-bit K and V"):
    jaxattn.dot_product_attention(
        _Q[:, :64], _Q[:, :64], _Q[:, :64], method="int8", pv_dtype="fp16",
        block_k=256, implementation="mosaic")
  segs = jnp.asarray(np.repeat(np.arange(3), [70, 150, 80])[None], jnp.int32)
  for block_k, kw in ((256, {}), (128, {"q_segment_ids": segs}),
                      (128, {"local_window_size": (100, 0)})):
    built = _kernels_built(monkeypatch, _Q, method="fp8", is_causal=True,
                           **kw)
    assert [x["block_k"] for x in built] == [block_k], kw


_Q = jax.random.normal(jax.random.key(3), (1, 300, 2, 64), jnp.float16)


def _kernels_built(monkeypatch, q, k=None, v=None, **kw):
  """The keyword arguments of each Mosaic kernel that
  ``dot_product_attention(q, k, v, implementation="mosaic", **kw)`` builds
  (k and v default to q), traced only (``jax.eval_shape``: the kernel is
  not run)."""
  from pallas_kernels import mosaic
  built, kernel = [], mosaic._kernel

  def spy(*args, **kwargs):
    built.append(kwargs)
    return kernel(*args, **kwargs)
  with monkeypatch.context() as m:
    m.setattr(mosaic, "_kernel", spy)
    jax.eval_shape(lambda *qkv: jaxattn.dot_product_attention(
        *qkv, implementation="mosaic", **kw),
                   q, q if k is None else k, q if v is None else v)
  return built


def test_mosaic_int8_key_block_follows_the_call(monkeypatch):
  """Full INT8 (int8 P and V, one V scale per tensor) runs 256-key blocks
  on calls that skip no key block, 128 where causality, segment ids or a
  window do: each call builds the kernel at that block."""
  assert api.config_for("int8", "mosaic").block_k == 256
  for kw in (dict(is_causal=True), dict(masked=True), dict(pv_dtype="fp16"),
             dict(v_granularity="block"), dict(block_k=64)):
    assert api.config_for("int8", "mosaic", **kw).block_k == kw.get(
        "block_k", 128), kw
  assert api.config_for("int8", "reference").block_k == 128
  for block_k, kw in ((256, {}), (128, {"is_causal": True})):
    built = _kernels_built(monkeypatch, _Q, method="int8", **kw)
    assert [x["block_k"] for x in built] == [block_k], kw


@pytest.mark.slow
def test_mosaic_fmha_int8_matches_reference_and_triton():
  """The 8-bit FMHA on the Hopper kernel (uint8 P against each block's own
  row max, ``(P - 128) V + 128 colsum(V)``): its int8 output within one
  step of the reference's and the Triton kernel's (rounding the same
  float32 value after a different accumulation order), causal with GQA,
  padded keys and static amax; then dynamic amax on scores large enough
  for the exact exponent (|s| up to ~1e4 in base 2)."""
  kq, kk, kv = jax.random.split(jax.random.key(11), 3)
  q = jax.random.normal(kq, (1, 150, 2, 64), jnp.float16)
  k = jax.random.normal(kk, (1, 200, 1, 64), jnp.float16) + 0.5
  v = jax.random.normal(kv, (1, 200, 1, 64), jnp.float16)
  kw = dict(is_causal=True, key_value_seq_lengths=[170], return_int8=True,
            amax={"q": 4.0, "k": 4.5, "v": 4.0, "o": 1.5})
  o8, sc = jaxattn.fmha_int8(q, k, v, implementation="mosaic", **kw)
  assert o8.dtype == jnp.int8
  for impl in ("reference", "triton"):
    r8, rsc = jaxattn.fmha_int8(q, k, v, implementation=impl, **kw)
    assert float(sc) == float(rsc)
    diff = np.abs(np.asarray(o8, np.int32) - np.asarray(r8, np.int32))
    assert diff.max() <= 1 and diff.mean() < 0.01, (impl, diff.mean())
  from jaxattn import fmha, operands
  from pallas_kernels import mosaic
  big = (q * 12.0, k * 12.0)   # the adapter's score bound passes 2^12
  ops, _ = operands.fmha_operands(*big, v, jnp.array([200]), scale=0.125,
                                  config=fmha.FmhaConfig(), block_k=128)
  assert float(ops.q_scale[0, 0, 0]) * 127 ** 2 * 64 > (
      mosaic.FUSED_EXPONENT_LIMIT)
  out = jaxattn.fmha_int8(*big, v, implementation="mosaic")
  ref = jaxattn.fmha_int8(*big, v, implementation="reference")
  assert bool(jnp.isfinite(out).all())
  assert _rel(out, ref) < 5e-3, _rel(out, ref)


@pytest.mark.parametrize("case", [(False, 150, 200, 170, 64, 128),
                                  (True, 150, 200, 200, 64, 64),
                                  (True, 256, 256, 256, 128, 128)], ids=str)
def test_mosaic_pasa_matches_triton_and_reference(case):
  """PASA's float16 softmax in the Mosaic kernel is the Triton kernel's
  arithmetic (same shifted keys, same rounding points): measured identical
  outputs on these cases; both differ from the reference by its float16
  accumulation order (rel 3.2e-4 to 3.6e-4)."""
  causal, t, s, kv_len, d, block_k = case
  kq, kk, kv = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 3)
  q = jax.random.normal(kq, (1, t, 2, d), jnp.float16)
  k = jax.random.normal(kk, (1, s, 1, d), jnp.float16) + 0.5
  v = jax.random.normal(kv, (1, s, 1, d), jnp.float16)
  kw = dict(method="pasa", is_causal=causal, key_value_seq_lengths=[kv_len],
            block_k=block_k)
  out = jaxattn.dot_product_attention(q, k, v, implementation="mosaic", **kw)
  tri = jaxattn.dot_product_attention(q, k, v, implementation="triton", **kw)
  ref = jaxattn.dot_product_attention(q, k, v, implementation="reference",
                                      **kw)
  assert out.dtype == jnp.float16 and bool(jnp.isfinite(out).all())
  assert _rel(out, tri) < 1e-4, _rel(out, tri)
  assert _rel(out, ref) < 5e-3, _rel(out, ref)


@pytest.mark.parametrize("method,opts,d", [
    ("fp32", {}, 96), ("sage", {}, 96), ("fp8", {}, 80), ("int8", {}, 40),
    ("pasa", {}, 96)], ids=str)
def test_mosaic_pads_head_dims_to_its_tiles(method, opts, d):
  """Head dims other than 64 and 128 (up to 128) run zero-padded to the
  next tile: the same result as the reference at that head dim."""
  kq, kk, kv = jax.random.split(jax.random.key(d), 3)
  q = jax.random.normal(kq, (1, 150, 2, d), jnp.float16)
  k = jax.random.normal(kk, (1, 200, 1, d), jnp.float16) + 0.5
  v = jax.random.normal(kv, (1, 200, 1, d), jnp.float16)
  kw = dict(method=method, is_causal=True, key_value_seq_lengths=[170],
            **api.backend_options(method, "mosaic", is_causal=True, **opts))
  assert api.resolve_implementation(q, k, v, implementation="mosaic",
                                    **kw) == "mosaic"
  out = jaxattn.dot_product_attention(q, k, v, implementation="mosaic", **kw)
  ref = jaxattn.dot_product_attention(q, k, v, implementation="reference",
                                      **kw)
  assert out.shape == ref.shape == (1, 150, 2, d)
  tol = {"pasa": 5e-3, "fp32": TOL}.get(method, TOL_8BIT_P)
  assert _rel(out, ref) < tol, _rel(out, ref)


def test_mosaic_causal_fp32_bfloat16_whole_blocks():
  """bfloat16, causal, lengths that are whole blocks (no padding)."""
  kq, kk, kv = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(kq, (1, 256, 1, 128), jnp.bfloat16)
  k = jax.random.normal(kk, (1, 256, 1, 128), jnp.bfloat16)
  v = jax.random.normal(kv, (1, 256, 1, 128), jnp.bfloat16)
  out = jaxattn.dot_product_attention(q, k, v, method="fp32", is_causal=True,
                                      implementation="mosaic")
  ref = jaxattn.dot_product_attention(q, k, v, method="fp32", is_causal=True,
                                      implementation="reference")
  assert out.dtype == jnp.bfloat16
  assert _rel(out, ref) < 5e-3  # bfloat16 output and P: rel ~2e-3


def test_mosaic_quantized_bfloat16_in_and_out():
  """8-bit paths with bfloat16 inputs write a bfloat16 output tile."""
  kq, kk, kv = jax.random.split(jax.random.key(4), 3)
  q = jax.random.normal(kq, (1, 128, 1, 64), jnp.bfloat16)
  k = jax.random.normal(kk, (1, 128, 1, 64), jnp.bfloat16)
  v = jax.random.normal(kv, (1, 128, 1, 64), jnp.bfloat16)
  out = jaxattn.dot_product_attention(q, k, v, method="sage",
                                      implementation="mosaic")
  ref = jaxattn.dot_product_attention(q, k, v, method="sage",
                                      implementation="reference",
                                      **api.backend_options("sage", "mosaic"))
  assert out.dtype == jnp.bfloat16
  assert _rel(out, ref) < 5e-3  # bfloat16 output rounding: rel ~2e-3


def test_mosaic_rows_without_keys_are_zero():
  q = jnp.ones((2, 64, 1, 64), jnp.float16)
  k = v = jnp.ones((2, 128, 1, 64), jnp.float16)
  out = jaxattn.dot_product_attention(q, k, v, method="fp32",
                                      key_value_seq_lengths=[0, 5],
                                      implementation="mosaic")
  assert float(jnp.abs(out[0]).max()) == 0.0
  np.testing.assert_allclose(np.asarray(out[1], np.float32), 1.0)


def test_mosaic_refuses_what_it_cannot_run():
  q = k = v = jnp.ones((1, 64, 1, 256), jnp.float16)
  with pytest.raises(NotImplementedError, match="head dim 256"):
    jaxattn.dot_product_attention(q, k, v, implementation="mosaic")
  q = k = v = jnp.ones((1, 64, 1, 64), jnp.float16)
  with pytest.raises(NotImplementedError, match="bias or mask"):
    jaxattn.dot_product_attention(q, k, v, mask=jnp.ones((64, 64), bool),
                                  implementation="mosaic")
  with pytest.raises(NotImplementedError, match="no Mosaic GPU kernel"):
    jaxattn.dot_product_attention(q, k, v, method="fp16",
                                  implementation="mosaic")
  with pytest.raises(NotImplementedError, match="compute_dtype=float32"):
    jaxattn.dot_product_attention(q, k, v, method="pasa",
                                  compute_dtype="float32",
                                  implementation="mosaic")
  with pytest.raises(NotImplementedError, match="float32 inputs"):
    jaxattn.dot_product_attention(q.astype(jnp.float32), k, v,
                                  implementation="mosaic")


def test_auto_selection_falls_back_off_hopper():
  # No GPU here: the automatic choice is the reference, never the interpreter.
  assert not api.BACKENDS["mosaic"].native()
  q = jnp.ones((1, 8, 1, 128))
  assert api.resolve_implementation(q, q, q, method="sage") == "reference"
  assert api.resolve_implementation(q, q, q, method="sage",
                                    implementation="mosaic") == "mosaic"


def test_mosaic_refuses_options_it_cannot_honour():
  """The Triton kernels' knobs and block sizes the Mosaic kernel does not
  take raise with the reason instead of being ignored."""
  q = k = v = jnp.ones((1, 64, 1, 64), jnp.float16)
  for method, opts, reason in [
      ("fp32", dict(tile_q=64), "tile_q=64: Triton kernel knobs"),
      ("int8", dict(num_warps=4), "num_warps=4: Triton kernel knobs"),
      ("pasa", dict(num_stages=2), "num_stages=2: Triton kernel knobs"),
      ("fp32", dict(block_k=32), "block_k=32: the Mosaic kernel takes"),
      ("sage", dict(block_q=64), "sage block_q=64"),
      ("fp8", dict(granularity="block", block_q=32), "block_q=32")]:
    with pytest.raises(NotImplementedError, match=reason):
      jaxattn.dot_product_attention(q, k, v, method=method,
                                    implementation="mosaic", **opts)


def test_automatic_choice_logs_why_it_passes_over_a_backend(monkeypatch,
                                                           caplog):
  """With implementation=None, a native backend that refuses the call is
  passed over with its reason on the "jaxattn" logger."""
  monkeypatch.setattr(api.BACKENDS["mosaic"], "native", lambda: True)
  q = jnp.ones((1, 8, 1, 256), jnp.float16)
  with caplog.at_level("INFO", logger="jaxattn"):
    assert api.resolve_implementation(q, q, q) == "reference"
  assert "does not run on Mosaic GPU here" in caplog.text
  assert "head dim 256" in caplog.text


def test_huge_scores_take_the_exact_exponent():
  """Scores beyond the fused exponent's range (q = k = 6e4: |s| ~ 6e10 in
  base 2) run the exact exponent: a finite output, where the fused one
  gave NaN on every row.  The bound picks for the methods that have one
  (ordinary scores keep the fused, faster exponent); ``fp32`` runs the
  exact one always."""
  from jaxattn.backends import mosaic as mosaic_backend
  pick = lambda bound: int(mosaic_backend._exact_when_needed(
      lambda exact_exponent: jnp.int32(exact_exponent), jnp.float32(bound)))
  assert (pick(10.0), pick(4096.0), pick(5e3), pick(jnp.inf)) == (0, 0, 1, 1)
  q = jnp.full((1, 128, 1, 128), 6e4, jnp.float16)
  v = jax.random.normal(jax.random.key(0), (1, 128, 1, 128), jnp.float16)
  run = lambda method, impl: jaxattn.dot_product_attention(
      q, q, v, method=method, implementation=impl)
  out = run("fp32", "mosaic")
  assert bool(jnp.isfinite(out).all())
  assert bool(jnp.isfinite(run("fp32", "reference")).all())
  # int8 takes the exact exponent through the bound; its int32 scores are
  # exact, so it also equals its reference (float scores of ~1e9 differ by
  # their ulps with the summation order, which such scores magnify)
  out, ref = (np.asarray(run("int8", impl), np.float32)
              for impl in ("mosaic", "reference"))
  assert np.isfinite(out).all() and _rel(out, ref) < TOL_8BIT_P


@pytest.mark.parametrize("qk,pv,exact", [("fp16", "fp16", False),
                                         ("fp16", "fp16", True),
                                         ("int8", "int8", False),
                                         ("fp8", "fp8", False),
                                         ("fp8", "fp8", True)])
def test_mosaic_log_sum_exp(qk, pv, exact):
  """The kernel's log-sum-exp (``return_lse``, the residual of the
  backward) against that of the scores it computes (16-bit, or the
  dequantized 8-bit operands), in natural log, for every operand type and
  both exponents: causal, a batch row with 70 keys and one with none, a
  query length that is not a multiple of the tile.  8-bit P sums rounded
  probabilities: e4m3 P is off by ~1%, and round(127 p) drops every p below
  1/254, so int8 P's l of a spread-out row runs several % low (0.065 in the
  log measured here; a wrong unit, log 127 or log 448, would be 4.8 or
  6.1).  fp8 takes one K scale per key block (``k_block_scale``), int8
  one per key."""
  from jaxattn import grad
  from pallas_kernels import mosaic
  b, t, s, n, d = 3, 150, 200, 2, 64
  ks = jax.random.split(jax.random.key(4), 3)
  q = jax.random.normal(ks[0], (b, t, n, d), jnp.float32)
  k = 2.0 * jax.random.normal(ks[1], (b, s, 1, d), jnp.float32)
  lens = jnp.asarray([200, 70, 0], jnp.int32)
  scale = d ** -0.5
  kw = dict(is_causal=True, exact_exponent=exact, return_lse=True)
  if qk == "fp16":
    q, k = q.astype(jnp.float16), k.astype(jnp.float16)
    v = jnp.zeros((b, s, 1, d), jnp.float16)
    _, lse = jax.jit(functools.partial(
        mosaic.mosaic_attention, qk=qk, pv=pv, scale=scale, **kw))(
            q, k, v, lens)
    tol = 1e-5
  else:   # one scale per token, scale * log2 e folded into Q's
    dt, top = ((jnp.int8, 127.0) if qk == "int8"
               else (jnp.float8_e4m3fn, 448.0))
    q_scale = jnp.max(jnp.abs(q), axis=-1) / top
    k_scale = jnp.max(jnp.abs(k), axis=-1) / top
    if qk == "fp8":   # one per block of 128 keys
      blocks = jnp.pad(k_scale, [(0, 0), (0, 56), (0, 0)]).reshape(
          b, 2, 128, 1).max(axis=2)                            # [B, 2, K]
      k_scale = jnp.repeat(blocks, 128, axis=1)[:, :s]
    cast = lambda x, sc: (jnp.round(x / sc[..., None]) if qk == "int8"
                          else x / sc[..., None]).astype(dt)
    q8, k8 = cast(q, q_scale), cast(k, k_scale)
    q = q8.astype(jnp.float32) * q_scale[..., None]
    k = k8.astype(jnp.float32) * k_scale[..., None]
    v = jnp.zeros((b, 1, d, s), jnp.int8 if pv == "int8" else dt)
    k_scales = (dict(k_block_scale=blocks.transpose(0, 2, 1))
                if qk == "fp8" else dict(k_scale=k_scale))
    _, lse = jax.jit(lambda q8, k8, v, lens, q_scale, k_scales:
                     mosaic.mosaic_attention(
                         q8, k8, v, lens, qk=qk, pv=pv, q_scale=q_scale,
                         **kw, **k_scales))(
        q8, k8, v, lens, q_scale * (scale * np.log2(np.e)), k_scales)
    tol = 2e-2 if pv == "fp8" else 0.1
  want = jax.jit(functools.partial(grad.logsumexp, scale=scale,
                                   is_causal=True))(
      q, k, None, None, lens).transpose(0, 2, 1)
  assert lse.shape == (b, n, t) and lse.dtype == jnp.float32
  assert np.all(np.isneginf(np.asarray(lse[2])))     # no key: -inf
  err = float(jnp.max(jnp.abs(lse[:2] - want[:2])))
  assert err < tol, err


def _sees(kv_lens, q_lens, offsets, window, is_causal, q_seg, kv_seg, t, s):
  """Bool ``[B, T, S]``: query ``i`` sees key ``j`` (the rule of
  :class:`pallas_kernels.common.IndexMask`, written out in numpy)."""
  col = lambda x: np.asarray(x)[:, None, None]
  i, j = np.arange(t)[None, :, None], np.arange(s)[None, None, :]
  vis = (i < col(q_lens)) & (j < col(kv_lens))
  left, right = window or (None, None)
  if left is not None:
    vis &= j >= i + col(offsets) - left
  if right is not None:
    vis &= j <= i + col(offsets) + right
  if is_causal:
    vis &= j <= i + col(offsets)
  if q_seg is not None:
    vis &= np.asarray(q_seg)[:, :, None] == np.asarray(kv_seg)[:, None, :]
  return vis


def _segment_ids(bounds, n):
  """int32 ``[n]``: sorted ids, id ``ids[k]`` from ``bounds[k]`` on."""
  out = np.zeros(n, np.int32)
  for start, sid in bounds:
    out[start:] = sid
  return out


INDEX_CASES = {
    # bottom-right causal local attention, a batch row of 50 queries that
    # sees only the last keys (its second warpgroup and tile see none)
    "window": dict(is_causal=True, window=(37, 0), q_lens=[150, 50],
                   kv_lens=[280, 300], bottom_right=True),
    # packed sequences: query ids 1 (rows 0-63, a whole warpgroup) and 3
    # have no key, key ids 0 and 3 no query; batch row 1 one sequence
    # (whole blocks without a mask)
    "segments": dict(
        is_causal=False, window=None, q_lens=[190, 200], kv_lens=[300, 250],
        bottom_right=False,
        q_seg=[[(0, 1), (64, 2), (131, 3), (160, 4)], [(0, 0)]],
        kv_seg=[[(0, 0), (41, 2), (151, 3), (161, 5), (231, 4)], [(0, 0)]]),
    # segment ids that are not sorted runs: in batch row 0 ids 1 and 2 come
    # back after another document, in row 1 the last id is 0
    "scattered_segments": dict(
        is_causal=True, window=None, q_lens=[190, 200], kv_lens=[300, 280],
        bottom_right=False,
        q_seg=[[(0, 1), (70, 2), (150, 1)], [(0, 1), (90, 2), (170, 0)]],
        kv_seg=[[(0, 1), (40, 2), (100, 1), (170, 2), (230, 3)],
                [(0, 1), (90, 2), (170, 0)]]),
    # a window of one key behind the diagonal: most key blocks skipped,
    # warpgroups of a tile start at different blocks (leading drains)
    "window_1": dict(is_causal=True, window=(1, 0), q_lens=[200, 60],
                     kv_lens=[300, 300], bottom_right=False),
}


def _index_case(name, b, t, s):
  from pallas_kernels import common
  c = INDEX_CASES[name]
  kv_lens = np.asarray(c["kv_lens"], np.int32)
  q_lens = np.asarray(c["q_lens"], np.int32)
  offsets = kv_lens - q_lens if c["bottom_right"] else np.zeros(b, np.int32)
  q_seg = kv_seg = None
  if "q_seg" in c:
    q_seg = np.stack([_segment_ids(x, t) for x in c["q_seg"]])
    kv_seg = np.stack([_segment_ids(x, s) for x in c["kv_seg"]])
  im = common.IndexMask(
      q_lens=jnp.asarray(q_lens), offsets=jnp.asarray(offsets),
      q_segments=None if q_seg is None else jnp.asarray(q_seg),
      kv_segments=None if kv_seg is None else jnp.asarray(kv_seg),
      window=c["window"])
  sees = _sees(kv_lens, q_lens, offsets, c["window"], c["is_causal"], q_seg,
               kv_seg, t, s)
  return im, sees, jnp.asarray(kv_lens), c["is_causal"]


def _mosaic_with_index_mask(method, q, k, v, kv_lens, im, *, scale,
                            is_causal, config):
  """The Mosaic adapter's kernel path for ``method`` with ``index_mask=im``
  (the quantized methods without the NaN confinement of ``run``)."""
  from jaxattn.backends import mosaic as mosaic_backend
  adapter = mosaic_backend.ADAPTERS[method]
  kw = dict(is_causal=is_causal, config=config, index_mask=im)
  if adapter.kernel is None:
    return adapter.run(q, k, v, None, None, kv_lens, scale=scale, **kw)
  ops = adapter.prepare(q, k, v, kv_lens, scale=scale, config=config)
  return adapter.kernel(ops, kv_lens, None, None, out_dtype=q.dtype, **kw)


@pytest.mark.parametrize("method,case", [
    ("fp32", "window"), ("fp32", "segments"), ("pasa", "window"),
    ("pasa", "segments"), ("sage", "segments"), ("int8", "window"),
    ("fp8", "segments"), ("fp32", "scattered_segments")], ids=str)
def test_mosaic_index_mask_matches_dense_mask_reference(method, case):
  """Query lengths, a bottom-right offset, a local window and packed
  segment ids, from indices in the kernel, against the reference with the
  same visibility as a dense mask; rows that see no key (beyond the query
  length, in a segment without keys) are exactly zero."""
  from jaxattn import methods
  from jaxattn.backends import reference
  b, t, s, n, d = 2, 200, 300, 1, 64
  kq, kk, kv = jax.random.split(jax.random.key(7), 3)
  q = jax.random.normal(kq, (b, t, n, d), jnp.float16)
  k = jax.random.normal(kk, (b, s, 1, d), jnp.float16) + 0.5
  v = jax.random.normal(kv, (b, s, 1, d), jnp.float16)
  im, sees, kv_lens, causal = _index_case(case, b, t, s)
  config = methods.get(method).config_cls.from_options(block_k=64)
  scale = d ** -0.5
  out = jax.jit(functools.partial(
      _mosaic_with_index_mask, method, scale=scale, is_causal=causal,
      config=config))(q, k, v, kv_lens, im)
  mask = jnp.asarray(np.broadcast_to(sees[:, None], (b, n, t, s)))
  ref = jax.jit(functools.partial(
      reference.ADAPTERS[method].run, scale=scale, is_causal=False,
      config=config))(q, k, v, None, mask, kv_lens).astype(q.dtype)
  out = np.asarray(out, np.float32)
  assert out.shape == (b, t, n, d) and np.isfinite(out).all()
  blind = ~sees.any(-1)                                  # [B, T]
  assert blind.any() and (~blind).any()
  assert np.all(out[blind] == 0.0)
  tol = {"fp32": TOL, "pasa": 5e-3}.get(method, TOL_8BIT_P)
  err = _rel(out[~blind], np.asarray(ref)[~blind])
  assert err < tol, err


@pytest.mark.parametrize("method", ["fp32", "int8"])
def test_mosaic_skips_key_blocks_outside_a_narrow_window(method):
  """A window of one key: each warpgroup runs only the key blocks its rows
  see (the CTA streams their union, starting past block 0, and a
  warpgroup drains its sibling's blocks before and after its own); the
  output is still the dense-mask reference's."""
  from jaxattn import methods
  from jaxattn.backends import reference
  from pallas_kernels import common
  b, t, s, n, d = 2, 200, 300, 1, 64
  kq, kk, kv = jax.random.split(jax.random.key(8), 3)
  q = jax.random.normal(kq, (b, t, n, d), jnp.float16)
  k = jax.random.normal(kk, (b, s, 1, d), jnp.float16)
  v = jax.random.normal(kv, (b, s, 1, d), jnp.float16)
  im, sees, kv_lens, causal = _index_case("window_1", b, t, s)
  ranges = np.asarray(jax.jit(lambda kv_lens, im: common.block_ranges(
      common.row_bounds(kv_lens, im, t=t, is_causal=causal), n_row_blocks=4,
      block_r=64, block_c=64, has_mask=False))(kv_lens, im))
  lo, hi = ranges[..., 0], ranges[..., 3]
  assert np.all(hi - lo <= 2) and lo[0, 3] == 2
  assert np.any(lo[:, 0::2] < lo[:, 1::2])      # a tile's leading drain
  assert np.all(ranges[1, 2:] == 0)             # a tile without a key
  config = methods.get(method).config_cls.from_options(block_k=64)
  scale = d ** -0.5
  out = jax.jit(functools.partial(
      _mosaic_with_index_mask, method, scale=scale, is_causal=causal,
      config=config))(q, k, v, kv_lens, im)
  mask = jnp.asarray(sees[:, None])
  ref = jax.jit(functools.partial(
      reference.ADAPTERS[method].run, scale=scale, is_causal=False,
      config=config))(q, k, v, None, mask, kv_lens).astype(q.dtype)
  out = np.asarray(out, np.float32)
  blind = ~sees.any(-1)
  assert np.all(out[blind] == 0.0)
  tol = TOL if method == "fp32" else TOL_8BIT_P
  err = _rel(out[~blind], np.asarray(ref)[~blind])
  assert err < tol, err


def test_tile_table_lists_every_cta_once_longest_first():
  """The kernel's CTAs (one per 128-row query tile and batch row) carry
  their batch row, tile and warpgroups' key-block ranges; longest first,
  each CTA appears once, the key blocks never grow down the list, and ties
  keep the natural order (so uniform tiles keep it)."""
  from pallas_kernels import common, mosaic
  kv_lens = jnp.asarray([512, 300], jnp.int32)
  bounds = common.row_bounds(kv_lens, common.IndexMask(), t=512,
                             is_causal=True)
  ranges = common.block_ranges(bounds, n_row_blocks=8, block_r=64,
                               block_c=128, has_mask=False)
  r_np = np.asarray(ranges)
  # the rows in the natural (batch, tile) order
  natural = np.asarray([[batch, tile, *r_np[batch, 2 * tile:2 * tile + 2]
                         .ravel()] for batch, tile in np.ndindex(2, 4)])
  first = np.asarray(mosaic.tile_table(ranges))
  assert first.shape == (8, 10) and first.dtype == np.int32
  blocks = lambda t: (t[:, 5] - t[:, 2]) + (t[:, 9] - t[:, 6])
  assert sorted(map(tuple, first)) == sorted(map(tuple, natural))
  assert np.all(np.diff(blocks(first)) <= 0)
  assert blocks(first)[0] == 8 and tuple(first[0, :2]) == (0, 3)
  # the whole order: by blocks, most first, ties in the natural order
  # (blocks 6: (0, 2), (1, 2), (1, 3); blocks 2: (0, 0), (1, 0))
  np.testing.assert_array_equal(
      first, natural[np.lexsort((np.arange(8), -blocks(natural)))])
  assert [tuple(r[:2]) for r in first if blocks(r[None])[0] == 6] == [
      (0, 2), (1, 2), (1, 3)]
  full = common.row_bounds(jnp.asarray([512, 512], jnp.int32),
                           common.IndexMask(), t=512, is_causal=False)
  uniform = common.block_ranges(full, n_row_blocks=8, block_r=64,
                                block_c=128, has_mask=False)
  u_np = np.asarray(uniform)
  np.testing.assert_array_equal(
      mosaic.tile_table(uniform),
      [[batch, tile, *u_np[batch, 2 * tile:2 * tile + 2].ravel()]
       for batch, tile in np.ndindex(2, 4)])



@pytest.mark.parametrize("causal,window", [(False, None), (True, (64, 0))])
def test_tile_table_is_a_constant_without_index_arrays(causal, window):
  """Without key lengths or index arrays (only static causality and
  window) the tile table is computed at trace time: the lowered call
  sorts nothing.  With key lengths as data it is computed per call."""
  q = jnp.zeros((1, 256, 2, 64), jnp.float16)

  def lowered(*lens):
    call = lambda q, *lens: jaxattn.dot_product_attention(
        q, q, q, is_causal=causal, local_window_size=window, method="fp32",
        implementation="mosaic",
        key_value_seq_lengths=lens[0] if lens else None)
    return jax.jit(call).lower(q, *lens).as_text()

  compiles = []

  def listener(event, *_, **__):
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    assert "sort" not in lowered()
  finally:   # (only this one: other modules keep listeners of their own)
    jax.monitoring.unregister_event_duration_listener(listener)
  # (one compiled table at trace time: op by op, each of its ~50 small ops
  # compiled, 2.2 s of a first call on a GPU)
  assert len(compiles) <= 1, compiles
  assert "sort" in lowered(jnp.array([200], jnp.int32))

@pytest.mark.slow
def test_mosaic_output_lse_is_the_kernels_own():
  """``output_lse`` (what the ring's merge takes) is the quantized kernel's
  log-sum-exp, with the score shift of SageAttention's key smoothing added
  back: it equals the float scores' log-sum-exp up to the 8-bit P's sum
  (e4m3 P, ~1%) and the int8 scores' error, while the key mean it restores
  is worth several units here (keys with a per-channel bias, a different
  one per key head, so that a query head paired with the wrong key head's
  mean shows).  A batch row with no key and a NaN query row keeps
  jax.nn's value, not NaN.  The output is the call's own."""
  from jaxattn import grad, operands
  method = "sage"
  b, t, s, n, nk, d = 3, 96, 160, 4, 2, 64
  ks = jax.random.split(jax.random.key(7), 4)
  q = jax.random.normal(ks[0], (b, t, n, d), jnp.float16)
  q = q.at[2, 5, 1, 3].set(jnp.nan)   # in the row with no key
  channel_bias = 3.0 * jax.random.normal(ks[3], (nk, d))
  k = (jax.random.normal(ks[1], (b, s, nk, d)) + channel_bias).astype(
      jnp.float16)
  v = jax.random.normal(ks[2], (b, s, nk, d), jnp.float16)
  lens = jnp.asarray([160, 90, 0], jnp.int32)
  scale = d ** -0.5
  config = api.config_for(method, "mosaic")
  static = dict(method=method, implementation="mosaic", scale=scale,
                is_causal=True, config=config, with_lse=True)
  out, lse = jax.jit(functools.partial(api._forward, output_lse=True,
                                       **static))(q, k, v, None, None, lens)
  plain, float_lse = jax.jit(functools.partial(api._forward, **static))(
      q, k, v, None, None, lens)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(plain))
  np.testing.assert_array_equal(np.asarray(lse[2]), grad.MASK_VALUE)
  diff = np.abs(np.asarray(lse[:2]) - np.asarray(float_lse[:2]))
  print("max |lse - float lse|", diff.max())
  assert diff.max() < 0.05, diff.max()  # 0.021 measured
  ops = jax.jit(functools.partial(
      operands.quantized_operands, method, scale=scale, config=config,
      pack_int4=False))(q, k, v, lens)
  shift = scale * jnp.einsum("btkgd,bkd->btkg",
                             q.astype(jnp.float32).reshape(b, t, nk, 2, d),
                             ops.k_shift).reshape(b, t, n)
  assert float(jnp.abs(shift[:2]).max()) > 3.0   # the correction matters


def test_mosaic_sage_chunks_merge_through_the_output_lse():
  """Two key chunks with different per-channel key means (so different
  smoothing shifts), each a sage call with its ``output_lse``, merged as
  the ring merges its steps: as accurate against float32 attention as one
  call over all the keys."""
  b, t, s, n, d = 1, 64, 128, 2, 64
  ks = jax.random.split(jax.random.key(3), 5)
  q = jax.random.normal(ks[0], (b, t, n, d), jnp.float16)
  k = jax.random.normal(ks[1], (b, s, n, d), jnp.float32)
  k = k.at[:, :64].add(2.0 * jax.random.normal(ks[3], (d,)))
  k = k.at[:, 64:].add(2.0 * jax.random.normal(ks[4], (d,))).astype(
      jnp.float16)
  v = jax.random.normal(ks[2], (b, s, n, d), jnp.float16)
  scale = d ** -0.5
  static = dict(method="sage", implementation="mosaic", scale=scale,
                is_causal=False, config=api.config_for("sage", "mosaic"),
                with_lse=True, output_lse=True)
  forward = jax.jit(functools.partial(api._forward, **static))
  parts = [forward(q, k[:, c], v[:, c], None, None,
                   jnp.full((b,), 64, jnp.int32))
           for c in (slice(0, 64), slice(64, 128))]
  (o_a, l_a), (o_b, l_b) = parts
  lse = jnp.logaddexp(l_a, l_b)[..., None]
  merged = (jnp.exp(l_a[..., None] - lse) * o_a.astype(jnp.float32)
            + jnp.exp(l_b[..., None] - lse) * o_b.astype(jnp.float32))
  single = jaxattn.dot_product_attention(q, k, v, method="sage",
                                         implementation="mosaic")
  exact = jaxattn.dot_product_attention(
      *(x.astype(jnp.float32) for x in (q, k, v)))
  assert _rel(merged, exact) <= 1.2 * _rel(single, exact) + 2e-4, (
      _rel(merged, exact), _rel(single, exact))


def test_mosaic_fp16_fp32_block_of_minus_inf_scores():
  """fp16_fp32 rounds scores below -65504 to -inf: a first key block whose
  scores all do so (unmasked, the row's max still -inf after it) adds
  nothing, as in the reference, rather than -inf - -inf = NaN."""
  q = jnp.full((1, 128, 1, 64), 40.0, jnp.float16)
  k_far = jnp.full((1, 128, 1, 64), -40.0, jnp.float16)   # 40^2 64 > 65504
  k_near = jax.random.normal(jax.random.key(0), (1, 128, 1, 64),
                             jnp.float16) * 0.01
  k = jnp.concatenate([k_far, k_near], axis=1)
  v = jax.random.normal(jax.random.key(1), (1, 256, 1, 64), jnp.float16)
  kw = dict(method="fp16_fp32")
  out = jaxattn.dot_product_attention(q, k, v, implementation="mosaic", **kw)
  ref = jaxattn.dot_product_attention(q, k, v, implementation="reference",
                                      **kw)
  assert bool(jnp.isfinite(ref).all())
  assert bool(jnp.isfinite(out).all())
  assert _rel(out, ref) < TOL, _rel(out, ref)


@pytest.mark.parametrize("method,opts", [
    ("fp8", {"granularity": "block", "block_k": 128}),
    ("sage", {})], ids=str)
def test_mosaic_block_k_scales_equal_per_key_scales(method, opts):
  """One K scale per key block (``k_block_scale``: the row factor ``q_scale
  k_j`` in the exponent, or times the scores before SageAttention2's bias)
  gives the per-key kernel's output up to flips of the 8-bit P (the
  exponent's product rounds once instead of twice), and the same bits
  with the exact exponent where no bias regroups the products; with GQA,
  a key length inside the last block, and that block's visible keys all
  zero (k_j = 0) under a causal mask, which stays finite."""
  from jaxattn.backends import mosaic as mosaic_backend
  from pallas_kernels import mosaic
  kq, kk, kv = jax.random.split(jax.random.key(7), 3)
  b, t, s, n, kh, d = 1, 128, 200, 4, 2, 64
  q = jax.random.normal(kq, (b, t, n, d), jnp.float16)
  k = (jax.random.normal(kk, (b, s, kh, d), jnp.float16) + 0.5).at[
      :, 128:130].set(0)
  v = jax.random.normal(kv, (b, s, kh, d), jnp.float16)
  lens = jnp.full((b,), 130, jnp.int32)
  cfg = api.config_for(method, "mosaic", **opts)
  ops = jax.jit(functools.partial(mosaic_backend._prepare, method,
                                  scale=d ** -0.5, config=cfg))(q, k, v, lens)
  per_block = mosaic_backend._k_scales(ops, cfg.block_k)
  assert set(per_block) == {"k_block_scale"}
  if method == "fp8":   # (sage's keys are shifted by their mean first)
    assert float(per_block["k_block_scale"][0, 0, 1]) == 0.0
  run = lambda exact, **scales: jax.jit(
      lambda ops, lens, scales: mosaic.mosaic_attention(
          ops.q, ops.k, ops.v, lens, qk=ops.qk, pv=ops.pv, is_causal=True,
          params=mosaic.MosaicParams(block_k=cfg.block_k),
          q_scale=ops.q_scale, q_block_bias=ops.q_block_bias,
          bias_rows=ops.bias_rows, v_block_scale=ops.v_block_scale,
          out_scale=ops.out_scale, out_shift=ops.out_shift,
          v_keys_ordered=ops.v_keys_ordered, exact_exponent=exact,
          **scales))(ops, lens, scales)
  fused = np.asarray(run(False, **per_block), np.float32)
  assert np.isfinite(fused).all()
  assert _rel(fused, run(False, k_scale=ops.k_scale)) < TOL_8BIT_P
  exact = run(True, **per_block)
  if ops.q_block_bias is None:
    np.testing.assert_array_equal(exact, run(True, k_scale=ops.k_scale))
  else:        # (S q_scale k_j + bias: the products regroup)
    assert _rel(exact, run(True, k_scale=ops.k_scale)) < TOL_8BIT_P
  with pytest.raises(ValueError, match="one of them"):
    run(False, k_scale=ops.k_scale, **per_block)


@pytest.mark.parametrize("method,opts", [
    ("fp8", {"granularity": "block", "block_k": 64}),
    ("int8", {"v_granularity": "block", "block_k": 64})], ids=str)
def test_mosaic_v_block_scales_spanning_float32(method, opts):
  """One V scale per key block, where the blocks' scales span 2^80
  (bfloat16 inputs): a block 2^40 above the rest, a block of zeros (scale
  0), and the block 2^-40 below that every row attends to (the others
  score ~400 below it); the kernel equals its reference."""
  b, t, s, n, d = 1, 128, 256, 2, 64
  kq, kk, kv = jax.random.split(jax.random.key(3), 3)
  q = 3.0 * (jnp.abs(jax.random.normal(kq, (b, t, n, d), jnp.float32)) + 1)
  sign = jnp.repeat(jnp.asarray([-1.0, 1.0, 1.0, -1.0]), 64)[None, :, None,
                                                              None]
  k = sign * (jnp.abs(jax.random.normal(kk, (b, s, n, d))) + 1.0)
  v_scale = jnp.repeat(jnp.asarray([2.0 ** 40, 0.0, 2.0 ** -40, 1.0]), 64)
  v = jax.random.normal(kv, (b, s, n, d)) * v_scale[None, :, None, None]
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))
  out = np.asarray(jaxattn.dot_product_attention(
      q, k, v, method=method, implementation="mosaic", **opts), np.float64)
  ref = np.asarray(jaxattn.dot_product_attention(
      q, k, v, method=method, implementation="reference",
      **api.backend_options(method, "mosaic", **opts)), np.float64)
  assert np.isfinite(out).all()
  assert 0 < np.abs(ref).max() < 2.0 ** -36    # block 2's V, as intended
  assert _rel(out, ref) < 1e-2, _rel(out, ref)


@pytest.mark.parametrize("method", ["fp8", "sage"])
def test_mosaic_exponent_flag_runs_each_static_form(method):
  """``exact_exponent`` as a bool array: the kernel holds both exponents
  and branches on the flag (the adapters' choice by the score bound, with
  no ``lax.cond``); each value gives its static form's output and
  log-sum-exp bit for bit, causal, with the key length inside the last
  block.  fp8 takes a row factor per key block, sage the smoothing bias."""
  from jaxattn.backends import mosaic as mosaic_backend
  from pallas_kernels import mosaic
  kq, kk, kv = jax.random.split(jax.random.key(8), 3)
  b, t, s, n, kh, d = 1, 128, 200, 2, 1, 64
  q = jax.random.normal(kq, (b, t, n, d), jnp.float16)
  k = jax.random.normal(kk, (b, s, kh, d), jnp.float16) + 0.5
  v = jax.random.normal(kv, (b, s, kh, d), jnp.float16)
  lens = jnp.full((b,), 170, jnp.int32)
  cfg = api.config_for(method, "mosaic", block_k=128)
  ops = jax.jit(functools.partial(mosaic_backend._prepare, method,
                                  scale=d ** -0.5, config=cfg))(q, k, v, lens)
  kernel = lambda ops, lens, exact: mosaic.mosaic_attention(
      ops.q, ops.k, ops.v, lens, qk=ops.qk, pv=ops.pv, is_causal=True,
      params=mosaic.MosaicParams(block_k=cfg.block_k), q_scale=ops.q_scale,
      **mosaic_backend._k_scales(ops, cfg.block_k),
      q_block_bias=ops.q_block_bias, bias_rows=ops.bias_rows,
      v_block_scale=ops.v_block_scale, out_scale=ops.out_scale,
      out_shift=ops.out_shift, v_keys_ordered=ops.v_keys_ordered,
      exact_exponent=exact, return_lse=True)
  static, by_flag = jax.jit(kernel, static_argnums=2), jax.jit(kernel)
  for exact in (False, True):
    got, want = by_flag(ops, lens, jnp.asarray(exact)), static(ops, lens,
                                                               exact)
    for g, w in zip(got, want):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
  with pytest.raises(ValueError, match="bool scalar"):
    by_flag(ops, lens, jnp.asarray([True]))


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.float16])
def test_mosaic_row_amax_is_the_written_rows_max(out_dtype):
  """``return_row_amax`` (the 8-bit FMHA's output scale without a pass over
  O): each row's ``max |O|`` of the values written, alongside the
  log-sum-exp, which it leaves as it is; causal, a query length that is
  not a multiple of the tile, a batch row whose keys are all past its
  length (rows of zeros)."""
  from pallas_kernels import mosaic
  b, t, s, n, d = 2, 150, 200, 2, 64
  ks = jax.random.split(jax.random.key(9), 3)
  q, k, v = (jax.random.normal(x, (b, sz, n, d), jnp.float16)
             for x, sz in zip(ks, (t, s, s)))
  lens = jnp.asarray([200, 0], jnp.int32)
  run = jax.jit(functools.partial(
      mosaic.mosaic_attention, qk="fp16", pv="fp16", is_causal=True,
      scale=d ** -0.5, out_dtype=out_dtype, exact_exponent=True,
      return_lse=True), static_argnames="return_row_amax")
  out, lse, amax = run(q, k, v, lens, return_row_amax=True)
  out_only, lse_only = run(q, k, v, lens, return_row_amax=False)
  assert amax.shape == (b, n, t) and amax.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(out), np.asarray(out_only))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_only))
  want = np.abs(np.asarray(out, np.float32)).max(-1).transpose(0, 2, 1)
  np.testing.assert_array_equal(np.asarray(amax), want)
  assert want[0].min() > 0 and not want[1].any()


@pytest.mark.parametrize("method", ["fp32", "sage", "fmha_int8", "fp8"])
def test_mosaic_one_warpgroup_equals_two(method, monkeypatch):
  """The CTA as one warpgroup that issues its own loads
  (``MosaicParams.warpgroups=1``) gives the producer-and-two-consumers
  kernel's bits: output and log-sum-exp, causal and bottom-right aligned,
  with query and key lengths, a window and packed segments (CTAs that skip
  key blocks, blocks masked in part), a NaN in one key and GQA.  64-key
  blocks, so that a CTA walks more blocks than the ring has slots and the
  warpgroup refills them itself (sage: the smoothing bias by TMA with K;
  the FMHA: uint8 P and V's column sums)."""
  from pallas_kernels import mosaic
  b, t, s, n, kh, d = 2, 100, 150, 2, 1, 64
  kq, kk, kv = jax.random.split(jax.random.key(11), 3)
  q = jax.random.normal(kq, (b, t, n, d), jnp.float16)
  k = (jax.random.normal(kk, (b, s, kh, d), jnp.float16) + 0.5).at[
      1, 7, 0, 3].set(jnp.inf)
  v = jax.random.normal(kv, (b, s, kh, d), jnp.float16)
  q_seg = jnp.asarray(np.repeat([[0, 1, 2], [0, 0, 1]], [30, 40, 30],
                                axis=1), jnp.int32)
  kv_seg = jnp.asarray(np.repeat([[0, 1, 2], [0, 0, 1]], [70, 40, 40],
                                 axis=1), jnp.int32)
  calls = [dict(is_causal=True, causal_alignment="bottom_right",
                query_seq_lengths=jnp.asarray([100, 80], jnp.int32),
                key_value_seq_lengths=jnp.asarray([150, 110], jnp.int32)),
           dict(is_causal=False, local_window_size=(70, 20),
                q_segment_ids=q_seg, kv_segment_ids=kv_seg)]
  every = {(a, c) for a in mosaic.QK_TYPES for c in mosaic.PV_TYPES}
  outs = {}
  for setting, (dims, operands) in {"one": ((d,), every),
                                    "two": ((), frozenset())}.items():
    monkeypatch.setattr(mosaic, "ONE_WARPGROUP_HEAD_DIMS", dims)
    monkeypatch.setattr(mosaic, "ONE_WARPGROUP_OPERANDS", operands)
    jax.clear_caches()
    assert mosaic.default_warpgroups("fp16", "fp16", d) == (
        1 if setting == "one" else 2)
    outs[setting] = [jaxattn.dot_product_attention(
        q, k, v, method=method, implementation="mosaic", block_k=64,
        return_residual=method != "fmha_int8", **kw) for kw in calls]
  jax.clear_caches()
  for one, two in zip(outs["one"], outs["two"]):
    out = np.asarray(jax.tree.leaves(one)[0], np.float32)
    assert np.isnan(out).any() and np.isfinite(out).any()   # (the Inf key)
    for x, y in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_mosaic_warpgroups_by_operands_head_dim_and_segments():
  """One warpgroup at D=64 for the 8-bit operand pairs, and for float16
  operands only on packed calls (segment ids) outside PASA; two
  elsewhere (docs/design.md, "One warpgroup per CTA" and "One warpgroup at
  D=128, and on packed calls")."""
  from pallas_kernels import mosaic
  wgs = mosaic.default_warpgroups
  for qk, pv in [("fp8", "fp8"), ("int8", "fp8"), ("int8", "fp16"),
                 ("int8", "int8"), ("int8", "uint8")]:
    assert wgs(qk, pv, 64) == 1 and wgs(qk, pv, 128) == 2
  assert wgs("fp16", "fp16", 64) == 2
  assert wgs("fp16", "fp16", 64, segments=True) == 1
  assert wgs("fp16", "fp16", 64, segments=True, pasa=True) == 2
  assert wgs("fp16", "fp16", 128, segments=True) == 2


@pytest.mark.parametrize("method", ["sage", "fp8", "fp32"])
def test_mosaic_call_without_key_lengths_compiles_no_masked_step(
    method, monkeypatch):
  """A call without key lengths reaches the kernel as ``kv_lens=None``:
  non-causal with whole key blocks, it compiles no masked step (sage and
  fp8 at D=64 run one warpgroup either way), with the bits, NaN
  rows and log-sum-exp of the call given full lengths; causal, or with
  keys beyond the last whole block, it keeps the masked step."""
  from pallas_kernels import mosaic
  kernels = []
  kernel = mosaic._kernel

  def spy(*args, **kwargs):
    kernels.append((kwargs["masked_steps"], kwargs["warpgroups"]))
    return kernel(*args, **kwargs)
  monkeypatch.setattr(mosaic, "_kernel", spy)
  jax.clear_caches()   # (each call traced here, where the spy sees it)
  b, t, s, n, d = 1, 150, 256, 2, 64
  kq, kk, kv = jax.random.split(jax.random.key(12), 3)
  q = jax.random.normal(kq, (b, t, n, d), jnp.float16)
  k = (jax.random.normal(kk, (b, s, n, d), jnp.float16) + 0.5).at[
      0, 9, 1, 3].set(jnp.nan)
  v = jax.random.normal(kv, (b, s, n, d), jnp.float16)
  full = jnp.full((b,), s, jnp.int32)

  def call(kv_lens):
    kernels.clear()
    out = jaxattn.dot_product_attention(
        q, k, v, method=method, implementation="mosaic", block_k=128,
        key_value_seq_lengths=kv_lens, return_residual=True)
    return jax.tree.map(np.asarray, out), kernels[:]
  wgs = 1 if method in ("sage", "fp8") else 2
  without, built = call(None)
  assert built == [(False, wgs)]
  given, built = call(full)
  assert built == [(True, wgs)]
  out = without[0].astype(np.float32)
  assert np.isnan(out[:, :, 1]).all() and np.isfinite(out[:, :, 0]).all()
  for x, y in zip(without, given):
    np.testing.assert_array_equal(x, y)
  # (these two are only traced: the choice is static)
  masked = lambda keys=s, **kw: [
      (x["masked_steps"], x["warpgroups"]) for x in _kernels_built(
          monkeypatch, q, k[:, :keys], v[:, :keys], method=method,
          block_k=128, **kw)]
  assert masked(is_causal=True) == [(True, wgs)]
  assert [m for m, _ in masked(keys=200)] == [True]

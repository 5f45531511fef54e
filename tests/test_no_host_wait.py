"""No call waits for the host (issue 58).

On the GPU a ``lax.cond`` (or ``lax.switch``, or a ``while_loop`` whose
predicate comes from the data) outside a kernel makes the host read its
predicate back while the GPU idles.  The default paths decide on the
device instead:

* PASA's keys' factor ``p`` (:func:`jaxattn.pasa.with_key_factor`) is a
  float32 scalar that the key kernel multiplies the keys by, and the
  attention kernels take the exponent's factor ``scale / p`` at run time:
  one kernel of each per call, bit for bit the explicit choice's output;
* PASA's V is zeroed where not finite whatever it holds, and the rows a
  NaN/Inf reaches under segment ids or a dense mask are computed without
  a branch (:mod:`jaxattn.nonfinite`).

The lowering checks look at the module as it is built for a CUDA GPU
(lowered on this machine with the kernels as their custom calls, not
interpreted), and at the jaxpr outside the kernels.
"""
import contextlib
import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest
from jax.extend import core as jcore

import jaxattn
from jaxattn import base, data, nonfinite, pasa
from pallas_kernels import common, key_shift

# Primitives whose insides are a kernel or a library call: a cond inside a
# Pallas kernel is an scf.if on the device, no host wait.
OPAQUE = {"pallas_call", "mpmd_map", "core_map", "call_hi_primitive",
          "triton_kernel_call", "pure_callback"}


def _branches_outside_kernels(closed_jaxpr):
  """The ``cond`` and ``while`` equations of the jaxpr outside kernels,
  but for ``lax.platform_dependent``'s switches (``branches_platforms``):
  lowering keeps the branch of the platform it lowers for
  (quant.reciprocal's)."""
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      name = eqn.primitive.name
      by_platform = eqn.params.get("branches_platforms") is not None
      if name in ("cond", "while") and not by_platform:
        found.append(f"{name}: {str(eqn)[:160]}")
      if name in OPAQUE:
        continue
      for param in eqn.params.values():
        for x in (param if isinstance(param, (tuple, list)) else (param,)):
          if isinstance(x, jcore.ClosedJaxpr):
            walk(x.jaxpr)
          elif isinstance(x, jcore.Jaxpr):
            walk(x)

  walk(closed_jaxpr.jaxpr)
  return found


@contextlib.contextmanager
def _as_on_a_gpu():
  """The kernels lowered for an H200 (Triton and Mosaic GPU custom calls)
  instead of interpreted; jax's trace caches cleared before and after, so
  that no jaxpr traced for the interpreter is reused here, nor one traced
  here by a later test."""
  gpu_info = pytest.importorskip("jax._src.pallas.triton.gpu_info")
  if not hasattr(gpu_info, "GpuVersion"):
    pytest.skip("jax's Triton GPU table moved")
  info = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
  jax.clear_caches()
  try:
    with mock.patch.object(common, "interpret", lambda: False), \
        mock.patch.object(common, "has_gpu", lambda: True), \
        mock.patch.object(gpu_info, "get_gpu_info", lambda: info):
      yield
  finally:
    jax.clear_caches()


def _gpu_module(f, *args) -> str:
  with _as_on_a_gpu():
    try:
      return jax.jit(f).trace(*args).lower(
          lowering_platforms=("cuda",)).as_text()
    except ModuleNotFoundError as e:   # (jax_triton's kernels need it)
      pytest.skip(f"the GPU lowering needs {e.name} here")


_CONST_I32 = re.compile(r"\s*(%[\w#]+) = stablehlo\.constant dense<-?\d+> : "
                        r"tensor<i32>$")
_CASE = re.compile(r"\s*(%[\w#]+)(?::\d+)? = \"stablehlo\.case\"\((%[\w#]+)\)")


def _platform_switches(lines) -> set:
  """The lines of ``lax.platform_dependent``'s switches as jax lowers them
  for one platform: a case on the int32 constant of the line above, whose
  branches return int32 constants (the platform's branch index), then, on
  the line after it closes, the case on its result.  XLA folds both."""
  lines_ok = set()
  for i, line in enumerate(lines[1:], 1):
    case, const = _CASE.match(line), _CONST_I32.match(lines[i - 1])
    if not (case and const and case.group(2) == const.group(1)):
      continue
    j = i + 1
    while j < len(lines) and (_CONST_I32.match(lines[j])
                              or lines[j].strip() == "}, {"
                              or lines[j].strip().startswith(
                                  "stablehlo.return")):
      j += 1
    if j + 1 >= len(lines) or lines[j].strip() != (
        "}) : (tensor<i32>) -> tensor<i32>"):
      continue
    switch = _CASE.match(lines[j + 1])
    if switch and switch.group(2) == case.group(1):
      lines_ok.update((i, j + 1))
  return lines_ok


def _data_dependent_branches(text: str):
  """What of the StableHLO module could make the host wait: ``case`` and
  ``if`` (``lax.cond``, ``lax.switch``) but for ``lax.platform_dependent``'s
  (:func:`_platform_switches`), and ``while`` loops whose condition is more
  than a counter against a constant (``lax.scan`` and a ``fori_loop`` of
  static length lower to those, and XLA runs them without reading the
  predicate back)."""
  found = [m for m in ("stablehlo.if", "mhlo.case", "mhlo.if") if m in text]
  lines = text.splitlines()
  platform = _platform_switches(lines)
  found += [f"stablehlo.case: {line.strip()[:80]}"
            for i, line in enumerate(lines)
            if _CASE.match(line) and i not in platform]
  for cond in re.findall(r"stablehlo\.while\(.*?\n\s*cond \{\n(.*?)\} do \{",
                         text, flags=re.S):
    ops = [line.split("=", 1)[-1].split()[0] for line in cond.splitlines()
           if line.strip()]
    if not set(ops) <= {"stablehlo.constant", "stablehlo.compare",
                        "stablehlo.return"}:
      found.append("while: " + cond.strip()[:300])
  return found


def test_the_checks_find_run_time_branches_and_pass_platform_switches():
  """The two checks above flag a ``lax.switch`` on a computed index and a
  ``while`` on a computed predicate, and pass a ``lax.platform_dependent``
  switch (a case on the platform's constant index after lowering), also
  beside a switch on a computed index."""
  x = jnp.ones(3)
  by_value = lambda x: lax.switch((x.sum() > 0).astype(jnp.int32),
                                  [jnp.sin, jnp.cos], x)
  by_loop = lambda x: lax.while_loop(lambda c: c.sum() < 10.0,
                                     lambda c: c * 2.0, x)
  by_platform = lambda x: lax.platform_dependent(x, cpu=jnp.sin,
                                                 default=jnp.cos)
  # both in loop bodies, where MLIR reuses the SSA names of sibling regions
  both = lambda x: lax.fori_loop(0, 3, lambda i, c: by_value(c), lax.fori_loop(
      0, 3, lambda i, c: by_platform(c), x))
  for f, found in ((by_value, True), (by_loop, True), (by_platform, False),
                   (both, True)):
    text = jax.jit(f).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert bool(_branches_outside_kernels(jax.make_jaxpr(f)(x))) == found
    assert bool(_data_dependent_branches(text)) == found


SHAPE = (1, 192, 2, 64)   # B, T, N, D
CALLS = [("pasa", "reference", False), ("pasa", "triton", False),
         ("pasa", "mosaic", False), ("pasa", "triton", True),
         ("pasa", "mosaic", True), ("int8", "reference", True),
         ("int8", "triton", True), ("int8", "mosaic", True),
         ("sage", "mosaic", True), ("fp8", "mosaic", True)]


def _call(method, implementation, segments):
  def f(q, k, v, *ids):
    kw = dict(q_segment_ids=ids[0], kv_segment_ids=ids[0]) if ids else {}
    return jaxattn.dot_product_attention(
        q, k, v, method=method, implementation=implementation,
        is_causal=True, **kw)
  x = jax.ShapeDtypeStruct(SHAPE, jnp.float16)
  ids = (jax.ShapeDtypeStruct(SHAPE[:2], jnp.int32),) if segments else ()
  return f, (x, x, x, *ids)


@pytest.mark.parametrize("method,implementation,segments", CALLS, ids=str)
def test_default_calls_have_no_branch_outside_the_kernels(
    method, implementation, segments):
  """The module built for the GPU holds no ``case``/``if`` and no
  ``while`` with a data-dependent predicate, and the jaxpr outside the
  kernels no ``cond``/``while``: PASA (one key kernel and one attention
  kernel), and the quantized methods with segment ids (whose NaN rows
  needed a cond)."""
  f, args = _call(method, implementation, segments)
  assert _branches_outside_kernels(jax.make_jaxpr(f)(*args)) == []
  text = _gpu_module(f, *args)
  assert _data_dependent_branches(text) == []
  if method == "pasa" and implementation != "reference":
    kernels = re.findall(r"stablehlo\.custom_call @([\w$.]+)\(", text)
    # the block decision, the key kernel and the attention kernel (two of
    # each before, one per choice of the keys' factor)
    attention = "mosaic_gpu_v2" if implementation == "mosaic" else None
    assert len(kernels) == 3, kernels
    if attention:
      assert kernels.count(attention) == 1, kernels


# ----------------------------------------------------------------------------
# PASA's keys' factor chosen on the device: the explicit choice, bit for bit.


def _factor_inputs(fits: bool):
  """Keys with entries below 2^-10 (float16 subnormals once multiplied by
  p = 2^-4: the two choices differ) and, where ``fits`` is False, Q and K
  so large that the unscaled keys could overflow a float16 score."""
  q, k, v = data.pasa_case(jax.random.key(1), dict(dist="hybrid", x0=0.0,
                                                   am=10.0), (1, 150, 2, 64))
  k = k.at[:, ::3, :, ::5].set(3e-4)
  if not fits:
    q, k = q * 60, k * 60
  beta = pasa.PasaConfig().resolved_beta
  assert bool(pasa.unscaled_keys_fit(base.max_row_norm(q),
                                     base.max_row_norm(k), beta)) == fits
  return q, k, v


FORMS = {"running": {}, "per_block": dict(online_softmax="per_block"),
         "nearest": dict(key_rounding="nearest")}


def _bit_faithful_here(implementation):
  """The references are bit-faithful on the CPU, where the suite runs
  them; XLA:GPU fuses a Python constant into the reference's arithmetic
  differently from a runtime scalar (an H200 run gave last-ulp
  differences between the two choices' forms), so there only the
  kernels are held to the bits."""
  if implementation == "reference" and common.has_gpu():
    pytest.skip("the references are bit-faithful on the CPU")


@pytest.mark.parametrize("implementation,form", [
    ("reference", "running"), ("reference", "per_block"),
    ("reference", "nearest"), ("triton", "running"), ("triton", "per_block"),
    ("triton", "nearest"), ("mosaic", "running"), ("mosaic", "per_block")])
def test_the_factor_chosen_on_the_device_is_the_explicit_choice(
    implementation, form):
  """``scale_in_keys=None`` (the default) gives the output of
  ``scale_in_keys=False`` where the unscaled keys fit and of ``True``
  where they do not, bit for bit, with one compiled call for both (the
  running and the per-block softmax, sum-preserving and nearest keys;
  causal, a key length and sizes that are not whole blocks).  The two
  explicit choices differ on these keys."""
  _bit_faithful_here(implementation)
  run = functools.partial(jaxattn.dot_product_attention, method="pasa",
                          implementation=implementation, is_causal=True,
                          key_value_seq_lengths=[131], **FORMS[form])
  for fits in (True, False):
    q, k, v = _factor_inputs(fits)
    auto = np.asarray(run(q, k, v))
    unscaled = np.asarray(run(q, k, v, scale_in_keys=False))
    scaled = np.asarray(run(q, k, v, scale_in_keys=True))
    assert np.isfinite(auto).all() and np.isfinite(scaled).all()
    np.testing.assert_array_equal(auto, unscaled if fits else scaled)
    assert not np.array_equal(unscaled, scaled, equal_nan=True)


@pytest.mark.parametrize("implementation", ["reference", "triton"])
@pytest.mark.parametrize("form", ["running", "per_block"])
def test_the_runtime_factor_with_a_bias_and_the_log_sum_exp(implementation,
                                                            form):
  """The constants the kernel derives from the exponent's factor at run
  time (a bias's units, the log-sum-exp's factors) are the static
  choice's: output and log-sum-exp bit for bit, with a bias in the
  running form (the per-block form with a bias keeps the scale in the
  keys: no choice to make) and without one in both."""
  _bit_faithful_here(implementation)
  from jaxattn.backends import reference, triton
  backend = {"reference": reference, "triton": triton}[implementation]
  adapter = backend.ADAPTERS["pasa"]
  run_lse = adapter.run_lse or functools.partial(adapter.run, return_lse=True)
  for fits in (True, False):
    q, k, v = _factor_inputs(fits)
    b, t, n, _ = q.shape
    s = k.shape[1]
    biases = [None]
    if form == "running":
      biases.append(jax.random.normal(jax.random.key(5), (b, n, t, s),
                                      jnp.float32) * 3.0)
    for bias in biases:
      def call(sik, bias=bias):
        # (32-row tiles: a [128, S] float32 bias tile exceeds the GPU's
        # shared memory)
        config = pasa.PasaConfig(scale_in_keys=sik, tile_q=32,
                                 **FORMS[form])
        f = jax.jit(lambda q, k, v, bias: run_lse(
            q, k, v, bias, None, jnp.asarray([131], jnp.int32),
            scale=0.125, is_causal=True, config=config))
        out, lse = f(q, k, v, bias)
        return np.asarray(out, np.float32), np.asarray(lse, np.float32)
      auto, explicit = call(None), call(not fits)
      for a, e in zip(auto, explicit):
        np.testing.assert_array_equal(a, e)


@pytest.mark.parametrize("rounding", ["sum_preserving", "nearest"])
def test_key_kernel_takes_its_factor_at_run_time(rounding):
  """The key kernel with its factor as a float32 operand gives the bits
  of the kernel with the factor as a constant (1, a power of two, and
  Algorithm 1's scale for nearest rounding), with the adaptive shift, a
  short key length and a partial block; one compiled kernel for all."""
  b, s, h, d, bk = 2, 300, 3, 64, 128
  r = np.random.default_rng(0)
  biased = (np.arange(s) // bk % 2 == 0)[None, :, None, None]
  k = r.standard_normal((b, s, h, d)) * 3 + biased * np.linspace(-20, 20, d)
  k[:, ::7, :, ::3] = 3e-4 * np.sign(k[:, ::7, :, ::3])
  k = jnp.asarray(k, jnp.float16)
  lens = jnp.asarray([s, s // 2 + 3], jnp.int32)
  beta = pasa.optimal_beta(n=bk, dtype="float16")
  moved = key_shift.large_mean_blocks(k, lens, beta=beta, block_k=bk,
                                      min_ratio=pasa.SHIFT_MIN_RATIO)
  kw = dict(beta=beta, block_k=bk, rounding=rounding, shift=moved)
  at_run_time = jax.jit(lambda k, p: key_shift.shifted_key_blocks(
      k, lens, scale=p, **kw)[0])
  # (nearest rounding multiplies in float16: Algorithm 1's scale as the
  # float16 value it is rounded to)
  factors = [1.0, 2.0 ** -4] + ([float(np.float16(0.125 * 0.7))]
                                if rounding == "nearest" else [])
  for p in factors:
    want = np.asarray(key_shift.shifted_key_blocks(k, lens, scale=p, **kw)[0])
    got = np.asarray(at_run_time(k, jnp.float32(p)))
    np.testing.assert_array_equal(got, want)


def test_key_factor_value_is_either_static_value():
  """:func:`pasa.key_factor_value` of a choice made on the device is the
  static value of that choice, rounded to the dtype from float64 (not
  from float32: ``fl16(fl32(x))`` may differ)."""
  scale = 0.1 + 2.0 ** -30
  for dtype in (jnp.float16, jnp.float32):
    for sik in (True, False):
      f = lambda p: scale / p * base.LOG2E
      got = pasa.key_factor_value(scale, True, jnp.asarray(sik), f, dtype)
      want = np.asarray(f(pasa.key_factor(scale, True, sik)), dtype)
      assert got.dtype == dtype and np.asarray(got) == want, (dtype, sik)
  assert pasa.key_factor_value(scale, True, None) == pasa.key_factor(
      scale, True, True)


def test_the_keys_keep_the_scale_where_the_factor_would_not_be_exact():
  """Outside :data:`pasa.RUNTIME_FACTOR_SCALES` (no real call) the call
  keeps the scale in the keys instead of choosing on the device."""
  config = pasa.PasaConfig()
  seen = []
  for scale, runtime in ((0.125, True), (2.0 ** -110, False),
                         (2.0 ** 110, False)):
    pasa.with_key_factor(seen.append, jnp.float32(1.0), jnp.float32(1.0),
                         config, scale=scale)
    assert isinstance(seen[-1], jax.Array) == runtime, scale
    if not runtime:
      assert seen[-1] is True


# ----------------------------------------------------------------------------
# The rows a NaN/Inf reaches under segment ids, without a [B, T, S] mask.


def _dense_visibility(t, s, *, q_lens, kv_lens, offsets, is_causal, window,
                      q_seg, kv_seg):
  """bool ``[B, T, S]`` from the definitions."""
  i = np.arange(t)[:, None]
  j = np.arange(s)[None, :]
  out = []
  for b in range(len(kv_lens)):
    vis = (i < q_lens[b]) & (j < kv_lens[b])
    c = i + offsets[b]
    if is_causal:
      vis &= j <= c
    if window is not None:
      left, right = window
      if left is not None:
        vis &= j >= c - left
      if right is not None:
        vis &= j <= c + right
    vis &= q_seg[b][:, None] == kv_seg[b][None, :]
    out.append(vis)
  return np.stack(out)


@pytest.mark.parametrize("is_causal,window", [
    (True, None), (False, None), (False, (5, 3)), (True, (9, 0))])
def test_nonfinite_rows_with_segments_equal_the_dense_rule(is_causal,
                                                          window):
  """With segment ids (unsorted, negative, large, a query id no key has)
  the reached rows come from a sort of the key ids and a search per row,
  no ``[B, T, S]`` mask: the same rows as the dense definition, with GQA,
  query and key lengths and bottom-right offsets; and with a dense mask
  as well, the dense rule on both."""
  b, t, s, n, nk = 2, 45, 70, 4, 2
  rng = np.random.default_rng(7)
  ids = np.asarray([3, -1, 2 ** 30, 7, 0])
  q_seg = ids[rng.integers(0, 5, (b, t))]
  kv_seg = ids[rng.integers(0, 4, (b, s))]   # (0 is no key's id)
  q_seg[1, 30:] = np.sort(q_seg[1, 30:])
  q_lens, kv_lens = np.asarray([45, 31]), np.asarray([70, 52])
  offsets = kv_lens - q_lens
  bad_q = rng.random((b, t, n)) < 0.05
  bad_kv = rng.random((b, s, nk)) < 0.06
  im = common.IndexMask(q_lens=jnp.asarray(q_lens, jnp.int32),
                        offsets=jnp.asarray(offsets, jnp.int32),
                        q_segments=jnp.asarray(q_seg, jnp.int32),
                        kv_segments=jnp.asarray(kv_seg, jnp.int32),
                        window=window)
  vis = _dense_visibility(t, s, q_lens=q_lens, kv_lens=kv_lens,
                          offsets=offsets, is_causal=is_causal, window=window,
                          q_seg=q_seg, kv_seg=kv_seg)
  mask = rng.random((b, n, t, s)) < 0.8
  bad_key = np.repeat(bad_kv, n // nk, axis=2)                 # [B, S, N]
  for dense in (None, mask):
    v4 = vis[:, None] if dense is None else vis[:, None] & dense
    reached = (v4 & bad_key.transpose(0, 2, 1)[:, :, None, :]).any(-1)
    reached = reached.transpose(0, 2, 1)                       # [B, T, N]
    sees = v4.any(-1).transpose(0, 2, 1)
    assert reached.any() and not reached.all()
    for q_flags, want in ((bad_q, reached | (bad_q & sees)), (None, reached)):
      got = jax.jit(functools.partial(
          nonfinite.rows_reached, is_causal=is_causal, q_shape=(b, t, n, 8)))(
              None if q_flags is None else jnp.asarray(q_flags),
              jnp.asarray(bad_kv), None if dense is None else jnp.asarray(
                  dense), jnp.asarray(kv_lens, jnp.int32), index_mask=im)
      np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("method", ["pasa", "int8"])
@pytest.mark.parametrize("implementation", ["reference", "triton", "mosaic"])
def test_nonfinite_inputs_with_segment_ids(method, implementation):
  """A NaN query, a NaN key and an infinite value with unsorted segment
  ids, causal: NaN exactly in the rows they reach (the dense rule), every
  other row the call with those elements zeroed (PASA's V is zeroed
  whatever it holds, with no branch)."""
  b, t, n, d = 1, 150, 2, 64
  rng = np.random.default_rng(2)
  seg = np.asarray([5, 1, 9])[rng.integers(0, 3, (b, t))]
  x = {c: rng.standard_normal((b, t, n if c == "q" else 1, d))
       for c in "qkv"}
  bad = {c: a.copy() for c, a in x.items()}
  bad["q"][0, 40, 1, 3] = np.nan
  bad["k"][0, 60, 0, 7] = np.nan
  bad["v"][0, 100, 0, 0] = -np.inf
  zeroed = {c: np.where(np.isfinite(a), a, 0.0) for c, a in bad.items()}
  run = lambda z: np.asarray(jaxattn.dot_product_attention(
      *(jnp.asarray(z[c], jnp.float16) for c in "qkv"), method=method,
      implementation=implementation, is_causal=True,
      q_segment_ids=jnp.asarray(seg, jnp.int32)), np.float32)
  out, clean = run(bad), run(zeroed)
  vis = np.tril(np.ones((t, t), bool)) & (seg[0][:, None] == seg[0][None])
  want = np.zeros((t, n), bool)
  want[:, :] |= (vis[:, 60] | vis[:, 100])[:, None]
  want[40, 1] |= vis[40].any()
  got = ~np.isfinite(out[0]).all(-1)
  np.testing.assert_array_equal(got, want)
  assert np.isnan(out[0][got]).all()
  np.testing.assert_array_equal(out[0][~got], clean[0][~got])

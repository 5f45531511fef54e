"""Every method on every backend at float16's extremes (+-65504, values near
it, subnormals, V at +-65504), against float32 attention on the same float16
values:

* NaN is never wider than float32's, except where a method overflows by
  design (``fp16_fp32`` and ``fp16`` scores past 65504, ``fp16``'s float16
  accumulator, PASA past its bound, the README's "PASA's bound"), and there
  what stays finite is float32's value, never a finite wrong number;
* each kernel equals its own method's reference (test_fuzz's KERNEL_TOL),
  except at +-65504 exactly, where scores tie exactly and float32 sums
  break the ties by their order (a kernel and the reference then pick
  different keys, both right to float32);
* with subnormal Q, K (uniform attention over normal V) the error against
  float32 is within the method's budget (test_fuzz's ERROR_BUDGET, the
  table in benchmarks/README.md);
* with V at +-65504 the error against float32 is the error of the same
  call with V at +-1: attention is linear in V, and the extreme values
  cost nothing.  (Two-valued V is hard for SageAttention2's smoothed fp8
  V at long sequences whatever its scale: its reference measures 0.22 at
  1000 keys, against 3.9e-2 on normal V; the README's limits.)
"""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import api, metrics
from test_fuzz import ERROR_BUDGET, KERNEL_TOL, OUTPUT_ROUNDING

SHAPE = (1, 40, 70, 2, 64)        # B, T, S, N, D (CPU: interpret mode)
GPU_SHAPE = (2, 300, 1000, 4, 128)
F16_MAX = 65504.0


def _inputs(case, shape):
  B, T, S, N, D = shape
  r = np.random.default_rng(11)
  normal = lambda *shape: r.standard_normal(shape).astype(np.float32)
  signs = lambda *shape: np.where(r.random(shape) < 0.5, -1.0, 1.0)
  q, k, v = normal(B, T, N, D), normal(B, S, N, D), normal(B, S, N, D)
  if case == "max":
    q, k = F16_MAX * signs(B, T, N, D), F16_MAX * signs(B, S, N, D)
  elif case == "near_max":
    q, k = (np.clip(x * 6e4, -F16_MAX, F16_MAX) for x in (q, k))
  elif case == "subnormal":
    q, k = q * 3e-8, k * 3e-8
  elif case == "v_max":
    v = F16_MAX * signs(B, S, N, D)
  return tuple(jnp.asarray(x, jnp.float16) for x in (q, k, v))


def _by_design(method, case):
  """The method overflows float16 on these inputs by design."""
  scores_overflow = case in ("max", "near_max")
  return ((method in ("fp16_fp32", "pasa") and scores_overflow)
          or (method == "fp16" and case != "subnormal"))


CASES = ["max", "near_max", "subnormal", "v_max"]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_every_method_and_backend_at_float16_extremes(case):
  check(case, SHAPE)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_gpu_kernels_at_float16_extremes(case):
  """The same on the GPU kernels, at a size with many key blocks."""
  check(case, GPU_SHAPE)


def _unit_v_error(q, k, v, method, impl):
  """The error against float32 of the call with V / 65504 (V = +-1)."""
  v1 = (v.astype(jnp.float32) / F16_MAX).astype(jnp.float16)
  f32 = lambda x: x.astype(jnp.float32)
  ref = jaxattn.dot_product_attention(f32(q), f32(k), f32(v1),
                                      implementation="reference")
  out = jaxattn.dot_product_attention(q, k, v1, method=method,
                                      implementation=impl)
  out = out[0] if isinstance(out, tuple) else out
  return metrics.relative_rmse(np.asarray(out, np.float64),
                               np.asarray(ref, np.float64))


def check(case, shape):
  q, k, v = _inputs(case, shape)
  f32 = lambda x: x.astype(jnp.float32)
  ref32 = np.asarray(jaxattn.dot_product_attention(
      f32(q), f32(k), f32(v), implementation="reference"), np.float64)
  assert np.isfinite(ref32).all()
  checked = 0
  for method in jaxattn.METHODS:
    ref = None
    for impl in ("reference", "triton", "mosaic"):
      try:
        api.resolve_implementation(q, k, v, method=method,
                                   implementation=impl)
      except NotImplementedError:
        continue
      out = jaxattn.dot_product_attention(q, k, v, method=method,
                                          implementation=impl)
      out = np.asarray(out[0] if isinstance(out, tuple) else out, np.float64)
      label = (case, method, impl)
      rows_bad = ~np.isfinite(out).all(-1)
      if _by_design(method, case):
        # what stays finite in a poisoned row is float32's value (scores
        # past 65504 make the row NaN; fp16's accumulator overflows only
        # some elements of a row to inf)
        row_scale = np.abs(ref32).max(-1, keepdims=True)
        finite = np.isfinite(out) & rows_bad[..., None]
        dev = np.abs(np.where(finite, out - ref32, 0.0)) / row_scale
        assert dev.max() < 1e-2, (label, dev.max())
      else:
        assert not rows_bad.any(), (label, rows_bad.mean())
      if impl == "reference":
        ref = out
      elif case != "max" and not rows_bad.any():
        own = ref
        filled = api.backend_options(method, impl)
        if filled:   # the reference with the options the backend filled
          own = jaxattn.dot_product_attention(   # in (sage on Mosaic)
              q, k, v, method=method, implementation="reference", **filled)
          own = np.asarray(own[0] if isinstance(own, tuple) else own,
                           np.float64)
        err = metrics.relative_rmse(out, own)
        tol = max(KERNEL_TOL[method], OUTPUT_ROUNDING["float16"])
        assert err < tol, (label, err)
      if case == "subnormal" and not _by_design(method, case):
        err = metrics.relative_rmse(out, ref32)
        assert err < ERROR_BUDGET[method], (label, err)
      if case == "v_max" and not _by_design(method, case):
        err = metrics.relative_rmse(out, ref32)
        unit = _unit_v_error(q, k, v, method, impl)
        assert abs(err - unit) <= 0.05 * unit + 1e-4, (label, err, unit)
      checked += 1
  assert checked >= 18, checked


def references_at_max():
  """Every method's reference output at Q, K = +-65504, float32
  ``[methods, B, T, N, D]``."""
  q, k, v = _inputs("max", SHAPE)
  outs = []
  for method in jaxattn.METHODS:
    out = jaxattn.dot_product_attention(q, k, v, method=method,
                                        implementation="reference")
    outs.append(np.asarray(out[0] if isinstance(out, tuple) else out,
                           np.float32))
  return np.stack(outs)


_REFERENCES_AT_MAX = """
import sys
import numpy as np
sys.path.insert(0, "tests")
from test_extremes import references_at_max
np.save(sys.argv[1], references_at_max())
"""


def _references_in_subprocess(xla_flags: str, tmp_path):
  """:func:`references_at_max` in a CPU process with these XLA flags."""
  path = tmp_path / f"out{len(list(tmp_path.glob('out*.npy')))}.npy"
  subprocess.run([sys.executable, "-c", _REFERENCES_AT_MAX, str(path)],
                 env=dict(os.environ, XLA_FLAGS=xla_flags,
                          JAX_PLATFORMS="cpu"),
                 check=True, cwd=pathlib.Path(__file__).parents[1],
                 capture_output=True, timeout=600)
  return np.load(path)


@pytest.mark.slow
def test_references_do_not_depend_on_xla_optimisation(tmp_path):
  """At Q, K = +-65504 (base-2 scores ~1e10, where an ulp is ~1000) each
  reference's row max and exponent read one float32 value of each score
  (``base.visible_scores``), so XLA's code generation cannot put s - m
  above 0 in one of them: every method's reference gives the same bits at
  XLA's backend optimisation level 0 and the default (level 0 made 10% of
  sage's rows NaN before), finite except where the method overflows by
  design.  Level 0 is computed here where the process runs at it
  (conftest.py sets it on the CPU), the default in a subprocess with the
  process's other flags."""
  opt0 = "--xla_backend_optimization_level=0"
  flags_here = os.environ.get("XLA_FLAGS", "")
  if opt0 in flags_here and jax.default_backend() == "cpu":
    outs = (references_at_max(),
            _references_in_subprocess(flags_here.replace(opt0, "").strip(),
                                      tmp_path))
  else:
    outs = (_references_in_subprocess(opt0, tmp_path),
            _references_in_subprocess("", tmp_path))
  for method, level0, default in zip(jaxattn.METHODS, *outs):
    np.testing.assert_array_equal(level0, default, err_msg=method)
    assert np.isfinite(level0).all() or _by_design(method, "max"), method

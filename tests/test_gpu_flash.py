"""GPU tests of the flash / PASA Pallas kernels at real sizes (marker ``gpu``).

Run on a GPU machine with ``python -m pytest -m gpu -q -s``; every comparison
prints its numbers.  Each case draws fresh random inputs and first fills the
allocator with NaN buffers of the output's size, so an element the kernel
never writes shows up as NaN or as a mismatch.
"""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import data, metrics

pytestmark = pytest.mark.gpu

# Kernel vs reference, relative RMSE bound per method: the same arithmetic up
# to the accumulation order of the matmuls (and exp2 vs exp for fp32).
TOL = {"fp32": 2e-3, "fp16_fp32": 2e-3, "fp16": 1e-2, "pasa": 1e-2}

CASES = [
    # (B, T, S, N, K, D, causal, padded)
    (1, 1024, 1024, 8, 8, 128, False, False),
    (1, 4096, 4096, 8, 8, 128, True, False),
    (1, 3001, 3001, 4, 2, 96, True, True),
    (2, 1000, 2500, 4, 4, 80, False, True),
    (1, 16384, 16384, 2, 1, 64, True, False),
    (1, 2048, 2048, 4, 4, 32, True, False),
    (1, 2000, 2048, 4, 2, 256, False, True),
]


@pytest.mark.parametrize("method", list(TOL))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_matches_reference(method, case, poison_allocator):
  b, t, s, n, kh, d, causal, padded = case
  seed = np.random.randint(1 << 30)
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (b, t, n, d), jnp.float16)
  k = jax.random.normal(kk, (b, s, kh, d), jnp.float16)
  v = jax.random.normal(kv, (b, s, kh, d), jnp.float16)
  lens = jnp.array([s - 7 * (i + 1) for i in range(b)]) if padded else None
  kw = dict(is_causal=causal, key_value_seq_lengths=lens, method=method)
  poison_allocator((b, t, n, d))
  out = jaxattn.dot_product_attention(q, k, v, implementation="triton", **kw)
  ref = jaxattn.dot_product_attention(q, k, v, implementation="reference",
                                      **kw)
  err = metrics.relative_rmse(out, ref)
  print(f"{method} {case}: rel_rmse(kernel, reference) = {err:.2e}")
  assert metrics.nonfinite_fraction(out) == 0.0
  assert err < TOL[method]


@pytest.mark.parametrize("case", data.PASA_TABLE4_CASES,
                         ids=lambda c: c["name"])
def test_pasa_table4_overflow(case):
  """PASA paper Table 4 at (1, 16, 1280, 128): fp16_fp32 overflows to NaN,
  PASA never does."""
  q, k, v = data.pasa_case(jax.random.key(0), case, (1, 1280, 16, 128),
                           jnp.float16)
  ref = metrics.exact_attention(q, k, v)
  nan_pct = {}
  for method in ("fp16_fp32", "pasa"):
    out = jaxattn.dot_product_attention(q, k, v, method=method,
                                        implementation="triton")
    nan_pct[method] = 100 * metrics.nan_fraction(out)
    finite = np.isfinite(np.asarray(out, np.float64)).all()
    rel = metrics.relative_rmse(out, ref) if finite else float("nan")
    print(f"{case['name']}: {method} NaN {nan_pct[method]:.2f}% "
          f"(paper fp16_fp32 {case['paper_nan_pct']}%), rel_rmse {rel:.2e}")
    if method == "pasa":
      # float16 scores round to ~0.06 at the score spread of the uniform
      # cases: the PASA reference itself measures 3.5e-2 to 4.5e-2 there
      # (jaxattn report), the kernel 3.9e-2 / 4.4e-2 (H100).
      assert nan_pct[method] == 0.0
      assert rel < 6e-2
  assert nan_pct["fp16_fp32"] > 0.0

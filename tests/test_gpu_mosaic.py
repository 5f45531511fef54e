"""GPU tests of the Hopper (Mosaic GPU) kernels at real sizes (marker
``gpu``; they need compute capability 9.0): every Mosaic method against its
reference and against the Triton kernel of the same method, on fresh random
inputs, with the allocator poisoned, odd lengths, key padding, causal
masking and GQA.  ``python -m pytest -m gpu -q -s tests/test_gpu_mosaic.py``
prints each relative error."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import api, data, metrics

pytestmark = pytest.mark.gpu

VARIANTS = [
    ("fp32", {}, 2e-3),
    ("fp16_fp32", {}, 2e-3),
    ("sage", {"preset": "sage2-8b"}, 2e-3),
    ("sage", {"preset": "sage1"}, 2e-3),
    ("int8", {}, 2e-3),
    ("int8", {"v_granularity": "block", "block_k": 128}, 2e-3),
    ("int8", {"pv_dtype": "fp16"}, 2e-3),
    # fp8: Hopper's fp8 wgmma accumulates QK^T with a reduced-precision
    # (about 14-bit mantissa) accumulator, which the float32 reference cannot
    # emulate; the resulting flips of the e4m3 rounding of P measured 5.1e-3
    # at D=128, S=2048 and 8e-6 at D=64 on an H100.
    ("fp8", {}, 1e-2),
    ("fp8", {"granularity": "block"}, 1e-2),
    ("pasa", {}, 1e-2),   # float16 softmax: the Triton kernel's bound
    # int8 output (dynamic amax): a float32 output moved by accumulation
    # order rounds to the neighbouring int8 step here and there (one step
    # is 1/127 of the largest output)
    ("fmha_int8", {}, 1e-2),
]
# (batch, q_len, kv_len, heads, kv heads, head dim, causal, padded)
CASES = [(1, 2048, 2048, 8, 8, 128, False, False),
         (1, 4096, 4096, 8, 2, 128, True, False),
         (2, 3001, 2500, 4, 4, 64, True, True),
         (1, 1000, 8192, 4, 1, 128, False, True)]


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("method,opts,tol", VARIANTS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_mosaic_matches_reference_and_triton(method, opts, tol, case,
                                             poison_allocator):
  if not api.BACKENDS["mosaic"].native():
    pytest.fail("the Mosaic kernels need a compute capability 9.0 GPU")
  b, t, s, n, kh, d, causal, padded = case
  kq, kk, kv = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 3)
  q = jax.random.normal(kq, (b, t, n, d), jnp.float16)
  k = jax.random.normal(kk, (b, s, kh, d), jnp.float16) + 0.5
  v = jax.random.normal(kv, (b, s, kh, d), jnp.float16)
  lens = (jnp.array([s - 7 * (i + 1) for i in range(b)], jnp.int32)
          if padded else None)
  # the options the Mosaic backend fills in (sage: 128-key blocks), so
  # that the reference and Triton compute the same numerics
  kw = dict(method=method, is_causal=causal, key_value_seq_lengths=lens,
            **api.backend_options(method, "mosaic", is_causal=causal,
                                  **opts))
  poison_allocator((b, t, n, d))
  out = jaxattn.dot_product_attention(q, k, v, implementation="mosaic", **kw)
  ref = jaxattn.dot_product_attention(q, k, v, implementation="reference",
                                      **kw)
  has_triton = method in api.BACKENDS["triton"].ADAPTERS
  tri = (jaxattn.dot_product_attention(q, k, v, implementation="triton", **kw)
         if has_triton else ref)  # "fp8" has no Triton kernel
  assert out.shape == ref.shape and out.dtype == ref.dtype
  assert bool(jnp.isfinite(out).all()), "non-finite output (unwritten rows?)"
  e_ref, e_tri = _rel(out, ref), _rel(out, tri)
  print(f"\n{method} {opts} {case}: rel_rmse vs reference {e_ref:.2e}, "
        f"vs triton {e_tri:.2e}")
  assert e_ref < tol and e_tri < tol


def test_auto_selects_mosaic_on_hopper():
  assert api.BACKENDS["mosaic"].native()
  q = jnp.ones((1, 64, 2, 128), jnp.float16)
  assert api.resolve_implementation(q, q, q, method="sage") == "mosaic"
  assert api.resolve_implementation(q, q, q, mask=jnp.ones((64, 64), bool),
                                    method="sage") == "triton"
  assert api.resolve_implementation(q, q, q, method="int8",
                                    tile_q=64) == "triton"


@pytest.mark.parametrize("case", data.PASA_TABLE4_CASES,
                         ids=lambda c: c["name"])
def test_mosaic_pasa_table4_overflow(case):
  """PASA paper Table 4 at (1, 16, 1280, 128) on the Mosaic kernel: no NaN,
  the Triton kernel's error against float64 (tests/test_gpu_flash.py)."""
  q, k, v = data.pasa_case(jax.random.key(0), case, (1, 1280, 16, 128),
                           jnp.float16)
  out = jaxattn.dot_product_attention(q, k, v, method="pasa",
                                      implementation="mosaic")
  tri = jaxattn.dot_product_attention(q, k, v, method="pasa",
                                      implementation="triton")
  rel = metrics.relative_rmse(out, metrics.exact_attention(q, k, v))
  print(f"\n{case['name']}: mosaic pasa NaN {100 * metrics.nan_fraction(out)}"
        f"%, rel_rmse {rel:.2e}, vs triton {_rel(out, tri):.2e}")
  assert metrics.nonfinite_fraction(out) == 0.0
  assert rel < 6e-2 and _rel(out, tri) < 1e-2


@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
def test_pasa_kernels_beat_fp16_fp32_on_the_papers_sweeps(implementation):
  """The CPU test of the PASA allocations (tests/test_flash_pasa.py) on the
  GPU kernels at the paper's Table 4 shape: the default beats fp16_fp32 at
  every non-zero mean of Figures 9 and 10 and has its error exactly at
  x0 = 0, where it computes fp16_fp32's arithmetic; Algorithm 1 mostly
  loses."""
  from test_flash_pasa import check_sweep_ordering, sweep_errors
  errors = sweep_errors(implementation, (1, 1280, 16, 128))
  for point, e in errors.items():
    print(f"\n{implementation} {point}: " + ", ".join(
        f"{n} {x:.4e}" for n, x in e.items()))
  check_sweep_ordering(errors)


@pytest.mark.parametrize("implementation", ["mosaic", "triton"])
@pytest.mark.parametrize("dist, am", [("uniform", 0.5), ("hybrid", 10.0)])
def test_pasa_kernels_are_fp16_fp32_where_no_block_is_shifted(
    implementation, dist, am):
  """The CPU identity test (tests/test_flash_pasa.py) on the GPU kernels
  at the paper's Table 4 shape: bit for bit the same output."""
  from test_flash_pasa import check_pasa_is_fp16_fp32
  check_pasa_is_fp16_fp32(implementation, dist, am, (1, 1280, 16, 128))

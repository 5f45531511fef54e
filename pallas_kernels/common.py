"""Pieces shared by the kernels: constants, the GPU probes and the
interpret-mode switch, exact rounding, padding, the key-block range of a
query block and the visibility mask.

This is the bottom of the dependency graph: nothing here (or anywhere in
``pallas_kernels``) imports ``jaxattn``.  The references in ``jaxattn``
import the few numeric helpers they share with the kernels from here.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pl_triton

LOG2E = math.log2(math.e)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class KernelParams:
  """Block sizes, warps and software-pipelining stages of one kernel call."""
  block_q: int
  block_k: int
  num_warps: int
  num_stages: int


def default_device():
  """The device jax computes on by default here: ``jax.default_device``'s
  where one is in effect (the PyTorch shim sets the CPU for CPU tensors on
  a GPU host), else the default backend's first."""
  device = jax.config.jax_default_device
  if isinstance(device, str):
    return jax.devices(device)[0]
  return device if device is not None else jax.devices()[0]


def has_gpu() -> bool:
  """jax computes on a GPU by default here (:func:`default_device`)."""
  try:
    return default_device().platform == "gpu"
  except RuntimeError:
    return False


def is_hopper() -> bool:
  """A compute capability 9.x GPU (H100, H200): the Mosaic kernel's target."""
  return has_gpu() and str(
      getattr(default_device(), "compute_capability", "")).startswith("9")


def interpret() -> bool:
  """Pallas interpret mode when jax has no GPU (how CI runs the kernels)."""
  return not has_gpu()


def exp_f32(x):
  """``exp(x)`` as the kernels take it: ``exp2(x * log2 e)`` in float32."""
  return jnp.exp2(x.astype(jnp.float32) * LOG2E)


def round_probability(p, levels: int):
  """``floor(levels * p + 1/2)`` for ``p`` in ``[0, 1]``: the quantized
  probabilities of INT-FlashAttention (127) and the 8-bit FMHA (255).  Ties
  round up rather than to even, as the kernels compute it (the Triton
  lowering has no ``round``); float32 ties are all but absent here."""
  return jnp.floor(levels * p + 0.5)


def int4_halves(packed):
  """``(lo, hi)``: the two int8 halves of int4 values packed two per byte in
  halves of the last axis (``jaxattn.quant.pack_int4_halves``),
  sign-extended by arithmetic shifts (``lo = (p << 4) >> 4``, ``hi = p >>
  4``), as the kernel unpacks them in registers."""
  return (packed << 4) >> 4, packed >> 4


def round_half_even(y):
  """``rint(y)`` (ties to even, as ``jnp.round``) of float32 ``y`` inside a
  Pallas Triton kernel.  On the GPU one ``cvt.rni.f32.f32``: an opaque
  instruction, so LLVM cannot contract the product that made ``y`` into a
  fused multiply-add (which would round ``x * inv`` once instead of twice
  and flip the rare quantized value that the references round
  differently)."""
  if interpret():
    return jnp.round(y)
  return pl_triton.elementwise_inline_asm(
      "cvt.rni.f32.f32 $0, $1;", args=[y], constraints="=f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(y.shape, jnp.float32)])[0]


def reciprocal_rn(x):
  """``fl(1 / x)`` correctly rounded (``jaxattn.quant.reciprocal``, with ``1
  / 0 := 0``) of float32 ``x`` inside a Pallas Triton kernel: Triton's
  float32 division is ``div.full.f32`` (2 ulp), so on the GPU this is an
  explicit ``div.rn.f32``."""
  safe = jnp.where(x == 0, 1.0, x)
  if interpret():
    r = 1.0 / safe
  else:
    r = pl_triton.elementwise_inline_asm(
        "div.rn.f32 $0, 0f3F800000, $1;", args=[safe], constraints="=f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)])[0]
  return jnp.where(x == 0, 0.0, r)


def pad_axis(x, axis: int, size: int):
  """Zero-pads ``axis`` of ``x`` to ``size`` (no copy when it already is)."""
  if x.shape[axis] == size:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, pad)


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def key_block_range(i, kv_len, *, block_q, block_k, is_causal, has_mask):
  """``(n_full, n_blocks)`` for query block ``i``: key blocks
  ``[0, n_full)`` are visible to every row (no mask needed), blocks
  ``[n_full, n_blocks)`` need the mask, later blocks are seen by no row."""
  hi = kv_len
  if is_causal:
    hi = jnp.minimum(hi, (i + 1) * block_q)
  n_blocks = lax.div(hi + block_k - 1, block_k)
  n_full = lax.div(kv_len, block_k)
  if is_causal:
    n_full = jnp.minimum(n_full, lax.div(i * block_q + 1, block_k))
  if has_mask:
    n_full = jnp.zeros_like(n_full)
  return jnp.minimum(n_full, n_blocks), n_blocks


def visible(i, j, kv_len, *, block_q, block_k, is_causal, mask=None):
  """Boolean ``[block_q, block_k]``: query ``i*block_q + r`` sees key
  ``j*block_k + c`` (``mask``: the user's int8 mask block, or None)."""
  shape = (block_q, block_k)
  cols = j * block_k + lax.broadcasted_iota(jnp.int32, shape, 1)
  vis = cols < kv_len
  if is_causal:
    rows = i * block_q + lax.broadcasted_iota(jnp.int32, shape, 0)
    vis = vis & (cols <= rows)
  if mask is not None:
    vis = vis & (mask != 0)
  return vis

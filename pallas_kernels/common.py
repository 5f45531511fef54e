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


# non-empty while :func:`pallas_kernels.triton_call.compiling_for` traces the
# kernels with a GPU's static flags on a machine without one
GPU_FLAGS_WITHOUT_GPU: list = []


def interpret() -> bool:
  """Pallas interpret mode when jax has no GPU (how CI runs the kernels)."""
  return not has_gpu() and not GPU_FLAGS_WITHOUT_GPU


def exp_f32(x, scale: float = 1.0):
  """``exp(scale * x)`` as the kernels take it: ``exp2(x * (scale log2 e))``
  in float32, the factor one constant."""
  return jnp.exp2(x.astype(jnp.float32) * (scale * LOG2E))


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


def multiply_rn(a, b):
  """``fl(a * b)`` of float32 arrays inside a Pallas Triton kernel, rounded
  once and never contracted into a later add (``mul.rn.f32`` on the GPU;
  LLVM would otherwise fuse ``x - a * b`` into an FMA)."""
  if interpret():   # (XLA:CPU contracts too, as the program around allows)
    return jax.lax.optimization_barrier(a * b)
  return pl_triton.elementwise_inline_asm(
      "mul.rn.f32 $0, $1, $2;", args=[a, b], constraints="=f,f,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


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


# Which keys a query row sees, from indices (never a dense mask).  A row
# ``i`` sees key ``j`` iff ``i < row_len``, ``j < col_len``, ``i + lower <=
# j <= i + upper`` and, with segment ids, ``seg_q[i] == seg_k[j]`` (and the
# user's mask, where one is given).  ``lower``/``upper`` hold the causal
# diagonal and the local window relative to the alignment offset; UNBOUNDED
# stands for no limit (small enough that ``i +- UNBOUNDED`` cannot overflow).
UNBOUNDED = 1 << 30


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class IndexMask:
  """What, besides the key lengths and causality, decides which keys a query
  row sees; every field optional.

  Attributes:
    q_lens: int32 ``[B]``: query rows at or beyond it see no key.
    offsets: int32 ``[B]``: the diagonal's offset: row ``i``'s causal limit
      and window centre is key ``i + offset`` (0: top-left alignment;
      ``kv_len - q_len``: bottom-right).
    q_segments, kv_segments: int32 ``[B, T]`` and ``[B, S]``: a score is
      kept only where the two segment ids are equal (packed sequences).
    window: static ``(left, right)``: row ``i`` sees keys ``i + offset -
      left .. i + offset + right`` (None on a side: unbounded).
  """
  q_lens: jax.Array | None = None
  offsets: jax.Array | None = None
  q_segments: jax.Array | None = None
  kv_segments: jax.Array | None = None
  window: tuple[int | None, int | None] | None = dataclasses.field(
      default=None, metadata=dict(static=True))

  @property
  def has_segments(self) -> bool:
    return self.q_segments is not None

  def query_rows(self, start: int, stop: int, batch: int) -> "IndexMask":
    """The mask of query rows ``[start, stop)`` as a call of their own:
    row ``start + i`` becomes row ``i``, so the diagonal's offset grows by
    ``start``, and the query lengths and segment ids are those rows'."""
    offsets = (jnp.zeros((batch,), jnp.int32) if self.offsets is None
               else self.offsets)
    return dataclasses.replace(
        self, offsets=offsets + start,
        q_lens=(None if self.q_lens is None
                else jnp.clip(self.q_lens - start, 0, stop - start)),
        q_segments=(None if self.q_segments is None
                    else self.q_segments[:, start:stop]))


def row_bounds(kv_lens, index_mask: IndexMask | None, *, t: int,
               is_causal: bool):
  """int32 ``[B, 4]``: ``(row_len, col_len, lower, upper)`` of each batch
  row (see :class:`IndexMask`): query rows ``< row_len`` (``t`` without
  query lengths) see keys ``< col_len`` in ``[i + lower, i + upper]``."""
  b = kv_lens.shape[0]
  im = index_mask or IndexMask()
  kv_lens = kv_lens.astype(jnp.int32)
  q_lens = (jnp.full((b,), t, jnp.int32) if im.q_lens is None
            else jnp.minimum(im.q_lens.astype(jnp.int32), t))
  offset = (jnp.zeros((b,), jnp.int32) if im.offsets is None
            else im.offsets.astype(jnp.int32))
  left, right = im.window or (None, None)
  lower = (jnp.full((b,), -UNBOUNDED, jnp.int32) if left is None
           else offset - left)
  upper = (jnp.full((b,), UNBOUNDED, jnp.int32) if right is None
           else offset + right)
  if is_causal:
    upper = jnp.minimum(upper, offset)
  return jnp.stack([q_lens, kv_lens, lower, upper], axis=1)


def transpose_bounds(bounds):
  """The bounds with keys as rows: key ``j`` is seen by queries ``j -
  upper .. j - lower`` (for kernels that own a key block)."""
  row_len, col_len, lower, upper = (bounds[:, c] for c in range(4))
  return jnp.stack([col_len, row_len, -upper, -lower], axis=1)


def _block_summary(seg, valid, n_blocks: int, block: int):
  """Per block of ``block`` entries of ``seg`` ``[B, L]`` (``valid``
  ``[B, L]``): min and max segment id of the valid entries (``UNBOUNDED``
  and ``-UNBOUNDED`` when none) and whether all ``block`` ids are equal."""
  size = n_blocks * block
  pad = size - seg.shape[1]
  if pad > 0:
    seg = jnp.pad(seg, ((0, 0), (0, pad)), mode="edge")
    valid = jnp.pad(valid, ((0, 0), (0, pad)))
  seg = seg[:, :size].reshape(-1, n_blocks, block)
  valid = valid[:, :size].reshape(-1, n_blocks, block)
  lo = jnp.where(valid, seg, UNBOUNDED).min(-1)
  hi = jnp.where(valid, seg, -UNBOUNDED).max(-1)
  uniform = valid.all(-1) & (lo == hi)
  return lo, hi, uniform


def block_ranges(bounds, row_segments=None, col_segments=None, *,
                 n_row_blocks: int, block_r: int, block_c: int,
                 has_mask: bool):
  """int32 ``[B, n_row_blocks, 4]``: for each block of ``block_r`` rows, the
  column blocks ``(lo, full_lo, full_hi, hi)`` (of ``block_c`` columns).

  Blocks ``[lo, hi)`` hold every column that some row of the block sees;
  ``[full_lo, full_hi)`` (inside it) are seen whole by every row, so they
  need no mask; the others of ``[lo, hi)`` need the element mask
  (:func:`visible`), and the blocks outside ``[lo, hi)`` are skipped.
  Segment ids narrow the range to the column blocks whose ids overlap the
  row block's (exact for packed, sorted ids; any ids stay correct, the mask
  decides).  ``bounds`` as :func:`row_bounds` (rows are queries) or
  :func:`transpose_bounds` (rows are keys).
  """
  row_len, col_len, lower, upper = (bounds[:, c, None] for c in range(4))
  r0 = (jnp.arange(n_row_blocks, dtype=jnp.int32) * block_r)[None]
  r_last = jnp.minimum(r0 + block_r, row_len) - 1
  c_lo = jnp.maximum(r0 + lower, 0)
  c_hi = jnp.minimum(r_last + upper + 1, col_len)          # exclusive
  f_lo = jnp.maximum(r0 + block_r - 1 + lower, 0)
  f_hi = jnp.minimum(r0 + upper + 1, col_len)
  lo, hi = lax.div(c_lo, block_c), lax.div(c_hi + block_c - 1, block_c)
  flo, fhi = lax.div(f_lo + block_c - 1, block_c), lax.div(f_hi, block_c)
  full_ok = (r0 + block_r <= row_len) & jnp.asarray(not has_mask)
  if row_segments is not None:
    n_cols = col_segments.shape[1]
    n_col_blocks = -(-n_cols // block_c)
    rows = jnp.arange(row_segments.shape[1])[None]
    cols = jnp.arange(n_cols)[None]
    smin, smax, s_uniform = _block_summary(
        row_segments, rows < bounds[:, 0, None], n_row_blocks, block_r)
    cmin, cmax, c_uniform = _block_summary(
        col_segments, cols < bounds[:, 1, None], n_col_blocks, block_c)
    jb = jnp.arange(n_col_blocks, dtype=jnp.int32)[None, None]
    overlap = ((cmin[:, None, :] <= smax[:, :, None])
               & (cmax[:, None, :] >= smin[:, :, None]))
    lo = jnp.maximum(lo, jnp.where(overlap, jb, n_col_blocks).min(-1))
    hi = jnp.minimum(hi, jnp.where(overlap, jb + 1, 0).max(-1))
    same = c_uniform[:, None, :] & (cmin[:, None, :] == smin[:, :, None])
    same_lo = jnp.where(same, jb, n_col_blocks).min(-1)
    same_hi = jnp.where(same, jb + 1, 0).max(-1)
    contiguous = same.sum(-1) == same_hi - same_lo
    flo, fhi = jnp.maximum(flo, same_lo), jnp.minimum(fhi, same_hi)
    full_ok = full_ok & s_uniform & contiguous
  nonempty = (hi > lo) & (r_last >= r0)   # (a block past row_len sees none)
  lo, hi = jnp.where(nonempty, lo, 0), jnp.where(nonempty, hi, 0)
  full_ok = full_ok & nonempty & (fhi > flo)
  flo = jnp.where(full_ok, jnp.clip(flo, lo, hi), hi)
  fhi = jnp.where(full_ok, jnp.clip(fhi, flo, hi), hi)
  return jnp.stack([lo, flo, fhi, hi], axis=-1).astype(jnp.int32)


def index_operands(kv_lens, index_mask: IndexMask | None, *, t: int,
                   s: int, is_causal: bool, t_pad: int, s_pad: int,
                   block_q: int, block_k: int, has_mask: bool):
  """What a forward kernel reads of the index mask: ``(bounds [B, 4],
  ranges [B, t_pad / block_q, 4], segment ids)`` (:func:`row_bounds`,
  :func:`block_ranges`; the ids padded to ``[B, t_pad]`` and ``[B,
  s_pad]``, or an empty list)."""
  im = index_mask or IndexMask()
  bounds = row_bounds(jnp.minimum(kv_lens, s), im, t=t, is_causal=is_causal)
  ranges = block_ranges(bounds, im.q_segments, im.kv_segments,
                        n_row_blocks=t_pad // block_q, block_r=block_q,
                        block_c=block_k, has_mask=has_mask)
  segments = []
  if im.has_segments:
    segments = [pad_axis(im.q_segments.astype(jnp.int32), 1, t_pad),
                pad_axis(im.kv_segments.astype(jnp.int32), 1, s_pad)]
  return bounds, ranges, segments


def row_key_ranges(bounds, *, t_pad: int):
  """int32 ``[B, 2, t_pad]``: the first and last key each query row sees by
  its bounds (:func:`row_bounds`; last < first: none), so that a kernel
  masks a block with two compares per score (and the segment ids)."""
  row_len, col_len, lower, upper = (bounds[:, c, None] for c in range(4))
  rows = jnp.arange(t_pad, dtype=jnp.int32)[None]
  first = jnp.maximum(rows + lower, 0)
  last = jnp.where(rows < row_len, jnp.minimum(rows + upper, col_len - 1), -1)
  return jnp.stack([first, last], axis=1)


def visible(rows, cols, bounds, *, row_segments=None, col_segments=None,
            mask=None):
  """Boolean: row ``rows`` sees column ``cols`` (absolute int32 indices of
  one block, broadcastable to each other); ``bounds``: the four scalars of
  :func:`row_bounds`; optional segment ids ``[block_r]`` and ``[block_c]``
  and the user's int8 mask block."""
  row_len, col_len, lower, upper = bounds
  vis = ((rows < row_len) & (cols < col_len) & (cols >= rows + lower)
         & (cols <= rows + upper))
  if row_segments is not None:
    vis = vis & (row_segments[:, None] == col_segments[None, :])
  if mask is not None:
    vis = vis & (mask != 0)
  return vis


def block_indices(i, j, block_r: int, block_c: int):
  """Absolute row and column indices ``[block_r, block_c]`` of block
  ``(i, j)``."""
  shape = (block_r, block_c)
  rows = i * block_r + lax.broadcasted_iota(jnp.int32, shape, 0)
  cols = j * block_c + lax.broadcasted_iota(jnp.int32, shape, 1)
  return rows, cols

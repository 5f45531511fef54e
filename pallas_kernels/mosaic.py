"""Warp-specialised attention forward for Hopper (Pallas Mosaic GPU).

One kernel with static flags, in the FlashAttention-3 shape of jax's own
``jax/experimental/pallas/ops/gpu/attention_mgpu.py``: per CTA one (batch,
query head, tile of ``2 * block_q`` rows); three warpgroups, a producer that
streams K and V blocks with the bulk tensor copy engine (TMA) into a ring of
``stages`` shared-memory slots, and two consumers on alternating query blocks
whose softmax overlaps the other's matmuls (a shared "schedule" barrier
orders their tensor-core use: ping-pong).  With ``warpgroups=1``
(:class:`MosaicParams`) the CTA is SageAttention2's sm90 one instead: one
warpgroup of ``block_q`` rows that issues its own loads into the ring and
keeps its registers, so that several CTAs share an SM and overlap one
another's softmax and matmuls; every row computes the same steps either
way, so the two give the same bits.

Operand types (static ``qk`` / ``pv``):

* ``qk="fp16"`` (float16 or bfloat16 Q, K): ``S = Q K^T`` on the 16-bit
  tensor cores, the softmax scale folded into the exponent,
  ``exp2(S * scale * log2 e - m)``;
* ``qk="int8"``: int8 Q, K (wgmma s8 x s8 -> s32), then
  ``S = float32(S_i32) * q_scale[:, None] * k_scale[None, :]`` with
  ``scale * log2 e`` folded into ``q_scale`` (SageAttention,
  INT-FlashAttention); without a smoothing bias the softmax applies
  ``q_scale > 0`` itself (row max of ``S_i32 k_scale`` times ``q_scale``,
  one FMA per score in the exponent).  Where K's scales are one per key
  block (per block or per tensor: ``k_block_scale``) the block's ``k_j``
  joins the row factor ``q_scale k_j`` instead (no per-key scale row; a
  multiply per score only with the exact exponent, and with a bias the
  product folds into the bias's FMA);
* ``qk="fp8"``: float8_e4m3fn Q, K with the same per-row/per-key scales
  (FlashAttention-3's fp8 path);
* ``pv="fp16"``: P in float16/bfloat16 from registers, V ``[S, D]``;
* ``pv="fp8"``: ``P * 448`` in float8_e4m3fn, formed as
  ``exp2(S - (m - log2 448))`` (no multiply per score; l then counts
  1/448ths), V ``[D, S]`` (key dimension contiguous, the K-major operand
  8-bit wgmma needs), per-block product added into a float32 accumulator
  as ``O * alpha + P V`` (two-level accumulation, one FMA);
* ``pv="int8"``: ``P = floor(127 p + 1/2)`` in int8, V int8 ``[D, S]``, s32
  accumulation per block (INT-FlashAttention); the row sum is that of the
  quantized P.
* ``pv="uint8"`` (the 8-bit FMHA): P anchored at the block's own row max
  ``m_t``, ``P = floor(255 exp2(S - m_t) + 1/2)`` in ``[0, 255]``, fed to
  the s8 wgmma as ``P - 128`` (Hopper's wgmma takes no u8 A operand from
  registers) with the exact identity ``P V = (P - 128) V + 128 colsum(V)``
  (the column sums of each V block given); the state is then
  ``O = e^{m - m'} O + e^{m_t - m'} P V``, ``l = e^{m - m'} l + e^{m_t -
  m'} rowsum exp2(S - m_t)`` (unquantized row sums, as the method).

``f16_scores``: ``S`` rounded to float16 as it leaves the matmul (the PASA
paper's ``fp16_fp32`` baseline, and PASA).

``pasa_inva`` (PASA): Q and the shifted keys in float16, the online
pseudo-average of Algorithm 1 (steps 1-6) with ``S'`` and ``P`` in float16;
the exponent's factor ``pasa_exp_scale`` on ``S'``, and per key block a 0/1
weight where the adaptive shift left some blocks (:mod:`jaxattn.pasa`).
With the float32 state the softmax is the ``fp16_fp32`` one, its running
max moved by PASA's corrections (``pasa_running``, FlashAttention-2's
form, P accumulated in the tensor cores); with the float16 state it is
Algorithm 1's, ``P`` against each block's own max and the per-block ``P V``
rescaled.

8-bit P feeds the PV wgmma from registers: the accumulator-layout
registers are reinterpreted as the 8-bit operand layout without moving data
(:func:`_as_8bit_operand`), which reads each 16-key chunk in a fixed
permutation; V's keys are stored in that order by the quantizer
(:func:`pallas_kernels.quantizers.key_order`).  The epilogue computes
``O / l`` and, where given, ``* out_scale + out_shift`` per channel (V's
scale and mean).

Which keys a row sees comes from indices (:func:`common.row_bounds`: key
lengths, causality, query lengths, an alignment offset, a local window;
segment ids for packed sequences), never a dense mask.  The CTA streams
only the key blocks some row of its tile sees (:func:`common.block_ranges`
per warpgroup); a warpgroup drains the blocks only its sibling needs,
computes the blocks all its rows see whole without a mask, and masks the
rest element by element.  The CTAs launch longest first
(:func:`tile_table`), so the short tiles fill the last wave.  Causal
masking is top-left aligned unless an offset says otherwise.  Query heads
of a group read their key/value head (GQA without repeats).  Lengths are
padded outside the kernel to whole blocks.  Without a GPU the kernel runs
in Mosaic GPU's interpreter
(``InterpretGPUParams``), where P (8-bit or 16-bit) goes through shared
memory and the 16-bit PV product into a separate accumulator (the
interpreter implements wgmma with shared-memory operands only).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import common
from pallas_kernels.common import FP8_MAX, LOG2E
from pallas_kernels.quantizers import key_order

LOG2_FP8_MAX = math.log2(FP8_MAX)
QK_TYPES = ("fp16", "int8", "fp8")
PV_TYPES = ("fp16", "fp8", "int8", "uint8")
# The head dims of the kernel's tiles; smaller ones are zero-padded to the
# next (256 would not fit the shared-memory ring).
HEAD_DIMS = (64, 128)
# The fused exponent exp2(s * c - m) (one FMA per score) is off by up to half
# an ulp of the row max m, which grows with m: beyond this |m| (base 2) the
# error passes float16 P's precision, and at ~1e9 it overflows or zeroes P.
# Callers whose scores may exceed it take exact_exponent=True.
FUSED_EXPONENT_LIMIT = 2.0 ** 12
# Where a CTA is one warpgroup by default (:class:`MosaicParams`): at head
# dim 64, for the operand types listed.  At 64 such a CTA needs 44-76 KB of
# shared memory, so two to four share an SM if its registers let them.
# fp8 ran 9% faster end to end on the H100 (docs/design.md, "One warpgroup
# per CTA").  The int8-QK kernels (sage, half-INT8, full INT8, the FMHA)
# need 168 registers since the masked step compares constants
# ("The masked step's registers"; 206-210 before, two CTAs an SM) and ran
# 6-14% faster causal on the H200.  float16 operands (fp32, PASA) keep two
# (PASA lost 8-12% with one, fp32 tied), except fp32 on packed calls
# (segment ids: many short CTAs), 15-18% faster with one on the H200.
ONE_WARPGROUP_HEAD_DIMS = (64,)
ONE_WARPGROUP_OPERANDS = frozenset({("fp8", "fp8"), ("int8", "fp8"),
                                    ("int8", "fp16"), ("int8", "int8"),
                                    ("int8", "uint8")})
ONE_WARPGROUP_PACKED_OPERANDS = frozenset({("fp16", "fp16")})


def default_warpgroups(qk: str, pv: str, head_dim: int, *,
                       segments: bool = False, pasa: bool = False) -> int:
  """The CTA's consumer warpgroups (:class:`MosaicParams`) for a call whose
  tiles have ``head_dim`` channels and whose operands are ``qk``, ``pv``;
  ``segments``: the call has segment ids; ``pasa``: PASA's kernel (float16
  operands that keep two warpgroups)."""
  operands = ONE_WARPGROUP_OPERANDS | (
      ONE_WARPGROUP_PACKED_OPERANDS if segments and not pasa else frozenset())
  one = head_dim in ONE_WARPGROUP_HEAD_DIMS and (qk, pv) in operands
  return 1 if one else 2


def has_masked_steps(all_keys: bool, is_causal: bool, index_mask,
                     s_len: int, block_k: int) -> bool:
  """Whether the kernel needs its masked step: unless every query row sees
  every key (no key lengths, not causal, no index mask) and the keys fill
  whole blocks.  Without it the kernel holds one step, whose registers are
  fewer."""
  return not (all_keys and not is_causal and index_mask is None
              and s_len % block_k == 0)


@dataclasses.dataclass(frozen=True)
class MosaicParams:
  """Rows per consumer warpgroup, keys per block, shared-memory ring depth,
  and the CTA's shape: ``warpgroups=2`` is FlashAttention-3's (a producer
  warpgroup and two consumers in ping-pong, one CTA per SM);
  ``warpgroups=1`` SageAttention2's sm90 one (one warpgroup that issues its
  own TMA loads, no register reallocation, so that several CTAs share an
  SM and overlap one another's softmax and matmuls); None picks as
  measured (:func:`default_warpgroups`)."""
  block_q: int = 64
  block_k: int = 128
  stages: int = 2
  warpgroups: int | None = None


def interpret():
  """Mosaic GPU's interpreter when jax has no GPU (how CI runs the kernel)."""
  return plgpu.InterpretGPUParams() if common.interpret() else None


def permute_keys(v, axis):
  """Orders the keys of ``v`` (a multiple of 16 along ``axis``) by
  :func:`pallas_kernels.quantizers.key_order` (the V quantizer writes them
  so directly: ``v_operand(..., key_order=True)``)."""
  return jnp.take(v, jnp.asarray(key_order(v.shape[axis])), axis=axis)


def p_in_registers():
  """Whether 8-bit P feeds the PV wgmma from registers (on the GPU; the
  interpreter reads P from shared memory), so V's keys must be in
  :func:`pallas_kernels.quantizers.key_order`."""
  return interpret() is None


def _as_8bit_operand(p):
  """An 8-bit ``[64, bk]`` P in the accumulator (WGMMA) layout as the 8-bit
  wgmma A operand (WGMMA_8BIT layout), without moving data: each thread's
  two 2-element vectors of a 16-key chunk become one 4-element vector.  The
  wgmma then reads P with its keys in :data:`KEY_PERMUTATION` order, which
  the V operand shares (:func:`permute_keys`), so ``P V`` is unchanged.  (This
  is FlashAttention-3's fp8 trick with the permutation moved to V, where it
  costs nothing: V is laid out once by the quantizer.)"""
  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=plgpu.ShapeDtypeStruct(p.shape, p.dtype,
                                         plgpu.Layout.WGMMA_8BIT))
  def reinterpret(ctx, x):
    del ctx
    layout = mgpu.WGMMA_LAYOUT_8BIT
    regs = np.empty(layout.registers_shape(x.shape), dtype=object)
    for idx in np.ndindex(regs.shape):
      pair = [x.registers[(idx[0], 2 * idx[1] + h, *idx[2:])] for h in (0, 1)]
      regs[idx] = mgpu_utils.vector_concat(pair)
    return mgpu.FragmentedArray(_registers=regs, _layout=layout,
                                _is_signed=x.is_signed)
  return reinterpret(p)


def _fresh_accumulator(shape, dtype):
  """A zero ``shape`` float32 or int32 array in the WGMMA layout whose
  registers are each set by their own ``mov`` right where the array is
  made, for a wgmma to accumulate into.  Mosaic GPU's wgmma always adds to
  its accumulator input, and a splat of 0 lets LLVM share one zero register
  across the loop; ptxas then does not see that the product's accumulator
  is 0 and zeroes it with a move per register every step, instead of taking
  the wgmma form that ignores the accumulator.  The moves are opaque to
  LLVM (inline asm with side effects), so they stay next to the wgmma,
  where ptxas folds them into that form."""
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import llvm, vector

  @plgpu.inline_mgpu(
      return_type=plgpu.ShapeDtypeStruct(shape, dtype, plgpu.Layout.WGMMA))
  def zeros(ctx):
    del ctx
    layout = mgpu.WGMMA_LAYOUT
    if jnp.dtype(dtype) == jnp.int32:
      elt, constraint, mov = ir.IntegerType.get_signless(32), "r", "mov.b32"
      zero = "0"
    else:
      elt, constraint, mov = ir.F32Type.get(), "f", "mov.f32"
      zero = "0f00000000"
    vec_len = layout.vector_length
    regs = np.empty(layout.registers_shape(shape), dtype=object)
    for idx in np.ndindex(regs.shape):
      struct = llvm.inline_asm(
          llvm.StructType.get_literal([elt] * vec_len), [],
          "\n\t".join(f"{mov} ${i}, {zero};" for i in range(vec_len)),
          ",".join([f"={constraint}"] * vec_len), has_side_effects=True)
      parts = [llvm.extractvalue(elt, struct, [i]) for i in range(vec_len)]
      regs[idx] = vector.from_elements(
          ir.VectorType.get((vec_len,), elt), parts)
    return mgpu.FragmentedArray(
        _registers=regs, _layout=layout,
        _is_signed=True if jnp.dtype(dtype) == jnp.int32 else None)
  return zeros()


def _floor_to_8bit(t, offset, *, by_add):
  """``(floor(t), floor(t) - offset)`` as float32 and int8 arrays like ``t``
  (float32, WGMMA layout, ``0 <= t < 2^22``; the int8 wraps modulo 256, so
  ``offset=128`` gives uint8 P's s8 operand ``P - 128``).

  ``by_add``: ``y = t + (1.5 * 2^23 - offset)`` rounded down (``add.rm``)
  holds ``floor(t) - offset`` in its low mantissa bits exactly, because the
  sum's ulp is 1; the int8 is y's low byte and the float ``y - (1.5 * 2^23
  - offset)`` (exact).  Two full-rate float adds replace ``cvt.rzi.s32.f32`` and
  ``cvt.rn.f32.s32``, which run on the 16/clk/SM unit that also takes exp2.
  Otherwise (Mosaic GPU's interpreter, which runs no inline PTX) the plain
  conversions, with the same values for finite ``t`` in that range (a NaN
  ``t`` gives int8 -1 here and 0 there; the kernel's P is never NaN: its
  operands are finite and its masked rows' max is made finite)."""
  if not by_add:
    t_int = t.astype(jnp.int32)   # truncation = floor for t >= 0
    return t_int.astype(jnp.float32), (t_int - offset).astype(jnp.int8)
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, vector

  magic = 1.5 * 2.0 ** 23 - offset   # its low 8 bits are -offset mod 256
  magic_bits = np.float32(magic).view(np.uint32)

  @plgpu.inline_mgpu(
      arg_types=(plgpu.Layout.WGMMA,),
      return_type=(
          plgpu.ShapeDtypeStruct(t.shape, jnp.float32, plgpu.Layout.WGMMA),
          plgpu.ShapeDtypeStruct(t.shape, jnp.int8, plgpu.Layout.WGMMA)))
  def floor(ctx, x):
    del ctx
    f32, i32, i8 = (ir.F32Type.get(), ir.IntegerType.get_signless(32),
                    ir.IntegerType.get_signless(8))
    back = arith.constant(f32, ir.FloatAttr.get(f32, magic))
    vec_len = x.layout.vector_length
    floats = np.empty(x.registers.shape, dtype=object)
    ints = np.empty(x.registers.shape, dtype=object)
    for idx, reg in np.ndenumerate(x.registers):
      ys = [llvm.inline_asm(
          f32, [vector.extract(reg, [], [i])],
          f"add.rm.f32 $0, $1, 0f{magic_bits:08X};", "=f,f")
            for i in range(vec_len)]
      floats[idx] = vector.from_elements(
          ir.VectorType.get((vec_len,), f32),
          [arith.subf(y, back) for y in ys])
      ints[idx] = vector.from_elements(
          ir.VectorType.get((vec_len,), i8),
          [arith.trunci(i8, arith.bitcast(i32, y)) for y in ys])
    return (mgpu.FragmentedArray(_registers=floats, _layout=x.layout,
                                 _is_signed=None),
            mgpu.FragmentedArray(_registers=ints, _layout=x.layout,
                                 _is_signed=True))
  return floor(t)


def _smem(shape, dtype):
  """A swizzled shared-memory tile ``shape`` whose minor dim is the wgmma
  contraction dim (or the N dim of a 16-bit B)."""
  itemsize = jnp.dtype(dtype).itemsize
  swizzle = min(128, shape[-1] * itemsize)
  return plgpu.SMEM(shape, dtype, transforms=(
      plgpu.TilingTransform((8, swizzle // itemsize)),
      plgpu.SwizzleTransform(swizzle)))


def _pasa_scores(s, visible, *, block_k, state_dtype, exp_factor):
  """PASA steps 1-2 on one key block's float32 product ``S' = Q K'^T``
  (``[bq, bk]``, WGMMA layout), as :func:`jaxattn.pasa.pasa_head`: the
  row mean over all ``bk`` columns before any mask, ``S'`` rounded to
  float16, its masked row max ``m'``, ``P = fl16(exp(S' - m'))`` and
  ``l' = rowsum exp(S' - m')`` (``S' - m'`` in ``state_dtype``, times
  ``exp_factor`` in base 2: a float, or a row of one value).  Returns
  ``P`` (float16) and the rows ``(s_mean, m', l', seen)`` in
  ``state_dtype``."""
  f32, f16 = jnp.float32, jnp.float16
  s_mean = (s.sum(axis=1) * (1.0 / block_k)).astype(state_dtype)
  s = s.astype(f16)
  seen = None
  if visible is not None:
    s = jnp.where(visible, s, -jnp.inf)
    seen = jnp.where(visible, 1.0, 0.0).max(axis=1) > 0.0
  m_loc = s.max(axis=1)
  m_ref = jnp.where(m_loc == -jnp.inf, 0.0, m_loc)
  sd = state_dtype
  if not isinstance(exp_factor, float):
    exp_factor = lax.broadcast_in_dim(exp_factor, s.shape, [0])
  e = jnp.exp2((s.astype(sd) - lax.broadcast_in_dim(m_ref.astype(sd), s.shape,
                                                     [0])).astype(f32)
               * exp_factor)
  return e.astype(f16), (s_mean, m_loc.astype(sd), e.sum(axis=1).astype(sd),
                         seen)


def _pasa_corrections(f, count, s_mean, *, inva, weight, seen=None):
  """PASA steps 3-4 (:func:`jaxattn.pasa.pasa_head`) on rows in ``F``'s
  dtype: the new ``F`` and block count (float32) and the corrections
  ``dm'_{j-1}, dm'_j`` (units of ``S'``).  ``weight``: the block's float32
  scalar, 1 if it is shifted and 0 if not (None: every block is); an
  unshifted one adds no ``Sbar'`` to ``F``.  A row where ``seen`` is
  False (None: every row sees the block) keeps ``F`` and its count."""
  f32 = jnp.float32
  sd = f.dtype
  inva = jnp.asarray(inva, sd)
  shifted = None
  w = None
  if weight is not None:   # the scalar as a row (a select takes no scalar
    w = count * 0.0 + weight             # predicate)
    shifted = w > 0.0
  if seen is not None:
    w = jnp.where(seen, 1.0 if w is None else w, 0.0)
  moved = None if w is None else w > 0.0
  total = (count.astype(sd) * f + s_mean).astype(f32)
  if moved is None:
    jn = count + 1.0                    # the block count j (exact in f32)
    f_new = (total / jn.astype(sd).astype(f32)).astype(sd)
  else:
    jn = count + jnp.where(moved, 1.0, 0.0)
    f_new = jnp.where(moved, (total / jnp.maximum(jn, 1.0).astype(sd)
                              .astype(f32)).astype(sd), f)
  s_in_f = (s_mean if shifted is None
            else jnp.where(shifted, s_mean, 0.0).astype(sd))
  return f_new, jn, inva * (f - f_new), inva * (s_in_f - f_new)


def _pasa_update(state, rows, pv_blk, *, inva, exp_factor, weight):
  """PASA steps 3-6 (:func:`jaxattn.pasa.pasa_head`) in the state's dtype
  (``O``'s): the online pseudo-average ``F``, the corrections ``dm'``, the
  new max and the rescaled ``l`` and ``O`` with the block's ``P V``.
  ``state`` is ``(O, m, l, (F, count))``; rows that see no key of the block
  keep it.  ``weight`` as :func:`_pasa_corrections`."""
  f32 = jnp.float32
  o, m, l, (f, count) = state
  sd = o.dtype
  s_mean, m_loc, l_loc, seen = rows
  exp_sd = lambda x: jnp.exp2(x.astype(f32) * exp_factor).astype(sd)
  f_new, jn, dmp_prev, dmp_cur = _pasa_corrections(
      f, count, s_mean, inva=inva, weight=weight)
  m_new = jnp.maximum(m + dmp_prev, m_loc + dmp_cur)
  # all-(-inf) rows so far get 0 weights, not -inf - -inf = NaN
  m_safe = jnp.where(m_new == -jnp.inf, jnp.zeros_like(m_new), m_new)
  e_prev = exp_sd((m - m_safe) + dmp_prev)
  e_cur = exp_sd((m_loc - m_safe) + dmp_cur)
  l_new = e_prev * l + e_cur * l_loc
  rows_of = lambda x: lax.broadcast_in_dim(x, o.shape, [0])
  o_new = rows_of(e_cur) * pv_blk.astype(sd) + rows_of(e_prev) * o
  if seen is None:
    return o_new, m_new, l_new, (f_new, jn)
  keep = lambda new, old: jnp.where(seen, new, old)
  return (jnp.where(rows_of(seen), o_new, o), keep(m_new, m), keep(l_new, l),
          (keep(f_new, f), keep(jn, count)))


def _block_anchored_p(s, c, m, l, *, masked, exact_exponent,
                      round_p_by_add):
  """uint8 P of one block (the 8-bit FMHA): ``P = floor(255 exp2(S - m_t)
  + 1/2)`` against the block's own row max ``m_t``, returned as the s8
  operand ``P - 128``, with the state's new ``(m', l', e^{m - m'},
  e^{m_t - m'})``.  ``s``: the masked scores ``[bq, bk]``; ``c``: the
  factor to base 2 (a row, or a float); ``m``, ``l``: the running max (in
  the units of ``s`` with ``exact_exponent``, else times ``c``) and sum.
  A row that sees nothing of the block gets ``e^{m_t - m'} = 0``."""
  rows = lambda x: lax.broadcast_in_dim(x, s.shape, [0])
  finite = ((lambda x: jnp.where(x == -jnp.inf, 0.0, x)) if masked
            else (lambda x: x))

  def times_c(x):
    if isinstance(c, float):
      return x if c == 1.0 else x * c
    return x * (rows(c) if x.ndim == 2 else c)

  if exact_exponent:   # s - m_t exact near the max, then the factor
    s = lax.optimization_barrier(s)
    m_t = s.max(axis=1)
    e = jnp.exp2(times_c(s - rows(finite(m_t))))
    to_base2 = times_c
  else:                # one FMA per score; m, m_t already times c
    m_t = times_c(s.max(axis=1))
    e = jnp.exp2(times_c(s) - rows(finite(m_t)))
    to_base2 = lambda x: x
  m_new = jnp.maximum(m, m_t)
  m_ref = finite(m_new)
  a_prev = jnp.exp2(to_base2(m - m_ref))
  a_cur = jnp.exp2(to_base2(m_t - m_ref))
  _, p_op = _floor_to_8bit(e * 255.0 + 0.5, 128, by_add=round_p_by_add)
  return p_op, (
      m_new, a_prev * l + a_cur * e.sum(axis=1), a_prev, a_cur)


def _log_sum_exp(m, l, empty, *, pv):
  """The natural-log log-sum-exp of each row's scaled scores from the online
  softmax's state: the running max ``m`` in base 2 and the sum ``l`` of the
  P the kernel formed (in units of 1/448 for fp8 P, 1/127 for int8 P);
  ``-inf`` for a row that saw no key."""
  f32 = jnp.float32
  m = m.astype(f32)
  unit = {"fp8": FP8_MAX, "int8": 127.0}.get(pv, 1.0)
  # (the product rounded on its own: whether the compiler fuses it into
  # the add must not depend on the rest of the kernel, so that kernels
  # with and without masked steps give the same bits)
  lse = (lax.optimization_barrier(m * math.log(2.0))
         + jnp.log(jnp.where(empty, 1.0, l.astype(f32))))
  if unit != 1.0:
    lse = lse - math.log(unit)
  return jnp.where(empty, -jnp.inf, lse)


def _kernel(q_ref, k_ref, v_ref, tile_ref, *refs, qk, pv,
            block_q, block_k, stages, warpgroups, masked_steps, group,
            c_scale, runtime_c, pasa_inva, pasa_running, pasa_state_dtype,
            f16_scores,
            has_shifted, has_segments, has_qk_scales, k_scale_per_block,
            has_qbias, bias_rows, has_vbs, prefetch_block_scales,
            has_colsum, has_epilogue, has_nan_rows, p_in_smem, fused_pv,
            out_dtype,
            exact_exponent, runtime_exponent, return_lse, return_row_amax,
            fresh_accumulators, round_p_by_add):
  """Refs: q ``[B, T, N, D]``, k ``[B, S, K, D]``, v ``[B, S, K, D]`` (16-bit
  PV) or ``[B, K, D, S]`` (8-bit PV); tile_ref int32 ``[B * T_pad /
  (W block_q), 2 + 4 W]`` (W = ``warpgroups``), one row per query tile,
  read by every head's CTA
  (:func:`tile_table`); key_range_ref int32 ``[B, 2, T_pad]``, the first and
  last key each row sees (:func:`common.row_key_ranges`); with
  ``runtime_exponent`` int32 ``[1]``, nonzero for the exact exponent (both
  forms are compiled and the consumers branch on it; else the static
  ``exact_exponent`` picks one); with ``runtime_c`` float32 ``[1]``, the
  exponent's factor read at run time in place of ``c_scale``; optional
  segment
  ids ``[B, T]`` and ``[B, S]`` int32; optional
  q_scale ``[B, N, T]`` and k_scale float32 (8-bit QK), ``[B, K, S]`` or
  with ``k_scale_per_block`` ``[B, K, ceil(S / block_k)]``;
  optional qbias ``[B, N, nqb, S]`` float32 (a base-2 score bias shared by
  each ``bias_rows`` query rows); optional v_block_scale ``[B, K, nb]``;
  optional PASA block weights ``[B, K, nb]`` float32; optional V column
  sums ``[B, K, nb, D]`` int32 (``pv="uint8"``); optional out_scale,
  out_shift ``[B, K, D]`` float32; optional NaN rows ``[B, N, T]`` float32
  (1: the row is NaN); out ``[B, T, N, D]``;
  with ``return_lse`` lse ``[B, N, T]`` float32; with ``return_row_amax``
  each output row's ``max |O|`` ``[B, N, T]`` float32.
  ``c_scale``: the factor from the scores to the exponent's base 2 where
  no ``q_scale`` gives it.  ``pasa_inva``: k holds PASA's shifted keys and
  this is ``fl16(beta / (1 - beta))``; None otherwise."""
  refs = list(refs)
  wgs = warpgroups
  producer = wgs > 1   # else the one warpgroup issues its own loads
  key_range_ref = refs.pop(0)
  exact_ref = refs.pop(0) if runtime_exponent else None
  c_ref = refs.pop(0) if runtime_c else None
  qseg_ref, kseg_ref = ((refs.pop(0), refs.pop(0)) if has_segments
                        else (None,) * 2)
  qs_ref, ks_ref = (refs.pop(0), refs.pop(0)) if has_qk_scales else (None,) * 2
  qbias_ref = refs.pop(0) if has_qbias else None
  vbs_ref = refs.pop(0) if has_vbs else None
  shifted_ref = refs.pop(0) if has_shifted else None
  colsum_ref = refs.pop(0) if has_colsum else None
  osc_ref, osh_ref = (refs.pop(0), refs.pop(0)) if has_epilogue else (None,) * 2
  nan_rows_ref = refs.pop(0) if has_nan_rows else None
  out_ref = refs.pop(0)
  lse_ref = refs.pop(0) if return_lse else None
  amax_ref = refs.pop(0) if return_row_amax else None
  bq, bk = block_q, block_k
  head_dim = q_ref.shape[-1]
  eight_bit_pv = pv in ("fp8", "int8", "uint8")
  f32, f16 = jnp.float32, jnp.float16
  pasa = pasa_inva is not None
  pasa_per_block = pasa and not pasa_running   # Algorithm 1's softmax

  def body(scratch, barriers):
    (q_smem2, o_smem2, k_smem, v_smem, p_smem2, ks_smem, qb_smem,
     lse_smem2, amax_smem2) = scratch
    if o_smem2 is None:  # O is written over Q (read by no wgmma by then)
      o_smem2 = q_smem2
    (k_bars, v_bars, q_bars, k_consumed, v_consumed, schedule, ks_bars,
     qb_bars) = barriers
    tile = lax.axis_index("tile")
    batch, q_seq = tile_ref[tile, 0], tile_ref[tile, 1]
    q_head = lax.axis_index("heads")
    kv_head = lax.div(q_head, jnp.int32(group))
    wg = lax.axis_index("wg") if producer else 0
    # a warpgroup's own buffer (one warpgroup's are allocated without the
    # leading axis: a constant index into them does not lower in run_state)
    own = (lambda ref: ref.at[wg]) if producer else (lambda ref: ref)
    tile_base = q_seq * (wgs * bq)
    wg_ranges = [[tile_ref[tile, 2 + 4 * w + c] for c in range(4)]
                 for w in range(wgs)]
    # The CTA streams the union of its warpgroups' key blocks (an empty
    # range is (0, 0, 0, 0): it must not pull tile_lo down to 0).
    tile_hi = functools.reduce(jnp.maximum, [r[3] for r in wg_ranges])
    tile_lo = functools.reduce(jnp.minimum, [
        jnp.where(hi > lo, lo, tile_hi) for lo, *_, hi in wg_ranges])
    tile_steps = tile_hi - tile_lo

    def slot_of(j):  # key block j's ring slot (step j - tile_lo)
      return lax.rem(j - tile_lo, jnp.int32(stages))

    def schedule_barrier():
      if producer:   # (one warpgroup has no sibling to take turns with)
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    def load_k(u, slot):  # step u: key block tile_lo + u, with its rows
      j = tile_lo + u
      plgpu.copy_gmem_to_smem(
          k_ref.at[batch, pl.ds(j * bk, bk), kv_head], k_smem.at[slot],
          k_bars.at[slot])
      if has_qk_scales and not k_scale_per_block:
        plgpu.copy_gmem_to_smem(ks_ref.at[batch, kv_head, pl.ds(j * bk, bk)],
                                ks_smem.at[slot], ks_bars.at[slot])
      if has_qbias:  # the tile's rows lie in one bias block
        plgpu.copy_gmem_to_smem(
            qbias_ref.at[batch, q_head,
                         lax.div(tile_base, jnp.int32(bias_rows)),
                         pl.ds(j * bk, bk)],
            qb_smem.at[slot], qb_bars.at[slot])

    def load_v(u, slot):
      j = tile_lo + u
      v_src = (v_ref.at[batch, kv_head, :, pl.ds(j * bk, bk)] if eight_bit_pv
               else v_ref.at[batch, pl.ds(j * bk, bk), kv_head])
      plgpu.copy_gmem_to_smem(v_src, v_smem.at[slot], v_bars.at[slot])

    def first_loads():   # the ring's first fill
      for st in range(stages):
        @pl.when(st < tile_steps)
        def _():
          load_k(jnp.int32(st), st)
          load_v(jnp.int32(st), st)

    def release(j, consumed, load):
      """Block j's K (or V) slot is read: the producer may refill it, or,
      without one, the warpgroup loads block ``j + stages`` into it once
      all its warps are past their reads."""
      slot = slot_of(j)
      if producer:
        plgpu.barrier_arrive(consumed.at[slot])
        return
      plgpu.commit_smem()

      @pl.when(j + stages < tile_hi)
      def _():
        load(j + stages - tile_lo, slot)

    def _consumer():
      if producer:
        plgpu.set_max_registers(232, action="increase")
      q_smem, o_smem = own(q_smem2), own(o_smem2)
      p_smem = own(p_smem2) if p_smem2 is not None else None
      q_base = tile_base + wg * bq
      # this warpgroup's (lo, full_lo, full_hi, hi); an empty range becomes
      # [tile_lo, tile_lo), so that it only drains
      lo, full_lo, full_hi, hi = (
          jnp.maximum(tile_ref[tile, 2 + 4 * wg + c], tile_lo)
          for c in range(4))
      plgpu.copy_gmem_to_smem(q_ref.at[batch, pl.ds(q_base, bq), q_head],
                              q_smem, own(q_bars))
      if not producer:
        first_loads()
      row_layout = plgpu.Layout.WGMMA.reduce(1)
      col_layout = plgpu.Layout.WGMMA.reduce(0)
      if has_qk_scales:
        q_scale = plgpu.load(qs_ref.at[batch, q_head, pl.ds(q_base, bq)],
                             layout=row_layout, optimized=False)
        if not has_qbias:  # the softmax's factor, > 0: an all-zero row's 0
          # becomes tiny, which leaves its scores at 0
          q_scale = jnp.maximum(q_scale, np.float32(np.finfo(np.float32).tiny))
      # each row's first and last key: a masked block is two compares
      first_key, last_key = (
          plgpu.load(key_range_ref.at[batch, c, pl.ds(q_base, bq)],
                     layout=row_layout, optimized=False) for c in range(2))
      if has_segments:
        q_seg = plgpu.load(qseg_ref.at[batch, pl.ds(q_base, bq)],
                           layout=row_layout, optimized=False)
      stat = jnp.dtype(pasa_state_dtype) if pasa_per_block else f32
      row = lambda x, dt=stat: plgpu.layout_cast(jnp.full((bq,), x, dt),
                                                 row_layout)
      m_i, l_i = row(-jnp.inf), row(0.0)
      acc = plgpu.layout_cast(jnp.full((bq, head_dim), 0.0, stat),
                              plgpu.Layout.WGMMA)
      pasa_state = (row(0.0), row(0.0, f32)) if pasa else ()  # F, count
      # the factor from the scores to base 2 where no q_scale gives it: the
      # constant, or read at run time as a row of one value (the form a
      # row of q_scale factors takes: the same products, op for op)
      c_rows = row(0.0, f32) + c_ref[0] if runtime_c else c_scale
      # the factor that takes scores to base 2 in the exponent
      if has_qk_scales and not has_qbias:
        exp_factor = q_scale
      else:
        exp_factor = 1.0 if has_qk_scales else c_rows
      acc_type = jnp.int32 if qk == "int8" else f32
      pv_type = jnp.int32 if pv in ("int8", "uint8") else f32
      plgpu.barrier_wait(own(q_bars))

      def block_loads(j, masked):
        """Block j's values in global memory, loaded here at the start of
        the step so that their latency hides behind the QK wgmma (not where
        they are used, after a wgmma wait), as functions that give them."""
        thunks = {}
        if has_colsum:
          thunks["colsum"] = lambda: plgpu.load(
              colsum_ref.at[batch, kv_head, j], layout=col_layout,
              optimized=False)
        thunks["weight"] = ((lambda: shifted_ref[batch, kv_head, j])
                            if has_shifted else (lambda: None))
        if masked and has_segments:
          thunks["k_seg"] = lambda: plgpu.load(
              kseg_ref.at[batch, pl.ds(j * bk, bk)], layout=col_layout,
              optimized=False)
        return {name: (lambda x=f(): x) for name, f in thunks.items()}

      def block_scales(j):
        """Key block j's K and V scales (float32 0 for those the call has
        not), j clamped into the arrays (the last step loads one past its
        block).  Loaded one step ahead and carried into the next: fp8's
        kernel (one K scale per block) ran about 3% faster end to end."""
        def at(ref):
          return ref[batch, kv_head, jnp.minimum(j, ref.shape[-1] - 1)]
        zero = jnp.float32(0.0)
        return (at(ks_ref) if k_scale_per_block else zero,
                at(vbs_ref) if has_vbs else zero)

      def scores(s, j, masked, loads, k_scale, exact_exponent):
        """Block j's scores ``[bq, bk]`` (base 2 where scaled by q_scale),
        the exponent's factor and the visibility mask; frees K's slot.
        ``loads``: :func:`block_loads`; ``k_scale``: the block's one K
        scale (``k_scale_per_block``)."""
        slot = slot_of(j)
        # Per-key rows (K scales, the smoothing bias) arrive with K by TMA.
        if has_qk_scales and not k_scale_per_block:
          plgpu.barrier_wait(ks_bars.at[slot])
          k_scale = plgpu.load(ks_smem.at[slot], layout=col_layout,
                               optimized=False)
        if has_qbias:
          plgpu.barrier_wait(qb_bars.at[slot])
          qb = plgpu.load(qb_smem.at[slot], layout=col_layout, optimized=False)
        release(j, k_consumed, load_k)
        if k_scale_per_block and not (has_qbias or exact_exponent):
          # One K scale for the block: S_i32 q_scale k_j, with the row
          # factor q_scale k_j > 0 applied by the softmax (no multiply per
          # score; tiny keeps -inf * c at -inf where k_j = 0)
          s = s.astype(f32)
          c = jnp.maximum(q_scale * k_scale,
                          np.float32(np.finfo(np.float32).tiny))
        elif k_scale_per_block and has_qbias:  # one FMA per score with qb
          s = s.astype(f32) * lax.broadcast_in_dim(q_scale * k_scale,
                                                   s.shape, [0])
          c = 1.0
        elif has_qk_scales and not has_qbias:
          # S = (S_i32 k_scale) q_scale, q_scale > 0 applied by the softmax:
          # row max of S_i32 k_scale times q_scale, one FMA per score in the
          # exponent (the exact exponent keeps m in the units of S_i32
          # k_scale, the same in every block)
          s = s.astype(f32) * (k_scale if k_scale_per_block else
                               lax.broadcast_in_dim(k_scale, s.shape, [1]))
          c = q_scale
        elif has_qk_scales:  # S in base 2: the query scale holds scale*log2 e
          s = (s.astype(f32) * lax.broadcast_in_dim(q_scale, s.shape, [0])
               * lax.broadcast_in_dim(k_scale, s.shape, [1]))
          c = 1.0
        else:
          c = c_rows
          if f16_scores:   # S leaves the matmul unit in float16
            s = s.astype(f16).astype(f32)
        if has_qbias:  # SageAttention's smoothing bias q_mean K^T (base 2)
          s = s + lax.broadcast_in_dim(qb, s.shape, [1])
        visible = None
        if masked:
          # A thread's columns are 8 i + its lane's part (two values). The
          # constants 8 i are compared with the row's bounds less that part,
          # so no register holds a column index: compared as whole indices,
          # the 32 distinct columns stayed live through the loop (sage with
          # one warpgroup at D=64: 208 registers against 168, two CTAs per
          # SM instead of three; docs/design.md, "The masked step's
          # registers").
          cols = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1,
                                        layout=plgpu.Layout.WGMMA)
          lane = cols & 7
          eights = cols - lane
          bound = lambda x: lax.broadcast_in_dim(x - j * bk, s.shape, [0])
          visible = ((eights >= bound(first_key) - lane)
                     & (eights <= bound(last_key) - lane))
          if has_segments:
            k_seg = loads["k_seg"]()
            visible = visible & (
                lax.broadcast_in_dim(q_seg, (bq, bk), [0])
                == lax.broadcast_in_dim(k_seg, (bq, bk), [1]))
        return s, c, visible

      def softmax(s, c, visible, m_i, l_i, shift, exact_exponent):
        """The online softmax of one block: P (the PV operand's dtype),
        the new row max and sum, the factor ``alpha`` of the old ones, and
        the block's own rows (PASA's for :func:`_pasa_update`; uint8 P's
        factor ``e^{m_t - m'}`` of its product).  ``shift``: PASA's
        corrections ``(dm'_{j-1}, dm'_j)`` in the units of ``m``, which
        move the old max and the block's (None: none)."""
        if pasa_per_block:
          p, pasa_rows = _pasa_scores(s, visible, block_k=bk,
                                      state_dtype=stat, exp_factor=c)
          return p, (m_i, l_i, None, pasa_rows)
        # PASA: the old max moves by dm'_{j-1}, the block's by dm'_j, and
        # the block's P is taken against the new max less dm'_j
        if shift is not None:
          m_i = m_i + shift[0]
        moved = (lambda m: m) if shift is None else (lambda m: m + shift[1])
        unmoved = (lambda m: m) if shift is None else (lambda m: m - shift[1])
        if visible is not None:
          s = jnp.where(visible, s, -jnp.inf)
        if pv == "uint8":
          return _block_anchored_p(s, c, m_i, l_i, masked=visible is not None,
                                   exact_exponent=exact_exponent,
                                   round_p_by_add=round_p_by_add)

        def finite(m_new):
          """The max the exponents subtract: 0 for a row that has seen no
          key yet (its m stays -inf: no -inf - -inf), only in masked
          steps (every row sees a finite score of an unmasked block,
          unless float16 scores round a whole block to -inf)."""
          if visible is None and not f16_scores:
            return m_new
          return jnp.where(m_new == -jnp.inf, 0.0, m_new)
        if exact_exponent:
          # The running max in the units of s: s - m is exact for the
          # scores near the max (Sterbenz), so a tie gets exactly P = 1
          # however large the scores are, and the factor c comes after.
          # Mosaic GPU allows FMA contraction: without the barrier,
          # s = S_i32 * k_scale fuses into s - m, the max score's exponent
          # is off by up to half an ulp of m again, and at |m| ~ 1e9 P
          # overflows (full INT8 at q = k = 6e4 came out 94% wrong).
          s = lax.optimization_barrier(s)
          m_new = jnp.maximum(m_i, moved(s.max(axis=1)))
          m_ref = finite(m_new)
          e = s - lax.broadcast_in_dim(unmoved(m_ref), s.shape, [0])
          if not isinstance(c, float):   # a row of factors
            alpha = jnp.exp2((m_i - m_ref) * c)
            e = e * lax.broadcast_in_dim(c, s.shape, [0])
          elif c != 1.0:
            alpha = jnp.exp2((m_i - m_ref) * c)
            e = e * c
          else:
            alpha = jnp.exp2(m_i - m_ref)
          p = jnp.exp2(e + LOG2_FP8_MAX if pv == "fp8" else e)
        else:
          m_new = jnp.maximum(m_i, moved(s.max(axis=1) * c))
          m_ref = finite(m_new)
          alpha = jnp.exp2(m_i - m_ref)
          # fp8: P * 448 = exp2(s - (m - log2 448)) (l counts 1/448ths)
          m_exp = unmoved(m_ref)
          if pv == "fp8":
            m_exp = m_exp - LOG2_FP8_MAX
          if not isinstance(c, float):   # a row of factors
            s = s * lax.broadcast_in_dim(c, s.shape, [0])
          elif c != 1.0:
            s = s * c
          p = jnp.exp2(s - lax.broadcast_in_dim(m_exp, s.shape, [0]))
        if pv == "fp8":
          p_op = p.astype(jnp.float8_e4m3fn)
        elif pv == "int8":  # floor(127 p + 1/2)
          p, p_op = _floor_to_8bit(p * 127.0 + 0.5, 0, by_add=round_p_by_add)
        else:
          p_op = p.astype(v_ref.dtype)
        return p_op, (m_new, l_i * alpha + p.sum(axis=1), alpha, None)

      def pv_operands(j, p_op):
        """P as the PV wgmma's A operand and block j's V slot as B."""
        if p_in_smem:
          p_smem[...] = p_op
          plgpu.commit_smem()
          p_op = p_smem
        elif eight_bit_pv:  # V's keys are in KEY_PERMUTATION order
          p_op = _as_8bit_operand(p_op)
        v_op = v_smem.at[slot_of(j)]
        if eight_bit_pv:
          v_op = v_op.transpose((1, 0))   # [D, bk] in memory: K-major B
        return p_op, v_op

      def add_block(state, pv_blk, loads, alpha, block_rows):
        """The state ``(O, m, l, PASA's F)`` after the block's per-block
        ``P V``: ``O * alpha + P V`` (one FMA), or PASA's steps 3-6."""
        if has_colsum:   # uint8 P: (P - 128) V + 128 colsum(V), exact
          colsum = loads["colsum"]()
          pv_blk = pv_blk + lax.broadcast_in_dim(colsum * 128, pv_blk.shape,
                                                 [1])
          pv_blk = pv_blk.astype(f32) * lax.broadcast_in_dim(
              block_rows, pv_blk.shape, [0])
        else:
          pv_blk = pv_blk.astype(f32)
        if has_vbs:  # one V scale per key block
          pv_blk = pv_blk * loads["v_scale"]()
        if pasa_per_block:
          return _pasa_update(state, block_rows, pv_blk, inva=pasa_inva,
                              exp_factor=c_rows,
                              weight=loads["weight"]())
        acc, *rest = state
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0]) + pv_blk
        return (acc, *rest)

      def kv_step(j, carry, masked, exact_exponent):
        # QK, softmax, PV: one block at a time
        acc, m_i, l_i, pasa_state, ahead = carry
        slot = slot_of(j)
        loads = block_loads(j, masked)
        if prefetch_block_scales:   # this step's, loaded in the last one
          k_block, v_scale = ahead
          if has_vbs:
            loads["v_scale"] = lambda: v_scale
          ahead = block_scales(j + 1)
        else:   # no per-block scale
          k_block = None

        def qk_scope(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          schedule_barrier()
          return acc_ref[...]
        if "qk" in fresh_accumulators:
          def qk_state(acc_ref):
            plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
            schedule_barrier()
          s = pl.run_state(qk_state)(plgpu.ACC.init(
              _fresh_accumulator((bq, bk), acc_type)))
        else:
          s = pl.run_scoped(qk_scope, plgpu.ACC((bq, bk), acc_type))
        if pasa_running:   # Sbar': the float32 product's mean, before masks
          s_mean = (s.sum(axis=1) * (1.0 / bk)).astype(stat)
        s, c, visible = scores(s, j, masked, loads, k_block, exact_exponent)
        shift = None
        if pasa_running:   # PASA steps 3-4 move the online softmax's max
          seen = (None if visible is None else
                  jnp.where(visible, 1.0, 0.0).max(axis=1) > 0.0)
          f, count = pasa_state
          f, count, dmp_prev, dmp_cur = _pasa_corrections(
              f, count, s_mean, inva=pasa_inva, weight=loads["weight"](),
              seen=seen)
          pasa_state = (f, count)
          # m is in the units of s with the exact exponent, else base 2
          shift = ((dmp_prev, dmp_cur) if exact_exponent
                   else (dmp_prev * c, dmp_cur * c))
        p_op, (m_new, l_new, alpha, block_rows) = softmax(
            s, c, visible, m_i, l_i, shift, exact_exponent)
        if fused_pv:   # (else one FMA in add_block)
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        if producer:
          plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(v_bars.at[slot])
        if producer:
          plgpu.barrier_wait(schedule)
        p_op, v_op = pv_operands(j, p_op)

        def wait_next_k():
          @pl.when(j + 1 < hi)
          def _():
            plgpu.barrier_wait(k_bars.at[slot_of(j + 1)])

        if fused_pv:   # accumulate in the tensor cores (16-bit P, on the GPU)
          def pv_state(acc_ref):
            plgpu.wgmma(acc_ref, p_op, v_op)
            wait_next_k()
          acc = pl.run_state(pv_state)(plgpu.ACC.init(acc))
        else:          # per-block product, added into the accumulator
          def pv_scope(pv_ref):
            plgpu.wgmma(pv_ref, p_op, v_op)
            wait_next_k()
            return pv_ref[...]
          if "pv" in fresh_accumulators:
            def pv_state(pv_ref):
              plgpu.wgmma(pv_ref, p_op, v_op)
              wait_next_k()
            pv_blk = pl.run_state(pv_state)(plgpu.ACC.init(
                _fresh_accumulator((bq, head_dim), pv_type)))
          else:
            pv_blk = pl.run_scoped(pv_scope,
                                   plgpu.ACC((bq, head_dim), pv_type))
          acc, m_new, l_new, pasa_state = add_block(
              (acc, m_new, l_new, pasa_state), pv_blk, loads, alpha,
              block_rows)
        release(j, v_consumed, load_v)
        return acc, m_new, l_new, pasa_state, ahead

      def drain(j, _):  # blocks the other warpgroup needs and this one not
        slot = slot_of(j)
        plgpu.barrier_wait(k_bars.at[slot])   # (every phase is observed)
        plgpu.barrier_wait(v_bars.at[slot])
        if has_qk_scales and not k_scale_per_block:
          plgpu.barrier_wait(ks_bars.at[slot])
        if has_qbias:
          plgpu.barrier_wait(qb_bars.at[slot])
        plgpu.barrier_arrive(k_consumed.at[slot])
        plgpu.barrier_arrive(v_consumed.at[slot])
        schedule_barrier()
        schedule_barrier()

      # Every step of [tile_lo, tile_hi) in order, each barrier phase
      # observed once: drain, masked, unmasked, masked, drain.
      if producer:
        pl.when(wg == 1)(schedule_barrier)
        lax.fori_loop(tile_lo, lo, drain, None)

      @pl.when(hi > lo)
      def _():
        plgpu.barrier_wait(k_bars.at[slot_of(lo)])

      def own_blocks(exact_exponent):
        """The warpgroup's key blocks, masked, unmasked, masked: O, the
        row max (in base 2 where the log-sum-exp needs it) and l."""
        step = functools.partial(kv_step, exact_exponent=exact_exponent)
        masked_step = functools.partial(step, masked=True)
        ahead = block_scales(lo) if prefetch_block_scales else ()
        if masked_steps:
          carry = lax.fori_loop(lo, full_lo, masked_step,
                                (acc, m_i, l_i, pasa_state, ahead))
          carry = lax.fori_loop(full_lo, full_hi,
                                functools.partial(step, masked=False), carry)
          acc_out, m_out, l_out, *_ = lax.fori_loop(full_hi, hi, masked_step,
                                                    carry)
        else:   # every row sees every key of [lo, hi): no masked step in
          # the kernel, whose registers it would otherwise set
          acc_out, m_out, l_out, *_ = lax.fori_loop(
              lo, hi, functools.partial(step, masked=False),
              (acc, m_i, l_i, pasa_state, ahead))
        if return_lse and exact_exponent:  # m is in the units of s
          m_out = (m_out.astype(f32) * exp_factor).astype(m_out.dtype)
        return acc_out, m_out, l_out

      if runtime_exponent:   # (uniform: every thread reads the same flag)
        acc, m_i, l_i = lax.cond(exact_ref[0] != 0,
                                 functools.partial(own_blocks, True),
                                 functools.partial(own_blocks, False))
      else:
        acc, m_i, l_i = own_blocks(exact_exponent)
      if producer:
        lax.fori_loop(hi, tile_hi, drain, None)
        pl.when(wg == 0)(schedule_barrier)

      empty = l_i == 0.0
      # (with P * 448 folded into the exponent, l is in units of 1/448)
      l_unit = FP8_MAX if pv == "fp8" else 1.0
      inv_l = l_unit / jnp.where(empty, 1.0, l_i.astype(f32))
      out = acc.astype(f32) * lax.broadcast_in_dim(inv_l, acc.shape, [0])
      if has_epilogue:
        osc = plgpu.load(osc_ref.at[batch, kv_head], layout=col_layout,
                         optimized=False)
        osh = plgpu.load(osh_ref.at[batch, kv_head], layout=col_layout,
                         optimized=False)
        out = (out * lax.broadcast_in_dim(osc, out.shape, [1])
               + lax.broadcast_in_dim(osh, out.shape, [1]))
      out = jnp.where(lax.broadcast_in_dim(empty, out.shape, [0]), 0.0, out)
      if has_nan_rows:   # the rows a NaN/Inf input reaches
        nan_row = plgpu.load(
            nan_rows_ref.at[batch, q_head, pl.ds(q_base, bq)],
            layout=row_layout, optimized=False)
        out = jnp.where(lax.broadcast_in_dim(nan_row > 0.0, out.shape, [0]),
                        jnp.nan, out)
      out = out.astype(out_dtype)
      o_smem[...] = out
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(o_smem,
                              out_ref.at[batch, pl.ds(q_base, bq), q_head])
      if return_lse:
        lse_smem = own(lse_smem2)
        lse_smem[...] = _log_sum_exp(m_i, l_i, empty, pv=pv)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_smem,
                                lse_ref.at[batch, q_head, pl.ds(q_base, bq)])
      if return_row_amax:   # (the 8-bit FMHA's output scale, without a
        # pass over O)
        amax_smem = own(amax_smem2)
        amax_smem[...] = jnp.abs(out.astype(f32)).max(axis=1)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(amax_smem,
                                amax_ref.at[batch, q_head, pl.ds(q_base, bq)])
      plgpu.wait_smem_to_gmem(0)

    def _producer():
      plgpu.set_max_registers(40, action="decrease")
      first_loads()

      @pl.loop(stages, jnp.maximum(tile_steps, stages))
      def _(u):
        slot = lax.rem(u, jnp.int32(stages))
        plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.barrier_wait(v_consumed.at[slot])
        load_k(u, slot)
        load_v(u, slot)

      @pl.loop(jnp.maximum(tile_steps - stages, 0), tile_steps)
      def _(u):  # the last uses of each slot (every phase is observed)
        slot = lax.rem(u, jnp.int32(stages))
        plgpu.barrier_wait(k_consumed.at[slot])
        plgpu.barrier_wait(v_consumed.at[slot])

    if producer:
      pl.when(wg < wgs)(_consumer)
      pl.when(wg == wgs)(_producer)
    else:
      _consumer()

  q_dtype, k_dtype, v_dtype = q_ref.dtype, k_ref.dtype, v_ref.dtype
  v_tile = (head_dim, bk) if eight_bit_pv else (bk, head_dim)
  p_dtype = {"fp8": jnp.float8_e4m3fn, "int8": jnp.int8,
             "uint8": jnp.int8}.get(pv, v_dtype)
  per_wg = (wgs,) if producer else ()
  scratch = [
      _smem((*per_wg, bq, head_dim), q_dtype),
      (_smem((*per_wg, bq, head_dim), out_dtype) if out_dtype != q_dtype
       else None),
      _smem((stages, bk, head_dim), k_dtype),
      _smem((stages, *v_tile), v_dtype),
      _smem((*per_wg, bq, bk), p_dtype) if p_in_smem else None,
      (plgpu.SMEM((stages, bk), jnp.float32)
       if has_qk_scales and not k_scale_per_block else None),
      plgpu.SMEM((stages, bk), jnp.float32) if has_qbias else None,
      plgpu.SMEM((*per_wg, bq), jnp.float32) if return_lse else None,
      plgpu.SMEM((*per_wg, bq), jnp.float32) if return_row_amax else None,
  ]
  barriers = (
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=wgs) if producer else plgpu.Barrier(),
      plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
      plgpu.Barrier(num_arrivals=wgs, num_barriers=stages),
      plgpu.Barrier(num_arrivals=wgs),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=stages),
  )
  pl.run_scoped(lambda sc, *bars: body(sc, bars), scratch, *barriers,
                **(dict(collective_axes="wg") if producer else {}))


def tile_table(ranges, *, warpgroups: int = 2):
  """int32 ``[B * T_pad / (W block_q), 2 + 4 W]``, one row per query tile
  (read by every head's CTA): its batch row, its tile (``W block_q`` rows,
  ``W = warpgroups``) and its warpgroups' key-block ranges
  (:func:`common.block_ranges`, ``ranges`` ``[B, T_pad / block_q, 4]``).

  The rows are ordered by the key blocks their warpgroups compute, most
  first (a stable sort): the hardware hands each next CTA to the first SM
  that frees up, so the short tiles (causal's first rows, short documents)
  fill the last wave (a longest-first list schedule)."""
  b, n_row_blocks, _ = ranges.shape
  tiles = n_row_blocks // warpgroups
  ranges = ranges.reshape(b, tiles, 4 * warpgroups)
  index = lambda axis: lax.broadcasted_iota(jnp.int32, (b, tiles, 1), axis)
  table = jnp.concatenate([index(0), index(1), ranges], axis=-1).reshape(
      b * tiles, 2 + 4 * warpgroups).astype(jnp.int32)
  blocks = sum(ranges[..., 4 * w + 3] - ranges[..., 4 * w]
               for w in range(warpgroups)).reshape(b * tiles)
  return table[jnp.argsort(-blocks, stable=True)]


@functools.partial(jax.jit, static_argnames=(
    "t", "s_len", "is_causal", "t_pad", "s_pad", "block_q", "block_k",
    "warpgroups"))
def _index_tables(kv_lens, index_mask, *, t, s_len, is_causal, t_pad,
                  s_pad, block_q, block_k, warpgroups):
  """``(bounds, tile table, segment ids)`` of a call
  (:func:`common.index_operands`, :func:`tile_table`), jitted as one: where
  every input is known at trace time the caller runs it then, as one
  executable (evaluated op by op, each of its ~50 small ops was compiled
  for the GPU: 2.2 s of a first call on the H200)."""
  bounds, ranges, segments = common.index_operands(
      kv_lens, index_mask, t=t, s=s_len, is_causal=is_causal, t_pad=t_pad,
      s_pad=s_pad, block_q=block_q, block_k=block_k, has_mask=False)
  return bounds, tile_table(ranges, warpgroups=warpgroups), segments


def _grid(heads: int, tiles: int) -> dict:
  """The kernel's grid over (head, row of :func:`tile_table`), the
  faster-varying axis first (x: launched first; y is limited to 65535).
  The heads vary fastest, so the CTAs of one query tile run together for
  every head: measured faster on the H100 than one head's tiles together,
  although those share K and V in L2."""
  if tiles <= 65535:
    return dict(grid=(heads, tiles), grid_names=("heads", "tile"))
  return dict(grid=(tiles, heads), grid_names=("tile", "heads"))


def mosaic_attention(q, k, v, kv_lens, *, qk, pv, is_causal, params=None,
                     scale=None, q_scale=None, k_scale=None,
                     k_block_scale=None, q_block_bias=None,
                     bias_rows=None, v_block_scale=None, v_colsum=None,
                     out_scale=None,
                     out_shift=None, pasa_inva=None,
                     pasa_state_dtype=jnp.float16, pasa_exp_scale=1.0,
                     pasa_shifted=None, pasa_running=False,
                     pasa_exp_factor=None,
                     f16_scores=False, v_keys_ordered=False,
                     out_dtype=jnp.float16, exact_exponent=False,
                     return_lse=False, return_row_amax=False,
                     index_mask=None, nan_rows=None):
  """Runs the kernel on BTNH inputs.

  Args:
    q: ``[B, T, N, D]``; k: ``[B, S, K, D]`` (float16/bfloat16 for
      ``qk="fp16"``, int8 or float8_e4m3fn otherwise); v: ``[B, S, K, D]``
      float16/bfloat16 (``pv="fp16"``) or ``[B, K, D, S]`` float8_e4m3fn /
      int8 (``pv="fp8"`` / ``"int8"``, ``"uint8"``); kv_lens int32 ``[B]``,
      or None for every key: a non-causal call with no index mask and S a
      multiple of the key block then compiles no masked step.
    scale: the softmax scale (``qk="fp16"``); q_scale ``[B, T, N]`` (times
      ``scale * log2 e``) and k_scale ``[B, S, K]`` float32 for 8-bit QK,
      or instead of k_scale one K scale per key block, k_block_scale
      ``[B, K, ceil(S / block_k)]`` (per-block and per-tensor K scales,
      finite and >= 0 like every K scale here): the row factor ``q_scale
      k_j`` then multiplies the block's scores once, where per-key scales
      cost a multiply per score and a shared-memory row per block.
    q_block_bias: float32 ``[B, N, ceil(T / bias_rows), S]``, a base-2
      score bias shared by each block of ``bias_rows`` query rows (a multiple
      of ``block_q``), or None.
    v_block_scale: float32 ``[B, K, S / block_k]`` or None.
    v_colsum: int32 ``[B, K, ceil(S / block_k), D]``, the column sums of
      each int8 V block (``pv="uint8"`` only, which needs them).
    out_scale, out_shift: float32 ``[B, K, D]`` or None.
    pasa_inva: PASA's ``fl16(beta / (1 - beta))``: k then holds the shifted,
      scaled float16 keys (PASA's per-block shift, done by the caller) and
      the softmax runs PASA's steps 1-6 (``qk = pv = "fp16"``, float16
      only) with the state in ``pasa_state_dtype`` (float16: Algorithm 1).
    pasa_exp_scale: the softmax scale over the keys' factor (PASA).
    pasa_exp_factor: None, or a float32 scalar array, a power of two, by
      which ``pasa_exp_scale`` is multiplied at run time (PASA's ``1 /
      p`` for the keys' factor ``p`` chosen per call on the device;
      ``pasa_exp_scale`` is then the softmax scale): the kernel reads the
      exponent's factor ``fl32(pasa_exp_scale log2 e) * pasa_exp_factor``
      (exact, the factor a power of two) from an operand, one compiled
      kernel for any factor, the same products as with the constant.
    pasa_running: PASA's softmax in FlashAttention-2's form (needs the
      float32 state; :attr:`jaxattn.pasa.PasaConfig.online_softmax`).
    f16_scores: ``S`` rounded to float16 as it leaves the matmul
      (``qk="fp16"``; the ``fp16_fp32`` method; implied by ``pasa_running``).
    pasa_shifted: float32 ``[B, K, S_pad / block_k]``, 1 for a shifted key
      block and 0 for one the adaptive shift left, or None (PASA).
    exact_exponent: the exponent as ``(s - m) * c`` (exact for the scores
      near the row max however large they are; one more instruction per
      score) instead of the fused ``s * c - m``; needed where
      ``|s * c|`` may exceed :data:`FUSED_EXPONENT_LIMIT`.  A bool
      array (a scalar) picks at run time: the kernel holds both forms and
      branches on it, so a caller that decides from the data needs no
      ``lax.cond``, whose predicate the host would wait for.
    v_keys_ordered: the 8-bit V's keys are already in
      :func:`pallas_kernels.quantizers.key_order`
      (the quantizer wrote them so); otherwise they are permuted here when P
      comes from registers.
    return_lse: also return the natural-log log-sum-exp of each row's
      scaled scores as the online softmax formed them (float32 ``[B, N,
      T]``, ``-inf`` for a row that sees no key; not with PASA).
    return_row_amax: also return each output row's largest magnitude
      (float32 ``[B, N, T]``, of the values written), so that a
      per-tensor output scale needs no pass over O.
    index_mask: query lengths, alignment, local window and segment ids
      (:class:`common.IndexMask`), or None.  Each warpgroup skips the key
      blocks none of its rows sees and masks only the blocks some row sees
      in part.
    nan_rows: bool ``[B, T, N]`` or None: the output rows written as NaN
      (those a NaN/Inf input reaches: :mod:`jaxattn.nonfinite`), in the
      epilogue instead of a pass over the output afterwards.
  Returns: ``[B, T, N, D]`` in ``out_dtype``, or a tuple of it and, in
  this order, the log-sum-exp and the row amax, where asked for.

  A head dim below 64, or between 64 and 128, is zero-padded to the next
  of :data:`HEAD_DIMS`: zero channels add nothing to ``Q K^T`` and give
  output channels that are dropped, so the result is unchanged.
  """
  b, t, n, d = q.shape
  s_len, nk = k.shape[1], k.shape[2]
  all_keys = kv_lens is None
  if d > HEAD_DIMS[-1]:
    raise ValueError(f"the Mosaic kernel takes head dims up to "
                     f"{HEAD_DIMS[-1]}, got {d}")
  d_tile = next(x for x in HEAD_DIMS if x >= d)
  if qk not in QK_TYPES or pv not in PV_TYPES:
    raise ValueError(f"qk must be one of {QK_TYPES} and pv one of "
                     f"{PV_TYPES}, got {qk!r}, {pv!r}")
  params = params or MosaicParams()
  bq, bk = params.block_q, params.block_k
  masked_steps = has_masked_steps(all_keys, is_causal, index_mask, s_len,
                                  bk)
  wgs = (default_warpgroups(
      qk, pv, d_tile, pasa=pasa_inva is not None,
      segments=index_mask is not None and index_mask.has_segments)
         if params.warpgroups is None else params.warpgroups)
  if wgs not in (1, 2):
    raise ValueError(f"warpgroups must be 1 or 2, got {wgs}")
  t_pad = common.round_up(t, wgs * bq)
  s_pad = common.round_up(s_len, bk)
  pad = common.pad_axis
  q, k = pad(pad(q, 1, t_pad), 3, d_tile), pad(pad(k, 1, s_pad), 3, d_tile)
  interp = interpret()
  # P feeds the PV wgmma from registers on the GPU (8-bit P with V's keys
  # permuted, see _as_8bit_operand); in the interpreter it goes through
  # shared memory.
  p_in_smem = not p_in_registers()
  if v_keys_ordered and (p_in_smem or pv == "fp16"):
    raise ValueError("V's keys are in the register-operand order, but P "
                     "goes through shared memory (or is 16-bit)")
  if pv == "fp16":
    v = pad(pad(v, 1, s_pad), 3, d_tile)
  else:
    v = pad(pad(v, 3, s_pad), 2, d_tile)
    v = v if p_in_smem or v_keys_ordered else permute_keys(v, axis=3)
  # Without key lengths or traced index arrays the tile table is known at
  # trace time: a constant, instead of a sort and its small kernels on
  # every call.
  if all_keys:
    kv_lens = np.full((b,), s_len, np.int32)
  known = not any(isinstance(x, jax.core.Tracer)
                  for x in jax.tree.leaves((kv_lens, index_mask)))
  with jax.core.eval_context() if known else contextlib.nullcontext():
    bounds, table, segments = _index_tables(
        kv_lens, index_mask, t=t, s_len=s_len, is_causal=is_causal,
        t_pad=t_pad, s_pad=s_pad, block_q=bq, block_k=bk, warpgroups=wgs)
  args = [q, k, v, table, common.row_key_ranges(bounds, t_pad=t_pad)]
  runtime_exponent = not isinstance(exact_exponent, (bool, np.bool_))
  if runtime_exponent:
    exact_exponent = jnp.asarray(exact_exponent)
    if exact_exponent.shape or exact_exponent.dtype != jnp.bool_:
      raise ValueError(f"exact_exponent is a bool or a bool scalar array, "
                       f"got {exact_exponent.dtype}{exact_exponent.shape}")
    args.append(exact_exponent.astype(jnp.int32).reshape(1))
  runtime_c = pasa_exp_factor is not None
  if runtime_c:
    if pasa_inva is None:
      raise ValueError("pasa_exp_factor is PASA's (pasa_inva)")
    args.append((np.float32(float(pasa_exp_scale) * LOG2E)
                 * jnp.asarray(pasa_exp_factor, jnp.float32)).reshape(1))
  args += segments
  has_qk_scales = qk != "fp16"
  if has_qk_scales and (k_scale is None) == (k_block_scale is None):
    raise ValueError("8-bit QK takes k_scale or k_block_scale (one of them)")
  if not has_qk_scales and not (q_scale is k_scale is k_block_scale is None):
    raise ValueError("qk='fp16' takes the softmax scale, not q/k scales")
  if has_qk_scales:
    args.append(pad(q_scale.astype(jnp.float32), 1, t_pad).transpose(0, 2, 1))
    if k_scale is not None:
      args.append(pad(k_scale.astype(jnp.float32), 1, s_pad).transpose(0, 2, 1))
    else:
      if k_block_scale.shape != (b, nk, -(-s_len // bk)):
        raise ValueError(f"k_block_scale must be [B, K, ceil(S / block_k)] = "
                         f"{(b, nk, -(-s_len // bk))}, got "
                         f"{k_block_scale.shape}")
      args.append(k_block_scale.astype(jnp.float32))
  if q_block_bias is not None:
    if bias_rows % (wgs * bq):
      raise ValueError(f"bias_rows={bias_rows} must be a multiple of the "
                       f"tile's {wgs * bq} rows")
    args.append(pad(pad(q_block_bias.astype(jnp.float32), 3, s_pad), 2,
                    -(-t_pad // bias_rows)))
  if v_block_scale is not None:
    args.append(pad(v_block_scale.astype(jnp.float32), 2, s_pad // bk))
  if (v_colsum is not None) != (pv == "uint8"):
    raise ValueError("pv='uint8' takes the V column sums (v_colsum), and "
                     "only it")
  if pasa_shifted is not None:
    if pasa_shifted.shape != (b, nk, s_pad // bk):
      raise ValueError(f"pasa_shifted must be [B, K, S_pad / block_k] = "
                       f"{(b, nk, s_pad // bk)}, got {pasa_shifted.shape}")
    args.append(pasa_shifted.astype(jnp.float32))
  if v_colsum is not None:
    args.append(pad(pad(v_colsum.astype(jnp.int32), 2, s_pad // bk), 3,
                    d_tile))
  has_epilogue = out_scale is not None
  if has_epilogue:
    args += [pad(x.astype(jnp.float32), 2, d_tile)
             for x in (out_scale, out_shift)]
  if nan_rows is not None:
    args.append(pad(nan_rows.astype(jnp.float32), 1, t_pad).transpose(0, 2, 1))
  pasa = pasa_inva is not None
  if pasa_running and not (pasa and jnp.dtype(pasa_state_dtype)
                           == jnp.float32):
    raise ValueError("pasa_running takes PASA (pasa_inva) with the float32 "
                     "state")
  if f16_scores and qk != "fp16":
    raise ValueError("f16_scores rounds 16-bit products (qk='fp16')")
  if pasa and return_lse:
    raise ValueError("the PASA kernel does not return the log-sum-exp")
  if pasa and not (qk == pv == "fp16" and q.dtype == k.dtype == v.dtype
                   == jnp.float16):
    raise ValueError("the PASA kernel takes float16 Q, K', V (qk=pv='fp16')")
  k_scale_per_block = has_qk_scales and k_block_scale is not None
  kernel = functools.partial(
      _kernel, qk=qk, pv=pv, block_q=bq, block_k=bk,
      stages=params.stages, warpgroups=wgs, masked_steps=masked_steps,
      group=n // nk,
      c_scale=float(pasa_exp_scale if pasa else scale or 1.0) * LOG2E,
      runtime_c=runtime_c,
      pasa_inva=float(pasa_inva) if pasa else None,
      pasa_running=bool(pasa_running),
      pasa_state_dtype=jnp.dtype(pasa_state_dtype).name,
      f16_scores=bool(f16_scores or pasa_running),
      has_shifted=pasa_shifted is not None, has_segments=bool(segments),
      has_qk_scales=has_qk_scales,
      k_scale_per_block=k_scale_per_block,
      has_qbias=q_block_bias is not None, bias_rows=bias_rows,
      has_vbs=v_block_scale is not None,
      prefetch_block_scales=k_scale_per_block or v_block_scale is not None,
      has_colsum=v_colsum is not None,
      has_epilogue=has_epilogue, has_nan_rows=nan_rows is not None,
      p_in_smem=p_in_smem,
      fused_pv=(pv == "fp16" and not p_in_smem
                and not (pasa and not pasa_running)),
      out_dtype=out_dtype,
      exact_exponent=None if runtime_exponent else bool(exact_exponent),
      runtime_exponent=runtime_exponent, return_lse=return_lse,
      return_row_amax=return_row_amax,
      # the 8-bit products accumulate into registers zeroed next to their
      # wgmma (:func:`_fresh_accumulator`); float16 S measured no faster so
      fresh_accumulators=() if p_in_smem else tuple(
          x for x in ("qk", "pv") if (qk if x == "qk" else pv) != "fp16"),
      # integer P rounded by one float add (:func:`_floor_to_8bit`), which
      # the interpreter cannot run (inline PTX)
      round_p_by_add=interp is None)
  row_outputs = int(return_lse) + int(return_row_amax)
  out_type = (jax.ShapeDtypeStruct((b, t_pad, n, d_tile), out_dtype),
              *[jax.ShapeDtypeStruct((b, n, t_pad), jnp.float32)]
              * row_outputs)
  outs = plgpu.kernel(
      kernel,
      out_type=out_type if row_outputs else out_type[0],
      **_grid(n, b * t_pad // (wgs * bq)),
      **(dict(num_threads=wgs + 1, thread_name="wg") if wgs > 1 else {}),
      compiler_params=plgpu.CompilerParams(approx_math=True),
      interpret=interp,
  )(*args)
  if not row_outputs:
    return outs[:, :t, :, :d]
  return (outs[0][:, :t, :, :d], *[x[:, :, :t] for x in outs[1:]])


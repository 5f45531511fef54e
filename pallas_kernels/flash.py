"""Flash-attention forward kernel (Pallas, Triton lowering) with static
precision flags: ``"fp32"``, ``"fp16_fp32"``, ``"fp16"`` (the precision
allocations of the PASA paper, section 1) and ``"pasa"`` (PASA's float16
softmax with the online pseudo-average, steps 1-6 of Algorithm 1).

One kernel body, per head and per query block: the precision allocation,
causal masking, an optional bias and mask, and the log-sum-exp output.  Batch
and heads are grid axes indexing the BTNH arrays in place (the equivalent of
vmapping the per-head kernel, without the transposes that ``jax.vmap`` of a
``pallas_call`` costs); query heads of a group share their key/value head
without repeating it.  Lengths are padded outside the kernel to whole blocks
(only when needed); the kernel masks keys at or beyond ``kv_len``, runs the
key blocks every row sees without any mask, and skips the key blocks that no
row of the query block can see (causal, padding).

For ``"pasa"`` the caller passes keys already shifted once per key block by
the shifting matrix and scaled by a factor ``p`` (PASA's batched-GEMM
pre-processing), ``scale`` is ``fl16(beta / (1 - beta))``, the exponent's
factor on ``S'`` is ``pasa_exp_scale = softmax scale / p``, and with the
adaptive shift a 0/1 weight per key block says which blocks were shifted
(an unshifted one adds no ``Sbar'`` to ``F``).  Where ``p`` is chosen per
call on the device, the exponent's factor is a runtime scalar
(``pasa_exp_factor``): one compiled kernel for either choice.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import common
from pallas_kernels.common import LOG2E

PRECISIONS = ("fp32", "fp16_fp32", "fp16", "pasa")

# (precision, head_dim_padded) -> (block_q, block_k, num_warps, num_stages):
# the best of the tile sweep (7928894) on an H100 (B=2 H=32 S=8192 D=128 and
# B=4 H=32 S=4096 D=64); 256 is a guess that fits the registers.
_TABLE = {
    ("fp32", 64): (64, 128, 4, 2),
    ("fp32", 128): (128, 64, 4, 2),
    ("fp32", 256): (64, 32, 8, 2),
    ("pasa", 64): (128, 128, 8, 3),
    ("pasa", 128): (128, 128, 8, 3),
    ("pasa", 256): (32, 128, 8, 2),
}


def default_params(precision: str, head_dim: int) -> common.KernelParams:
  """The tuned block sizes, warps and stages for ``precision`` at
  ``head_dim`` (padded to a power of two, 64 to 256)."""
  # fp16_fp32 is PASA's baseline: the same key blocks, so that where PASA
  # shifts no block the two compute the same arithmetic
  key = "pasa" if precision in ("pasa", "fp16_fp32") else "fp32"
  d = min(max(pl.next_power_of_2(head_dim), 64), 256)
  return common.KernelParams(*_TABLE[(key, d)])


def _flash_kernel(q_ref, k_ref, v_ref, bounds_ref, range_ref, *refs, scale,
                  precision, block_q, block_k, has_segments, has_bias,
                  has_mask, return_lse, state_dtype, pasa_exp_scale,
                  has_shifted, pasa_running, runtime_exp):
  """One query block of one head.

  q_ref ``[block_q, D]``; k_ref, v_ref ``[S_pad, D]`` (PASA: shifted keys);
  bounds_ref ``[4]`` int32 (:func:`common.row_bounds`); range_ref ``[4]``
  int32, this block's key blocks (:func:`common.block_ranges`); optional
  segment ids ``[block_q]`` and ``[S_pad]`` int32, bias ``[block_q, S_pad]``
  float32 and mask ``[block_q, S_pad]`` int8, PASA's block weights
  ``[S_pad / block_k]`` float32; outputs o ``[block_q, D]`` and optionally
  lse ``[block_q]`` float32 (natural log).  For PASA ``scale`` is
  ``beta / (1 - beta)`` (the softmax scale is folded into the keys) and
  ``state_dtype`` is the dtype of its ``m, l, O, F, Sbar'`` (float16 is
  Algorithm 1; ``S'`` and ``P`` are float16 either way); ``pasa_running``:
  its online softmax in FlashAttention-2's form (``"fp16_fp32"``'s code,
  the running max moved by PASA's corrections), else Algorithm 1's.
  ``runtime_exp``: PASA's exponent constants come from a float32 ``[4]``
  operand after ``range_ref`` (:func:`_pasa_exp_constants`) instead of
  ``pasa_exp_scale``.
  """
  refs = list(refs)
  exp_ref = refs.pop(0) if runtime_exp else None
  qseg_ref, kseg_ref = ((refs.pop(0), refs.pop(0)) if has_segments
                        else (None, None))
  bias_ref = refs.pop(0) if has_bias else None
  mask_ref = refs.pop(0) if has_mask else None
  shifted_ref = refs.pop(0) if has_shifted else None
  o_ref = refs.pop(0)
  lse_ref = refs.pop(0) if return_lse else None
  f32, f16 = jnp.float32, jnp.float16
  is_pasa = precision == "pasa"
  running = is_pasa and pasa_running
  stat = {"fp16": f16, "pasa": jnp.dtype(state_dtype)}.get(precision, f32)
  # "fp32"/"fp16_fp32" and PASA's running form work in base 2 with
  # scale*log2(e) applied in the FMA of exp2(s * c - m); "fp16" and PASA's
  # Algorithm 1 mirror their references op for op.
  base2 = precision in ("fp32", "fp16_fp32") or running
  # the factor from the scores (PASA: S', in units of the keys' factor) to
  # the exponent's argument, natural log
  s_unit = pasa_exp_scale if is_pasa else scale
  # the constants derived from it: the base-2 factor, its inverse for a
  # bias, and PASA's log-sum-exp factors (Python floats, or read from the
  # operand: the same float32 values)
  if runtime_exp:
    c_exp, inv_unit, lse_running, lse_unit = (exp_ref[x] for x in range(4))
  else:
    c_exp, inv_unit, lse_running, lse_unit = _pasa_exp_constants(
        s_unit, scale) if is_pasa else (s_unit * LOG2E, 1.0 / s_unit, None,
                                         None)
  i = pl.program_id(0)
  bounds = tuple(bounds_ref[c] for c in range(4))
  q = q_ref[...]
  q_seg = qseg_ref[...] if has_segments else None
  dv = o_ref.shape[-1]

  def div(a, b):  # correctly rounded (no float16 division in Triton)
    return (a.astype(f32) / b.astype(f32)).astype(a.dtype)

  # exp(scale / p * x), as jaxattn.pasa.pasa_head takes it (as
  # common.exp_f32: exp2(x fl(scale / p log2 e)))
  exp_pasa = lambda x: jnp.exp2(x.astype(f32) * c_exp)

  def corrections(j, s_mean, seen, f, count):
    """PASA steps 3-4 (:func:`jaxattn.pasa.pasa_head`): the new ``F`` and
    block count and ``dm'_{j-1}, dm'_j``; a row that sees no key of the
    block (``seen`` False; None: every row sees one) keeps ``F``."""
    inva = jnp.asarray(scale, stat)
    moved = seen
    if has_shifted:   # an unshifted block adds no Sbar' to F
      shifted = shifted_ref[j] > 0.0
      moved = shifted if moved is None else moved & shifted
      s_in_f = jnp.where(shifted, s_mean, 0.0).astype(stat)
    else:
      s_in_f = s_mean
    if moved is None:
      jn = count + 1
      f_new = div((jn - 1).astype(stat) * f + s_mean, jn.astype(stat))
    else:
      jn = count + moved.astype(jnp.int32)
      f_new = jnp.where(moved, div((jn - 1).astype(stat) * f + s_mean,
                                   jnp.maximum(jn, 1).astype(stat)), f)
    return f_new, jn, inva * (f - f_new), inva * (s_in_f - f_new)

  def body(j, carry, masked):
    m, l, o, f, count = carry
    ks = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
    s = lax.dot_general(q, k_ref[ks, :], (((1,), (1,)), ((), ())),
                        preferred_element_type=f32)
    if is_pasa:
      s_mean = (jnp.sum(s, axis=1) / block_k).astype(stat)
    if precision != "fp32":
      s = s.astype(f16)  # the score matrix leaves the matmul unit in fp16
    if precision == "fp16":
      s = s * jnp.asarray(scale, f16)
    elif not is_pasa or running:
      s = s.astype(f32)
    if has_bias:
      b = bias_ref[:, ks]
      if base2:
        b = b * inv_unit
      elif is_pasa and (runtime_exp or pasa_exp_scale != 1.0):
        b = b * inv_unit           # S' is in units of p
      s = s + b.astype(s.dtype)
    visible = None
    if masked:
      rows, cols = common.block_indices(i, j, block_q, block_k)
      visible = common.visible(
          rows, cols, bounds, row_segments=q_seg,
          col_segments=kseg_ref[ks] if has_segments else None,
          mask=mask_ref[:, ks] if has_mask else None)
      s = jnp.where(visible, s, -jnp.inf)
    v = v_ref[ks, :]
    c = c_exp
    if not is_pasa or running:
      if base2:
        s = s * c
        if common.interpret():
          # the interpreter's XLA may recompute s (or contract s * c into
          # the subtraction) differently for the max and the exponent, and
          # at scores ~1e10 one ulp of difference overflows exp2
          s = lax.optimization_barrier(s)
      m_cur = jnp.max(s, axis=1)
      if running:   # PASA: the max moves by its corrections (base 2)
        seen = (None if visible is None
                else jnp.max(visible.astype(jnp.int32), axis=1) > 0)
        f, count, d_prev, d_cur = corrections(j, s_mean, seen, f, count)
        d_prev, d_cur = d_prev * c, d_cur * c
        m_new = jnp.maximum(m + d_prev, m_cur + d_cur)
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        e = jnp.exp2(s - (m_ref - d_cur)[:, None])
        alpha = jnp.exp2((m + d_prev) - m_ref)
      else:
        m_new = jnp.maximum(m, m_cur)
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new).astype(stat)
        if base2:
          e = jnp.exp2(s - m_ref[:, None])
          alpha = jnp.exp2(m - m_ref)
        else:
          e = common.exp_f32(s - m_ref[:, None])
          alpha = common.exp_f32(m - m_ref).astype(stat)
      l = alpha * l + jnp.sum(e, axis=1).astype(stat)
      pv = lax.dot_general(e.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                           preferred_element_type=f32)
      o = alpha[:, None] * o + pv.astype(stat)
      return m_new, l, o, f, count
    # PASA steps 1-6, as jaxattn.pasa.pasa_head.
    m_loc = jnp.max(s, axis=1)
    m_ref = jnp.where(m_loc == -jnp.inf, 0.0, m_loc).astype(f16)
    e = exp_pasa(s.astype(stat) - m_ref.astype(stat)[:, None])
    m_loc = m_loc.astype(stat)
    l_loc = jnp.sum(e, axis=1).astype(stat)
    p = e.astype(f16)
    f_new, jn, dmp_prev, dmp_cur = corrections(j, s_mean, None, f, count)
    m_new = jnp.maximum(m + dmp_prev, m_loc + dmp_cur)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new).astype(stat)
    dm_prev = (m - m_safe) + dmp_prev
    dm_cur = (m_loc - m_safe) + dmp_cur
    e_prev = exp_pasa(dm_prev).astype(stat)
    e_cur = exp_pasa(dm_cur).astype(stat)
    l_new = e_prev * l + e_cur * l_loc
    pv = lax.dot_general(p, v, (((1,), (0,)), ((), ())),
                         preferred_element_type=f32).astype(stat)
    o_new = e_cur[:, None] * pv + e_prev[:, None] * o
    if visible is None:
      return m_new, l_new, o_new, f_new, jn
    seen = jnp.max(visible.astype(jnp.int32), axis=1) > 0
    return (jnp.where(seen, m_new, m), jnp.where(seen, l_new, l),
            jnp.where(seen[:, None], o_new, o), jnp.where(seen, f_new, f),
            jnp.where(seen, jn, count))

  lo, full_lo, full_hi, hi = (range_ref[c] for c in range(4))
  init = (jnp.full((block_q,), -jnp.inf, stat), jnp.zeros((block_q,), stat),
          jnp.zeros((block_q, dv), stat), jnp.zeros((block_q,), stat),
          jnp.zeros((block_q,), jnp.int32))
  masked = functools.partial(body, masked=True)
  carry = lax.fori_loop(lo, full_lo, masked, init)
  carry = lax.fori_loop(full_lo, full_hi,
                        functools.partial(body, masked=False), carry)
  m, l, o, f, _ = lax.fori_loop(full_hi, hi, masked, carry)
  empty = l == 0
  safe_l = jnp.where(empty, 1.0, l).astype(stat)
  out = div(o, safe_l[:, None])
  out = jnp.where(empty[:, None], 0.0, out)
  o_ref[...] = out.astype(o_ref.dtype)
  if return_lse:
    lf = jnp.log(safe_l.astype(f32))
    if running:   # relative to beta F / (1 - beta), as m
      lse = (m.astype(f32) / LOG2E
             + lse_running * f.astype(f32) + lf)
    elif base2:
      lse = m.astype(f32) / LOG2E + lf
    elif is_pasa:
      lse = (lse_unit
             * (m.astype(f32) + jnp.float32(scale) * f.astype(f32)) + lf)
    else:
      lse = m.astype(f32) + lf
    lse_ref[...] = jnp.where(empty, -jnp.inf, lse)


def _pasa_exp_constants(exp_scale: float, inva: float):
  """PASA's constants from the exponent's factor ``exp_scale`` on ``S'``
  (``scale / p``), as float32: ``exp_scale log2 e`` (the base-2 factor),
  ``1 / exp_scale`` (a bias in the units of ``S'``), ``exp_scale inva``
  and ``exp_scale`` (the log-sum-exp's), each rounded once from float64."""
  return tuple(np.float32(x) for x in (
      exp_scale * LOG2E, 1.0 / exp_scale, exp_scale * inva, exp_scale))


def _runtime_exp_constants(exp_scale: float, inva: float, factor):
  """:func:`_pasa_exp_constants` of ``exp_scale * factor`` at run time, for
  a float32 scalar ``factor`` that is a power of two: each static constant
  times ``factor`` (or ``1 / factor``), exact where they stay float32
  normal numbers (:data:`jaxattn.pasa.RUNTIME_FACTOR_SCALES`), so that
  the kernel computes what it would with ``exp_scale * factor`` as its
  constant.  float32 ``[4]``."""
  factor = jnp.asarray(factor, jnp.float32).reshape(())
  c, inv, lse_running, lse_unit = _pasa_exp_constants(exp_scale, inva)
  return jnp.stack([c * factor, inv / factor, lse_running * factor,
                    lse_unit * factor])


def flash_attention(q, k, v, kv_lens, bias=None, mask=None, *, scale,
                    is_causal, precision, params, return_lse=False,
                    state_dtype=jnp.float16, index_mask=None,
                    pasa_exp_scale=1.0, pasa_shifted=None,
                    pasa_running=False, pasa_exp_factor=None):
  """Batched flash attention through the kernel.

  Args:
    q: ``[B, T, N, D]``; k, v: ``[B, S, K, D]`` (``N`` a multiple of ``K``;
      for ``"pasa"`` k holds the shifted, scaled float16 keys); kv_lens int32
      ``[B]``; bias (float, natural-log units) and mask (bool) ``[B, N, T,
      S]`` or None.
    scale: the softmax scale (``"pasa"``: ``fl16(beta / (1 - beta))``).
    precision: one of :data:`PRECISIONS` (static).
    state_dtype: ``"pasa"`` only: the dtype of the running state (float16
      is PASA's Algorithm 1; float32 its default allocation).
    pasa_exp_scale: ``"pasa"`` only: the softmax scale over the keys'
      factor (the exponent's factor on ``S'``).
    pasa_exp_factor: ``"pasa"`` only: None, or a float32 scalar array, a
      power of two, by which ``pasa_exp_scale`` is multiplied at run time
      (``1 / p`` for keys' factor ``p`` chosen per call on the device;
      ``pasa_exp_scale`` is then the softmax scale): the kernel reads its
      constants from an operand, one compiled kernel for any factor, and
      computes what it would with ``pasa_exp_scale * pasa_exp_factor`` as
      its constant.
    pasa_shifted: ``"pasa"`` only: float32 ``[B, K, S_pad / block_k]``, 1
      for the shifted key blocks, 0 for those the adaptive shift left (in
      ``params.block_k`` blocks), or None (every block shifted).
    pasa_running: ``"pasa"`` only: the online softmax in FlashAttention-2's
      form (needs the float32 state; ``PasaConfig.online_softmax``).
    params: block sizes, warps and stages (:func:`default_params`).
    index_mask: query lengths, alignment, local window and segment ids
      (:class:`common.IndexMask`), or None.
  Returns: ``[B, T, N, D]`` (float16 for the float16 precisions, the input
    dtype for "fp32"), and the float32 log-sum-exp ``[B, N, T]`` if
    ``return_lse``.

  The grid is (query blocks, batch, query heads); query head ``h`` reads
  key/value head ``h // (N // K)``, so K and V are never repeated.  Inputs are
  only copied when a length is not a whole number of blocks or the head dim
  not a power of two.
  """
  if precision not in PRECISIONS:
    raise ValueError(f"precision must be one of {PRECISIONS}, got "
                     f"{precision!r}")
  if pasa_running and jnp.dtype(state_dtype) != jnp.float32:
    raise ValueError("PASA's running online softmax needs the float32 state")
  b, t, n, d = q.shape
  s_len, nk = k.shape[1], k.shape[2]
  group = n // nk
  d_pad = max(pl.next_power_of_2(d), 16)
  bq = min(params.block_q, max(16, pl.next_power_of_2(t)))
  bk = params.block_k
  in_dtype = q.dtype if precision == "fp32" else jnp.float16
  q, k, v = q.astype(in_dtype), k.astype(in_dtype), v.astype(in_dtype)
  t_pad = -(-t // bq) * bq
  s_pad = -(-s_len // bk) * bk
  q = common.pad_axis(common.pad_axis(q, 1, t_pad), 3, d_pad)
  k = common.pad_axis(common.pad_axis(k, 1, s_pad), 3, d_pad)
  v = common.pad_axis(common.pad_axis(v, 1, s_pad), 3, d_pad)
  bounds, ranges, segments = common.index_operands(
      kv_lens, index_mask, t=t, s=s_len, is_causal=is_causal, t_pad=t_pad,
      s_pad=s_pad, block_q=bq, block_k=bk, has_mask=mask is not None)
  runtime_exp = pasa_exp_factor is not None
  if runtime_exp and precision != "pasa":
    raise ValueError("pasa_exp_factor is PASA's (precision='pasa')")
  exp_args = ([_runtime_exp_constants(float(pasa_exp_scale), float(scale),
                                      pasa_exp_factor)]
              if runtime_exp else [])
  args = [q, k, v, bounds, ranges, *exp_args, *segments]
  in_specs = [
      pl.BlockSpec((None, bq, None, d_pad), lambda i, bi, h: (bi, i, h, 0)),
      pl.BlockSpec((None, s_pad, None, d_pad),
                   lambda i, bi, h: (bi, 0, h // group, 0)),
      pl.BlockSpec((None, s_pad, None, d_pad),
                   lambda i, bi, h: (bi, 0, h // group, 0)),
      pl.BlockSpec((None, 4), lambda i, bi, h: (bi, 0)),
      pl.BlockSpec((None, None, 4), lambda i, bi, h: (bi, i, 0)),
  ]
  if runtime_exp:
    in_specs.append(pl.BlockSpec((4,), lambda i, bi, h: (0,)))
  if segments:
    in_specs += [pl.BlockSpec((None, bq), lambda i, bi, h: (bi, i)),
                 pl.BlockSpec((None, s_pad), lambda i, bi, h: (bi, 0))]
  for x, dtype in ((bias, jnp.float32), (mask, jnp.int8)):
    if x is not None:
      args.append(common.pad_axis(common.pad_axis(x.astype(dtype), 2, t_pad), 3, s_pad))
      in_specs.append(pl.BlockSpec((None, None, bq, s_pad),
                                   lambda i, bi, h: (bi, h, i, 0)))
  if pasa_shifted is not None:
    if pasa_shifted.shape != (b, nk, s_pad // bk):
      raise ValueError(f"pasa_shifted must be [B, K, S_pad / block_k] = "
                       f"{(b, nk, s_pad // bk)}, got {pasa_shifted.shape}")
    args.append(pasa_shifted.astype(jnp.float32))
    in_specs.append(pl.BlockSpec((None, None, s_pad // bk),
                                 lambda i, bi, h: (bi, h // group, 0)))
  out_shape = [jax.ShapeDtypeStruct((b, t_pad, n, d_pad), in_dtype)]
  out_specs = [pl.BlockSpec((None, bq, None, d_pad),
                            lambda i, bi, h: (bi, i, h, 0))]
  if return_lse:
    out_shape.append(jax.ShapeDtypeStruct((b, n, t_pad), jnp.float32))
    out_specs.append(pl.BlockSpec((None, None, bq), lambda i, bi, h: (bi, h, i)))
  kernel = functools.partial(
      _flash_kernel, scale=scale, precision=precision, block_q=bq,
      block_k=bk, has_segments=bool(segments), has_bias=bias is not None,
      has_mask=mask is not None, return_lse=return_lse,
      state_dtype=jnp.dtype(state_dtype).name,
      pasa_exp_scale=float(pasa_exp_scale),
      has_shifted=pasa_shifted is not None, pasa_running=bool(pasa_running),
      runtime_exp=runtime_exp)
  outs = pl.pallas_call(
      kernel, grid=(t_pad // bq, b, n), in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=params.num_warps,
                                           num_stages=params.num_stages),
      interpret=common.interpret(), name=f"jaxattn_{precision}_fwd")(*args)
  out = outs[0]
  if t_pad != t or d_pad != d:
    out = out[:, :t, :, :d]
  if return_lse:
    return out, outs[1][:, :, :t]
  return out


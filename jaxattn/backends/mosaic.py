"""The Mosaic backend: the warp-specialised Hopper kernel
(:func:`pallas_kernels.mosaic.mosaic_attention`, Pallas Mosaic GPU) on an
H100/H200, or Mosaic GPU's interpreter without a GPU.

=========  ======================  ========================================
method     kernel flags            operands
=========  ======================  ========================================
"fp32"     ``qk = pv = "fp16"``    the float16/bfloat16 inputs
fp16_fp32  same, ``f16_scores``    the inputs in float16
"pasa"     ``pasa_inva``           shifted keys (:func:`jaxattn.operands.pasa_operands`)
"sage"     ``qk="int8"``, ``pv``   :func:`jaxattn.operands.quantized_operands`
"int8"     ``qk="int8"``, ``pv``   same
"fp8"      ``qk = pv = "fp8"``     same
fmha_int8  ``qk="int8"``,          :func:`jaxattn.operands.fmha_operands`,
           ``pv="uint8"``          float32 output, then the output's int8
=========  ======================  ========================================

The kernel takes head dims up to 128 (others than 64 and 128 zero-padded
to the next), no bias or mask, and keys in blocks of 64 or 128 (or 256 where K and V
are 8-bit); its tiles are fixed, so it refuses the Triton kernels' knobs
(``tile_q``, ``num_warps``, ``num_stages``) rather than ignoring them.
A call without key lengths reaches the kernel as ``kv_lens=None``
(:attr:`jaxattn.backends.Adapter.all_keys`; not PASA, not the FMHA), so
that a non-causal call without an index mask compiles no masked step.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from jaxattn import base, fmha, nonfinite, operands, pasa, sage
from jaxattn.backends import Adapter, Call, refuse_options, two_stage
from pallas_kernels import common, mosaic

NAME = "mosaic"
TITLE = "Mosaic GPU"
BLOCK_KS = (64, 128)
# 256-key blocks fit the shared-memory ring only with 8-bit K and V (two
# slots of 32 KB of K and 32 KB of V at D=128, 128 KB; 16-bit ones would
# take 256 KB).
BLOCK_KS_8BIT = (64, 128, 256)
TRITON_KNOBS = ("tile_q", "num_warps", "num_stages")


def native() -> bool:
  return common.is_hopper()


def _check_common(call: Call) -> None:
  d = call.q.shape[-1]
  if call.has_bias or call.has_mask:
    raise NotImplementedError(
        "the Mosaic kernel does not take a bias or mask (use "
        "implementation='triton')")
  if d > mosaic.HEAD_DIMS[-1]:
    raise NotImplementedError(
        f"the Mosaic kernel does not take head dim {d} (it takes up to "
        f"{mosaic.HEAD_DIMS[-1]}; 256 would not fit its shared-memory ring)")
  refuse_options(call.config, TRITON_KNOBS,
                 "Triton kernel knobs; the Mosaic kernel's tiles are fixed "
                 "(use implementation='triton')")
  block_k = getattr(call.config, "block_k", None)
  eight_bit = call.method in ("sage", "int8", "fp8", "fmha_int8") and (
      getattr(call.config, "pv_dtype", "fp8") != "fp16")
  allowed = BLOCK_KS_8BIT if eight_bit else BLOCK_KS
  if block_k is not None and block_k not in allowed:
    raise NotImplementedError(
        f"block_k={block_k}: the Mosaic kernel takes blocks of "
        + ("64, 128 or 256 keys" if eight_bit else
           "64 or 128 keys here (256 needs 8-bit K and V: int8, fp8, "
           "fmha_int8, sage with fp8 P V)"))


def _check_fp32(call: Call) -> None:
  _check_common(call)
  if jnp.dtype(call.q.dtype) not in (jnp.float16, jnp.bfloat16):
    raise NotImplementedError(
        f"{call.q.dtype} inputs: the Mosaic 'fp32' kernel takes "
        "float16/bfloat16 (use implementation='triton')")


def _check_pasa(call: Call) -> None:
  _check_common(call)
  if jnp.dtype(call.config.compute_dtype) != jnp.float16:
    raise NotImplementedError(
        f"PASA compute_dtype={call.config.compute_dtype}: the kernel "
        "computes in float16")


def _check_sage(call: Call) -> None:
  _check_common(call)
  if call.config.smooth_q and call.config.block_q % 128:
    raise NotImplementedError(
        f"sage block_q={call.config.block_q}: with smooth_q the Mosaic "
        "kernel needs a multiple of 128 (its tile of query rows)")


def _check_fp8(call: Call) -> None:
  _check_common(call)
  if call.config.granularity == "block" and call.config.block_q % 64:
    raise NotImplementedError(
        f"fp8 block granularity with block_q={call.config.block_q}: the "
        "Mosaic kernel needs a multiple of 64")


def _fp8_defaults(config, masked: bool, is_causal: bool) -> tuple:
  """256-key blocks for per-tensor fp8 (cuDNN's fp8 step), unless segment
  ids or a window hide key blocks: there a coarser block wastes more than
  it saves.  With ``granularity="block"`` the key block is the K and V
  scale group, so it keeps the method's own (docs/design.md, "256-key
  blocks for per-tensor fp8")."""
  del is_causal   # (faster causal too)
  if config.granularity != "tensor" or masked:
    return ()
  return (("block_k", 256),)


def _int8_defaults(config, masked: bool, is_causal: bool) -> tuple:
  """256-key blocks for full INT8 (int8 P and V, one V scale per tensor)
  on calls that skip no key block: 2% faster there, 1-2% slower causal
  (docs/design.md, "256-key blocks for full INT8 without a mask")."""
  if (config.pv_dtype != "int8" or config.v_granularity != "tensor"
      or masked or is_causal):
    return ()
  return (("block_k", 256),)


def _out_dtype(dtype):
  """The kernel writes 16-bit output tiles: bfloat16 stays, else float16."""
  return jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float16


def _exact_when_needed(kernel, score_bound):
  """``kernel(exact_exponent=...)`` with the fused exponent where every
  score is within :data:`pallas_kernels.mosaic.FUSED_EXPONENT_LIMIT` (a
  bound on ``|s * c|`` in base 2, from the inputs' largest row norms
  (``fp16_fp32``, PASA) or the quantized operands' scales), else (a NaN
  bound too) the exact one: huge scores never overflow P, and ordinary
  ones keep the faster form.  The kernel holds both forms and branches on
  the flag itself: a ``lax.cond`` here would make the host wait for the
  predicate (8-10 us with the GPU idle)."""
  fused = score_bound <= mosaic.FUSED_EXPONENT_LIMIT
  return kernel(exact_exponent=jnp.logical_not(fused))


def _score_bound(q_norm, k_norm, exp_factor):
  """A bound on ``|S * c|`` from the largest row norms of Q and K
  (:func:`jaxattn.base.max_row_norm`, over their finite values, so that
  one NaN/Inf, which poisons its own rows anyway, does not change the path
  the others take): ``|q . k| <= |q| |k|``; ``exp_factor`` the softmax
  scale, times log2 e here."""
  return q_norm * k_norm * (abs(exp_factor) * base.LOG2E)


def _fp32(q, k, v, bias, mask, kv_lens, *, scale, is_causal, config,
          return_lse=False, index_mask=None, f16_scores=False):
  """The exact exponent always: a bound on the scores would read Q and K
  for their row norms, which costs more than the exact form's one
  instruction per score.  With
  ``f16_scores`` (``fp16_fp32``) the bound still picks, as for PASA's
  running form, which is that method op for op where no key block is
  shifted and takes the same path."""
  del bias, mask  # refused by the check
  params = mosaic.MosaicParams(block_k=config.block_k or 128)
  kernel = functools.partial(
      mosaic.mosaic_attention, q, k.astype(q.dtype), v.astype(q.dtype),
      kv_lens, qk="fp16", pv="fp16", is_causal=is_causal, scale=scale,
      params=params,
      f16_scores=f16_scores, out_dtype=q.dtype, return_lse=return_lse,
      index_mask=index_mask)
  if not f16_scores:
    return kernel(exact_exponent=True)
  return _exact_when_needed(kernel, _score_bound(
      base.max_row_norm(q), base.max_row_norm(k), scale))


def _fp16_fp32(q, k, v, bias, mask, kv_lens, **kwargs):
  """The ``fp16_fp32`` method: float16 inputs, ``S`` rounded to float16,
  the rest in float32 (PASA's baseline)."""
  f16 = jnp.float16
  return _fp32(q.astype(f16), k.astype(f16), v.astype(f16), bias, mask,
               kv_lens, f16_scores=True, **kwargs)


def _pasa(q, k, v, bias, mask, kv_lens, *, scale, is_causal, config,
          index_mask=None):
  """PASA's keys shifted once per block (as for the Triton kernel), then
  its softmax in the kernel (``S'``, ``P`` float16, the state in
  ``config.state_dtype``); float16 output.  The running form takes the
  exact exponent where ``fp16_fp32`` would (``|q K'| scale / p`` is ``|q
  K| scale`` for unshifted keys) or its own scores need it.  The keys'
  factor is chosen per call on the device
  (:func:`jaxattn.pasa.with_key_factor`): one key kernel and one
  attention kernel, which take it at run time."""
  del bias, mask
  f16 = jnp.float16
  q = q.astype(f16)
  norms = base.max_row_norm(q), base.max_row_norm(k.astype(f16))
  return pasa.with_key_factor(functools.partial(
      _pasa_keys, q, k, v, kv_lens, norms, config=config, scale=scale,
      is_causal=is_causal, index_mask=index_mask), *norms, config,
      scale=scale)


def _pasa_keys(q, k, v, kv_lens, norms, scale_in_keys, *, config, scale,
               is_causal, index_mask):
  """:func:`_pasa` with the call's ``scale_in_keys`` (a bool, or a bool
  scalar array chosen on the device)."""
  f16 = jnp.float16
  ops = operands.pasa_operands(k, v.astype(f16), kv_lens, scale=scale,
                               config=config, scale_in_keys=scale_in_keys)
  # the rows a NaN/Inf key or value reaches are NaN (the kernel writes
  # them; Q's own NaN/Inf propagate through the products)
  reached = nonfinite.rows_reached(
      None, ops.bad_kv, None, kv_lens, is_causal=is_causal, q_shape=q.shape,
      index_mask=index_mask)
  kernel = functools.partial(
      mosaic.mosaic_attention, q, ops.k, ops.v, kv_lens, qk="fp16",
      pv="fp16", is_causal=is_causal,
      params=mosaic.MosaicParams(block_k=config.block_k), pasa_inva=ops.inva,
      pasa_state_dtype=config.state_dtype, pasa_exp_scale=ops.exp_scale,
      pasa_exp_factor=ops.exp_factor, pasa_shifted=ops.shifted,
      out_dtype=f16, index_mask=index_mask,
      pasa_running=config.running_softmax, nan_rows=reached)
  # |S' scale / p| = |q . M^T k| scale, and a shifted key's norm is at
  # most (1 + beta) max|k|; with no block shifted this is fp16_fp32's
  # bound on the same call, so that the two take the same path
  bound = _score_bound(*norms, scale)
  if ops.shifted is None:
    bound = bound * (1.0 + config.resolved_beta)
  else:
    bound = bound * jnp.where(ops.shifted.any(), 1.0 + config.resolved_beta,
                              1.0)
  return (_exact_when_needed(kernel, bound) if config.running_softmax
          else kernel())


def _prepare(method, q, k, v, kv_lens, *, scale, config, segments=None):
  """int4 Q, K in int8 containers (no int4 tensor cores); an 8-bit V in the
  register-operand key order where P comes from registers."""
  return operands.quantized_operands(
      method, q, k, v, kv_lens, scale=scale, config=config, pack_int4=False,
      v_key_order=mosaic.p_in_registers(), segments=segments)


def _k_scales(ops: operands.QuantizedOperands, block_k: int) -> dict:
  """The kernel's K scales: one per key block (``k_block_scale``) where
  the operands' scale groups hold whole blocks, else one per key."""
  s_len = ops.k_scale.shape[1]
  if ops.k_scale_keys >= s_len or ops.k_scale_keys % block_k == 0:
    return dict(k_block_scale=ops.k_scale[:, ::block_k].transpose(0, 2, 1))
  return dict(k_scale=ops.k_scale)


def _kernel(ops: operands.QuantizedOperands, kv_lens, bias=None, mask=None,
            *, is_causal, config, out_dtype, index_mask=None,
            return_lse=False, nan_rows=None):
  """The kernel on :class:`jaxattn.operands.QuantizedOperands`.  The
  method's ``block_k`` is the kernel's: it is part of the numerics (the
  online softmax rounds P against each block's running max; scale
  groups).  ``return_lse``: also the log-sum-exp of the scores it formed
  (``[B, N, T]``, without ``ops.k_shift``).  ``nan_rows``: the output rows
  the kernel writes as NaN."""
  del bias, mask
  return _exact_when_needed(functools.partial(
      mosaic.mosaic_attention,
      ops.q, ops.k, ops.v, kv_lens, qk=ops.qk, pv=ops.pv, is_causal=is_causal,
      params=mosaic.MosaicParams(block_k=config.block_k),
      q_scale=ops.q_scale, **_k_scales(ops, config.block_k),
      q_block_bias=ops.q_block_bias,
      bias_rows=ops.bias_rows, v_block_scale=ops.v_block_scale,
      out_scale=ops.out_scale, out_shift=ops.out_shift,
      v_keys_ordered=ops.v_keys_ordered,
      out_dtype=_out_dtype(out_dtype), index_mask=index_mask,
      return_lse=return_lse, nan_rows=nan_rows), ops.score_bound)


def _fmha(q, k, v, bias, mask, kv_lens, *, scale, is_causal, config,
          index_mask=None):
  """The uint8-P kernel (float32 output times ``v_scale / 255`` in its
  epilogue), then the method's output quantization, then NaN in the rows
  a NaN/Inf input reaches (flagged by the quantizers, which count NaN/Inf
  as 0 as the reference does; the output's amax is over those values)."""
  del bias, mask
  ops, v_scale = operands.fmha_operands(
      q, k, v, kv_lens, scale=scale, config=config, block_k=config.block_k,
      v_key_order=mosaic.p_in_registers())
  b, nk, d = k.shape[0], k.shape[2], v.shape[-1]
  out_scale = jnp.broadcast_to(v_scale / 255.0, (b, nk, d))
  # |S_i32| <= 127^2 D, times the one factor of the scores
  bound = jnp.abs(ops.q_scale[0, 0, 0]) * (127.0 ** 2 * q.shape[-1])
  out = _exact_when_needed(functools.partial(
      mosaic.mosaic_attention, ops.q, ops.k, ops.v, kv_lens, qk="int8",
      pv="uint8", is_causal=is_causal,
      params=mosaic.MosaicParams(block_k=config.block_k),
      q_scale=ops.q_scale, **_k_scales(ops, config.block_k),
      v_colsum=ops.v_colsum, v_keys_ordered=ops.v_keys_ordered,
      out_scale=out_scale, out_shift=jnp.zeros_like(out_scale),
      out_dtype=jnp.float32, index_mask=index_mask,
      return_row_amax=True), bound)
  # the output amax from the kernel's epilogue (each row's max |O|), not an
  # XLA pass over the float32 O
  o, row_amax = out
  return nonfinite.poison(fmha.method_output(o, config=config,
                                             row_amax=row_amax),
                          nonfinite.rows_reached(
                              ops.q_nonfinite, ops.kv_nonfinite, None,
                              kv_lens, is_causal=is_causal, q_shape=q.shape,
                              index_mask=index_mask))


ADAPTERS = {
    "fp32": Adapter(run=_fp32, check=_check_fp32,
                    run_lse=functools.partial(_fp32, return_lse=True),
                    index_mask=True, all_keys=True),
    "fp16_fp32": Adapter(run=_fp16_fp32, check=_check_common,
                         index_mask=True, all_keys=True),
    "pasa": Adapter(run=_pasa, check=_check_pasa, confines_nonfinite=True,
                    index_mask=True),
    # 128-key blocks unless asked otherwise: SageAttention2's sm90 block,
    # and faster here at the same error (docs/design.md)
    "sage": two_stage(functools.partial(_prepare, "sage"), _kernel,
                      check=_check_sage, defaults=(("block_k", 128),),
                      kernel_lse=True, kernel_nan_rows=True, all_keys=True,
                      query_chunk=sage.query_chunk_rows),
    "int8": two_stage(functools.partial(_prepare, "int8"), _kernel,
                      check=_check_common, defaults=_int8_defaults,
                      kernel_lse=True, kernel_nan_rows=True, all_keys=True),
    "fp8": two_stage(functools.partial(_prepare, "fp8"), _kernel,
                     check=_check_fp8, defaults=_fp8_defaults,
                     kernel_lse=True, kernel_nan_rows=True, all_keys=True),
    "fmha_int8": Adapter(run=_fmha, check=_check_common, index_mask=True,
                         confines_nonfinite=True),
}

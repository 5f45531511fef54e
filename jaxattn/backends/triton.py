"""The Triton backend (Pallas with the Triton lowering; any CUDA GPU, or
Pallas interpret mode without one).

=============  ===========================================  ==================
method         kernel                                       operands
=============  ===========================================  ==================
"fp32"         :func:`pallas_kernels.flash.flash_attention`  the inputs
"fp16_fp32"    same, ``precision="fp16_fp32"``               float16 inputs
"fp16"         same, ``precision="fp16"``                    float16 inputs
"pasa"         same, ``precision="pasa"``                    shifted keys
                                                             (:func:`jaxattn.operands.pasa_operands`)
"sage"         :func:`pallas_kernels.quantized.quantized_attention`  :func:`jaxattn.operands.quantized_operands`
"int8"         same                                         same
"fmha_int8"    same, ``pv="uint8"``                          :func:`jaxattn.operands.fmha_operands`
=============  ===========================================  ==================

"fp8" has no Triton kernel (the Triton lowering here has no fp8 x fp8
matmul with per-row scales); it runs on the Mosaic kernel or the reference.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from jaxattn import base, fmha, nonfinite, operands, pasa, sage
from jaxattn.backends import Adapter, Call, two_stage
from pallas_kernels import common, flash, key_shift, quantized

NAME = "triton"
TITLE = "Triton"


def native() -> bool:
  return common.has_gpu()


def flash_params(precision: str, head_dim: int, config) -> common.KernelParams:
  """The flash kernel's tuned table (:func:`pallas_kernels.flash.
  default_params`) overridden by the config's ``tile_q``, ``num_warps``,
  ``num_stages`` and ``block_k`` (PASA's ``block_k`` is the size of its
  shifting matrix, always the config's)."""
  p = flash.default_params(precision, head_dim)
  return common.KernelParams(
      block_q=config.tile_q or p.block_q,
      block_k=config.block_k or p.block_k,
      num_warps=config.num_warps or p.num_warps,
      num_stages=config.num_stages or p.num_stages)


def quantized_params(head_dim: int, config) -> common.KernelParams:
  """The quantized kernel's tuned table for the method's ``block_k``
  (:func:`pallas_kernels.quantized.default_params`) overridden by the
  config's Triton knobs (``tile_q``, ``num_warps``, ``num_stages``) where
  it has them."""
  p = quantized.default_params(head_dim, config.block_k)
  return common.KernelParams(
      block_q=getattr(config, "tile_q", None) or p.block_q,
      block_k=config.block_k,
      num_warps=getattr(config, "num_warps", None) or p.num_warps,
      num_stages=getattr(config, "num_stages", None) or p.num_stages)


def _flash(precision):
  def run(q, k, v, bias, mask, kv_lens, *, scale, is_causal, config,
          return_lse=False, index_mask=None):
    params = flash_params(precision, q.shape[-1], config)
    return flash.flash_attention(q, k, v, kv_lens, bias, mask, scale=scale,
                                 is_causal=is_causal, precision=precision,
                                 params=params, return_lse=return_lse,
                                 index_mask=index_mask)
  return Adapter(run=run, run_lse=functools.partial(run, return_lse=True),
                 index_mask=True)


def _check_pasa(call: Call) -> None:
  if jnp.dtype(call.config.compute_dtype) != jnp.float16:
    raise NotImplementedError(
        f"PASA compute_dtype={call.config.compute_dtype}: the kernels "
        "compute in float16; use implementation='reference'")
  if call.config.block_k not in key_shift.BLOCK_KS:
    raise NotImplementedError(
        f"PASA block_k={call.config.block_k}: the key-shift kernel takes "
        f"blocks of {', '.join(map(str, key_shift.BLOCK_KS))} keys; use "
        "implementation='reference'")


def _pasa(q, k, v, bias, mask, kv_lens, *, scale, is_causal, config,
          return_lse=False, index_mask=None):
  """The shifted keys (:func:`jaxattn.operands.pasa_operands`), then the
  kernel; a non-finite query poisons its own row there.  The keys' factor
  is chosen per call on the device (:func:`jaxattn.pasa.with_key_factor`):
  one key kernel and one attention kernel, which take it at run time."""
  f16 = jnp.float16
  return pasa.with_key_factor(functools.partial(
      _pasa_keys, q, k, v, bias, mask, kv_lens, config=config, scale=scale,
      is_causal=is_causal, return_lse=return_lse, index_mask=index_mask),
      base.max_row_norm(q.astype(f16)), base.max_row_norm(k.astype(f16)),
      config, scale=scale, has_bias=bias is not None)


def _pasa_keys(q, k, v, bias, mask, kv_lens, scale_in_keys, *, config, scale,
               is_causal, return_lse, index_mask):
  """:func:`_pasa` with the call's ``scale_in_keys`` (a bool, or a bool
  scalar array chosen on the device)."""
  ops = operands.pasa_operands(k, v, kv_lens, scale=scale, config=config,
                               scale_in_keys=scale_in_keys)
  outs = flash.flash_attention(
      q, ops.k, ops.v, kv_lens, bias, mask, scale=ops.inva,
      is_causal=is_causal, precision="pasa",
      params=flash_params("pasa", q.shape[-1], config),
      state_dtype=config.state_dtype, return_lse=return_lse,
      index_mask=index_mask, pasa_exp_scale=ops.exp_scale,
      pasa_exp_factor=ops.exp_factor, pasa_shifted=ops.shifted,
      pasa_running=config.running_softmax)
  out = nonfinite.poison(outs[0] if return_lse else outs,
                         nonfinite.rows_reached(
                             None, ops.bad_kv, mask, kv_lens,
                             is_causal=is_causal, q_shape=q.shape,
                             index_mask=index_mask))
  return (out, outs[1]) if return_lse else out


def _prepare(method, q, k, v, kv_lens, *, scale, config, segments=None):
  return operands.quantized_operands(method, q, k, v, kv_lens, scale=scale,
                                     config=config, pack_int4=True,
                                     segments=segments)


def _kernel(ops: operands.QuantizedOperands, kv_lens, bias=None, mask=None,
            *, is_causal, config, out_dtype, index_mask=None):
  """The quantized kernel on :class:`jaxattn.operands.QuantizedOperands`
  (``head_dim``: the unpacked width, for the tuned table)."""
  head_dim = ops.k.shape[-1] * (2 if ops.qk == "int4" else 1)
  return quantized.quantized_attention(
      ops.q, ops.q_scale, ops.k, ops.k_scale, ops.v, kv_lens, bias, mask,
      qk=ops.qk, pv=ops.pv, is_causal=is_causal,
      params=quantized_params(head_dim, config),
      v_block_scale=ops.v_block_scale, v_colsum=ops.v_colsum,
      q_block_bias=ops.q_block_bias, bias_rows=ops.bias_rows,
      out_scale=ops.out_scale, out_shift=ops.out_shift, out_dtype=out_dtype,
      index_mask=index_mask)


def _fmha(q, k, v, bias, mask, kv_lens, *, scale, is_causal, config,
          index_mask=None):
  """The uint8-P kernel, then the method's output quantization, then NaN
  in the rows a NaN/Inf input reaches (flagged by the quantizers)."""
  ops, v_scale = operands.fmha_operands(q, k, v, kv_lens, scale=scale,
                                        config=config, block_k=config.block_k)
  o = _kernel(ops, kv_lens, bias, mask, is_causal=is_causal, config=config,
              out_dtype=jnp.float32, index_mask=index_mask)
  return nonfinite.poison(
      fmha.method_output(o * (v_scale / 255.0), config=config),
      nonfinite.rows_reached(ops.q_nonfinite, ops.kv_nonfinite, mask,
                             kv_lens, is_causal=is_causal, q_shape=q.shape,
                             index_mask=index_mask))


ADAPTERS = {
    "fp32": _flash("fp32"),
    "fp16_fp32": _flash("fp16_fp32"),
    "fp16": _flash("fp16"),
    "pasa": Adapter(run=_pasa, check=_check_pasa, confines_nonfinite=True,
                    run_lse=functools.partial(_pasa, return_lse=True),
                    index_mask=True),
    "sage": two_stage(functools.partial(_prepare, "sage"), _kernel,
                      query_chunk=sage.query_chunk_rows),
    "int8": two_stage(functools.partial(_prepare, "int8"), _kernel),
    "fmha_int8": Adapter(run=_fmha, index_mask=True, confines_nonfinite=True),
}

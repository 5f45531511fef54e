"""The table of attention methods: name -> configuration class, batched
reference and description.  Each method module (``flash``, ``pasa``,
``sage``, ``int_flash``, ``fmha``, ``fp8``) holds its configuration and its
bit-faithful per-head reference; the kernels that run a method are listed per
backend in :mod:`jaxattn.backends`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from jaxattn import flash, fmha, fp8, int_flash, pasa, sage


@dataclasses.dataclass(frozen=True)
class Method:
  """An attention method.

  ``reference`` is batched: ``fn(q, k, v, bias, mask, kv_lens, *, scale,
  is_causal, config)`` on normalised BTNH inputs (bias/mask broadcast to
  ``[B, N, T, S]`` or None, ``kv_lens`` int32 ``[B]``) returning float32
  ``[B, T, N, Dv]`` (``fmha_int8`` with ``return_int8``: a tuple).
  ``confine_nonfinite``: the method takes statistics across rows or keys
  (quantization scales, smoothing means, PASA's key-block shift), through
  which one NaN/Inf would reach rows that float32 attention keeps finite,
  and its quantizers turn NaN/Inf into finite numbers.  Such a method runs
  as if non-finite input elements were 0, with NaN in exactly the rows they
  reach (:mod:`jaxattn.nonfinite`): inside the operand kernels where the
  backend's adapter flags the rows itself, else through one XLA pass.
  ``output_is_exact``: the output and log-sum-exp are float attention's (to
  the output dtype's rounding), so the backward may take them as its
  residuals (cuDNN's backward without a second forward, :mod:`jaxattn.grad`);
  a quantized method's would put its error into every dQ and dK.
  """
  name: str
  config_cls: type
  reference: Callable[..., Any]
  doc: str
  confine_nonfinite: bool = False
  output_is_exact: bool = False


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("fp32", flash.FlashConfig, flash.reference("fp32"),
           "float32 scores, softmax and accumulators (high precision)",
           output_is_exact=True),
    Method("fp16_fp32", flash.FlashConfig, flash.reference("fp16_fp32"),
           "float16 score matrix, the rest float32 (overflows)"),
    Method("fp16", flash.FlashConfig, flash.reference("fp16"),
           "fully float16 flash attention"),
    Method("pasa", pasa.PasaConfig, pasa.reference,
           "PASA: float16 attention with online pseudo-average shifting",
           confine_nonfinite=True),
    Method("sage", sage.SageConfig, sage.reference,
           "SageAttention2: smoothed int8/int4 QK (per-warp scales), fp8 PV "
           "with per-channel V scales; presets sage2-8b, sage2-4b, sage1",
           confine_nonfinite=True),
    Method("int8", int_flash.Int8Config, int_flash.reference,
           "INT-FlashAttention: token-level int8 Q/K, int8 V and P (int32 "
           "matmuls); pv_dtype='fp16' is the half-INT8 variant",
           confine_nonfinite=True),
    Method("fmha_int8", fmha.FmhaConfig, fmha.reference,
           "8-bit FMHA: per-tensor static/dynamic amax int8 Q/K/V/O, uint8 P",
           confine_nonfinite=True),
    Method("fp8", fp8.Fp8Config, fp8.reference,
           "FlashAttention-3-style FP8: e4m3 Q/K/V/P, per-tensor or per-block "
           "descales, float32 accumulation", confine_nonfinite=True),
)}


def get(name: str) -> Method:
  """The method called ``name``; ValueError listing the methods otherwise."""
  if name not in METHODS:
    raise ValueError(f"unknown method {name!r}; available: {sorted(METHODS)}")
  return METHODS[name]

"""jaxattn: fast low-precision attention for JAX that does not break.

``jaxattn.dot_product_attention`` is a drop-in for
``jax.nn.dot_product_attention`` (BTNH layout) with a ``method`` argument:

=============  ==============================================================
method         algorithm
=============  ==============================================================
"fp32"         flash attention, float32 scores/softmax/accumulators
"fp16_fp32"    float16 score matrix, rest float32 (the PASA paper's baseline)
"fp16"         fully float16 flash attention
"pasa"         PASA: float16 end to end with online pseudo-average shifting
"sage"         SageAttention2: smoothed int4/int8 QK, fp8 PV
"int8"         INT-FlashAttention: int8 Q, K, V and P
"fmha_int8"    8-bit FMHA: static/dynamic amax, uint8 P, int8 output
"fp8"          FlashAttention-3-style float8 e4m3 baseline
=============  ==============================================================
"""
from jaxattn import base, quant
from jaxattn import flash, pasa, sage, int_flash, fmha, fp8
from jaxattn import methods
from jaxattn.api import dot_product_attention, ring_attention, _named
from jaxattn.mix import choose_precision
from jaxattn import ring, sharding  # noqa: F401 (public modules)
from jaxattn import decode
from jaxattn.decode import KVCache, decode_attention

METHODS = tuple(methods.METHODS)

fp32_attention = _named("fp32", "Flash attention with float32 softmax.")
fp16_fp32_attention = _named("fp16_fp32", "Float16 scores, float32 softmax.")
fp16_attention = _named("fp16", "Fully float16 flash attention.")
pasa_attention = _named("pasa", "PASA (online pseudo-average shifting).")
sage_attention = _named("sage", "SageAttention2: smoothed int8/int4 QK, fp8 PV.")
int8_attention = _named("int8", "INT-FlashAttention (int8 Q, K, V, P).")
fmha_int8 = _named("fmha_int8", "8-bit FMHA (int8 Q/K/V/O, uint8 P).")
fp8_attention = _named("fp8", "FlashAttention-3-style float8 e4m3.")

__all__ = ["dot_product_attention", "METHODS", "fp32_attention",
           "fp16_fp32_attention", "fp16_attention", "pasa_attention", "pasa",
           "sage_attention", "sage", "choose_precision",
           "int8_attention", "fmha_int8", "fp8_attention", "int_flash",
           "fmha", "fp8", "ring", "ring_attention", "decode",
           "decode_attention", "KVCache"]

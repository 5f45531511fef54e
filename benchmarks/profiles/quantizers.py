"""Where the quantizers' time goes on the GPU, at 2x32x8192x128 float16:
each piece of the kernels' quantizers jitted and timed alone.

    python3 benchmarks/profiles/quantizers.py [pieces|variants|all]

``pieces``: elementwise passes, casts, the whole quantizers, the smoothing
bias; ``variants``: the 8-bit V transpose and the smoothing-bias matmul
variants.
"""
import sys

import jax
import jax.numpy as jnp

from jaxattn import fp8, int_flash, quant, sage
from jaxattn import operands as prepare
from jaxattn.tuning import time_call

b, h, s, d = 2, 32, 8192, 128
f32 = jnp.float32
P = jax.lax.DotAlgorithmPreset
cfg = sage.SageConfig.from_options()
res = {}


def T(name, fn, *args):
  """Times jit(fn)(*args) (ms) and prints it."""
  try:
    res[name] = time_call(jax.jit(fn), args, 10, 7) * 1e3
  except Exception as e:  # noqa: BLE001
    res[name] = f"ERR {type(e).__name__}: {str(e)[:300]}"
  shown = res[name] if isinstance(res[name], str) else round(res[name], 3)
  print(f"{name:45s} {shown}", flush=True)


def pieces(q, k, v, lens):
  T("copy q (read+write f16)", lambda q: q * 2, q)
  T("read q (sum)", lambda q: q.astype(f32).sum(), q)
  T("q -> int8 cast", lambda q: q.astype(jnp.int8), q)
  T("q -> fp8 cast", lambda q: q.astype(jnp.float8_e4m3fn), q)
  T("q -> fp8 quantize_fp8", lambda q: quant.quantize_fp8(q, jnp.float32(3.0)), q)
  T("q -> int8 quantize_int", lambda q: quant.quantize_int(q, jnp.float32(3.0)), q)
  T("per-token int8 q", lambda q: int_flash.quantize_per_token(q), q)
  T("row amax q", lambda q: jnp.abs(q.astype(f32)).max(-1), q)
  T("v int8 transpose", lambda v: prepare.kv_heads_last(v.astype(jnp.int8)), v)
  T("int8_inputs", lambda q, k, v, l: prepare.int8_inputs(q, k, v, l, config=int_flash.Int8Config()), q, k, v, lens)
  T("int8_inputs half", lambda q, k, v, l: prepare.int8_inputs(q, k, v, l, config=int_flash.Int8Config(pv_dtype="fp16")), q, k, v, lens)
  T("fp8_inputs", lambda q, k, v, l: prepare.fp8_inputs(q, k, v, l, config=fp8.Fp8Config()), q, k, v, lens)
  T("sage_inputs", lambda q, k, v, l: prepare.sage_inputs(q, k, v, l, scale=0.088, config=cfg), q, k, v, lens)
  T("sage_inputs no smooth_q", lambda q, k, v, l: prepare.sage_inputs(q, k, v, l, scale=0.088, config=sage.SageConfig.from_options(smooth_q=False)), q, k, v, lens)
  T("sage_inputs sage1", lambda q, k, v, l: prepare.sage_inputs(q, k, v, l, scale=0.088, config=sage.SageConfig.from_options(preset="sage1")), q, k, v, lens)
  def bias_only(q, k, l):
    z = prepare.sage_inputs(q, k, k, l, scale=0.088, config=cfg)
    return z["smooth_bias"]
  T("sage bias only", bias_only, q, k, lens)
  def bias_identity(q, k, l):
    qm = q.astype(f32).reshape(b, s // 128, 128, h, d).mean(2)
    return jnp.einsum("bqhd,bshd->bhqs", qm, k.astype(f32), precision=jax.lax.Precision.HIGHEST, preferred_element_type=f32)
  T("bias identity f32 HIGHEST", bias_identity, q, k, lens)
  def bias_default(q, k, l):
    qm = q.astype(f32).reshape(b, s // 128, 128, h, d).mean(2)
    return jnp.einsum("bqhd,bshd->bhqs", qm, k.astype(f32), preferred_element_type=f32)
  T("bias identity f32 default", bias_default, q, k, lens)
  T("quantized_operands sage", lambda q, k, v, l: (prepare.quantized_operands("sage", q, k, v, l, scale=0.088, config=cfg)), q, k, v, lens)


def variants(q, k, v, lens):
  T("quantized_operands int8", lambda q, k, v, l: (prepare.quantized_operands("int8", q, k, v, l, scale=0.088, config=int_flash.Int8Config())), q, k, v, lens)
  T("quantized_operands fp8", lambda q, k, v, l: (prepare.quantized_operands("fp8", q, k, v, l, scale=0.088, config=fp8.Fp8Config())), q, k, v, lens)
  T("int8_inputs", lambda q, k, v, l: prepare.int8_inputs(q, k, v, l, config=int_flash.Int8Config()), q, k, v, lens)
  T("int8_inputs + v transpose", lambda q, k, v, l: (lambda z: {**z, "v": prepare.kv_heads_last(z["v"])})(prepare.int8_inputs(q, k, v, l, config=int_flash.Int8Config())), q, k, v, lens)
  T("int8 v only transposed", lambda v, l: prepare.kv_heads_last(prepare.int8_inputs(v, v, v, l, config=int_flash.Int8Config())["v"]), v, lens)
  T("int8 v only", lambda v, l: prepare.int8_inputs(v, v, v, l, config=int_flash.Int8Config())["v"], v, lens)
  def v_t_first(v, l):  # transpose the float16 input first, then quantize in [B,K,D,S]
    vt = prepare.kv_heads_last(v).astype(f32)
    sv = jnp.abs(vt).max(axis=(2, 3)) * int_flash.RCP_R
    return int_flash.quantize_scaled(vt, sv[:, :, None, None])
  T("int8 v transpose-first", v_t_first, v, lens)
  def ks_of(k, l):
    kf = k.astype(f32); m = kf.mean(1); return kf - m[:, None], m
  for name, prec in [("HIGHEST", jax.lax.Precision.HIGHEST), ("BF16x3", P.BF16_BF16_F32_X3), ("TF32x3", P.TF32_TF32_F32_X3)]:
    def bias(q, k, l, prec=prec):
      qm = q.astype(f32).reshape(b, s // 128, 128, h, d).mean(2)
      ks, _ = ks_of(k, l)
      return jnp.einsum("bqhd,bshd->bhqs", qm, ks, precision=prec, preferred_element_type=f32)
    T(f"bias ks {name}", bias, q, k, lens)
    def bias_id(q, k, l, prec=prec):
      qm = q.astype(f32).reshape(b, s // 128, 128, h, d).mean(2)
      km = k.astype(f32).mean(1)
      return (jnp.einsum("bqhd,bshd->bhqs", qm, k.astype(f32), precision=prec, preferred_element_type=f32)
              - jnp.einsum("bqhd,bhd->bhq", qm, km)[..., None])
    T(f"bias identity {name}", bias_id, q, k, lens)


if __name__ == "__main__":
  which = sys.argv[1] if len(sys.argv) > 1 else "all"
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  inputs = [jax.random.normal(x, (b, s, h, d), jnp.float16)
            for x in (kq, kk, kv)]
  inputs.append(jnp.full((b,), s, jnp.int32))
  if which in ("pieces", "all"):
    pieces(*inputs)
  if which in ("variants", "all"):
    variants(*inputs)

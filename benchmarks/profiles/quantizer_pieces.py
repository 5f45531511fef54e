"""Quantizer cost breakdown on the GPU (run20): each piece of the kernels' quantizers timed alone at 2x32x8192x128.  python3 benchmarks/profiles/quantizer_pieces.py"""
"""Where the quantizers' time goes (2x32x8192x128, float16)."""
import functools, math
import jax, jax.numpy as jnp, numpy as np
import jaxattn
from jaxattn import sage, quant, int_flash, fp8
from pallas_kernels import prepare
from pallas_kernels.tuning import time_call

b, h, s, d = 2, 32, 8192, 128
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(x, (b, s, h, d), jnp.float16) for x in (kq, kk, kv))
lens = jnp.full((b,), s, jnp.int32)
cfg = sage.SageConfig.from_options()
f32 = jnp.float32
res = {}
def T(name, fn, *args):
  try:
    res[name] = time_call(jax.jit(fn), args, 10, 7) * 1e3
  except Exception as e:
    res[name] = f"ERR {type(e).__name__}: {str(e)[:200]}"
  print(f"{name:40s} {res[name] if isinstance(res[name], str) else round(res[name], 3)}", flush=True)

T("copy q (read+write f16)", lambda q: q * 2, q)
T("read q (sum)", lambda q: q.astype(f32).sum(), q)
T("q -> int8 cast", lambda q: q.astype(jnp.int8), q)
T("q -> fp8 cast", lambda q: q.astype(jnp.float8_e4m3fn), q)
T("q -> fp8 quantize_fp8", lambda q: quant.quantize_fp8(q, jnp.float32(3.0)), q)
T("q -> int8 quantize_int", lambda q: quant.quantize_int(q, jnp.float32(3.0)), q)
T("per-token int8 q", lambda q: int_flash._per_token(q), q)
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
for kname, fn in [("kernel_inputs sage", lambda q, k, v, l: {n: x for n, x in prepare.kernel_inputs("sage", q, k, v, l, scale=0.088, config=cfg).items() if isinstance(x, jax.Array)})]:
  T(kname, fn, q, k, v, lens)
print("SUMMARY", {k_: (round(v_, 3) if not isinstance(v_, str) else v_) for k_, v_ in res.items()})

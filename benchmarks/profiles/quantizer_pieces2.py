"""Quantizer cost breakdown, part 2 (run20b): the 8-bit V transpose and the smoothing-bias matmul variants.  python3 benchmarks/profiles/quantizer_pieces2.py"""
import functools, math
import jax, jax.numpy as jnp, numpy as np
from jaxattn import sage, quant, int_flash, fp8
from pallas_kernels import prepare
from pallas_kernels.tuning import time_call
b, h, s, d = 2, 32, 8192, 128
kq, kk, kv = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(x, (b, s, h, d), jnp.float16) for x in (kq, kk, kv))
lens = jnp.full((b,), s, jnp.int32)
cfg = sage.SageConfig.from_options()
f32 = jnp.float32
P = jax.lax.DotAlgorithmPreset
def T(name, fn, *args):
  try:
    t = time_call(jax.jit(fn), args, 10, 7) * 1e3; print(f"{name:45s} {t:.3f}", flush=True); return t
  except Exception as e:
    print(f"{name:45s} ERR {type(e).__name__}: {str(e)[:300]}", flush=True)
arrays = lambda dct: {n: x for n, x in dct.items() if isinstance(x, jax.Array)}
T("kernel_inputs int8", lambda q, k, v, l: arrays(prepare.kernel_inputs("int8", q, k, v, l, scale=0.088, config=int_flash.Int8Config())), q, k, v, lens)
T("kernel_inputs fp8", lambda q, k, v, l: arrays(prepare.kernel_inputs("fp8", q, k, v, l, scale=0.088, config=fp8.Fp8Config())), q, k, v, lens)
T("int8_inputs", lambda q, k, v, l: prepare.int8_inputs(q, k, v, l, config=int_flash.Int8Config()), q, k, v, lens)
T("int8_inputs + v transpose", lambda q, k, v, l: (lambda z: {**z, "v": prepare.kv_heads_last(z["v"])})(prepare.int8_inputs(q, k, v, l, config=int_flash.Int8Config())), q, k, v, lens)
T("int8 v only transposed", lambda v, l: prepare.kv_heads_last(prepare.int8_inputs(v, v, v, l, config=int_flash.Int8Config())["v"]), v, lens)
T("int8 v only", lambda v, l: prepare.int8_inputs(v, v, v, l, config=int_flash.Int8Config())["v"], v, lens)
def v_t_first(v, l):  # transpose the float16 input first, then quantize in [B,K,D,S]
  vt = prepare.kv_heads_last(v).astype(f32)
  sv = jnp.abs(vt).max(axis=(2, 3)) * int_flash.RCP_R
  return int_flash._quantize(vt, sv[:, :, None, None])
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

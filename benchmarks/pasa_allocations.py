"""PASA's key preparation and end-to-end time per precision allocation,
against cuDNN bfloat16 in the same process (H100 numbers in docs/design.md).

  python benchmarks/pasa_allocations.py OUT.json

Allocations: the default (float32 state, sum-preserving keys, adaptive
shift, FlashAttention-2's online softmax, the keys' scale chosen per call),
the same with the scale always in the keys (no per-call choice: the
default's cost of that choice), the same with Algorithm 1's
per-block softmax, the same without the adaptive shift, and the paper's
Algorithm 1; then the ``fp32`` and ``fp16_fp32`` methods on the same
kernel, the baselines of PASA's speed.  Rows: ``keys`` is :func:`jaxattn.operands.
pasa_operands` alone, ``e2e`` the whole call on the Mosaic kernel (the
Triton one without a Hopper GPU).  Key preparation is timed on the
normal inputs (no block is large-mean, so the adaptive shift shifts none)
and on keys with a per-channel bias (:func:`jaxattn.data.channel_outlier`,
where it shifts nearly all), as ``keys_ms`` and ``keys_biased_ms``.
"""
import json
import sys

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import api, base, data, operands, pasa
from jaxattn.tuning import time_call

ALLOCATIONS = {"default": {}, "scale_in_keys": {"scale_in_keys": True},
               "per_block": {"online_softmax": "per_block"},
               "not_adaptive": {"adaptive_shift": False},
               "algorithm1": pasa.ALGORITHM1}


def main(out_path):
  impl = "mosaic" if api.BACKENDS["mosaic"].native() else "triton"
  shape = (2, 8192, 32, 128)
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(x, shape, jnp.float16) for x in ks)
  lens = jnp.full((shape[0],), shape[1], jnp.int32)
  k_biased = data.channel_outlier(jax.random.key(1), shape)[1]
  rows = []
  for causal in (False, True):
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, implementation="cudnn"))
    t_ref = time_call(cudnn, bf)
    for name, opts in ALLOCATIONS.items():
      cfg = pasa.PasaConfig(**opts)
      keys = jax.jit(lambda k, v: (lambda o: (o.k, o.shifted))(
          operands.pasa_operands(k, v, lens, config=cfg,
                                 scale=base.default_scale(shape[-1]))))
      e2e = jax.jit(lambda q, k, v: jaxattn.dot_product_attention(
          q, k, v, method="pasa", is_causal=causal, implementation=impl,
          **opts))
      t_keys = time_call(keys, (k, v)) if not causal else None
      t_biased = time_call(keys, (k_biased, v)) if not causal else None
      shifted = (None if causal or not cfg.adaptive_shift else
                 [float(keys(x, v)[1].mean()) for x in (k, k_biased)])
      t_e2e = time_call(e2e, (q, k, v))
      t_e2e_biased = time_call(e2e, (q, k_biased, v))
      rows.append(dict(allocation=name, causal=causal, impl=impl,
                       keys_ms=t_keys and t_keys * 1e3,
                       keys_biased_ms=t_biased and t_biased * 1e3,
                       shifted_fraction_normal_biased=shifted,
                       e2e_ms=t_e2e * 1e3, e2e_biased_ms=t_e2e_biased * 1e3,
                       cudnn_bf16_ms=t_ref * 1e3,
                       ratio_vs_cudnn_bf16=t_ref / t_e2e))
      print(f"{name:13s} causal={causal!s:5s} keys "
            f"{rows[-1]['keys_ms'] or 0:.3f} ms (biased "
            f"{rows[-1]['keys_biased_ms'] or 0:.3f} ms, shifted {shifted})"
            f"  e2e {t_e2e * 1e3:.3f} ms (biased "
            f"{t_e2e_biased * 1e3:.3f})  "
            f"x{t_ref / t_e2e:.3f} of cuDNN bf16 ({t_ref * 1e3:.3f} ms)",
            flush=True)
    for method in ("fp32", "fp16_fp32"):
      e2e = jax.jit(lambda q, k, v: jaxattn.dot_product_attention(
          q, k, v, method=method, is_causal=causal, implementation=impl))
      t_e2e = time_call(e2e, (q, k, v))
      rows.append(dict(allocation=method, causal=causal, impl=impl,
                       e2e_ms=t_e2e * 1e3, cudnn_bf16_ms=t_ref * 1e3,
                       ratio_vs_cudnn_bf16=t_ref / t_e2e))
      print(f"{method:13s} causal={causal!s:5s} e2e {t_e2e * 1e3:.3f} ms  "
            f"x{t_ref / t_e2e:.3f} of cuDNN bf16", flush=True)
  meta = dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
              shape="BTNH " + "x".join(map(str, shape)))
  with open(out_path, "w") as f:
    json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "pasa_allocations.json")

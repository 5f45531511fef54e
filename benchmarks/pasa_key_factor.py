"""The cost of PASA's per-call key factor (``PasaConfig.scale_in_keys``) on
the H100, against cuDNN bfloat16 in the same process.

  python benchmarks/pasa_key_factor.py OUT.json

At 2x32x8192x128, non-causal, on normal inputs and on keys with a
per-channel bias (:func:`jaxattn.data.channel_outlier`, every block
shifted): the default (``None``: row norms, then ``lax.cond``), the two
choices forced (``True``: the softmax scale's power of two in the keys,
the behaviour before the choice existed; ``False``: keys without it, the
default's branch on these inputs), and the row norms alone.  Two rounds,
interleaved, so that the spread between rounds shows the noise.
"""
import json
import sys

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn import api, base, data
from jaxattn.tuning import time_call


def main(out_path):
  impl = "mosaic" if api.BACKENDS["mosaic"].native() else "triton"
  shape = (2, 8192, 32, 128)
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(x, shape, jnp.float16) for x in ks)
  inputs = {"normal": (q, k, v),
            "biased": (q, data.channel_outlier(jax.random.key(1), shape)[1],
                       v)}
  cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, implementation="cudnn"))
  calls = {name: jax.jit(lambda q, k, v, o=opts: jaxattn.dot_product_attention(
      q, k, v, method="pasa", implementation=impl, **o))
           for name, opts in (("default", {}), ("in_keys", dict(scale_in_keys=True)),
                              ("no_scale", dict(scale_in_keys=False)))}
  calls["norms"] = jax.jit(lambda q, k, v: (base.max_row_norm(q),
                                            base.max_row_norm(k)))
  rows = []
  for rnd in range(2):
    for data_name, args in inputs.items():
      bf = [x.astype(jnp.bfloat16) for x in args]
      t_ref = time_call(cudnn, bf)
      for name, fn in calls.items():
        t = time_call(fn, args)
        rows.append(dict(round=rnd, data=data_name, call=name, ms=t * 1e3,
                         cudnn_bf16_ms=t_ref * 1e3, ratio=t_ref / t))
        print(f"round {rnd} {data_name:6s} {name:8s} {t * 1e3:.3f} ms  "
              f"x{t_ref / t:.3f} of cuDNN bf16 ({t_ref * 1e3:.3f} ms)",
              flush=True)
      with open(out_path, "w") as f:
        json.dump(dict(meta=dict(device=jax.devices()[0].device_kind,
                                 jax=jax.__version__, impl=impl,
                                 shape="BTNH 2x8192x32x128"), rows=rows),
                  f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1] if len(sys.argv) > 1 else "pasa_key_factor.json")

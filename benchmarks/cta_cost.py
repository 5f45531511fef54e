"""Per-CTA fixed cost of the Mosaic kernel: calls whose tiles each see
only w+1 keys (local_window_size=(w, 0), causal), fp32 on float16 inputs,
2x8192x32x128 (4096 CTAs of 128 rows), against cuDNN with the same window;
and the unmasked causal call: the time x SMs / CTAs (us per CTA) falls to
the fixed cost of a CTA as the window shrinks.

    python benchmarks/cta_cost.py [OUT_DIR]     (writes cta_cost.json)
"""
import sys, os, json
sys.path.insert(0, os.getcwd())
import jax, jax.numpy as jnp
import jaxattn
from jaxattn.tuning import time_call
B, S, N, D = 2, 8192, 32, 128
ks = jax.random.split(jax.random.key(0), 3)
q, k, v = (jax.random.normal(x, (B, S, N, D), jnp.float16) for x in ks)
ctas, sms = B * N * S // 128, jax.devices()[0].core_count
res = []
for w in (0, 127, 255, 511, 1023, None):
  kw = {} if w is None else dict(local_window_size=(w, 0))
  row = dict(window=w)
  for name, f in (
      ("mosaic", lambda q, k, v: jaxattn.dot_product_attention(
          q, k, v, is_causal=True, method="fp32", **kw)),
      ("cudnn", lambda q, k, v: jax.nn.dot_product_attention(
          q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
          v.astype(jnp.bfloat16), is_causal=True, implementation="cudnn",
          **kw))):
    try:
      t = time_call(jax.jit(f), (q, k, v), iters=10, reps=5)
      row[name + "_ms"] = t * 1e3
      row[name + "_us_per_cta"] = t * 1e6 * sms / ctas
    except Exception as e:  # noqa: BLE001
      row[name] = repr(e)[:200]
  res.append(row)
  print(row, flush=True)
out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
json.dump(res, open(os.path.join(out_dir, "cta_cost.json"), "w"), indent=1)

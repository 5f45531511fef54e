"""PASA through the ring vs single device, against float64 attention, on
the PASA paper's biased inputs (Table 4 style: fp16_fp32 overflows), on 4
virtual CPU devices with the reference implementations:

    python benchmarks/pasa_ring.py       (prints one line per case)
"""
import os, functools
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("PJRT_NPROC", "64")
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_enable_x64", True)
from jax.sharding import AxisType, PartitionSpec as P
import jaxattn
from jaxattn import pasa, ring
def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64); return float(np.linalg.norm(a - b) / np.linalg.norm(b))
S, N, D = 1024, 8, 128
rng = np.random.default_rng(0)
cases = {"uniform(30, 0.5)": lambda: rng.uniform(29.5, 30.5, (1, S, N, D)),
         "uniform(20, 15)": lambda: rng.uniform(5, 35, (1, S, N, D)),
         "hybrid(30, 10)": lambda: rng.normal(30, 1, (1, S, N, D)) + rng.normal(0, 10, (1, S, N, D)) * (rng.random((1, S, N, D)) < 0.001)}
for name, gen in cases.items():
  q, k, v = (jnp.asarray(gen(), jnp.float16) for _ in range(3))
  truth = jaxattn.dot_product_attention(*(x.astype(jnp.float64) for x in (q, k, v)), implementation="reference")
  for causal in (False, True):
    row = [name, "causal" if causal else "full"]
    nan16 = float(jnp.isnan(jaxattn.dot_product_attention(q, k, v, method="fp16_fp32", is_causal=causal, implementation="reference")).mean())
    for cfg in ({}, pasa.ALGORITHM1):
      single = jaxattn.dot_product_attention(q, k, v, method="pasa", is_causal=causal, implementation="reference", **cfg)
      t = jaxattn.dot_product_attention(*(x.astype(jnp.float64) for x in (q, k, v)), implementation="reference", is_causal=causal)
      row.append(f"single {rel(single, t):.2e}")
      for n in (2, 4):
        mesh = jax.make_mesh((n,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
        layout = "zigzag" if causal else "contiguous"
        body = jax.jit(jax.shard_map(functools.partial(jaxattn.ring_attention, axis_name="sp", method="pasa", is_causal=causal, layout=layout, implementation="reference", **cfg), mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"), check_vma=False))
        to = (lambda x: ring.to_zigzag(x, n)) if causal else (lambda x: x)
        back = (lambda x: ring.from_zigzag(x, n)) if causal else (lambda x: x)
        out = back(body(to(q), to(k), to(v)))
        row.append(f"ring{n} {rel(out, t):.2e} nan {float(jnp.isnan(out).mean()):.0%}")
    print(" | ".join(row), f"| fp16_fp32 NaN {nan16:.0%}", flush=True)

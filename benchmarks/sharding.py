"""Sharding and ring attention on 2 GPUs (issue 19): checks and timings.

Run from the repository root on a machine with 2 GPUs (jax[cuda] 0.11.2+):

    NCCL_NVLS_ENABLE=0 OUT=/tmp/out python benchmarks/sharding.py
    # --quick: small timing shapes; --cpu-smoke: tiny checks, no timings;
    # --timings: sections 2 and 3 only
    # (XLA_FLAGS=--xla_force_host_platform_device_count=2 on a CPU)

1. Shard-local checks, implementation=None, methods fp32, sage, fp8, pasa,
   int8: batch-sharded and head-sharded jit, the compiled HLO's all-gathers
   (must be 0) and the difference to the single-device result; the gradient
   (fp32, sage) likewise; the ring (shard_map ring_attention, zigzag causal
   and non-causal) and the sequence-sharded jit against single-device
   attention.
2. Weak scaling, batch-sharded: B=2 per GPU, S=8192, N=32, D=128, float16:
   1 GPU with B=2 against 2 GPUs with B=4; efficiency t1/t2 (bar >= 0.9).
3. Ring attention at S = 2 x 32768 (B=1, N=16, D=128, float16; N=16 keeps
   the single-GPU reference at ~50 ms a call): ideal = single-GPU time of
   the full-length attention / 2; ratio ideal/measured (bar >= 0.8), for
   non-causal and causal (zigzag layout through shard_map; the contiguous
   layout that jit takes by itself on sequence-sharded inputs is timed too).

Every case runs in its own try/except; the JSON goes to $OUT/sharding.json
and a short table is printed last.
"""
import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxattn  # noqa: E402
from jaxattn import ring  # noqa: E402

QUICK = "--quick" in sys.argv
SMOKE = "--cpu-smoke" in sys.argv   # tiny checks only (CPU, 2 virtual devices)
TIMINGS_ONLY = "--timings" in sys.argv
CHECK_S = 256 if SMOKE else 2048
METHODS = ("fp32", "sage", "fp8", "pasa", "int8")
OUT = os.environ.get("OUT", ".")
RESULTS = {"jax": jax.__version__, "devices": [str(d) for d in jax.devices()],
           "checks": [], "weak_scaling": [], "ring": []}


def log(*a):
  print(*a, flush=True)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def bench(f, *args, iters=10, warmup=3):
  """Seconds per call of ``f(*args)`` (block_until_ready after warmup)."""
  for _ in range(warmup):
    jax.block_until_ready(f(*args))
  t0 = time.perf_counter()
  for _ in range(iters):
    out = f(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / iters


def case(section, name, fn):
  log(f"--- {section}: {name}")
  try:
    row = {"case": name, **fn()}
  except Exception as e:  # noqa: BLE001  (one case must not stop the rest)
    traceback.print_exc()
    row = {"case": name, "error": f"{type(e).__name__}: {str(e)[:500]}"}
  log("   ", row)
  RESULTS[section].append(row)
  save()


def save():
  """The JSON so far (a run cut short by a time limit keeps its cases)."""
  os.makedirs(OUT, exist_ok=True)
  with open(os.path.join(OUT, "sharding.json"), "w") as f:
    json.dump(RESULTS, f, indent=1)


def inputs(b, s, n, k, d=128, dtype=jnp.float16, seed=0, key_bias=0.0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(ks[0], (b, s, n, d), dtype),
          jax.random.normal(ks[1], (b, s, k, d), dtype) + key_bias,
          jax.random.normal(ks[2], (b, s, k, d), dtype))


def put(mesh, spec, *xs):
  return tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x in xs)


def hlo_counts(fn, *args):
  text = jax.jit(fn).lower(*args).compile().as_text()
  return {"all_gathers": text.count("all-gather"),
          "collective_permutes": text.count("collective-permute")}


MESH = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,))
N_DEV = 2


# --- 1. shard-local checks ----------------------------------------------------

def check_sharded(method, spec, causal, with_grad):
  q, k, v = inputs(4, CHECK_S, 8, 4, key_bias=1.0)
  attend = functools.partial(jaxattn.dot_product_attention, method=method,
                             is_causal=causal)
  impl = jaxattn.api.resolve_implementation(q, k, v, method=method,
                                            is_causal=causal)
  args = put(MESH, spec, q, k, v)
  row = {"method": method, "spec": str(spec), "causal": causal,
         "implementation": impl, **hlo_counts(attend, *args)}
  got, want = jax.jit(attend)(*args), jax.jit(attend)(q, k, v)
  row["out_sharding"] = str(got.sharding.spec)
  row["max_abs_diff"] = float(jnp.max(jnp.abs(got.astype(jnp.float32)
                                              - want.astype(jnp.float32))))
  row["rel_diff"] = rel(got, want)
  if with_grad:
    def loss(q, k, v):
      return jnp.sum(attend(q, k, v).astype(jnp.float32) ** 2)
    g = jax.grad(loss, (0, 1, 2))
    row["grad_all_gathers"] = hlo_counts(g, *args)["all_gathers"]
    row["grad_rel_diff"] = max(rel(a, b) for a, b in zip(
        jax.jit(g)(*args), jax.jit(g)(q, k, v)))
  return row


def check_ring(method, causal):
  q, k, v = inputs(1, 2 * CHECK_S, 8, 4, key_bias=1.0)
  layout = "zigzag" if causal else "contiguous"
  body = jax.shard_map(
      functools.partial(jaxattn.ring_attention, axis_name="x", method=method,
                        is_causal=causal, layout=layout),
      mesh=MESH, in_specs=P(None, "x"), out_specs=P(None, "x"),
      check_vma=False)
  to = functools.partial(ring.to_zigzag, n=N_DEV) if causal else (lambda x: x)
  back = (functools.partial(ring.from_zigzag, n=N_DEV) if causal
          else (lambda x: x))
  got = back(jax.jit(body)(*(to(x) for x in (q, k, v))))
  want = jaxattn.dot_product_attention(q, k, v, method=method,
                                       is_causal=causal)
  exact = jaxattn.dot_product_attention(
      *(x.astype(jnp.float32) for x in (q, k, v)), is_causal=causal,
      implementation="reference")
  row = {"method": method, "causal": causal, "layout": layout,
         "ring_vs_single": rel(got, want), "ring_vs_f32": rel(got, exact),
         "single_vs_f32": rel(want, exact)}
  # the sequence-sharded jit takes the (contiguous) ring by itself
  attend = functools.partial(jaxattn.dot_product_attention, method=method,
                             is_causal=causal)
  args = put(MESH, P(None, "x"), q, k, v)
  row.update({f"jit_{k}": v for k, v in hlo_counts(attend, *args).items()})
  row["jit_vs_single"] = rel(jax.jit(attend)(*args), want)
  return row


# --- 2. weak scaling ----------------------------------------------------------

def weak_scaling(method, causal):
  b, s, n, d = 2, 8192, 32, 128
  if QUICK:
    s = 2048
  attend = jax.jit(functools.partial(jaxattn.dot_product_attention,
                                     method=method, is_causal=causal))
  q1, k1, v1 = inputs(b, s, n, n, d)
  t1 = bench(attend, q1, k1, v1)
  q2, k2, v2 = put(MESH, P("x"), *inputs(b * N_DEV, s, n, n, d))
  counts = hlo_counts(attend, q2, k2, v2)
  t2 = bench(attend, q2, k2, v2)
  return {"method": method, "causal": causal,
          "shape_per_gpu": [b, s, n, d], "t1_ms": 1e3 * t1, "t2_ms": 1e3 * t2,
          "efficiency": t1 / t2, "bar": 0.9, **counts}


# --- 3. ring at S = 2 x 32768 -------------------------------------------------

def ring_timing(method, causal):
  b, s, n, d = 1, 2 * 32768, 16, 128
  if QUICK:
    s = 2 * 4096
  q, k, v = inputs(b, s, n, n, d)
  single = jax.jit(functools.partial(jaxattn.dot_product_attention,
                                     method=method, is_causal=causal))
  t_single = bench(single, q, k, v, iters=5, warmup=2)
  layout = "zigzag" if causal else "contiguous"
  body = jax.jit(jax.shard_map(
      functools.partial(jaxattn.ring_attention, axis_name="x", method=method,
                        is_causal=causal, layout=layout),
      mesh=MESH, in_specs=P(None, "x"), out_specs=P(None, "x"),
      check_vma=False))
  to = (functools.partial(ring.to_zigzag, n=N_DEV) if causal
        else (lambda x: x))
  args = put(MESH, P(None, "x"), *(to(x) for x in (q, k, v)))
  t_ring = bench(body, *args, iters=5, warmup=2)
  # the contiguous ring that jit takes by itself on sequence-sharded inputs
  plain = put(MESH, P(None, "x"), q, k, v)
  t_jit = bench(single, *plain, iters=5, warmup=2)
  ideal = t_single / N_DEV
  return {"method": method, "causal": causal, "layout": layout,
          "shape": [b, s, n, d], "t_single_ms": 1e3 * t_single,
          "ideal_ms": 1e3 * ideal, "t_ring_ms": 1e3 * t_ring,
          "ratio": ideal / t_ring, "bar": 0.8, "t_jit_contiguous_ms":
          1e3 * t_jit, "ratio_jit_contiguous": ideal / t_jit,
          **{f"ring_{k}": v for k, v in hlo_counts(body, *args).items()}}


def main():
  log("jax", jax.__version__, jax.devices())
  if jax.device_count() < 2:
    log("needs 2 devices")
  for method in () if TIMINGS_ONLY else METHODS:
    for spec, causal in ((P("x"), True), (P(None, None, "x"), False)):
      case("checks", f"{method} {spec} causal={causal}",
           lambda: check_sharded(method, spec, causal,
                                 with_grad=method in ("fp32", "sage")))
  for method in () if TIMINGS_ONLY else METHODS:
    for causal in (False, True):
      case("checks", f"ring {method} causal={causal}",
           lambda: check_ring(method, causal))
  for method in () if SMOKE else ("fp32", "sage", "fp8"):
    for causal in (False, True):
      case("weak_scaling", f"{method} causal={causal}",
           lambda: weak_scaling(method, causal))
  for method in () if SMOKE else ("fp32", "sage"):
    for causal in (False, True):
      case("ring", f"{method} causal={causal}",
           lambda: ring_timing(method, causal))

  save()

  log("\n=== shard-local checks (all-gathers must be 0) ===")
  for r in RESULTS["checks"]:
    if "error" in r:
      log(f"{r['case']:<40} ERROR {r['error'][:100]}")
    elif "ring_vs_single" in r:
      log(f"{r['case']:<40} ring-vs-single {r['ring_vs_single']:.2e} "
          f"ring/single vs f32 {r['ring_vs_f32']:.2e}/{r['single_vs_f32']:.2e}"
          f" jit: gathers {r['jit_all_gathers']} permutes "
          f"{r['jit_collective_permutes']} vs-single {r['jit_vs_single']:.2e}")
    else:
      log(f"{r['case']:<40} {r['implementation']:<9} gathers "
          f"{r['all_gathers']} rel {r['rel_diff']:.1e} max|d| "
          f"{r['max_abs_diff']:.1e} out {r['out_sharding']}"
          + (f" grad gathers {r['grad_all_gathers']} rel "
             f"{r['grad_rel_diff']:.1e}" if "grad_rel_diff" in r else ""))
  log("\n=== weak scaling, batch-sharded (efficiency t1/t2, bar 0.9) ===")
  for r in RESULTS["weak_scaling"]:
    log(f"{r['case']:<24} " + (f"ERROR {r['error'][:100]}" if "error" in r
        else f"t1 {r['t1_ms']:.2f} ms  t2 {r['t2_ms']:.2f} ms  efficiency "
             f"{r['efficiency']:.3f}  gathers {r['all_gathers']}"))
  log("\n=== ring, S = 2 x 32768 (ratio ideal/measured, bar 0.8) ===")
  for r in RESULTS["ring"]:
    log(f"{r['case']:<24} " + (f"ERROR {r['error'][:100]}" if "error" in r
        else f"single {r['t_single_ms']:.1f} ms  ideal {r['ideal_ms']:.1f}  "
             f"ring({r['layout']}) {r['t_ring_ms']:.1f} ratio "
             f"{r['ratio']:.3f}  jit(contiguous) {r['t_jit_contiguous_ms']:.1f}"
             f" ratio {r['ratio_jit_contiguous']:.3f}"))
  log(f"\nJSON: {os.path.join(OUT, 'sharding.json')}")


if __name__ == "__main__":
  main()

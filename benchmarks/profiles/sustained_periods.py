"""Why cuDNN bf16's timed row reads ~10% over its GPU period
(``docs/design.md``, Measuring): the GPU's period between back-to-back calls
over a long run, first calls against last, with the host's wall time of
the same calls and the SM clock and power sampled alongside:

    python benchmarks/profiles/sustained_periods.py OUT.log [--causal]

If the periods grow from the first calls to the last while the clock
falls, the timed row measures clocks under sustained load (and is the fair
one); if they stay flat while the wall time per call stays above them, the
host holds the call.
"""
import argparse
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn.tuning import device_kernels, split_calls

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--causal", action="store_true")
ap.add_argument("--calls", type=int, default=60)
ap.add_argument("--shape", default="2,8192,32,128")
args = ap.parse_args()
b, s, n, d = map(int, args.shape.split(","))


def methods():
  cudnn = lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=args.causal, implementation="cudnn")
  ours = lambda m: lambda q, k, v: jaxattn.dot_product_attention(
      q, k, v, is_causal=args.causal, method=m)
  return {"cudnn_bf16": (jnp.bfloat16, cudnn),
          "fp32": (jnp.float16, ours("fp32")),
          "fp8": (jnp.float16, ours("fp8"))}


log = open(args.out, "w")


def emit(line):
  print(line, flush=True)
  log.write(line + "\n")


smi = subprocess.Popen(
    ["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu",
     "--format=csv,noheader", "-lms", "100"],
    stdout=open(args.out + ".smi.csv", "w"), stderr=subprocess.DEVNULL)
keys = jax.random.split(jax.random.key(0), 3)
emit(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, {args.shape} "
     f"{'causal' if args.causal else 'non-causal'}, {args.calls} calls")
for name, (dtype, fn) in methods().items():
  q, k, v = (jax.random.normal(x, (b, s, n, d), jnp.float32).astype(dtype)
             for x in keys)
  f = jax.jit(fn)
  for _ in range(3):
    jax.block_until_ready(f(q, k, v))
  t0 = time.perf_counter()
  for _ in range(args.calls):
    out = f(q, k, v)
  jax.block_until_ready(out)
  wall = (time.perf_counter() - t0) / args.calls * 1e3
  per_call = split_calls(device_kernels(f, (q, k, v), args.calls),
                         args.calls)
  if per_call is None:
    emit(f"{name}: the traced GPU kernels do not split into {args.calls} "
         f"equal calls")
    continue
  starts = [c[0][1] for c in per_call]
  periods = [(b_ - a) / 1e6 for a, b_ in zip(starts, starts[1:])]
  main = [max(e[2] for e in c) / 1e6 for c in per_call]
  emit(f"{name}: wall {wall:.3f} ms a call (untraced); traced periods "
       f"first 5 {statistics.median(periods[:5]):.3f}, last 5 "
       f"{statistics.median(periods[-5:]):.3f}, all "
       f"{statistics.median(periods):.3f} ms; attention kernel first 5 "
       f"{statistics.median(main[:5]):.3f}, last 5 "
       f"{statistics.median(main[-5:]):.3f} ms")
smi.terminate()
emit(f"(clocks and power every 100 ms: {args.out}.smi.csv)")

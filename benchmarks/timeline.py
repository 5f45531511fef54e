"""Where an end-to-end call's time goes on the GPU: every kernel of the
last of a few back-to-back calls, from jax's profiler (CUPTI), with the
idle gaps between them, for the methods of ``jaxattn.bench`` at
2x8192x32x128:

    python benchmarks/timeline.py OUT.log [--causal]

For each method it prints the call's time (``jaxattn.timing.time_call``,
as the benchmark times it, with cuDNN bf16 in the same process), then one
traced call's kernels in launch order (start offset, duration, the idle
gap before it) and a summary: the kernels' busy time, the gaps, and the
busy time outside the attention kernel (the preprocessing).
"""
import argparse

import jax
import jax.numpy as jnp

import jaxattn
from jaxattn.timing import device_kernels, split_calls, time_call

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--causal", action="store_true")
ap.add_argument("--methods", default="cudnn_bf16,fp32,int8,int8_half,fp8,sage")
ap.add_argument("--shape", default="2,8192,32,128")
args = ap.parse_args()
b, s, n, d = map(int, args.shape.split(","))
CALLS = 4


def method_fn(name):
  if name == "cudnn_bf16":
    return jnp.bfloat16, lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=args.causal, implementation="cudnn")
  method, opts = {"int8_half": ("int8", {"pv_dtype": "fp16"})}.get(
      name, (name, {}))
  return jnp.float16, lambda q, k, v: jaxattn.dot_product_attention(
      q, k, v, is_causal=args.causal, method=method, **opts)


keys = jax.random.split(jax.random.key(0), 3)
log = open(args.out, "w")


def emit(line=""):
  print(line, flush=True)
  log.write(line + "\n")


emit(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, "
     f"{args.shape} {'causal' if args.causal else 'non-causal'}")
summary = []
for name in args.methods.split(","):
  dtype, fn = method_fn(name)
  q, k, v = (jax.random.normal(x, (b, s, n, d), jnp.float32).astype(dtype)
             for x in keys)
  f = jax.jit(fn)
  ms = time_call(f, (q, k, v), iters=10, reps=5) * 1e3
  per_call = split_calls(device_kernels(f, (q, k, v), CALLS), CALLS)
  if per_call is None:
    emit(f"== {name}: {ms:.3f} ms per call; the traced GPU kernels do not "
         f"split into {CALLS} equal calls")
    continue
  call = per_call[-1]
  period = (call[0][1] - per_call[-2][0][1]) / 1e6
  emit(f"== {name}: {ms:.3f} ms per call (time_call); traced call "
       f"{len(call)} kernels, {period:.3f} ms from the previous call's start")
  t0, end = call[0][1], call[0][1]
  busy = gaps = prep = 0
  main = max(call, key=lambda e: e[2])
  for kname, start, dur in call:
    gap = max(start - end, 0)
    emit(f"  {(start - t0) / 1e3:9.1f} us  {dur / 1e3:9.1f} us  gap "
         f"{gap / 1e3:6.1f}  {kname[:90]}")
    busy += dur
    gaps += gap
    if (kname, start, dur) != main:
      prep += dur
    end = max(end, start + dur)
  emit(f"  busy {busy / 1e6:.3f} ms, gaps {gaps / 1e6:.3f} ms, attention "
       f"kernel {main[2] / 1e6:.3f} ms, other kernels {prep / 1e6:.3f} ms")
  summary.append((name, ms, busy / 1e6, gaps / 1e6, main[2] / 1e6,
                  prep / 1e6))
emit("\nmethod        call ms  busy ms  gaps ms  kernel ms  other ms")
for row in summary:
  emit("%-12s %8.3f %8.3f %8.3f %10.3f %9.3f" % row)

"""A/B of how the Mosaic adapters choose between the kernel's fused and
exact exponents, end to end on the H100, in one process against cuDNN
bfloat16:

  python benchmarks/exponent_switch.py OUT.json [--causal]
      --part methods|fp32|flag|stack [--shape B,S,N,D] [--layers L]
      [--window W]

``kernel``: the kernel holds both exponents and branches on the flag of a
bound on the scores (``jaxattn.backends.mosaic._exact_when_needed``, the
default); ``cond``: an XLA ``lax.cond`` on that bound picks one of two
kernels (``EXPONENT_BY_COND``; the host waits for its predicate); ``fused``:
the fused exponent always, with no bound and no choice (the time the
choice costs; not safe for huge scores); with ``--part fp32`` (fp32 only)
also ``exact``: the exact exponent always, with no bound (fp32's default
since ``b885042``), and ``cond`` reads Q and K for fp32's bound
(``FP32_SCORE_BOUND``).  ``--part methods`` compares ``cond`` with
``fused``; ``--part flag`` ``kernel`` with ``cond`` and ``fused`` for the
quantized methods; ``--part stack`` times ``--layers`` calls in a row in
one jitted function (each output the next call's queries, as layers
chain), where a host wait per call also holds back the launches behind
it, against as many cuDNN calls; with ``--window W`` the calls take
``local_window_size=W``, and ``cond`` also finds the rows a NaN/Inf
reaches under a second ``lax.cond`` (``nonfinite.REACHED_BY_RANGES``
off), as before 2026-11-27.  Packed rows (8 documents of random
lengths per row) run in the causal calls of ``methods`` and ``flag``.
Each call is compiled ahead of time, then timed in three rounds of
alternating order; the record's ``checks`` say whether the first two
settings' outputs are the same bits, on ordinary inputs and with a NaN in
one query row and an Inf in one key.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import api, nonfinite
from jaxattn.backends import mosaic as mosaic_backend
from jaxattn.tuning import (alternating_rounds, api_calls_per_setting,
                            benchmark_args, nonfinite_inputs,
                            packed_segments, random_btnh,
                            record_against_cudnn, write_record)

ATTRS = ("FP32_SCORE_BOUND", "EXPONENT_BY_COND", "_exact_when_needed")
DEFAULT = mosaic_backend._exact_when_needed
FUSED = lambda kernel, bound: kernel(exact_exponent=False)
SETTINGS = {
    "methods": (("cond", (True, True, DEFAULT)),
                ("fused", (True, True, FUSED))),
    "fp32": (("cond", (True, True, DEFAULT)), ("fused", (True, True, FUSED)),
             ("exact", (False, True, DEFAULT))),
    "flag": (("kernel", (False, False, DEFAULT)),
             ("cond", (False, True, DEFAULT)),
             ("fused", (False, False, FUSED))),
}
SETTINGS["stack"] = SETTINGS["flag"][:2]
QUANTIZED = ("int8", "sage", "fp8", "fmha_int8")


def _defaults():
  for a, x in zip(ATTRS, SETTINGS["flag"][0][1]):
    setattr(mosaic_backend, a, x)
  nonfinite.REACHED_BY_RANGES = True


def stack_calls(settings, methods, q, k, v, *, causal, layers, window=None):
  """``"method/setting" -> (compiled, args)``: ``layers`` API calls in a
  row, each output the next one's queries (checks as
  :func:`api_calls_per_setting`'s), and the cuDNN bfloat16 stack as the
  reference."""
  def stack(attend):
    def run(q, k, v, **options):
      for _ in range(layers):
        q = attend(q, k, v, **options).astype(q.dtype)
      return q
    return run

  calls, checks = api_calls_per_setting(
      mosaic_backend, ATTRS, settings,
      [(m, m, {"local_window_size": window}) for m in methods],
      [(q, k, v), nonfinite_inputs(q, k, v)], causal=causal,
      log=lambda m: print(m, flush=True), wrap=stack,
      on_setting=lambda s: setattr(nonfinite, "REACHED_BY_RANGES",
                                   s != "cond"))
  _defaults()
  ref_args = tuple(x.astype(jnp.bfloat16) for x in (q, k, v))
  reference = (jax.jit(stack(functools.partial(
      jax.nn.dot_product_attention, is_causal=causal,
      local_window_size=window, implementation=(
          "cudnn" if jax.default_backend() == "gpu" else "xla")))), ref_args)
  return calls, checks, reference


def main(a):
  q, k, v = random_btnh(a.shape)
  if a.part == "stack":
    calls, checks, reference = stack_calls(
        SETTINGS["stack"], QUANTIZED, q, k, v, causal=a.causal,
        layers=a.layers, window=a.window)
    rows = alternating_rounds(calls, reference=reference,
                              log=lambda m: print(m, flush=True))
    b, s, h, d = a.shape
    write_record(a.out, causal=a.causal, shape=f"BTNH {b}x{s}x{h}x{d}",
                 layers=a.layers, window=a.window,
                 reference=f"cuDNN bf16 x {a.layers}", rows=rows,
                 checks=checks)
    return
  inputs = [(q, k, v), nonfinite_inputs(q, k, v)]
  segs = packed_segments(np.random.default_rng(0), a.shape[0], a.shape[1], 8)
  plain = {"fp32": ("fp32",), "methods": ("fp32", "int8", "sage", "fp8"),
           "flag": QUANTIZED}[a.part]
  packed = {"fp32": ("fp32",), "methods": ("fp32", "fp8"),
            "flag": ("fp8", "sage")}[a.part]
  methods = [(m, m, {}) for m in plain]
  if a.causal:
    methods += [(f"packed_{m}", m, {"q_segment_ids": segs}) for m in packed]
  calls, checks = api_calls_per_setting(
      mosaic_backend, ATTRS, SETTINGS[a.part], methods, inputs,
      causal=a.causal, log=lambda m: print(m, flush=True))
  _defaults()
  record_against_cudnn(a.out, calls, (q, k, v), causal=a.causal,
                       checks=checks)


if __name__ == "__main__":
  main(benchmark_args(causal=True, parts=tuple(SETTINGS), extra=(
      ("--layers", dict(type=int, default=8)),
      ("--window", dict(type=int, default=None)))))

"""A/B of the 8-bit FMHA's pre-processing: XLA's amax and quantizing
passes with a non-finite guard in front (``nonfinite.confined``: row flags
and finite copies; the form before 2026-11-26), against an XLA amax pass
and one Pallas quantizing pass per tensor that flags the non-finite rows
itself (:func:`jaxattn.operands.fmha_operands`).  On the H100, in one
process against cuDNN bfloat16; also the method end to end and its parts
(the kernel alone, the output's quantization).

  python benchmarks/fmha_prep.py OUT.json [--shape B,S,N,D]

The two forms' operands must be the same bits (V up to the kernel's key
order), on ordinary inputs and with a NaN in one query row and an Inf in
one key.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import api, base, fmha, nonfinite, operands
from jaxattn.tuning import (benchmark_args, nonfinite_inputs, random_btnh,
                            record_against_cudnn)
from pallas_kernels import mosaic


def xla_operands(q, k, v, kv_lens, *, scale, config, block_k):
  """The form before: flags and finite copies, then fmha_quantize in XLA,
  the column sums and V transposed (the kernel then permutes V's keys)."""
  flags = (nonfinite.row_flags(q), nonfinite.row_flags(k)
           | nonfinite.row_flags(v))
  q, k, v = (nonfinite.finite(x) for x in (q, k, v))
  qz = fmha.fmha_quantize(q, k, v, kv_lens, config=config)
  b = q.shape[0]
  s_pad = -(-k.shape[1] // block_k) * block_k
  v8 = jnp.pad(qz["v"], [(0, 0), (0, s_pad - k.shape[1]), (0, 0), (0, 0)])
  colsum = v8.astype(jnp.int32).reshape(b, s_pad // block_k, block_k,
                                        *v8.shape[2:]).sum(axis=2)
  v_t = mosaic.permute_keys(operands.kv_heads_last(qz["v"]), axis=3)
  s_factor = qz["q_scale"] * qz["k_scale"] * (scale * base.LOG2E)
  return dict(q=qz["q"], k=qz["k"], v=v_t, colsum=colsum.transpose(0, 2, 1, 3),
              s_factor=s_factor, flags=flags)


def pallas_operands(q, k, v, kv_lens, *, scale, config, block_k):
  ops, _ = operands.fmha_operands(q, k, v, kv_lens, scale=scale,
                                  config=config, block_k=block_k,
                                  v_key_order=True)
  return dict(q=ops.q, k=ops.k, v=ops.v, colsum=ops.v_colsum,
              s_factor=ops.q_scale[0, 0, 0],
              flags=(ops.q_nonfinite, ops.kv_nonfinite))


def main(out_path, shape):
  b, s, h, d = shape
  q, k, v = random_btnh(shape)
  lens = jnp.full((b,), s, jnp.int32)
  bad = nonfinite_inputs(q, k, v)
  cfg = api.config_for("fmha_int8", "mosaic")
  kw = dict(scale=d ** -0.5, config=cfg, block_k=cfg.block_k)
  calls, checks = {}, {}
  outs = {}
  for name, fn in (("xla", xla_operands), ("pallas", pallas_operands)):
    compiled = jax.jit(lambda q, k, v, fn=fn: fn(q, k, v, lens, **kw)).lower(
        q, k, v).compile()
    calls[f"operands/{name}"] = (compiled, (q, k, v))
    outs[name] = [jax.tree.map(np.asarray, compiled(*x)) for x in
                  ((q, k, v), bad)]
  for i, case in enumerate(("normal", "nan_inf")):
    a, c = outs["xla"][i], outs["pallas"][i]
    v_len = c["v"].shape[-1]
    checks[case] = {n: bool(np.array_equal(
        np.asarray(a[n])[..., :v_len] if n == "v" else a[n], c[n]))
        for n in ("q", "k", "v", "colsum", "s_factor")}
    checks[case]["flags"] = all(np.array_equal(x, y) for x, y in
                                zip(a["flags"], c["flags"]))
    print(case, checks[case], flush=True)
  e2e = jax.jit(lambda q, k, v: api.dot_product_attention(
      q, k, v, method="fmha_int8", implementation="mosaic"))
  calls["fmha_int8/e2e"] = (e2e.lower(q, k, v).compile(), (q, k, v))
  # the parts of the call: the kernel alone on its operands, and the
  # output's quantization with the non-finite rows
  ordered = mosaic.p_in_registers()   # (the interpreter: natural order)
  ops, v_scale = operands.fmha_operands(q, k, v, lens, v_key_order=ordered,
                                        **kw)
  bk = cfg.block_k
  kernel_args = (ops.q, ops.k, ops.v, ops.q_scale,
                 ops.k_scale[:, ::bk].transpose(0, 2, 1), ops.v_colsum,
                 jnp.broadcast_to(v_scale / 255.0, (b, h, d)))
  kernel = jax.jit(lambda q8, k8, v8, qs, kbs, colsum, osc: (
      mosaic.mosaic_attention(
          q8, k8, v8, lens, qk="int8", pv="uint8", is_causal=False,
          params=mosaic.MosaicParams(block_k=bk), q_scale=qs,
          k_block_scale=kbs, v_colsum=colsum, v_keys_ordered=ordered,
          out_scale=osc, out_shift=jnp.zeros_like(osc),
          out_dtype=jnp.float32)))
  calls["fmha_int8/kernel"] = (kernel.lower(*kernel_args).compile(),
                               kernel_args)
  o32 = kernel(*kernel_args)
  output = jax.jit(lambda o, qb, kvb: nonfinite.poison(
      fmha.method_output(o, config=cfg).astype(q.dtype),
      nonfinite.rows_reached(qb, kvb, None, lens, is_causal=False,
                             q_shape=q.shape)))
  out_args = (o32, ops.q_nonfinite, ops.kv_nonfinite)
  calls["fmha_int8/output"] = (output.lower(*out_args).compile(), out_args)
  record_against_cudnn(out_path, calls, (q, k, v), causal=False,
                       checks=checks)


if __name__ == "__main__":
  a = benchmark_args()
  main(a.out, a.shape)

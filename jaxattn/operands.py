"""Quantized operands: what the quantized kernels take, built once by the
same quantizers for every backend.

:func:`quantized_operands` quantizes Q, K and V for ``method`` ("sage",
"int8", "fp8") with the references' arithmetic, bit for bit given the
same means, and lays them out the way the kernels take them
(:class:`QuantizedOperands`).  The Triton passes of
:mod:`pallas_kernels.quantizers` make them in two phases, a launch per
kind of pass and warp count in each (:func:`fused_operands`;
:func:`fused_qk` for Q and K alone): the first reads the tensors whose
statistics the second needs (sage's key sums and V's sums, max and min,
beside the Q pass with its query-block means;
INT8's and fp8's per-head amax) and the second quantizes the rest: each
input read once for its values, Q with per-row scales (``scale * log2
e``, the softmax in base 2, folded in after), K with per-key scales and
SageAttention2's smoothing bias from the same key tiles, the 8-bit V
written transposed to ``[B, K, D, S]`` beside the per-channel epilogue
``O / l * out_scale + out_shift``.  sage's "tensor" granularity keeps the
BTNH XLA quantizers (:func:`sage_inputs`, :func:`int8_inputs`,
:func:`fp8_inputs`, which are also the bit-for-bit checks of the passes).

:func:`fmha_operands` does the same for the 8-bit FMHA (uint8 P against int8
V through the column-sum identity).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import base, fmha, fp8, int_flash, nonfinite, pasa, quant, sage
from pallas_kernels import key_shift, quantizers


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedOperands:
  """The operands and scales of a quantized kernel call (a pytree; the
  operand types and layout flags are static).

  Attributes:
    q: ``[B, T, N, D]`` int8 (int4 values for ``qk="int4"`` packed two per
      byte in halves: ``[B, T, N, ceil(D / 2)]``) or float8_e4m3fn.
    q_scale: float32 ``[B, T, N]``, times ``scale * log2 e``.
    k: ``[B, S, K, D]`` like ``q``; k_scale: float32 ``[B, S, K]``.
    v: 8-bit ``[B, K, D, S]`` (key dimension contiguous; with
      ``v_keys_ordered`` each 16-key chunk in the Mosaic kernel's
      register-operand order, S padded to 16), or float16 ``[B, S, K, D]``
      for ``pv="fp16"``.
    q_block_bias: float32 ``[B, N, ceil(T / bias_rows), S]``, a base-2 score
      bias shared by each block of ``bias_rows`` query rows
      (SageAttention2's ``c q_m K_smoothed^T``), or None.
    v_block_scale: float32 ``[B, K, ceil(S / block_k)]``, or None.
    v_colsum: int32 ``[B, K, ceil(S / block_k), D]`` column sums of each
      int8 V block (``pv="uint8"``), or None.
    out_scale, out_shift: float32 ``[B, K, D]``, the epilogue ``O / l *
      out_scale + out_shift``, or None.
    out_row_scale: float32 ``[B, T, N]``, a factor of each output row
      applied after the kernel (the V scale of the row's packed document),
      or None.
    k_shift: float32 ``[B, K, D]``, the key mean the quantized keys are
      shifted by (SageAttention's ``smooth_k``): each row's scores lie
      ``scale q . k_shift`` below the method's, which the kernel's
      log-sum-exp adds back; None: no shift.
    score_bound: float32 scalar, at least ``max |S|`` of the base-2 scores
      ``S q_scale k_scale (+ q_block_bias)``, from the scales (None: not
      known).
    q_nonfinite: bool ``[B, T, N]``, the query rows that held a NaN/Inf
      (quantized as 0; :mod:`jaxattn.nonfinite`), or None.
    kv_nonfinite: bool ``[B, S, K]``, the keys whose key or value held
      one, or None.
    qk: "int8", "int4" or "fp8"; pv: "int8", "fp8", "fp16" or "uint8".
    bias_rows: query rows per ``q_block_bias`` row.
    v_keys_ordered: V's keys are in the register-operand order.
    k_scale_keys: keys that share one K scale, counted from key 0 (1: per
      token; ``block_k``: per block; ``S`` or more: one per head), so that
      a kernel can take one scale per key block where they allow it.
  """
  q: jax.Array
  q_scale: jax.Array
  k: jax.Array
  k_scale: jax.Array
  v: jax.Array
  q_block_bias: jax.Array | None = None
  v_block_scale: jax.Array | None = None
  v_colsum: jax.Array | None = None
  out_scale: jax.Array | None = None
  out_shift: jax.Array | None = None
  out_row_scale: jax.Array | None = None
  k_shift: jax.Array | None = None
  score_bound: jax.Array | None = None
  q_nonfinite: jax.Array | None = None
  kv_nonfinite: jax.Array | None = None
  qk: str = dataclasses.field(default="int8", metadata=dict(static=True))
  pv: str = dataclasses.field(default="int8", metadata=dict(static=True))
  bias_rows: int | None = dataclasses.field(default=None,
                                            metadata=dict(static=True))
  v_keys_ordered: bool = dataclasses.field(default=False,
                                           metadata=dict(static=True))
  k_scale_keys: int = dataclasses.field(default=1,
                                        metadata=dict(static=True))


def kv_heads_last(x):
  """``[B, S, K, D] -> [B, K, D, S]`` (the 8-bit PV operand layout)."""
  return x.transpose(0, 2, 3, 1)


def _channels(x, shape):
  """A per-head scale ``[B, K]`` (or per-channel ``[B, K, D]``) as
  ``[B, K, D]`` float32."""
  x = x.astype(jnp.float32)
  return jnp.broadcast_to(x[..., None] if x.ndim == 2 else x, shape)


def _pack_int4(x):
  """int4 values in int8 containers ``[..., D]`` -> int8 ``[..., ceil(D /
  2)]`` packed in halves (an odd ``D`` gets a zero channel first)."""
  x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, x.shape[-1] % 2)])
  return quant.pack_int4_halves(x)


# The quantizers below are the references' (jaxattn.sage.sage_quantize,
# jaxattn.int_flash.int8_quantize, jaxattn.fp8.fp8_quantize) written on the
# BTNH arrays directly instead of per head through vmap: the same values
# (tests/test_prepare.py checks them bit for bit), in fewer passes over
# memory and without the transposes that vmap's head axis costs.


def _group_amax(x, group: int):
  """``max |x|`` of ``x`` ``[B, L, H, D]`` over groups of ``group`` rows (and
  ``D``): ``[B, ceil(L / group), H]`` (a group longer than ``L`` is one)."""
  n = x.shape[1]
  group = max(1, min(group, n))
  amax = jnp.abs(x).max(axis=-1)                         # [B, L, H]
  amax = jnp.pad(amax, [(0, 0), (0, -n % group), (0, 0)])
  return amax.reshape(amax.shape[0], -1, group, amax.shape[2]).max(axis=2)


def _expand(per_group, group: int, n: int):
  """``[B, G, H]`` per-group values as one per row ``[B, n, H]``."""
  return jnp.repeat(per_group, max(1, min(group, n)), axis=1)[:, :n]


def _group_scales(x, group: int, bits: int):
  """Per-row scales ``fl(amax * fl(1/qmax))`` of ``x`` ``[B, L, H, D]`` over
  groups of rows: ``[B, L, H]`` (:func:`jaxattn.sage._row_scales`)."""
  rcp = np.float32(1.0 / quant.qmax(bits))
  per_group = sage.rounded(_group_amax(x, group) * rcp)
  return _expand(per_group, group, x.shape[1])


def _valid_keys(k, kv_lens):
  """``[B, S, 1, 1]``: key ``s`` of batch ``b`` is below ``kv_lens[b]``."""
  return base.zero_beyond(jnp.ones(k.shape[:2] + (1, 1), bool), kv_lens, 1)


def _key_mean(x, kv_lens):
  """SageAttention2's token mean ``fl(sum_s x * fl(1 / n))`` over the ``n =
  min(kv_len, S)`` visible keys of ``x`` ``[B, S, K, D]``: ``[B, K, D]``
  float32 (:func:`jaxattn.sage.quantize_kv_head`'s ``k_mean``)."""
  kv_lens = jnp.asarray(kv_lens, jnp.int32)
  visible = jnp.where(_valid_keys(x, kv_lens), x.astype(jnp.float32), 0.0)
  return _token_mean(visible.sum(axis=1), kv_lens, x.shape[1])


def _token_mean(total, kv_lens, s: int):
  """``fl(total * fl(1 / n))`` with ``n = max(min(kv_len, s), 1)``: the
  mean of ``[B, K, D]`` sums over each batch row's visible keys."""
  count = quant.reciprocal(jnp.maximum(jnp.minimum(kv_lens, s), 1))
  return sage.rounded(total * count[:, None, None])


def _query_block_means(q, block_q: int):
  """SageAttention2's query-block means ``fl(sum x * fl(1 / count))`` of
  ``q`` ``[B, T, N, D]`` over blocks of ``block_q`` rows (the last one
  partial): ``[B, ceil(T / block_q), N, D]`` float32, and ``q`` float32
  padded to whole blocks ``[B, nqb, block_q, N, D]``."""
  b, t, n, d = q.shape
  nqb = -(-t // block_q)
  qf = jnp.pad(q.astype(jnp.float32),
               [(0, 0), (0, nqb * block_q - t), (0, 0), (0, 0)])
  qf = qf.reshape(b, nqb, block_q, n, d)
  counts = jnp.clip(t - jnp.arange(nqb) * block_q, 1, block_q)
  rcp = quant.reciprocal(counts.astype(jnp.float32))[None, :, None, None]
  return sage.rounded(qf.sum(axis=2) * rcp), qf


def int8_inputs(q, k, v, kv_lens, *, config, v_values: bool = True,
                qk_values: bool = True) -> dict:
  """:func:`jaxattn.int_flash.int8_quantize` on BTNH arrays (same entries;
  ``v_values=False`` leaves out the int8 V, keeping its scale: the kernels
  take V from :func:`quantizers.v_operand`; ``qk_values=False`` leaves out Q and K and
  their scales: :func:`fused_qk` makes them)."""
  f32 = jnp.float32
  valid = _valid_keys(k, kv_lens)
  out = {}
  if qk_values:
    q8, q_scale = int_flash.quantize_per_token(q)
    k8, k_scale = int_flash.quantize_per_token(jnp.where(valid, k.astype(f32), 0.0))
    out = dict(q=q8, q_scale=q_scale, k=k8, k_scale=k_scale)
  vf = jnp.where(valid, v.astype(f32), 0.0)
  if config.pv_dtype == "fp16":
    out["v"] = vf.astype(jnp.float16)
    return out
  if config.v_granularity == "tensor":
    out["v_scale"] = jnp.abs(vf).max(axis=(1, 3)) * int_flash.RCP_R  # [B, K]
    rows = out["v_scale"][:, None, :, None]
  else:                                                     # [B, nb, K]
    out["v_scale"] = _group_amax(vf, config.block_k) * int_flash.RCP_R
    rows = _expand(out["v_scale"], config.block_k, vf.shape[1])[..., None]
  if v_values:
    out["v"] = int_flash.quantize_scaled(vf, rows)
  return out


def _fp8_head_scale(x):
  """fp8's per-head scale ``amax |x| * fl(1/448)`` of ``x`` ``[B, L, H,
  D]`` (float32, the rows to count already masked): ``[B, H]``."""
  return jnp.abs(x).max(axis=(1, 3)) * fp8.RCP_FP8_MAX


def fp8_inputs(q, k, v, kv_lens, *, config, v_values: bool = True,
               qk_values: bool = True) -> dict:
  """:func:`jaxattn.fp8.fp8_quantize` on BTNH arrays (same entries;
  ``v_values=False`` leaves out the fp8 V, keeping its scale;
  ``qk_values=False`` leaves out Q, K and their scales)."""
  f32 = jnp.float32
  valid = _valid_keys(k, kv_lens)
  block = config.granularity == "block"

  def quantize(x, group, values=True):
    if not block:
      sc = _fp8_head_scale(x)                              # [B, H]
      inv = quant.reciprocal(sc)[:, None, :, None]
    else:
      sc = _group_amax(x, group) * fp8.RCP_FP8_MAX         # [B, G, H]
      inv = quant.reciprocal(_expand(sc, group, x.shape[1]))[..., None]
    return (quant.quantize_fp8(x, inv) if values else None), sc

  v8, sv = quantize(jnp.where(valid, v.astype(f32), 0.0), config.block_k,
                    v_values)
  out = dict(v_scale=sv)
  if qk_values:
    q8, sq = quantize(q.astype(f32), config.block_q)
    k8, sk = quantize(jnp.where(valid, k.astype(f32), 0.0), config.block_k)
    out.update(q=q8, q_scale=sq, k=k8, k_scale=sk)
  return {**out, "v": v8} if v_values else out


def sage_inputs(q, k, v, kv_lens, *, scale: float, config,
                v_values: bool = True) -> dict:
  """SageAttention2's pre-processing written on the BTNH arrays directly:
  the same quantized values and scales as :func:`jaxattn.sage.sage_quantize`
  (the reference, per head through ``vmap``), in fewer passes and without
  its per-head layouts, the float32 smoothed-key copy or the transposes.

  Returns ``q`` int8 ``[B, T, N, D]``, ``q_scale_folded`` ``[B, T, N]``,
  ``k`` int8 ``[B, S, K, D]``, ``k_scale`` ``[B, S, K]``, ``k_mean``
  ``[B, K, D]`` (zeros without ``smooth_k``), ``v``
  (float8_e4m3fn or float16 ``[B, S, K, D]``), ``v_scale`` (fp8) and
  ``v_mean`` ``[B, K, D]``, and ``smooth_bias`` ``[B, N, nqb, S]`` (base e,
  ``q_m K_smoothed^T``) when ``smooth_q``.  ``v_values=False`` leaves out
  the fp8 V, keeping its scale and mean.
  """
  f32 = jnp.float32
  b, t, n, d = q.shape
  s, nk = k.shape[1], k.shape[2]
  g = n // nk
  bits = config.bits
  kv_lens = jnp.asarray(kv_lens, jnp.int32)
  valid = _valid_keys(k, kv_lens)
  out = {}

  k_mean = (_key_mean(k, kv_lens) if config.smooth_k
            else jnp.zeros((b, nk, d), f32))             # [B, K, D]
  ks = jnp.where(valid, k.astype(f32) - k_mean[:, None], 0.0)
  k_scale = _group_scales(ks, sage.k_group_rows(config, s), bits)
  out["k"] = quant.quantize_int(ks, quant.reciprocal(k_scale)[..., None], bits)
  out["k_scale"] = k_scale
  out["k_mean"] = k_mean
  out.update(sage_v_stats(v, kv_lens, config))
  if config.pv_dtype == "fp8" and v_values:
    vs = jnp.where(valid, v.astype(f32) - out["v_mean"][:, None], 0.0)
    out["v"] = quant.quantize_fp8(vs, quant.reciprocal(out["v_scale"])[:, None])

  bq = config.block_q
  q_mean, qf = _query_block_means(q, bq)                 # [B, nqb, N, D]
  nqb = qf.shape[1]
  if config.smooth_q:
    qm = q_mean.reshape(b, nqb, nk, g, d)
    out["smooth_bias"] = jnp.einsum(
        "bqkgd,bskd->bkgqs", qm, ks, precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=f32).reshape(b, n, nqb, s)
    real = (jnp.arange(nqb * bq) < t).reshape(1, nqb, bq, 1, 1)
    qf = jnp.where(real, qf - q_mean[:, :, None], 0.0)
  qs = qf.reshape(b, nqb * bq, n, d)
  q_scale = _group_scales(qs, sage.q_group_rows(config, nqb * bq), bits)
  q_scale, qs = q_scale[:, :t], qs[:, :t]
  out["q"] = quant.quantize_int(qs, quant.reciprocal(q_scale)[..., None], bits)
  out["q_scale_folded"] = q_scale * sage.log2_scale(scale)
  return out


def _fits_rows_kernel(*groups) -> bool:
  """:func:`quantizers.rows_operand` takes groups of 1 to 128 rows (powers of two);
  "tensor" scales (one amax over the whole sequence) stay with XLA."""
  return all(g in (1, 2, 4, 8, 16, 32, 64, 128) for g in groups)


def _fits_key_groups(n: int) -> bool:
  """The V pass scales groups of ``n`` keys itself (and sums int8 blocks of
  ``n``) where ``n`` is a power of two of at least 16 (whole 16-key chunks
  of the register-operand order) and at most 256."""
  return 16 <= n <= 256 and n & (n - 1) == 0


def fused_qk(method: str, q, k, kv_lens, *, scale: float,
             config) -> dict | None:
  """The 8-bit (or int4-valued) Q and K of ``method`` by the Triton passes
  of :mod:`pallas_kernels.quantizers` (:func:`fused_operands` without V):
  each read once for its values, K after its mean (the column sums of a
  first phase that also runs the Q pass), Q subtracting each query
  block's mean as the pass reads the block (SageAttention2's smoothing),
  the SageAttention2 bias from the same key tiles.

  The values and scales of :func:`sage_inputs` / :func:`int8_inputs` /
  :func:`fp8_inputs` bit for bit given the same means: sage's key mean and
  query-block means are the kernels' float32 sums, which may differ from
  XLA's in the last bits (summation order; equal on the CPU for the query
  means); ``q_block_bias`` (``c q_m K_smoothed^T``, ``c = scale log2 e``
  folded into ``q_m``) to float32 accumulation order.  fp8's per-head
  ("tensor") scales come from a first phase's amax.  None where a
  granularity does not fit the kernel (sage's "tensor", groups that are
  not powers of two up to 128): the XLA quantizers then.

  Returns ``q8``, ``q_scale`` ``[B, T, N]`` (unfolded), ``k8``, ``k_scale``
  ``[B, S, K]``, ``q_bad`` / ``k_bad`` (the rows that held a NaN/Inf,
  quantized as 0), and for "sage" ``q_block_bias`` ``[B, N, nqb, S]`` or
  None, ``bias_bound``, ``k_mean`` ``[B, K, D]`` (zeros without
  ``smooth_k``) and ``q_mean`` ``[B, nqb, N, D]`` (None without
  ``smooth_q``).
  """
  return fused_operands(method, q, k, None, kv_lens, scale=scale,
                        config=config)


def fused_operands(method: str, q, k, v, kv_lens, *, scale: float, config,
                   v_key_order: bool = False, segments=None) -> dict | None:
  """:func:`fused_qk` and, with ``v``, V's 8-bit operand ``[B, K, D, S]``
  (keys in the Mosaic kernel's register-operand order with
  ``v_key_order``), in two phases of :func:`quantizers.run_passes` (each a
  launch per kind of pass): the passes that need a whole-sequence
  statistic run in the second, after the first has computed it from the
  tensor it reads anyway.

  ======  ==========================================  ====================
  method  phase 1                                     phase 2
  ======  ==========================================  ====================
  sage    K's column sums, V's sums/max/min, the Q    K (the mean, the
          pass with its query-block means             bias), V (fp8 PV)
  int8    V's amax per head, Q, K (per token); V      V ("tensor" scale)
          with its own per-block scales ("block")
  fp8     "tensor": the amax per head of Q, K, V      Q, K, V
          "block": Q, K, V, each its own scales       (none)
  ======  ==========================================  ====================

  Without ``v``, or for float16 PV, there is no ``v8`` (the caller's XLA
  path).  int8's per-segment V scales (``segments``, "tensor") come from
  XLA (:func:`segment_v_scales`) before its V pass, as do per-block ones
  whose blocks the pass cannot take (:func:`_fits_key_groups`).

  sage's V statistics are the kernel's (``v_mean`` a float32 sum in the
  kernel's order, the fp8 ``v_scale`` exact from its max and min:
  :func:`sage_v_stats`); every other scale is a max, exact.  V's values
  are the XLA quantizers' bit for bit given the same statistics.

  Returns :func:`fused_qk`'s dict with ``v8``, ``v_bad`` (bool ``[B, K,
  S]``) and ``v_scale`` (sage: ``[B, K, D]``, with ``v_mean``; int8 and fp8
  "tensor": ``[B, K]``; "block": ``[B, K, ceil(S / block_k)]``), or None
  as :func:`fused_qk`.
  """
  b, t, n, d = q.shape
  s, nk = k.shape[1], k.shape[2]
  f32, i8, e4 = jnp.float32, jnp.int8, jnp.float8_e4m3fn
  kv_lens = jnp.asarray(kv_lens, jnp.int32)
  q_lens = jnp.full((b,), t, jnp.int32)
  rows = functools.partial(quantizers.rows_pass, flag_nonfinite=True)
  v_kw = dict(key_order=v_key_order, flag_nonfinite=True)
  out = {}

  def unpack(prefix, res):   # a rows pass's results
    x8, sc, extra, bad = res
    out.update({f"{prefix}8": x8, f"{prefix}_scale": sc,
                f"{prefix}_bad": bad})
    return extra

  def take_v(res, **extra):   # a V pass's results
    out.update(v8=res[0], v_bad=res[1], **extra)

  if method == "int8":
    q_pass = rows(q, q_lens, group=1, dtype=i8)
    k_pass = rows(k, kv_lens, group=1, dtype=i8)
    v_int8 = v is not None and config.pv_dtype != "fp16"
    block_v = v_int8 and config.v_granularity == "block"
    if block_v and _fits_key_groups(config.block_k):
      # one phase: V scales each block of keys itself
      rq, rk, rv = quantizers.run_passes(
          q_pass, k_pass, quantizers.v_pass(v, kv_lens, dtype=i8,
                                            group=config.block_k, **v_kw))
      unpack("q", rq)
      unpack("k", rk)
      take_v(rv, v_scale=rv[2])
      return out
    tensor_v = v_int8 and not block_v and segments is None
    rq, rk, amax = quantizers.run_passes(
        q_pass, k_pass,
        quantizers.stats_pass(v, kv_lens, mode=quantizers.STATS_AMAX)
        if tensor_v else None)
    unpack("q", rq)
    unpack("k", rk)
    if not v_int8:
      return out
    if tensor_v:
      v_scale = amax * int_flash.RCP_R                         # [B, K]
      res = quantizers.run_passes(quantizers.v_pass(
          v, kv_lens, dtype=i8,
          inv_channel=_channels(quant.reciprocal(v_scale),
                                (b, nk, v.shape[-1])),
          **v_kw))[0]
      take_v(res, v_scale=v_scale)
    elif not block_v:                       # one scale per segment
      per_key, per_row = segment_v_scales(v, kv_lens, segments, n)
      res = quantizers.run_passes(quantizers.v_pass(
          v, kv_lens, dtype=i8,
          inv_row=quant.reciprocal(per_key).transpose(0, 2, 1), **v_kw))[0]
      take_v(res, v_scale_per_key=per_key, v_scale_per_row=per_row)
    else:             # per-block scales from XLA (groups the pass cannot)
      vf = jnp.where(_valid_keys(v, kv_lens),
                     nonfinite.finite(v).astype(f32), 0.0)
      v_scale = _group_amax(vf, config.block_k) * int_flash.RCP_R
      inv = _expand(quant.reciprocal(v_scale), config.block_k, s)
      res = quantizers.run_passes(quantizers.v_pass(
          v, kv_lens, dtype=i8, inv_row=inv.transpose(0, 2, 1), **v_kw))[0]
      take_v(res, v_scale=v_scale.transpose(0, 2, 1))
    return out

  if method == "fp8":
    if config.granularity == "tensor":
      # one scale per head: the amax of the finite values (keys below the
      # length) first, then one quantizing pass each
      amax = lambda x, lens: quantizers.stats_pass(
          x, lens, mode=quantizers.STATS_AMAX)
      aq, ak, av = quantizers.run_passes(
          amax(q, q_lens), amax(k, kv_lens),
          amax(v, kv_lens) if v is not None else None)
      sq, sk = aq * fp8.RCP_FP8_MAX, ak * fp8.RCP_FP8_MAX       # [B, H]
      given = lambda x, lens, sc: rows(x, lens, group=1, dtype=e4, scale=sc)
      v_pass = None
      if v is not None:
        sv = av * fp8.RCP_FP8_MAX
        v_pass = quantizers.v_pass(
            v, kv_lens, dtype=e4,
            inv_channel=_channels(quant.reciprocal(sv), (b, nk, v.shape[-1])),
            **v_kw)
      rq, rk, rv = quantizers.run_passes(given(q, q_lens, sq),
                                         given(k, kv_lens, sk), v_pass)
      unpack("q", rq)
      unpack("k", rk)
      if v is not None:
        take_v(rv, v_scale=sv)
      return out
    if not _fits_rows_kernel(config.block_q, config.block_k):
      return None
    v_pass = None
    if v is not None:
      if not _fits_key_groups(config.block_k):
        return None
      v_pass = quantizers.v_pass(v, kv_lens, dtype=e4, group=config.block_k,
                                 **v_kw)
    rq, rk, rv = quantizers.run_passes(
        rows(q, q_lens, group=config.block_q, dtype=e4),
        rows(k, kv_lens, group=config.block_k, dtype=e4), v_pass)
    unpack("q", rq)
    unpack("k", rk)
    if v is not None:
      take_v(rv, v_scale=rv[2])
    return out

  if method != "sage":
    raise ValueError(f"no quantized kernel inputs for method {method!r}")
  bq = config.block_q
  q_group = sage.q_group_rows(config, -(-t // bq) * bq)
  k_group = sage.k_group_rows(config, s)
  if not _fits_rows_kernel(q_group, k_group, bq):
    return None
  bits = config.bits
  fp8_v = v is not None and config.pv_dtype == "fp8"
  # Phase 1: the key mean's sums, V's sums and extrema, and the Q pass
  # with its query-block means (from the tiles it reads anyway).
  q_pass = rows(q, q_lens, group=q_group, dtype=i8, bits=bits,
                shift="tile_mean" if config.smooth_q else None,
                block=bq if config.smooth_q else None)
  k_kw = dict(group=k_group, dtype=i8, bits=bits)
  k_first = not (config.smooth_q or config.smooth_k)   # nothing to wait for
  k_sums, v_stats, rq, rk = quantizers.run_passes(
      quantizers.stats_pass(k, kv_lens, mode=quantizers.STATS_SUM)
      if config.smooth_k else None,
      quantizers.stats_pass(v, kv_lens, mode=quantizers.STATS_EXTREMA)
      if fp8_v else None,
      q_pass, rows(k, kv_lens, **k_kw) if k_first else None)
  q_mean = unpack("q", rq)                              # [B, nqb, N, D]
  k_mean = (_token_mean(k_sums, kv_lens, s) if config.smooth_k
            else jnp.zeros((b, nk, d), f32))
  v_pass = None
  if fp8_v:
    total, hi, lo = v_stats
    stats = _sage_v_stats_from(total, hi, lo, kv_lens, s, config)
    out.update(stats)
    v_pass = quantizers.v_pass(
        v, kv_lens, dtype=e4,
        shift=stats["v_mean"] if config.smooth_v else None,
        inv_channel=quant.reciprocal(stats["v_scale"]), **v_kw)
  bias_q = None
  if config.smooth_q:                          # q_mean [B, nqb, N, D]
    nqb, g = q_mean.shape[1], n // nk  # [B, K, g * nqb, D]: a group's heads
    bias_q = (q_mean * sage.log2_scale(scale)).reshape(
        b, nqb, nk, g, d).transpose(0, 2, 3, 1, 4).reshape(b, nk, g * nqb, d)
  # Phase 2: K shifted by its mean, with the bias; V.
  if k_first:
    rv = quantizers.run_passes(v_pass)[0] if v_pass else None
  else:
    rk, rv = quantizers.run_passes(
        rows(k, kv_lens, shift=k_mean[:, None] if config.smooth_k else None,
             bias_q_mean=bias_q, **k_kw), v_pass)
  bias = unpack("k", rk)
  if rv is not None:
    take_v(rv)
  bias_bound = None
  if bias is not None:                              # [B, N, nqb, S]
    bias = bias.reshape(b, n, -1, s)
    # |q_m K_s^T| <= |q_m|_1 max |K_s| = |q_m|_1 qmax max(k_scale), from
    # the small arrays instead of a read of the bias
    bias_bound = (jnp.abs(bias_q).sum(axis=-1).max() * quant.qmax(bits)
                  * jnp.abs(out["k_scale"]).max())
  out.update(q_block_bias=bias, bias_bound=bias_bound, k_mean=k_mean,
             q_mean=q_mean)
  return out


def _sage_v_stats_from(total, hi, lo, kv_lens, s: int, config) -> dict:
  """``v_mean`` (zeros without ``smooth_v``) and the fp8 per-channel
  ``v_scale`` from V's column sums, max and min ``[B, K, D]`` over the
  visible keys (:func:`sage_v_stats`)."""
  mean = (_token_mean(total, kv_lens, s) if config.smooth_v
          else jnp.zeros(total.shape, jnp.float32))
  amax = jnp.maximum(jnp.maximum(hi - mean, mean - lo), 0.0)
  return dict(v_mean=mean, v_scale=sage.rounded(amax * sage.RCP_FP8_MAX))


def sage_v_stats(v, kv_lens, config, *, kernel: bool = False) -> dict:
  """SageAttention2's V statistics in one reduction pass: ``v_mean``
  ``[B, K, D]`` (zeros without ``smooth_v``) and, for ``pv_dtype="fp8"``,
  ``v_scale = fl(max_s |fl(v - v_mean)| * fl(1/448))`` per channel, the
  same values as :func:`sage_inputs` from the channel's max and min
  (``fl(. - m)`` is monotonic, so ``max |fl(v - m)| = max(fl(v_max - m),
  fl(m - v_min))``) instead of a second pass over the smoothed V; with
  ``pv_dtype="fp16"`` the smoothed float16 ``v``.

  ``kernel``: NaN/Inf count as 0 (as :func:`nonfinite.finite` makes
  them), and for fp8 PV where :func:`quantizers.column_stats_fits` the
  sum, max and min come from the Triton statistics pass, which sums in
  another order than XLA: the mean may differ from the XLA pass's in its
  last bits, and the scale with it.  (:func:`quantized_operands` takes
  them from the same pass at every shape, in the phase that quantizes
  Q: :func:`fused_operands`.)"""
  f32 = jnp.float32
  b, s, nk, d = v.shape
  kv_lens = jnp.asarray(kv_lens, jnp.int32)
  zeros = jnp.zeros((b, nk, d), f32)
  if (kernel and config.pv_dtype == "fp8"
      and quantizers.column_stats_fits(s, d)):
    total, hi, lo = quantizers.column_stats(v, kv_lens, extrema=True)
    return _sage_v_stats_from(total, hi, lo, kv_lens, s, config)
  if kernel:
    v = nonfinite.finite(v)
  valid = _valid_keys(v, kv_lens)
  vf = v.astype(f32)
  mean = _key_mean(v, kv_lens) if config.smooth_v else zeros
  if config.pv_dtype != "fp8":
    return dict(v_mean=mean, v=jnp.where(valid, vf - mean[:, None], 0.0)
                .astype(jnp.float16))
  hi = jnp.where(valid, vf, -jnp.inf).max(axis=1)
  lo = jnp.where(valid, vf, jnp.inf).min(axis=1)
  amax = jnp.maximum(jnp.maximum(hi - mean, mean - lo), 0.0)
  return dict(v_mean=mean,
              v_scale=sage.rounded(amax * sage.RCP_FP8_MAX))


def _score_bound(q_scale, k_scale, qmax, d, bias_bound=None):
  """``max |S|`` bound of ``(Q8 K8^T) q_scale k_scale (+ bias)`` with
  ``|Q8|, |K8| <= qmax``: ``qmax^2 D max q_scale max k_scale``."""
  amax = lambda x: jnp.max(jnp.abs(x)).astype(jnp.float32)
  bound = amax(q_scale) * amax(k_scale) * (float(qmax) ** 2 * d)
  return bound if bias_bound is None else bound + bias_bound


def segment_v_scales(v, kv_lens, segments, n_heads: int):
  """INT8's V scale per packed document (``v_granularity="tensor"``):
  ``(per key [B, S, K], per query row [B, T, N])``, each the ``amax / 127``
  of the V values of the segment's keys (finite values, keys below
  ``kv_lens``).  A query row sees only its own segment's keys, so the
  scale factors out of its ``P V`` exactly."""
  q_seg, kv_seg = segments
  vmax = jnp.abs(jnp.where(_valid_keys(v, kv_lens), nonfinite.finite(v), 0.0)
                 .astype(jnp.float32)).max(axis=-1)                # [B, S, K]
  per_key, per_row = jax.vmap(quant.segment_absmax)(vmax, kv_seg, q_seg)
  per_row = jnp.repeat(per_row, n_heads // v.shape[2], axis=2)
  return per_key * int_flash.RCP_R, per_row * int_flash.RCP_R


def quantized_operands(method: str, q, k, v, kv_lens, *, scale: float,
                       config, pack_int4: bool = True,
                       v_key_order: bool = False,
                       segments=None) -> QuantizedOperands:
  """The quantized operands of ``method`` ("sage", "int8" or "fp8").

  Args:
    q: ``[B, T, N, D]``; k, v: ``[B, S, K, D]`` (any float dtype); kv_lens
      int32 ``[B]``; scale: the softmax scale; config: the method's
      configuration.
    pack_int4: SageAttention2's int4 Q and K packed two per byte in halves
      (``qk="int4"``, :func:`jaxattn.quant.pack_int4_halves`; the Triton
      kernel), else int4 values in int8 containers (``qk="int8"``; the
      Mosaic kernel).
    v_key_order: an 8-bit V's keys in the Mosaic kernel's register-operand
      order (:func:`pallas_kernels.quantizers.key_order`).
    segments: ``(q_segment_ids [B, T], kv_segment_ids [B, S])`` of a packed
      call, or None: INT8's per-tensor V scale becomes one per segment
      (:func:`segment_v_scales`; the other methods' scales are unchanged).
  Returns: :class:`QuantizedOperands`, the references' quantized values and
    scales bit for bit given the same means (sage's key and query-block
    means and V mean are the kernels' float32 sums, which may differ from
    XLA's in the last bits; SageAttention2's bias to float32 accumulation
    order).  The Triton passes make them in two phases
    (:func:`fused_operands`); sage's "tensor" granularity (and groups the
    passes do not take) keeps the XLA quantizers.
  """
  b, t, n, d = q.shape
  s_len, nk = k.shape[1], k.shape[2]
  kv_shape = (b, nk, v.shape[-1])
  ones = lambda *shape: jnp.ones(shape, jnp.float32)
  # NaN/Inf count as 0 (:mod:`jaxattn.nonfinite`): the Triton passes
  # read the raw inputs and flag the rows; the XLA statistics and
  # quantizers read them through ``fin``, fused into their own passes.
  fin = nonfinite.finite
  v_flags = {}     # set by v8: the 8-bit V kernel flags V's keys

  def v8(dtype, shift=None, inv_channel=None, inv_row=None):
    """The 8-bit V ``[B, K, D, S]`` in one pass (the XLA paths')."""
    v_op, bad = quantizers.v_operand(
        v, kv_lens, dtype=dtype,
        shift=jnp.zeros(kv_shape, jnp.float32) if shift is None else shift,
        inv_channel=ones(*kv_shape) if inv_channel is None else inv_channel,
        inv_row=ones(b, nk, s_len) if inv_row is None else inv_row,
        key_order=v_key_order, flag_nonfinite=True)
    v_flags["kernel"] = bad
    return v_op

  def per_row(per_group, group):  # [B, G, K] -> one per key [B, K, S]
    return _expand(per_group, group, s_len).transpose(0, 2, 1)

  fused = fused_operands(method, q, k, v, kv_lens, scale=scale,
                         config=config, v_key_order=v_key_order,
                         segments=segments)
  if fused is not None and fused.get("v8") is not None:
    v_flags["kernel"] = fused["v_bad"]

  def with_flags(**ops):
    """The operands with the non-finite flags: from the kernels where they
    read the input, else one XLA reduction."""
    q_bad = nonfinite.row_flags(q) if fused is None else fused["q_bad"]
    k_bad = nonfinite.row_flags(k) if fused is None else fused["k_bad"]
    v_bad = v_flags.get("kernel")
    v_bad = (nonfinite.row_flags(v) if v_bad is None     # V through XLA
             else v_bad.transpose(0, 2, 1))
    return QuantizedOperands(q_nonfinite=q_bad, kv_nonfinite=k_bad | v_bad,
                             **ops)

  if method == "sage":
    fp8_pv = config.pv_dtype == "fp8"
    if fused is None:
      z = sage_inputs(fin(q), fin(k), fin(v), kv_lens, scale=scale,
                      config=config, v_values=False)
      q_block_bias = (z["smooth_bias"] * sage.log2_scale(scale)
                      if config.smooth_q else None)
      v_op = (v8(jnp.float8_e4m3fn, shift=z["v_mean"],
                 inv_channel=quant.reciprocal(z["v_scale"]))
              if fp8_pv else z["v"])
    else:
      z = dict(q=fused["q8"], k=fused["k8"], k_scale=fused["k_scale"],
               k_mean=fused["k_mean"],
               q_scale_folded=fused["q_scale"] * sage.log2_scale(scale))
      if fp8_pv:
        z.update(v_mean=fused["v_mean"], v_scale=fused["v_scale"])
        v_op = fused["v8"]
      else:                   # the smoothed float16 V (XLA)
        z.update(sage_v_stats(v, kv_lens, config, kernel=True))
        v_op = z["v"]
      q_block_bias = fused["q_block_bias"]
    q8, k8, qk = z["q"], z["k"], "int8"
    if config.qk_dtype == "int4" and pack_int4:
      q8, k8, qk = _pack_int4(q8), _pack_int4(k8), "int4"
    bias_bound = (jnp.abs(q_block_bias).max() if fused is None
                  else fused["bias_bound"]) if config.smooth_q else None
    return with_flags(
        q=q8, q_scale=z["q_scale_folded"], k=k8, k_scale=z["k_scale"],
        score_bound=_score_bound(z["q_scale_folded"], z["k_scale"],
                                 quant.qmax(config.bits), d, bias_bound),
        v=v_op, q_block_bias=q_block_bias,
        out_scale=(z["v_scale"] / quant.FP8_MAX if fp8_pv
                   else jnp.ones(kv_shape, jnp.float32)),
        out_shift=z["v_mean"], qk=qk, pv=config.pv_dtype,
        k_shift=z["k_mean"] if config.smooth_k else None,
        bias_rows=config.block_q if config.smooth_q else None,
        v_keys_ordered=v_key_order and fp8_pv,
        k_scale_keys=sage.k_group_rows(config, s_len))
  if method == "int8":
    z = dict(q=fused["q8"], q_scale=fused["q_scale"], k=fused["k8"],
             k_scale=fused["k_scale"])
    q_scale = z["q_scale"] * (scale * base.LOG2E)
    qk_ops = dict(q=z["q"], q_scale=q_scale, k=z["k"], k_scale=z["k_scale"],
                  score_bound=_score_bound(q_scale, z["k_scale"], 127, d),
                  qk="int8", pv=config.pv_dtype)
    if config.pv_dtype == "fp16":
      v16 = int8_inputs(q, k, fin(v), kv_lens, config=config,
                        qk_values=False)["v"]
      return with_flags(v=v16, **qk_ops)
    if config.v_granularity == "block":
      return with_flags(v=fused["v8"], v_block_scale=fused["v_scale"],
                        v_keys_ordered=v_key_order, **qk_ops)
    if segments is not None:
      return with_flags(
          v=fused["v8"], out_scale=jnp.ones(kv_shape, jnp.float32),
          out_shift=jnp.zeros(kv_shape, jnp.float32),
          out_row_scale=fused["v_scale_per_row"],
          v_keys_ordered=v_key_order, **qk_ops)
    return with_flags(
        v=fused["v8"], out_scale=_channels(fused["v_scale"], kv_shape),
        out_shift=jnp.zeros(kv_shape, jnp.float32),
        v_keys_ordered=v_key_order, **qk_ops)
  if method == "fp8":
    block = config.granularity == "block"
    if fused is None:       # groups the passes do not take: XLA's scales
      z = fp8_inputs(fin(q), fin(k), fin(v), kv_lens, config=config,
                     v_values=False)
      q8, k8 = z["q"], z["k"]
      q_scale = jnp.repeat(z["q_scale"], config.block_q, axis=1)[:, :t]
      k_scale = jnp.repeat(z["k_scale"], config.block_k, axis=1)[:, :s_len]
      v_op = v8(jnp.float8_e4m3fn,
                inv_row=per_row(quant.reciprocal(z["v_scale"]),
                                config.block_k))
      v_scale = z["v_scale"].transpose(0, 2, 1)           # [B, K, groups]
    else:                   # one scale per row already
      q8, k8, v_op = fused["q8"], fused["k8"], fused["v8"]
      q_scale, k_scale, v_scale = (fused["q_scale"], fused["k_scale"],
                                   fused["v_scale"])
    q_scale = q_scale * (scale * base.LOG2E)
    return with_flags(
        q=q8, q_scale=q_scale, k=k8, k_scale=k_scale, v=v_op,
        v_block_scale=v_scale if block else None,
        score_bound=_score_bound(q_scale, k_scale, quant.FP8_MAX, d),
        out_scale=(jnp.full(kv_shape, 1.0 / quant.FP8_MAX, jnp.float32)
                   if block else _channels(v_scale / quant.FP8_MAX,
                                           kv_shape)),
        out_shift=jnp.zeros(kv_shape, jnp.float32),
        qk="fp8", pv="fp8", v_keys_ordered=v_key_order,
        k_scale_keys=config.block_k if block else s_len)
  raise ValueError(f"no quantized operands for method {method!r}")


@dataclasses.dataclass(frozen=True)
class PasaOperands:
  """What the PASA kernels take (:func:`pasa_operands`).

  Attributes:
    k: float16 shifted keys ``[B, S_pad, K, D]`` times the keys' factor
      ``p`` (:func:`jaxattn.pasa.key_factor`; ``S_pad`` a whole number of
      ``block_k`` blocks).
    v: V with NaN/Inf set to 0.
    inva: the kernels' constant ``fl16(beta / (1 - beta))``.
    exp_scale: ``scale / p``, the exponent's factor on ``S'``, where ``p``
      is static; where the call chooses it on the device, the softmax
      scale (``p = 1``'s), which ``exp_factor`` multiplies.
    exp_factor: None (``p`` static), or the float32 scalar ``1 / p``, a
      power of two, chosen on the device
      (:func:`jaxattn.pasa.with_key_factor`): the exponent's factor is
      ``exp_scale * exp_factor``, which the kernels take at run time.
    shifted: float32 ``[B, K, S_pad / block_k]``, 1 for a shifted block and
      0 for one the adaptive shift left; None without the adaptive shift.
    bad_kv: bool ``[B, S, K]``, the keys whose key or value held a NaN/Inf.
  """
  k: jax.Array
  v: jax.Array
  inva: float
  exp_scale: float
  shifted: jax.Array | None
  bad_kv: jax.Array
  exp_factor: jax.Array | None = None


def pasa_operands(k, v, kv_lens, *, scale: float, config,
                  scale_in_keys=None) -> PasaOperands:
  """The PASA kernels' operands: :func:`jaxattn.pasa.shift_keys` of every
  head in one kernel (:func:`pallas_kernels.key_shift.shifted_key_blocks`;
  the same values but for a rare one-ulp move where float32 accumulation
  order differs), with NaN/Inf keys counted as 0, and V with NaN/Inf set
  to 0 (:mod:`jaxattn.nonfinite`).

  Args: k, v ``[B, S, K, D]``; kv_lens int32 ``[B]``; config a
  :class:`jaxattn.pasa.PasaConfig` with float16 ``compute_dtype``;
  scale_in_keys: the call's choice of the keys' factor, a bool or a bool
  scalar array (:func:`jaxattn.pasa.with_key_factor`); None:
  ``config.scale_in_keys`` (None as True).

  V is copied whatever it holds: a copy only where it holds a NaN/Inf
  took a ``lax.cond``, whose predicate the host waits for.  The copy is
  one write of V (``B S K D`` float16 values, 134 MB at 2 x 8192 x 32 x
  128), in the pass that reads V for its flags anyway.
  """
  if jnp.dtype(config.compute_dtype) != jnp.float16:
    raise ValueError("the PASA kernels compute in float16; use "
                     "implementation='reference' for compute_dtype="
                     f"{config.compute_dtype}")
  beta = config.resolved_beta
  adaptive = config.adaptive_shift
  if scale_in_keys is None:
    scale_in_keys = config.scale_in_keys
  # p: a Python float, or a float32 scalar chosen on the device
  factor = pasa.key_factor_value(scale, adaptive, scale_in_keys)
  static = not isinstance(factor, jax.Array)
  shift = (key_shift.large_mean_blocks(k, kv_lens, beta=beta,
                                       min_ratio=pasa.SHIFT_MIN_RATIO,
                                       block_k=config.block_k)
           if adaptive else None)
  k_shifted, bad_k = key_shift.shifted_key_blocks(
      k, kv_lens, beta=beta, scale=factor, block_k=config.block_k,
      rounding=config.key_rounding, flag_nonfinite=True, shift=shift)
  bad_v = nonfinite.row_flags(v)
  return PasaOperands(
      k=k_shifted, v=nonfinite.finite(v),
      inva=float(np.float16(beta / (1.0 - beta))),
      exp_scale=scale / factor if static else scale,
      exp_factor=None if static else pasa.key_factor_value(
          scale, adaptive, scale_in_keys, lambda p: 1.0 / p),
      shifted=shift, bad_kv=bad_k | bad_v)


def fmha_operands(q, k, v, kv_lens, *, scale: float, config, block_k: int,
                  v_key_order: bool = False):
  """The 8-bit FMHA's operands: :func:`jaxattn.fmha.fmha_quantize`'s values
  bit for bit, in two phases of the Triton passes
  (:func:`quantizers.run_passes`): the amax of the finite values of each
  tensor (keys below the length; none for a static amax, and no first
  phase where all three are static), then one quantizing pass each with
  the given scale, which flag the rows that hold a NaN/Inf and quantize
  them as 0; the V pass also sums each ``block_k``-key block's int8
  columns.

  One scale per tensor is folded into ``q_scale`` (times ``scale * log2
  e``); ``k_scale`` is 1; V is ``[B, K, D, S]`` int8 (keys in the Mosaic
  kernel's register-operand order with ``v_key_order``) with the column
  sums of each ``block_k``-key block for the uint8 P identity
  (``pv="uint8"``).

  Returns ``(QuantizedOperands, v_scale)``: the kernel's output times
  ``v_scale / 255`` is the float output before output quantization.
  """
  b, t, n = q.shape[:3]
  s, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
  f32 = jnp.float32
  kv_lens = base.kv_lengths(kv_lens, b, s)
  q_lens = jnp.full((b,), t, jnp.int32)
  static = config.amax_dict
  inputs = (("q", q, q_lens), ("k", k, kv_lens), ("v", v, kv_lens))
  amax = quantizers.run_passes(*(
      None if name in static
      else quantizers.stats_pass(x, lens, mode=quantizers.STATS_AMAX)
      for name, x, lens in inputs)) if len(static) < 3 else [None] * 3
  sq, sk, sv = ((jnp.asarray(static[name], f32) if a is None else a.max())
                * fmha.RCP_QMAX for a, (name, _, _) in zip(amax, inputs))
  per_head = lambda sc, h: jnp.broadcast_to(sc, (b, h))
  rows = functools.partial(quantizers.rows_pass, group=1, dtype=jnp.int8,
                           flag_nonfinite=True)
  sums = block_k if _fits_key_groups(block_k) else None
  (q8, _, _, q_bad), (k8, _, _, k_bad), (v8, v_bad, _, colsum) = (
      quantizers.run_passes(
          rows(q, q_lens, scale=per_head(sq, n)),
          rows(k, kv_lens, scale=per_head(sk, nk)),
          quantizers.v_pass(
              v, kv_lens, dtype=jnp.int8,
              inv_channel=jnp.broadcast_to(quant.reciprocal(sv),
                                           (b, nk, dv)),
              colsum=sums, key_order=v_key_order, flag_nonfinite=True)))
  if colsum is None:   # blocks the pass cannot sum: XLA, from the int8 V
    # a block's column sums do not depend on the order of its keys
    s_pad = -(-s // block_k) * block_k
    # (V's keys beyond S are zeros: the padding of the key order's chunks)
    colsum = jnp.pad(v8, [(0, 0)] * 3 + [(0, s_pad - v8.shape[-1])])
    colsum = colsum.astype(jnp.int32)
    colsum = colsum.reshape(b, nk, dv, s_pad // block_k, block_k).sum(-1)
    colsum = colsum.transpose(0, 1, 3, 2)
  s_factor = sq * sk * (scale * base.LOG2E)
  ops = QuantizedOperands(
      q=q8, q_scale=jnp.broadcast_to(s_factor, (b, t, n)), k=k8,
      k_scale=jnp.ones((b, s, nk), f32), v=v8, v_colsum=colsum, qk="int8",
      pv="uint8", k_scale_keys=s, v_keys_ordered=v_key_order,
      q_nonfinite=q_bad, kv_nonfinite=k_bad | v_bad.transpose(0, 2, 1))
  return ops, sv

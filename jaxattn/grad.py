"""The backward pass of every method: the exact gradient of softmax attention
at the inputs (a straight-through estimate through the quantization, as
SageAttention's training kernels take it), and the log-sum-exp residual.

With ``P = softmax(s)``, ``s = scale Q K^T + bias`` (FlashAttention-2,
section 2.3)::

    dV = P^T dO        dP = dO V^T        delta = rowsum(dO * O)
    dS = P * (dP - delta)      dQ = scale dS K      dK = scale dS^T Q
    dbias = dS

``P = exp(s - lse)`` is rebuilt from the log-sum-exp and ``O = P V`` from
``P`` (each block of query rows sees every key, so this costs one more
product), not taken from the forward: a quantized method's output would
put its error into ``delta`` and from there into every ``dQ`` and ``dK``
(2-3% for sage and fp8, measured), where the exact ``O`` gives the exact
gradient at the inputs.  :func:`backward_path` picks the fastest way that
fits the call: cuDNN's backward on a GPU where cuDNN takes the call, from
the forward's output and log-sum-exp where the method's are exact
(:func:`cudnn_residual_vjp`), else after cuDNN's own forward
(:func:`cudnn_vjp`); the Pallas Triton backward (:func:`pallas_vjp`) for
other GPU calls without a bias or dense mask (float32 inputs, head dims
above 128); else the XLA form (:func:`xla_vjp`), in blocks of query rows.
"""
from __future__ import annotations

import functools
import inspect
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from jaxattn import base, methods
from pallas_kernels import common, flash, flash_backward

# jax.nn's value for a masked logit (its _apply_masks), so that a row that
# sees no key has jax.nn's log-sum-exp: this value (plus log S, which it
# absorbs).
MASK_VALUE = float(np.float32(-0.7 * np.finfo(np.float32).max))
# query rows per block of the XLA backward (bounds its [B, N, rows, S]
# temporaries)
XLA_ROWS = 512
# (block_q, block_k, num_warps, num_stages) of the Triton backward by padded
# head dim (correct on an H100; not tuned: at 2x8192x32x128 bfloat16 it
# takes 21 ms where cuDNN's backward takes 14)
_BACKWARD_TILES = {64: (64, 64, 4, 2), 128: (64, 64, 4, 2),
                   256: (32, 32, 8, 1)}
# cuDNN's backward from our residuals binds jax's private cuDNN module
# (jax._src.cudnn.fused_attention_stablehlo): the versions tested, and the
# parameters of its backward rule in each (the residual tuple follows them).
CUDNN_RESIDUAL_JAX = ("0.11", "0.12")
_CUDNN_BWD_RULES = {
    ("scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
     "sliding_window_length", "is_training", "return_residual", "res",
     "grad_output"): "0.11",
    ("scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
     "sliding_window_length", "score_mod", "cudnn_version", "return_residual",
     "res", "grad_output"): "0.12",
}
logger = logging.getLogger("jaxattn")


def _visible(t0, t, s, bounds, mask, q_seg=None, kv_seg=None):
  """bool ``[B, 1 or N, t, S]``: the scores kept for query rows ``t0 ..
  t0 + t`` (:func:`jaxattn.base.index_visibility` and the mask)."""
  vis = base.index_visibility(bounds, q_seg, kv_seg, t=t, s=s, t0=t0)[:, None]
  return vis if mask is None else vis & mask


def _bounds(q, kv_lens, is_causal, index_mask):
  """The bounds of :func:`pallas_kernels.common.row_bounds` and the segment
  ids (or None) of ``index_mask``."""
  im = index_mask or common.IndexMask()
  return (common.row_bounds(kv_lens, im, t=q.shape[1], is_causal=is_causal),
          im.q_segments, im.kv_segments)


def _grouped(q, nk):
  """``[B, T, N, D]`` -> ``[B, T, K, G, D]`` (query heads by key head)."""
  b, t, n, d = q.shape
  return q.reshape(b, t, nk, n // nk, d)


def _scores(q, k, bias, mask, bounds, q_seg, kv_seg, *, t0, scale):
  """float32 scores ``[B, N, t, S]`` of the query rows ``q`` (starting at
  ``t0``) and their visibility."""
  f32 = jnp.float32
  b, t, n, d = q.shape
  nk = k.shape[2]
  s = jnp.einsum("btkgd,bskd->bkgts", _grouped(q.astype(f32), nk),
                 k.astype(f32), precision=lax.Precision.HIGHEST)
  s = s.reshape(b, n, t, k.shape[1]) * jnp.float32(scale)
  if bias is not None:
    s = s + bias.astype(f32)
  return s, _visible(t0, t, k.shape[1], bounds, mask, q_seg, kv_seg)


def _row_blocks(t: int, rows: int):
  """(block count, padded length) of ``t`` query rows in blocks."""
  rows = min(rows, t)
  n = -(-t // rows)
  return n, n * rows, rows


def _split_rows(x, axis, n, rows):
  """``x`` padded along ``axis`` to ``n * rows`` and split into ``n``
  blocks (a new leading axis)."""
  if x is None:
    return None
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, n * rows - x.shape[axis])
  x = jnp.pad(x, pad)
  x = x.reshape(*x.shape[:axis], n, rows, *x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def _join_rows(x, axis, t):
  """Inverse of :func:`_split_rows` (the padding dropped)."""
  x = jnp.moveaxis(x, 0, axis)
  x = x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2:])
  return lax.slice_in_dim(x, 0, t, axis=axis)


def logsumexp(q, k, bias, mask, kv_lens, *, scale, is_causal,
              rows=XLA_ROWS, index_mask=None):
  """float32 ``[B, T, N]``: the natural-log log-sum-exp of each query row's
  visible float32 scores, :data:`MASK_VALUE` for a row that sees no key
  (jax.nn's ``return_residual`` value there)."""
  t = q.shape[1]
  n, _, rows = _row_blocks(t, rows)
  bounds, q_seg, kv_seg = _bounds(q, kv_lens, is_causal, index_mask)

  def block(args):
    i, qb, bb, mb, sb = args
    s, vis = _scores(qb, k, bb, mb, bounds, sb, kv_seg, t0=i * rows,
                     scale=scale)
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    lse = jnp.log(jnp.sum(jnp.exp(s - m_safe), axis=-1)) + m_safe[..., 0]
    return jnp.where(jnp.isneginf(lse), MASK_VALUE, lse)   # [B, N, rows]
  lse = lax.map(block, (jnp.arange(n), _split_rows(q, 1, n, rows),
                        _split_rows(bias, 2, n, rows),
                        _split_rows(mask, 2, n, rows),
                        _split_rows(q_seg, 1, n, rows)))
  return _join_rows(lse, 2, t).transpose(0, 2, 1)


def float_logsumexp(q, k, bias, mask, kv_lens, *, scale, is_causal,
                    on_gpu, index_mask=None):
  """The residual ``[B, T, N]`` (as :func:`logsumexp`) of the float32
  scores for a forward that did not keep one: on a GPU from the Triton
  flash kernel (a forward pass whose output is dropped, K standing in for
  V), else :func:`logsumexp`."""
  if not on_gpu:
    return logsumexp(q, k, bias, mask, kv_lens, scale=scale,
                     is_causal=is_causal, index_mask=index_mask)
  _, lse = flash.flash_attention(
      q, k, k, kv_lens, bias, mask, scale=scale, is_causal=is_causal,
      precision="fp32", params=flash.default_params("fp32", q.shape[-1]),
      return_lse=True, index_mask=index_mask)
  return as_residual(lse.transpose(0, 2, 1))


def as_residual(lse):
  """A kernel's float32 log-sum-exp (``-inf`` where a row sees no key)
  with jax.nn's value for those rows."""
  return jnp.where(jnp.isneginf(lse), MASK_VALUE, lse.astype(jnp.float32))


def xla_vjp(q, k, v, bias, mask, kv_lens, lse, dout, *, scale, is_causal,
            rows=XLA_ROWS, index_mask=None, out=None):
  """``(dq, dk, dv, dbias)`` of softmax attention (the module docstring),
  float32, from the log-sum-exp ``lse`` ``[B, T, N]``; dbias ``[B, N, T,
  S]`` or None.  Query rows in blocks of ``rows``.  ``delta`` from
  ``out`` where given (the rows' exact output over more keys than ``k``:
  a block of a ring, whose ``lse`` is the rows' global one), else from
  ``O = P V`` rebuilt here."""
  f32 = jnp.float32
  b, t, n, d = q.shape
  s_len, nk = k.shape[1], k.shape[2]
  g = n // nk
  kf, vf = k.astype(f32), v.astype(f32)
  nb, _, rows = _row_blocks(t, rows)
  hi = lax.Precision.HIGHEST
  bounds, q_seg, kv_seg = _bounds(q, kv_lens, is_causal, index_mask)

  def block(carry, args):
    dk, dv = carry
    i, qb, dob, lseb, bb, mb, sb, ob = args
    s, vis = _scores(qb, k, bb, mb, bounds, sb, kv_seg, t0=i * rows,
                     scale=scale)
    lse_t = lseb.transpose(0, 2, 1)[..., None]                 # [B, N, r, 1]
    p = jnp.where(vis, jnp.exp(s - lse_t), 0.0)
    pg = p.reshape(b, nk, g, rows, s_len)
    dog = _grouped(dob.astype(f32), nk)                         # [B, r, K, G, D]
    dv = dv + jnp.einsum("bkgts,btkgd->bskd", pg, dog, precision=hi)
    dp = jnp.einsum("btkgd,bskd->bkgts", dog, vf, precision=hi)
    o = (jnp.einsum("bkgts,bskd->btkgd", pg, vf, precision=hi)
         if ob is None else _grouped(ob.astype(f32), nk))
    delta = jnp.einsum("btkgd,btkgd->bkgt", o, dog, precision=hi)
    ds = pg * (dp - delta[..., None])
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, kf, precision=hi) * scale
    dk = dk + jnp.einsum("bkgts,btkgd->bskd", ds,
                         _grouped(qb.astype(f32), nk), precision=hi) * scale
    dbias = ds.reshape(b, n, rows, s_len) if bias is not None else None
    return (dk, dv), (dq.reshape(b, rows, n, d), dbias)

  zeros = (jnp.zeros((b, s_len, nk, d), f32),
           jnp.zeros((b, s_len, nk, v.shape[-1]), f32))
  split = functools.partial(_split_rows, n=nb, rows=rows)
  (dk, dv), (dq, dbias) = lax.scan(block, zeros, (
      jnp.arange(nb), split(q, 1), split(dout, 1), split(lse, 1),
      split(bias, 2), split(mask, 2), split(q_seg, 1), split(out, 1)))
  dq = _join_rows(dq, 1, t)
  if bias is not None:
    dbias = _join_rows(dbias, 2, t)
  return dq, dk, dv, dbias


def cudnn_reason(q_dtype, head_dim: int, has_bias: bool, has_mask: bool,
                 on_gpu: bool) -> str | None:
  """Why cuDNN's backward cannot take the call, or None when it can."""
  if not on_gpu:
    return "no GPU"
  if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.float16),
                                jnp.dtype(jnp.bfloat16)):
    return f"cuDNN takes float16/bfloat16, not {jnp.dtype(q_dtype).name}"
  if head_dim % 8 or head_dim > 128:
    return f"cuDNN's backward takes head dims <= 128 in steps of 8, not {head_dim}"
  if has_bias or has_mask:
    return "a bias or dense mask (cuDNN's backward would need the dense bias gradient)"
  return None


def cudnn_vjp(q, k, v, kv_lens, dout, *, scale, is_causal):
  """``(dq, dk, dv)`` from cuDNN's backward (``jax.vjp`` of
  ``jax.nn.dot_product_attention(implementation="cudnn")``, which runs its
  own forward for the residual)."""
  def attend(q, k, v):
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=is_causal,
        key_value_seq_lengths=kv_lens, implementation="cudnn")
  _, vjp = jax.vjp(attend, q, k, v.astype(q.dtype))
  dq, dk, dv = vjp(dout.astype(q.dtype))
  # a batch row with no key: the forward returns 0 there, so no gradient
  has_keys = (kv_lens > 0)[:, None, None, None]
  return tuple(jnp.where(has_keys, x, 0) for x in (dq, dk, dv))


@functools.lru_cache(maxsize=1)
def _cudnn_contract() -> tuple[str | None, str]:
  """(the contract of jax's private cuDNN backward, or None; why not)."""
  version = ".".join(jax.__version__.split(".")[:2])
  if version not in CUDNN_RESIDUAL_JAX:
    return None, (f"jax {jax.__version__} is not among the versions whose "
                  f"private cuDNN backward was tested {CUDNN_RESIDUAL_JAX}")
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    params = tuple(inspect.signature(
        fa._dot_product_attention_bwd_rule).parameters)
  except (ImportError, AttributeError) as e:
    return None, f"jax's private cuDNN module moved ({e})"
  contract = _CUDNN_BWD_RULES.get(params)
  if contract is None:
    return None, f"jax's cuDNN backward rule changed: {params}"
  return contract, ""


def cudnn_residual_reason() -> str | None:
  """Why cuDNN's backward cannot take the forward's residuals with this
  jax (then :func:`cudnn_vjp` recomputes them), or None."""
  contract, why = _cudnn_contract()
  return None if contract else why


def cudnn_residual_vjp(q, k, v, kv_lens, out, lse, dout, *, scale, is_causal):
  """``(dq, dk, dv)`` from cuDNN's backward kernel alone, with the
  forward's output ``out`` ``[B, T, N, D]`` and log-sum-exp ``lse``
  (float32 ``[B, T, N]``, natural log: cuDNN's softmax statistics) as its
  residuals, where :func:`cudnn_vjp` would run cuDNN's forward again.
  Binds jax's private cuDNN backward rule as jax.nn's own VJP does
  (:func:`cudnn_residual_reason` must be None)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  contract, why = _cudnn_contract()
  if contract is None:
    raise NotImplementedError(why)
  version = fa.check_cudnn_version()
  layout = fa.AttentionLayout.BTNH.value
  dt = q.dtype
  fa.check_is_flash_attention(q, k, v.astype(dt), layout, version, False, True)
  unused = jnp.zeros(0, dt)
  b, t = q.shape[:2]
  mask_type = fa.MaskType.PADDING_CAUSAL if is_causal else fa.MaskType.PADDING
  head = (q, k, v.astype(dt), unused, jnp.full((b,), t, jnp.int32),
          kv_lens.astype(jnp.int32), unused, unused, unused, unused)
  stats = (lse.astype(jnp.float32).transpose(0, 2, 1), out.astype(dt))
  static = (float(scale), 0, 0.0, (False, False), mask_type, layout, None)
  if contract == "0.11":   # (..., is_training, return_residual, res, dO)
    grads = fa._dot_product_attention_bwd_rule(
        *static, version, False, (*head, *stats), dout.astype(dt))
  else:                    # (..., score_mod, cudnn_version, ...): flex args
    grads = fa._dot_product_attention_bwd_rule(
        *static, None, version, False, (*head, (), *stats), dout.astype(dt))
  has_keys = (kv_lens > 0)[:, None, None, None]
  return tuple(jnp.where(has_keys, x, 0) for x in grads[:3])


def pallas_vjp(q, k, v, kv_lens, dout, *, scale, is_causal, out=None,
               lse=None, index_mask=None):
  """``(dq, dk, dv)`` float32 from the Triton backward kernels, with ``O``
  and the log-sum-exp ``[B, T, N]`` of an exact forward: ``out`` and
  ``lse`` where given, else the flash kernel's ``"fp32"`` forward (so the
  gradient is attention's at the inputs, whatever the method's forward)."""
  d = q.shape[-1]
  if out is None or lse is None:
    out, lse = flash.flash_attention(
        q, k, v, kv_lens, scale=scale, is_causal=is_causal,
        precision="fp32", params=flash.default_params("fp32", d),
        return_lse=True, index_mask=index_mask)
  else:
    lse = lse.transpose(0, 2, 1)
  # rows with no key (-inf, or jax.nn's MASK_VALUE): P = 0 there anyway
  lse = jnp.where(jnp.isfinite(lse) & (lse > MASK_VALUE), lse, 0.0)
  delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32),
                  axis=-1).transpose(0, 2, 1)
  tiles = _BACKWARD_TILES[min(max(pl.next_power_of_2(d), 64), 256)]
  return flash_backward.flash_backward(
      q, k, v, kv_lens, lse, delta, dout.astype(q.dtype), scale=scale,
      is_causal=is_causal, params=common.KernelParams(*tiles),
      index_mask=index_mask)


def takes_residuals(path: str, method: str) -> bool:
  """Whether the backward on ``path`` takes the forward's output and
  log-sum-exp (``method``'s output is exact; cuDNN's only with a jax whose
  private backward was tested) instead of computing its own."""
  if not methods.get(method).output_is_exact:
    return False
  return path == "triton" or (path == "cudnn"
                              and cudnn_residual_reason() is None)


def backward_path(q_dtype, head_dim, has_bias, has_mask, on_gpu,
                  has_index_mask=False) -> str:
  """``"cudnn"`` where cuDNN's backward takes the call (no query lengths,
  alignment, window or segment ids), else ``"triton"`` on a GPU without a
  bias or dense mask, else ``"xla"``."""
  if (not has_index_mask and cudnn_reason(q_dtype, head_dim, has_bias,
                                          has_mask, on_gpu) is None):
    return "cudnn"
  if on_gpu and not has_bias and not has_mask:
    return "triton"
  return "xla"


def attention_vjp(q, k, v, bias, mask, kv_lens, lse, dout, *, scale,
                  is_causal, on_gpu, out=None, index_mask=None):
  """``(dq, dk, dv, dbias)`` in the inputs' dtypes (dbias None without a
  bias) by :func:`backward_path`: cuDNN's or the Triton backward (from
  ``out`` and ``lse`` where both are given, the forward's exact output,
  else after their own forward) or :func:`xla_vjp`.  Where jax's cuDNN module refuses the call after all
  (its own checks run at trace time), the XLA form runs, with the
  log-sum-exp computed here if the forward did not keep it."""
  path = backward_path(q.dtype, q.shape[-1], bias is not None,
                       mask is not None, on_gpu, index_mask is not None)
  grads = None
  if path == "triton":
    grads = (*pallas_vjp(q, k, v, kv_lens, dout, scale=scale,
                         is_causal=is_causal, out=out,
                         lse=None if out is None else lse,
                         index_mask=index_mask), None)
  elif path == "cudnn":
    try:
      if out is not None and lse is not None:
        grads = (*cudnn_residual_vjp(q, k, v, kv_lens, out, lse, dout,
                                     scale=scale, is_causal=is_causal), None)
      else:
        grads = (*cudnn_vjp(q, k, v, kv_lens, dout, scale=scale,
                            is_causal=is_causal), None)
    except (ValueError, NotImplementedError, RuntimeError) as e:
      logger.info("jaxattn: cuDNN's backward refused the call (%s); "
                  "using the XLA backward", e)
  if grads is None:
    if lse is None:
      lse = float_logsumexp(q, k, bias, mask, kv_lens, scale=scale,
                            is_causal=is_causal, on_gpu=on_gpu,
                            index_mask=index_mask)
    grads = xla_vjp(q, k, v, bias, mask, kv_lens, lse, dout, scale=scale,
                    is_causal=is_causal, index_mask=index_mask)
  dq, dk, dv, dbias = grads
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
          None if bias is None else dbias.astype(bias.dtype))

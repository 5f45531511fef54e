"""Accuracy metrics of an attention output ``o`` against a reference ``r``.

Every function accepts numpy or jax arrays of any shape and dtype (float16,
bfloat16, float8, integers, ...), converts them to float64 numpy arrays and
returns a Python ``float``.  ``out`` and ``ref`` must have the same shape.

Non-finite values are *not* filtered out: a NaN anywhere in ``out`` (or
``ref``) makes :func:`cosine_similarity`, :func:`relative_l1`, :func:`rmse`
and :func:`relative_rmse` NaN (an Inf makes the error metrics Inf and the
cosine NaN), so a broken output can never look accurate.  Use
:func:`nonfinite_fraction` / :func:`nan_fraction` (or :func:`summary`, which
reports both kinds of numbers) to see how much of the output is broken.

A relative metric with an all-zero reference (zero denominator) is ``0.0``
when ``out`` equals ``ref`` and ``inf`` otherwise; no division warning is
emitted.  Empty arrays count as equal (errors 0, cosine 1).
"""
from __future__ import annotations

import numpy as np

__all__ = ["cosine_similarity", "relative_l1", "rmse", "relative_rmse",
           "nonfinite_fraction", "nan_fraction", "summary"]


def _f64(x) -> np.ndarray:
  return np.asarray(x).astype(np.float64)


def _pair(out, ref) -> tuple[np.ndarray, np.ndarray]:
  o, r = _f64(out), _f64(ref)
  if o.shape != r.shape:
    raise ValueError(f"out and ref must have the same shape, got {o.shape} "
                     f"and {r.shape}")
  return o, r


def _ratio(num: float, den: float) -> float:
  """``num / den`` with ``0/0 = 0`` and ``x/0 = inf`` (NaN stays NaN)."""
  if np.isnan(num) or np.isnan(den):
    return float("nan")
  if den == 0.0:
    return 0.0 if num == 0.0 else float("inf")
  with np.errstate(all="ignore"):
    return float(num / den)


def cosine_similarity(out, ref) -> float:
  """``sum(o*r) / (sqrt(sum o^2) * sqrt(sum r^2))`` over all elements.

  1.0 when both are all zero, 0.0 when exactly one is; NaN when either holds
  a NaN or an Inf."""
  o, r = _pair(out, ref)
  with np.errstate(all="ignore"):
    dot = float(np.sum(o * r))
    no = float(np.sqrt(np.sum(o * o)))
    nr = float(np.sqrt(np.sum(r * r)))
    if not (np.isfinite(dot) and np.isfinite(no) and np.isfinite(nr)):
      return float("nan")
    if no == 0.0 or nr == 0.0:
      return 1.0 if no == nr else 0.0
    return float(dot / (no * nr))


def relative_l1(out, ref) -> float:
  """``sum|o - r| / sum|r|``."""
  o, r = _pair(out, ref)
  with np.errstate(all="ignore"):
    return _ratio(float(np.sum(np.abs(o - r))), float(np.sum(np.abs(r))))


def rmse(out, ref) -> float:
  """``sqrt(mean((o - r)^2))`` (0.0 for empty arrays)."""
  o, r = _pair(out, ref)
  if o.size == 0:
    return 0.0
  with np.errstate(all="ignore"):
    return float(np.sqrt(np.mean((o - r) ** 2)))


def relative_rmse(out, ref) -> float:
  """``||o - r||_2 / ||r||_2`` (Frobenius norms over all elements), the
  PASA paper's accuracy metric; equals ``rmse(o, r) / rms(r)``."""
  o, r = _pair(out, ref)
  with np.errstate(all="ignore"):
    num = float(np.sqrt(np.sum((o - r) ** 2)))
    den = float(np.sqrt(np.sum(r * r)))
  return _ratio(num, den)


def nonfinite_fraction(out) -> float:
  """``count(isnan(o) | isinf(o)) / size(o)`` (0.0 for empty arrays)."""
  o = _f64(out)
  return float(np.mean(~np.isfinite(o))) if o.size else 0.0


def nan_fraction(out) -> float:
  """``count(isnan(o)) / size(o)`` (0.0 for empty arrays)."""
  o = _f64(out)
  return float(np.mean(np.isnan(o))) if o.size else 0.0


def summary(out, ref) -> dict[str, float]:
  """All metrics at once: ``{"cos_sim", "rel_l1", "rmse", "rel_rmse",
  "nan_frac"}`` (``nan_frac`` is :func:`nan_fraction` of ``out``)."""
  o, r = _pair(out, ref)
  return {
      "cos_sim": cosine_similarity(o, r),
      "rel_l1": relative_l1(o, r),
      "rmse": rmse(o, r),
      "rel_rmse": relative_rmse(o, r),
      "nan_frac": nan_fraction(o),
  }


def exact_attention(q, k, v, *, scale=None, is_causal=False, kv_lens=None,
                    bias=None, mask=None) -> np.ndarray:
  """The float64 ground truth: textbook ``softmax(Q K^T scale + bias) V`` in
  numpy on BTNH arrays (GQA by repeating K and V), with the same masking as
  ``jaxattn.dot_product_attention`` (top-left causal, ``kv_lens``, boolean
  ``mask``); rows that see no key are zero."""
  q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
  t, n, d = q.shape[1:]
  s_len, nk = k.shape[1], k.shape[2]
  k, v = np.repeat(k, n // nk, axis=2), np.repeat(v, n // nk, axis=2)
  scale = 1.0 / np.sqrt(d) if scale is None else scale
  s = np.einsum("btnd,bsnd->bnts", q, k) * scale
  if bias is not None:
    s = s + np.broadcast_to(np.asarray(bias, np.float64), s.shape)
  vis = np.ones(s.shape, bool)
  if kv_lens is not None:
    vis &= (np.arange(s_len)[None, :] < np.asarray(kv_lens)[:, None])[
        :, None, None, :]
  if is_causal:
    vis &= np.tril(np.ones((t, s_len), bool))
  if mask is not None:
    vis &= np.broadcast_to(np.asarray(mask), s.shape)
  s = np.where(vis, s, -np.inf)
  mx = s.max(-1, keepdims=True)
  p = np.where(vis, np.exp(s - np.where(np.isfinite(mx), mx, 0)), 0)
  den = p.sum(-1, keepdims=True)
  return np.einsum("bnts,bsnd->btnd", p / np.where(den == 0, 1, den), v)


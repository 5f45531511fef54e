"""The public entry point: ``dot_product_attention`` and one named function per
method, shaped like ``jax.nn.dot_product_attention``."""
from __future__ import annotations

import dataclasses
import functools
import logging
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn import base, grad, methods, nonfinite, ring, sharding
from jaxattn.backends import Call, with_defaults
from jaxattn.backends import mosaic, reference, triton
from pallas_kernels.common import IndexMask, row_bounds

# The backends by implementation name, and the order in which
# implementation=None tries them.
BACKENDS = {"mosaic": mosaic, "triton": triton, "reference": reference}
PREFERENCE = ("mosaic", "triton", "reference")
RENAMED = {"pallas": "triton"}  # deprecated implementation names
IMPLEMENTATIONS = (None, *BACKENDS, *RENAMED)
_FLOAT_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)
CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
logger = logging.getLogger("jaxattn")


def _lengths(x, name, b, n):
  """``x`` as int32 ``[b]`` checked to lie in ``[0, n]`` (where concrete;
  checked before the conversion, which would wrap 64-bit values)."""
  if not isinstance(x, jax.core.Tracer):
    x = np.asarray(x)
  if x.shape != (b,) or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array of shape ({b},), got "
                     f"{x.dtype}{x.shape}")
  if not isinstance(x, jax.core.Tracer):
    lo, hi = int(np.min(x)), int(np.max(x))
    if lo < 0 or hi > n:
      raise ValueError(f"{name} must lie in [0, {n}], got values in "
                       f"[{lo}, {hi}]")
  return jnp.clip(jnp.asarray(x), 0, n).astype(jnp.int32)


def window_pair(local_window_size):
  """``local_window_size`` as ``(left, right)`` (jax.nn: an int is a
  symmetric window); None on a side is unbounded."""
  w = local_window_size
  if isinstance(w, (int, np.integer)) and not isinstance(w, bool):
    w = (int(w), int(w))
  if (not isinstance(w, (tuple, list)) or len(w) != 2
      or not all(x is None or (isinstance(x, (int, np.integer))
                               and not isinstance(x, bool) and x >= 0)
                 for x in w)):
    raise ValueError("local_window_size must be an int >= 0 or a (left, "
                     f"right) pair of them, got {local_window_size!r}")
  return tuple(None if x is None else int(x) for x in w)


def _segments(ids, name, b, n):
  ids = jnp.asarray(ids)
  if ids.shape != (b, n) or not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array of shape ({b}, {n}), "
                     f"got {ids.dtype}{ids.shape}")
  return ids.astype(jnp.int32)


def build_index_mask(query, key, kv_lens, *, query_seq_lengths,
                     local_window_size, q_segment_ids, kv_segment_ids,
                     causal_alignment):
  """The checked :class:`IndexMask` of the call (None when it holds
  nothing) and the names of the features it uses."""
  b, t = query.shape[:2]
  s = key.shape[1]
  if causal_alignment not in CAUSAL_ALIGNMENTS:
    raise ValueError(f"causal_alignment must be one of {CAUSAL_ALIGNMENTS}, "
                     f"got {causal_alignment!r}")
  features = []
  q_lens = offsets = q_seg = kv_seg = window = None
  if query_seq_lengths is not None:
    q_lens = _lengths(query_seq_lengths, "query_seq_lengths", b, t)
    features.append("query_seq_lengths")
  if local_window_size is not None:
    # a side of t + s or more hides no key: clamped, so that any int fits
    # the kernels' int32 bounds
    window = tuple(None if w is None else min(w, t + s)
                   for w in window_pair(local_window_size))
    features.append("local_window_size")
  if causal_alignment == "bottom_right":
    # query row i's diagonal is key i + kv_len - q_len (its last row sees
    # the last key): chunked prefill and decode against a cache
    offsets = kv_lens - (jnp.full((b,), t, jnp.int32) if q_lens is None
                         else q_lens)
    features.append("causal_alignment")
  if q_segment_ids is not None or kv_segment_ids is not None:
    if q_segment_ids is None:
      raise ValueError("kv_segment_ids needs q_segment_ids")
    if kv_segment_ids is None:
      if t != s:
        raise ValueError(f"query ({t}) and key ({s}) lengths differ: pass "
                         "kv_segment_ids as well")
      kv_segment_ids = q_segment_ids
    q_seg = _segments(q_segment_ids, "q_segment_ids", b, t)
    kv_seg = _segments(kv_segment_ids, "kv_segment_ids", b, s)
    features.append("segment_ids")
  if not features:
    return None, frozenset()
  return (IndexMask(q_lens=q_lens, offsets=offsets, q_segments=q_seg,
                    kv_segments=kv_seg, window=window), frozenset(features))


def _check_inputs(query, key, value, bias, mask, key_value_seq_lengths):
  for name, x in (("query", query), ("key", key), ("value", value)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim not in (3, 4):
      raise ValueError(
          f"{name} must have rank 4 [batch, seq, heads, head_dim] (or 3 "
          f"without batch), got shape {x.shape}")
    if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in _FLOAT_DTYPES]:
      raise TypeError(
          f"{name} must be float16, bfloat16, float32 or float64, got "
          f"{x.dtype}")
  if not query.ndim == key.ndim == value.ndim:
    raise ValueError("query, key and value must have the same rank, got "
                     f"{query.shape}, {key.shape}, {value.shape}")
  b, t, nq, d = query.shape
  bk, s, nk, dk = key.shape
  if bk != b or value.shape[0] != b:
    raise ValueError(f"batch sizes differ: query {b}, key {bk}, "
                     f"value {value.shape[0]}")
  if dk != d:
    raise ValueError(f"query and key head dims differ: {d} vs {dk}")
  if value.shape[1] != s or value.shape[2] != nk:
    raise ValueError(f"key {key.shape} and value {value.shape} must agree on "
                     "sequence length and heads")
  if value.shape[3] != d:
    raise ValueError(f"value head dim {value.shape[3]} must equal the query "
                     f"head dim {d}")
  if t < 1 or s < 1 or d < 1 or nq < 1 or nk < 1:
    raise ValueError(f"empty dimension in query {query.shape} or key "
                     f"{key.shape}")
  if d > 256:
    raise ValueError(f"head_dim {d} > 256 is not supported")
  if nq % nk:
    raise ValueError(f"query heads ({nq}) must be a multiple of key/value "
                     f"heads ({nk})")
  full = (b, nq, t, s)
  if bias is not None:
    try:
      bias = jnp.broadcast_to(jnp.asarray(bias), full)
    except (ValueError, TypeError) as e:
      raise ValueError(f"bias of shape {jnp.shape(bias)} does not broadcast "
                       f"to [batch, heads, q_len, kv_len] = {full}") from e
    if not jnp.issubdtype(bias.dtype, jnp.floating):
      raise TypeError(f"bias must be floating, got {bias.dtype}")
  if mask is not None:
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
      raise TypeError(f"mask must be boolean, got {mask.dtype}")
    try:
      mask = jnp.broadcast_to(mask, full)
    except ValueError as e:
      raise ValueError(f"mask of shape {mask.shape} does not broadcast to "
                       f"[batch, heads, q_len, kv_len] = {full}") from e
  if key_value_seq_lengths is None:
    kv_lens = base.kv_lengths(None, b, s)
  else:
    kv_lens = _lengths(key_value_seq_lengths, "key_value_seq_lengths", b, s)
  return bias, mask, kv_lens


def implementation_name(implementation: str | None) -> str | None:
  """``implementation`` checked (ValueError listing the names) and with a
  deprecated name replaced (DeprecationWarning)."""
  if implementation in RENAMED:
    new = RENAMED[implementation]
    warnings.warn(f"implementation={implementation!r} is now {new!r}",
                  DeprecationWarning, stacklevel=4)
    return new
  if implementation is not None and implementation not in BACKENDS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got "
                     f"{implementation!r}")
  return implementation


@functools.lru_cache(maxsize=256)
def _log_fallback(method: str, backend: str, reason: str) -> None:
  """Says once per (method, backend, reason) why ``implementation=None``
  passed over a backend that runs natively here."""
  logger.info("jaxattn: method %r does not run on %s here: %s", method,
              backend, reason)


def select_backend(implementation: str | None, call: Call) -> str:
  """The name of the backend that runs ``call``.

  None walks :data:`PREFERENCE` and takes the first backend that runs
  natively here (Mosaic on Hopper, Triton on any GPU, the reference
  everywhere), has an adapter for the method and accepts the call.  A name
  is taken as asked: NotImplementedError with the reason when its backend
  has no kernel for the method or cannot honour the call.  When None passes
  over a native backend, the ``"jaxattn"`` logger says why (INFO, once per
  reason).  "pallas" is the deprecated name of "triton".
  """
  implementation = implementation_name(implementation)
  if implementation is None:
    for name in PREFERENCE:
      backend = BACKENDS[name]
      adapter = backend.ADAPTERS.get(call.method)
      if adapter is None or not backend.native():
        continue
      try:
        _check_dtypes(name, call)
        _check_index_mask(name, adapter, call)
        adapter.check(call)
      except NotImplementedError as e:
        _log_fallback(call.method, BACKENDS[name].TITLE, str(e))
        continue
      return name
    raise AssertionError(f"no backend accepts {call}")  # the reference does
  backend = BACKENDS[implementation]
  adapter = backend.ADAPTERS.get(call.method)
  if adapter is None:
    others = [n for n in PREFERENCE if call.method in BACKENDS[n].ADAPTERS]
    raise NotImplementedError(
        f"method {call.method!r} has no {backend.TITLE} kernel; use "
        f"implementation={' or '.join(map(repr, others))}")
  _check_dtypes(implementation, call)
  _check_index_mask(implementation, adapter, call)
  adapter.check(call)
  return implementation


def _positive_scale(query, scale):
  """``(query, scale)`` with the scale a positive float (default
  ``1/sqrt(H)``): the kernels take the row max of the scaled scores from
  the unscaled ones, which needs ``scale > 0``.  The scores stay the same:
  a negative scale negates the queries instead (exact, also through the
  symmetric quantizers), and a zero scale zeroes them with a scale of 1
  (``0 * q``: every finite score is 0, and NaN/Inf stay NaN as in
  ``0 * (q . k)``).  A NaN or infinite scale is refused."""
  scale = base.softmax_scale(scale, query.shape[-1])
  if scale < 0:
    return -query, -scale
  if scale == 0:
    return query * jnp.zeros((), query.dtype), 1.0
  return query, scale


def _check_dtypes(name, call: Call) -> None:
  """NotImplementedError for float64 inputs (with x64 on; else jax takes
  them as float32) on a kernel backend: the kernels compute in 32 bits and
  less, the reference in float64."""
  dtypes = {jax.dtypes.canonicalize_dtype(x.dtype) for x in (call.q, call.k)}
  if name != "reference" and jnp.dtype(jnp.float64) in dtypes:
    raise NotImplementedError(
        f"the {BACKENDS[name].TITLE} kernels take no float64 inputs; "
        "implementation='reference' computes in float64")


def _check_index_mask(name, adapter, call: Call) -> None:
  """NotImplementedError when a kernel backend's adapter does not compute
  the call's index mask (the reference folds it into a dense mask)."""
  if call.index_features and not adapter.index_mask and name != "reference":
    raise NotImplementedError(
        f"the {BACKENDS[name].TITLE} kernel of {call.method!r} does not take "
        f"{', '.join(sorted(call.index_features))}")


def _dense(mask, kv_lens, index_mask, *, n, t, s, is_causal):
  """The mask ``[B, N, T, S]`` that holds ``index_mask`` and causality (for
  the references, which take a dense mask)."""
  bounds = row_bounds(kv_lens, index_mask, t=t, is_causal=is_causal)
  vis = base.index_visibility(bounds, index_mask.q_segments,
                              index_mask.kv_segments, t=t, s=s)[:, None]
  vis = jnp.broadcast_to(vis, (vis.shape[0], n, t, s))
  return vis if mask is None else vis & mask


def _forward(q, k, v, bias, mask, kv_lens, index_mask=None, *, method,
             implementation, scale, is_causal, config, with_lse,
             output_lse=False, all_keys=False):
  """The method's output in the query dtype, and with ``with_lse`` the
  float32 log-sum-exp ``[B, T, N]`` (:mod:`jaxattn.grad`: the kernel's own
  where it has one, else that of the float32 scores).  ``output_lse``:
  the normalizer of the returned output where the kernel has it
  (``Adapter.run_output_lse``: the quantized scores'), for merging
  partial outputs; no gradient takes that one.  ``all_keys``: the call
  has no key lengths (``kv_lens`` holds S), which the adapters that take
  it (:attr:`Adapter.all_keys`) are told by ``kv_lens=None``."""
  if implementation != "reference" and jax.config.read("jax_enable_x64"):
    # The kernels and their wrappers compute indices and scales in 32 bits;
    # with x64 on, jnp would make them 64-bit (float64 inputs go to the
    # reference: :func:`_check_dtypes`).
    with jax.enable_x64(False):
      return _forward(q, k, v, bias, mask, kv_lens, index_mask,
                      method=method, implementation=implementation,
                      scale=scale, is_causal=is_causal, config=config,
                      with_lse=with_lse, output_lse=output_lse,
                      all_keys=all_keys)
  backend = BACKENDS[implementation]
  adapter = backend.ADAPTERS[method]
  static = dict(scale=scale, is_causal=is_causal, config=config)
  run_lens = None if all_keys and adapter.all_keys else kv_lens
  if index_mask is not None and not adapter.index_mask:
    mask = _dense(mask, kv_lens, index_mask, n=q.shape[2], t=q.shape[1],
                  s=k.shape[1], is_causal=is_causal)
    if adapter.segment_scales and index_mask.q_segments is not None:
      static["segments"] = (index_mask.q_segments, index_mask.kv_segments)
    index_mask, is_causal = None, False
    static["is_causal"] = False
  if index_mask is not None:
    static["index_mask"] = index_mask
  run_lse = adapter.run_lse
  if output_lse and adapter.run_output_lse is not None:
    run_lse = adapter.run_output_lse
  if with_lse and run_lse is not None:
    out, lse = run_lse(q, k, v, bias, mask, run_lens, **static)
    return out.astype(q.dtype), grad.as_residual(lse.transpose(0, 2, 1))
  run = adapter.run
  if methods.get(method).confine_nonfinite and not adapter.confines_nonfinite:
    run = functools.partial(nonfinite.confined, adapter.run)
  out = run(q, k, v, bias, mask, run_lens, **static)
  if isinstance(out, tuple):  # e.g. (int8 output, its scale): returned as is
    return out, None
  if not with_lse:
    return out.astype(q.dtype), None
  lse = grad.float_logsumexp(q, k, bias, mask, kv_lens, scale=scale,
                             is_causal=is_causal, on_gpu=triton.native(),
                             index_mask=index_mask)
  return out.astype(q.dtype), lse


@functools.partial(jax.jit, static_argnames=(
    "method", "implementation", "scale", "is_causal", "config",
    "return_residual", "all_keys"))
def _attention(q, k, v, bias, mask, kv_lens, index_mask, *, method,
               implementation, scale, is_causal, config,
               return_residual=False, all_keys=False):
  """The method's forward, with the straight-through backward of
  :mod:`jaxattn.grad` as its VJP (cuDNN's where it takes the call);
  ``all_keys``: the call has no key lengths."""
  static = dict(method=method, implementation=implementation, scale=scale,
                is_causal=is_causal, config=config, all_keys=all_keys)
  if getattr(config, "return_int8", False):   # an int8 output: no gradient
    return _forward(q, k, v, bias, mask, kv_lens, index_mask,
                    with_lse=False, **static)[0]
  on_gpu = triton.native()
  path = grad.backward_path(q.dtype, q.shape[-1], bias is not None,
                            mask is not None, on_gpu, index_mask is not None)
  # the backward kernel from the forward's residuals where the output is
  # exact and the kernel keeps its log-sum-exp (no second forward)
  keep_output = (grad.takes_residuals(path, method)
                 and BACKENDS[implementation].ADAPTERS[method].run_lse
                 is not None)

  # shard-local under jit (jaxattn.sharding); not the int8-output call
  # above, whose output scale is one per tensor
  forward = sharding.forward(_forward)

  @jax.custom_vjp
  def attend(q, k, v, bias, mask, kv_lens, index_mask):
    out, lse = forward(q, k, v, bias, mask, kv_lens, index_mask,
                       with_lse=return_residual, **static)
    return (out, lse) if return_residual else out

  def attend_fwd(q, k, v, bias, mask, kv_lens, index_mask):
    out, lse = forward(
        q, k, v, bias, mask, kv_lens, index_mask,
        with_lse=return_residual or path == "xla" or keep_output, **static)
    primal = (out, lse) if return_residual else out
    return primal, (q, k, v, bias, mask, kv_lens, index_mask, lse,
                    out if keep_output else None)

  def attend_bwd(res, cotangent):
    q, k, v, bias, mask, kv_lens, index_mask, lse, out = res
    dout = cotangent[0] if return_residual else cotangent  # lse: no gradient
    exact_step = ring.Step("fp32", None, scale, forward=_forward,
                           resolve=resolve_implementation)
    return (*sharding.attention_vjp(q, k, v, bias, mask, kv_lens, lse,
                                    dout, scale=scale, is_causal=is_causal,
                                    on_gpu=on_gpu, out=out,
                                    index_mask=index_mask,
                                    exact_step=exact_step),
            None, None, None)

  attend.defvjp(attend_fwd, attend_bwd)
  return attend(q, k, v, bias, mask, kv_lens, index_mask)


def dot_product_attention(query, key, value, bias=None, mask=None, *,
                          scale: float | None = None, is_causal: bool = False,
                          query_seq_lengths=None,
                          key_value_seq_lengths=None,
                          local_window_size: int | tuple[int, int] | None = None,
                          q_segment_ids=None, kv_segment_ids=None,
                          causal_alignment: str = "top_left",
                          method: str = "fp32",
                          implementation: str | None = None,
                          return_residual: bool = False,
                          **options: Any):
  """Scaled dot-product attention, a drop-in for
  ``jax.nn.dot_product_attention`` with a choice of low-precision ``method``.

  Args:
    query: ``[B, T, N, H]`` (or ``[T, N, H]``), float16/bfloat16/float32.
    key, value: ``[B, S, K, H]``; ``N`` must be a multiple of ``K``
      (grouped-query attention); ``S`` may differ from ``T``.
    bias: float, broadcastable to ``[B, N, T, S]``, added to the scaled
      scores.
    mask: bool, broadcastable to ``[B, N, T, S]``; True keeps a score.
    scale: softmax scale, default ``1/sqrt(H)``: any finite real (a
      negative one negates the scores, zero weighs the visible keys
      equally); NaN or inf raise ValueError.
    is_causal: top-left aligned causal mask (query ``i`` sees keys
      ``0..i``), as ``jax.nn.dot_product_attention``.
    query_seq_lengths: int ``[B]``: query rows at or beyond it are padding;
      they see no key and return 0 (jax.nn's output there; their
      log-sum-exp is jax.nn's value for a row that sees no key).
    key_value_seq_lengths: int ``[B]``, keys at or beyond it are masked.
    local_window_size: ``(left, right)`` or an int (``(w, w)``), as
      jax.nn: query ``i`` sees keys ``i - left .. i + right`` (relative to
      the aligned diagonal, below); with ``is_causal``, ``right`` is 0.
    q_segment_ids, kv_segment_ids: int ``[B, T]`` and ``[B, S]``: packed
      sequences; a score is kept only where the two ids are equal (combined
      with everything else).  ``kv_segment_ids`` defaults to
      ``q_segment_ids`` when ``T == S``.
    causal_alignment: ``"top_left"`` (jax.nn's ``is_causal``: query ``i``
      sees keys ``0..i``) or ``"bottom_right"`` (query ``i`` sees keys
      ``0..i + kv_len - q_len``, per batch row from the lengths: the last
      query sees the last key; chunked prefill and decode against a
      cache).  The local window is centred on the same diagonal.
    method: one of ``jaxattn.METHODS`` ("fp32", "fp16_fp32", "fp16", "pasa",
      "sage", "int8", "fmha_int8", "fp8").
    implementation: None (on an H100/H200 the Mosaic GPU kernel when the
      method has one and the call fits it, else the Triton kernel on a GPU
      when the method has one and the call fits it, else the reference),
      "reference", "triton" (interpret mode without a GPU) or "mosaic" (the
      warp-specialised Hopper kernel; Mosaic GPU's interpreter without a
      GPU).  "pallas" is the deprecated name of "triton".  A named
      implementation that cannot run the call raises NotImplementedError
      with the reason.
    return_residual: also return the log-sum-exp of each query row's
      scores, float32 ``[B, T, N]`` (natural log; jax.nn's value
      ``-0.7 * float32 max`` for a row that sees no key), as
      ``(output, lse)``.  It is the kernel's own where the kernel computes
      it (the Triton "fp32", "fp16_fp32", "fp16" and "pasa" kernels, the
      Mosaic "fp32" kernel), else that of the float32 scores (one more
      forward pass).  A sequence-sharded call runs as a ring and returns
      the merge of its steps' own (:mod:`jaxattn.ring`).
    **options: the method's options (its configuration dataclass fields);
      unknown ones raise ``TypeError``.

  Differentiable: the gradient is the exact gradient of attention at the
  inputs (straight through the quantization), from cuDNN's backward on a GPU
  where it takes the call (from the forward's output and log-sum-exp for
  ``method="fp32"``; after a second, cuDNN, forward for the quantized
  methods, whose output is not exact), else from
  :func:`jaxattn.grad.xla_vjp`.

  Returns:
    ``[B, T, N, H]`` in the query dtype.  Rows that see no key are zero;
    NaN/Inf in the inputs propagate to the rows they reach.  Methods with an
    integer output option (``fmha_int8`` with ``return_int8=True``) return a
    tuple as documented there.
  """
  config = methods.get(method).config_cls.from_options(**options)
  unbatched = getattr(query, "ndim", 0) == 3
  query, key, value, bias, mask, kv_lens, index_mask, impl = _normalise(
      query, key, value, bias, mask, key_value_seq_lengths, config=config,
      method=method, implementation=implementation, is_causal=is_causal,
      indices=dict(query_seq_lengths=query_seq_lengths,
                   local_window_size=local_window_size,
                   q_segment_ids=q_segment_ids,
                   kv_segment_ids=kv_segment_ids,
                   causal_alignment=causal_alignment))
  config = backend_config(method, impl, config, options,
                          skips_key_blocks(index_mask), bool(is_causal))
  query, scale = _positive_scale(query, scale)
  out = _attention(query, key, value, bias, mask, kv_lens, index_mask,
                   method=method, implementation=impl, scale=scale,
                   is_causal=bool(is_causal), config=config,
                   return_residual=bool(return_residual),
                   all_keys=key_value_seq_lengths is None)
  if unbatched:  # drop the batch axis again (not from a scalar scale)
    if return_residual:
      out = (out[0][0], out[1][0])
    else:
      out = (out[0][0], *out[1:]) if isinstance(out, tuple) else out[0]
  return out


def backend_config(method: str, implementation: str, config, options,
                   masked: bool = False, is_causal: bool = False):
  """``config`` with the backend's preferred values of the options the call
  (and the method's preset) left unset (:attr:`backends.Adapter.
  defaults`: e.g. sage's ``block_k=128`` on the Mosaic kernel).  ``masked``:
  the call has segment ids or a local window (:func:`skips_key_blocks`),
  and ``is_causal``, which some defaults depend on."""
  name = implementation_name(implementation)
  if name is None:
    raise ValueError("backend_config needs a backend name (see "
                     "resolve_implementation), got None")
  adapter = BACKENDS[name].ADAPTERS.get(method)
  return config if adapter is None else with_defaults(
      adapter, config, options, masked, is_causal)


def skips_key_blocks(index_mask) -> bool:
  """Whether a call's index mask (segment ids, a local window) can hide
  whole key blocks inside a query tile, beyond what causality and the
  lengths hide: the ``masked`` of :func:`backend_config`."""
  return index_mask is not None and (index_mask.has_segments
                                     or index_mask.window is not None)


def config_for(method: str, implementation: str, masked: bool = False,
               is_causal: bool = False, **options):
  """The config ``implementation`` runs ``method`` with for ``options``
  (:func:`backend_config` of the options' config)."""
  config = methods.get(method).config_cls.from_options(**options)
  return backend_config(method, implementation, config, options, masked,
                        is_causal)


def backend_options(method: str, implementation: str, masked: bool = False,
                    is_causal: bool = False, **options) -> dict:
  """``options`` plus the values ``implementation`` fills into the ones
  left unset (:func:`backend_config`; ``masked``: for a call with segment
  ids or a local window; ``is_causal``: for a causal call): pass them to
  another implementation (e.g. ``"reference"``) to reproduce this one's
  numerics."""
  plain = methods.get(method).config_cls.from_options(**options)
  config = config_for(method, implementation, masked, is_causal, **options)
  return {**options, **{f.name: getattr(config, f.name)
                        for f in dataclasses.fields(config)
                        if getattr(config, f.name) != getattr(plain, f.name)}}


def _normalise(query, key, value, bias, mask, key_value_seq_lengths, *,
               config, method, implementation, is_causal, indices=None):
  """The inputs batched and checked, bias and mask broadcast, the key
  lengths as int32 ``[B]``, the :class:`IndexMask` (or None) and the
  backend that runs the call."""
  indices = dict(indices or {})
  if getattr(query, "ndim", 0) == 3:
    query, key, value = (jnp.asarray(x)[None] for x in (query, key, value))
    for name in ("query_seq_lengths", "q_segment_ids", "kv_segment_ids"):
      if indices.get(name) is not None:   # one batch row
        indices[name] = jnp.asarray(indices[name])[None]
    if bias is not None:
      bias = jnp.asarray(bias)
      bias = bias[None] if bias.ndim == 3 else bias
    if mask is not None:
      mask = jnp.asarray(mask)
      mask = mask[None] if mask.ndim == 3 else mask
  bias, mask, kv_lens = _check_inputs(query, key, value, bias, mask,
                                      key_value_seq_lengths)
  index_mask, features = build_index_mask(
      query, key, kv_lens,
      **{"query_seq_lengths": None, "local_window_size": None,
         "q_segment_ids": None, "kv_segment_ids": None,
         "causal_alignment": "top_left", **indices})
  call = Call(method=method, config=config,
              q=jax.ShapeDtypeStruct(query.shape, query.dtype),
              k=jax.ShapeDtypeStruct(key.shape, key.dtype),
              has_bias=bias is not None, has_mask=mask is not None,
              is_causal=bool(is_causal), index_features=features)
  impl = select_backend(implementation, call)
  return query, key, value, bias, mask, kv_lens, index_mask, impl


def resolve_implementation(query, key, value, bias=None, mask=None, *,
                           is_causal: bool = False,
                           query_seq_lengths=None,
                           key_value_seq_lengths=None,
                           local_window_size=None, q_segment_ids=None,
                           kv_segment_ids=None,
                           causal_alignment: str = "top_left",
                           method: str = "fp32",
                           implementation: str | None = None,
                           **options: Any) -> str:
  """The backend (``"mosaic"``, ``"triton"`` or ``"reference"``) that
  :func:`dot_product_attention` would run these arguments on, or its
  error."""
  config = methods.get(method).config_cls.from_options(**options)
  return _normalise(query, key, value, bias, mask, key_value_seq_lengths,
                    config=config, method=method,
                    implementation=implementation, is_causal=is_causal,
                    indices=dict(query_seq_lengths=query_seq_lengths,
                                 local_window_size=local_window_size,
                                 q_segment_ids=q_segment_ids,
                                 kv_segment_ids=kv_segment_ids,
                                 causal_alignment=causal_alignment))[-1]


def ring_attention(query, key, value, *, axis_name, method: str = "fp32",
                   is_causal: bool = False, layout: str = "contiguous",
                   scale: float | None = None, key_value_seq_lengths=None,
                   implementation: str | None = None,
                   return_residual: bool = False, **options: Any):
  """Attention over a sequence sharded along mesh axis ``axis_name``; call
  inside ``jax.shard_map(..., check_vma=False)`` (:mod:`jaxattn.ring`).

  Args:
    query: the local ``[B, T/n, N, H]`` chunk(s) of the queries.
    key, value: the local ``[B, S/n, K, H]`` chunk(s); with ``is_causal``,
      ``T == S``.
    axis_name: the mesh axis (or tuple of axes) the sequence is sharded
      over; ValueError when it is not bound.
    layout: ``"contiguous"`` or ``"zigzag"`` (causal load balance; permute
      with :func:`jaxattn.ring.to_zigzag` before sharding and
      :func:`jaxattn.ring.from_zigzag` after).
    key_value_seq_lengths: int ``[B]``, global key lengths (keys at or
      beyond are masked), as in :func:`jaxattn.dot_product_attention`.
    method, scale, implementation, **options: as
      :func:`jaxattn.dot_product_attention`.  Each step runs the method on
      one chunk; ``fmha_int8`` with ``return_int8`` is refused (its output
      scale is one per tensor).
    return_residual: also return the float32 log-sum-exp ``[B, T/n, N]``.

  Returns:
    The local ``[B, T/n, N, H]`` output in the query dtype (and the
    log-sum-exp).  Differentiable (a ring backward, module docstring).
  """
  n = ring.axis_size(axis_name)
  config = methods.get(method).config_cls.from_options(**options)
  if getattr(config, "return_int8", False):
    raise NotImplementedError(
        "fmha_int8 with return_int8=True: its output scale is one per "
        "tensor, which a ring of partial outputs does not have")
  unbatched = getattr(query, "ndim", 0) == 3
  q, k, v, _, _, _, _, impl = _normalise(
      query, key, value, None, None, None, config=config, method=method,
      implementation=implementation, is_causal=is_causal)
  config = backend_config(method, impl, config, options,
                          is_causal=bool(is_causal))
  b, c = q.shape[0], k.shape[1]
  if key_value_seq_lengths is None:
    kv_lens = jnp.full((b,), n * c, jnp.int32)
  else:
    kv_lens = _lengths(key_value_seq_lengths, "key_value_seq_lengths", b,
                       n * c)
  q, scale = _positive_scale(q, scale)
  out, lse = ring.attention(
      q, k, v, kv_lens, axis_name=axis_name, is_causal=is_causal,
      layout=layout, return_residual=True,
      step=ring.Step(method, impl, scale, config, forward=_forward,
                     resolve=resolve_implementation))
  if unbatched:
    out, lse = out[0], lse[0]
  return (out, lse) if return_residual else out


def _named(method: str, doc: str):
  def fn(query, key, value, bias=None, mask=None, *, scale=None,
         is_causal=False, query_seq_lengths=None, key_value_seq_lengths=None,
         local_window_size=None, q_segment_ids=None, kv_segment_ids=None,
         causal_alignment="top_left", implementation=None,
         return_residual=False, **options):
    return dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, causal_alignment=causal_alignment,
        method=method, implementation=implementation,
        return_residual=return_residual, **options)
  fn.__name__ = f"{method}_attention"
  fn.__doc__ = (f"{doc}\n\n``dot_product_attention(..., method={method!r})``; "
                "same signature and options.")
  return fn

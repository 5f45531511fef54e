"""Flax integration: jaxattn methods as the ``attention_fn`` of
``flax.nnx.MultiHeadAttention`` and ``flax.linen.MultiHeadDotProductAttention``.

::

  from flax import nnx
  import jaxattn.flax

  layer = nnx.MultiHeadAttention(
      num_heads=8, in_features=512, decode=False, rngs=nnx.Rngs(0),
      attention_fn=jaxattn.flax.make_attention_fn("sage", preset="sage2-4b"))

Per-layer choice (SageAttn-mix's 4-bit / 8-bit presets, PASA on the layers
whose float16 scores overflow) is plain configuration: a mapping from a layer
name *you* choose to a method, turned into one ``attention_fn`` per layer by
:func:`attention_fns`::

  choice = jaxattn.choose_precision(calibration, xi_percent=30)
  fns = jaxattn.flax.attention_fns(choice | {"layer_5": "pasa"},
                                   default="fp32")
  blocks = [Block(..., attention_fn=fns[f"layer_{i}"]) for i in range(n)]

Flax's arguments and what happens to them:

* ``query``, ``key``, ``value``: ``[batch..., length, heads, head_dim]`` (any
  number of batch dims, also none), i.e. jaxattn's BTNH; extra batch dims are
  flattened into one and restored.  Key/value heads may divide the query
  heads (grouped-query attention, ``num_kv_heads``).
* ``bias`` (float) and ``mask`` (True keeps a score; cast to bool as flax
  does), broadcastable to ``[batch..., heads, q_len, kv_len]``.
* ``is_causal`` (nnx): top-left aligned, as in flax and ``jax.nn``
  (``make_attention_fn(..., causal_alignment="bottom_right")`` for chunked
  prefill; ``local_window_size=`` there for sliding-window layers).
* Packed sequences and padding without a dense mask: pass a
  :class:`SequenceMask` as the module's ``mask``; flax hands it through to
  the ``attention_fn`` unchanged (outside flax's own decode cache, which
  builds a dense mask)::

    y = layer(x, mask=jaxattn.flax.SequenceMask(q_segment_ids=segments))
* ``dtype``: as in flax's default, the inputs are cast to it (default: their
  promoted dtype) and the output has it; the method's own arithmetic
  (float16 scores, int8/int4/fp8 operands, float32 softmax) is unchanged.
* ``dropout_rate`` > 0 with ``deterministic=False`` raises ``ValueError``:
  flash kernels never form the attention weights, so there is nothing to drop
  out.  Evaluation (``deterministic=True``) runs without dropout as flax does.
* ``precision`` is ignored: ``jax.lax.Precision`` selects the XLA matmul
  algorithm, whereas a jaxattn method fixes the precision of every operand
  itself (that is its point), so there is no matmul left for it to govern.
* ``module`` (passed for ``sow_weights=True``) is ignored: the weights are
  never materialised, so nothing is sown.  ``force_fp32_for_softmax``
  (linen) is ignored: every method keeps its softmax statistics in float32
  except ``"fp16"``/``"pasa"``, whose float16 statistics are the point.
* ``qk_attn_weights_einsum`` / ``attn_weights_value_einsum`` (linen, AQT)
  must be None: the method computes both products itself.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import dataclasses

import flax  # noqa: F401  (the integration requires Flax to be installed)
import jax
import jax.numpy as jnp

from jaxattn import api, methods, sage

AttentionFn = Callable[..., Any]


def _flatten_batch(x, n_batch: int, batch_shape: tuple[int, ...]):
  """``x``: ``[batch..., a, b, c]`` broadcastable to ``batch_shape`` in its
  batch dims (missing leading dims count as 1) -> ``[prod(batch) or 1, a, b,
  c]``; batch dims of size 1 everywhere stay a single broadcast dim."""
  x = jnp.asarray(x)
  x = x.reshape((1,) * (n_batch + 3 - x.ndim) + x.shape)
  if all(d == 1 for d in x.shape[:n_batch]):
    return x.reshape((1, *x.shape[n_batch:]))
  x = jnp.broadcast_to(x, batch_shape + x.shape[n_batch:])
  return x.reshape((math.prod(batch_shape), *x.shape[n_batch:]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SequenceMask:
  """What a packed or padded batch masks, as indices: pass it as the
  ``mask`` of ``nnx.MultiHeadAttention`` / ``linen.MultiHeadDotProductAttention``
  with a jaxattn ``attention_fn``, which computes it inside the kernels
  (``jaxattn.dot_product_attention``'s keywords of the same names).

  Attributes:
    q_segment_ids: int ``[batch..., q_len]``: a score is kept only where the
      query's and the key's ids are equal (packed documents).
    kv_segment_ids: int ``[batch..., kv_len]``; default ``q_segment_ids``.
    query_seq_lengths: int ``[batch...]``: later query rows are padding
      (their output is 0).
    key_value_seq_lengths: int ``[batch...]``: later keys are masked.
    mask: an ordinary boolean mask to combine, or None.
  """
  q_segment_ids: Any = None
  kv_segment_ids: Any = None
  query_seq_lengths: Any = None
  key_value_seq_lengths: Any = None
  mask: Any = None


def _flat_index(x, n_batch: int, batch_shape: tuple[int, ...], trailing: int):
  """``x`` ``[batch..., *trailing dims]`` -> ``[prod(batch), ...]``."""
  if x is None:
    return None
  x = jnp.broadcast_to(jnp.asarray(x), batch_shape + jnp.shape(x)[
      jnp.ndim(x) - trailing:])
  return x.reshape((math.prod(batch_shape), *x.shape[n_batch:]))


def make_attention_fn(method: str = "fp32", implementation: str | None = None,
                      *, local_window_size: int | tuple[int, int] | None = None,
                      causal_alignment: str = "top_left",
                      **options: Any) -> AttentionFn:
  """An ``attention_fn`` for ``nnx.MultiHeadAttention`` /
  ``linen.MultiHeadDotProductAttention`` computing
  ``jaxattn.dot_product_attention(..., method=method, **options)``.

  Args:
    method: one of ``jaxattn.METHODS``.
    implementation: None, "reference", "triton" or "mosaic", as in
      ``jaxattn.dot_product_attention``.
    local_window_size: sliding-window attention for this layer (an int or
      ``(left, right)``, as ``jax.nn``).
    causal_alignment: ``"top_left"`` (flax's ``is_causal``) or
      ``"bottom_right"`` (the last query sees the last key).
    **options: the method's options (e.g. ``preset="sage2-4b"``); checked
      now, an unknown one raises ``TypeError``.

  Returns:
    ``attention_fn(query, key, value, bias=None, mask=None, ...)`` taking
    flax's arguments (see the module docstring) and returning
    ``[batch..., q_len, heads, v_head_dim]`` in ``dtype`` (default: the
    promoted input dtype).  Its ``method``, ``implementation`` and
    ``options`` attributes say what it computes.
  """
  m = methods.get(method)               # unknown method: ValueError now
  m.config_cls.from_options(**options)  # unknown option: TypeError now
  implementation = api.implementation_name(implementation)
  if local_window_size is not None:
    api.window_pair(local_window_size)   # a bad window: ValueError now
  if causal_alignment not in api.CAUSAL_ALIGNMENTS:
    raise ValueError(f"causal_alignment must be one of "
                     f"{api.CAUSAL_ALIGNMENTS}, got {causal_alignment!r}")

  def attention_fn(query, key, value, bias=None, mask=None,
                   broadcast_dropout: bool = True, dropout_rng=None,
                   dropout_rate: float = 0.0, deterministic: bool = False,
                   dtype=None, precision=None, module=None,
                   is_causal: bool = False,
                   force_fp32_for_softmax: bool = False,
                   qk_attn_weights_einsum=None,
                   attn_weights_value_einsum=None):
    del broadcast_dropout, dropout_rng, precision, module
    del force_fp32_for_softmax
    if dropout_rate > 0.0 and not deterministic:
      raise ValueError(
          f"jaxattn method {method!r} has no attention dropout (flash "
          f"attention never forms the weights): got dropout_rate="
          f"{dropout_rate} with deterministic=False; set dropout_rate=0 or "
          "deterministic=True")
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
      raise ValueError(
          f"jaxattn method {method!r} computes Q K^T and P V itself; "
          "qk_attn_weights_einsum / attn_weights_value_einsum must be None")
    if dtype is None:
      dtype = jnp.result_type(query, key, value)
    query, key, value = (jnp.asarray(x, dtype) for x in (query, key, value))
    batch_shape = query.shape[:-3]
    n_batch = len(batch_shape)
    if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
      raise ValueError(f"batch dims differ: query {query.shape}, key "
                       f"{key.shape}, value {value.shape}")
    flat = lambda x: x.reshape((math.prod(batch_shape), *x.shape[n_batch:]))
    q, k, v = map(flat, (query, key, value))
    index = {}
    if isinstance(mask, SequenceMask):
      index = dict(
          q_segment_ids=_flat_index(mask.q_segment_ids, n_batch,
                                    batch_shape, 1),
          kv_segment_ids=_flat_index(mask.kv_segment_ids, n_batch,
                                     batch_shape, 1),
          query_seq_lengths=_flat_index(mask.query_seq_lengths, n_batch,
                                        batch_shape, 0),
          key_value_seq_lengths=_flat_index(mask.key_value_seq_lengths,
                                            n_batch, batch_shape, 0))
      mask = mask.mask
    if bias is not None:
      bias = _flatten_batch(bias, n_batch, batch_shape)
    if mask is not None:
      mask = _flatten_batch(jnp.asarray(mask).astype(jnp.bool_), n_batch,
                            batch_shape)
    out = api.dot_product_attention(
        q, k, v, bias, mask, is_causal=is_causal, method=method,
        implementation=implementation, local_window_size=local_window_size,
        causal_alignment=causal_alignment, **index, **options)
    return out.reshape((*batch_shape, *out.shape[1:])).astype(dtype)

  attention_fn.method = method
  attention_fn.implementation = implementation
  attention_fn.options = dict(options)
  attention_fn.__name__ = f"jaxattn_{method}_attention_fn"
  attention_fn.__qualname__ = attention_fn.__name__
  return attention_fn


def layer_options(spec: str | Mapping[str, Any]) -> dict[str, Any]:
  """One layer's configuration as ``make_attention_fn`` keyword arguments.

  ``spec`` is a method name (``"pasa"``), a ``"sage"`` preset name
  (``"sage2-4b"``, what ``jaxattn.choose_precision`` returns per layer)
  or a mapping ``{"method": ..., **options}`` (``"implementation"`` allowed;
  ``"method"`` defaults to ``"fp32"``, or to ``"sage"`` when ``"preset"`` is
  given).
  """
  if isinstance(spec, str):
    if spec in methods.METHODS:
      return {"method": spec}
    if spec in sage.PRESETS:
      return {"method": "sage", "preset": spec}
    raise ValueError(f"unknown attention {spec!r}: not a method "
                     f"{tuple(methods.METHODS)} nor a sage preset "
                     f"{tuple(sage.PRESETS)}")
  if isinstance(spec, Mapping):
    spec = dict(spec)
    spec.setdefault("method", "sage" if "preset" in spec else "fp32")
    return spec
  raise TypeError(f"a layer's attention must be a str or a mapping, got "
                  f"{type(spec).__name__}")


class LayerAttentionFns(dict):
  """``{layer name: attention_fn}``; with a ``default``, indexing a name
  not in the configuration returns the default's ``attention_fn``."""

  def __init__(self, fns: Mapping[str, AttentionFn],
               default: AttentionFn | None = None):
    super().__init__(fns)
    self.default = default

  def __missing__(self, name):
    if self.default is None:
      raise KeyError(f"no attention configured for layer {name!r} and no "
                     f"default; configured: {sorted(self)}")
    return self.default


def attention_fns(config: Mapping[str, str | Mapping[str, Any]], *,
                  default: str | Mapping[str, Any] | None = None,
                  implementation: str | None = None) -> LayerAttentionFns:
  """One ``attention_fn`` per layer from plain configuration.

  Args:
    config: ``{layer name: spec}``, names of your choosing (``"layer_3"``,
      or ``(layer, timestep)`` keys); ``spec`` as in :func:`layer_options`,
      so the output of ``jaxattn.choose_precision`` is accepted as is.
    default: the spec of layers not in ``config`` (None: such a name raises
      ``KeyError``).
    implementation: for every layer whose spec does not name one.

  Returns:
    a dict ``{layer name: attention_fn}`` (a :class:`LayerAttentionFns`):
    pass ``fns[name]`` as the ``attention_fn`` of that layer.  Every spec is
    validated now.
  """
  def build(spec):
    options = layer_options(spec)
    options.setdefault("implementation", implementation)
    return make_attention_fn(**options)

  return LayerAttentionFns(
      {name: build(spec) for name, spec in config.items()},
      None if default is None else build(default))


__all__ = ["make_attention_fn", "attention_fns", "layer_options",
           "LayerAttentionFns", "SequenceMask"]


# ----------------------------------------------------------------------------
# Decode with a quantized KV cache (jaxattn.decode).

from flax import nnx as _nnx  # noqa: E402

from jaxattn import decode as _decode  # noqa: E402

_CACHE_FIELDS = ("k", "v", "k_scale", "v_scale", "k_mean")
_PAGED_FIELDS = ("k_pages", "v_pages", "k_scale", "v_scale", "k_mean")


class QuantizedCacheAttention(_nnx.MultiHeadAttention):
  """``nnx.MultiHeadAttention`` whose decode path keeps a
  :class:`jaxattn.KVCache` (int8 / fp8 / float16 / bfloat16, quantized
  once per token as it is appended) and attends with
  :func:`jaxattn.decode_attention`.  A drop-in: same constructor (plus the
  keywords below), same parameters, same ``init_cache(input_shape)``;
  without ``decode`` it is ``nnx.MultiHeadAttention`` unchanged.

  Args (keywords, besides ``nnx.MultiHeadAttention``'s):
    cache_method: the decode method ("int8", "fp8", "sage", "pasa",
      "fp32"); the cache has its default format
      (:data:`jaxattn.decode.METHOD_CACHES`) unless ``cache_options``
      (``k_dtype``, ``v_dtype``, ``smooth_k``) say otherwise.
    decode_options: keyword arguments of ``jaxattn.decode_attention``
      (``implementation``, ``num_splits``, ...).
    num_pages, page_size: a paged cache (:class:`jaxattn.decode.
      PagedKVCache`) of ``num_pages`` pages of ``page_size`` tokens
      (a power of two >= 16) instead of a dense one; see below.

  In decode mode a call takes ``[batch, T, features]`` (one batch dim):
  its ``T`` tokens are appended at the cache index and attend to the
  cache causally (bottom-right).  ``T <= 16`` runs the decode kernel; a
  longer call (a prompt) attends to the dequantized cache through
  ``jaxattn.dot_product_attention`` (float32), then decode continues
  from the quantized cache.  ``mask`` must be None in decode mode (the
  positions come from the cache index), as must dropout.

  **Paged** (``num_pages`` given): ``init_cache((slots, max_length,
  features))`` makes the pool, one key shift per sequence slot, and a page
  table ``page_indices`` int32 ``[slots, ceil(max_length / page_size)]``
  with the slots' lengths ``seq_lengths`` int32 ``[slots]``, kept in the
  module (``nnx.Cache``).  The caller owns the table (the contract of
  :class:`~jaxattn.decode.PagedKVCache`) and sets rows of it with
  :meth:`set_page_table` (one layer) or :meth:`set_page_tables` (every
  paged layer of a model: they share one table) when a request takes a
  slot; the table starts as slot ``b`` owning pages ``b * n .. (b + 1) *
  n - 1`` where the pool holds ``slots * n`` pages, else with no page.  A
  call ``layer(x, seq_ids=..., active=...)`` takes the rows ``[B, T,
  features]`` of the slots ``seq_ids`` (int ``[B]``, default all slots),
  appends their tokens at their lengths and advances those; rows with
  ``active`` False (bool ``[B]``) append nothing and output the output
  projection of 0 (idle slots of a fixed-size batch).
  """

  def __init__(self, *args, cache_method: str = "int8",
               cache_options: Mapping[str, Any] | None = None,
               decode_options: Mapping[str, Any] | None = None,
               num_pages: int | None = None, page_size: int = 16, **kwargs):
    super().__init__(*args, **kwargs)
    if cache_method not in _decode.METHOD_CACHES:
      raise ValueError(f"cache_method must be one of "
                       f"{sorted(_decode.METHOD_CACHES)}, got "
                       f"{cache_method!r}")
    self.cache_method = cache_method
    self.cache_options = dict(cache_options or {})
    self.decode_options = dict(decode_options or {})
    _decode.DecodeConfig.from_options(**{
        k: v for k, v in self.decode_options.items()
        if k != "implementation"})
    if num_pages is not None and (
        not isinstance(num_pages, int) or num_pages < 1 or
        not isinstance(page_size, int) or page_size < 16
        or page_size & (page_size - 1)):
      raise ValueError(f"num_pages must be a positive int and page_size a "
                       f"power of two >= 16, got {num_pages!r}, "
                       f"{page_size!r}")
    self.num_pages, self.page_size = num_pages, page_size
    self.paged = num_pages is not None
    for name in dict.fromkeys(_CACHE_FIELDS + _PAGED_FIELDS):
      setattr(self, f"kv_{name}", _nnx.data(None))
    self.page_indices = _nnx.data(None)
    self.seq_lengths = _nnx.data(None)

  @property
  def _fields(self):
    return _PAGED_FIELDS if self.paged else _CACHE_FIELDS

  def init_cache(self, input_shape, dtype=jnp.float32):
    """An empty quantized cache for inputs ``[batch, max_length,
    features]`` (paged: ``batch`` sequence slots of up to ``max_length``
    tokens; ``dtype`` is unused: the cache format is the method's)."""
    del dtype
    if len(input_shape) != 3:
      raise ValueError("QuantizedCacheAttention takes inputs [batch, "
                       f"length, features], got shape {input_shape}")
    batch, max_length = input_shape[0], input_shape[1]
    if self.paged:
      cache = _decode.PagedKVCache.create(
          self.num_pages, self.page_size, self.num_kv_heads, self.head_dim,
          num_seqs=batch, method=self.cache_method, **self.cache_options)
      n = -(-max_length // self.page_size)
      # the dense layout when the pool holds it; else no page (page P:
      # eager writes raise, jitted ones are dropped) until the caller sets
      # the table
      table = (jnp.arange(batch * n, dtype=jnp.int32).reshape(batch, n)
               if self.num_pages >= batch * n
               else jnp.full((batch, n), self.num_pages, jnp.int32))
      self.page_indices = _nnx.Cache(table)
      self.seq_lengths = _nnx.Cache(jnp.zeros(batch, jnp.int32))
    else:
      cache = _decode.KVCache.create(
          batch, max_length, self.num_kv_heads, self.head_dim,
          method=self.cache_method, **self.cache_options)
      self.cache_index = _nnx.Cache(jnp.array(0, dtype=jnp.int32))
    for name in self._fields:
      x = getattr(cache, name)
      setattr(self, f"kv_{name}",
              _nnx.data(None) if x is None else _nnx.Cache(x))

  def set_page_table(self, page_indices, lengths=None, *, seq_ids=None):
    """Sets rows of the page table (paged cache): ``page_indices`` int
    ``[B, n]`` (``n`` up to the table's width; missing entries are 0, never
    read) for the slots ``seq_ids`` (int ``[B]``, default all), with their
    ``lengths`` (int ``[B]``, default 0: a new sequence, whose first call
    sets the slot's key shift)."""
    if not self.paged or self.page_indices is None:
      raise ValueError("set_page_table needs a paged cache "
                       "(QuantizedCacheAttention(..., num_pages=...)) after "
                       "init_cache")
    table = self.page_indices[...]
    page_indices = jnp.asarray(page_indices, jnp.int32)
    if page_indices.ndim != 2 or page_indices.shape[1] > table.shape[1]:
      raise ValueError(f"page_indices must be [B, n] with n <= "
                       f"{table.shape[1]}, got {page_indices.shape}")
    b = page_indices.shape[0]
    missing = table.shape[1] - page_indices.shape[1]
    page_indices = jnp.pad(page_indices, ((0, 0), (0, missing)))
    seq_ids = (jnp.arange(b) if seq_ids is None
               else jnp.asarray(seq_ids, jnp.int32))
    lengths = (jnp.zeros(b, jnp.int32) if lengths is None
               else jnp.asarray(lengths, jnp.int32))
    if seq_ids.shape != (b,) or lengths.shape != (b,):
      raise ValueError(f"seq_ids and lengths must have shape ({b},), got "
                       f"{seq_ids.shape} and {lengths.shape}")
    self.page_indices[...] = table.at[seq_ids].set(page_indices)
    self.seq_lengths[...] = self.seq_lengths[...].at[seq_ids].set(lengths)

  @staticmethod
  def set_page_tables(model, page_indices, lengths=None, *, seq_ids=None):
    """:meth:`set_page_table` on every paged
    :class:`QuantizedCacheAttention` in ``model`` (an nnx module);
    returns how many were set."""
    layers = [m for _, m in _nnx.iter_graph(model)
              if isinstance(m, QuantizedCacheAttention) and m.paged]
    for m in layers:
      m.set_page_table(page_indices, lengths, seq_ids=seq_ids)
    return len(layers)

  def _cache(self):
    cls = _decode.PagedKVCache if self.paged else _decode.KVCache
    return cls(**{
        name: (None if getattr(self, f"kv_{name}") is None
               else getattr(self, f"kv_{name}")[...])
        for name in self._fields})

  def __call__(self, inputs_q, inputs_k=None, inputs_v=None, *, mask=None,
               deterministic=None, rngs=None, sow_weights=False,
               decode=None, seq_ids=None, active=None, **kwargs):
    decode = self.decode if decode is None else decode
    if not decode:
      return super().__call__(inputs_q, inputs_k, inputs_v, mask=mask,
                              deterministic=deterministic, rngs=rngs,
                              sow_weights=sow_weights, decode=False,
                              **kwargs)
    if getattr(self, f"kv_{self._fields[0]}") is None:
      raise ValueError("Autoregressive cache not initialized, call "
                       "``init_cache`` first.")
    if mask is not None:
      raise ValueError("the quantized-cache decode path takes no mask: "
                       "the positions come from the cache index")
    if kwargs.get("input_positions") is not None:
      # flax applies rotary embeddings inside its attention_fn, which the
      # decode path does not call: refuse rather than silently skip them
      raise NotImplementedError(
          "the quantized-cache decode path does not apply rotary "
          "embeddings (input_positions); apply them to the inputs")
    if self.dropout_rate > 0.0 and not (
        deterministic if deterministic is not None
        else self.deterministic):
      raise ValueError("the quantized-cache decode path has no dropout")
    if not self.paged and (seq_ids is not None or active is not None):
      raise ValueError("seq_ids and active are for a paged cache "
                       "(num_pages=...)")
    inputs_k = inputs_q if inputs_k is None else inputs_k
    inputs_v = inputs_k if inputs_v is None else inputs_v
    query = self.query(inputs_q)
    key = self.key(inputs_k)
    value = self.value(inputs_v)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)
    b, t = query.shape[0], query.shape[1]
    page_indices = None
    if self.paged:
      seq_ids = (jnp.arange(b, dtype=jnp.int32) if seq_ids is None
                 else jnp.asarray(seq_ids, jnp.int32))
      active = (jnp.ones(b, bool) if active is None
                else jnp.asarray(active, bool))
      counts = jnp.where(active, t, 0).astype(jnp.int32)
      page_indices = self.page_indices[...][seq_ids]
      lengths = self.seq_lengths[...][seq_ids]
      cache = _decode.append_paged(self._cache(), key, value, lengths,
                                   page_indices, seq_ids=seq_ids,
                                   counts=counts)
      new_lengths = lengths + counts
      self.seq_lengths[...] = self.seq_lengths[...].at[seq_ids].set(
          new_lengths)
    else:
      index = self.cache_index[...]
      lengths = jnp.full((b,), index, jnp.int32)
      cache = _decode.append(self._cache(), key, value, lengths)
      self.cache_index[...] = index + t
      new_lengths = lengths + t
    for name in self._fields:
      x = getattr(cache, name)
      if x is not None:
        getattr(self, f"kv_{name}")[...] = x
    if t <= _decode.MAX_NEW_TOKENS:
      x = _decode.decode_attention(query, cache, new_lengths,
                                   page_indices=page_indices,
                                   method=self.cache_method,
                                   **self.decode_options)
    else:   # a prompt: float attention on the dequantized cache
      dense = cache if page_indices is None else _decode.paged_to_dense(
          cache, page_indices, new_lengths, seq_ids=seq_ids)
      k, v = dense.dequantize()
      x = api.dot_product_attention(
          query.astype(jnp.float32), k, v, is_causal=True,
          causal_alignment="bottom_right",
          key_value_seq_lengths=new_lengths).astype(query.dtype)
    if active is not None:
      x = jnp.where(active[:, None, None, None], x, 0)
    return self.out(x.astype(query.dtype))


__all__ += ["QuantizedCacheAttention"]

"""Shard-local attention under ``jax.jit``: the forward and the backward of
:func:`jaxattn.dot_product_attention` as custom-partitioned calls.

XLA cannot partition the Pallas (Triton, Mosaic) custom calls, so a jitted
call on sharded inputs used to gather Q, K and V and run replicated.  Here
each of the two functions that run kernels (the forward, ``api._forward``,
and the backward, :func:`jaxattn.grad.attention_vjp`) is a
``custom_partitioning`` call with a Shardy sharding rule (as jax's own cuDNN
attention): the partitioner hands it the operands' shardings and it runs
the same function on each device's shard:

* batch and heads: shard-local, no communication.  The plan follows the
  query: its batch and head mesh axes shard every operand (K and V heads
  too, so the query heads of a shard meet their own key/value heads);
* the sequence (K/V's ``S`` axis, or the query's ``T``): ring attention
  over those mesh axes (:mod:`jaxattn.ring`), contiguous layout; no bias,
  dense mask or index-mask features there (NotImplementedError).

A ``custom_vmap`` around the partitioned call keeps ``jax.vmap`` working:
every operand and result has the batch axis first, so a vmapped axis is
folded into it.  On one device the partitioned call is inlined.

Per-tensor statistics become per-shard statistics: ``fmha_int8``'s dynamic
amax (one per batched tensor) is taken over the shard, and so are the
per-call choices of a kernel path (the exact or fused exponent on the
Mosaic kernel, PASA's keys' factor, :func:`jaxattn.pasa.with_key_factor`),
which can move a row's last bits where its shard's bound differs from the
whole call's.  Every quantization statistic is per (batch, head) or finer,
so for inputs whose rows take the same paths, batch and head sharding give
the single-device bits.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import jax.extend.core as jex_core
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from jaxattn import grad, ring

# The axes of each array operand, one letter per dimension: b batch,
# t query rows, s keys, n query heads, k key/value heads, h head dim.
Q, KV, DENSE, ROWS, LSE = "btnh", "bskh", "bnts", "b", "btn"
INDEX = {"q_lens": "b", "offsets": "b", "q_segments": "bt",
         "kv_segments": "bs"}   # the fields of pallas_kernels.common.IndexMask
# by position: api._forward's (q, k, v, bias, mask, kv_lens, index_mask) ->
# (out, lse); attention_vjp's (q, k, v, bias, mask, kv_lens, lse, dout, out,
# index_mask) -> (dq, dk, dv, dbias)
FORWARD = ((Q, KV, KV, DENSE, DENSE, ROWS, INDEX), (Q, LSE))
BACKWARD = ((Q, KV, KV, DENSE, DENSE, ROWS, LSE, Q, Q, INDEX),
            (Q, KV, KV, DENSE))


def _axes(table, path) -> str:
  entry = table[path[0].idx]
  return entry[path[1].name] if isinstance(entry, dict) else entry


def _mesh_axes(spec, dim) -> tuple[str, ...]:
  entry = spec[dim] if dim < len(spec) else None
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


@dataclasses.dataclass(frozen=True)
class Plan:
  """The mesh axes that shard the batch, the heads and the sequence of
  every operand."""
  batch: tuple[str, ...] = ()
  heads: tuple[str, ...] = ()
  seq: tuple[str, ...] = ()

  def spec(self, axes: str) -> PartitionSpec:
    by_letter = {"b": self.batch, "t": self.seq, "s": self.seq,
                 "n": self.heads, "k": self.heads}

    def entry(names):
      return None if not names else names[0] if len(names) == 1 else names
    return PartitionSpec(*(entry(by_letter.get(a, ())) for a in axes))


def plan(mesh_shape, q_shape, q_spec, k_shape, k_spec) -> Plan:
  """The :class:`Plan` for a query ``[B, T, N, H]`` and keys ``[B, S, K,
  H]`` sharded by ``q_spec`` and ``k_spec`` (PartitionSpecs over a mesh of
  axis sizes ``mesh_shape``): batch and heads as the query's, the sequence
  as the keys' (else as the query's).  ValueError when a sharded dimension
  does not divide."""
  batch, heads = _mesh_axes(q_spec, 0), _mesh_axes(q_spec, 2)
  seq = _mesh_axes(k_spec, 1) or _mesh_axes(q_spec, 1)
  seq = tuple(a for a in seq if a not in batch + heads)

  def size(names):
    return math.prod(mesh_shape[a] for a in names)
  b, t, n, _ = q_shape
  s, nk = k_shape[1], k_shape[2]
  if b % size(batch):
    raise ValueError(f"batch {b} is not divisible by the {size(batch)} "
                     f"shards of mesh axes {batch}")
  if n % size(heads) or nk % size(heads):
    raise ValueError(
        f"query heads ({n}) and key/value heads ({nk}) must both be "
        f"divisible by the {size(heads)} shards of mesh axes {heads} that "
        "shard the heads (a shard's query heads must meet their own "
        "key/value heads); shard the batch instead, or replicate the heads")
  if t % size(seq) or s % size(seq):
    raise ValueError(f"query length {t} and key length {s} must be "
                     f"divisible by the {size(seq)} shards of mesh axes "
                     f"{seq} that shard the sequence")
  return Plan(batch, heads, seq)


def _rule(in_axes, out_axes, groups: int):
  """The Shardy rule: one factor per letter; query heads ``n`` are the
  compound ``(k g)`` of key/value heads and groups under GQA."""
  def term(axes):
    if groups == 1:
      return " ".join("n" if a == "k" else a for a in axes)
    return " ".join("(k g)" if a == "n" else a for a in axes)
  rule = (", ".join(map(term, in_axes)) + " -> "
          + ", ".join(map(term, out_axes)))
  return (rule, {"g": groups}) if groups > 1 else rule


def shard_local(fn: Callable, axes, ring: Callable | None = None):
  """``fn(*arrays, **static)`` as a shard-local call under jit.

  ``axes`` is ``(argument axes, result axes)`` by position (a dict of axes
  by field for a dataclass pytree such as the IndexMask); ``fn``'s
  arguments and results are pytrees of arrays (or None).  Where the plan
  shards the sequence, ``ring(*arrays, axis_name=..., **static)`` runs
  instead of ``fn`` (with the same results).
  """
  in_table, out_table = axes

  def wrapped(*args, **static):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(args)
    in_axes = tuple(_axes(in_table, p) for p, _ in leaves)
    flat = [x for _, x in leaves]
    out_tree = []

    def body(f, *xs, **extra):
      out = f(*jax.tree.unflatten(treedef, xs), **static, **extra)
      paths, tree = jax.tree_util.tree_flatten_with_path(out)
      out_tree[:] = [tree, tuple(_axes(out_table, p) for p, _ in paths)]
      return tuple(x for _, x in paths)

    groups = (flat[in_axes.index(Q)].shape[2]
              // flat[in_axes.index(KV)].shape[2])
    call = _partitioned(functools.partial(body, fn),
                        ring and functools.partial(body, ring), in_axes,
                        out_tree, groups)
    mesh = _explicit_mesh(flat)
    if mesh is None:
      outs = call(*flat)
    else:
      # explicit sharding: the operands' types carry it, which the code
      # inside cannot take; run it on Auto axes and give the results the
      # plan's explicit shardings
      jax.eval_shape(functools.partial(body, fn), *(
          jax.ShapeDtypeStruct(x.shape, x.dtype) for x in flat))
      q, k = flat[in_axes.index(Q)], flat[in_axes.index(KV)]
      p = plan(dict(zip(mesh.axis_names, mesh.axis_sizes)), q.shape,
               jax.typeof(q).sharding.spec, k.shape,
               jax.typeof(k).sharding.spec)
      outs = jax.sharding.auto_axes(call, out_sharding=tuple(
          NamedSharding(mesh, p.spec(a)) for a in out_tree[1]))(*flat)
    return jax.tree.unflatten(out_tree[0], outs)
  return wrapped


def _explicit_mesh(flat):
  """The abstract mesh of the operands where some of its axes are
  Explicit, else None."""
  for x in flat:
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty and any(
        t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
      return mesh
  return None


def _partitioned(local, ring_local, in_axes, out_tree, groups):
  """``local(*flat)`` as a custom_vmap of a custom_partitioning call."""
  q_pos, k_pos = in_axes.index(Q), in_axes.index(KV)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    q, k = arg_shapes[q_pos], arg_shapes[k_pos]
    p = plan(dict(mesh.shape), q.shape, q.sharding.spec, k.shape,
             k.sharding.spec)
    body = local
    if p.seq:
      if ring_local is None:
        raise NotImplementedError("this call cannot run sequence-sharded")
      axis = p.seq[0] if len(p.seq) == 1 else p.seq

      def body(*xs):
        return ring_local(*xs, axis_name=axis)
    shard = lambda axes: NamedSharding(mesh, p.spec(axes))  # noqa: E731
    return (mesh, body, tuple(shard(a) for a in out_tree[1]),
            tuple(shard(a) for a in in_axes))

  def rule(mesh, value_types, result_types):
    del mesh, value_types, result_types   # out_tree is known once traced
    return _rule(in_axes, out_tree[1], groups)

  # jit: custom_partitioning takes no closed-over constants (PASA's
  # shifting matrix), a jitted function holds them itself
  jitted = jax.jit(local)
  cp = custom_partitioning(jitted)
  cp.def_partition(partition=partition, sharding_rule=rule)

  @custom_vmap
  def call(*xs):
    if _host_callbacks(jax.make_jaxpr(jitted)(*xs)):
      # the interpreters (no GPU) run kernels in host callbacks: Mosaic
      # GPU's ordered ones do not lower inside custom_partitioning, and
      # Triton's (pure_callback) crash XLA:CPU there (jax 0.12, 4 devices):
      # unpartitioned
      return jitted(*xs)
    return cp(*xs)

  @call.def_vmap
  def fold(axis_size, in_batched, *xs):
    # every operand and result has the batch axis first: fold the vmapped
    # axis into it
    xs = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
          for x, b in zip(xs, in_batched)]
    outs = _partitioned(local, ring_local, in_axes, out_tree, groups)(
        *(x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in xs))
    return (tuple(o.reshape(axis_size, -1, *o.shape[1:]) for o in outs),
            (True,) * len(outs))

  return call


def _host_callbacks(closed_jaxpr) -> bool:
  """Whether the jaxpr (or one nested in it) calls back into the host: an
  effect (ordered callbacks) or a ``pure_callback``."""
  if closed_jaxpr.effects:
    return True

  def subjaxprs(value):
    if isinstance(value, jex_core.ClosedJaxpr):
      yield value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
      yield value
    elif isinstance(value, (tuple, list)):
      for v in value:
        yield from subjaxprs(v)

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if "callback" in eqn.primitive.name:
        return True
      if any(walk(sub) for v in eqn.params.values()
             for sub in subjaxprs(v)):
        return True
    return False
  return walk(closed_jaxpr.jaxpr)


def _ring_takes(bias, mask, index_mask, axis_name):
  if bias is not None or mask is not None or index_mask is not None:
    raise NotImplementedError(
        f"the sequence is sharded over mesh axes {axis_name}, where "
        "attention runs as a ring (jaxattn.ring), which takes no bias, "
        "dense mask, query lengths, window, alignment or segment ids; "
        "shard the batch or the heads instead")


def _forward_ring(q, k, v, bias, mask, kv_lens, index_mask, *, axis_name,
                  forward, method, implementation, scale, is_causal, config,
                  with_lse, all_keys=False):
  del all_keys   # a ring step sees a shard of the keys, as lengths
  _ring_takes(bias, mask, index_mask, axis_name)
  out, lse = ring.ring_forward(q, k, v, kv_lens, ring.Options(
      axis_name=axis_name, is_causal=is_causal, layout="contiguous",
      step=ring.Step(method, implementation, scale, config,
                     forward=forward)))
  return out, (lse if with_lse else None)


def _vjp(q, k, v, bias, mask, kv_lens, lse, dout, out, index_mask, *,
         exact_step, **static):
  del exact_step   # (the ring's)
  return grad.attention_vjp(q, k, v, bias, mask, kv_lens, lse, dout,
                            out=out, index_mask=index_mask, **static)


def _vjp_ring(q, k, v, bias, mask, kv_lens, lse, dout, out, index_mask, *,
              axis_name, exact_step, scale, is_causal, on_gpu):
  del on_gpu
  _ring_takes(bias, mask, index_mask, axis_name)
  opts = ring.Options(axis_name=axis_name, is_causal=is_causal,
                      layout="contiguous", step=exact_step)
  dq, dk, dv = ring.ring_backward(q, k, v, kv_lens, out, lse, dout, opts)
  return dq, dk, dv, None


def forward(fwd: Callable) -> Callable:
  """``api._forward`` (passed in: this module does not import the API) as a
  shard-local call; same signature."""
  return shard_local(fwd, FORWARD,
                     ring=functools.partial(_forward_ring, forward=fwd))


def attention_vjp(q, k, v, bias, mask, kv_lens, lse, dout, *, out=None,
                  index_mask=None, exact_step: ring.Step, **static: Any):
  """:func:`jaxattn.grad.attention_vjp` as a shard-local call (a ring
  backward where the sequence is sharded, whose exact residuals, when the
  forward's are not, come from a ring of ``exact_step``: float32
  attention); same signature otherwise."""
  return _backward(q, k, v, bias, mask, kv_lens, lse, dout, out, index_mask,
                   exact_step=exact_step, **static)


_backward = shard_local(_vjp, BACKWARD, ring=_vjp_ring)

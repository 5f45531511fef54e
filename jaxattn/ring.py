"""Ring attention: sequence parallelism inside ``shard_map``.

Each device holds a chunk of the queries and of the keys/values along the
sequence (mesh axis ``axis_name``, ``n`` devices).  In ``n`` steps every
device attends its queries to each K/V chunk while ``lax.ppermute`` passes
the chunks around the ring (issued before the step's attention, so XLA
overlaps the transfer with it).  Each step is one call of the method (any
of ``jaxattn.METHODS``, any backend) with its log-sum-exp (the kernel's
own, the normalizer of its output, where it has one: ``Adapter.
run_output_lse``; else the float32 scores'); the partial outputs merge
exactly through it::

    lse = logaddexp(lse_a, lse_b)
    out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b     (float32)

A row that sees no key in a step has jax.nn's ``lse`` there (``-0.7 *
float32 max``) and output 0, so it takes no weight; a row that sees no key
at all keeps that value and returns 0, as the single-device call.

PASA: each step is PASA over its chunk (its key blocks, and so its shifts,
are the single-device ones when the chunk is a multiple of ``block_k``);
the pseudo-average ``F`` is only the common reference the state is kept
relative to, which the merge through the exact (reference-free) float32
log-sum-exp replaces.  What it costs is the float16 rounding of each
step's output before the merge; ``docs/design.md`` ("Sharding and ring
attention") has the measurements.

Layouts (``layout=``): ``"contiguous"``: device ``i`` holds rows ``i c ..
(i+1) c - 1``.  ``"zigzag"`` (causal load balance): the sequence is cut
into ``2n`` chunks and device ``i`` holds chunks ``i`` and ``2n - 1 - i``,
so every device does the same causal work; :func:`to_zigzag` and
:func:`from_zigzag` permute a global array to and from that order (before
sharding it contiguously).  Without ``is_causal`` the layout does not
matter.

Gradients: a ``custom_vjp`` with a ring backward.  Autodiff through the
per-step calls would need the gradient of their log-sum-exp, which the
attention VJP does not give (it treats ``lse`` as a residual); the ring
backward instead computes each step's ``dQ``, ``dK``, ``dV`` from the
global output and log-sum-exp (``P = exp(s - lse)``, ``delta = rowsum(dO
O)``), ``dK``/``dV`` travelling with their chunk and arriving home after
``n`` steps.  As the single-device backward, it is float attention's exact
gradient: for a method whose output is not exact it first runs the ring
with ``method="fp32"`` for exact residuals.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxattn import grad, methods
from jaxattn.backends import triton

LAYOUTS = ("contiguous", "zigzag")


@dataclasses.dataclass(frozen=True)
class Step:
  """One ring step: the method's forward on local arrays.

  ``forward`` is ``jaxattn.api._forward`` and ``resolve`` is
  ``jaxattn.api.resolve_implementation`` (passed in: the API calls this
  module, not the reverse); ``implementation`` None is resolved per
  step."""
  method: str
  implementation: str | None
  scale: float
  config: Any = None
  forward: Callable[..., Any] | None = None
  resolve: Callable[..., Any] | None = None

  def __call__(self, q, k, v, kv_lens, is_causal):
    """``(out [B, T, N, H] in q's dtype, lse float32 [B, T, N])``."""
    config = self.config or methods.get(self.method).config_cls()
    impl = self.implementation
    if impl is None:
      impl = self.resolve(q, k, v, is_causal=is_causal, method=self.method,
                          **_options(config))
    # the kernel's own log-sum-exp where it has one: the normalizer of the
    # output it returns, what the merge needs (the float scores' would
    # cost a second attention pass per step)
    return self.forward(q, k, v, None, None, kv_lens, None,
                        method=self.method, implementation=impl,
                        scale=self.scale, is_causal=is_causal,
                        config=config, with_lse=True, output_lse=True)


def _options(config) -> dict:
  return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
          if getattr(config, f.name) != f.default}


@dataclasses.dataclass(frozen=True)
class Options:
  axis_name: Any
  is_causal: bool
  layout: str
  step: Step


def axis_size(axis_name) -> int:
  """The size of mesh axis ``axis_name``; ValueError when it is not bound
  (outside ``shard_map``)."""
  return _check_axis(axis_name)


def _check_axis(axis_name) -> int:
  try:
    return lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"axis_name {axis_name!r} is not bound: call ring_attention inside "
        "jax.shard_map over a mesh with that axis") from e


def _varying(x) -> bool:
  """Whether shard_map tracks ``x``'s varying manual axes (check_vma; the
  attribute moved from ``aval.vma`` in jax 0.11 to ``aval.mat.varying``)."""
  aval = jax.typeof(x)
  return bool(getattr(getattr(aval, "mat", None), "varying", None)
              or getattr(aval, "vma", None))


def to_zigzag(x, n: int, axis: int = 1):
  """``x`` with its ``axis`` cut into ``2n`` chunks reordered ``0, 2n-1, 1,
  2n-2, ...``: sharded contiguously over ``n`` devices, device ``i`` then
  holds chunks ``i`` and ``2n - 1 - i`` (the ``"zigzag"`` layout)."""
  chunks = jnp.split(x, 2 * n, axis=axis)
  return jnp.concatenate([c for i in range(n)
                          for c in (chunks[i], chunks[2 * n - 1 - i])],
                         axis=axis)


def from_zigzag(x, n: int, axis: int = 1):
  """The inverse of :func:`to_zigzag`."""
  chunks = jnp.split(x, 2 * n, axis=axis)
  order = [None] * (2 * n)
  for i in range(n):
    order[i], order[2 * n - 1 - i] = chunks[2 * i], chunks[2 * i + 1]
  return jnp.concatenate(order, axis=axis)


def _chunk_lens(kv_lens, src, c, n, layout):
  """Key lengths of chunk ``src`` (``c`` keys) from the global ones: the
  visible keys of a chunk are a prefix of it; for ``"zigzag"`` also those
  of its first half alone."""
  if layout == "contiguous":
    return jnp.clip(kv_lens - src * c, 0, c), None
  h = c // 2
  first = jnp.clip(kv_lens - src * h, 0, h)
  second = jnp.clip(kv_lens - (2 * n - 1 - src) * h, 0, h)
  return first + second, first


def _pad_rows(x, rows, value):
  """``x`` ``[B, r, ...]`` with ``rows`` rows of ``value`` in front."""
  pad = [(0, 0)] * x.ndim
  pad[1] = (rows, 0)
  return jnp.pad(x, pad, constant_values=value)


def _step(opts, n, s, src, me, c, kv_lens, *, full, lower, upper, nothing,
          diagonal):
  """The work of step ``s`` by the position of chunk ``src`` against ours
  (``me``): ``full``/``diagonal`` compute; a causal step after the first
  picks, by ``src < me``, ``full`` or ``nothing`` (contiguous) or ``lower``
  (first key half) or ``upper`` (second query half) (zigzag).  Each
  takes the chunk's key lengths."""
  lens, first = _chunk_lens(kv_lens, src, c, n, opts.layout)
  if not opts.is_causal:
    return full(lens)
  if isinstance(s, int) and s == 0:
    return diagonal(lens)
  if opts.layout == "contiguous":
    return lax.cond(src < me, full, nothing, lens)
  return lax.cond(src < me, lambda _: lower(first), upper, lens)


def _ring_loop(opts, k, v, compute, init, *, send_after=None):
  """Runs ``compute(s, src, k, v, acc) -> acc`` for the ``n`` steps: step
  0 on the local chunk, then a loop whose body first passes the chunk on
  (so the transfer overlaps the step's compute), and with ``send_after``
  also passes ``send_after(acc)`` on after the compute (the backward's
  dK, dV, which travel with their chunk)."""
  n = _check_axis(opts.axis_name)
  me = lax.axis_index(opts.axis_name)
  perm = [(j, (j + 1) % n) for j in range(n)]
  ring = functools.partial(lax.ppermute, axis_name=opts.axis_name, perm=perm)
  move = (lambda acc: acc) if send_after is None else (
      lambda acc: send_after(acc, ring))

  def body(s, carry):
    k, v, acc = carry
    k_next, v_next = ring((k, v))
    return k_next, v_next, move(compute(s, (me - s) % n, k, v, acc))
  k_next, v_next = ring((k, v)) if n > 1 else (k, v)
  acc = move(compute(0, me, k, v, init))
  return lax.fori_loop(1, n, body, (k_next, v_next, acc))[2] if n > 1 else acc


def ring_forward(q, k, v, kv_lens, opts: Options):
  """``(out [B, T, N, H] in q's dtype, lse float32 [B, T, N])`` of the
  local queries against every chunk of the ring (module docstring)."""
  n, me = _check_axis(opts.axis_name), lax.axis_index(opts.axis_name)
  c, h, th = k.shape[1], k.shape[1] // 2, q.shape[1] // 2
  f32 = jnp.float32
  if opts.is_causal and (q.shape[1] != c or (opts.layout == "zigzag"
                                             and c % 2)):
    raise NotImplementedError(
        f"causal ring attention needs query and key chunks of one length "
        f"(even for the zigzag layout), got {q.shape[1]} and {c}")

  def compute(s, src, k, v, acc):
    step = functools.partial(opts.step, q)

    def upper(lens):
      o, l = opts.step(q[:, th:], k, v, lens, False)
      return (_pad_rows(o, th, 0), _pad_rows(l, th, grad.MASK_VALUE))
    o_s, l_s = _step(
        opts, n, s, src, me, c, kv_lens,
        full=lambda lens: step(k, v, lens, False),
        lower=lambda lens: step(k[:, :h], v[:, :h], lens, False),
        upper=upper,
        nothing=lambda lens: (jnp.zeros(q.shape[:3] + v.shape[3:], q.dtype),
                              jnp.full(q.shape[:3], grad.MASK_VALUE, f32)),
        diagonal=lambda lens: step(k, v, lens, True))
    out, lse = acc
    new = jnp.logaddexp(lse, l_s)   # a row with no key yet: MASK_VALUE
    return (out * jnp.exp(lse - new)[..., None]
            + o_s.astype(f32) * jnp.exp(l_s - new)[..., None], new)
  init = (jnp.zeros(q.shape[:3] + v.shape[3:], f32),
          jnp.full(q.shape[:3], grad.MASK_VALUE, f32))
  out, lse = _ring_loop(opts, k, v, compute, init)
  return out.astype(q.dtype), lse


def block_vjp(q, k, v, kv_lens, out, lse, dout, *, scale, is_causal):
  """``(dq, dk, dv)`` float32 of one block of keys, from the global output
  and log-sum-exp of the rows: cuDNN's backward or the Triton one on a GPU,
  else :func:`jaxattn.grad.xla_vjp`."""
  on_gpu = triton.native()
  path = grad.backward_path(q.dtype, q.shape[-1], False, False, on_gpu)
  if path == "cudnn" and grad.cudnn_residual_reason() is None:
    try:
      return tuple(x.astype(jnp.float32) for x in grad.cudnn_residual_vjp(
          q, k, v, kv_lens, out, lse, dout, scale=scale,
          is_causal=is_causal))
    except (ValueError, NotImplementedError, RuntimeError):
      pass   # as grad.attention_vjp: the next path
  if on_gpu:
    return grad.pallas_vjp(q, k, v, kv_lens, dout, scale=scale,
                           is_causal=is_causal, out=out, lse=lse)
  return grad.xla_vjp(q, k, v, None, None, kv_lens, lse, dout, scale=scale,
                      is_causal=is_causal, out=out)[:3]


def ring_backward(q, k, v, kv_lens, out, lse, dout, opts: Options):
  """``(dq, dk, dv)`` in the inputs' dtypes: the ring backward (module
  docstring).  ``out`` and ``lse`` are the forward's when exact; with
  ``out`` None they come from a ``"fp32"`` ring forward first."""
  if out is None:
    exact = Options(opts.axis_name, opts.is_causal, opts.layout,
                    dataclasses.replace(opts.step, method="fp32",
                                        implementation=None, config=None))
    out, lse = ring_forward(q, k, v, kv_lens, exact)
  n, me = _check_axis(opts.axis_name), lax.axis_index(opts.axis_name)
  c, h, th = k.shape[1], k.shape[1] // 2, q.shape[1] // 2
  f32 = jnp.float32
  vjp = functools.partial(block_vjp, scale=opts.step.scale)

  def compute(s, src, k, v, acc):
    def lower(lens):
      gq, gk, gv = vjp(q, k[:, :h], v[:, :h], lens, out, lse, dout,
                       is_causal=False)
      pad = [(0, 0), (0, c - h), (0, 0), (0, 0)]
      return gq, jnp.pad(gk, pad), jnp.pad(gv, pad)

    def upper(lens):
      gq, gk, gv = vjp(q[:, th:], k, v, lens, out[:, th:], lse[:, th:],
                       dout[:, th:], is_causal=False)
      return _pad_rows(gq, th, 0), gk, gv
    g = _step(
        opts, n, s, src, me, c, kv_lens,
        full=lambda lens: vjp(q, k, v, lens, out, lse, dout, is_causal=False),
        lower=lower, upper=upper,
        nothing=lambda lens: (jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32),
                              jnp.zeros(v.shape, f32)),
        diagonal=lambda lens: vjp(q, k, v, lens, out, lse, dout,
                                  is_causal=True))
    return tuple(a + x.astype(f32) for a, x in zip(acc, g))

  def send(acc, ring):   # dK, dV travel with their chunk: home after n moves
    return (acc[0], *ring(acc[1:]))
  dq, dk, dv = _ring_loop(opts, k, v, compute, (
      jnp.zeros(q.shape, f32), jnp.zeros(k.shape, f32),
      jnp.zeros(v.shape, f32)), send_after=send)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _ring(q, k, v, kv_lens, opts):
  return ring_forward(q, k, v, kv_lens, opts)


def _ring_fwd(q, k, v, kv_lens, opts):
  out, lse = ring_forward(q, k, v, kv_lens, opts)
  exact = methods.get(opts.step.method).output_is_exact
  return (out, lse), (q, k, v, kv_lens, out if exact else None, lse)


def _ring_bwd(opts, res, cotangent):
  q, k, v, kv_lens, out, lse = res
  dq, dk, dv = ring_backward(q, k, v, kv_lens, out, lse, cotangent[0], opts)
  return dq, dk, dv, None   # lse: no gradient, as dot_product_attention's


_ring.defvjp(_ring_fwd, _ring_bwd)


def attention(q, k, v, kv_lens, *, axis_name, is_causal: bool, layout: str,
              step: Step, return_residual: bool = False):
  """The ring on normalised BTNH chunks (``jaxattn.ring_attention`` checks
  the arguments and builds ``step``): the local output in the query dtype
  (and the float32 log-sum-exp ``[B, T/n, N]``)."""
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  _check_axis(axis_name)
  if any(map(_varying, (q, k, v))):
    raise ValueError(
        "call ring_attention inside jax.shard_map(..., check_vma=False): "
        "the kernels and references do not track varying manual axes")
  out, lse = _ring(q, k, v, kv_lens, Options(axis_name, bool(is_causal),
                                             layout, step))
  return (out, lse) if return_residual else out


__all__ = ["attention", "axis_size", "ring_forward", "ring_backward", "to_zigzag",
           "from_zigzag", "Step", "Options", "LAYOUTS"]

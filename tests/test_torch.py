"""``jaxattn.torch``: jaxattn's methods on torch tensors through DLPack.

Results are compared with ``jaxattn.dot_product_attention`` on the same data
(and with torch SDPA for "fp32"), in both layouts, causal, GQA, bfloat16 and
float8 inputs; zero-copy is checked by buffer pointers on both sides; every
refused input has its error.  Shapes are small: B=2, N=4 query heads, K=2
key heads, T=16, S=24, H=32.  A call with a signature seen before traces
and compiles nothing and crosses DLPack once per tensor (counted, not
timed).
"""
import collections
import inspect
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import jaxattn
import jaxattn.torch as jt

B, N, K, T, S, H = 2, 4, 2, 16, 24, 32
REF = dict(implementation="reference")


def hnd(seed, dtype=torch.float32, n=N, nk=K, t=T, s=S):
  """q, k, v ``[B, heads, seq, H]`` (HND)."""
  g = torch.Generator().manual_seed(seed)
  return tuple(torch.randn(shape, generator=g).to(dtype)
               for shape in ((B, n, t, H), (B, nk, s, H), (B, nk, s, H)))


def btnh(x, dtype=None):
  """An HND torch tensor as a BTNH jax array (exact: float32 round trip)."""
  array = jnp.asarray(x.float().numpy().transpose(0, 2, 1, 3))
  return array.astype(dtype or jnp.dtype(str(x.dtype).split(".")[1]))


def to_hnd(array):
  return np.asarray(jnp.asarray(array, jnp.float32)).transpose(0, 2, 1, 3)


def jaxattn_hnd(q, k, v, dtype=None, **kw):
  """jaxattn.dot_product_attention on the same data, as float32 HND numpy."""
  out = jaxattn.dot_product_attention(btnh(q, dtype), btnh(k, dtype),
                                      btnh(v, dtype), **REF, **kw)
  return to_hnd(out)


def sdpa(q, k, v, **kw):
  return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)


@pytest.fixture(autouse=True)
def _jax_on_the_cpu(request):
  """The CPU tensors' results (computed on jax's CPU device, as the shim
  does for CPU tensors) compare with jax's on the CPU too: on a GPU host
  jax's default device is the GPU, whose float32 products are TF32."""
  if "gpu" in request.keywords:
    yield
    return
  with jax.default_device(jax.devices("cpu")[0]):
    yield


# SDPA float32 vs jaxattn "fp32": measured max |diff| 2.4e-7 at these shapes.
SDPA_ATOL = 2e-6


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_fp32_matches_sdpa_and_jaxattn(layout, is_causal):
  q, k, v = hnd(0)
  args = (q, k, v) if layout == "HND" else \
      tuple(x.transpose(1, 2).contiguous() for x in (q, k, v))
  out = jt.attention(*args, tensor_layout=layout, is_causal=is_causal, **REF)
  assert out.dtype == torch.float32 and isinstance(out, torch.Tensor)
  if layout == "NHD":
    assert out.shape == (B, T, N, H)
    out = out.transpose(1, 2)
  assert out.shape == (B, N, T, H)
  want = sdpa(q, k, v, is_causal=is_causal)
  assert (out - want).abs().max().item() < SDPA_ATOL
  # Same numbers as jaxattn up to XLA's fusion around the transposes: the
  # non-causal float32 case differs by at most 1 ulp (2.4e-7 measured).
  np.testing.assert_allclose(out.numpy(),
                             jaxattn_hnd(q, k, v, is_causal=is_causal),
                             rtol=0, atol=5e-7)


@pytest.mark.parametrize("method", ["fp16", "pasa", "sage", "int8", "fp8"])
def test_methods_match_jaxattn_float16(method):
  q, k, v = hnd(1, torch.float16)
  out = jt.attention(q, k, v, method=method, is_causal=True, **REF)
  assert out.dtype == torch.float16 and out.shape == (B, N, T, H)
  want = jaxattn_hnd(q, k, v, method=method, is_causal=True)
  np.testing.assert_array_equal(out.float().numpy(), want)
  assert np.abs(want - sdpa(q.float(), k.float(), v.float(),
                            is_causal=True).numpy()).max() < 0.2


def test_bfloat16_input_and_output():
  q, k, v = hnd(2, torch.bfloat16)
  out = jt.attention(q, k, v, tensor_layout="HND", **REF)
  assert out.dtype == torch.bfloat16
  np.testing.assert_array_equal(out.float().numpy(),
                                jaxattn_hnd(q, k, v, jnp.bfloat16))
  want = sdpa(q.float(), k.float(), v.float())
  assert (out.float() - want).abs().max().item() < 0.02


def test_sageattn_signature_and_presets():
  params = list(inspect.signature(jt.sageattn).parameters)
  assert params[:7] == ["q", "k", "v", "tensor_layout", "is_causal",
                        "sm_scale", "smooth_k"]
  q, k, v = hnd(3, torch.float16)
  out = jt.sageattn(q, k, v, tensor_layout="HND", is_causal=True, **REF)
  assert out.dtype == torch.float16
  np.testing.assert_array_equal(
      out.float().numpy(),
      jaxattn_hnd(q, k, v, method="sage", is_causal=True, preset="sage2-8b"))
  out = jt.sageattn(*(x.transpose(1, 2) for x in (q, k, v)),
                    tensor_layout="NHD", sm_scale=0.1, smooth_k=False,
                    qk_quant_gran="per_block", preset="sage1", **REF)
  np.testing.assert_array_equal(
      out.transpose(1, 2).float().numpy(),
      jaxattn_hnd(q, k, v, method="sage", scale=0.1, preset="sage1",
                  smooth_k=False, qk_granularity="block"))


def test_scale_masks_and_kv_lengths():
  q, k, v = hnd(4)
  g = torch.Generator().manual_seed(0)
  keep = torch.rand(B, 1, T, S, generator=g) > 0.3
  out = jt.attention(q, k, v, sm_scale=0.3, attn_mask=keep, **REF)
  want = sdpa(q, k, v, attn_mask=keep, scale=0.3)
  assert (out - want).abs().max().item() < SDPA_ATOL
  bias = torch.randn(T, S)
  out = jt.attention(q, k, v, attn_mask=bias, **REF)
  assert (out - sdpa(q, k, v, attn_mask=bias)).abs().max().item() < SDPA_ATOL
  lens = torch.tensor([5, 24])
  out = jt.attention(q, k, v, key_value_seq_lengths=lens, **REF)
  np.testing.assert_array_equal(
      out.numpy(),
      jaxattn_hnd(q, k, v, key_value_seq_lengths=jnp.array([5, 24])))
  visible = (torch.arange(S) < lens[:, None])[:, None, None, :]
  assert (out - sdpa(q, k, v, attn_mask=visible)).abs().max().item() < SDPA_ATOL


def test_fmha_int8_returns_tuple_of_tensors():
  q, k, v = hnd(5, torch.float16)
  amax = {"q": 4.0, "k": 4.0, "v": 4.0, "o": 2.0}
  o_int8, o_scale = jt.attention(q, k, v, method="fmha_int8", return_int8=True,
                                 amax=amax, **REF)
  assert o_int8.dtype == torch.int8 and o_int8.shape == (B, N, T, H)
  assert o_scale.dtype == torch.float32 and o_scale.shape == ()
  want_i8, want_scale = jaxattn.dot_product_attention(
      btnh(q), btnh(k), btnh(v), method="fmha_int8", return_int8=True,
      amax=amax, **REF)
  np.testing.assert_array_equal(o_int8.numpy(), to_hnd(want_i8))
  assert o_scale.item() == float(want_scale) == np.float32(2.0 / 127)


@pytest.mark.parametrize("float8", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3fn", "e5m2"])
def test_float8_inputs_read_as_float16(float8):
  q, k, v = (x.to(float8) for x in hnd(6))
  out = jt.attention(q, k, v, is_causal=True, **REF)
  assert out.dtype == torch.float16
  want = jt.attention(*(x.half() for x in (q, k, v)), is_causal=True, **REF)
  assert torch.equal(out, want)
  mixed = jt.attention(q.half(), k, v.half(), is_causal=True, **REF)
  assert torch.equal(mixed, want)


def test_zero_copy_input_side():
  q = hnd(7)[0]
  array, (axes, float8) = jt._import_tensor(q)
  assert array.unsafe_buffer_pointer() == q.data_ptr()
  assert axes == (0, 1, 2, 3) and float8 is None
  view = torch.randn(B, T, N, H).transpose(1, 2)  # HND view of NHD memory
  array, (axes, _) = jt._import_tensor(view)
  assert array.unsafe_buffer_pointer() == view.data_ptr()
  np.testing.assert_array_equal(np.asarray(jnp.transpose(array, axes)),
                                view.numpy())
  f8 = q.to(torch.float8_e4m3fn)
  array, (_, float8) = jt._import_tensor(f8)
  assert array.unsafe_buffer_pointer() == f8.data_ptr()
  assert array.dtype == jnp.uint8 and float8 == "float8_e4m3fn"
  gaps = torch.randn(B, N, 2 * T, H)[:, :, ::2]  # no dense buffer: copied
  array, (axes, _) = jt._import_tensor(gaps)
  assert array.unsafe_buffer_pointer() != gaps.data_ptr()
  np.testing.assert_array_equal(np.asarray(jnp.transpose(array, axes)),
                                gaps.numpy())


def test_device_views_follow_the_buffer_and_own_nothing():
  """The CUDA plans' input views (exercised here on jax's CPU device): a
  view of a tensor's memory, not of its values, from an address's second
  call on; one array per address, at most CAPACITY kept; dropping them
  frees only their own capsules."""
  load = jt._find_view_load()
  assert load is not None
  cpu = jax.devices("cpu")[0]
  total = jax.jit(jnp.sum)
  for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.uint8):
    t = (torch.arange(2 * 3 * 40) % 7).reshape(2, 3, 40).to(dtype)
    views = jt._DeviceViews(t, cpu, 1, load)
    assert views(t) is None         # a first call: the caller imports
    a = views(t)
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert a.shape == t.shape and a.dtype == jnp.dtype(str(t.dtype)[6:])
    np.testing.assert_array_equal(np.asarray(a).astype(np.float32),
                                  t.float().numpy())
    assert views(t) is a            # the same buffer: the same array
    t.add_(1)                       # written in place: the view reads it
    assert float(total(views(t).astype(jnp.float32))) == float(t.float().sum())
  kept = [torch.full((2, 3, 40), float(i)) for i in range(views.CAPACITY + 5)]
  views = jt._DeviceViews(kept[0], cpu, 1, load)
  # buffers in turn, more than CAPACITY: every call the caller's import
  assert all(views(x) is None for _ in range(3) for x in kept)
  assert views.arrays == {} and len(views.seen) == views.CAPACITY
  views = jt._DeviceViews(kept[0], cpu, 1, load)
  assert all(views(x) is None for x in kept)
  assert list(views.seen) == [x.data_ptr() for x in kept[5:]]
  sums = [float(total(views(x))) for x in kept[5:]]   # second calls: views
  assert sums == [240.0 * i for i in range(5, len(kept))]
  assert list(views.arrays) == [x.data_ptr() for x in kept[5:]]
  assert not views.seen
  views(kept[5])                    # a hit makes it the most recent
  assert views(kept[0]) is None     # (its first call, long ago, forgotten)
  views(kept[0])                    # ... so its view evicts kept[6]'s
  assert kept[5].data_ptr() in views.arrays
  assert kept[6].data_ptr() not in views.arrays
  errors = []

  def hammer(offset):               # threads share a plan's views
    try:
      for i in range(200):
        x = kept[(offset + i) % len(kept)]
        a = views(x)
        assert a is None or a.unsafe_buffer_pointer() == x.data_ptr()
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=hammer, args=(j,)) for j in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert errors == [] and len(views.arrays) <= views.CAPACITY
  assert len(views.seen) <= views.CAPACITY
  del views, sums
  import gc
  gc.collect()
  assert all(float(x[0, 0, 0]) == i for i, x in enumerate(kept))


def test_plans_with_views_read_each_call_s_tensors(monkeypatch):
  """Plans whose inputs are views that own nothing (CUDA's, and a GPU
  host's CPU tensors: this host made to look like one): repeat calls on the
  same buffers, in-place writes, freed and reused buffers, more buffers
  than a plan keeps, the log-sum-exp and autograd all give each call its
  own tensors' results."""
  monkeypatch.setattr(jt, "_jax_has_gpu", lambda: True)
  jt._clear_plans()
  try:
    def check(q, k, v):
      out, lse = jt.attention(q, k, v, return_lse=True, **REF)
      torch.testing.assert_close(out, sdpa(q, k, v), atol=1e-5, rtol=1e-5)
      scores = torch.einsum("bnth,bnsh->bnts", q,
                            k.repeat_interleave(N // K, 1)) / H ** 0.5
      torch.testing.assert_close(lse, torch.logsumexp(scores, -1),
                                 atol=1e-5, rtol=1e-5)

    q, k, v = hnd(30)
    check(q, k, v)
    plan = list(jt._DIRECT.values())[-1]
    assert plan.views is not None and all(plan.views[:3])
    # (the plan's build called its inputs once: the call made views)
    arrays = dict(plan.views[0].arrays)
    assert len(arrays) == 1
    check(q, k, v)                           # the same buffers: hits
    assert plan.views[0].arrays == arrays
    q.mul_(-2.0)                             # written in place
    check(q, k, v)
    for seed in range(2 * jt._DeviceViews.CAPACITY):   # new and reused
      check(*hnd(100 + seed))
    assert len(plan.views[0].arrays) <= jt._DeviceViews.CAPACITY
    tensors = [x.clone().requires_grad_() for x in hnd(31)]
    w = torch.randn(B, N, T, H)
    got = _grads(lambda *t: jt.attention(*t, is_causal=True, **REF),
                 tensors, w)
    want = _grads(lambda *t: sdpa(*t, is_causal=True), tensors, w)
    for a, b in zip(got, want):
      assert ((a - b).norm() / b.norm()).item() < GRAD_RTOL
  finally:
    jt._clear_plans()


@pytest.mark.parametrize("grad", [False, True], ids=["direct", "operator"])
def test_zero_copy_output_side(monkeypatch, grad):
  exported = []
  export = jt._to_torch

  def spy(array, stream):
    exported.append(array)
    return export(array, stream)

  monkeypatch.setattr(jt, "_to_torch", spy)
  q, k, v = hnd(8)
  out = jt.attention(q.requires_grad_(grad), k, v, **REF)
  assert len(exported) == 1 + grad   # with autograd: the log-sum-exp too
  assert out.data_ptr() == exported[0].unsafe_buffer_pointer()
  assert out.requires_grad == grad


# Every jax trace, lowering and XLA compilation in the process.
_JAX_COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kw: _JAX_COMPILES.append(event)
    if event.startswith("/jax/core/compile/") else None)


def _count_calls(monkeypatch, eager=True):
  """Counts the DLPack crossings (jaxattn's import and export, and jax's and
  torch's own from_dlpack) and new plans; ``eager``: the checks and the
  calls of the custom operator too (functions that ``torch.compile``
  traces, guards on and would replay the counting of)."""
  counts = collections.Counter()

  def wrap(owner, name, key):
    fn = getattr(owner, name)

    def counted(*args, **kwargs):
      counts[key] += 1
      return fn(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)

  wrap(jt, "_to_jax", "import")
  view = jt._DeviceViews.__call__

  def counted_view(self, tensor):   # (a view, hit or made; None imports)
    out = view(self, tensor)
    counts["import"] += out is not None
    return out

  monkeypatch.setattr(jt._DeviceViews, "__call__", counted_view)
  wrap(jt, "_host_view", "import")   # (a CPU tensor as a numpy view)
  wrap(jax.dlpack, "from_dlpack", "jax.dlpack.from_dlpack")
  wrap(torch, "from_dlpack", "export")
  wrap(jt, "_Plan", "plan")
  if eager:
    wrap(jt, "_check", "check")
    wrap(torch.ops.jaxattn, "attention", "operator")
  del _JAX_COMPILES[:]
  return counts


def _second_call_cases():
  """(name, call(seed) -> output tensor(s), inputs that cross DLPack,
  outputs that cross back, operator calls) of a second call."""
  g = torch.Generator().manual_seed(3)
  keep = torch.rand(B, 1, T, S, generator=g) > 0.3

  def direct(seed):
    return jt.attention(*hnd(seed), **REF)

  def views_mask_lens(seed):   # NHD views of HND memory, a bool mask, lens
    q, k, v = (x.transpose(1, 2) for x in hnd(seed))
    return jt.sageattn(q, k, v, tensor_layout="NHD", attn_mask=keep,
                       key_value_seq_lengths=[S - 4, S], **REF)

  def float8_lse(seed):
    q, k, v = (x.to(torch.float8_e4m3fn) for x in hnd(seed))
    return jt.attention(q, k, v, is_causal=True, return_lse=True, **REF)

  def autograd(seed):
    q, k, v = (x.requires_grad_() for x in hnd(seed))
    out = jt.attention(q, k, v, is_causal=True, **REF)
    return (out, *torch.autograd.grad(out.sum(), (q, k, v)))

  # autograd on the CPU: XLA's backward, from the forward's log-sum-exp (an
  # export) without its output: q, k, v, lse and dout cross into it
  return [("direct", direct, 3, 1, 0),
          ("views_mask_lens", views_mask_lens, 4, 1, 0),
          ("float8_lse", float8_lse, 3, 2, 0),
          ("autograd", autograd, 3 + 5, 2 + 3, 1)]


@pytest.mark.parametrize("gpu_host", [False, True],
                         ids=["this_host", "as_a_gpu_host"])
@pytest.mark.parametrize("case", _second_call_cases(), ids=lambda c: c[0])
def test_second_call_compiles_nothing_and_crosses_dlpack_per_tensor(
    monkeypatch, case, gpu_host):
  """The structure that makes a call cheap: the second call of a signature
  checks nothing, traces and compiles nothing, imports each input tensor
  once (a numpy view on the CPU, else jax's core DLPack import; never
  jax.dlpack.from_dlpack's Python),
  exports each output once, and goes through the custom operator only
  where autograd needs it; its results are those of a fresh call."""
  name, call, n_in, n_out, n_op = case
  jt._clear_plans()
  if gpu_host:   # CPU tensors as on a GPU host: views that own nothing
    monkeypatch.setattr(jt, "_jax_has_gpu", lambda: True)
  first = call(0)
  counts = _count_calls(monkeypatch)
  second = call(1)
  assert _JAX_COMPILES == []
  # (no checks, no new plan, no jax.dlpack.from_dlpack: Counters compare
  # missing keys as 0)
  assert counts == collections.Counter(
      {"import": n_in, "export": n_out, "operator": n_op}), counts
  monkeypatch.undo()
  jt._clear_plans()
  if gpu_host:
    monkeypatch.setattr(jt, "_jax_has_gpu", lambda: True)
  fresh = call(1)   # checked, traced and compiled anew
  monkeypatch.undo()
  jt._clear_plans()
  assert _JAX_COMPILES
  for a, b in zip(*(x if isinstance(x, tuple) else (x,)
                    for x in (second, fresh))):
    assert torch.equal(a, b)
  assert not all(torch.equal(a, b) for a, b in zip(
      *(x if isinstance(x, tuple) else (x,) for x in (first, second))))


def test_calls_share_views_and_copy_only_gapped_tensors(monkeypatch):
  """A call imports a permuted view as its tensor's buffer (no copy), every
  call of its signature; a view with gaps is copied (once a call).  Where
  jax has only CPUs the executable takes a numpy view of the buffer, which
  it aliases (bfloat16 as its bits); on a GPU host, a view that owns
  nothing (:class:`jaxattn.torch._DeviceViews`)."""
  imported, views = [], []
  crossing = "_DeviceViews" if jt._jax_has_gpu() else "_host_view"

  def spy(name):
    fn = getattr(jt, name)

    def spied(tensor, *args):
      out = fn(tensor, *args)
      imported.append((name, tensor.data_ptr()))
      views.append(out)
      return out

    monkeypatch.setattr(jt, name, spied)

  spy("_to_jax")
  spy("_host_view")
  call_view = jt._DeviceViews.__call__

  def spied_view(self, tensor):
    out = call_view(self, tensor)
    if out is not None:   # (else _to_jax imports: a buffer's first call)
      imported.append(("_DeviceViews", tensor.data_ptr()))
      views.append(out)
    return out

  monkeypatch.setattr(jt._DeviceViews, "__call__", spied_view)
  for seed in (0, 1):   # the call that plans and one that reuses the plan
    q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2)
               for x in hnd(seed))   # HND views of NHD buffers
    gaps = torch.randn(B, K, 2 * S, H)[:, :, ::2]
    del imported[:]
    jt.attention(q, k, v, **REF)
    if crossing == "_DeviceViews":   # (a buffer's first call imports)
      jt.attention(q, k, v, **REF)
    assert imported[-3:] == [(crossing, x.data_ptr()) for x in (q, k, v)]
    if crossing == "_host_view":
      assert all(isinstance(a, np.ndarray) for a in views[-3:])
      assert views[-1].ctypes.data == v.data_ptr()   # shared, not copied
    del imported[:]
    jt.attention(q, k, gaps, **REF)
    assert [p for _, p in imported[-3:-1]] == [q.data_ptr(), k.data_ptr()]
    assert imported[-1][1] != gaps.data_ptr()
  bf16 = [x.to(torch.bfloat16) for x in hnd(0)]
  out = jt.attention(*bf16, **REF)
  if crossing == "_host_view":
    assert views[-1].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        views[-1].view(np.int16), bf16[2].view(torch.int16).numpy())
  want = jt.attention(*(x.float() for x in bf16), **REF)
  torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


def test_torch_compile_second_call_compiles_nothing(monkeypatch):
  """Under ``torch.compile`` the operator's call of a known signature
  traces and compiles nothing in jax and crosses DLPack per tensor."""
  fn = torch.compile(lambda q, k, v: jt.sageattn(q, k, v, **REF),
                     fullgraph=True)
  fn(*hnd(0))
  counts = _count_calls(monkeypatch, eager=False)
  out = fn(*hnd(1))
  assert _JAX_COMPILES == []
  assert counts == collections.Counter({"import": 3, "export": 1}), counts
  monkeypatch.undo()
  assert torch.equal(out, jt.sageattn(*hnd(1), **REF))


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_torch_compile_uses_the_autograd_operator_only_for_gradients(grad):
  """A graph traced with no gradient to record calls the operator without
  an autograd kernel; one with a gradient, the operator with it."""
  graphs = []

  def backend(gm, example_inputs):
    graphs.append({str(n.target) for n in gm.graph.nodes
                   if n.op == "call_function"})
    return gm

  fn = torch.compile(lambda q, k, v: jt.sageattn(q, k, v, **REF),
                     backend=backend, fullgraph=True)
  q, k, v = hnd(2)
  out = fn(q.requires_grad_(grad), k, v)
  ops = {t for t in graphs[0] if t.startswith("jaxattn.")}
  assert ops == {"jaxattn.attention" if grad
                 else "jaxattn.attention_no_grad"}, graphs
  assert out.requires_grad == grad
  assert torch.equal(out.detach(), jt.sageattn(*hnd(2), **REF))


def test_non_contiguous_views_give_the_same_result():
  q, k, v = hnd(9)
  want = jt.attention(q, k, v, **REF)
  q_view = q.transpose(1, 2).contiguous().transpose(1, 2)  # permuted view
  k_gaps = torch.stack([k, torch.zeros_like(k)], dim=3).flatten(2, 3)[:, :, ::2]
  v_expand = v[:, :1].expand(B, K, S, H)  # stride 0
  assert not (q_view.is_contiguous() or k_gaps.is_contiguous()
              or v_expand.is_contiguous())
  assert torch.equal(jt.attention(q_view, k_gaps, v, **REF), want)
  out = jt.attention(q, k, v_expand, **REF)
  assert (out - sdpa(q, k, v_expand)).abs().max().item() < SDPA_ATOL


def _grads(fn, tensors, w):
  return torch.autograd.grad((fn(*tensors) * w).sum(), tensors)


@pytest.mark.parametrize("mha", [False, True], ids=["gqa", "mha_s_eq_t"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_outputs_follow_the_inputs_memory_order(compiled, mha):
  """As torch SDPA's flash output follows the query's stride order: HND
  views of ``[B, T, N, H]`` buffers (a model's ``view(B, T, N, H)
  .transpose(1, 2)``) give an output, and gradients, that are such views
  too (no copy on either side), contiguous HND gives contiguous HND, with
  the contiguous inputs' values, without and with gradients.  Compiled
  first, in a fresh process state, a model's ``transpose(1, 2).reshape``
  of the output gives eager's values and gradients (inductor asserts each
  operator output's strides: q, k, v of one shape once made it expect a
  contiguous output where the operator returned a permuted one)."""
  dense = hnd(14, nk=N, s=T) if mha else hnd(14)
  buffers = [x.transpose(1, 2).contiguous().requires_grad_() for x in dense]
  attn = lambda q, k, v: jt.sageattn(q, k, v, is_causal=True, **REF)
  w = torch.randn(B, N, T, H, generator=torch.Generator().manual_seed(2))
  if compiled:
    torch._dynamo.reset()
    jt._clear_plans()

    def model(q, k, v):   # [B, T, N, H] in, [B, T, N * H] out
      out = attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
      return out.transpose(1, 2).reshape(B, T, N * H) * 2.0

    w_model = w.transpose(1, 2).reshape(B, T, N * H)
    got = _grads(torch.compile(model, fullgraph=True), buffers, w_model)
    for a, b in zip(got, _grads(model, buffers, w_model)):
      torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    with torch.no_grad():
      assert torch.equal(torch.compile(model, fullgraph=True)(*buffers),
                         model(*buffers))
  with torch.no_grad():
    want = attn(*dense)
    assert want.is_contiguous()
    out = attn(*(x.transpose(1, 2) for x in buffers))
  assert out.shape == want.shape and out.transpose(1, 2).is_contiguous()
  assert torch.equal(out, want)
  views = [x.transpose(1, 2) for x in buffers]   # (not leaves: their grads)
  out = attn(*views)
  assert out.transpose(1, 2).is_contiguous() and torch.equal(out, want)
  grads = torch.autograd.grad((out * w).sum(), views)
  leaves = [x.clone().requires_grad_() for x in dense]
  want_grads = _grads(attn, leaves, w)
  for got, ref in zip(grads, want_grads):
    assert ref.is_contiguous()
    assert got.shape == ref.shape and got.transpose(1, 2).is_contiguous()
    # (the backward of a permuted layout is another XLA program: its float32
    # sums may round apart by a few ulps, as they did on a CPU without
    # AVX-512: 1.8e-7 on a gradient of 0.07)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mask", ["permuted", "transposed_2d"])
def test_compiled_bias_gradient_of_a_permuted_mask(mask):
  """The gradient of a float ``attn_mask`` that is a permuted view has its
  strides, as the fake's ``empty_like`` says: compiled equals eager."""
  torch._dynamo.reset()
  g = torch.Generator().manual_seed(17)
  bias = (torch.randn(B, T, N, S, generator=g).transpose(1, 2)
          if mask == "permuted" else torch.randn(S, T, generator=g).t())
  bias.requires_grad_()
  q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in hnd(17))
  f = lambda q, k, v, m: jt.attention(q, k, v, attn_mask=m, **REF).sin()
  got = torch.autograd.grad(
      torch.compile(f, fullgraph=True)(q, k, v, bias).sum(), bias)[0]
  want = torch.autograd.grad(f(q, k, v, bias).sum(), bias)[0]
  assert got.stride() == bias.stride()
  torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_log_sum_exp_carries_no_gradient():
  """The backward takes no gradient through the log-sum-exp: it is marked
  non-differentiable, so a loss on it alone raises instead of getting
  zeros, and the output's gradient is unchanged beside it."""
  q, k, v = (x.requires_grad_() for x in hnd(16))
  out, lse = jt.attention(q, k, v, return_lse=True, **REF)
  assert out.requires_grad and not lse.requires_grad
  with pytest.raises(RuntimeError, match="does not require grad"):
    torch.autograd.grad(lse.sum(), (q, k, v))
  got = torch.autograd.grad((out.sum() + lse.sum()), (q, k, v))
  want = torch.autograd.grad(sdpa(q, k, v).sum(), (q, k, v))
  for a, b in zip(got, want):
    assert ((a - b).norm() / b.norm()).item() < GRAD_RTOL


def test_compiled_permuted_inputs_at_a_new_length():
  """A second sequence length makes ``torch.compile`` retrace with
  symbolic shapes: permuted inputs (HND views of ``[B, T, N, H]``) still
  compile with ``fullgraph=True`` and match eager, with gradients (the
  memory order is read where dynamo can trace it on symbolic strides)."""
  torch._dynamo.reset()
  f = lambda q, k, v: jt.attention(q, k, v, is_causal=True, **REF).sin()
  compiled = torch.compile(f, fullgraph=True)
  g = torch.Generator().manual_seed(15)
  for t in (16, 24):
    q, k, v = (torch.randn(B, t, n, H, generator=g).transpose(1, 2)
               for n in (N, K, K))
    q.requires_grad_()
    got = compiled(q, k, v)
    want = f(q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), q)[0],
                               torch.autograd.grad(want.sum(), q)[0],
                               rtol=1e-6, atol=1e-6)


# Gradients against SDPA's float32 autograd: measured max relative L2
# 3.1e-7 (the exact gradient at the inputs, for every method).
GRAD_RTOL = 1e-5


@pytest.mark.parametrize("method", ["fp32", "sage", "int8"])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_autograd_matches_sdpa(method, layout):
  """Outputs carry autograd; the gradients of q, k, v and a float
  attn_mask (a bias) equal SDPA's, causal or with the bias, GQA."""
  q, k, v = hnd(10)
  g = torch.Generator().manual_seed(1)
  bias = torch.randn((1, N, T, S), generator=g).requires_grad_()
  w = torch.randn((B, N, T, H), generator=g)
  to = (lambda x: x) if layout == "HND" else (lambda x: x.transpose(1, 2))
  for kw, sdpa_kw, args in (
      (dict(is_causal=True), dict(is_causal=True), (q, k, v)),
      ({}, {}, (q, k, v, bias))):
    tensors = [x.clone().requires_grad_() for x in args[:3]] + list(args[3:])
    def ours(q, k, v, *bias):
      out = jt.attention(to(q), to(k), to(v), method=method,
                         tensor_layout=layout,
                         attn_mask=bias[0] if bias else None, **REF, **kw)
      return to(out)
    def want(q, k, v, *bias):
      return sdpa(q, k, v, attn_mask=bias[0] if bias else None, **sdpa_kw)
    got, ref = _grads(ours, tensors, w), _grads(want, tensors, w)
    for a, b in zip(got, ref):
      assert a.shape == b.shape
      assert ((a - b).norm() / b.norm()).item() < GRAD_RTOL


def test_no_grad_and_detached_inputs_have_no_graph():
  q, k, v = (x.requires_grad_() for x in hnd(10))
  with torch.no_grad():
    assert not jt.attention(q, k, v, **REF).requires_grad
  out = jt.attention(q.detach(), k.detach(), v.detach(), **REF)
  assert not out.requires_grad
  assert (out - sdpa(q, k, v).detach()).abs().max().item() < SDPA_ATOL


def test_torch_compile_forward_and_backward():
  """``torch.compile(fullgraph=True)`` of sageattn: the same output and
  gradients as eager (the custom operator is one opaque call)."""
  q, k, v = (x.requires_grad_() for x in hnd(12))
  fn = lambda q, k, v: jt.sageattn(q, k, v, is_causal=True, **REF)
  compiled = torch.compile(fn, fullgraph=True)
  w = torch.randn(B, N, T, H)
  got, ref = _grads(compiled, (q, k, v), w), _grads(fn, (q, k, v), w)
  assert torch.equal(compiled(q, k, v), fn(q, k, v))
  for a, b in zip(got, ref):
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_sageattn_return_lse_is_sdpa_log_sum_exp():
  q, k, v = hnd(13)
  out, lse = jt.sageattn(q, k, v, return_lse=True, **REF)
  assert torch.equal(out, jt.sageattn(q, k, v, **REF))
  kr, vr = (x.repeat_interleave(N // K, dim=1) for x in (k, v))
  want = torch.logsumexp(q @ kr.transpose(-1, -2) / H ** 0.5, dim=-1)
  assert lse.shape == (B, N, T) and lse.dtype == torch.float32
  assert (lse - want).abs().max().item() < 1e-5


def test_pallas_interpret_matches_reference():
  q, k, v = hnd(11, n=2, nk=1, t=16, s=16)
  out = jt.attention(q, k, v, is_causal=True, implementation="triton",
                     tile_q=16, block_k=16)
  want = jt.attention(q, k, v, is_causal=True, **REF)
  assert (out - want).abs().max().item() < 1e-6


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_errors():
  q, k, v = hnd(12)
  with pytest.raises(ValueError, match="tensor_layout must be 'HND' or 'NHD'"):
    jt.attention(q, k, v, tensor_layout="BTNH")
  with pytest.raises(ValueError, match=r"q must have rank 4 \[batch, heads, "):
    jt.attention(q[0], k, v)
  with pytest.raises(ValueError, match=r"k must have rank 4 \[batch, seq, "):
    jt.sageattn(q, k[0], v, tensor_layout="NHD")
  with pytest.raises(TypeError, match="v must be a torch.Tensor"):
    jt.attention(q, k, v.numpy())
  for int4 in (torch.int4, torch.uint4, torch.quint4x2):
    with pytest.raises(TypeError, match="4-bit tensors cannot cross DLPack"):
      jt.attention(q, torch.empty(B, K, S, H, dtype=int4), v)
  with pytest.raises(TypeError, match="must be float16, bfloat16, float32 or "
                     "float8, got torch.int8"):
    jt.attention(q.to(torch.int8), k, v)
  with pytest.raises(TypeError, match="float64 but jax_enable_x64 is off"):
    jt.attention(q.double(), k, v)
  with pytest.raises(TypeError, match="key_value_seq_lengths must hold "
                     "integers, got torch.float32"):
    jt.attention(q, k, v, key_value_seq_lengths=torch.tensor([3.7] * B))
  with pytest.raises(TypeError, match="attn_mask must be bool, float16, "
                     "bfloat16, float32 or float8, got torch.int32"):
    jt.attention(q, k, v, attn_mask=torch.ones(T, S, dtype=torch.int32))
  meta = torch.empty(B, K, S, H, device="meta")
  with pytest.raises(ValueError, match="one device, got q on cpu, k on meta"):
    jt.attention(q, meta, v)
  with pytest.raises(ValueError, match="attn_mask on meta"):
    jt.attention(q, k, v, attn_mask=torch.ones(T, S, device="meta"))
  with pytest.raises(ValueError, match="on meta cannot cross DLPack"):
    jt.attention(*(torch.empty(x.shape, device="meta") for x in (q, k, v)))
  if any(d.platform == "gpu" for d in jax.devices()):
    assert jt._jax_device_kind(torch.device("cuda", 0)) is None
  else:
    with pytest.raises(RuntimeError, match="jax has no GPU backend"):
      jt._jax_device_kind(torch.device("cuda", 0))
  with pytest.raises(NotImplementedError, match="no dropout"):
    jt.attention(q, k, v, dropout_p=0.1)
  with pytest.raises(ValueError, match="qk_quant_gran must be one of"):
    jt.sageattn(q, k, v, qk_quant_gran="per_thread")
  with pytest.raises(TypeError, match="unknown option"):
    jt.sageattn(q, k, v, pv_accum_dtype="fp32+fp16")
  with pytest.raises(ValueError, match=r"key_value_seq_lengths must lie in "
                     r"\[0, 24\]"):
    jt.attention(q, k, v, key_value_seq_lengths=[3, 25])
  with pytest.raises(ValueError, match="must be a multiple of key/value heads"):
    jt.attention(q[:, :3], k, v, **REF)


@pytest.mark.gpu
def test_cuda_compiled_sageattn_module_matches_eager_and_trains():
  """On a GPU, CUDA tensors: a module calling ``sageattn`` compiled with
  ``torch.compile(fullgraph=True)`` equals eager, its gradients are within
  the method's error of float32 SDPA's, and a few steps of SGD on it lower
  the loss."""
  if not torch.cuda.is_available():
    pytest.fail("jax sees a GPU but torch does not")
  torch.manual_seed(0)

  class Block(torch.nn.Module):
    def __init__(self, dim=256, heads=4):
      super().__init__()
      self.heads = heads
      self.qkv = torch.nn.Linear(dim, 3 * dim)
      self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
      b, t, c = x.shape
      q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).unbind(2)
      o = jt.sageattn(q, k, v, tensor_layout="NHD", is_causal=True)
      return self.proj(o.reshape(b, t, c))

  block = Block().cuda().half()
  x = torch.randn(2, 512, 256, device="cuda", dtype=torch.float16)
  target = torch.randn_like(x)
  compiled = torch.compile(block, fullgraph=True)
  eager_out, compiled_out = block(x), compiled(x)
  torch.testing.assert_close(compiled_out, eager_out, rtol=0, atol=0)

  q, k, v = (torch.randn(2, 8, 512, 64, device="cuda", dtype=torch.float16,
                         requires_grad=True) for _ in range(3))
  w = torch.randn(2, 8, 512, 64, device="cuda", dtype=torch.float16)
  got = torch.autograd.grad((jt.sageattn(q, k, v, is_causal=True).float()
                             * w).sum(), (q, k, v))
  ref = F.scaled_dot_product_attention(*(x.float() for x in (q, k, v)),
                                       is_causal=True)
  want = torch.autograd.grad((ref * w).sum(), (q, k, v))
  for a, b in zip(got, want):   # the exact gradient at the inputs
    assert float((a.float() - b).norm() / b.norm()) < 1e-2

  opt = torch.optim.SGD(block.parameters(), lr=0.05)
  losses = []
  for _ in range(5):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(compiled(x).float(), target.float())
    loss.backward()
    opt.step()
    losses.append(float(loss))
  assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


@pytest.mark.gpu
def test_cuda_stream_order_without_synchronising():
  """On a GPU: inputs written by a long chain of kernels on a side torch
  stream, the call on that stream and the output read there, with no
  synchronisation in between, equal the same call after a full
  synchronisation (jax's kernels wait on the device for torch's stream,
  torch for jax's result), and the host does not wait for the stream.
  Repeated, since a missing wait is a race."""
  if not torch.cuda.is_available():
    pytest.fail("jax sees a GPU but torch does not")
  side = torch.cuda.Stream()
  base = torch.randn(2, 4, 1024, 64, device="cuda")
  torch.cuda.synchronize()
  for trial in range(5):
    with torch.cuda.stream(side):
      q = base.clone()
      for _ in range(200):          # ~ms of queued work before q is final
        q = q * 1.0001 + 1e-4
      q = (q + trial).half()
      k, v = q.flip(2), q.flip(3)
      out = jt.attention(q, k, v, method="fp32", is_causal=True) * 2.0
    torch.cuda.synchronize()
    want = jt.attention(q, k, v, method="fp32", is_causal=True) * 2.0
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, rtol=0, atol=0)

  # several calls queued behind a sleeping stream (a chain of small kernels
  # above may finish before the host has queued it): each call reads the
  # inputs its own producers wrote
  with torch.cuda.stream(side):
    outs, inputs = [], []
    torch.cuda._sleep(200_000_000)   # ~0.1 s
    slept = torch.cuda.Event()
    slept.record(side)
    for trial in range(4):
      q = (base * (trial + 1)).half()
      k, v = q.flip(2), q.flip(3)
      outs.append(jt.attention(q, k, v, method="fp32", is_causal=True))
      inputs.append((q, k, v))
  # the host did not wait for the sleeping stream (the fence waits on the
  # device): the sleep had not ended when the four calls returned
  assert not slept.query()
  torch.cuda.synchronize()
  for out, (q, k, v) in zip(outs, inputs):
    want = jt.attention(q, k, v, method="fp32", is_causal=True)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, rtol=0, atol=0)
  torch.cuda.synchronize()
  # each post had its turn, no more; the posts were the driver's stream
  # writes of the host's count
  for fence in jt._FENCES.values():
    assert callable(fence.write)
    posts, turns = fence.tensor.tolist()
    assert posts == turns == fence.count > 0


@pytest.mark.gpu
def test_cuda_views_read_the_buffer_after_a_reuse():
  """On a GPU the plan's inputs are views that own nothing: an input freed
  right after its call, its block reused on the same stream for the next
  call's input (behind a sleeping stream, so that both calls are queued
  before either runs), gives each call its own input's result."""
  side = torch.cuda.Stream()
  base = torch.randn(2, 4, 256, 64, device="cuda")
  k, v = base.flip(2).half(), base.flip(3).half()
  jt._clear_plans()
  jt.attention(base.half(), k, v, method="fp32")   # plan once
  torch.cuda.synchronize()
  with torch.cuda.stream(side):
    q = (base * 2).half()
    address = q.data_ptr()
    # the address's first call imports (DLPack's import holds the tensor
    # until jax is done); from its second on, a view
    jt.attention(q, k, v, method="fp32")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)   # ~0.1 s
    slept = torch.cuda.Event()
    slept.record(side)
    first = jt.attention(q, k, v, method="fp32")
    del q                            # its block goes back to side's pool
    q = (base * 3).half()            # ... and is taken again
    second = jt.attention(q, k, v, method="fp32")
  assert not slept.query()
  assert q.data_ptr() == address     # the reuse this test is about
  plan = next(p for p in jt._FAST.values() if p.views is not None)
  assert address in plan.views[0].arrays
  torch.cuda.synchronize()
  for out, scale in ((first, 2), (second, 3)):
    want = F.scaled_dot_product_attention(
        (base * scale).half().float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=0)


@pytest.mark.gpu
def test_cuda_graph_capture_is_refused():
  """Inside a CUDA graph capture a call raises (jax's kernels cannot join
  the graph), and the stream's fence stays in step for the next call."""
  q = torch.randn(1, 2, 64, 32, device="cuda", dtype=torch.float16)
  want = jt.attention(q, q, q, method="fp32")
  graph = torch.cuda.CUDAGraph()
  with pytest.raises(RuntimeError, match="CUDA graph capture"):
    with torch.cuda.graph(graph):
      jt.attention(q, q, q, method="fp32")
  torch.testing.assert_close(jt.attention(q, q, q, method="fp32"), want,
                             rtol=0, atol=0)


def test_index_mask_keywords_forward_backward_and_compile():
  """Query lengths, a window, segment ids and bottom-right alignment pass
  through the operator: output and gradients equal jax's on the same call
  (GQA, bottom-right with S > T), eager and under ``torch.compile``."""
  q, k, v = (x.requires_grad_() for x in hnd(14))
  g = torch.Generator().manual_seed(2)
  q_seg = torch.sort(torch.randint(0, 3, (B, T), generator=g), dim=1).values
  kv_seg = torch.sort(torch.randint(0, 3, (B, S), generator=g), dim=1).values
  index = dict(query_seq_lengths=torch.tensor([T, 11]),
               local_window_size=(5, 2), q_segment_ids=q_seg,
               kv_segment_ids=kv_seg, causal_alignment="bottom_right")
  jax_index = {name: (jnp.asarray(x.numpy()) if isinstance(x, torch.Tensor)
                      else x) for name, x in index.items()}
  w = torch.randn((B, N, T, H), generator=g)
  fn = lambda q, k, v: jt.attention(q, k, v, is_causal=True, **REF, **index)
  got = _grads(fn, (q, k, v), w)
  compiled = _grads(torch.compile(fn, fullgraph=True), (q, k, v), w)
  f = lambda q, k, v: jnp.sum(jaxattn.dot_product_attention(
      q, k, v, is_causal=True, **REF, **jax_index) * btnh(w))
  want = jax.grad(f, argnums=(0, 1, 2))(
      *(btnh(x.detach()) for x in (q, k, v)))
  assert np.allclose(fn(q, k, v).detach().numpy(),
                     jaxattn_hnd(q.detach(), k.detach(), v.detach(),
                                 is_causal=True, **jax_index), atol=1e-6)
  for a, b, c in zip(got, compiled, want):
    assert np.allclose(a.numpy(), to_hnd(c), rtol=1e-5, atol=1e-6)
    assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match="query_seq_lengths must lie in"):
    jt.attention(q, k, v, query_seq_lengths=[T + 1, 0])
  with pytest.raises(TypeError, match="q_segment_ids must hold integers"):
    jt.attention(q, k, v, q_segment_ids=q_seg.float())


def test_stream_fence_takes_its_turn():
  """The fence's wait (Triton's interpreter on the CPU): posted turns are
  taken at once (the token is the turn), a post still missing times out
  to -1, and a counter of another shape is refused."""
  from pallas_kernels import stream_fence
  posted = stream_fence.wait_for(jnp.array([3, 2], jnp.int32))
  assert posted.tolist() == [3]
  wrapped = stream_fence.wait_for(
      jnp.array([-2**31, 2**31 - 1], jnp.int32))   # the counts wrap
  assert wrapped.tolist() == [-2**31]
  missing = stream_fence.wait_for(jnp.array([2, 2], jnp.int32), max_spins=3)
  assert missing.tolist() == [-1]
  with pytest.raises(ValueError, match="counter must be int32"):
    stream_fence.wait_for(jnp.zeros((2,), jnp.int64 if jax.config.
                                    jax_enable_x64 else jnp.float32))


def test_a_failed_launch_resyncs_the_fence(monkeypatch):
  """On CUDA a call posts to its fence, then launches under the fence's
  lock; a launch that raises resyncs the fence (posts := turns) and
  releases the lock (checked with stand-ins for the fence and the
  executable: the CPU has no streams)."""
  q, k, v = hnd(21)
  jt.attention(q, k, v, **REF)
  plan = list(jt._DIRECT.values())[-1]
  events = []

  class Fence:
    lock = threading.Lock()
    def post(self):
      events.append("post")
    def resync(self):
      events.append("resync")

  fence = Fence()
  monkeypatch.setattr(jt._Plan, "inputs",
                      lambda self, tensors, lens: ([], 7, fence, []))

  def fails(*args):
    assert fence.lock.locked()
    raise RuntimeError("launch failed")

  monkeypatch.setattr(plan, "compiled", fails)
  with pytest.raises(RuntimeError, match="launch failed"):
    plan((q, k, v, None, None, None, None))
  assert events == ["post", "resync"] and not fence.lock.locked()
  monkeypatch.setattr(plan, "compiled", lambda *a: ("out", "token"))
  assert plan((q, k, v, None, None, None, None))[:2] == ("out", 7)
  assert events == ["post", "resync", "post"]

"""PyTorch interop: jaxattn's methods on ``torch.Tensor`` inputs and outputs,
without copies, through DLPack, on the tensors' device (CPU, or CUDA with a
CUDA build of jax).

* :func:`sageattn` has SageAttention's signature (``sageattn(q, k, v,
  tensor_layout="HND", is_causal=False, sm_scale=None, smooth_k=True)``):
  switching is a change of import.
* :func:`attention` runs any method of ``jaxattn.dot_product_attention``.

Layouts: ``"HND"`` is ``[batch, heads, seq, head_dim]`` (torch SDPA,
SageAttention), ``"NHD"`` is ``[batch, seq, heads, head_dim]`` (jaxattn's
BTNH).  Every transpose happens inside the one compiled JAX call.  Outputs
and gradients keep their inputs' memory order, as torch SDPA's flash
output follows the query's (:func:`_memory_order`): a model's HND views of
``[B, T, N, H]`` buffers cross, and come back, with no transpose at all.

What crosses DLPack and how:

* A contiguous tensor, or a permuted view of one (``x.transpose(1, 2)``), is
  shared without a copy; its axis order is restored in the compiled call.
  Any other view (a slice with gaps, an ``expand``) is copied once with
  ``.contiguous()``: DLPack and XLA take dense buffers only.  (JAX itself
  copies a buffer that is not 16-byte aligned.)
* float8 tensors (``float8_e4m3fn``, ``float8_e5m2`` and the ``fnuz``
  variants) travel as a ``uint8`` view and are bitcast back in JAX, then
  widened exactly to float16: a float8 input is float16 data that happens to
  be stored in 8 bits (no scale), and the output is float16.
* int4 / uint4 / quint4x2 tensors are refused: DLPack has no 4-bit type, and
  attention takes float values (``method="sage"`` with
  ``preset="sage2-4b"`` quantises to int4 itself).

Host cost: each call signature (shapes, strides, dtypes, devices, layout,
method, options, flags and jax's tracing configuration) is checked, traced
and compiled once (``jax.jit(...).lower(...).compile()``, kept in a dict,
:class:`_Plan`); a call with a known signature imports its tensors through
jax's DLPack core (``dlpack_managed_tensor_to_buffer``, not the Python of
``jax.dlpack.from_dlpack``; where jax has only CPUs as numpy views, which
the executable's argument path aliases; otherwise once per buffer
address, as views that own nothing, :class:`_DeviceViews`), runs the
compiled executable and exports its output with ``torch.from_dlpack``.
Without a gradient to record (grad mode off, or no input requires grad)
that is all; otherwise the call goes through the operator below.

Autograd and ``torch.compile``: the custom operator
``torch.ops.jaxattn.attention`` (``torch.library.custom_op``, with a fake
implementation for tracing) carries the calls that need a gradient, and
``torch.ops.jaxattn.attention_no_grad`` (the same call without an autograd
kernel) those that ``torch.compile`` traces with none to record; the
compiled graph keeps either as one opaque call instead of tracing DLPack.
The backward is the operator ``jaxattn::attention_backward``, which runs
jaxattn's VJP (:func:`jaxattn.grad.attention_vjp`: the exact gradient of
attention at the inputs, straight through the quantization) on the saved
inputs and the forward's log-sum-exp.  A float ``attn_mask`` (a bias) gets
a gradient too.

CUDA streams: nothing synchronises the device, and the host does not wait
for torch's queued work.  Importing the inputs on a stream (what
``jax.dlpack.from_dlpack`` does) would make jax 0.11.2's launch block the
host until torch's stream reaches them, so they are imported without one,
and a fence (:class:`_Fence`) orders the reads on the device: per call
torch's current stream increments a counter in device memory, and the
call's first kernel spins until the counter reaches its turn
(:mod:`pallas_kernels.stream_fence`).  The output is exported with torch's
current stream (``__dlpack__(stream=...)``, as ``torch.from_dlpack`` does),
and jax makes that stream wait until the result is ready.  Calls are
therefore ordered on whichever torch stream is current (``with
torch.cuda.stream(s):``).  (Torch's own ops may still wait on the host:
on the H200 the first calls queued on a new stream waited inside a torch
op, most likely its allocator making room beside jax's preallocated
memory; ``XLA_PYTHON_CLIENT_MEM_FRACTION`` leaves torch room.)
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxattn
from jaxattn import api, base, grad
from pallas_kernels import stream_fence

try:  # jax's C++ DLPack import, under jax.dlpack.from_dlpack's Python
  from jax._src.lib import _jax as _jaxlib
except ImportError:  # pragma: no cover - older jaxlib
  _jaxlib = None
try:  # the configuration that jit keys its traces on (x64, precision, ...)
  from jax._src.config import trace_context as _trace_context
except ImportError:  # pragma: no cover
  def _trace_context():
    return None

LAYOUTS = {"HND": (0, 2, 1, 3), "NHD": (0, 1, 2, 3)}  # to BTNH, self-inverse
_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT8 = {torch.float8_e4m3fn: "float8_e4m3fn",
           torch.float8_e5m2: "float8_e5m2",
           torch.float8_e4m3fnuz: "float8_e4m3fnuz",
           torch.float8_e5m2fnuz: "float8_e5m2fnuz"}
_INT4 = tuple(getattr(torch, n) for n in ("int4", "uint4", "quint4x2")
              if hasattr(torch, n))
_QK_QUANT_GRAN = {"per_warp": "warp", "per_block": "block",
                  "per_token": "token", "per_tensor": "tensor"}
_NO_INDEX = (None, None, None)
_MAX_ENTRIES = 512   # signatures kept per cache (the oldest goes first)


def _check_dtype(tensor: torch.Tensor, name: str, allowed=_FLOAT) -> None:
  if tensor.dtype in _INT4:
    raise TypeError(
        f"{name} is {tensor.dtype}: 4-bit tensors cannot cross DLPack (it has "
        "no 4-bit type) and attention takes float inputs; pass the float "
        "values (method='sage', preset='sage2-4b' quantises to int4 itself)")
  if tensor.dtype == torch.float64 and not jax.config.jax_enable_x64:
    raise TypeError(f"{name} is float64 but jax_enable_x64 is off; pass "
                    "float32 or enable x64")
  if tensor.dtype not in allowed and tensor.dtype not in _FLOAT8:
    kinds = "bool, " * (torch.bool in allowed) + "float16, bfloat16, float32"
    raise TypeError(f"{name} must be {kinds} or float8, got {tensor.dtype}")


@torch.compiler.assume_constant_result
def _jax_has_gpu() -> bool:
  """(A constant to ``torch.compile``, which cannot trace ``jax.devices``.)"""
  return any(d.platform == "gpu" for d in jax.devices())


def _jax_device_kind(device: torch.device) -> None:
  """Raises unless jax can take tensors from ``device`` through DLPack."""
  if device.type == "cpu":
    return
  if device.type != "cuda":
    raise ValueError(f"tensors on {device} cannot cross DLPack to jax; use "
                     "CPU or CUDA tensors")
  if not _jax_has_gpu():
    raise RuntimeError(f"tensors are on {device} but jax has no GPU backend; "
                       "install a CUDA build of jax (jaxattn[gpu])")


def _jax_device(device: torch.device):
  """A context in which jax computes on ``device``'s kind: the CPU for CPU
  tensors even where jax's default backend is a GPU (so that no GPU kernel
  is picked for arrays that live on the CPU)."""
  if device.type == "cpu":
    return jax.default_device(jax.devices("cpu")[0])
  return contextlib.nullcontext()


def _check(q, k, v, attn_mask, layout) -> None:
  """The checks of a call's tensors and layout (once per signature)."""
  if layout not in LAYOUTS:
    raise ValueError(f"tensor_layout must be 'HND' or 'NHD', got {layout!r}")
  tensors = {"q": q, "k": k, "v": v}
  if attn_mask is not None:
    tensors["attn_mask"] = attn_mask
  for name, x in tensors.items():
    if not isinstance(x, torch.Tensor):
      raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
  for name, x in (("q", q), ("k", k), ("v", v)):
    if x.ndim != 4:
      dims = "[batch, heads, seq, head_dim]" if layout == "HND" else \
             "[batch, seq, heads, head_dim]"
      raise ValueError(f"{name} must have rank 4 {dims} for tensor_layout="
                       f"{layout!r}, got shape {tuple(x.shape)}")
    _check_dtype(x, name)
  if attn_mask is not None:
    _check_dtype(attn_mask, "attn_mask", _FLOAT + (torch.bool,))
  devices = {name: x.device for name, x in tensors.items()}
  if len(set(devices.values())) > 1:
    raise ValueError("q, k, v (and attn_mask) must be on one device, got "
                     + ", ".join(f"{n} on {d}" for n, d in devices.items()))
  _jax_device_kind(q.device)
  for name, x in tensors.items():
    if x.layout != torch.strided:
      raise TypeError(f"{name} must be a strided (dense) tensor, got "
                      f"{x.layout}")


def _store(cache: dict, key, value):
  if len(cache) >= _MAX_ENTRIES:
    cache.pop(next(iter(cache)))
  cache[key] = value
  return value


# --- DLPack: jax's core import, torch's current stream --------------------

_JAX_DEVICES: dict = {}       # torch.device -> jax device
_EXTERNAL_STREAMS: dict = {}  # jax's stream pointer -> torch.cuda.ExternalStream
_UNSET = object()
_importer = _exporter = _stream_write = _UNSET   # found at first use


def _jax_device_for(device: torch.device):
  """The jax device that holds ``device``'s memory (as
  ``jax.dlpack.from_dlpack`` picks it)."""
  found = _JAX_DEVICES.get(device)
  if found is None:
    if device.type == "cpu":
      found = jax.devices("cpu")[0]
    else:
      index = device.index or 0
      found = next(d for d in jax.local_devices(backend="gpu")
                   if d.local_hardware_id == index)
    _JAX_DEVICES[device] = found
  return found


def _core_import_forms():
  """jax's C++ DLPack import as ``f(capsule, jax_device, stream,
  dl_device_type)``, in each form jax has had: (capsule, device, stream,
  copy, dl device type), older the first 3.  Empty without it."""
  core = getattr(_jaxlib, "dlpack_managed_tensor_to_buffer", None)
  if core is None:
    return ()
  return (lambda capsule, device, stream, dl_type: core(
              capsule, device, stream, None, dl_type),
          lambda capsule, device, stream, dl_type: core(
              capsule, device, stream))


def _find_importer():
  """``f(tensor, jax_device, stream, dl_device_type)``: jax's C++ DLPack
  import of a dense tensor (what ``jax.dlpack.from_dlpack`` does after its
  Python look-ups), or None where this jax and torch have no form of it
  that imports a probe tensor correctly."""
  exports = [getattr(torch._C, n, None)
             for n in ("_to_dlpack_versioned", "_to_dlpack")]
  probe = torch.arange(4, dtype=torch.float32)
  cpu = jax.devices("cpu")[0]
  for export in filter(None, exports):
    for form in _core_import_forms():
      importer = (lambda t, device, stream, dl_type, export=export,
                  form=form: form(export(t), device, stream, dl_type))
      try:
        array = importer(probe, cpu, None, 1)
        if (isinstance(array, jax.Array) and array.dtype == jnp.float32
            and np.array_equal(np.asarray(array), probe.numpy())):
          return importer
      except Exception:  # pylint: disable=broad-except
        continue
  return None


def _find_exporter():
  """``f(array, stream)``: a DLPack capsule of a single-device jax array
  from jax's C++ export (what ``jax.Array.__dlpack__`` does after its
  Python look-ups; on CUDA ``stream`` waits until the array is ready), or
  ``__dlpack__`` itself where this jax has no form of it that exports a
  probe array correctly."""
  core = getattr(_jaxlib, "buffer_to_dlpack_managed_tensor", None)
  candidates = [] if core is None else [
      lambda array, stream: core(array, stream=stream, max_version=(1, 0),
                                 copied=False),
      lambda array, stream: core(array, stream=stream)]
  probe = jax.device_put(np.arange(4, dtype=np.float32), jax.devices("cpu")[0])
  for exporter in candidates:
    try:
      if np.array_equal(torch.from_dlpack(exporter(probe, None)).numpy(),
                        np.arange(4, dtype=np.float32)):
        return exporter
    except Exception:  # pylint: disable=broad-except
      continue
  return lambda array, stream: array.__dlpack__(stream=stream,
                                                max_version=(1, 0))


def _to_jax(tensor: torch.Tensor, device, stream, dl_type: int):
  """A dense tensor as a jax array on ``device`` sharing its memory (jax
  copies a buffer that is not 16-byte aligned).  On CUDA ``stream`` is
  jax's stream for external buffers, which the caller made wait for
  torch's, or None where a fence orders the reads (:class:`_Fence`)."""
  global _importer
  if _importer is _UNSET:
    _importer = _find_importer()
  if _importer is not None:
    try:
      return _importer(tensor, device, stream, dl_type)
    except Exception:  # pylint: disable=broad-except
      pass   # (a pinned tensor, say): jax's own path, which handshakes
      # itself (and makes the launch wait on the host)
  return jax.dlpack.from_dlpack(tensor.detach(), device=device)


# CPU tensors whose dtype numpy holds (bfloat16 through an int16 view):
# what the executable takes as a numpy view (:func:`_host_view`)
_HOST_VIEW_DTYPES = {torch.float16: None, torch.float32: None,
                     torch.uint8: None, torch.bool: None, torch.int32: None,
                     torch.bfloat16: (torch.int16, jnp.bfloat16)}


class _DLTensor(ctypes.Structure):   # DLPack's DLTensor (unversioned)
  _fields_ = [("data", ctypes.c_void_p), ("device", ctypes.c_int32 * 2),
              ("ndim", ctypes.c_int32), ("dtype", ctypes.c_uint8 * 4),
              ("shape", ctypes.c_void_p), ("strides", ctypes.c_void_p),
              ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
  _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
              ("deleter", ctypes.c_void_p)]


def _find_libc():
  """``(malloc, free, PyCapsule_New)`` through ctypes, or None."""
  # (own prototypes: the shared ctypes.pythonapi functions stay as found)
  try:
    libc = ctypes.CDLL(None)
    malloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t)(
        ("malloc", libc))
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(("free", libc))
    new_capsule = ctypes.PYFUNCTYPE(
        ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
        ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))
  except (OSError, AttributeError, TypeError):
    return None
  return malloc, free, new_capsule


_capsule_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object,
                                     ctypes.c_char_p)(
                                         ("PyCapsule_GetPointer",
                                          ctypes.pythonapi))
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object,
                                      ctypes.c_char_p)(
                                          ("PyCapsule_IsValid",
                                           ctypes.pythonapi))


def _find_view_load():
  """``load(capsule, jax_device, dl_device_type)`` for the capsules of
  :class:`_DeviceViews`: jax's C++ import, in the form this jax takes,
  or None where no form imports a probe tensor as a view of its memory."""
  global _LIBC
  _LIBC = _find_libc()
  if _LIBC is None:
    return None
  probe = torch.arange(12, dtype=torch.float32).reshape(3, 4)
  cpu = jax.devices("cpu")[0]
  for form in _core_import_forms():
    load = (lambda capsule, device, dl_type, form=form:
            form(capsule, device, None, dl_type))
    try:
      array = _DeviceViews(probe, cpu, 1, load).make(probe.data_ptr())
      if (array.unsafe_buffer_pointer() == probe.data_ptr()
          and np.array_equal(np.asarray(array), probe.numpy())):
        return load
    except Exception:  # pylint: disable=broad-except
      continue
  return None


_LIBC = None
_view_load = _UNSET   # _find_view_load's answer, found at the first plan


class _DeviceViews:
  """jax arrays viewing one plan input's buffers, by address, that own no
  memory (CUDA tensors, and CPU tensors where jax has a GPU): a repeat
  call on a buffer called before reuses its array, with no DLPack import (on
  the H200's host 9-12 us a tensor, and the executable costs more on fresh
  imports than on arrays it has run on).

  Each array comes from a DLPack capsule built here whose deleter is libc's
  ``free`` of the capsule itself (no torch reference, no GIL).  A plan
  fixes shape, strides and dtype, so the address names the view.  The
  caller keeps the tensor alive until the outputs are exported (on the CPU
  once jax's result is ready; on CUDA on torch's stream, which waits for
  it): later torch work on that stream,
  a reuse of the freed buffer included, comes after jax's reads, as after
  a torch kernel's (a buffer freed on another stream needs
  ``record_stream``, as for torch's own kernels).  The views are private:
  ``jax.live_arrays()`` lists them, and one read after its tensor is freed
  reads freed memory.
  """

  __slots__ = ("template", "ndim", "device", "dl_type", "load", "arrays",
               "seen", "lock")
  # Addresses kept a plan input, the least recently used evicted.  A view
  # is made on an address's second call within the last CAPACITY new ones:
  # a miss that makes a view costs more than DLPack's import (H200, tiny
  # call, 24 sets in turn over 16 kept: +2 to +74 us a call), so buffers
  # seen once, or cycling through more than CAPACITY, keep the import.
  CAPACITY = 64

  def __init__(self, tensor: torch.Tensor, device, dl_type: int, load):
    """``load(capsule, device, dl_type)``: jax's C++ DLPack import."""
    # dtype and device as torch encodes them, from torch's own capsule
    capsule = torch._C._to_dlpack(tensor)
    theirs = _DLManagedTensor.from_address(
        _capsule_pointer(capsule, b"dltensor"))
    head = _DLManagedTensor()
    head.dl_tensor.device[:] = theirs.dl_tensor.device[:]
    head.dl_tensor.dtype[:] = theirs.dl_tensor.dtype[:]
    del theirs, capsule   # (torch's capsule frees itself, unused)
    head.dl_tensor.ndim = tensor.ndim
    head.deleter = ctypes.cast(_LIBC[1], ctypes.c_void_p).value
    dims = (ctypes.c_int64 * (2 * tensor.ndim))(*tensor.shape,
                                                  *tensor.stride())
    self.template = bytes(head) + bytes(dims)
    self.ndim = tensor.ndim
    self.device = device
    self.dl_type = dl_type
    self.load = load
    self.arrays: dict = {}   # address -> array, least recently used first
    self.seen: dict = {}     # addresses called once, oldest first
    self.lock = threading.Lock()

  def __call__(self, tensor: torch.Tensor):
    """The view of ``tensor``'s buffer, or None on the first call with its
    address (the caller imports it)."""
    address = tensor.data_ptr()
    with self.lock:
      array = self.arrays.pop(address, None)
      if array is not None:
        self.arrays[address] = array   # (now the most recently used)
        return array
      if address not in self.seen:
        self.seen[address] = None
        if len(self.seen) > self.CAPACITY:
          del self.seen[next(iter(self.seen))]
        return None
      del self.seen[address]
    array = self.make(address)
    if array.unsafe_buffer_pointer() != address:
      return array   # a copy (jax copies unaligned CPU buffers) goes stale
    with self.lock:
      self.arrays[address] = array
      while len(self.arrays) > self.CAPACITY:
        del self.arrays[next(iter(self.arrays))]
    return array

  def make(self, address: int):
    """A new view of the buffer at ``address``, not kept."""
    malloc, free, new_capsule = _LIBC
    size = len(self.template)
    block = malloc(size)
    if not block:
      raise MemoryError("jaxattn.torch: no memory for a DLPack capsule")
    ctypes.memmove(block, self.template, size)
    dims = block + ctypes.sizeof(_DLManagedTensor)
    view = _DLManagedTensor.from_address(block)
    view.dl_tensor.data = address
    view.dl_tensor.shape = dims
    view.dl_tensor.strides = dims + 8 * self.ndim
    del view
    try:
      capsule = new_capsule(block, b"dltensor", None)
    except BaseException:
      free(block)
      raise
    try:
      return self.load(capsule, self.device, self.dl_type)
    except BaseException:
      # (a consumed capsule is renamed; an unconsumed one owns the block)
      if _capsule_is_valid(capsule, b"dltensor"):
        free(block)
      raise


def _host_view(tensor: torch.Tensor):
  """A dense CPU tensor of a dtype in :data:`_HOST_VIEW_DTYPES` as a numpy
  array sharing its memory, which the compiled executable's own argument
  path takes without a copy (an aligned buffer).  (A numpy view costs
  about 1 us a tensor on a 2-core CPU, jax's DLPack import 5; the
  executable's dispatch and wait took 7-33 us less with views.)"""
  if tensor.requires_grad:
    tensor = tensor.detach()
  as_int = _HOST_VIEW_DTYPES[tensor.dtype]
  if as_int is None:
    return tensor.numpy()
  return tensor.view(as_int[0]).numpy().view(as_int[1])


def _to_torch(array: jax.Array, stream) -> torch.Tensor:
  """A jax array as a torch tensor sharing its memory; on CUDA ``stream``
  (torch's current stream) waits until the array is ready."""
  global _exporter
  if _exporter is _UNSET:
    _exporter = _find_exporter()
  return torch.from_dlpack(_exporter(array, stream))


def _cuda_handshake(index: int, device):
  """Per call on CUDA: jax's stream for external buffers waits for torch's
  current stream (one event), before the inputs are imported on it.
  Returns ``(jax's stream, torch's current stream)`` as DLPack stream
  numbers."""
  current = torch.cuda.current_stream(index)
  try:
    stream = device.get_stream_for_external_ready_events()
  except Exception:  # pylint: disable=broad-except
    stream = None
  if stream is None:   # no stream to wait on: wait here (not seen on CUDA)
    current.synchronize()
  elif stream != current.cuda_stream:
    waiter = _EXTERNAL_STREAMS.get(stream)
    if waiter is None:
      waiter = _EXTERNAL_STREAMS[stream] = torch.cuda.ExternalStream(
          stream, device=index)
    waiter.wait_event(current.record_event())
  # DLPack numbers the legacy default stream 1 (torch.from_dlpack does too)
  return stream, current.cuda_stream or 1


def _find_stream_write():
  """The CUDA driver's ``cuStreamWriteValue32`` (a 32-bit store queued on a
  stream, after a memory fence: no kernel launch), or None."""
  try:
    write = ctypes.CDLL("libcuda.so.1").cuStreamWriteValue32_v2
  except (OSError, AttributeError):
    return None
  write.argtypes = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32,
                    ctypes.c_uint)
  write.restype = ctypes.c_int
  return write


class _Fence:
  """Orders jax's stream after one torch stream without a host wait
  (:mod:`pallas_kernels.stream_fence`): an int32 ``[2]`` counter (posts,
  turns) in jax's memory, shared with torch.  Per call torch's stream posts
  (after the work that wrote the inputs), then the call's executable, whose
  first kernel waits on the device for that post, is launched.  While it
  waits, all of jax's work on the device waits with it."""

  __slots__ = ("array", "tensor", "posts", "lock", "index", "stream",
               "address", "write", "count")

  def __init__(self, device, stream: int, index: int):
    # jax's zeros, queued on jax's stream before every wait; torch's stream
    # waits for them before its first post
    self.array = jax.device_put(np.zeros(2, np.int32), device)
    self.tensor = _to_torch(self.array, stream)
    self.posts = self.tensor[:1]
    self.lock = threading.Lock()
    self.index = index
    global _stream_write
    if _stream_write is _UNSET:
      _stream_write = _find_stream_write()
    self.write = _stream_write   # None: posts are torch add_'s
    self.stream = stream   # (1: the legacy default stream, as in CUDA)
    self.address = self.posts.data_ptr()
    self.count = 0         # posts queued, mod 2^32: the counter's next value

  def post(self) -> None:
    """Queued on torch's current stream, after the work that wrote the
    inputs: the counter := posts so far, by the driver's stream write (on
    the H200's host 21 us a call as a torch ``add_``), or ``add_`` where
    that is refused (the same value)."""
    self.count = (self.count + 1) & 0xFFFFFFFF
    if self.write is None or self.write(self.stream, self.address,
                                        self.count, 0) != 0:
      self.posts.add_(1)

  def resync(self) -> None:
    """After a launch that failed: once every queued wait has passed (each
    had its post), posts := turns taken, so the next wait is the next
    post's."""
    torch.cuda.synchronize(self.index)
    self.posts.copy_(self.tensor[1:])
    torch.cuda.synchronize(self.index)
    self.count = int(self.posts.item()) & 0xFFFFFFFF


_FENCES: dict = {}   # (device index, torch stream) -> _Fence, kept for good

# torch's current CUDA stream as its raw handle (0: the legacy default
# stream), without the Stream object torch.cuda.current_stream builds
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
    lambda index: torch.cuda.current_stream(index).cuda_stream)


def _fence_for(index: int, device):
  """``(torch's current stream as a DLPack stream number, its fence)``."""
  if torch.cuda.is_current_stream_capturing():
    # a captured post runs at each replay, but jax's wait runs now, once
    raise RuntimeError("jaxattn.torch cannot run inside a CUDA graph capture "
                       "(torch.cuda.graph, torch.compile's reduce-overhead "
                       "mode): jax launches its kernels outside the graph")
  # DLPack numbers the legacy default stream 1 (torch.from_dlpack does too)
  stream = _raw_stream(index) or 1
  fence = _FENCES.get((index, stream))
  if fence is None:
    fence = _FENCES[index, stream] = _Fence(device, stream, index)
  return stream, fence


def _dense_layout(tensor: torch.Tensor):
  """``(perm, copy, axes)``: the tensor crosses as ``tensor.permute(perm)``
  (perm None: as it is), a view of its dense buffer, or (copy True) as
  ``tensor.contiguous()``; ``jnp.transpose(array, axes)`` restores its axis
  order.  A function of shape and strides only."""
  ndim = tensor.ndim
  order = list(range(ndim))
  if not tensor.is_contiguous():
    order.sort(key=lambda i: -tensor.stride(i))
    if not tensor.permute(order).is_contiguous():
      return None, True, tuple(range(ndim))
  axes = tuple(order.index(i) for i in range(ndim))
  return (None if order == sorted(order) else tuple(order)), False, axes


def _memory_order(tensor: torch.Tensor):
  """The axes of ``tensor`` from the largest stride to the smallest, where
  it is a permuted view of a dense buffer with its last axis innermost;
  else (or in order already) None.  The forward's output follows it, as
  torch SDPA's flash output follows the query's stride order: a query
  that is a ``[B, T, N, H]`` buffer seen as HND gives an output that is
  one too, so neither jax nor the caller's ``transpose(1, 2).reshape``
  copies it."""
  order = _dense_order(tensor)
  return None if order is None or order[-1] != tensor.ndim - 1 else order


def _dense_order(tensor: torch.Tensor):
  """The axes of ``tensor`` from the largest stride to the smallest, where
  it is a permuted view of a dense buffer (None: in order already, or not
  dense); the memory order of the gradient of a float ``attn_mask``, as of
  ``empty_like``'s."""
  # (dim_order, not _dense_layout's sort: dynamo traces it on symbolic
  # strides, where a sort with stride keys does not trace)
  order = tuple(tensor.dim_order())
  if order == tuple(range(tensor.ndim)):
    return None
  return order if tensor.permute(order).is_contiguous() else None


def _in_memory_order(array, order):
  """Inside jit: ``array`` (the output's axes) as its memory order's."""
  return array if order is None else jnp.transpose(array, order)


def _op_order(shape, order) -> list:
  """``shape`` in memory ``order`` (:func:`_memory_order`)."""
  return list(shape) if order is None else [shape[i] for i in order]


def _inverse(order) -> tuple | None:
  """The permutation that undoes ``order`` (None for None)."""
  return None if order is None else tuple(order.index(i)
                                          for i in range(len(order)))


def _permuted(tensor: torch.Tensor, axes) -> torch.Tensor:
  return tensor if axes is None else tensor.permute(axes)


def _from_memory_order(tensor: torch.Tensor, order) -> torch.Tensor:
  """A tensor in memory ``order`` back to its own axes (a view)."""
  return _permuted(tensor, _inverse(order))


def _import_tensor(tensor: torch.Tensor):
  """A tensor as a jax array that shares its memory (one-off; calls use
  :class:`_Plan`).

  Returns ``(array, (axes, float8))``: ``jnp.transpose(array, axes)`` has
  the tensor's axis order, and ``float8`` names the float8 dtype of a
  ``uint8`` array (None otherwise).  A permuted view of a contiguous tensor
  is shared as its contiguous buffer; any other view is copied once.
  """
  perm, copy, axes = _dense_layout(tensor)
  if copy:
    tensor = tensor.contiguous()
  elif perm is not None:
    tensor = tensor.permute(perm)
  float8 = _FLOAT8.get(tensor.dtype)
  if float8 is not None:
    tensor = tensor.view(torch.uint8)
  device = _jax_device_for(tensor.device)
  stream, dl_type = None, 1
  if tensor.device.type == "cuda":
    stream, dl_type = _cuda_handshake(tensor.device.index, device)[0], 2
  return _to_jax(tensor, device, stream, dl_type), (axes, float8)


def _restore(array, axes, float8):
  """Inside jit: the float8 bitcast (widened to float16) and the transpose."""
  if float8 is not None:
    array = jax.lax.bitcast_convert_type(array, jnp.dtype(float8))
    array = array.astype(jnp.float16)
  return jnp.transpose(array, axes)


def _sig(t):
  """What a compiled call is specialised on, of one tensor (or None)."""
  return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


class _Plan:
  """One compiled jax call for one signature of torch inputs.

  ``body(arrays, lens)`` is traced once, on the inputs restored inside jax
  (float8 widened, axis order restored, then transposed by ``to[i]``; None
  for an absent tensor) and ``lens`` (int32 ``[B]`` or None), and compiled
  for the tensors' device.  A call imports the tensors (views and copies
  decided here, from the first call's strides), on CUDA posts to torch's
  stream's fence (:class:`_Fence`), and runs the executable, whose first
  kernel waits for that post.
  """

  __slots__ = ("recipes", "views", "compiled", "device", "dl_type", "cuda",
               "out_axes")

  def __init__(self, body, tensors, lens, to):
    torch_device = next(t for t in tensors if t is not None).device
    self.device = _jax_device_for(torch_device)
    self.cuda = torch_device.index if torch_device.type == "cuda" else None
    self.dl_type = 2 if self.cuda is not None else 1   # kDLCUDA, kDLCPU
    # (a forward's: its output's axes back from q's memory order)
    self.out_axes = None
    # numpy views where jax's only devices are CPUs (the case measured; a
    # GPU host's CPU tensors keep the import, which names the CPU device)
    host_views = self.cuda is None and not _jax_has_gpu()
    recipes, metas = [], []
    for t, to_axes in zip(tensors, to):
      if t is None:
        recipes.append(None)
        metas.append(None)
        continue
      perm, copy, axes = _dense_layout(t)
      float8 = _FLOAT8.get(t.dtype)
      dtype = torch.uint8 if float8 else t.dtype
      recipes.append((perm, copy, float8 is not None,
                      host_views and dtype in _HOST_VIEW_DTYPES))
      if to_axes is not None:
        axes = tuple(axes[i] for i in to_axes)
      metas.append((axes, float8))
    self.recipes = tuple(recipes)
    self.views = None
    if not host_views:   # (CUDA, and a GPU host's CPU tensors)
      global _view_load
      if _view_load is _UNSET:
        _view_load = _find_view_load()
      if _view_load is not None:
        try:
          self.views = tuple(
              None if r is None else _DeviceViews(
                  _crossed(t, r), self.device, self.dl_type, _view_load)
              for t, r in zip(tensors, self.recipes))
        except Exception:  # pylint: disable=broad-except
          self.views = None   # (DLPack's own import, as before)
    has_lens = lens is not None

    fenced = self.cuda is not None

    def traced(*args):
      token = None
      if fenced:   # every reader of the inputs waits for torch's post
        token = stream_fence.wait_for(args[-1])
        args = jax.lax.optimization_barrier((token, args[:-1]))[1]
      args = iter(args)
      arrays = [None if m is None else _restore(next(args), *m) for m in metas]
      out = body(arrays, next(args) if has_lens else None)
      # (an output, so that XLA keeps the wait: the barrier alone is no use
      # of it, and the wait has no side effect XLA knows of)
      return out if token is None else (out, token)

    if self.views is not None:
      try:   # this jax takes the views, or DLPack's own import it is
        for t, r, views in zip(tensors, self.recipes, self.views):
          address = None if views is None else _crossed(t, r).data_ptr()
          if address is not None and not address % 16:
            views.make(address)
      except Exception:  # pylint: disable=broad-except
        self.views = None
    args, _, _, _ = self.inputs(tensors, lens)
    with _jax_device(torch_device):
      self.compiled = jax.jit(traced).lower(*args).compile()

  def inputs(self, tensors, lens):
    """``(args, stream, fence, held)``: the executable's arguments for
    ``tensors`` and ``lens`` (on CUDA the fence's counter last), torch's
    stream to export the outputs on and its fence (both None on the CPU),
    and the tensors that the arguments view without owning them."""
    args, held = [], []
    for i, (t, recipe) in enumerate(zip(tensors, self.recipes)):
      if recipe is None:
        continue
      t = _crossed(t, recipe)
      if recipe[3]:   # (float64, int64 and GPU hosts: jax's import)
        args.append(_host_view(t))
        continue
      if self.cuda is not None and t.data_ptr() % 16:
        # jax would copy it at the import, on its stream, before the
        # fence's wait: torch copies it, after the work that wrote it
        t = t.clone()
      held.append(t)
      array = None
      if self.views is not None:
        try:
          array = self.views[i](t)
        except Exception:  # pylint: disable=broad-except
          pass   # DLPack's own import, as _to_jax falls back to jax's
      if array is None:   # (no stream: the fence orders jax's reads)
        array = _to_jax(t, self.device, None, self.dl_type)
      args.append(array)
    if lens is not None:
      args.append(lens)
    if self.cuda is None:
      return args, None, None, held
    export_stream, fence = _fence_for(self.cuda, self.device)
    args.append(fence.array)
    return args, export_stream, fence, held

  def __call__(self, tensors, lens=None):
    """``(jax outputs, torch's stream to export them on, what to hold)``.
    Hold the last until the outputs are exported: the tensors that views
    read (torch's stream then waits for jax's result), and on the CPU the
    imported arrays, so that their release (torch's DLPack deleter, which
    takes the GIL) runs in this thread, not in XLA's worker while this one
    waits holding the GIL."""
    args, export_stream, fence, held = self.inputs(tensors, lens)
    if fence is None:
      return self.compiled(*args), export_stream, (args, held)
    # The post goes first: on torch's legacy default stream a kernel waits
    # for every blocking stream's work, jax's wait included, so a post
    # queued after the launch would never run.
    with fence.lock:   # (another thread's post must not come between)
      fence.post()
      try:
        out = self.compiled(*args)[0]
      except BaseException:
        fence.resync()   # a turn may or may not have been taken
        raise
    return out, export_stream, (args, held)


def _crossed(tensor: torch.Tensor, recipe) -> torch.Tensor:
  """The tensor as it crosses into jax by ``recipe`` (a :class:`_Plan`'s):
  its dense buffer in memory order, float8 as uint8."""
  perm, copy, as_uint8, _ = recipe
  if copy:
    tensor = tensor.contiguous()
  elif perm is not None:
    tensor = tensor.permute(perm)
  return tensor.view(torch.uint8) if as_uint8 else tensor


# --- the forward and backward as plans ------------------------------------

def _bias_and_mask(attn_mask):
  if attn_mask is None:
    return None, None
  if attn_mask.dtype == jnp.bool_:
    return None, attn_mask
  return attn_mask, None


def _forward_plan(tensors, lens, *, layout, method, implementation, scale,
                  is_causal, options, window, alignment, need_lse):
  """The plan of ``(q, k, v, attn_mask, q_lens, q_segment_ids,
  kv_segment_ids)``: the output with the layout's axes, contiguous in q's
  memory order (:func:`_op_order`; ``plan.out_axes`` permutes it back);
  with ``need_lse`` also the float32 log-sum-exp ``[B, T, N]``;
  ``fmha_int8`` with ``return_int8``: ``(int8 output, its scale)``."""
  to_layout = LAYOUTS[layout]
  order = _memory_order(tensors[0])

  def output(x):   # [B, T, N, H] -> the layout's axes, in q's memory order
    return _in_memory_order(jnp.transpose(x, to_layout), order)

  def body(arrays, kv_lens):
    q, k, v, attn_mask, q_lens, q_seg, kv_seg = arrays
    bias, mask = _bias_and_mask(attn_mask)
    out = jaxattn.dot_product_attention(
        q, k, v, bias, mask, scale=scale, is_causal=is_causal,
        key_value_seq_lengths=kv_lens, method=method,
        implementation=implementation, return_residual=need_lse,
        query_seq_lengths=q_lens, q_segment_ids=q_seg,
        kv_segment_ids=kv_seg, local_window_size=window,
        causal_alignment=alignment, **options)
    if need_lse:   # (output, log-sum-exp [B, T, N])
      return output(out[0]), out[1]
    if isinstance(out, tuple):  # (int8 output, its scale)
      return (output(out[0]), *out[1:])
    return output(out)

  plan = _Plan(body, tensors, lens, (to_layout,) * 3 + (None,) * 4)
  plan.out_axes = _inverse(order)
  return plan


def _sum_to(x, shape):
  """``x`` summed over the axes that broadcasting ``shape`` to it added."""
  lead = x.ndim - len(shape)
  x = x.sum(axis=tuple(range(lead))) if lead else x
  axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
  return x.sum(axis=axes, keepdims=True) if axes else x


def _backward_plan(tensors, lens, *, layout, scale, is_causal, window,
                   alignment):
  """The plan of ``(q, k, v, attn_mask, q_lens, q_segment_ids,
  kv_segment_ids, lse, dout, out)``: ``(dq, dk, dv, dbias)`` in the
  tensors' layout's axes, each contiguous in its tensor's memory order
  (:func:`_op_order`; dbias shaped like the float ``attn_mask``, or None);
  ``out``, the forward's output, or None."""
  to_layout = LAYOUTS[layout]
  on_gpu = tensors[0].device.type == "cuda"
  orders = [_memory_order(t) for t in tensors[:3]]   # (as the fake's)
  # a float mask's gradient has its strides (the fake's empty_like)
  bias_order = None if tensors[3] is None else _dense_order(tensors[3])

  def body(arrays, kv_lens):
    q, k, v, attn_mask, q_lens, q_seg, kv_seg, lse, dout, out = arrays
    bias, mask = _bias_and_mask(attn_mask)
    b, t, n, d = q.shape
    full = (b, n, t, k.shape[1])
    bias_shape = None if bias is None else bias.shape
    if bias is not None:
      bias = jnp.broadcast_to(bias, full)
    if mask is not None:
      mask = jnp.broadcast_to(mask, full)
    kv_lens = (jnp.full((b,), k.shape[1], jnp.int32) if kv_lens is None
               else jnp.asarray(kv_lens, jnp.int32))
    index_mask, _ = api.build_index_mask(
        q, k, kv_lens, query_seq_lengths=q_lens, local_window_size=window,
        q_segment_ids=q_seg, kv_segment_ids=kv_seg,
        causal_alignment=alignment)
    dq, dk, dv, dbias = grad.attention_vjp(
        q, k, v, bias, mask, kv_lens, None if lse.size == 0 else lse, dout,
        scale=base.default_scale(d) if scale is None else scale,
        is_causal=is_causal, on_gpu=on_gpu, out=out, index_mask=index_mask)
    return (*(_in_memory_order(jnp.transpose(g, to_layout), o)
              for g, o in zip((dq, dk, dv), orders)),
            None if dbias is None else _in_memory_order(
                _sum_to(dbias, bias_shape), bias_order))

  return _Plan(body, tensors, lens,
               (to_layout,) * 3 + (None,) * 5 + (to_layout,) * 2)


# --- the public functions -------------------------------------------------

_CHECKED: dict = {}   # signatures of (q, k, v, attn_mask, layout) checked
_DIRECT: dict = {}    # call signature -> _Plan, calls without autograd
_FAST: dict = {}      # the same, keyed by the arguments as given
_OP_PLANS: dict = {}  # operator signature -> _Plan (forward and backward)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              method: str = "fp32", tensor_layout: str = "HND",
              is_causal: bool = False, sm_scale: float | None = None,
              attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
              key_value_seq_lengths=None, implementation: str | None = None,
              return_lse: bool = False, query_seq_lengths=None,
              local_window_size: int | tuple[int, int] | None = None,
              q_segment_ids=None, kv_segment_ids=None,
              causal_alignment: str = "top_left", **options):
  """``jaxattn.dot_product_attention`` on torch tensors, without copies.

  Args:
    q: ``[B, N, T, H]`` ("HND") or ``[B, T, N, H]`` ("NHD"); float16,
      bfloat16, float32 or float8 (read as float16).
    k, v: ``[B, K, S, H]`` / ``[B, S, K, H]``, ``N`` a multiple of ``K``;
      same device as ``q``.
    method: one of ``jaxattn.METHODS``; ``options`` are its config fields.
    is_causal: top-left aligned, as torch SDPA.
    sm_scale: softmax scale, default ``1/sqrt(H)``.
    attn_mask: as torch SDPA, broadcastable to ``[B, N, T, S]`` in either
      layout: bool (True takes part) or float (added to the scaled scores).
    dropout_p: must be 0 (no dropout).
    key_value_seq_lengths: ints ``[B]`` (tensor or sequence); keys at or
      beyond are masked.
    implementation: None, "reference", "triton" or "mosaic" (as
      ``jaxattn.dot_product_attention``).
    return_lse: also return the float32 log-sum-exp ``[B, N, T]``
      (``dot_product_attention``'s ``return_residual``); it carries no
      gradient (``requires_grad`` False).
    query_seq_lengths: ints ``[B]``; query rows at or beyond return 0.
    local_window_size: an int or ``(left, right)``: sliding-window
      attention, as ``jaxattn.dot_product_attention``.
    q_segment_ids, kv_segment_ids: int tensors ``[B, T]`` / ``[B, S]``
      (in either layout): packed sequences, a score is kept only where the
      ids are equal; ``kv_segment_ids`` defaults to ``q_segment_ids``.
    causal_alignment: ``"top_left"`` (torch SDPA's ``is_causal``) or
      ``"bottom_right"`` (the last query sees the last key: chunked
      prefill).

  Returns:
    The output in ``q``'s layout and dtype (float16 for float8 ``q``), on
    ``q``'s device, sharing the memory of jax's result.  ``fmha_int8`` with
    ``return_int8=True`` returns ``(int8 output, float32 scale)``.
  """
  if dropout_p:
    raise NotImplementedError(f"dropout_p={dropout_p}: jaxattn has no dropout")
  compiling = torch.compiler.is_compiling()
  fast_key = None
  if not compiling and (key_value_seq_lengths is None
                        and query_seq_lengths is None
                        and q_segment_ids is None and kv_segment_ids is None):
    # The common call, seen before: its plan from its arguments as given
    try:
      fast_key = (_sig(q), _sig(k), _sig(v), _sig(attn_mask), tensor_layout,
                  method, implementation, sm_scale, is_causal, return_lse,
                  local_window_size, causal_alignment,
                  tuple(options.items()), _trace_context())
      plan = _FAST.get(fast_key)
    except (AttributeError, TypeError, RuntimeError):  # unhashable, say
      fast_key = plan = None
    if plan is not None and not (torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
        or (attn_mask is not None and attn_mask.requires_grad))):
      return _direct_call(plan, (q, k, v, attn_mask, None, None, None), None,
                          options.get("return_int8"), return_lse)
  head = None
  if not compiling:   # a signature checked before is not checked again
    try:
      head = (_sig(q), _sig(k), _sig(v), _sig(attn_mask), tensor_layout,
              _trace_context())
      checked = head in _CHECKED
    except (AttributeError, TypeError, RuntimeError):  # not (dense) tensors
      checked = False
  if compiling or not checked:
    _check(q, k, v, attn_mask, tensor_layout)
    if not compiling:
      head = (_sig(q), _sig(k), _sig(v), _sig(attn_mask), tensor_layout,
              _trace_context())
      _store(_CHECKED, head, True)
  lens = None
  if key_value_seq_lengths is not None:
    lens = _kv_lens(key_value_seq_lengths, k, tensor_layout)
  index = _NO_INDEX
  if (query_seq_lengths is not None or q_segment_ids is not None
      or kv_segment_ids is not None):
    index = _index_tensors(q, tensor_layout, query_seq_lengths,
                           q_segment_ids, kv_segment_ids)
  window = local_window_size
  if isinstance(window, (tuple, list)):
    window = tuple(None if w is None else int(w) for w in window)
  elif window is not None:
    window = int(window)
  scale = None if sm_scale is None else float(sm_scale)
  is_causal = bool(is_causal)
  return_int8 = bool(options.get("return_int8"))
  needs_grad = torch.is_grad_enabled() and (
      q.requires_grad or k.requires_grad or v.requires_grad
      or (attn_mask is not None and attn_mask.requires_grad))

  if return_int8 or not (compiling or needs_grad):
    # No gradient to record: the plan, without the operator's dispatch.
    key = (head, None if lens is None else lens.shape,
           tuple(None if x is None else x.shape for x in index), window,
           causal_alignment, method, implementation, scale, is_causal,
           _options_key(options), bool(return_lse))
    plan = _DIRECT.get(key)
    if plan is None:
      plan = _store(_DIRECT, key, _forward_plan(
          (q, k, v, attn_mask, *index), lens, layout=tensor_layout,
          method=method, implementation=implementation, scale=scale,
          is_causal=is_causal, options=dict(options), window=window,
          alignment=causal_alignment, need_lse=bool(return_lse)))
    if fast_key is not None:
      _store(_FAST, fast_key, plan)
    return _direct_call(plan, (q, k, v, attn_mask, *index), lens, return_int8,
                        return_lse)

  indexed = (index is not _NO_INDEX or window is not None
             or causal_alignment != "top_left")
  need_lse = return_lse or (needs_grad and _needs_lse(
      q.dtype, q.shape[-1], None if attn_mask is None else attn_mask.dtype,
      q.device.type == "cuda", indexed, method))
  op = (torch.ops.jaxattn.attention if needs_grad
        else torch.ops.jaxattn.attention_no_grad)
  out, lse = op(
      q, k, v, attn_mask, None if lens is None else torch.from_numpy(lens),
      *index, tensor_layout, method, implementation, scale, is_causal,
      _encode(options), _encode([window, causal_alignment]), need_lse)
  out = _from_memory_order(out, _memory_order(q))
  return (out, lse.transpose(1, 2)) if return_lse else out


def _clear_plans() -> None:
  """Forgets every signature: the next calls check, trace and compile."""
  for cache in (_CHECKED, _DIRECT, _FAST, _OP_PLANS):
    cache.clear()


def _run(plan, tensors, lens, export):
  """``export(jax outputs, torch stream)`` of ``plan`` on the tensors.  The
  tensors that the inputs view stay referenced until it returns (torch's
  stream then waits for jax's result) or, where it raises, until jax's
  outputs are ready."""
  out, stream, _held = plan(tensors, lens)
  try:
    return export(out, stream)
  except BaseException:
    jax.block_until_ready(out)
    raise


def _export_direct(out, stream, return_int8, return_lse, axes):
  """The outputs as torch tensors, the output permuted back by ``axes``
  from its memory order (``_Plan.out_axes``; None: as it is)."""
  if return_int8:
    return (_permuted(_to_torch(out[0], stream), axes),
            *(_to_torch(x, stream) for x in out[1:]))
  if return_lse:
    return (_permuted(_to_torch(out[0], stream), axes),
            _to_torch(out[1], stream).transpose(1, 2))
  return _permuted(_to_torch(out, stream), axes)


def _direct_call(plan, tensors, lens, return_int8, return_lse):
  """``plan`` on the tensors, its outputs as torch tensors."""
  return _run(plan, tensors, lens, lambda out, stream: _export_direct(
      out, stream, return_int8, return_lse, plan.out_axes))


def _options_key(options: dict):
  """The options as part of a cache key (hashable)."""
  items = tuple(options.items())
  try:
    hash(items)
    return items
  except TypeError:
    return _freeze(options)


def _freeze(value):
  """Options as a hashable key (dicts and lists to tuples)."""
  if isinstance(value, dict):
    return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
  if isinstance(value, list):
    return tuple(_freeze(v) for v in value)
  return value


@torch.compiler.assume_constant_result
def _encode(options) -> str:
  """The options as the operator's string argument (JSON; a constant to
  ``torch.compile``, which does not trace ``json``)."""
  return json.dumps(options, sort_keys=True)


def _decode_index_static(index_static: str):
  """``(local_window_size, causal_alignment)`` from the operator's JSON."""
  window, alignment = json.loads(index_static)
  if isinstance(window, list):
    window = tuple(window)
  return window, alignment


def _integer_tensor(x, name: str, device=None) -> torch.Tensor:
  """``x`` as a tensor (on ``device``), TypeError unless it holds
  integers."""
  x = torch.as_tensor(x, device=device)
  if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
    raise TypeError(f"{name} must hold integers, got {x.dtype}")
  return x


def _kv_lens(key_value_seq_lengths, k, layout) -> np.ndarray:
  """The key lengths as checked int32 numpy ``[B]`` (a value check per
  call: it reads them on the host)."""
  lens = np.asarray(_integer_tensor(
      key_value_seq_lengths, "key_value_seq_lengths").cpu())
  s = k.shape[2 if layout == "HND" else 1]
  if lens.size and (lens.min() < 0 or lens.max() > s):
    raise ValueError(f"key_value_seq_lengths must lie in [0, {s}], got "
                     f"{lens.tolist()}")
  return lens.astype(np.int32)


def _index_tensors(q, layout, query_seq_lengths, q_segment_ids,
                   kv_segment_ids):
  """The index arrays as int32 tensors on ``q``'s device (or None)."""
  out = []
  for name, x in (("query_seq_lengths", query_seq_lengths),
                  ("q_segment_ids", q_segment_ids),
                  ("kv_segment_ids", kv_segment_ids)):
    if x is not None:
      x = _integer_tensor(x, name, device=q.device).to(
          torch.int32).contiguous()
    out.append(x)
  # checked here as key_value_seq_lengths are, except under torch.compile
  # (no data-dependent branch there): jax clips them to [0, T]
  if query_seq_lengths is not None and not torch.compiler.is_compiling():
    t = q.shape[2] if layout == "HND" else q.shape[1]
    lens = out[0].cpu().numpy()
    if lens.size and (lens.min() < 0 or lens.max() > t):
      raise ValueError(f"query_seq_lengths must lie in [0, {t}], got "
                       f"{lens.tolist()}")
  return tuple(out)


def _torch_dtype_to_jax(dtype):
  return jnp.float16 if dtype in _FLOAT8 else jnp.dtype(
      str(dtype).split(".")[1])


_LSE_NEEDS: dict = {}


def _backward_path(dtype, head_dim, mask_dtype, on_gpu, indexed) -> str:
  """Which backward :func:`jaxattn.grad.attention_vjp` will take: "xla"
  needs the forward's log-sum-exp, "cudnn" recomputes its own."""
  return grad.backward_path(
      _torch_dtype_to_jax(dtype), head_dim,
      mask_dtype is not None and mask_dtype != torch.bool,
      mask_dtype == torch.bool, on_gpu=on_gpu, has_index_mask=indexed)


@torch.compiler.assume_constant_result
def _takes_residuals(path: str, method: str) -> bool:
  """(A constant to ``torch.compile``: it inspects jax's cuDNN module.)"""
  return grad.takes_residuals(path, method)


def _keeps_output(dtype, head_dim, mask_dtype, on_gpu, indexed,
                  method) -> bool:
  """Whether the backward takes the forward's output and log-sum-exp as
  its residuals (an exact method), as :func:`jaxattn.dot_product_attention`
  does."""
  return _takes_residuals(
      _backward_path(dtype, head_dim, mask_dtype, on_gpu, indexed), method)


def _needs_lse(dtype, head_dim, mask_dtype, on_gpu, indexed, method) -> bool:
  """Whether the backward takes the forward's log-sum-exp (XLA's, or an
  exact method's residuals); kept per arguments outside torch.compile."""
  key = (dtype, head_dim, mask_dtype, on_gpu, indexed, method)
  if not torch.compiler.is_compiling() and key in _LSE_NEEDS:
    return _LSE_NEEDS[key]
  needs = (_backward_path(dtype, head_dim, mask_dtype, on_gpu, indexed)
           == "xla" or _keeps_output(*key))
  if not torch.compiler.is_compiling():
    _LSE_NEEDS[key] = needs
  return needs


def _op_lens(kv_lens):
  return None if kv_lens is None else np.asarray(kv_lens.cpu(), np.int32)


_INDEX_SCHEMA = "Tensor? q_lens, Tensor? q_segment_ids, Tensor? kv_segment_ids"
_SCHEMA = ("(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? kv_lens, "
           f"{_INDEX_SCHEMA}, str layout, str method, str? implementation, "
           "float? sm_scale, bool is_causal, str options, str index_static, "
           "bool need_lse) -> (Tensor, Tensor)")


def _attention_forward(q, k, v, attn_mask, kv_lens, q_lens, q_segment_ids,
                       kv_segment_ids, layout, method, implementation,
                       sm_scale, is_causal, options, index_static, need_lse):
  """``(output, float32 log-sum-exp [B, T, N] or an empty tensor)``, the
  output contiguous with q's layout's axes in q's memory order
  (:func:`_op_order`: the caller permutes it back, so that an operator's
  outputs are always contiguous, which inductor's stride asserts need);
  ``options``: JSON of the method's options; ``index_static``: JSON
  ``[local_window_size, causal_alignment]``."""
  tensors = (q, k, v, attn_mask, q_lens, q_segment_ids, kv_segment_ids)
  lens = _op_lens(kv_lens)
  key = ("forward", *map(_sig, tensors), None if lens is None else lens.shape,
         layout, method, implementation, sm_scale, is_causal, options,
         index_static, need_lse, _trace_context())
  plan = _OP_PLANS.get(key)
  if plan is None:
    window, alignment = _decode_index_static(index_static)
    plan = _store(_OP_PLANS, key, _forward_plan(
        tensors, lens, layout=layout, method=method,
        implementation=implementation, scale=sm_scale, is_causal=is_causal,
        options=json.loads(options), window=window, alignment=alignment,
        need_lse=need_lse))
  def export(out, stream):
    if need_lse:
      return _to_torch(out[0], stream), _to_torch(out[1], stream)
    return _to_torch(out, stream), q.new_empty((0,), dtype=torch.float32)
  return _run(plan, tensors, lens, export)


def _shapes(q, v, layout):
  b = q.shape[0]
  t, n = (q.shape[2], q.shape[1]) if layout == "HND" else (q.shape[1],
                                                           q.shape[2])
  return (*q.shape[:3], v.shape[3]), (b, t, n)


def _attention_fake(q, k, v, attn_mask, kv_lens, q_lens, q_segment_ids,
                    kv_segment_ids, layout, method, implementation, sm_scale,
                    is_causal, options, index_static, need_lse):
  out_shape, lse_shape = _shapes(q, v, layout)
  dtype = torch.float16 if q.dtype in _FLOAT8 else q.dtype
  return (q.new_empty(_op_order(out_shape, _memory_order(q)), dtype=dtype),
          q.new_empty(lse_shape if need_lse else (0,), dtype=torch.float32))


# The forward twice: ``jaxattn::attention`` carries autograd (its backward
# is registered below); ``jaxattn::attention_no_grad`` is the same call
# without an autograd kernel, for graphs that ``torch.compile`` traced with
# no gradient to record.  A custom_op's autograd kernel is Python that runs
# on every call, gradient or not: on the H200's host the operator without
# it took 331 us a call at 1x8x128x64 against 396 (medians of 5 rounds of
# 300), and a compiled Linear + sageattn 614 against 710.
_attention_op = torch.library.custom_op(
    "jaxattn::attention", _attention_forward, mutates_args=(),
    schema=_SCHEMA)
_attention_op.register_fake(_attention_fake)
_NO_GRAD_LIB = torch.library.Library("jaxattn", "FRAGMENT")
_NO_GRAD_LIB.define("attention_no_grad" + _SCHEMA)
_NO_GRAD_LIB.impl("attention_no_grad", _attention_forward,
                  "CompositeExplicitAutograd")
torch.library.register_fake("jaxattn::attention_no_grad", _attention_fake,
                            lib=_NO_GRAD_LIB)


_BACKWARD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor? attn_mask, Tensor? kv_lens, "
    f"{_INDEX_SCHEMA}, Tensor lse, Tensor dout, Tensor? out, str layout, "
    "float? sm_scale, bool is_causal, str index_static) "
    "-> (Tensor, Tensor, Tensor, Tensor)")


@torch.library.custom_op("jaxattn::attention_backward", mutates_args=(),
                         schema=_BACKWARD_SCHEMA)
def _attention_backward_op(q, k, v, attn_mask, kv_lens, q_lens,
                           q_segment_ids, kv_segment_ids, lse, dout, out,
                           layout, sm_scale, is_causal, index_static):
  """``(dq, dk, dv, dbias)`` shaped like q, k, v and a float attn_mask
  (an empty tensor without one); ``out``, the forward's output as cuDNN's
  residual, or None."""
  tensors = (q, k, v, attn_mask, q_lens, q_segment_ids, kv_segment_ids, lse,
             dout, out)
  lens = _op_lens(kv_lens)
  key = ("backward", *map(_sig, tensors),
         None if lens is None else lens.shape, layout, sm_scale, is_causal,
         index_static, _trace_context())
  plan = _OP_PLANS.get(key)
  if plan is None:
    window, alignment = _decode_index_static(index_static)
    plan = _store(_OP_PLANS, key, _backward_plan(
        tensors, lens, layout=layout, scale=sm_scale, is_causal=is_causal,
        window=window, alignment=alignment))
  bias_order = None if attn_mask is None else _dense_order(attn_mask)

  def export(grads, stream):
    dbias = (q.new_empty((0,)) if grads[3] is None
             else _from_memory_order(_to_torch(grads[3], stream), bias_order))
    return (*(_to_torch(g, stream) for g in grads[:3]), dbias)
  return _run(plan, tensors, lens, export)


@_attention_backward_op.register_fake
def _attention_backward_fake(q, k, v, attn_mask, kv_lens, q_lens,
                             q_segment_ids, kv_segment_ids, lse, dout, out,
                             layout, sm_scale, is_causal, index_static):
  has_bias = attn_mask is not None and attn_mask.dtype != torch.bool
  return (*(x.new_empty(_op_order(x.shape, _memory_order(x)))
            for x in (q, k, v)),
          torch.empty_like(attn_mask) if has_bias else q.new_empty((0,)))


_TOP_LEFT = json.dumps([None, "top_left"], sort_keys=True)


def _setup_context(ctx, inputs, output):
  (q, k, v, attn_mask, kv_lens, q_lens, q_seg, kv_seg, layout, method, _,
   sm_scale, is_causal, _, index_static, _) = inputs
  indexed = (any(x is not None for x in (q_lens, q_seg, kv_seg))
             or index_static != _TOP_LEFT)
  keep = output[1].numel() > 0 and _keeps_output(
      q.dtype, q.shape[-1], None if attn_mask is None else attn_mask.dtype,
      q.device.type == "cuda", indexed, method)
  order = _memory_order(q)   # (the operator's output is in it)
  ctx.save_for_backward(q, k, v, attn_mask, kv_lens, q_lens, q_seg, kv_seg,
                        output[1],
                        _from_memory_order(output[0], order) if keep else None)
  ctx.static = (layout, sm_scale, is_causal, index_static)
  ctx.order = order
  # the backward takes no gradient through the log-sum-exp: a loss on it
  # raises (no grad_fn) rather than getting zeros
  ctx.mark_non_differentiable(output[1])
  ctx.bias = attn_mask is not None and attn_mask.dtype != torch.bool


def _backward(ctx, dout, _):
  q, k, v, attn_mask, kv_lens, q_lens, q_seg, kv_seg, lse, out = \
      ctx.saved_tensors
  layout, sm_scale, is_causal, index_static = ctx.static
  dq, dk, dv, dbias = torch.ops.jaxattn.attention_backward(
      q, k, v, attn_mask, kv_lens, q_lens, q_seg, kv_seg, lse,
      _from_memory_order(dout, ctx.order), out, layout, sm_scale, is_causal,
      index_static)
  dq, dk, dv = (_from_memory_order(g, o) for g, o in (
      (dq, ctx.order), (dk, _memory_order(k)), (dv, _memory_order(v))))
  return (dq, dk, dv, dbias if ctx.bias else None, *(None,) * 12)


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def sageattn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             tensor_layout: str = "HND", is_causal: bool = False,
             sm_scale: float | None = None, smooth_k: bool = True,
             return_lse: bool = False, qk_quant_gran: str | None = None,
             **options) -> torch.Tensor:
  """SageAttention's ``sageattn`` on jaxattn's ``method="sage"``.

  Same arguments and shapes as SageAttention (1.0.6 and 2.x): ``q``
  ``[B, N, T, H]`` ("HND") or ``[B, T, N, H]`` ("NHD"), float16, bfloat16 or
  float32; ``k``, ``v`` with ``K`` heads (``N`` a multiple of ``K``).
  Returns the output in ``q``'s layout and dtype.

  The default algorithm is jaxattn's ``preset="sage2-8b"`` (SageAttention2:
  int8 per-warp QK, fp8 PV); ``preset="sage1"`` is SageAttention 1.0.6's.
  ``smooth_k`` and ``qk_quant_gran`` ("per_warp", "per_block", "per_token",
  "per_tensor") map onto :class:`jaxattn.sage.SageConfig`; other options are
  its fields (``smooth_v``, ``pv_dtype``, ...) or :func:`attention`'s
  (``attn_mask``, ``key_value_seq_lengths``, ``implementation``).
  ``return_lse=True`` also returns the float32 log-sum-exp of each row of
  the scaled scores, ``[B, N, T]`` (natural log), as SageAttention does
  for ring attention: ``(output, lse)``.
  """
  if qk_quant_gran is not None:
    if qk_quant_gran not in _QK_QUANT_GRAN:
      raise ValueError(f"qk_quant_gran must be one of {tuple(_QK_QUANT_GRAN)}"
                       f", got {qk_quant_gran!r}")
    options["qk_granularity"] = _QK_QUANT_GRAN[qk_quant_gran]
  return attention(q, k, v, method="sage", tensor_layout=tensor_layout,
                   is_causal=is_causal, sm_scale=sm_scale, smooth_k=smooth_k,
                   return_lse=return_lse, **options)

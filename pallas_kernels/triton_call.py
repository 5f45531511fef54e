"""Triton kernels called from JAX: through ``jax_triton`` on a GPU, through
Triton's interpreter on the CPU.

Pallas's Triton backend is deprecated since jax 0.11.0, so the kernels
written since then are plain ``@triton.jit`` functions.  :func:`launch`
runs one: on a GPU with ``jax_triton.triton_call`` (one custom call,
compiled for the device when jax lowers it); without a GPU as a
``jax.pure_callback`` that runs the same function in Triton's interpreter
(numpy semantics, one program at a time) on the host, which is how CI tests
the kernels.  The interpreter runs no inline PTX and no libdevice calls, so
the kernels use neither: where the GPU has a faster instruction for the
same value they say so.

Outputs are allocated by the caller of the kernel: on the GPU
``jax_triton`` hands fresh (uninitialised) buffers to the kernel, and in the
interpreter they are filled with a poison pattern first (NaN for floats,
the most negative value for integers), so a test that compares every
element catches an element the kernel did not write.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.abc
import os
import sys
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import common

# The interpreter and the module patches it needs are process-global: the
# callbacks of several devices (a mesh of CPU devices) take turns.
_LOCK = threading.RLock()


class _NoTriton:
  """Stands in for ``triton`` where it is not installed (jax without a
  GPU and without torch): kernel modules still import, their functions are
  plain Python, and :func:`launch` says what is missing."""
  jit = staticmethod(lambda fn=None, **_: fn if fn else (lambda f: f))

  class language:  # noqa: N801 (the module's name)
    constexpr = staticmethod(lambda value=None: value)


try:
  import triton
  import triton.language as tl
except ImportError:  # pragma: no cover (the test extra brings triton)
  triton = _NoTriton
  tl = _NoTriton.language


def launch(kernel, *args, out_shape, grid, num_warps: int = 4,
           num_stages: int = 2, enable_fp_fusion: bool = False,
           **constexprs):
  """``kernel[grid](*args, *outputs, **constexprs)``; returns the outputs.

  Args:
    kernel: a ``@triton.jit`` function whose parameters are ``args`` (jax
      arrays, passed as pointers; Python ints and floats, passed as
      scalars), then one pointer per output, then the ``constexprs``
      (``jax_triton``'s convention).
    out_shape: a ``jax.ShapeDtypeStruct`` or a tuple of them.
    grid: up to three ints.
    num_warps, num_stages: Triton's knobs (GPU only).
    enable_fp_fusion: let the compiler contract ``a * b + c`` into an FMA.
      Off by default: the kernels' references round each operation, as the
      interpreter does.
  """
  if triton is _NoTriton:
    raise NotImplementedError(
        "jaxattn's Triton kernels need the triton package (pip install "
        "'jaxattn[gpu]' on a GPU, or torch, which brings it, for the "
        "interpreter); implementation='reference' runs without it")
  single = isinstance(out_shape, jax.ShapeDtypeStruct)
  shapes = (out_shape,) if single else tuple(out_shape)
  grid = tuple(int(g) for g in grid)
  # (jax_triton passes a Python float as float64; the kernels take float32)
  args = tuple(np.float32(a) if isinstance(a, float) else a for a in args)
  if any(g == 0 for g in grid):
    raise ValueError(f"empty grid {grid}")
  for target, compiled in _COMPILE_TARGETS:
    compiled.append(_compile(kernel, args, shapes, target, num_warps,
                             num_stages, enable_fp_fusion, constexprs))
  if common.has_gpu():
    _compile_ahead().submit(kernel, args, shapes, num_warps, num_stages,
                            enable_fp_fusion, constexprs)
    outs = jax_triton().triton_call(
        *args, kernel=kernel, out_shape=shapes, grid=grid,
        num_warps=num_warps, num_stages=num_stages,
        enable_fp_fusion=enable_fp_fusion, **constexprs)
  else:
    outs = _interpret(kernel, args, shapes, grid, constexprs)
  return outs[0] if single else tuple(outs)


_COMPILE_TARGETS: list = []   # (GPU target, compiled kernels), innermost last
_TRITON_TYPES = {"int8": "i8", "uint8": "u8", "int16": "i16", "int32": "i32",
                 "int64": "i64", "float16": "fp16", "bfloat16": "bf16",
                 "float32": "fp32", "float8_e4m3fn": "fp8e4nv",
                 "float8_e5m2": "fp8e5", "bool": "i1"}


@contextlib.contextmanager
def compiling_for(target):
  """Within it, every :func:`launch` is also compiled by Triton for
  ``target``, a ``triton.backends.compiler.GPUTarget`` such as
  ``GPUTarget("cuda", 90, 32)``, with the argument types, knobs and
  constexprs of the launch, and the kernels' callers pick a GPU's static
  flags (:func:`common.interpret` is False): CI has no GPU, and the
  interpreter runs code that a GPU's compiler refuses (Triton's 8-bit dots
  need 32 channels, say).  For tracing (``jax.eval_shape``), not for
  running: the interpreter cannot run the GPU's inline PTX.  Yields the
  list of compiled kernels; a kernel that does not compile raises."""
  compiled: list = []
  _COMPILE_TARGETS.append((target, compiled))
  common.GPU_FLAGS_WITHOUT_GPU.append(target)
  try:
    yield compiled
  finally:   # (contexts nest: ours are the last)
    _COMPILE_TARGETS.pop()
    common.GPU_FLAGS_WITHOUT_GPU.pop()


def _compile(kernel, args, shapes, target, num_warps, num_stages,
             enable_fp_fusion, constexprs):
  """``kernel`` compiled for ``target``: arrays (or tracers) as pointers
  of their dtype (16-byte aligned), then the outputs' pointers, scalars
  as ``i32`` / ``i64`` / ``fp32``, the constexprs by name.  (jax_triton
  also makes a scalar equal to 1 a constant; this does not.)"""
  from triton.compiler import ASTSource  # (only where this is used)
  types = []
  for a in args:
    if _is_array(a):
      types.append("*" + _TRITON_TYPES[np.dtype(a.dtype).name])
    elif isinstance(a, (float, np.floating)):
      types.append("fp32")
    else:
      types.append("i32" if -2**31 <= int(a) < 2**31 else "i64")
  types += ["*" + _TRITON_TYPES[np.dtype(s.dtype).name] for s in shapes]
  names = kernel.arg_names
  signature = {n: types[i] if i < len(types) else "constexpr"
               for i, n in enumerate(names)}
  # jax_triton specialises every array as 16-byte aligned: without it the
  # loads would not vectorise, and the code would not be the GPU's
  attrs = {(i,): [["tt.divisibility", 16]]
           for i, t in enumerate(types) if t.startswith("*")}
  return triton.compile(
      ASTSource(kernel, signature, dict(constexprs), attrs), target=target,
      options=dict(num_warps=num_warps, num_stages=num_stages,
                   enable_fp_fusion=enable_fp_fusion))


_JAX_TRITON = []


def jax_triton():
  """The ``jax_triton`` module, imported without its side effect on the
  process: its import sets ``TRITON_CACHE_DIR`` to "", which turns off
  Triton's on-disk cache for everything else in the process (then
  ``torch.compile`` and any other Triton user fail with "Could not create
  or locate cache dir").  jax_triton keeps its kernels in memory and does
  not need that setting."""
  if not _JAX_TRITON:
    saved = os.environ.get("TRITON_CACHE_DIR")
    import jax_triton as module   # pylint: disable=import-outside-toplevel
    if saved is None:
      os.environ.pop("TRITON_CACHE_DIR", None)
    else:
      os.environ["TRITON_CACHE_DIR"] = saved
    _JAX_TRITON.append(module)
  return _JAX_TRITON[0]


class CompileAhead:
  """Compiles a launch's kernel on a worker thread from the moment it is
  traced, for ``jax_triton``'s lowering to take.

  ``jax_triton`` compiles each launch when jax lowers it (Triton's AST ->
  TTIR -> TTGIR -> LLVM -> PTX, about 0.5 s a kernel, most of it in MLIR
  and LLVM passes that release the GIL), one launch after another: a
  quantized method's five to twelve kernels made most of its first call.
  A call traces all its launches before jax lowers any, so each launch
  starts its compile here, with the arguments the lowering will pass, and
  the lowering's ``get_or_create_triton_kernel`` (wrapped by this object)
  waits for that compile instead of starting its own.  A compile that
  fails raises at the lowering, as it would have.  (PTX -> cubin happens at
  the first launch, inside jaxlib, behind one lock: not sped up here.)

  Args:
    lib: ``jax_triton.triton_lib`` (or a stand-in with its
      ``get_or_create_triton_kernel``, ``get_cuda_backend`` and
      ``get_triton_type``); its ``get_or_create_triton_kernel`` is wrapped.
    workers: compile threads.
  """

  def __init__(self, lib, workers: int):
    self.lib = lib
    self.compile = lib.get_or_create_triton_kernel
    self.pool = concurrent.futures.ThreadPoolExecutor(
        workers, thread_name_prefix="jaxattn-triton-compile")
    self.pending: dict = {}
    self.lock = threading.Lock()
    lib.get_or_create_triton_kernel = self.get_or_create

  @staticmethod
  def key(platform, fn, arg_dtypes, scalar_args, num_warps, num_stages,
          num_ctas, compute_capability, enable_fp_fusion, metaparams, dump):
    """What the compiled kernel depends on: a scalar's value only by
    whether it is 1 or None (as jax_triton specialises), so that a call
    that differs in a scalar finds the kernel compiled."""
    scalars = tuple((i, t, v is None, v is not None and v == 1)
                    for i, t, v in scalar_args)
    return (platform, fn, tuple(arg_dtypes), scalars, num_warps, num_stages,
            num_ctas, compute_capability, enable_fp_fusion,
            tuple(sorted(metaparams.items())), dump)

  def get_or_create(self, backend_init_func, platform, fn, arg_dtypes,
                    scalar_args, **options):
    """``get_or_create_triton_kernel``: the compile started at trace time
    (taken once: a later request finds jax_triton's own cache, and a
    failure is not kept), else the original."""
    try:
      key = self.key(platform, fn, arg_dtypes, scalar_args, **options)
    except TypeError:   # (a jax_triton whose arguments moved: its own path)
      key = None
    with self.lock:
      future = self.pending.pop(key, None)
    if future is not None:
      return future.result()
    return self.compile(backend_init_func, platform, fn, arg_dtypes,
                        scalar_args, **options)

  def submit(self, kernel, args, shapes, num_warps, num_stages,
             enable_fp_fusion, constexprs) -> None:
    """Starts the compile the lowering of ``jax_triton.triton_call(*args,
    kernel=kernel, ...)`` will ask for: arrays (inputs, then outputs) by
    their Triton pointer type, Python scalars in place, ``num_ctas=1``,
    the device's compute capability."""
    get_type = self.lib.get_triton_type
    arg_dtypes, scalar_args = [], []
    for i, a in enumerate(args):   # (as triton_call splits its arguments)
      if isinstance(a, (bool, int, float, np.float32)):
        scalar_args.append((i, get_type(a), a))
        arg_dtypes.append(get_type(a))
      else:   # (jax binds a numpy float64 array as float32)
        arg_dtypes.append(get_type(jax.core.ShapedArray(
            a.shape, jax.dtypes.canonicalize_dtype(a.dtype))))
    arg_dtypes += [get_type(jax.core.ShapedArray(
        s.shape, jax.dtypes.canonicalize_dtype(s.dtype))) for s in shapes]
    options = dict(num_warps=num_warps, num_stages=num_stages, num_ctas=1,
                   compute_capability=None,
                   enable_fp_fusion=enable_fp_fusion,
                   metaparams=dict(sorted(constexprs.items())), dump=False)
    key = self.key("cuda", kernel, arg_dtypes, tuple(scalar_args), **options)
    with self.lock:
      if key not in self.pending:
        self.pending[key] = self.pool.submit(
            self.compile, self.lib.get_cuda_backend, "cuda", kernel,
            arg_dtypes, tuple(scalar_args), **options)


_COMPILE_AHEAD: list = []


class _RefusedOnThisThread(importlib.abc.MetaPathFinder):
  """An import finder that refuses the module ``name`` to the thread that
  made it; other threads import it as usual."""

  def __init__(self, name: str):
    self.name, self.thread = name, threading.get_ident()

  def find_spec(self, fullname, path=None, target=None):
    if fullname == self.name and threading.get_ident() == self.thread:
      raise ModuleNotFoundError(f"{fullname} is not imported by this "
                                "thread", name=fullname)
    return None


def init_specialize_without(libtriton, module: str = "torch") -> None:
  """Runs Triton's one-time set-up of its native argument specialisation
  (``libtriton.native_specialize_impl``, which jax_triton calls for each
  compile) with ``module`` refused to this thread.

  That set-up imports torch, only to look up ``torch.Tensor`` for a fast
  path: about 4 s of a JAX process's first Triton compile on the H200's
  host, for a class jax never passes, and every compile worker waits on
  the import.  Without it Triton specialises a torch tensor by its
  ``data_ptr`` attribute, as it does any tensor type (the same result), so
  a torch user loses one dict lookup per argument.  A process that has
  imported ``module`` is left as it is; a set-up that fails leaves the
  error to the compile that needs it."""
  specialize = getattr(libtriton, "native_specialize_impl", None)
  if specialize is None or module in sys.modules:
    return
  finder = _RefusedOnThisThread(module)
  sys.meta_path.insert(0, finder)
  try:   # (an int argument: the backend is not read)
    specialize(None, 2, False, False, False)
  except Exception:  # noqa: BLE001  (the compile raises it again)
    pass
  finally:
    sys.meta_path.remove(finder)


def _compile_ahead() -> CompileAhead:
  with _LOCK:
    if not _COMPILE_AHEAD:
      try:   # pylint: disable-next=import-outside-toplevel
        from triton._C import libtriton
      except ImportError:   # (a Triton built otherwise: nothing to set up)
        libtriton = None
      init_specialize_without(libtriton)
      _COMPILE_AHEAD.append(CompileAhead(
          sys.modules[jax_triton().__name__ + ".triton_lib"],
          workers=min(8, os.cpu_count() or 1)))
    return _COMPILE_AHEAD[0]


def _is_array(x) -> bool:
  return (hasattr(x, "shape") and hasattr(x, "dtype")
          and not isinstance(x, np.generic))


def _interpret(kernel, args, shapes, grid, constexprs):
  """:func:`launch` on the host, in Triton's interpreter."""
  positions = [i for i, a in enumerate(args) if _is_array(a)]
  arrays = [jnp.asarray(args[i]) for i in positions]

  def host(*values):
    # (the interpreter takes scalars as Python numbers, floats as float32)
    with _LOCK:   # one at a time: see _run_interpreted
      full = [a.item() if isinstance(a, np.generic) else a for a in args]
      for i, x in zip(positions, values):
        full[i] = _to_torch(np.asarray(x))
      outs = [_poisoned(s) for s in shapes]
      _run_interpreted(kernel, grid, full + outs, constexprs)
      return tuple(np.array(_to_numpy(o, s.dtype)) for o, s in
                   zip(outs, shapes))

  return jax.pure_callback(host, tuple(shapes), *arrays)


def _torch():
  try:
    import torch
  except ImportError as e:  # pragma: no cover (the test extra has torch)
    raise NotImplementedError(
        "the Triton kernels run without a GPU only in Triton's interpreter, "
        "which needs torch; install jaxattn[torch] or use "
        "implementation='reference'") from e
  return torch


def _torch_dtype(dtype):
  torch = _torch()
  return {
      "float16": torch.float16, "bfloat16": torch.bfloat16,
      "float32": torch.float32, "int8": torch.int8, "uint8": torch.uint8,
      "int16": torch.int16, "int32": torch.int32, "int64": torch.int64,
      "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
      "bool": torch.bool,
  }[np.dtype(dtype).name]


def _to_torch(x: np.ndarray):
  """A CPU tensor with ``x``'s values (bfloat16 / float8 by their bits)."""
  torch = _torch()
  x = np.ascontiguousarray(x)
  name = x.dtype.name
  if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
    bits = x.view(np.int16 if name == "bfloat16" else np.uint8)
    return torch.from_numpy(bits.copy()).view(_torch_dtype(x.dtype))
  return torch.from_numpy(x.copy())


def _to_numpy(t, dtype):
  dtype = np.dtype(dtype)
  torch = _torch()
  if dtype.name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
    bits = torch.int16 if dtype.name == "bfloat16" else torch.uint8
    return t.view(bits).numpy().view(dtype)
  return t.numpy()


def _poisoned(shape: jax.ShapeDtypeStruct):
  torch = _torch()
  dtype = np.dtype(shape.dtype)
  t = torch.empty(shape.shape, dtype=_torch_dtype(dtype))
  if jnp.issubdtype(dtype, jnp.floating):
    t.fill_(float("nan"))
  elif dtype == np.bool_:
    t.fill_(True)
  else:
    t.fill_(int(np.iinfo(dtype).min))
  return t


@contextlib.contextmanager
def _interpreted(modules):
  """Every ``@triton.jit`` function of ``modules`` (Triton's language and
  the kernel's own module) as an interpreted function while the kernel
  runs: ``tl.max``, ``tl.sum`` and the kernel's helpers are ``JITFunction``
  objects unless Triton was imported in interpret mode, and the
  interpreter can only call interpreted ones."""
  import triton.language as tl
  from triton.runtime import interpreter
  from triton.runtime.interpreter import InterpretedFunction
  from triton.runtime.jit import JITFunction
  saved = []
  builder = interpreter.interpreter_builder
  dot = builder.create_dot

  def create_dot(a, b, d, *rest):
    # The interpreter keeps bfloat16 as its bits (numpy has no bfloat16)
    # and would multiply the bits: widen them to float32 (exact products).
    widen = lambda x: interpreter.TensorHandle(
        (x.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
    if a.dtype == tl.bfloat16:
      a = widen(a)
    if b.dtype == tl.bfloat16:
      b = widen(b)
    return dot(a, b, d, *rest)

  class Nested(InterpretedFunction):
    """A device function called from the kernel: the language is patched
    once for the whole launch below, where Triton's own re-patches it on
    every call (``inspect.getmembers`` over its modules: about 1 ms a
    call, seconds a test)."""

    def __call__(self, *args, **kwargs):
      try:
        return self.rewrite()(*args, **kwargs)
      except Exception as e:
        raise interpreter.InterpreterError(repr(e)) from e

  scopes = []
  try:
    saved.append((builder, "create_dot", dot))
    builder.create_dot = create_dot
    for mod in modules:
      for name, value in list(vars(mod).items()):
        if isinstance(value, JITFunction):
          saved.append((mod, name, value))
          setattr(mod, name, Nested(value.fn))
    for mod in modules:   # (patches the languages its functions see)
      if any(v is tl or v is tl.core for v in vars(mod).values()):
        scopes.append(interpreter._patch_lang(
            types.SimpleNamespace(__globals__=vars(mod))))
    yield
  finally:
    for scope in reversed(scopes):
      scope.restore()
    for mod, name, value in saved:
      setattr(mod, name, value)


def _run_interpreted(kernel, grid, args, constexprs):
  import triton  # noqa: F401
  # (gluon's module asserts at import that its helpers are jitted; import
  # it before they are swapped for interpreted ones)
  import triton.experimental.gluon.language  # noqa: F401
  from triton.runtime.interpreter import InterpretedFunction
  fn = getattr(kernel, "fn", kernel)
  modules = [m for n, m in list(sys.modules.items())
             if n == "triton.language" or n.startswith("triton.language.")]
  modules.append(sys.modules[fn.__module__])
  with _interpreted(modules):
    InterpretedFunction(fn)[grid](*args, **constexprs)

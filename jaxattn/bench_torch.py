"""Host time per call of jaxattn.torch against the jitted JAX call.

Also torch SDPA and SageAttention2's own ``sageattn`` on the same inputs,
and ``torch.compile`` of a small module against eager; JSON out, a table
last.

    python -m jaxattn bench --torch [--out F.json] [--calls 300]
        [--rounds 3] [--row-timeout 300]

Each row times ``--rounds`` rounds of back-to-back calls (``--calls`` at the
tiny shape, fewer at the large ones: about 0.3 s a round) after warm-up,
with ``time.perf_counter`` around the loop and the device synchronised at
its end (``torch.cuda.synchronize``, ``jax.block_until_ready``), and keeps
the best round; the rounds of the rows of one comparison alternate, each
after a 50 ms pause.
``host_us`` is that time per call; ``overhead_us`` the shim's minus the
jitted JAX call's (``jax.jit`` of the same transposes and
``jaxattn.dot_product_attention`` on jax arrays sharing the tensors'
memory); at the tiny shape also with ``FRESH_SETS`` input sets in turn,
more buffers than a CUDA plan keeps views of (every call imports anew,
the case of buffers the plan has not seen).
``thread_us`` (and ``overhead_thread_us``) is the calling
thread's CPU time per call over the same rounds: the host's work without
the waits, which other processes on a shared machine disturb less (on a
GPU it includes the final synchronisation's spin).  On the CPU a torch output is ready when the call returns, so the
JAX call is timed with ``block_until_ready`` per call there
(``jax_async_us``: synchronised at the end of the loop only).  On a GPU
``gpu_us`` is the GPU time per call over one round from CUDA events on
torch's stream (torch rows, and jaxattn.torch's, whose output torch's
stream waits for) and ``device_us`` jax's kernels per call from its
profiler (:func:`jaxattn.timing.device_period_ms`; jax rows).

GPU (B x H x S x D, HND, float16): the tiny 1x8x128x64 for every method,
then ``sageattn`` and ``fp8`` at 2x24x4096x64 (image DiT), 1x48x17776x64
(video DiT), 1x32x8192x128 causal (LLM prefill) and 8x32x1024x128 causal
(batched prompts), each on contiguous inputs and on views of ``[B, S, H,
D]`` buffers (rows marked "(views)": what a model's ``x.view(B, S, H,
D).transpose(1, 2)`` passes), and ``torch.compile(fullgraph=True)`` of
``Linear + sageattn`` against eager at 2x24x4096x64 and 1x32x8192x128
causal.  CPU: the tiny 1x2x16x16 (float32, torch on one thread) on the
reference path for every method, and compile against eager at it.

A row that fails records its error; a row that outlives ``--row-timeout``
is stopped (an exception in Python; where it hangs outside Python, the
whole run, after writing what was measured).
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import signal
import sys
import threading
import time
import traceback
import warnings

import jax
import jax.numpy as jnp

import jaxattn
import jaxattn.torch as jt
from jaxattn.timing import device_period_ms

GPU_TINY = (1, 8, 128, 64)
GPU_LARGE = [((2, 24, 4096, 64), False, "image DiT"),
             ((1, 48, 17776, 64), False, "video DiT"),
             ((1, 32, 8192, 128), True, "LLM prefill"),
             ((8, 32, 1024, 128), True, "batched prompts")]
GPU_COMPILE = [((2, 24, 4096, 64), False), ((1, 32, 8192, 128), True)]
CPU_TINY = (1, 2, 16, 16)
ROUND_SECONDS = 0.3   # a round at the large shapes lasts about this long
FRESH_SETS = 96       # tiny shape: input sets in turn, > a plan's views
PAUSE_SECONDS = 0.05  # before each round
HUNG_EXIT_CODE = 3


class RowTimeout(Exception):
  pass


class SkipRow(Exception):
  """A peer that is not installed: the row is skipped, not an error."""


class Watchdog:
  """Stops a row that outlives its time: SIGALRM raises RowTimeout in the
  main thread (Python loops), and past a grace period a thread writes what
  was measured and exits the process (a call stuck outside Python)."""

  def __init__(self, seconds, on_hang, grace=60.0):
    self.seconds, self.on_hang, self.grace = seconds, on_hang, grace
    self.deadline, self.name = None, None
    self.alarm = hasattr(signal, "SIGALRM")
    if self.alarm:
      signal.signal(signal.SIGALRM, self._raise)
    threading.Thread(target=self._watch, daemon=True).start()

  def _raise(self, *_):
    raise RowTimeout(f"row ran past {self.seconds:.0f} s")

  def _watch(self):
    while True:
      time.sleep(1.0)
      deadline = self.deadline
      if deadline is not None and time.monotonic() > deadline + self.grace:
        self.on_hang(self.name)
        os._exit(HUNG_EXIT_CODE)  # pylint: disable=protected-access

  def start(self, name):
    self.name = name
    self.deadline = time.monotonic() + self.seconds
    if self.alarm:
      signal.setitimer(signal.ITIMER_REAL, self.seconds)

  def stop(self):
    if self.alarm:
      signal.setitimer(signal.ITIMER_REAL, 0)
    self.deadline = None


class Bench:
  """The run: its device, rows, JSON document and watchdog."""

  def __init__(self, args):
    import torch  # pylint: disable=import-outside-toplevel
    self.torch = torch
    self.args = args
    self.gpu = (torch.cuda.is_available()
                and any(d.platform == "gpu" for d in jax.devices()))
    self.device = torch.device("cuda" if self.gpu else "cpu")
    # float16 on the GPU; float32 on the CPU, where torch's float16 kernels
    # (SDPA, Linear) take a slow path
    self.dtype = torch.float16 if self.gpu else torch.float32
    if not self.gpu:
      # torch's OpenMP workers spin after each parallel region (SDPA, the
      # Linear); on a small CPU they would take the cores from XLA's worker
      # in the rounds that follow, which then time the contention
      torch.set_num_threads(1)
    self.rows = []
    dev = jax.devices()[0]
    self.doc = dict(
        meta=dict(
            benchmark="jaxattn.bench_torch", mode="gpu" if self.gpu else "cpu",
            device=(torch.cuda.get_device_name(0) if self.gpu
                    else platform.processor() or platform.machine()),
            jax_device=getattr(dev, "device_kind", str(dev)),
            jax=jax.__version__, torch=torch.__version__,
            python=platform.python_version(), host=platform.node(),
            cpu_count=os.cpu_count(), calls=args.calls, rounds=args.rounds,
            loadavg_start=_loadavg(),
            dtype=str(self.dtype).replace("torch.", ""), layout="HND",
            torch_threads=torch.get_num_threads(),
            date=datetime.datetime.now().isoformat(timespec="seconds"),
            command=" ".join(["python -m jaxattn bench --torch"]
                             + list(args.argv))),
        rows=self.rows)
    self.watchdog = Watchdog(args.row_timeout, self._hung)

  # --- recording --------------------------------------------------------

  def _hung(self, name):
    self.rows.append(dict(name=name, error=f"hung: no return within "
                          f"{self.args.row_timeout:.0f} s + grace; run "
                          "stopped"))
    self.finish()

  def finish(self):
    self.doc["meta"]["loadavg_end"] = _loadavg()
    summary = summarise(self.rows)
    self.doc["summary"] = summary
    if self.args.out:
      os.makedirs(os.path.dirname(self.args.out) or ".", exist_ok=True)
      with open(self.args.out, "w") as f:
        json.dump(self.doc, f, indent=1)
    print(format_table(self.rows, summary), flush=True)
    if self.args.out:
      print(f"wrote {self.args.out}", flush=True)

  def run_rows(self, specs):
    """Runs rows that compare with one another: ``specs`` are ``(row,
    setup)``, ``setup()`` -> ``(fn, sync, extra)``; rounds alternate
    between the rows.  Each row's fields are filled in place; an error or
    a timeout is recorded on its row."""
    ready = []
    for row, setup in specs:
      self.rows.append(row)
      try:
        self.watchdog.start(row["name"])
        fn, sync, calls = self._prepare(setup)
        ready.append((row, fn, sync, calls, []))
      except BaseException as e:  # pylint: disable=broad-except
        self._error(row, e)
      finally:
        self.watchdog.stop()
    for _ in range(self.args.rounds):
      for row, fn, sync, calls, times in ready:
        if "error" in row:
          continue
        # a pause: XLA's and torch's worker threads spin a while after
        # their last task, and would take the cores from the next round
        time.sleep(PAUSE_SECONDS)
        try:
          self.watchdog.start(row["name"])
          times.append(self._round(fn, sync, calls))
        except BaseException as e:  # pylint: disable=broad-except
          self._error(row, e)
        finally:
          self.watchdog.stop()
    for row, fn, sync, calls, times in ready:
      if times and "error" not in row:
        row["calls"] = calls
        row["host_us"] = round(min(t for t, _ in times) * 1e6, 2)
        row["rounds_us"] = [round(t * 1e6, 2) for t, _ in times]
        row["thread_us"] = round(min(c for _, c in times) * 1e6, 2)
        try:
          self.watchdog.start(row["name"])
          self._device_times(row, fn, sync, calls)
        except BaseException as e:  # pylint: disable=broad-except
          if isinstance(e, KeyboardInterrupt):
            raise
          row["device_error"] = f"{type(e).__name__}: {e}"[:300]
        finally:
          self.watchdog.stop()
        print(f"  {row['name']} {row['shape']}: {row['host_us']} us/call",
              flush=True)
    return [row for row, _ in specs]

  def _error(self, row, e):
    if isinstance(e, KeyboardInterrupt):
      raise e
    if isinstance(e, SkipRow):
      row["skipped"] = str(e)[:300]
      row["error"] = "skipped"   # (not timed; not counted as an error)
      print(f"  {row['name']}: skipped ({row['skipped']})", flush=True)
      return
    row["error"] = f"{type(e).__name__}: {e}"[:400]
    if self.args.verbose:
      traceback.print_exc()
    print(f"  {row['name']}: {row['error']}", file=sys.stderr, flush=True)

  def _prepare(self, setup):
    fn, sync, kind = setup()
    for _ in range(3):    # compilation and warm-up
      out = fn()
    sync(out)
    if kind == "tiny":
      return fn, sync, self.args.calls
    t0 = time.perf_counter()
    out = fn()
    sync(out)
    once = time.perf_counter() - t0
    return fn, sync, max(5, min(self.args.calls, int(ROUND_SECONDS / once)))

  @staticmethod
  def _round(fn, sync, calls):
    """Seconds per call: wall-clock, and this thread's CPU time (the host
    work without the waits, which other processes on the machine disturb
    less)."""
    c0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(calls):
      out = fn()
    sync(out)
    return ((time.perf_counter() - t0) / calls,
            (time.thread_time() - c0) / calls)

  def _device_times(self, row, fn, sync, calls):
    if not self.gpu:
      return
    torch = self.torch
    if row["kind"] in ("jaxattn.torch", "sdpa", "sageattention", "compile",
                       "eager"):
      start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
      torch.cuda.synchronize()
      start.record()
      for _ in range(calls):
        out = fn()
      end.record()
      sync(out)
      row["gpu_us"] = round(start.elapsed_time(end) * 1e3 / calls, 2)
    if row["kind"] == "jax":
      ms = device_period_ms(fn, ())
      row["device_us"] = None if ms is None else round(ms * 1e3, 2)

  # --- the rows ---------------------------------------------------------

  def sync_torch(self, out):
    del out
    if self.gpu:
      self.torch.cuda.synchronize()

  def inputs(self, shape, seed=0, views=False):
    """Three ``[B, H, S, D]`` tensors: contiguous, or (``views``) views of
    ``[B, S, H, D]`` buffers, as a model's ``x.view(B, S, H, D)
    .transpose(1, 2)`` passes them."""
    torch = self.torch
    g = torch.Generator(device=self.device).manual_seed(seed)
    if views:
      b, h, s, d = shape
      return tuple(torch.randn((b, s, h, d), generator=g, device=self.device,
                               dtype=self.dtype).transpose(1, 2)
                   for _ in range(3))
    return tuple(torch.randn(shape, generator=g, device=self.device,
                             dtype=self.dtype) for _ in range(3))

  def compare(self, label, shape, causal, method, jax_kw, tiny, peers=True,
              views=False):
    """Rows of one shape and method: jaxattn.torch, the jitted JAX call on
    the same inputs (and, on the CPU, the same synchronised per call), and
    (``peers``) SDPA and SageAttention2; on contiguous ``[B, H, S, D]``
    inputs, or (``views``) on views of ``[B, S, H, D]`` buffers, where the
    jitted call takes the buffers as they are."""
    torch = self.torch
    kind = "tiny" if tiny else "large"
    q, k, v = self.inputs(shape, views=views)
    base = dict(shape="x".join(map(str, shape)), causal=causal,
                method=method, label=label,
                inputs="BSHD views" if views else "contiguous")
    suffix = " (views)" if views else ""
    shim_name = "sageattn" if method == "sage" else "attention"

    def shim():
      if shim_name == "sageattn":
        return lambda: jt.sageattn(q, k, v, is_causal=causal, **jax_kw), \
            self.sync_torch, kind
      return lambda: jt.attention(q, k, v, method=method, is_causal=causal,
                                  **jax_kw), self.sync_torch, kind

    def jax_call(per_call_sync):
      def setup():
        arrays = tuple(jax.dlpack.from_dlpack(x.transpose(1, 2) if views
                                              else x) for x in (q, k, v))
        opts = dict(jax_kw)
        if method == "sage":   # what sageattn passes
          opts.setdefault("smooth_k", True)
        t = ((lambda x: x) if views
             else (lambda x: jnp.transpose(x, (0, 2, 1, 3))))

        @jax.jit
        def f(q, k, v):
          return t(jaxattn.dot_product_attention(
              t(q), t(k), t(v), is_causal=causal, method=method, **opts))

        if per_call_sync:
          return (lambda: f(*arrays).block_until_ready()), (lambda o: o), kind
        return (lambda: f(*arrays)), jax.block_until_ready, kind
      return setup

    def shim_fresh():
      # more input sets than a plan keeps views of: every call's buffers
      # are new to it, as on a first pass over a model's layers
      sets = [self.inputs(shape, seed) for seed in range(FRESH_SETS)]
      turn = iter(range(1 << 62))
      call = jt.sageattn if shim_name == "sageattn" else functools.partial(
          jt.attention, method=method)
      return (lambda: call(*sets[next(turn) % FRESH_SETS], is_causal=causal,
                           **jax_kw)), self.sync_torch, kind

    specs = [(dict(base, name=f"jaxattn.torch.{shim_name} {method}{suffix}",
                   kind="jaxattn.torch"), shim),
             (dict(base, name=f"jax.jit {method}{suffix}", kind="jax"),
              jax_call(not self.gpu))]
    if tiny:
      specs.append((dict(base, name=f"  {FRESH_SETS} input sets in turn",
                         kind="jaxattn.torch.fresh"), shim_fresh))
    if not self.gpu:
      specs.append((dict(base, name=f"jax.jit {method} (async){suffix}",
                         kind="jax_async"), jax_call(False)))
    if peers:
      specs.append((dict(base, name=f"torch sdpa{suffix}", kind="sdpa"),
                    lambda: (lambda: torch.nn.functional
                             .scaled_dot_product_attention(
                                 q, k, v, is_causal=causal),
                             self.sync_torch, kind)))
      if self.gpu:
        specs.append((dict(base, name=f"sageattention.sageattn{suffix}",
                           kind="sageattention"), self._sageattention(
                               q, k, v, causal, kind)))
    with torch.no_grad():
      rows = self.run_rows(specs)
    shim_row, jax_row = rows[0], rows[1]
    if "host_us" in shim_row and "host_us" in jax_row:
      shim_row["jax_us"] = jax_row["host_us"]
      shim_row["overhead_us"] = round(shim_row["host_us"]
                                      - jax_row["host_us"], 2)
      shim_row["overhead_thread_us"] = round(shim_row["thread_us"]
                                             - jax_row["thread_us"], 2)
    for row in rows[2:]:
      if row.get("kind") == "jaxattn.torch.fresh" and "host_us" in row \
          and "host_us" in jax_row:
        row["overhead_us"] = round(row["host_us"] - jax_row["host_us"], 2)
        row["overhead_thread_us"] = round(row["thread_us"]
                                          - jax_row["thread_us"], 2)
      if row.get("kind") == "jax_async" and "host_us" in row:
        shim_row["jax_async_us"] = row["host_us"]
    del q, k, v
    if self.gpu:
      torch.cuda.empty_cache()

  def _sageattention(self, q, k, v, causal, kind):
    def setup():
      try:
        from sageattention import sageattn  # pylint: disable=import-outside-toplevel
      except Exception as e:  # pylint: disable=broad-except
        raise SkipRow(f"import sageattention failed: {type(e).__name__}: "
                      f"{e}") from e
      return (lambda: sageattn(q, k, v, tensor_layout="HND",
                               is_causal=causal)), self.sync_torch, kind
    return setup

  def compile_vs_eager(self, shape, causal, jax_kw, tiny):
    """``torch.compile(fullgraph=True)`` of ``Linear + sageattn`` against
    the same module eager (no grad)."""
    torch = self.torch
    kind = "tiny" if tiny else "large"
    q, k, v = self.inputs(shape, seed=1)

    class Block(torch.nn.Module):
      def __init__(self, d):
        super().__init__()
        self.proj = torch.nn.Linear(d, d)

      def forward(self, q, k, v):
        return jt.sageattn(self.proj(q), k, v, is_causal=causal, **jax_kw)

    block = Block(shape[-1]).to(self.device, self.dtype)
    base = dict(shape="x".join(map(str, shape)), causal=causal,
                method="sage", label="Linear + sageattn")
    compiled = {}

    def eager():
      return (lambda: block(q, k, v)), self.sync_torch, kind

    def compile_():
      t0 = time.perf_counter()
      fn = torch.compile(block, fullgraph=True)
      out = fn(q, k, v)
      self.sync_torch(out)
      compiled["first_call_s"] = round(time.perf_counter() - t0, 2)
      compiled["equal"] = bool(torch.equal(out, block(q, k, v)))
      return (lambda: fn(q, k, v)), self.sync_torch, kind

    with torch.no_grad():
      rows = self.run_rows([
          (dict(base, name="eager Linear+sageattn", kind="eager"), eager),
          (dict(base, name="torch.compile Linear+sageattn", kind="compile"),
           compile_)])
    rows[1].update(compiled)
    if "host_us" in rows[0] and "host_us" in rows[1]:
      rows[1]["eager_us"] = rows[0]["host_us"]
      rows[1]["vs_eager_us"] = round(rows[1]["host_us"]
                                     - rows[0]["host_us"], 2)
      if "gpu_us" in rows[0] and "gpu_us" in rows[1]:
        rows[1]["gpu_vs_eager_us"] = round(rows[1]["gpu_us"]
                                           - rows[0]["gpu_us"], 2)
    del q, k, v
    if self.gpu:
      torch.cuda.empty_cache()


def _loadavg():
  """The machine's 1-minute load average (other processes share it)."""
  try:
    return round(os.getloadavg()[0], 2)
  except OSError:
    return None


def summarise(rows):
  shim = [r for r in rows if r.get("kind") == "jaxattn.torch"
          and "overhead_us" in r]
  tiny = [r for r in shim if r.get("label") == "tiny"]
  out = dict(rows=len(rows),
             errors=sum("error" in r and "skipped" not in r for r in rows),
             skipped=sum("skipped" in r for r in rows))
  if tiny:
    worst = max(tiny, key=lambda r: r["overhead_us"])
    out["tiny_max_overhead_us"] = worst["overhead_us"]
    out["tiny_max_overhead_row"] = worst["name"]
    out["tiny_max_overhead_thread_us"] = max(r["overhead_thread_us"]
                                             for r in tiny)
  if shim:
    out["max_overhead_us"] = max(r["overhead_us"] for r in shim)
  fresh = [r for r in rows if r.get("kind") == "jaxattn.torch.fresh"
           and "overhead_us" in r]
  if fresh:
    out["tiny_max_overhead_fresh_inputs_us"] = max(r["overhead_us"]
                                                   for r in fresh)
  comp = [r for r in rows if r.get("kind") == "compile" and "vs_eager_us" in r]
  if comp:
    out["compile_vs_eager_us"] = {r["shape"]: r["vs_eager_us"] for r in comp}
  return out


def _fmt(x):
  return "" if x is None else (f"{x:.1f}" if isinstance(x, float) else str(x))


def format_table(rows, summary):
  head = ("row", "shape", "c", "host us", "over us", "jax us", "cpu over",
          "gpu us")
  lines = [f"{head[0]:38s} {head[1]:>15s} {head[2]:>1s} {head[3]:>9s} "
           f"{head[4]:>8s} {head[5]:>9s} {head[6]:>8s} {head[7]:>9s}"]
  for r in rows:
    if "error" in r:
      what = (f"skipped: {r['skipped']}" if "skipped" in r
              else f"ERROR {r['error']}")
      lines.append(f"{r['name'][:38]:38s} {r.get('shape', ''):>15s}   "
                   f"{what[:80]}")
      continue
    over = r.get("overhead_us", r.get("vs_eager_us"))
    ref = r.get("jax_us", r.get("eager_us"))
    gpu = r.get("gpu_us", r.get("device_us"))
    lines.append(f"{r['name'][:38]:38s} {r.get('shape', ''):>15s} "
                 f"{'y' if r.get('causal') else 'n'} "
                 f"{_fmt(r.get('host_us')):>9s} {_fmt(over):>8s} "
                 f"{_fmt(ref):>9s} {_fmt(r.get('overhead_thread_us')):>8s} "
                 f"{_fmt(gpu):>9s}")
  lines.append("over us: jaxattn.torch minus the jitted JAX call (compile "
               "rows: minus eager); cpu over: the same in the calling "
               "thread's CPU time; " + json.dumps(summary))
  return "\n".join(lines)


def main(argv=None, prog="python -m jaxattn bench --torch"):
  """Runs the benchmark (GPU where torch and jax both see one, else the
  CPU) and returns its JSON document."""
  argv = sys.argv[1:] if argv is None else list(argv)
  p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
  p.add_argument("--out", default="", help="write the JSON document here")
  p.add_argument("--calls", type=int, default=300,
                 help="calls a round at the tiny shape (fewer at large ones)")
  p.add_argument("--rounds", type=int, default=3, help="the best is kept")
  p.add_argument("--methods", default="",
                 help="comma list for the tiny shape; default all")
  p.add_argument("--row-timeout", type=float, default=300.0,
                 help="seconds a row may take (compilation included)")
  p.add_argument("--no-large", action="store_true",
                 help="GPU: only the tiny shape")
  p.add_argument("--verbose", action="store_true", help="print tracebacks")
  args = p.parse_args(argv)
  args.argv = argv
  # torch shares the GPU: jax takes memory as it needs it (read when jax
  # starts its GPU client, at the first look at its devices)
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  warnings.filterwarnings("ignore", category=DeprecationWarning)
  bench = Bench(args)
  methods = [m for m in args.methods.split(",") if m] or list(jaxattn.METHODS)
  print(f"{prog}: {bench.doc['meta']['mode']} ({bench.doc['meta']['device']}"
        f"), jax {jax.__version__}, torch {bench.torch.__version__}",
        flush=True)
  try:
    if bench.gpu:
      for method in methods:
        bench.compare("tiny", GPU_TINY, False, method, {}, tiny=True,
                      peers=method == methods[0])
      if not args.no_large:
        for shape, causal, label in GPU_LARGE:
          for views in (False, True):
            for method in ("sage", "fp8"):
              bench.compare(label, shape, causal, method, {}, tiny=False,
                            peers=method == "sage", views=views)
        for shape, causal in GPU_COMPILE:
          bench.compile_vs_eager(shape, causal, {}, tiny=False)
    else:
      ref = {"implementation": "reference"}
      for method in methods:
        bench.compare("tiny", CPU_TINY, False, method, ref, tiny=True,
                      peers=method == methods[0])
      bench.compile_vs_eager(CPU_TINY, False, ref, tiny=True)
  finally:
    bench.finish()
  return bench.doc


if __name__ == "__main__":
  main()

"""Decode against a KV cache: jaxattn.decode_attention (Triton split-K
kernel) on int8 / fp8 / sage / bfloat16 / PASA caches, against cuDNN
bfloat16 and against the memory floor.

    python benchmarks/decode.py OUT_DIR [--batches 1,8,32]
        [--lengths 4096,32768,131072] [--new-tokens 1,16]
        [--methods cudnn_bf16,fp32,int8,fp8,sage,pasa] [--heads 32x8]
        [--head-dim 128] [--options block_k=64,num_warps=4]
        [--page-size 64] [--budget-s 600] [--iters 20] [--reps 5]

Writes ``OUT_DIR/decode.json`` and ``OUT_DIR/decode.log`` (tracebacks of
failed rows).  Per point ``(B, S, T)``, with ``N`` query and ``K`` KV heads
(GQA) and every row's cache full (length ``S``):

* ``cudnn_bf16``: ``jax.nn.dot_product_attention(implementation="cudnn")``
  of ``T`` bfloat16 queries against bfloat16 K/V ``[B, S, K, D]``
  (non-causal: the causal mask among ``T <= 16`` new tokens costs nothing);
* a jaxattn method: ``jaxattn.decode_attention`` on a cache of that
  method's format, filled with random values directly on the device;
* ``<method>_paged`` (with ``--page-size``): the same cache as a
  :class:`jaxattn.decode.PagedKVCache` whose pages lie shuffled in the
  pool, read through the page table;
* ``floor_ms``: the bytes of the cache the call must read (values and
  scales) at the copy bandwidth measured in the same process
  (``copy_gbps``: 1 GiB read plus written, the faster of a plain Triton
  copy kernel and XLA's jitted ``x * 2``, both recorded);
  ``vs_floor`` is ``ms / floor_ms`` (1.0 is the floor) and
  ``speedup_vs_cudnn`` is cuDNN's time over the row's.

Points run in the order given, the cheapest first within a point, and
stop when ``--budget-s`` runs out (the rest are recorded as skipped).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jaxattn  # noqa: E402
from jaxattn import decode  # noqa: E402
from jaxattn.timing import time_call  # noqa: E402
from pallas_kernels import triton_call  # noqa: E402
from pallas_kernels.triton_call import tl, triton  # noqa: E402

METHODS = ("cudnn_bf16", "fp32", "int8", "fp8", "sage", "pasa")


COPY_BLOCK = 8192   # bytes a program of the Triton copy moves


@triton.jit
def _copy(x_ptr, y_ptr, BLOCK: tl.constexpr):
  i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
  tl.store(y_ptr + i, tl.load(x_ptr + i))


def copy_bandwidths(nbytes: int = 1 << 30) -> dict:
  """Bytes per second (read + write) of copying ``nbytes``: a plain
  Triton kernel (``triton``; 3.97 TB/s on the H200) and XLA's jitted ``x *
  2`` of bfloat16 (``xla``; 3.24), whose elementwise loops run slower."""
  x = jnp.ones((nbytes,), jnp.int8)
  triton_copy = jax.jit(lambda a: triton_call.launch(
      _copy, a, out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype),
      grid=(nbytes // COPY_BLOCK,), num_warps=8, BLOCK=COPY_BLOCK))
  out = dict(triton=2 * nbytes / time_call(triton_copy, (x,), iters=20,
                                           reps=5))
  del x
  y = jnp.ones((nbytes // 2,), jnp.bfloat16)
  out["xla"] = 2 * nbytes / time_call(jax.jit(lambda a: a * 2), (y,),
                                      iters=20, reps=5)
  return out


def random_cache(method: str, b: int, s: int, nk: int, d: int,
                 seed: int = 0) -> decode.KVCache:
  """A full cache of ``method``'s format with random contents, made on the
  device (no float copy of the whole cache ever exists)."""
  fmt = decode.METHOD_CACHES[method][0]
  keys = jax.random.split(jax.random.key(seed), 4)
  shape = (b, nk, s, d)

  def values(key, dtype):
    if dtype == "int8":
      return jax.random.randint(key, shape, -127, 128, jnp.int8)
    x = jax.random.normal(key, shape, jnp.bfloat16)
    if dtype == "float8_e4m3fn":
      return (x * 100).astype(jnp.float8_e4m3fn)
    return x.astype(dtype)

  def scales(key, dtype):
    if dtype not in ("int8", "float8_e4m3fn"):
      return None
    return jax.random.uniform(key, shape[:3], jnp.float32, 0.005, 0.02)

  return decode.KVCache(
      k=values(keys[0], fmt[0]), v=values(keys[1], fmt[1]),
      k_scale=scales(keys[2], fmt[0]), v_scale=scales(keys[3], fmt[1]),
      k_mean=(jnp.zeros((b, nk, d), jnp.float32) if fmt[2] else None))


def to_paged(cache: decode.KVCache, page: int, seed: int = 0):
  """``(PagedKVCache, page_indices)``: the dense cache's pages in a
  shuffled order in a pool of exactly its pages."""
  b, nk, s, d = cache.k.shape
  per = s // page
  perm = jax.random.permutation(jax.random.key(seed), b * per)
  where = jnp.argsort(perm)        # pool slot of dense page b * per + i

  def pool(x):
    if x is None:
      return None
    x = x.reshape(b, nk, per, page, *x.shape[3:])
    x = jnp.moveaxis(x, 1, 0).reshape(nk, b * per, page, *x.shape[4:])
    return x[:, perm]

  paged = decode.PagedKVCache(
      k_pages=pool(cache.k), v_pages=pool(cache.v),
      k_scale=pool(cache.k_scale), v_scale=pool(cache.v_scale),
      k_mean=cache.k_mean)
  return paged, where.reshape(b, per).astype(jnp.int32)


def cache_bytes(cache: decode.KVCache, length: int) -> int:
  """Bytes a decode call reads for ``length`` keys of every row."""
  return cache.batch * length * cache.bytes_per_token()


def bench_point(b, s, t, n, nk, d, methods, *, bandwidth, options, iters,
                reps, log, page_size=None):
  """``{method: {ms, ...} or {error}}`` at one point."""
  rows = {}
  kq = jax.random.key(1)
  q = jax.random.normal(kq, (b, t, n, d), jnp.bfloat16)
  lengths = jnp.full((b,), s, jnp.int32)
  for name in methods:
    try:
      if name == "cudnn_bf16":
        kk, kv = jax.random.split(jax.random.key(2))
        k = jax.random.normal(kk, (b, s, nk, d), jnp.bfloat16)
        v = jax.random.normal(kv, (b, s, nk, d), jnp.bfloat16)
        f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, implementation="cudnn"))
        ms = time_call(f, (q, k, v), iters, reps) * 1e3
        nbytes = 2 * b * s * nk * d * 2
        del k, v
      elif name.endswith("_paged"):
        method = name[:-len("_paged")]
        dense = random_cache(method, b, s, nk, d)
        nbytes = cache_bytes(dense, s)
        cache, table = to_paged(dense, page_size)
        del dense
        f = jax.jit(lambda q, c, l, p, m=method: jaxattn.decode_attention(
            q, c, l, page_indices=p, method=m, implementation="triton",
            **options))
        ms = time_call(f, (q, cache, lengths, table), iters, reps) * 1e3
        del cache
      else:
        cache = random_cache(name, b, s, nk, d)
        f = jax.jit(lambda q, c, l, name=name: jaxattn.decode_attention(
            q, c, l, method=name, implementation="triton", **options))
        ms = time_call(f, (q, cache, lengths), iters, reps) * 1e3
        nbytes = cache_bytes(cache, s)
        del cache
      floor = nbytes / bandwidth * 1e3
      rows[name] = dict(ms=ms, bytes=nbytes, floor_ms=floor,
                        vs_floor=ms / floor)
    except Exception as e:  # noqa: BLE001  (one failure must not stop the run)
      rows[name] = dict(error=f"{type(e).__name__}: {e}"[:500])
      log.write(f"--- {b}x{s}x{t} {name}\n{traceback.format_exc()}\n")
      log.flush()
    gc.collect()
  ref = rows.get("cudnn_bf16", {}).get("ms")
  for r in rows.values():
    if ref and "ms" in r:
      r["speedup_vs_cudnn"] = ref / r["ms"]
  return rows


def format_table(points) -> str:
  lines = [f"{'B':>3} {'S':>7} {'T':>3} {'method':<13} {'ms':>8} "
           f"{'x cuDNN':>8} {'floor ms':>9} {'x floor':>8}"]
  for p in points:
    for name, r in p["rows"].items():
      head = f"{p['B']:>3} {p['S']:>7} {p['T']:>3} {name:<13} "
      if "ms" in r:
        lines.append(head + f"{r['ms']:8.3f} "
                     f"{r.get('speedup_vs_cudnn', float('nan')):8.2f} "
                     f"{r['floor_ms']:9.3f} {r['vs_floor']:8.2f}")
      else:
        lines.append(head + r.get("error", r.get("skipped", "?"))[:60])
  return "\n".join(lines)


def _ints(text):
  return [int(x) for x in text.split(",") if x]


def _options(text):
  out = {}
  for item in filter(None, (text or "").split(",")):
    k, v = item.split("=")
    out[k] = int(v)
  return out


def run(out_dir, *, batches=(8, 1, 32), lengths=(32768, 4096, 131072),
        new_tokens=(1, 16), methods=METHODS, heads=(32, 8), head_dim=128,
        options=None, budget_s=600.0, iters=20, reps=5, points=None,
        bandwidth=None, page_size=None):
  """Runs the grid (or the explicit ``points``, ``(B, S, T)`` in order)
  and writes ``decode.json`` / ``decode.log`` in ``out_dir``; returns the
  document."""
  os.makedirs(out_dir, exist_ok=True)
  t_start = time.perf_counter()
  options = dict(options or {})
  n, nk = heads
  if page_size:
    methods = list(methods) + [f"{m}_paged" for m in methods
                               if m != "cudnn_bf16"]
  doc = dict(page_size=page_size, date=datetime.datetime.now().isoformat(timespec="seconds"),
             device=str(jax.devices()[0].device_kind), jax=jax.__version__,
             heads=[n, nk], head_dim=head_dim, options=options, points=[])
  path = os.path.join(out_dir, "decode.json")
  with open(os.path.join(out_dir, "decode.log"), "a") as log:
    if bandwidth is None:
      copies = copy_bandwidths()
      doc["copy_gbps_by_kind"] = {k: x / 1e9 for k, x in copies.items()}
      bandwidth = max(copies.values())
    doc["copy_gbps"] = bandwidth / 1e9
    if points is None:
      points = [(b, s, t) for s in lengths for b in batches
                for t in new_tokens]
    for b, s, t in points:
      point = dict(B=b, S=s, T=t)
      if time.perf_counter() - t_start > budget_s:
        point["rows"] = {m: dict(skipped="time budget") for m in methods}
      else:
        point["rows"] = bench_point(b, s, t, n, nk, head_dim, methods,
                                    bandwidth=bandwidth, options=options,
                                    iters=iters, reps=reps, log=log,
                                    page_size=page_size)
      doc["points"].append(point)
      with open(path, "w") as f:
        json.dump(doc, f, indent=1)
      print(f"[{time.perf_counter() - t_start:6.1f}s] {b}x{s}x{t}: " + ", ".join(
          f"{m} {r['ms']:.3f}" if "ms" in r else f"{m} -"
          for m, r in point["rows"].items()), flush=True)
  return doc


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("out_dir")
  p.add_argument("--batches", default="8,1,32")
  p.add_argument("--lengths", default="32768,4096,131072")
  p.add_argument("--new-tokens", default="1,16")
  p.add_argument("--methods", default=",".join(METHODS))
  p.add_argument("--heads", default="32x8", help="query x KV heads")
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--options", default="",
                 help="decode_attention knobs, e.g. block_k=64,num_warps=4")
  p.add_argument("--page-size", type=int, default=None,
                 help="also time each method on a shuffled paged pool")
  p.add_argument("--budget-s", type=float, default=600.0)
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--reps", type=int, default=5)
  a = p.parse_args(argv)
  if jax.devices()[0].platform != "gpu":
    print("benchmarks/decode.py needs a GPU", file=sys.stderr)
    return 1
  n, nk = map(int, a.heads.split("x"))
  doc = run(a.out_dir, batches=_ints(a.batches), lengths=_ints(a.lengths),
            new_tokens=_ints(a.new_tokens), methods=a.methods.split(","),
            heads=(n, nk), head_dim=a.head_dim, options=_options(a.options),
            budget_s=a.budget_s, iters=a.iters, reps=a.reps,
            page_size=a.page_size)
  print(f"copy bandwidth {doc['copy_gbps']:.0f} GB/s")
  print(format_table(doc["points"]))
  return 0


if __name__ == "__main__":
  sys.exit(main())

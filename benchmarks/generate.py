"""Generation with a Llama-shaped model (Flax NNX, random bf16 weights)
against a bf16 KV cache and int8 / fp8 paged caches (issue 59).

    python benchmarks/generate.py [--out F.json] [--steps 64] [--batch 32]
        [--cache-gb 40] [--sections throughput,capacity,ttft,greedy]
        [--caches bf16_cudnn,int8_paged,fp8_paged[,bf16_paged]]
        [--prompts 1024,8192,32768] [--tiny]

Model: 8 layers, d_model 4096, 32 query / 8 KV heads of 128, RoPE, RMSNorm,
SwiGLU 14336, vocab 32000 (Llama-2's), bf16 (4 GB).  ``--tiny``: 2 layers,
d_model 64, 4 / 2 heads of 16, vocab 256, contexts 16-64 (CPU, seconds).

Caches.  ``bf16_cudnn``: dense bf16 ``[B, S, K, D]`` per layer (cuDNN's
layout; every row holds S = the longest context), written by a scatter,
read by ``jax.nn.dot_product_attention(implementation="cudnn")`` with the
rows' lengths (XLA's without a GPU).  ``int8_paged``, ``fp8_paged`` (and
``bf16_paged``, the same bytes as the baseline but paged):
``jaxattn.decode.PagedKVCache``, pages of 64 tokens, each row exactly the
pages it needs, ``append_paged`` and ``decode_attention(method="int8" /
"fp8" / "fp32", page_indices=...)``.

Sections (each cache under try/except; failures are recorded):

1. throughput: decode tokens/s of ``--batch`` rows with contexts uniform in
   1k-32k, ``--steps`` greedy steps after 2 warm-up steps.  The caches hold
   random values made on the device: a step costs by lengths, not values.
2. capacity: the most rows (same draw) whose cache fits ``--cache-gb``
   (``bytes_per_token`` times the pages, or times the full row when
   dense), and tokens/s at that batch.
3. ttft: batch 1; a prompt's first P - 1 tokens prefilled through the
   model (``jaxattn.dot_product_attention(is_causal=True)``, the cache's
   method, "fp32" for bf16), then the first decode step on its last token.
4. greedy: 4 prompts of 64-512 tokens, 32 greedy tokens per cache against
   the bf16 cache's: equal tokens free-running, and teacher-forced (fed the
   bf16 tokens) argmax agreement and max |logit diff| over the bf16 logits'
   spread (median max - min).  Random weights make near-ties, so flips are
   expected; the tolerance is on the logits: ``REL_LOGIT_TOL``.

Timing: jitted steps, cache donated, ``jax.block_until_ready``; the first
call (compile) is reported apart as ``first_s``.  Prints a table last;
exit code 1 if anything failed.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jaxattn  # noqa: E402
from jaxattn import decode  # noqa: E402

BF16 = jnp.bfloat16
SECTIONS = ("throughput", "capacity", "ttft", "greedy")
# The greedy section's tolerance: max |logit diff| of an 8-bit cache's
# teacher-forced logits over the bf16 logits' spread.  --tiny measured
# 0.013 (int8) and 0.042 (fp8); bf16 paged against cuDNN, the bf16 floor,
# 0.009.
REL_LOGIT_TOL = 0.1


@dataclasses.dataclass(frozen=True)
class Config:
  layers: int = 8
  d_model: int = 4096
  heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  hidden: int = 14336
  vocab: int = 32000
  rope_theta: float = 500000.0
  page_size: int = 64
  min_len: int = 1024              # contexts of the decode sections
  max_len: int = 32768
  prompts: tuple = (1024, 8192, 32768)
  greedy_prompts: tuple = (64, 160, 320, 512)
  greedy_new: int = 32
  cache_gb: float = 40.0


FULL = Config()
TINY = Config(layers=2, d_model=64, heads=4, kv_heads=2, head_dim=16,
              hidden=128, vocab=256, page_size=16, min_len=16, max_len=64,
              prompts=(16, 64), greedy_prompts=(9, 17, 30, 48), greedy_new=8,
              cache_gb=2e-4)


# ----------------------------------------------------------------------------
# The model.  Attention is a callback, attend(layer, q, k, v): the cache
# kind decides how K/V are stored and read.


def rope(x, positions, theta):
  """Rotary embedding (Llama's halves) of ``x [B, T, H, D]`` at int
  ``positions [B, T]``, in float32."""
  half = x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  ang = positions[..., None].astype(jnp.float32) * freq
  cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin],
                         -1).astype(x.dtype)


class RMSNorm(nnx.Module):
  def __init__(self, dim: int):
    self.scale = nnx.Param(jnp.ones(dim, BF16))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5)
    return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def _linear(rngs, n_in, n_out):
  return nnx.Linear(n_in, n_out, use_bias=False, dtype=BF16,
                    param_dtype=BF16, rngs=rngs)


class Block(nnx.Module):
  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    d, n, nk, hd = cfg.d_model, cfg.heads, cfg.kv_heads, cfg.head_dim
    self.cfg = cfg
    self.attn_norm, self.mlp_norm = RMSNorm(d), RMSNorm(d)
    self.wq = _linear(rngs, d, n * hd)
    self.wk = _linear(rngs, d, nk * hd)
    self.wv = _linear(rngs, d, nk * hd)
    self.wo = _linear(rngs, n * hd, d)
    self.gate = _linear(rngs, d, cfg.hidden)
    self.up = _linear(rngs, d, cfg.hidden)
    self.down = _linear(rngs, cfg.hidden, d)

  def __call__(self, x, positions, attend):
    c = self.cfg
    b, t, _ = x.shape
    h = self.attn_norm(x)
    q = rope(self.wq(h).reshape(b, t, c.heads, c.head_dim), positions,
             c.rope_theta)
    k = rope(self.wk(h).reshape(b, t, c.kv_heads, c.head_dim), positions,
             c.rope_theta)
    v = self.wv(h).reshape(b, t, c.kv_heads, c.head_dim)
    x = x + self.wo(attend(q, k, v).astype(BF16).reshape(b, t, -1))
    h = self.mlp_norm(x)
    return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class Llama(nnx.Module):
  def __init__(self, cfg: Config, rngs: nnx.Rngs):
    self.embed = nnx.Embed(cfg.vocab, cfg.d_model, dtype=BF16,
                           param_dtype=BF16, rngs=rngs)
    self.blocks = getattr(nnx, "List", list)(
        [Block(cfg, rngs) for _ in range(cfg.layers)])
    self.norm = RMSNorm(cfg.d_model)
    self.head = _linear(rngs, cfg.d_model, cfg.vocab)

  def __call__(self, tokens, positions, attend, last):
    """float32 logits ``[B, vocab]`` of position ``last [B]`` of each row
    (only those: a 32k prompt's full logits would be 4 GB)."""
    x = self.embed(tokens)
    for i, block in enumerate(self.blocks):
      x = block(x, positions, functools.partial(attend, i))
    x = x[jnp.arange(x.shape[0]), last]
    return self.head(self.norm(x)).astype(jnp.float32)


# ----------------------------------------------------------------------------
# Cache kinds.


@dataclasses.dataclass(frozen=True)
class Kind:
  name: str
  method: str          # decode_attention's (paged) and the prefill's method
  paged: bool


KINDS = {k.name: k for k in (Kind("bf16_cudnn", "fp32", False),
                             Kind("bf16_paged", "fp32", True),
                             Kind("int8_paged", "int8", True),
                             Kind("fp8_paged", "fp8", True))}


@functools.lru_cache(maxsize=None)
def bytes_per_token(kind: Kind, cfg: Config) -> int:
  """All layers' bytes of one token (values and scales)."""
  if not kind.paged:
    return cfg.layers * 2 * cfg.kv_heads * cfg.head_dim * 2
  one = jax.eval_shape(lambda: decode.PagedKVCache.create(
      1, 16, cfg.kv_heads, cfg.head_dim, num_seqs=1, method=kind.method))
  return cfg.layers * decode.PagedKVCache.bytes_per_token(one)


def dense_capacity(need: int) -> int:
  return -(-need // 128) * 128


def page_table(needs, page: int, seed: int = 0):
  """``(table [B, max pages], num_pages)``: each row exactly the pages its
  ``needs`` tokens take, scattered over the pool (a used pool is not in
  order)."""
  n = -(-np.asarray(needs) // page)
  perm = np.random.default_rng(seed).permutation(int(n.sum()))
  table = np.zeros((len(n), int(n.max())), np.int32)
  start = np.concatenate([[0], np.cumsum(n)[:-1]])
  for i, (s, c) in enumerate(zip(start, n)):
    table[i, :c] = perm[s:s + c]
  return jnp.asarray(table), int(n.sum())


def _random_leaf(key, shape, dtype, field):
  if field == "k_mean":
    return jnp.zeros(shape, dtype)
  if field.endswith("scale"):
    return jax.random.uniform(key, shape, dtype, 0.005, 0.02)
  if jnp.dtype(dtype) == jnp.int8:
    return jax.random.randint(key, shape, -127, 128, jnp.int8)
  x = jax.random.normal(key, shape, BF16)
  if jnp.dtype(dtype).itemsize == 1:   # e4m3: up to 448 (beyond: NaN)
    x = jnp.clip(x * 100, -448, 448)
  return x.astype(dtype)


@functools.partial(jax.jit, static_argnames=("kind", "cfg", "batch", "pages",
                                             "capacity", "fill"))
def _layer_cache(key, *, kind, cfg, batch, pages, capacity, fill):
  """One layer's cache: empty (``fill`` False) or random values made on
  the device (one layer per call: the generator's temporaries of one
  layer at a time next to a 40 GB cache)."""
  if kind.paged:
    cache = decode.PagedKVCache.create(
        pages, cfg.page_size, cfg.kv_heads, cfg.head_dim, num_seqs=batch,
        method=kind.method)
  else:
    shape = (batch, capacity, cfg.kv_heads, cfg.head_dim)
    cache = {"k": jnp.zeros(shape, BF16), "v": jnp.zeros(shape, BF16)}
  if not fill:
    return cache
  leaves, tree = jax.tree_util.tree_flatten_with_path(cache)
  keys = jax.random.split(key, len(leaves))
  return jax.tree_util.tree_unflatten(tree, [
      _random_leaf(k, x.shape, x.dtype, str(path[-1]).strip(".[]'"))
      for k, (path, x) in zip(keys, leaves)])


def make_cache(kind: Kind, cfg: Config, needs, *, fill: bool, seed: int = 0):
  """``(caches, table or None, bytes held)`` for rows that will hold
  ``needs`` tokens each."""
  bpt = bytes_per_token(kind, cfg)
  if kind.paged:
    table, pages = page_table(needs, cfg.page_size, seed)
    held = pages * cfg.page_size * bpt
    cap = None
  else:
    table, pages = None, None
    cap = dense_capacity(int(max(needs)))
    held = len(needs) * cap * bpt
  # RngBitGenerator: threefry over gigabytes compiles slowly on the CPU
  key = jax.random.key(seed, impl="unsafe_rbg")
  cache = [_layer_cache(jax.random.fold_in(key, i), kind=kind, cfg=cfg,
                        batch=len(needs), pages=pages, capacity=cap,
                        fill=fill) for i in range(cfg.layers)]
  return cache, table, held


# ----------------------------------------------------------------------------
# Jitted prefill and decode step (the cache donated: updated in place).


def _write(kind, c, k, v, lengths, counts, table):
  if kind.paged:
    return decode.append_paged(c, k, v, lengths, table, counts=counts)
  t, cap = k.shape[1], c["k"].shape[1]
  pos = lengths[:, None] + jnp.arange(t)[None]
  pos = jnp.where(jnp.arange(t)[None] < counts[:, None], pos, cap)  # drop
  bi = jnp.arange(k.shape[0])[:, None]
  return {n: c[n].at[bi, pos].set(x, mode="drop")
          for n, x in (("k", k), ("v", v))}


def _decode_attend(kind, q, c, lengths, table):
  if kind.paged:
    return jaxattn.decode_attention(q, c, lengths, page_indices=table,
                                    method=kind.method)
  gpu = jax.devices()[0].platform == "gpu"
  return jax.nn.dot_product_attention(
      q, c["k"], c["v"], key_value_seq_lengths=lengths,
      implementation="cudnn" if gpu else None)


def _forward(graphdef, state, kind, cache, table, tokens, lengths, counts,
             prefill):
  model = nnx.merge(graphdef, state)
  cache = list(cache)
  positions = lengths[:, None] + jnp.arange(tokens.shape[1])[None]

  def attend(i, q, k, v):
    cache[i] = _write(kind, cache[i], k, v, lengths, counts, table)
    if prefill:   # the prompt's own K/V (rows start empty)
      return jaxattn.dot_product_attention(q, k, v, is_causal=True,
                                           method=kind.method)
    return _decode_attend(kind, q, cache[i], lengths + counts, table)

  logits = model(tokens, positions, attend, last=counts - 1)
  return cache, logits


@functools.partial(jax.jit, static_argnames=("graphdef", "kind"),
                   donate_argnames="cache")
def prefill(state, cache, table, tokens, counts, *, graphdef, kind):
  """Empty rows take ``counts`` of their ``tokens [B, T]`` (the rest is
  padding: later positions, which causal attention keeps from the
  others)."""
  return _forward(graphdef, state, kind, cache, table, tokens,
                  jnp.zeros_like(counts), counts, True)


@functools.partial(jax.jit, static_argnames=("graphdef", "kind"),
                   donate_argnames="cache")
def decode_step(state, cache, table, tokens, lengths, *, graphdef, kind):
  """One token per row (``tokens [B]`` at ``lengths``): ``(cache, greedy
  next tokens, lengths + 1, logits)``."""
  cache, logits = _forward(graphdef, state, kind, cache, table,
                           tokens[:, None], lengths, jnp.ones_like(lengths),
                           False)
  return cache, jnp.argmax(logits, -1).astype(jnp.int32), lengths + 1, logits


# ----------------------------------------------------------------------------
# Sections.


def context_lengths(cfg: Config, n: int) -> np.ndarray:
  return np.random.default_rng(0).integers(cfg.min_len, cfg.max_len + 1, n)


def _sync(x):
  jax.block_until_ready(x)
  return time.perf_counter()


def timed_decode(model, kind, cfg, lengths, steps):
  """tokens/s of ``steps`` greedy steps at ``lengths`` (random cache)."""
  graphdef, state = model
  b = len(lengths)
  warm = 2
  cache, table, held = make_cache(kind, cfg, np.asarray(lengths) + steps
                                  + warm, fill=True)
  tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab, b),
                       jnp.int32)
  lens = jnp.asarray(lengths, jnp.int32)
  step = functools.partial(decode_step, graphdef=graphdef, kind=kind)
  t0 = time.perf_counter()
  for _ in range(warm):      # compile, and a first run
    cache, tokens, lens, _ = step(state, cache, table, tokens, lens)
  t1 = _sync(tokens)
  for _ in range(steps):
    cache, tokens, lens, _ = step(state, cache, table, tokens, lens)
  t2 = _sync(tokens)
  dt = (t2 - t1) / steps
  bpt = bytes_per_token(kind, cfg)
  read = (float(np.sum(lengths)) + b * (warm + steps / 2)) * bpt
  return dict(batch=b, steps=steps, mean_context=float(np.mean(lengths)),
              ms_per_step=dt * 1e3, tokens_per_s=b / dt,
              cache_gb_held=held / 1e9, kv_gb_read_per_step=read / 1e9,
              hbm_gbps=(read + model_bytes(state)) / dt / 1e9,
              first_s=t1 - t0)


def model_bytes(state) -> int:
  """Bytes of the weights a decode step reads (the embedding is only
  gathered)."""
  return sum(x.size * x.dtype.itemsize
             for path, x in jax.tree_util.tree_flatten_with_path(state)[0]
             if "embed" not in jax.tree_util.keystr(path))


def section_throughput(model, cfg, kinds, args, log):
  lengths = context_lengths(cfg, args.batch)
  out = {}
  for kind in kinds:
    out[kind.name] = _guard(log, kind.name, lambda kind=kind: timed_decode(
        model, kind, cfg, lengths, args.steps))
  return out


def max_batch(kind, cfg, lengths, budget: float, room: int) -> int:
  """Most leading rows of ``lengths`` whose cache fits ``budget`` bytes."""
  bpt = bytes_per_token(kind, cfg)
  if kind.paged:
    pages = -(-(lengths + room) // cfg.page_size)
    return int(np.searchsorted(np.cumsum(pages * cfg.page_size * bpt),
                               budget, side="right"))
  # dense: every row holds the longest context a request may reach
  row = dense_capacity(cfg.max_len + room) * bpt
  return int(min(len(lengths), budget // row))


def section_capacity(model, cfg, kinds, args, log):
  lengths = context_lengths(cfg, 4096)
  budget = args.cache_gb * 1e9
  out = {}
  for kind in kinds:
    def run(kind=kind):
      b = max_batch(kind, cfg, lengths, budget, args.steps + 2)
      if b == 0:
        return dict(max_batch=0)
      r = dict(max_batch=b, budget_gb=args.cache_gb)
      if not kind.paged:   # what the same bf16 bytes would hold as pages
        r["max_batch_if_paged"] = max_batch(
            dataclasses.replace(kind, paged=True, name="bf16_paged"), cfg,
            lengths, budget, args.steps + 2)
      return r | timed_decode(model, kind, cfg, lengths[:b], args.steps)
    out[kind.name] = _guard(log, kind.name, run)
  return out


def section_ttft(model, cfg, kinds, args, log, reps: int = 2):
  graphdef, state = model
  out = {}
  for kind in kinds:
    def run(kind=kind):
      cache, table, _ = make_cache(kind, cfg, [max(args.prompts)],
                                   fill=False)
      res = {}
      for p in args.prompts:
        tokens = jnp.asarray(np.random.default_rng(p).integers(
            0, cfg.vocab, (1, p)), jnp.int32)
        counts = jnp.asarray([p - 1], jnp.int32)
        last = tokens[:, p - 1]
        times = []
        for _ in range(reps + 1):   # the first compiles
          t0 = time.perf_counter()
          cache, _ = prefill(state, cache, table, tokens, counts,
                             graphdef=graphdef, kind=kind)
          t1 = _sync(cache)
          cache, first, _, _ = decode_step(state, cache, table, last,
                                           counts, graphdef=graphdef,
                                           kind=kind)
          t2 = _sync(first)
          times.append((t1 - t0, t2 - t1))
        res[str(p)] = dict(
            ttft_ms=statistics.median(a + b for a, b in times[1:]) * 1e3,
            prefill_ms=statistics.median(a for a, _ in times[1:]) * 1e3,
            first_step_ms=statistics.median(b for _, b in times[1:]) * 1e3,
            first_s=sum(times[0]))
        log(f"  ttft {kind.name} P={p}: {res[str(p)]['ttft_ms']:.1f} ms")
      return res
    out[kind.name] = _guard(log, kind.name, run)
  return out


def generate(model, kind, cfg, prompts, forced=None):
  """Greedy tokens ``[new, B]`` and logits ``[new, B, vocab]`` after the
  ``prompts`` (int ``[B, T]`` padded, lengths ``lengths``); with
  ``forced [new, B]``, step ``s + 1`` takes ``forced[s]`` instead of its
  own token (teacher forcing)."""
  graphdef, state = model
  tokens, lengths = prompts
  cache, table, _ = make_cache(kind, cfg,
                               np.asarray(lengths) + cfg.greedy_new,
                               fill=False)
  counts = jnp.asarray(lengths - 1, jnp.int32)
  cache, _ = prefill(state, cache, table, jnp.asarray(tokens), counts,
                     graphdef=graphdef, kind=kind)
  tok = jnp.asarray(tokens[np.arange(len(lengths)), lengths - 1])
  lens, outs, logits = counts, [], []
  for s in range(cfg.greedy_new):
    cache, nxt, lens, lg = decode_step(state, cache, table, tok, lens,
                                       graphdef=graphdef, kind=kind)
    outs.append(nxt)
    logits.append(lg)
    tok = nxt if forced is None else jnp.asarray(forced[s])
  return np.asarray(jnp.stack(outs)), np.asarray(jnp.stack(logits))


def section_greedy(model, cfg, kinds, args, log):
  lengths = np.asarray(cfg.greedy_prompts)
  rng = np.random.default_rng(2)
  tokens = np.zeros((len(lengths), int(lengths.max())), np.int32)
  for i, n in enumerate(lengths):
    tokens[i, :n] = rng.integers(0, cfg.vocab, n)
  ref = None
  for kind in (k for k in kinds if k.method == "fp32"):   # bf16 caches
    try:
      ref_tok, ref_logits = generate(model, kind, cfg, (tokens, lengths))
      ref = kind
      break
    except Exception:  # noqa: BLE001  (then the next bf16 cache)
      log(f"  greedy reference {kind.name} failed:\n"
          f"{traceback.format_exc()}")
  if ref is None:
    return {"error": "greedy needs a bf16 cache that runs, to compare with"}
  spread = float(np.median(ref_logits.max(-1) - ref_logits.min(-1)))
  out = {"reference": ref.name, "prompt_lengths": lengths.tolist(),
         "new_tokens": cfg.greedy_new, "logit_spread": spread,
         "rel_logit_tol": REL_LOGIT_TOL}
  for kind in kinds:
    if kind == ref:
      continue
    def run(kind=kind):
      tok, _ = generate(model, kind, cfg, (tokens, lengths))
      _, logits = generate(model, kind, cfg, (tokens, lengths),
                           forced=ref_tok)
      diff = float(np.abs(logits - ref_logits).max())
      # the first free-running step where each row leaves the bf16 tokens
      first = [int(np.argmax(r)) if r.any() else cfg.greedy_new
               for r in (tok != ref_tok).T]
      log(f"  greedy {kind.name}: {(tok == ref_tok).mean():.2f} of the "
          f"tokens equal, max |dlogit| {diff:.3g} ({diff / spread:.3f} of "
          "the spread)")
      return dict(token_match=float((tok == ref_tok).mean()),
                  first_mismatch_step=first,
                  forced_argmax_match=float(
                      (logits.argmax(-1) == ref_tok).mean()),
                  max_abs_logit_diff=diff, rel_logit_diff=diff / spread,
                  within_tol=bool(diff / spread <= REL_LOGIT_TOL),
                  logits_finite=bool(np.isfinite(logits).all()))
    out[kind.name] = _guard(log, kind.name, run)
  return out


def _guard(log, name, fn):
  """``fn()``, or ``{"error": ...}`` with the traceback logged."""
  try:
    return fn()
  except Exception as e:  # noqa: BLE001  (one failure must not stop the run)
    log(f"  {name} failed:\n{traceback.format_exc()}")
    return {"error": f"{type(e).__name__}: {e}"[:500]}


# ----------------------------------------------------------------------------


def _errors(doc) -> int:
  if isinstance(doc, dict):
    return ("error" in doc) + sum(_errors(v) for v in doc.values())
  return 0


def format_table(doc) -> str:
  s = {k: doc.get(k, {}) for k in SECTIONS}
  kinds = doc["meta"]["caches"]
  prompts = [str(p) for p in doc["meta"]["prompts"]]
  head = (f"{'cache':<11} {'B/token':>8} {'tok/s':>9} {'max B':>6} "
          f"{'tok/s@max':>10} {'TTFT ms ' + '/'.join(prompts):>24} "
          f"{'match':>6} {'forced':>6} {'dlogit':>7}")
  lines = [head]

  def num(d, key, fmt):
    v = d.get(key) if isinstance(d, dict) else None
    return format(v, fmt) if isinstance(v, (int, float)) else "-"

  for k in kinds:
    th, ca, tt, gr = (s[x].get(k, {}) if isinstance(s[x], dict) else {}
                      for x in SECTIONS)
    ttft = "/".join(num(tt.get(p, {}), "ttft_ms", ".0f") for p in prompts)
    lines.append(
        f"{k:<11} {doc['meta']['bytes_per_token'][k]:>8} "
        f"{num(th, 'tokens_per_s', '9.0f'):>9} {num(ca, 'max_batch', 'd'):>6} "
        f"{num(ca, 'tokens_per_s', '.0f'):>10} {ttft:>24} "
        f"{num(gr, 'token_match', '.2f'):>6} "
        f"{num(gr, 'forced_argmax_match', '.2f'):>6} "
        f"{num(gr, 'rel_logit_diff', '.3f'):>7}")
  return "\n".join(lines)


def _ints(text):
  return tuple(int(x) for x in text.split(",") if x)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tiny", action="store_true",
                 help="small model and contexts (CPU, seconds)")
  p.add_argument("--steps", type=int, default=64,
                 help="timed decode steps per measurement")
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--cache-gb", type=float, default=None,
                 help="cache budget of the capacity section (default 40; "
                 "--tiny: 0.0002)")
  p.add_argument("--prompts", type=_ints, default=None,
                 help="TTFT prompt lengths (default 1024,8192,32768)")
  p.add_argument("--sections", default=",".join(SECTIONS))
  p.add_argument("--caches", default="bf16_cudnn,int8_paged,fp8_paged",
                 help=f"of {','.join(KINDS)}")
  p.add_argument("--out", help="write the results as JSON")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)
  cfg = TINY if args.tiny else FULL
  args.cache_gb = cfg.cache_gb if args.cache_gb is None else args.cache_gb
  args.prompts = args.prompts or cfg.prompts
  kinds = [KINDS[k] for k in args.caches.split(",")]
  sections = args.sections.split(",")
  unknown = set(sections) - set(SECTIONS)
  if unknown:
    p.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
  start = time.perf_counter()

  def log(msg):
    print(f"[{time.perf_counter() - start:6.1f}s] {msg}", flush=True)

  model = nnx.split(Llama(cfg, nnx.Rngs(args.seed)))
  jax.block_until_ready(model[1])
  doc = {"meta": dict(
      date=datetime.datetime.now().isoformat(timespec="seconds"),
      device=str(jax.devices()[0].device_kind), jax=jax.__version__,
      config=dataclasses.asdict(cfg), tiny=args.tiny, steps=args.steps,
      batch=args.batch, cache_gb=args.cache_gb, prompts=list(args.prompts),
      caches=[k.name for k in kinds], seed=args.seed,
      weights_gb_per_step=model_bytes(model[1]) / 1e9,
      bytes_per_token={k.name: bytes_per_token(k, cfg) for k in kinds},
      notes="random weights; decode sections fill the caches with random "
            "values (cost depends on the lengths only); bf16_cudnn is a "
            "dense cache (capacity per row) with cuDNN decode attention")}
  log(f"model built: {doc['meta']['weights_gb_per_step']:.2f} GB of "
      "weights read per step")
  run = dict(throughput=section_throughput, capacity=section_capacity,
             ttft=section_ttft, greedy=section_greedy)
  doc["meta"]["section_s"] = {}
  for name in sections:
    log(f"section {name}")
    t0 = time.perf_counter()
    doc[name] = _guard(log, name, lambda name=name: run[name](
        model, cfg, kinds, args, log))
    doc["meta"]["section_s"][name] = time.perf_counter() - t0
    for k, r in (doc[name].items() if isinstance(doc[name], dict) else ()):
      if isinstance(r, dict) and "tokens_per_s" in r:
        log(f"  {name} {k}: B={r['batch']} {r['tokens_per_s']:.0f} tok/s "
            f"({r['ms_per_step']:.2f} ms/step, first {r['first_s']:.1f} s)")
    if args.out:
      with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
  doc["meta"]["total_s"] = time.perf_counter() - start
  if args.out:
    with open(args.out, "w") as f:
      json.dump(doc, f, indent=1)
  print(format_table(doc))
  return 1 if _errors(doc) else 0


if __name__ == "__main__":
  sys.exit(main())

"""Continuous batching over a paged quantized KV cache.

A minimal server: a page allocator (a free list), a fixed number of batch
slots, and a loop in which requests of different prompt lengths arrive,
take a slot and the pages they need, are prefilled, decode one token per
step together with the others, and leave, giving their pages back to the
pool for the next request.  The model is one attention layer with random
weights (an embedding, grouped-query attention, an unembedding of the
attention output, greedy decoding): small enough to run on the CPU in
seconds, and deterministic, so that a request served in a busy batch can
be checked against the same request served alone.

::

  python examples/serving.py [--requests 12] [--max-batch 4]
                             [--num-pages 40] [--page-size 16]
                             [--method int8] [--seed 0]

Everything the cache needs is in :mod:`jaxattn.decode`: the pool
(:class:`~jaxattn.decode.PagedKVCache`), the update
(:func:`~jaxattn.decode.append_paged`, jitted with the pool donated) and
:func:`jaxattn.decode_attention` with the rows' page tables.  The page
table and lengths live on the host (numpy), as in a real server's
scheduler, and go to the device with each step.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn
from jaxattn import decode


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 128
  features: int = 64
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 32
  page_size: int = 16
  num_pages: int = 40          # the pool, shared by every sequence
  max_batch: int = 4           # slots decoded together each step
  max_seq_len: int = 256       # prompt + generated tokens of one request
  method: str = "int8"

  @property
  def pages_per_seq(self) -> int:
    return -(-self.max_seq_len // self.page_size)


@dataclasses.dataclass
class Request:
  id: int
  prompt: np.ndarray           # int tokens [prompt_len]
  max_new_tokens: int
  arrival: int = 0             # the step at which it may join


class PageAllocator:
  """A free list of the pool's pages.  ``allocate(n)`` returns ``n`` pages
  (None when fewer are free: the request waits); ``free(pages)`` returns
  them.  A freed page is reused as it is: nothing past a sequence's length
  is ever read, and the new sequence's first append sets its key shift."""

  def __init__(self, num_pages: int):
    self.num_pages = num_pages
    self._free = collections.deque(range(num_pages))
    self.peak_in_use = 0
    self.allocated_total = 0

  @property
  def num_free(self) -> int:
    return len(self._free)

  def allocate(self, n: int) -> list[int] | None:
    if n > len(self._free):
      return None
    pages = [self._free.popleft() for _ in range(n)]
    self.allocated_total += n
    self.peak_in_use = max(self.peak_in_use, self.num_pages - self.num_free)
    return pages

  def free(self, pages: list[int]) -> None:
    self._free.extend(pages)


def init_weights(key, cfg: Config) -> dict[str, jax.Array]:
  ks = jax.random.split(key, 6)
  f, n, nk, d = cfg.features, cfg.heads, cfg.kv_heads, cfg.head_dim
  normal = lambda k, shape, fan_in: (jax.random.normal(k, shape)
                                     / np.sqrt(fan_in))
  return {"embed": jax.random.normal(ks[0], (cfg.vocab, f)),
          "wq": normal(ks[1], (f, n * d), f),
          "wk": normal(ks[2], (f, nk * d), f),
          "wv": normal(ks[3], (f, nk * d), f),
          "wo": normal(ks[4], (n * d, f), n * d),
          "unembed": normal(ks[5], (f, cfg.vocab), f)}


def _qkv(w, tokens, cfg: Config):
  """tokens int ``[B, T]`` -> q ``[B, T, N, D]``, k, v ``[B, T, K, D]``."""
  x = w["embed"][tokens]
  b, t = tokens.shape
  q = (x @ w["wq"]).reshape(b, t, cfg.heads, cfg.head_dim)
  k = (x @ w["wk"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
  v = (x @ w["wv"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
  return q, k, v


def _next_token(w, attn, cfg: Config):
  """Greedy next token of the last position, from its attention output
  alone (no residual: the token then depends on the context it attends
  to, not mostly on itself)."""
  b = attn.shape[0]
  h = attn[:, -1].reshape(b, cfg.heads * cfg.head_dim) @ w["wo"]
  return jnp.argmax(h @ w["unembed"], -1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="cfg", donate_argnums=1)
def prefill(w, cache, tokens, count, slot, page_row, *, cfg: Config):
  """One request's prompt (``tokens`` int ``[1, T_pad]``, its first
  ``count`` real) into its pages (``page_row`` ``[1, pages_per_seq]``) as
  sequence slot ``slot``; returns the pool and the first new token."""
  q, k, v = _qkv(w, tokens, cfg)
  zero = jnp.zeros(1, jnp.int32)
  cache = decode.append_paged(cache, k, v, zero, page_row,
                              seq_ids=slot[None], counts=count[None])
  # only the last prompt token's output is needed: its query attends to
  # the whole prompt (one decode token at length `count`)
  last = count - 1
  q_last = jax.lax.dynamic_slice_in_dim(q, last, 1, axis=1)
  attn = jaxattn.decode_attention(q_last, cache, count[None],
                                  page_indices=page_row, method=cfg.method)
  return cache, _next_token(w, attn, cfg)[0]


@functools.partial(jax.jit, static_argnames="cfg", donate_argnums=1)
def decode_step(w, cache, tokens, lengths, active, page_table, *,
                cfg: Config):
  """One token for every slot (``tokens`` int ``[max_batch]``): idle slots
  (``active`` False) append nothing and their output is ignored.  Returns
  the pool and the next tokens."""
  q, k, v = _qkv(w, tokens[:, None], cfg)
  counts = active.astype(jnp.int32)
  cache = decode.append_paged(cache, k, v, lengths, page_table,
                              counts=counts)
  attn = jaxattn.decode_attention(q, cache, lengths + counts,
                                  page_indices=page_table, method=cfg.method)
  return cache, _next_token(w, attn, cfg)


def _bucket(n: int, cfg: Config) -> int:
  """Prompts are padded to a multiple of 32 tokens (``counts`` masks the
  padding), so a few prefill shapes are compiled, not one per length."""
  return min(-(-n // 32) * 32, cfg.pages_per_seq * cfg.page_size)


def serve(requests: list[Request], cfg: Config, weights,
          log=None) -> tuple[dict[int, list[int]], dict[str, int]]:
  """Runs the requests to completion with continuous batching; returns
  ``({request id: generated tokens}, stats)``."""
  for r in requests:
    if len(r.prompt) < 1 or len(r.prompt) + r.max_new_tokens - 1 > (
        cfg.pages_per_seq * cfg.page_size) or r.max_new_tokens < 1:
      raise ValueError(f"request {r.id} does not fit max_seq_len "
                       f"{cfg.max_seq_len}")
  alloc = PageAllocator(cfg.num_pages)
  cache = decode.PagedKVCache.create(
      cfg.num_pages, cfg.page_size, cfg.kv_heads, cfg.head_dim,
      num_seqs=cfg.max_batch, method=cfg.method)
  table = np.zeros((cfg.max_batch, cfg.pages_per_seq), np.int32)
  lengths = np.zeros(cfg.max_batch, np.int32)
  last = np.zeros(cfg.max_batch, np.int32)     # each slot's newest token
  running: list[dict | None] = [None] * cfg.max_batch
  waiting = collections.deque(sorted(requests, key=lambda r: r.arrival))
  done: dict[int, list[int]] = {}
  step = steps_run = 0
  while waiting or any(running):
    # admit arrived requests (first come, first served) while a slot and
    # the pages for their whole life are free; a real server would grow a
    # sequence page by page and preempt when the pool runs dry
    while waiting and waiting[0].arrival <= step and None in running:
      r = waiting[0]
      need = -(-(len(r.prompt) + r.max_new_tokens - 1) // cfg.page_size)
      pages = alloc.allocate(need)
      if pages is None:
        break
      waiting.popleft()
      slot = running.index(None)
      table[slot] = 0              # entries past the last page: never read
      table[slot, :need] = pages
      t_pad = _bucket(len(r.prompt), cfg)
      tokens = np.zeros((1, t_pad), np.int32)
      tokens[0, :len(r.prompt)] = r.prompt
      cache, tok = prefill(weights, cache, jnp.asarray(tokens),
                           jnp.int32(len(r.prompt)), jnp.int32(slot),
                           jnp.asarray(table[slot:slot + 1]), cfg=cfg)
      lengths[slot], last[slot] = len(r.prompt), int(tok)
      running[slot] = {"request": r, "pages": pages, "out": [int(tok)]}
      if log:
        log(f"step {step}: request {r.id} (prompt {len(r.prompt)}) -> slot "
            f"{slot}, pages {pages}")
    active = np.array([s is not None and len(s["out"]) < s["request"]
                       .max_new_tokens for s in running])
    if active.any():
      cache, nxt = decode_step(weights, cache, jnp.asarray(last),
                               jnp.asarray(lengths), jnp.asarray(active),
                               jnp.asarray(table), cfg=cfg)
      nxt = np.asarray(nxt)
      lengths += active
      steps_run += 1
    for slot, s in enumerate(running):
      if s is None:
        continue
      if active[slot]:
        s["out"].append(int(nxt[slot]))
        last[slot] = nxt[slot]
      if len(s["out"]) == s["request"].max_new_tokens:   # finished: leave
        done[s["request"].id] = s["out"]
        alloc.free(s["pages"])
        running[slot] = None
        lengths[slot] = 0
        if log:
          log(f"step {step}: request {s['request'].id} done, "
              f"{len(s['pages'])} pages freed")
    step += 1
  stats = {"steps": step, "decode_steps": steps_run,
           "peak_pages_in_use": alloc.peak_in_use,
           "pages_allocated": alloc.allocated_total,
           "pages_free_at_end": alloc.num_free}
  return done, stats


def random_requests(n: int, cfg: Config, seed: int = 0, max_prompt: int = 100,
                    max_new: int = 12) -> list[Request]:
  rng = np.random.default_rng(seed)
  return [Request(id=i,
                  prompt=rng.integers(0, cfg.vocab,
                                      int(rng.integers(1, max_prompt + 1))),
                  max_new_tokens=int(rng.integers(1, max_new + 1)),
                  arrival=int(rng.integers(0, 2 * n)))
          for i in range(n)]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--requests", type=int, default=12)
  parser.add_argument("--max-batch", type=int, default=4)
  parser.add_argument("--num-pages", type=int, default=40)
  parser.add_argument("--page-size", type=int, default=16)
  parser.add_argument("--max-prompt", type=int, default=100)
  parser.add_argument("--max-new", type=int, default=12)
  parser.add_argument("--method", default="int8",
                      choices=sorted(decode.METHOD_CACHES))
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--verbose", action="store_true")
  args = parser.parse_args(argv)
  cfg = Config(num_pages=args.num_pages, page_size=args.page_size,
               max_batch=args.max_batch, method=args.method,
               max_seq_len=args.max_prompt + args.max_new)
  weights = init_weights(jax.random.key(args.seed), cfg)
  requests = random_requests(args.requests, cfg, args.seed, args.max_prompt,
                             args.max_new)
  start = time.perf_counter()
  done, stats = serve(requests, cfg, weights,
                      log=print if args.verbose else None)
  elapsed = time.perf_counter() - start
  for r in requests:
    print(f"request {r.id:3d}  prompt {len(r.prompt):4d}  "
          f"tokens {done[r.id]}")
  print(f"{len(requests)} requests, {stats['decode_steps']} batched decode "
        f"steps, method {cfg.method}, pool {cfg.num_pages} pages of "
        f"{cfg.page_size} (peak {stats['peak_pages_in_use']} in use, "
        f"{stats['pages_allocated']} allocated over the run), "
        f"{elapsed:.1f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())

"""Where the CPU suite's XLA compile time goes, per test: compiles of single
primitives (what an eager jnp call compiles, ``jit(multiply)``) against
compiles of whole functions.  A pytest plugin and its summary:

    COMPILE_LOG_OUT=/tmp/cl PYTHONPATH=benchmarks/profiles \\
        .venv/bin/python -m pytest -p pytest_compile_log -n 2 -m "not gpu" tests
    python benchmarks/profiles/pytest_compile_log.py /tmp/cl

Each worker writes ``{nodeid: [eager count, eager s, other count, other
s]}`` to ``$COMPILE_LOG_OUT.<worker>`` (from jax's ``log_compiles``
messages, backend compile seconds only); the summary adds them per test
function, most eager compile time first.
"""
import collections
import glob
import json
import logging
import os
import re
import sys

import pytest

_current = [None]
_stats = collections.defaultdict(lambda: [0, 0.0, 0, 0.0])
_primitives = set()
_finished = re.compile(r"Finished XLA compilation of jit\((\w+)\) in "
                       r"([\d.e-]+) sec")


class _Handler(logging.Handler):

  def emit(self, record):
    m = _finished.search(record.getMessage())
    if m and _current[0] is not None:
      at = 0 if m.group(1) in _primitives else 2
      _stats[_current[0]][at] += 1
      _stats[_current[0]][at + 1] += float(m.group(2))


def pytest_configure(config):
  import jax
  import jax.numpy as jnp
  from jax import lax
  jax.config.update("jax_log_compiles", True)
  # the names eager calls compile under: jnp and lax functions, and the
  # private jnp helpers they go through
  _primitives.update(n for mod in (jnp, lax) for n in dir(mod)
                     if not n.startswith("__"))
  _primitives.update({
      "_where", "_pad", "_reduce_max", "_reduce_min", "_reduce_sum",
      "_reduce_any", "_reduce_all", "_reduce_prod", "_normal", "_uniform",
      "_mean", "_var", "_argmax", "_take", "_gather", "_einsum", "_cumsum",
      "_roll", "_split", "_squeeze", "_rewriting_take", "_one_hot",
      "convert_element_type", "broadcast_in_dim", "true_divide"})
  logging.getLogger("jax").addHandler(_Handler())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
  _current[0] = item.nodeid
  yield
  _current[0] = None


def pytest_unconfigure(config):
  out = os.environ.get("COMPILE_LOG_OUT")
  if out:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(f"{out}.{worker}", "w") as f:
      json.dump(_stats, f)


def summarize(prefix, top=25):
  per_test = {}
  for path in glob.glob(prefix + ".gw*") + glob.glob(prefix + ".main"):
    with open(path) as f:
      per_test.update(json.load(f))
  per_function = collections.defaultdict(lambda: [0, 0.0, 0, 0.0, 0])
  for nodeid, row in per_test.items():
    acc = per_function[nodeid.split("[")[0]]
    for i, x in enumerate(row):
      acc[i] += x
    acc[4] += 1
  total = [sum(r[i] for r in per_function.values()) for i in range(4)]
  print("eager: %d compiles %.1f s; whole functions: %d compiles %.1f s"
        % tuple(total))
  print("  eager s     n |  other s    n | params  test")
  for name, r in sorted(per_function.items(), key=lambda x: -x[1][1])[:top]:
    print("%9.1f %5d | %8.1f %4d | %6d  %s"
          % (r[1], r[0], r[3], r[2], r[4], name))


if __name__ == "__main__":
  summarize(sys.argv[1])

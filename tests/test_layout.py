"""The package layout: dependencies point one way.

``pallas_kernels`` (kernels: arrays and static flags) never imports
``jaxattn``; ``jaxattn`` (methods, operands, backends, API, integrations) sits
on top; the import graph of the two has no cycle, and no module hides an
import of the other package's modules inside a function."""
import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jaxattn", "pallas_kernels")


def _modules():
  """``{module name: path}`` of every module of the two packages."""
  out = {}
  for pkg in PACKAGES:
    for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
      for f in files:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3]
          name = rel.replace(os.sep, ".")
          out[name.removesuffix(".__init__")] = os.path.join(dirpath, f)
  return out


def _imports(path, modules):
  """``[(imported module, at module level?)]`` of the project's modules
  that ``path`` imports (``from a import b`` names ``a.b`` when that is a
  module)."""
  tree = ast.parse(open(path).read())
  top = set(map(id, tree.body))
  found = []
  for node in ast.walk(tree):
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}"
               in modules else node.module for a in node.names]
    for name in names:
      if name.split(".")[0] in PACKAGES:
        found.append((name, id(node) in top))
  return found


def test_import_graph_has_no_cycle_and_no_hidden_imports():
  modules = _modules()
  graph, hidden = {}, []
  for name, path in modules.items():
    deps = _imports(path, modules)
    graph[name] = {d for d, _ in deps if d in modules and d != name}
    hidden += [(name, d) for d, at_top in deps if not at_top]
  assert not hidden, f"function-local imports of project modules: {hidden}"
  state = {}

  def visit(node, stack):
    state[node] = "open"
    for dep in sorted(graph[node]):
      if state.get(dep) == "open":
        raise AssertionError(f"import cycle: {stack[stack.index(dep):]}"
                             f" -> {dep}")
      if dep not in state:
        visit(dep, stack + [dep])
    state[node] = "done"

  for name in sorted(graph):
    if name not in state:
      visit(name, [name])
  assert len(graph) > 20  # the walk saw the packages


def test_kernels_import_nothing_from_jaxattn():
  modules = _modules()
  for name, path in modules.items():
    if name.startswith("pallas_kernels"):
      bad = [d for d, _ in _imports(path, modules) if d.startswith("jaxattn")]
      assert not bad, (name, bad)


def test_importing_the_kernels_loads_no_method_module():
  """In a fresh interpreter: every kernel module imports, and no jaxattn
  module (method, configuration or otherwise) gets loaded."""
  code = ("import sys; import pallas_kernels.common, pallas_kernels.flash, "
          "pallas_kernels.quantized, pallas_kernels.quantizers, "
          "pallas_kernels.mosaic, pallas_kernels.paged; "
          "print(sorted(m for m in sys.modules if m.split('.')[0] in "
          "('jaxattn', 'pallas_kernels')))")
  r = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  loaded = eval(r.stdout.strip().splitlines()[-1])  # noqa: S307 (a list)
  assert "pallas_kernels.mosaic" in loaded
  assert [m for m in loaded if m.startswith("jaxattn")] == []


def test_every_backend_table_names_known_methods():
  """A newcomer finds the kernel of any method in one table per backend."""
  from jaxattn import api, methods
  for name, backend in api.BACKENDS.items():
    assert set(backend.ADAPTERS) <= set(methods.METHODS), name
    assert backend.NAME == name
  assert set(api.BACKENDS["reference"].ADAPTERS) == set(methods.METHODS)
  assert api.PREFERENCE[-1] == "reference"


def _count_lines(path):
  with open(os.path.join(ROOT, path)) as f:
    return sum(1 for _ in f)


def test_the_tree_stays_lean():
  """What a maintainer reads: at most 10 maintained benchmark scripts, 25
  recorded results, 800 lines of design note, 300 of README and 250 of
  the benchmarks' README."""
  scripts = [os.path.join(d, f)
             for d, _, files in os.walk(os.path.join(ROOT, "benchmarks"))
             for f in files if f.endswith(".py")]
  assert len(scripts) <= 10, sorted(scripts)
  results = os.listdir(os.path.join(ROOT, "benchmarks", "results"))
  assert len(results) <= 25, sorted(results)
  assert _count_lines("docs/design.md") <= 800
  assert _count_lines("README.md") <= 300
  assert _count_lines("benchmarks/README.md") <= 250


def test_the_library_names_only_scripts_that_exist():
  """Comments and docstrings of the library and the tests point at
  benchmark scripts that are there (an experiment's script is not kept:
  its commit holds the evidence)."""
  import re
  pattern = re.compile(r"benchmarks/[\w/]+\.(?:py|sh)")
  missing = []
  for top in (*PACKAGES, "tests"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
      for f in files:
        if f.endswith(".py"):
          path = os.path.join(dirpath, f)
          for ref in pattern.findall(open(path).read()):
            if not os.path.exists(os.path.join(ROOT, ref)):
              missing.append((os.path.relpath(path, ROOT), ref))
  assert not missing, missing

"""``python -m jaxattn {report,bench} [options]``: the accuracy report
(:mod:`jaxattn.report`) and the GPU benchmark (:mod:`jaxattn.bench`)."""
import importlib
import sys

# ``python -m jaxattn bench --grid`` and ``--torch``: the benchmarks of the
# shapes models run and of jaxattn.torch's host time, with their own options
BENCHMARKS = {"--grid": "bench_grid", "--torch": "bench_torch"}
COMMANDS = {
    "report": "accuracy / robustness report of the papers' cases (CPU or GPU)",
    "bench": "times the kernels against cuDNN and the peers (GPU)",
}


def usage():
  lines = [f"usage: python -m jaxattn {{{','.join(COMMANDS)}}} [options]", ""]
  lines += [f"  {name:8s}{text}" for name, text in COMMANDS.items()]
  lines += ["", "`python -m jaxattn COMMAND --help` lists a command's options."]
  return "\n".join(lines)


def main(argv=None):
  """Runs a command; returns the exit code (2 and the usage on stderr for a
  missing or unknown command)."""
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] in ("-h", "--help"):
    print(usage())
    return 0
  if not argv or argv[0] not in COMMANDS:
    print(usage(), file=sys.stderr)
    return 2
  module, rest = argv[0], list(argv[1:])
  for flag, other in BENCHMARKS.items():   # bench's own benchmarks
    if module == "bench" and flag in rest:
      rest.remove(flag)
      module = other
  importlib.import_module(f"jaxattn.{module}").main(rest)
  return 0


if __name__ == "__main__":
  sys.exit(main())

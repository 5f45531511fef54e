"""``python -m jaxattn {report,bench} [options]``: the accuracy report
(:mod:`jaxattn.report`) and the GPU benchmark (:mod:`jaxattn.bench`)."""
import importlib
import sys

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
  importlib.import_module(f"jaxattn.{argv[0]}").main(argv[1:])
  return 0


if __name__ == "__main__":
  sys.exit(main())

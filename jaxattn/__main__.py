"""``python -m jaxattn report ...`` (see :mod:`jaxattn.report`)."""
import sys

COMMANDS = ("report",)


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] not in COMMANDS:
    print(f"usage: python -m jaxattn {{{','.join(COMMANDS)}}} [options]",
          file=sys.stderr)
    return 2
  if argv[0] == "report":
    from jaxattn import report
    report.main(argv[1:])
  return 0


if __name__ == "__main__":
  sys.exit(main())

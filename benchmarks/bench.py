"""``python benchmarks/bench.py [options]`` is ``python -m jaxattn bench
[options]``: the benchmark harness lives in :mod:`jaxattn.bench` (options,
output and JSON format are documented there)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                ".."))
from jaxattn.bench import main  # noqa: E402

if __name__ == "__main__":
  main(prog="benchmarks/bench.py")

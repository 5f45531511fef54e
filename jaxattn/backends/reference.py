"""The references: every method's bit-faithful emulation in plain JAX (the
CPU's backend, and the ground truth of the kernels' tests)."""
from __future__ import annotations

from jaxattn.backends import Adapter
from jaxattn.methods import METHODS

NAME = "reference"
TITLE = "reference"


def native() -> bool:
  return True


ADAPTERS = {name: Adapter(run=m.reference) for name, m in METHODS.items()}

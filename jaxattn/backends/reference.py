"""The references: every method's bit-faithful emulation in plain JAX (the
CPU's backend, and the ground truth of the kernels' tests)."""
from __future__ import annotations

from jaxattn.backends import Adapter
from jaxattn.methods import METHODS

NAME = "reference"
TITLE = "reference"


def native() -> bool:
  return True


# INT8's per-tensor V scale becomes one per packed document
# (:func:`jaxattn.int_flash.quantize_kv_head`)
SEGMENT_SCALES = ("int8",)
ADAPTERS = {name: Adapter(run=m.reference,
                          segment_scales=name in SEGMENT_SCALES)
            for name, m in METHODS.items()}

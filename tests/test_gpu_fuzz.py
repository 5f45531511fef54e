"""The fuzz test (tests/test_fuzz.py) on the GPU kernels, at larger shapes:
lengths up to 700 (many key blocks, partial last blocks), head dims 64 and
128, every method, backend, dtype, mask and scale of the CPU suite.
``JAXATTN_GPU_FUZZ_EXAMPLES`` sets the number of draws (default 60)."""
import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from test_fuzz import calls, check

pytestmark = pytest.mark.gpu
EXAMPLES = int(os.environ.get("JAXATTN_GPU_FUZZ_EXAMPLES", "60"))


@st.composite
def gpu_calls(draw):
  c = draw(calls())
  c.update(t=draw(st.integers(1, 700)), s=draw(st.integers(1, 700)),
           d=draw(st.sampled_from([64, 128])),
           backend=draw(st.sampled_from(("triton", "mosaic"))))
  if c["lens"] is not None:
    c["lens"] = [min(n, c["s"]) for n in c["lens"]]
  return c


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          database=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow])
@given(c=gpu_calls())
def test_gpu_fuzz_every_method_and_backend(c):
  check(c)

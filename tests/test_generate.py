"""benchmarks/generate.py end to end in --tiny mode on the CPU: every
section's numbers, and the 8-bit caches' greedy tokens against bf16's.
No timing assertions (the numbers only have to exist)."""
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("flax")

_spec = importlib.util.spec_from_file_location(
    "generate_benchmark",
    Path(__file__).parents[1] / "benchmarks" / "generate.py")
generate = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = generate   # (its dataclasses look it up)
_spec.loader.exec_module(generate)

# (fp8's paged cache takes int8's path with another dtype: the GPU run
# records it; the CPU suite keeps to two caches for its time)
CACHES = ("bf16_cudnn", "int8_paged")


def _positive(x):
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_tiny_run_reports_every_section(tmp_path):
  out = tmp_path / "generate.json"
  rc = generate.main(["--tiny", "--steps", "2", "--prompts", "32",
                      "--caches", ",".join(CACHES), "--out", str(out)])
  doc = json.loads(out.read_text())
  assert rc == 0, {k: doc[k] for k in generate.SECTIONS}
  for section in generate.SECTIONS:
    assert "error" not in doc[section], doc[section]
  for name in CACHES:
    assert _positive(doc["meta"]["bytes_per_token"][name])
    th = doc["throughput"][name]
    assert th["batch"] == 32 and _positive(th["tokens_per_s"])
    assert _positive(th["ms_per_step"])
    ca = doc["capacity"][name]
    assert ca["max_batch"] >= 1 and _positive(ca["tokens_per_s"])
    assert ca["cache_gb_held"] <= doc["meta"]["cache_gb"]
    tt = doc["ttft"][name]["32"]
    assert all(_positive(tt[k]) for k in ("ttft_ms", "prefill_ms",
                                          "first_step_ms"))
  # an 8-bit token is 8-bit values plus a float32 scale per KV head
  bpt = doc["meta"]["bytes_per_token"]
  assert bpt["int8_paged"] < bpt["bf16_cudnn"]
  # paged rows hold only their pages: more of them fit the budget
  assert (doc["capacity"]["int8_paged"]["max_batch"]
          > doc["capacity"]["bf16_cudnn"]["max_batch"])
  greedy = doc["greedy"]
  assert greedy["reference"] == "bf16_cudnn"
  assert _positive(greedy["logit_spread"])
  for name in CACHES[1:]:
    g = greedy[name]
    assert g["logits_finite"]
    for key in ("token_match", "forced_argmax_match"):
      assert 0.0 <= g[key] <= 1.0
    assert math.isfinite(g["max_abs_logit_diff"])
    # the documented tolerance: teacher-forced logits within
    # REL_LOGIT_TOL of the bf16 logits' spread
    assert g["within_tol"], g
    assert g["rel_logit_diff"] <= generate.REL_LOGIT_TOL

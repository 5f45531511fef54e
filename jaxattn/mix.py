"""SageAttn-mix: the per-layer choice between SageAttention2's 4-bit and
8-bit presets (SageAttention2 technical report, section 4)."""
from __future__ import annotations

import math

import jax.numpy as jnp

from jaxattn import api, metrics, sage


def choose_precision(calibration, *, xi_percent: float, low: str = "sage2-4b",
                     high: str = "sage2-8b", is_causal: bool = False,
                     implementation: str | None = None,
                     return_scores: bool = False):
  """SageAttn-mix: the per-layer 4-bit / 8-bit choice of the SageAttention2
  report.

  For each key of ``calibration`` (a layer, or a ``(layer, timestep)`` pair
  for diffusion models) mapping to calibration inputs ``(q, k, v)`` (BTNH),
  measures ``accuracy = cossim * (1 - relative L1)`` of the ``low`` preset
  against float32 attention, and assigns the ``high`` preset to the worst
  ``xi_percent`` percent of the keys (rounded up), ``low`` to the rest.  The
  paper's xi: Llama2 50, CogVideoX 60, Open-Sora 25, Llama3.1 / GLM4 30.

  Returns the plain mapping ``{key: preset}`` to pass back as
  ``sage_attention(..., preset=choice[key])`` (and the accuracies
  ``{key: float}`` too if ``return_scores``).
  """
  if not 0.0 <= xi_percent <= 100.0:
    raise ValueError(f"xi_percent must be in [0, 100], got {xi_percent}")
  for preset in (low, high):
    if preset not in sage.PRESETS:
      raise ValueError(f"unknown preset {preset!r}; valid: "
                       f"{sorted(sage.PRESETS)}")
  scores = {}
  for key, (q, k, v) in calibration.items():
    ref = api.dot_product_attention(
        *(jnp.asarray(x, jnp.float32) for x in (q, k, v)), method="fp32",
        is_causal=is_causal, implementation="reference")
    out = api.dot_product_attention(q, k, v, method="sage", preset=low,
                                    is_causal=is_causal,
                                    implementation=implementation)
    scores[key] = (metrics.cosine_similarity(out, ref)
                   * (1.0 - metrics.relative_l1(out, ref)))
  n_high = math.ceil(len(scores) * xi_percent / 100.0)
  worst = set(sorted(scores, key=lambda key: scores[key])[:n_high])
  choice = {key: high if key in worst else low for key in scores}
  return (choice, scores) if return_scores else choice


"""The accuracy / robustness report: the papers' cases on the references.

``python -m jaxattn report [--json PATH] [--quick] [--implementation ...]
[--plot DIR]`` prints one table per family and writes the same numbers as
JSON:

* PASA Table 4 at shape (1, 16, 1280, 128): NaN percentage of ``fp16_fp32``,
  ``fp16``, ``pasa`` and ``fp32`` and their relative RMSE against a float64
  reference.
* SageAttention2 granularities (token / warp / block / tensor, int4 and
  int8, with and without smoothing) on channel-outlier keys: cosine
  similarity, relative L1 and RMSE against float64 attention.
* INT-FlashAttention: the fp8 baseline, full-INT8 (per-tensor and per-block
  V) and half-INT8, plus the 8-bit FMHA, on N(0, 1) and U(-0.5, 0.5) inputs:
  the paper's mean relative error ``mean|O - O_ref| / mean|O_ref|``.

``--plot DIR`` adds the sweep of the PASA paper's Figures 9 and 10 (relative
RMSE against the inputs' mean ``x0`` at a fixed amplitude ``Am`` and against
``Am`` at a fixed ``x0``, :func:`pasa_sweep`) and writes PNGs of it and of
Table 4's NaN percentages (:func:`plot`; matplotlib, imported only then).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn
from jaxattn import data, metrics, pasa
from jaxattn.metrics import exact_attention


def mean_relative_error(out, ref) -> float:
  """INT-FlashAttention's metric: ``mean|O - O_ref| / mean|O_ref|``."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.mean(np.abs(out - ref)) / np.mean(np.abs(ref)))


class Progress:
  """A progress bar on stderr: tqdm's when tqdm imports and the stream is a
  terminal, else a built-in one, redrawn in place on a terminal and one line
  per step otherwise (logs, pipes)."""

  WIDTH = 24

  def __init__(self, total, stream=None):
    self.stream = sys.stderr if stream is None else stream
    self.total, self.done, self.t0 = total, 0, time.time()
    self.label = ""
    self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
    self._tqdm = None
    if self.tty:
      try:
        from tqdm import tqdm
        self._tqdm = tqdm(total=total, file=self.stream, dynamic_ncols=True)
      except ImportError:
        pass

  def _line(self, label):
    return f"[{self.done}/{self.total}] {time.time() - self.t0:6.1f}s {label}"

  def _draw(self, label):
    filled = self.WIDTH * self.done // max(self.total, 1)
    bar = "#" * filled + "." * (self.WIDTH - filled)
    self.stream.write(f"\r\033[K{bar} {self._line(label)[:70]}")
    self.stream.flush()

  def step(self, label=""):
    """Marks one step done; ``label`` says which."""
    self.done += 1
    self.label = label
    if self._tqdm is not None:
      self._tqdm.set_postfix_str(label, refresh=False)
      self._tqdm.update(1)
    elif self.tty:
      self._draw(label)
    else:
      self.stream.write(self._line(label) + "\n")
      self.stream.flush()
    if self.done == self.total:
      self.close()

  def write(self, text, file=None):
    """Prints ``text`` (to stdout by default) without breaking the bar."""
    file = sys.stdout if file is None else file
    if self._tqdm is not None:
      self._tqdm.write(text, file=file)
      return
    live = self.tty and 0 < self.done < self.total
    if live:
      self.stream.write("\r\033[K")
      self.stream.flush()
    print(text, file=file, flush=True)
    if live:
      self._draw(self.label)

  def close(self):
    if self._tqdm is not None:
      self._tqdm.close()
      self._tqdm = None
    elif self.tty and self.done:
      self.stream.write("\n")
      self.stream.flush()
    self.tty = False


# The precision allocations PASA compares (its Figures 9 and 10, Table 4):
# label -> (method, options).  "pasa" is jaxattn's default allocation
# (float32 state, sum-preserving keys); "pasa_algorithm1" the paper's
# Algorithm 1 literally.
PASA_ALLOCATIONS = {
    "fp16_fp32": ("fp16_fp32", {}),
    "fp16": ("fp16", {}),
    "pasa": ("pasa", {}),
    "pasa_algorithm1": ("pasa", pasa.ALGORITHM1),
    "fp32": ("fp32", {}),
}
PASA_METHODS = tuple(PASA_ALLOCATIONS)


def _pasa_errors(q, k, v, ref, impl, progress, label):
  """``{label}_nan_pct`` and ``{label}_rel_rmse`` of every PASA_METHODS."""
  row = {}
  for name in PASA_METHODS:
    method, options = PASA_ALLOCATIONS[name]
    out = jaxattn.dot_product_attention(q, k, v, method=method,
                                        implementation=impl, **options)
    row[f"{name}_nan_pct"] = 100.0 * metrics.nan_fraction(out)
    row[f"{name}_rel_rmse"] = metrics.relative_rmse(out, ref)
    if progress is not None:
      progress.step(f"{label} {name}")
  return row


def pasa_table4(shape, impl, progress=None):
  rows = []
  for case in data.PASA_TABLE4_CASES:
    q, k, v = data.pasa_case(jax.random.key(0), case, shape, jnp.float16)
    ref = exact_attention(q, k, v)
    row = dict(case=case["name"], x0=case["x0"], am=case["am"],
               paper_fp16_fp32_nan_pct=case["paper_nan_pct"])
    row.update(_pasa_errors(q, k, v, ref, impl, progress,
                            f"PASA {case['name']}"))
    rows.append(row)
  return rows


# The PASA paper's Figures 9 (uniform, Eq. 17) and 10 (hybrid, Eq. 18):
# panel (a) varies the mean x0 at a fixed amplitude Am, panel (b) Am at a
# fixed x0.
PASA_SWEEPS = (
    dict(figure=9, dist="uniform", fixed_am=0.5, x0s=(0, 10, 20, 25, 30),
         fixed_x0=20.0, ams=(0.5, 5, 10, 15, 20)),
    dict(figure=10, dist="hybrid", fixed_am=10.0, x0s=(0, 10, 20, 25, 30),
         fixed_x0=20.0, ams=(10, 20, 50, 100)),
)
QUICK_PASA_SWEEPS = (
    dict(PASA_SWEEPS[0], x0s=(0, 20, 30), ams=(0.5, 15, 20)),
    dict(PASA_SWEEPS[1], x0s=(0, 20, 30), ams=(10, 50, 100)),
)


def sweep_points(sweeps):
  """``[(figure, dist, vary, x0, am)]``: every point of ``sweeps``."""
  return [(sw["figure"], sw["dist"], vary, float(x0), float(am))
          for sw in sweeps
          for vary, x0, am in (
              [("x0", x0, sw["fixed_am"]) for x0 in sw["x0s"]]
              + [("am", sw["fixed_x0"], am) for am in sw["ams"]])]


def sweep_inputs(sweeps):
  """The distinct ``(dist, x0, am)`` inputs of ``sweeps`` (the point where
  panels (a) and (b) cross is computed once)."""
  return list(dict.fromkeys((p[1], p[3], p[4]) for p in sweep_points(sweeps)))


def pasa_sweep(shape, impl="reference", progress=None, sweeps=PASA_SWEEPS):
  """PASA Figures 9 and 10: NaN % and relative RMSE (vs float64) of
  PASA_METHODS on :func:`data.pasa_uniform` / :func:`data.pasa_hybrid`
  inputs over the ``x0`` and ``Am`` values of ``sweeps``; one row per
  point, ``vary`` saying which panel ("x0" or "am") it belongs to."""
  errors = {}
  for dist, x0, am in sweep_inputs(sweeps):
    case = dict(dist=dist, x0=x0, am=am)
    q, k, v = data.pasa_case(jax.random.key(3), case, shape, jnp.float16)
    ref = exact_attention(q, k, v)
    errors[dist, x0, am] = _pasa_errors(q, k, v, ref, impl, progress,
                                        f"{dist} x0={x0:g} Am={am:g}")
  return [dict(figure=figure, dist=dist, vary=vary, x0=x0, am=am,
               **errors[dist, x0, am])
          for figure, dist, vary, x0, am in sweep_points(sweeps)]


SAGE_VARIANTS = [
    # (label, options)
    *[(f"int8 {g}", dict(qk_dtype="int8", qk_granularity=g))
      for g in ("token", "warp", "block", "tensor")],
    *[(f"int4 {g}", dict(qk_dtype="int4", qk_granularity=g))
      for g in ("token", "warp", "block", "tensor")],
    ("int4 warp, no smoothing", dict(qk_dtype="int4", qk_granularity="warp",
                                     smooth_q=False, smooth_k=False,
                                     smooth_v=False)),
    ("sage1 (int8 block, fp16 PV)", dict(preset="sage1")),
]


def sage_granularity(shape, impl, progress):
  q, k, v = data.channel_outlier(jax.random.key(1), shape, jnp.float16)
  ref = exact_attention(q, k, v)
  rows = []
  for label, opts in SAGE_VARIANTS:
    out = jaxattn.dot_product_attention(q, k, v, method="sage",
                                        implementation=impl, **opts)
    s = metrics.summary(out, ref)
    rows.append(dict(variant=label, cos_sim=s["cos_sim"], rel_l1=s["rel_l1"],
                     rmse=s["rmse"], nan_frac=s["nan_frac"]))
    progress.step(f"sage {label}")
  return rows


INT_VARIANTS = [
    ("fp8 (FA3-style)", "fp8", {}),
    ("full-INT8, V per tensor", "int8", dict(v_granularity="tensor")),
    ("full-INT8, V per block", "int8", dict(v_granularity="block")),
    ("half-INT8 (fp16 PV)", "int8", dict(pv_dtype="fp16")),
    ("8-bit FMHA, dynamic", "fmha_int8", {}),
]


def int_flash(shape, impl, progress):
  rows = []
  for dist, gen in (("normal", data.normal), ("uniform", data.uniform)):
    q, k, v = gen(jax.random.key(2), shape, jnp.float16)
    ref = exact_attention(q, k, v)
    for label, method, opts in INT_VARIANTS:
      out = jaxattn.dot_product_attention(q, k, v, method=method,
                                          implementation=impl, **opts)
      rows.append(dict(data=dist, variant=label,
                       mean_rel_err=mean_relative_error(out, ref),
                       rel_rmse=metrics.relative_rmse(out, ref)))
      progress.step(f"{dist} {label}")
  return rows


def _table(title, rows, cols):
  lines = [f"\n== {title}"]
  widths = [max(len(c), *(len(_fmt(r[c])) for r in rows)) for c in cols]
  lines.append("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
  for r in rows:
    lines.append("  ".join(_fmt(r[c]).rjust(w) for c, w in zip(cols, widths)))
  return "\n".join(lines)


def _fmt(x):
  if isinstance(x, float):
    return f"{x:.4g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"
  return str(x)


def run(quick=False, implementation="reference", stream=None,
        sweep=False):
  """Computes every table (and, with ``sweep``, :func:`pasa_sweep`), printed
  to ``stream`` (None: ``sys.stdout`` at the call, so that a redirection
  made after import is followed); returns the JSON-able dict."""
  stream = sys.stdout if stream is None else stream
  pasa_shape = (1, 320, 4, 128) if quick else (1, 1280, 16, 128)
  sage_shape = (1, 256, 2, 128) if quick else (1, 1024, 8, 128)
  int_shape = (1, 256, 2, 128) if quick else (1, 1024, 8, 128)
  sweep_shape = (1, 256, 2, 128) if quick else (1, 1024, 4, 128)
  sweeps = QUICK_PASA_SWEEPS if quick else PASA_SWEEPS
  total = (len(PASA_METHODS) * len(data.PASA_TABLE4_CASES)
           + len(SAGE_VARIANTS) + 2 * len(INT_VARIANTS)
           + (len(PASA_METHODS) * len(sweep_inputs(sweeps)) if sweep else 0))
  progress = Progress(total)
  shapes = dict(pasa=pasa_shape, sage=sage_shape, int_flash=int_shape)
  if sweep:
    shapes["pasa_sweep"] = sweep_shape
  doc = dict(
      jax=jax.__version__, device=jax.devices()[0].device_kind,
      implementation=implementation, shapes=shapes,
      pasa_table4=pasa_table4(pasa_shape, implementation, progress),
      sage_granularity=sage_granularity(sage_shape, implementation, progress),
      int_flash=int_flash(int_shape, implementation, progress),
  )
  if sweep:
    doc["pasa_sweep"] = pasa_sweep(sweep_shape, implementation, progress,
                                   sweeps)
  progress.close()
  stream.write(_table(
      f"PASA Table 4, shape {_bnsd(pasa_shape)}: NaN % and relative RMSE vs "
      "float64",
      doc["pasa_table4"],
      ["case", "paper_fp16_fp32_nan_pct", "fp16_fp32_nan_pct",
       "fp16_fp32_rel_rmse", "fp16_nan_pct", "pasa_nan_pct", "pasa_rel_rmse",
       "pasa_algorithm1_rel_rmse", "fp32_rel_rmse"]))
  stream.write(_table(
      "SageAttention2 granularities on channel-outlier keys (vs float64)",
      doc["sage_granularity"], ["variant", "cos_sim", "rel_l1", "rmse"]))
  stream.write(_table(
      "INT-FlashAttention: mean relative error vs float64",
      doc["int_flash"], ["data", "variant", "mean_rel_err", "rel_rmse"]))
  if sweep:
    stream.write(_table(
        f"PASA Figures 9-10 sweep, shape {_bnsd(sweep_shape)}: relative RMSE "
        "vs float64 (nan: NaN in the output)",
        doc["pasa_sweep"],
        ["dist", "vary", "x0", "am", "fp16_fp32_nan_pct",
         *(f"{m}_rel_rmse" for m in PASA_METHODS)]))
  stream.write("\n")
  return doc


def _bnsd(shape):
  """A BTNH shape written as the papers' (B,N,S,D)."""
  b, s, n, d = shape
  return f"(B,N,S,D)=({b},{n},{s},{d})"


# Colours of the PASA methods in every plot.
METHOD_COLOURS = {"fp16_fp32": "tab:red", "fp16": "tab:orange",
                  "pasa": "tab:blue", "pasa_algorithm1": "tab:purple",
                  "fp32": "tab:green",
                  "paper_fp16_fp32": "0.6"}


def require_matplotlib():
  """Raises SystemExit naming the extra to install when matplotlib is
  missing."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    raise SystemExit("--plot needs matplotlib: pip install 'jaxattn[plot]'"
                     ) from None


def new_figure(ncols=1, width=6.0, height=4.2):
  """``(figure, axes)``: a matplotlib Figure on the Agg canvas (no pyplot
  state) with ``ncols`` axes side by side."""
  require_matplotlib()
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure
  fig = Figure(figsize=(width * ncols, height), layout="constrained")
  FigureCanvasAgg(fig)
  return fig, fig.subplots(1, ncols, squeeze=False)[0]


def plot_pasa_sweep(rows, path, shape=None):
  """One figure of :func:`pasa_sweep`'s rows of one distribution, the PASA
  paper's Figure 9 or 10: relative RMSE against x0 (left) and Am (right),
  log scale; a NaN output is marked by text, as in the paper."""
  import math
  fig, axes = new_figure(2, width=5.2)
  dist, figure = rows[0]["dist"], rows[0]["figure"]
  for ax, vary, other in zip(axes, ("x0", "am"), ("am", "x0")):
    panel = [r for r in rows if r["vary"] == vary]
    if not panel:
      ax.set_axis_off()
      continue
    for i, m in enumerate(PASA_METHODS):
      ok = [r for r in panel if math.isfinite(r[f"{m}_rel_rmse"])]
      ax.plot([r[vary] for r in ok], [r[f"{m}_rel_rmse"] for r in ok],
              marker="o", color=METHOD_COLOURS[m], label=m)
      for r in panel:
        if not math.isfinite(r[f"{m}_rel_rmse"]):
          ax.annotate(f"{m} NaN {r[f'{m}_nan_pct']:.3g}%",
                      (r[vary], 0.97 - 0.06 * i),
                      xycoords=ax.get_xaxis_transform(), ha="right",
                      va="top", fontsize=7, color=METHOD_COLOURS[m])
          ax.plot([r[vary]], [0.955 - 0.06 * i], marker="x", markersize=6,
                  color=METHOD_COLOURS[m], transform=ax.get_xaxis_transform())
    ax.set_yscale("log")
    ax.set_ylim(top=ax.get_ylim()[1] * 30)  # room for the NaN marks
    ax.set_xlabel({"x0": "mean x0", "am": "amplitude Am"}[vary])
    ax.set_ylabel("relative RMSE vs float64")
    name = {"x0": "x0", "am": "Am"}[other]
    ax.set_title(f"({'ab'[vary == 'am']}) fixed {name} = {panel[0][other]:g}")
    ax.grid(True, which="both", alpha=0.3)
  axes[0].legend(loc="lower right", fontsize=8)
  where = f", {_bnsd(shape)}" if shape else ""
  fig.suptitle(f"PASA Figure {figure} style: {dist} inputs{where}")
  fig.savefig(path, dpi=100)
  return path


def plot_table4_nan(rows, path, shape=None):
  """Bar chart of the NaN percentage per PASA Table 4 case and method, with
  the paper's fp16_fp32 figure beside."""
  import numpy as np
  fig, (ax,) = new_figure(1, width=10.0, height=4.6)
  series = [*PASA_METHODS, "paper_fp16_fp32"]
  x = np.arange(len(rows))
  width = 0.8 / len(series)
  for i, m in enumerate(series):
    values = [r[f"{m}_nan_pct"] for r in rows]
    bars = ax.bar(x + (i - (len(series) - 1) / 2) * width, values, width,
                  color=METHOD_COLOURS[m], label=m.replace("paper_", "paper "),
                  hatch="//" if m.startswith("paper") else None)
    ax.bar_label(bars, [f"{v:.3g}" for v in values], fontsize=7, padding=2,
                 rotation=90)
  ax.set_xticks(x, [r["case"] for r in rows], rotation=15, fontsize=8)
  ax.set_ylim(0, 125)
  ax.set_ylabel("NaN outputs (%)")
  where = f" at {_bnsd(shape)}" if shape else ""
  ax.set_title(f"PASA Table 4 cases: NaN percentage per method{where} "
               "(paper: (1,16,1280,128))", fontsize=10)
  fig.legend(fontsize=8, ncols=len(series), loc="outside lower center")
  fig.savefig(path, dpi=100)
  return path


def plot(doc, out_dir):
  """Writes the report's PNGs into ``out_dir`` (Table 4's NaN bars and, when
  ``doc`` has the sweep, one figure per distribution); returns their
  paths."""
  os.makedirs(out_dir, exist_ok=True)
  shapes = doc.get("shapes", {})
  paths = [plot_table4_nan(doc["pasa_table4"],
                           os.path.join(out_dir, "pasa_table4_nan.png"),
                           shapes.get("pasa"))]
  sweep = doc.get("pasa_sweep", [])
  for dist in dict.fromkeys(r["dist"] for r in sweep):
    rows = [r for r in sweep if r["dist"] == dist]
    name = f"pasa_fig{rows[0]['figure']}_{dist}.png"
    paths.append(plot_pasa_sweep(rows, os.path.join(out_dir, name),
                                 shapes.get("pasa_sweep")))
  return paths


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m jaxattn report",
                              description=__doc__.split("\n")[0])
  p.add_argument("--json", default="", help="write the numbers as JSON here")
  p.add_argument("--quick", action="store_true", help="small shapes")
  p.add_argument("--implementation", default="reference",
                 choices=["reference", "triton"])
  p.add_argument("--plot", default="", metavar="DIR",
                 help="also run the PASA Figures 9-10 sweep and write PNG "
                 "plots here (needs matplotlib)")
  a = p.parse_args(argv)
  if a.plot:
    require_matplotlib()
  doc = run(quick=a.quick, implementation=a.implementation,
            sweep=bool(a.plot))
  if a.json:
    with open(a.json, "w") as f:
      json.dump(doc, f, indent=1, default=float)
    print(f"wrote {a.json}")
  if a.plot:
    for path in plot(doc, a.plot):
      print(f"wrote {path}")
  return doc

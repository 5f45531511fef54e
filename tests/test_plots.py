"""The command line (``python -m jaxattn``, ``bench`` without a GPU) and the
plots of ``report --plot`` and ``bench --plot``: each PNG is opened and
checked to be a real image with the methods' colours in it."""
import io
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from jaxattn import __main__ as cli
from jaxattn import bench, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Three recorded bench documents (older runs, kept as fixtures): a later
# document's point replaces an earlier one's.
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
RECORDED = [os.path.join(FIXTURES, f"bench_h100_run{n}.json")
            for n in (8, 9, 10)]
SHAPE = (1, 256, 2, 128)  # report --quick's sweep shape
SMALL_SWEEPS = (
    dict(report.PASA_SWEEPS[0], x0s=(0, 30), ams=(0.5, 20)),
    dict(report.PASA_SWEEPS[1], x0s=(0, 30), ams=(10, 100)),
)
TAB = {"tab:red": (214, 39, 40), "tab:orange": (255, 127, 14),
       "tab:blue": (31, 119, 180), "tab:green": (44, 160, 44)}


def _run(*args):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)


def _pixels(path, min_width=600, min_height=350):
  """The RGB pixels of a PNG, after checking it is a real, non-blank image
  of at least the given size."""
  assert os.path.getsize(path) > 10_000, path
  with Image.open(path) as im:
    assert im.format == "PNG"
    assert im.width >= min_width and im.height >= min_height, im.size
    rgb = np.asarray(im.convert("RGB"))
  colours = np.unique(rgb.reshape(-1, 3), axis=0)
  assert len(colours) > 20, (path, len(colours))
  non_white = np.mean(np.any(rgb < 250, axis=-1))
  assert 0.01 < non_white < 0.6, (path, non_white)
  return rgb


def _has_colour(rgb, colour):
  return bool(np.any(np.all(rgb == np.array(colour, np.uint8), axis=-1)))


@pytest.fixture(scope="module")
def report_doc():
  """Table 4 and a two-point-per-panel sweep at report --quick's sweep shape."""
  progress = report.Progress(
      len(report.PASA_METHODS) * (len(report.data.PASA_TABLE4_CASES)
                                  + len(report.sweep_inputs(SMALL_SWEEPS))),
      stream=io.StringIO())
  return dict(
      shapes=dict(pasa=SHAPE, pasa_sweep=SHAPE),
      pasa_table4=report.pasa_table4(SHAPE, "reference", progress),
      pasa_sweep=report.pasa_sweep(SHAPE, "reference", progress,
                                   SMALL_SWEEPS),
      progress_lines=progress.stream.getvalue().splitlines())


def test_sweep_numbers(report_doc):
  assert len(report_doc["progress_lines"]) == 5 * (6 + 8)
  assert report_doc["progress_lines"][-1].startswith("[70/70]")
  rows = report_doc["pasa_sweep"]
  assert [(r["dist"], r["vary"], r["x0"], r["am"]) for r in rows] == [
      ("uniform", "x0", 0.0, 0.5), ("uniform", "x0", 30.0, 0.5),
      ("uniform", "am", 20.0, 0.5), ("uniform", "am", 20.0, 20.0),
      ("hybrid", "x0", 0.0, 10.0), ("hybrid", "x0", 30.0, 10.0),
      ("hybrid", "am", 20.0, 10.0), ("hybrid", "am", 20.0, 100.0)]
  assert [r["figure"] for r in rows] == [9] * 4 + [10] * 4
  for r in rows:
    assert r["pasa_nan_pct"] == 0.0 and r["fp32_nan_pct"] == 0.0
    assert r["fp32_rel_rmse"] < 1e-3 and r["pasa_rel_rmse"] < 0.05
    if r["x0"] == 30.0:  # q.k ~ 128 * 900 > 65504: every float16 score overflows
      assert r["fp16_fp32_nan_pct"] == 100.0 and r["fp16_nan_pct"] == 100.0
      assert math.isnan(r["fp16_fp32_rel_rmse"])
    if r["x0"] == 0.0:
      assert r["fp16_fp32_nan_pct"] == 0.0
      assert r["fp16_fp32_rel_rmse"] < 1e-3
  uniform_20_20 = rows[3]
  assert 0.0 < uniform_20_20["fp16_fp32_nan_pct"] < 20.0
  table4 = {r["case"]: r for r in report_doc["pasa_table4"]}
  assert table4["uniform_x0=30_am=0.5"]["fp16_nan_pct"] == 100.0
  assert all(r["pasa_nan_pct"] == 0.0 for r in table4.values())


def test_report_plots(report_doc, tmp_path):
  paths = report.plot(report_doc, str(tmp_path / "plots"))
  names = ["pasa_table4_nan.png", "pasa_fig9_uniform.png",
           "pasa_fig10_hybrid.png"]
  assert paths == [str(tmp_path / "plots" / n) for n in names]
  assert sorted(os.listdir(tmp_path / "plots")) == sorted(names)
  for path in paths:
    rgb = _pixels(path, min_width=900, min_height=400)
    for colour in TAB.values():  # every method: bars, lines or legend
      assert _has_colour(rgb, colour), (path, colour)


def test_report_cli_plot(report_doc, tmp_path, monkeypatch, capsys):
  calls = []

  def fake_run(**kwargs):
    calls.append(kwargs)
    return report_doc

  monkeypatch.setattr(report, "run", fake_run)
  out = tmp_path / "p"
  assert cli.main(["report", "--quick", "--plot", str(out)]) == 0
  assert calls == [dict(quick=True, implementation="reference", sweep=True)]
  assert len(os.listdir(out)) == 3
  assert capsys.readouterr().out.count("wrote ") == 3


def test_bench_plots_from_recorded_json(tmp_path, capsys):
  import json

  import matplotlib
  out = tmp_path / "bench"
  assert bench.main(["--plot", str(out), "--from-json", *RECORDED]) is None
  assert capsys.readouterr().out.count("wrote ") == 4
  series = bench.speed_series([json.load(open(p)) for p in RECORDED])
  names = {f"bench_d{d}_{'causal' if c else 'noncausal'}.png": len(methods)
           for (c, d), methods in series.items()}
  assert sorted(os.listdir(out)) == sorted(names) == sorted(
      f"bench_d{d}_{c}.png" for d in (64, 128) for c in ("causal", "noncausal"))
  tab20 = [tuple(round(255 * x) for x in c)
           for c in matplotlib.colormaps["tab20"].colors]
  for name, n_methods in names.items():
    assert n_methods >= 14
    rgb = _pixels(out / name, min_width=1000, min_height=400)
    assert _has_colour(rgb, (0, 0, 0))  # the cuDNN bf16 line
    for i in range(1, n_methods):  # every other method's colour
      assert _has_colour(rgb, tab20[i % 20]), (name, i)


def test_bench_speed_series():
  import json
  docs = [json.load(open(p)) for p in RECORDED]
  series = bench.speed_series(docs)
  assert sorted(series) == [(False, 64), (False, 128), (True, 64), (True, 128)]
  d128 = series[(False, 128)]
  assert next(iter(d128)) == "cudnn_bf16"
  assert sorted(d128["cudnn_bf16"]) == [2048, 8192, 16384]
  assert d128["cudnn_bf16"][16384]["shape"] == (1, 32, 16384, 128)
  run10 = docs[2]["results"][0]["rows"]
  assert d128["jaxattn_pasa"][16384]["tflops"] == run10["jaxattn_pasa"]["tflops"]
  assert d128["jaxattn_pasa"][16384]["ratio_vs_cudnn_bf16"] == pytest.approx(
      run10["cudnn_bf16"]["ms"] / run10["jaxattn_pasa"]["ms"])


def test_bench_printed_format():
  rows = {"cudnn_bf16": dict(ms=3.69, tflops=596.04, ratio_vs_cudnn_bf16=1.0),
          "jaxattn_pasa": dict(error="ValueError: no")}
  assert bench.format_rows((2, 32, 8192, 128), True, rows) == (
      "# B,H,S,D=(2, 32, 8192, 128) causal=True\n"
      "  cudnn_bf16                      3.690 ms   596.0 TFLOP/s x1.000\n"
      "  jaxattn_pasa                 ERROR ValueError: no")


def test_bench_without_gpu():
  r = _run("-m", "jaxattn", "bench", "--shapes", "1x1x128x64")
  assert r.returncode == bench.NO_GPU_EXIT_CODE == 1, r.stderr
  assert "no GPU" in r.stderr and "--from-json" in r.stderr
  assert "Traceback" not in r.stderr
  assert r.stdout == ""


def test_bench_from_json_needs_plot(capsys):
  with pytest.raises(SystemExit) as e:
    bench.main(["--from-json", RECORDED[0]])
  assert e.value.code == 2
  assert "--from-json needs --plot DIR" in capsys.readouterr().err


def test_usage():
  r = _run("-m", "jaxattn")
  assert r.returncode == 2
  assert r.stderr.startswith("usage: python -m jaxattn {report,bench}")
  assert "report" in r.stderr and "bench" in r.stderr


def test_help_and_unknown_command(capsys):
  assert cli.main(["--help"]) == 0
  assert capsys.readouterr().out.startswith("usage: python -m jaxattn")
  assert cli.main(["bogus"]) == 2
  assert "usage:" in capsys.readouterr().err


def test_progress_without_terminal():
  stream = io.StringIO()
  progress = report.Progress(3, stream=stream)
  printed = io.StringIO()
  for label in ("a", "b"):
    progress.step(label)
  progress.write("table", file=printed)
  progress.step("c")
  lines = stream.getvalue().splitlines()
  assert [line.split()[0] for line in lines] == ["[1/3]", "[2/3]", "[3/3]"]
  assert [line.split()[-1] for line in lines] == ["a", "b", "c"]
  assert printed.getvalue() == "table\n"


def test_progress_builtin_bar_on_terminal(monkeypatch):
  class Terminal(io.StringIO):
    def isatty(self):
      return True

  monkeypatch.setitem(sys.modules, "tqdm", None)  # tqdm unavailable
  stream, printed = Terminal(), io.StringIO()
  progress = report.Progress(4, stream=stream)
  progress.step("one")
  progress.write("line", file=printed)
  progress.step("two")
  progress.close()
  text = stream.getvalue()
  assert text.count("\r\033[K") == 4  # 2 draws, the clear before "line", redraw
  assert "######......" in text and "[2/4]" in text and text.endswith("\n")
  assert printed.getvalue() == "line\n"


def test_bench_speed_accuracy_chart(tmp_path):
  """One point per end-to-end row that has an error against float32: cuDNN
  in black, the Mosaic rows in blue, the Triton rows in orange."""
  import matplotlib
  rows = {"cudnn_bf16": dict(ms=3.7, ratio_vs_cudnn_bf16=1.0, rel_l2=1.1e-2),
          "cudnn_fp8": dict(ms=2.7, ratio_vs_cudnn_bf16=1.34, rel_l2=6e-2),
          "jaxattn_fp8_mosaic": dict(ms=3.5, ratio_vs_cudnn_bf16=1.05,
                                     rel_l2=1.5e-1),
          "jaxattn_sage1": dict(ms=4.7, ratio_vs_cudnn_bf16=0.78,
                                rel_l2=1.3e-2),
          "kernel_fp8_mosaic": dict(ms=3.0, ratio_vs_cudnn_bf16=1.23),
          "jaxattn_pasa": dict(error="ValueError: no")}
  doc = dict(meta=dict(device="H100"),
             results=[dict(shape=[2, 32, 8192, 128], causal=False, rows=rows),
                      dict(shape=[2, 32, 8192, 128], causal=True,
                           rows={"cudnn_bf16": dict(ms=2.0)})])
  paths = bench.plot_speed_accuracy([doc], str(tmp_path))
  assert paths == [str(tmp_path / "speed_accuracy_2x32x8192x128_noncausal.png")]
  rgb = _pixels(paths[0])
  for colour in ("black", "tab:blue", "tab:orange"):
    want = tuple(round(255 * x) for x in matplotlib.colors.to_rgb(colour))
    assert _has_colour(rgb, want), colour
  assert bench._label("jaxattn_sage2-8b_mosaic") == "sage2-8b (mosaic)"
  assert bench._label("jaxattn_sage1") == "sage1 (triton)"
  assert bench._label("cudnn_fp8") == "cudnn_fp8"


def test_bench_accuracy_against_float32():
  """The benchmark's error column: float32 attention of the float32
  channel-outlier inputs against itself is exact to rounding; sage1 on the
  float16 inputs is as accurate as measured elsewhere; the cuDNN fp8 peer
  is one of the benchmarked rows."""
  import jax.numpy as jnp

  import jaxattn
  inputs = bench.accuracy_inputs((2, 3, 64, 32))
  assert [x.shape for x in inputs] == [(1, 64, 3, 32)] * 3
  fp32 = bench.accuracy(lambda q, k, v: jaxattn.dot_product_attention(
      q, k, v, is_causal=True, implementation="reference"), jnp.float32,
      inputs, True)
  assert fp32["cos_sim"] > 1 - 1e-9 and fp32["rel_l2"] < 1e-5, fp32
  sage = bench.accuracy(lambda q, k, v: jaxattn.dot_product_attention(
      q, k, v, method="sage", preset="sage1", is_causal=True,
      implementation="reference"), jnp.float16, inputs, True)
  assert 0.999 < sage["cos_sim"] < 1 and 1e-4 < sage["rel_l2"] < 5e-2, sage
  assert "cudnn_fp8" in bench.jax_methods(False, 128)
  line = bench.format_rows((1, 1, 64, 32), False, {"x": dict(
      ms=1.0, tflops=2.0, ratio_vs_cudnn_bf16=1.0, cos_sim=0.9999,
      rel_l2=1.2e-2)})
  assert line.endswith("x1.000  cos 0.999900 rel_l2 1.20e-02")


def test_bench_accuracy_reference_once_per_shape(monkeypatch):
  """The float32 reference is computed once per shape; where it fails
  (out of memory at 32k tokens), each row keeps its timing and records the
  reference's error, and the reference is not tried again."""
  import jax.numpy as jnp
  calls = []

  def failing_reference(inputs, causal):
    calls.append(causal)
    raise MemoryError("64 GiB of scores")

  jobs = [(name, "jax", (jnp.float16, lambda q, k, v: q + k + v))
          for name in ("cudnn_bf16", "a", "b")]
  monkeypatch.setattr(bench, "method_jobs", lambda *a, **k: jobs)
  monkeypatch.setattr(bench, "accuracy_reference", failing_reference)
  monkeypatch.setattr(bench, "device_period_ms", lambda f, args: 1.0)
  rows = bench.bench_shape((1, 2, 32, 16), True, [], 1, 1, io.StringIO())
  assert calls == [True]
  for name in ("cudnn_bf16", "a", "b"):
    assert rows[name]["ms"] > 0, rows[name]
    assert rows[name]["accuracy_error"].startswith(
        "reference: MemoryError: 64 GiB"), rows[name]

"""The report command on small shapes: its tables carry the papers' findings
and its JSON is written."""
import json

import pytest

from jaxattn import __main__ as cli


@pytest.mark.slow
def test_report_quick_through_the_cli(tmp_path, capsys):
  """``python -m jaxattn report --quick --json F``: the tables printed and
  written, with the paper's orderings."""
  path = tmp_path / "r.json"
  assert cli.main(["report", "--quick", "--json", str(path)]) == 0
  text = capsys.readouterr().out
  doc = json.loads(path.read_text())
  assert {"pasa_table4", "sage_granularity", "int_flash"} <= set(doc)
  assert "PASA Table 4" in text and "SageAttention2" in text
  pasa = {r["case"]: r for r in doc["pasa_table4"]}
  for name, row in pasa.items():
    assert row["pasa_nan_pct"] == 0.0 and row["fp32_nan_pct"] == 0.0
    assert row["pasa_rel_rmse"] < 0.1, name
  assert pasa["uniform_x0=30_am=0.5"]["fp16_fp32_nan_pct"] == 100.0
  assert pasa["hybrid_x0=30_am=10"]["fp16_fp32_nan_pct"] == 100.0
  sage = {r["variant"]: r for r in doc["sage_granularity"]}
  assert sage["int8 warp"]["cos_sim"] > 0.99
  assert sage["int4 warp"]["rel_l1"] < sage["int4 warp, no smoothing"]["rel_l1"]
  for dist in ("normal", "uniform"):
    err = {r["variant"]: r["mean_rel_err"] for r in doc["int_flash"]
           if r["data"] == dist}
    assert (err["fp8 (FA3-style)"] > err["full-INT8, V per tensor"]
            > err["half-INT8 (fp16 PV)"])
  assert cli.main(["bogus"]) == 2

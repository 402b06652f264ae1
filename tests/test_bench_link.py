"""The benchmark's link section on tiny sizes: training and push_pull over a bandwidth-limited link between
network namespaces (root only). Run by `make netns-test`, beside the multi-host tests:

    sudo PS_MULTIHOST=1 .venv/bin/python -m pytest tests/test_bench_link.py -v
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from test_bench_smoke import LIMIT_S, run_quick  # noqa: E402  (pytest puts tests/ on sys.path)

from bench.link import unavailable  # noqa: E402

if os.environ.get("PS_MULTIHOST") != "1":
    pytest.skip("the link benchmark runs only with PS_MULTIHOST=1 (and as root)", allow_module_level=True)


@pytest.mark.timeout(LIMIT_S)
def test_quick_link_section_measures_overlap_and_pushes_in_turn(tmp_path: Path) -> None:
    why = unavailable()
    if why:
        pytest.skip(f"the link section cannot run here: {why}")
    result = run_quick(tmp_path, ("link",))
    assert result.returncode == 0, result.stderr[-4000:]
    doc = json.loads((tmp_path / "latest.json").read_text())
    assert doc["sections"]["link"]["ok"], doc["sections"]
    by_id = {f["id"]: f for f in doc["figures"]}
    assert by_id["link.sps.cnn.w1.async+overlap"]["ratios"].keys() == {"link.sps.cnn.w1.async"}
    for wire in ("float32", "bf16"):
        in_turn = by_id[f"link.step.4MB.s2.w1.{wire}.in-turn"]
        assert in_turn["ratios"].keys() == {f"link.step.4MB.s2.w1.{wire}.at-once", "link.gloo.4MB"}
    assert all(f["median"] > 0 for f in doc["figures"] if f["section"] == "link")
    assert "## Link" in (tmp_path / "latest.md").read_text()

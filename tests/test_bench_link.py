"""The benchmark's link, compress, overlap_backward, hosts and stream sections on tiny sizes: training and push_pull
over a bandwidth-limited link between network namespaces (whole and compressed, pushes after or during backward, one
push per host or per process), and a worker's data streamed over HTTP through one (root only). Run by
`make netns-test`, beside the multi-host tests:

    sudo PS_MULTIHOST=1 .venv/bin/python -m pytest tests/test_bench_link.py -v
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from support.bench import LIMIT_S, run_quick  # noqa: E402  (pytest puts tests/ on sys.path)

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


@pytest.mark.timeout(LIMIT_S)
def test_quick_compress_section_measures_compressed_pushes_against_gloo_and_bf16(tmp_path: Path) -> None:
    why = unavailable()
    if why:
        pytest.skip(f"the compress section cannot run here: {why}")
    result = run_quick(tmp_path, ("compress",))
    assert result.returncode == 0, result.stderr[-4000:]
    doc = json.loads((tmp_path / "latest.json").read_text())
    assert doc["sections"]["compress"]["ok"], doc["sections"]
    by_id = {f["id"]: f for f in doc["figures"] if f["section"] == "compress"}
    prefix = "compress.400mbit"
    for name in ("float32.whole", "bf16.topk0.01", "bf16.powersgd4", "float32.topk0.01"):
        assert by_id[f"{prefix}.step.{name}"]["ratios"].keys() == {f"{prefix}.gloo", f"{prefix}.step.bf16.whole"}
    for kind in ("tta", "sps"):
        for name in ("bf16.topk0.01", "bf16.powersgd4"):
            assert by_id[f"{prefix}.{kind}.{name}"]["compare"] == [f"{prefix}.{kind}.bf16.whole"]
    # A compressed push is a few KB where a whole one is 2 MB a shard: the exchange is faster even on a quick run.
    assert by_id[f"{prefix}.step.bf16.topk0.01"]["median"] < by_id[f"{prefix}.step.bf16.whole"]["median"]
    assert all(f["median"] > 0 for f in by_id.values() if ".tta." not in f["id"])
    assert "## Compress" in (tmp_path / "latest.md").read_text()


@pytest.mark.timeout(LIMIT_S)
def test_quick_overlap_backward_section_measures_both_models_with_and_without_the_flag(tmp_path: Path) -> None:
    why = unavailable()
    if why:
        pytest.skip(f"the overlap_backward section cannot run here: {why}")
    result = run_quick(tmp_path, ("overlap_backward",))
    assert result.returncode == 0, result.stderr[-4000:]
    doc = json.loads((tmp_path / "latest.json").read_text())
    assert doc["sections"]["overlap_backward"]["ok"], doc["sections"]
    by_id = {f["id"]: f for f in doc["figures"] if f["section"] == "overlap_backward"}
    prefix = "overlap_backward.400mbit"
    assert by_id.keys() == {f"{prefix}.{kind}.bf16.{s}" for kind in ("sps.mlp", "step.cnn") for s in ("on", "off")}
    for kind in ("sps.mlp", "step.cnn"):
        assert by_id[f"{prefix}.{kind}.bf16.on"]["ratios"].keys() == {f"{prefix}.{kind}.bf16.off"}
        assert by_id[f"{prefix}.{kind}.bf16.off"]["compare"] == []
    # The quick MLP's largest part (2 MiB in bf16) is over one message, the digits CNN's is not.
    assert by_id[f"{prefix}.sps.mlp.bf16.on"]["params"]["follows_backward"]
    assert not by_id[f"{prefix}.step.cnn.bf16.on"]["params"]["follows_backward"]
    for f in by_id.values():
        assert f["repeats"] and all(x > 0 for x in f["repeats"]), f
        assert f["median"] > 0, f["id"]
    assert "## Overlap backward" in (tmp_path / "latest.md").read_text()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()
    left = [ns for ns in listed if (m := re.match(r"psnt(\d+)-", ns)) and not Path(f"/proc/{m.group(1)}").exists()]
    assert not left, left


@pytest.mark.timeout(LIMIT_S)
def test_quick_hosts_section_measures_one_push_per_host(tmp_path: Path) -> None:
    why = unavailable()
    if why:
        pytest.skip(f"the hosts section cannot run here: {why}")
    result = run_quick(tmp_path, ("hosts",))
    assert result.returncode == 0, result.stderr[-4000:]
    doc = json.loads((tmp_path / "latest.json").read_text())
    assert doc["sections"]["hosts"]["ok"], doc["sections"]
    by_id = {f["id"]: f for f in doc["figures"] if f["section"] == "hosts"}
    assert by_id.keys() == {f"hosts.{k}.{s}" for k in ("bytes", "step") for s in ("reduced", "separate")}
    # Both pushes and pulls of a host go once, not twice: about half the bytes on its link, whatever the speed.
    assert 0.4 < by_id["hosts.bytes.reduced"]["ratios"]["hosts.bytes.separate"] < 0.7
    assert "## Hosts" in (tmp_path / "latest.md").read_text()


@pytest.mark.timeout(LIMIT_S)
def test_quick_stream_section_measures_prefetch_over_a_limited_link(tmp_path: Path) -> None:
    why = unavailable()
    if why:
        pytest.skip(f"the stream section cannot run here: {why}")
    result = run_quick(tmp_path, ("stream",))
    assert result.returncode == 0, result.stderr[-4000:]
    doc = json.loads((tmp_path / "latest.json").read_text())
    assert doc["sections"]["stream"]["ok"], doc["sections"]
    by_id = {f["id"]: f for f in doc["figures"] if f["section"] == "stream"}
    assert by_id.keys() == {f"stream.sps.{run}" for run in ("local", "prefetch", "sequential", "slow")}
    # The 0.9x target is the full run's to report: a quick run on a shared machine is too noisy to judge it.
    for run in ("prefetch", "sequential"):
        assert by_id[f"stream.sps.{run}"]["ratios"].keys() == {"stream.sps.local"}
        assert by_id[f"stream.sps.{run}"]["ratios"]["stream.sps.local"] > 0
    for f in by_id.values():
        assert f["repeats"] and all(x > 0 for x in f["repeats"]), f
        assert f["median"] > 0, f["id"]
    slow = by_id["stream.sps.slow"]
    assert 0 < slow["extra"]["link_use_median"] < 1.5, slow["extra"]  # tbf holds the reader near the link's rate
    assert "## Stream" in (tmp_path / "latest.md").read_text()
    # The suite ran in a process of its own, now gone: any namespace named after a dead pid is one it left.
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()
    left = [ns for ns in listed if (m := re.match(r"psnt(\d+)-", ns)) and not Path(f"/proc/{m.group(1)}").exists()]
    assert not left, left

"""Smoke test of the benchmark suite: `bench/run.py --quick` runs its sections and writes its three files.

It checks that the suite works, not how fast anything is: the quick sizes are too small to mean anything. The
quick run takes a minute, so `make test` leaves it out: `make bench-smoke` (in .ci/run) runs it.
About a minute on 2 idle cores (real shard and worker processes start a dozen times); a busy machine takes
longer, and only pytest-timeout's generous limit stops it. The link, compress and hosts sections need root and
network namespaces: tests/test_bench_link.py runs them, from `make netns-test`.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.bench import LIMIT_S, run_quick

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = (
    "transport",
    "baselines",
    "training",
    "memory",
    "sparse",
    "sparse_many",
    "sparse_peer",
    "replication",
    "serving",
    "online",
    "link",
    "compress",
    "hosts",
)
# every section that runs on any machine (sparse_peer needs make bench-peers; link, compress and hosts, network
# namespaces)
SMOKE = tuple(s for s in SECTIONS if s not in ("sparse_peer", "link", "compress", "hosts"))
pytestmark = pytest.mark.timeout(LIMIT_S)  # whichever test runs the module's quick run first


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    if os.environ.get("PS_BENCH_SMOKE") != "1":
        pytest.skip("the benchmark's quick run (about a minute) runs with PS_BENCH_SMOKE=1: make bench-smoke")
    out = tmp_path_factory.mktemp("bench")
    return out, run_quick(out, SMOKE)


def test_quick_run_writes_json_and_markdown(quick_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, result = quick_run
    assert result.returncode == 0, f"exit status {result.returncode}\n{result.stderr[-4000:]}"
    doc = json.loads((out / "latest.json").read_text())
    for key in ("cores", "torch", "grpc", "glibc_tunables"):
        assert key in doc["machine"], key
    assert doc["machine"]["cores"] >= 1
    assert set(doc["sections"]) == set(SMOKE)
    assert all(s["ok"] for s in doc["sections"].values()), doc["sections"]

    figures = doc["figures"]
    for section in SMOKE:
        assert any(f["section"] == section for f in figures), f"no {section} figures"
    for f in figures:
        assert f["unit"], f["id"]
        if f["id"].startswith("training.tta."):
            continue  # the quick run is too short to reach the target accuracy: no time, by design
        assert f["repeats"], f["id"]
        # A count of what went wrong (files skipped after kills) is rightly 0; every measured figure is positive.
        low = 0 if f["unit"] == "files" else math.ulp(0)
        assert all(isinstance(x, int | float) and math.isfinite(x) and x >= low for x in f["repeats"]), f
        assert f["median"] >= low, f["id"]

    ids = {f["id"] for f in figures}
    for expected in ("transport.rt.", "transport.push.", "baselines.tcp.rt.", "baselines.gloo.", "baselines.rpc.rt."):
        assert any(i.startswith(expected) for i in ids), expected
    assert any(i.startswith("training.sps.") and i.endswith(".local") for i in ids)
    assert any(i.startswith("memory.overhead.") for i in ids)
    # Every path is measured: shared memory, the data socket and the gRPC streams, and the fused push_pull.
    for path in ("shm", "socket", "float32"):
        assert any(i.startswith("transport.rt.") and i.endswith(f".{path}") for i in ids), path
        assert any(i.startswith(f"memory.overhead.{path}.") for i in ids), path
    assert any(i.startswith("transport.step.") for i in ids)
    # TLS: the data socket and gRPC on shards that serve it, each against the same path in the clear.
    by_id = {f["id"]: f for f in figures}
    for path in ("socket", "float32"):
        tls = [f for i, f in by_id.items() if i.startswith("transport.rt.") and i.endswith(f".{path}-tls")]
        assert tls, path
        assert any(base.endswith(f".{path}") for base in tls[0]["ratios"]), tls[0]["ratios"]
    # The big model with one async worker, with ps-worker --overlap against without it.
    overlap = [f for i, f in by_id.items() if i.startswith("training.sps.") and i.endswith(".w1.async+overlap")]
    assert overlap, "no overlap figure"
    assert any(base.endswith(".w1.async") for base in overlap[0]["ratios"]), overlap[0]["ratios"]
    # Sparse tables: the step on each path against the local step, the throughput, the row table's memory and scale.
    for path in ("shm", "socket", "grpc"):
        step = by_id.get(f"sparse.step.{path}.s2.d64")
        assert step is not None and step["unit"] == "x", path
        assert "sparse.local.d64" in by_id[f"sparse.ms.{path}.s2.d64"]["ratios"], path
    assert "sparse.local.rate.d64" in by_id["sparse.ids.shm.s1.w4.d64"]["ratios"]
    for prefix in ("sparse.throughput.", "sparse.bytes.", "sparse.rss.", "sparse.scale."):
        assert any(i.startswith(prefix) for i in ids), prefix
    # The CPU of the worker and its shards per step against the local process's; the many-table model's cases.
    for path in ("shm", "socket", "grpc"):
        cpu = by_id.get(f"sparse.cpu.{path}.s2.d64")
        assert cpu is not None and all(r > 0 for r in cpu["repeats"]), path
    for what in ("cpu", "step", "rate"):
        assert any(i.startswith(f"sparse_many.{what}.t52.w2.s2") for i in ids), what
    # One async worker whose exchanges overlap its steps (tables prefetched two ahead) against the local step.
    for path in ("shm", "socket"):
        overlapped = by_id.get(f"sparse.overlap.{path}.s2.d64")
        assert overlapped is not None and all(r > 0 for r in overlapped["repeats"]), path
    # Replication: --replicas 2 against 1 in the same run, a failover and the restarted copy's catch-up timed.
    replicated = [f for i, f in by_id.items() if i.startswith("replication.rt.") and i.endswith(".r2")]
    assert replicated, "no replication cost figure"
    assert replicated[0]["compare"][0] in replicated[0]["ratios"], replicated[0]
    assert any(i.startswith("replication.failover.") for i in ids)
    assert any(i.startswith("replication.catchup.") for i in ids)
    # Ratios against the baselines of the same run are computed, and they are positive.
    ratios = [r for f in figures for r in f.get("ratios", {}).values()]
    assert ratios and all(r > 0 for r in ratios)

    text = (out / "latest.md").read_text()
    assert text.startswith("# paramserver benchmarks")
    for heading in (
        "## Transport",
        "## Baselines",
        "## Training",
        "## Memory",
        "## Sparse tables",
        "## Many tables",
        "## Replication",
    ):
        assert heading in text
    assert "| payload |" in text
    assert "# paramserver benchmarks" in result.stdout  # the table is printed at the end too


def test_baselines_bracket_the_transport_cases() -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from bench.run import run_order
    finally:
        sys.path.remove(str(ROOT))
    assert run_order(list(SECTIONS)) == [
        "baselines",
        "transport",
        "baselines",
        "training",
        "memory",
        "sparse",
        "sparse_many",
        "sparse_peer",
        "replication",
        "serving",
        "online",
        "link",
        "compress",
        "hosts",
    ]
    assert run_order(["baselines", "memory"]) == ["baselines", "memory"]
    assert run_order(["transport"]) == ["transport"]


def test_a_second_baselines_pass_adds_its_repeats(quick_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, _ = quick_run
    doc = json.loads((out / "latest.json").read_text())
    sys.path.insert(0, str(ROOT))
    try:
        from bench.common import schedule
    finally:
        sys.path.remove(str(ROOT))
    gloo = [f for f in doc["figures"] if f["id"].startswith("baselines.gloo.")]
    assert gloo
    for f in gloo:  # the timed iterations of two passes, before and after the transport cases
        assert f["n"] == 2 * schedule(f["params"]["bytes"], doc["plan"]["repeats"])[1], (f["id"], f["n"])
    assert len({f["id"] for f in doc["figures"]}) == len(doc["figures"]), "a figure id appears twice"


def test_quick_run_draws_the_plot(quick_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    pytest.importorskip("matplotlib")
    out, result = quick_run
    assert result.returncode == 0, result.stderr[-4000:]
    png = out / "latest.png"
    assert png.is_file()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_readme_summary_is_written_between_the_markers(
    quick_run: tuple[Path, subprocess.CompletedProcess[str]], tmp_path: Path
) -> None:
    from bench import report, report_summary

    out, _ = quick_run
    doc = json.loads((out / "latest.json").read_text())
    readme = tmp_path / "README.md"
    begin, end = report_summary.README_BEGIN, report_summary.README_END
    readme.write_text(f"# x\n\nbefore\n{begin}\nstale\n{end}\nafter\n")
    assert report.update_readme(doc, readme)
    text = readme.read_text()
    assert "stale" not in text and text.startswith("# x\n\nbefore\n") and text.endswith("after\n")
    assert "| what | this run | target |" in text
    assert "shared memory" in text  # the quick run measures the shared-memory path too
    readme.write_text("no markers here\n")
    assert not report.update_readme(doc, readme)


def test_the_third_party_section_shows_each_figure_against_its_target() -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from bench import report
        from bench.common import Figure
        from bench.third_party import TARGETS
    finally:
        sys.path.remove(str(ROOT))
    figures = [
        Figure(
            id=f"third_party.deepfm.grouped.{kind}",
            section="third_party",
            title=kind,
            unit="x",
            repeats=values,
            params={"fields": 8, "samples": 4_000, "rounds": 1, "target": TARGETS.get(kind)},
            extra={"local_auc": 0.71},
        ).to_json()
        for kind, values in (("cpu", [1.4, 1.2]), ("rate", [0.7, 0.8]), ("auc", [-0.02, -0.01]))
    ]
    doc = {"machine": {}, "plan": {"quick": True, "repeats": 1, "train_repeats": 1}, "figures": figures}
    doc["started"] = "now"
    report.add_ratios(doc)
    text = report.markdown(doc)
    assert "## Other people's loops" in text
    row = next(line for line in text.splitlines() if line.startswith("| grouped |"))
    assert "1.30x | ≤ 1.5x: met" in row and "0.75x | ≥ 1.0x: not met" in row, row
    assert "-0.015 | ≥ -0.003: not met | 0.71" in row, row

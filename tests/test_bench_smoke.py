"""Smoke test of the benchmark suite: `bench/run.py --quick` runs every section and writes its three files.

It checks that the suite works, not how fast anything is: the quick sizes are too small to mean anything.
About a minute on 2 idle cores (real shard and worker processes start a dozen times).
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("transport", "baselines", "training", "memory", "link")
TIMEOUT_S = 240


def _link_unavailable() -> str | None:
    """Why the link section cannot run here (it needs root and network namespaces), or None."""
    sys.path.insert(0, str(ROOT))
    try:
        from bench.link import unavailable
    finally:
        sys.path.remove(str(ROOT))
    return unavailable()


def _run_quick(out: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        # SIGTERM first: the suite then stops every shard and worker it started (SIGKILL would orphan them).
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        pytest.fail(f"bench/run.py --quick took over {TIMEOUT_S} s\n{stderr[-4000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp_path_factory.mktemp("bench")
    return out, _run_quick(out)


@pytest.mark.timeout(TIMEOUT_S + 120)
def test_quick_run_writes_json_and_markdown(quick_run: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    out, result = quick_run
    assert result.returncode == 0, f"exit status {result.returncode}\n{result.stderr[-4000:]}"
    doc = json.loads((out / "latest.json").read_text())
    for key in ("cores", "torch", "grpc", "glibc_tunables"):
        assert key in doc["machine"], key
    assert doc["machine"]["cores"] >= 1
    assert set(doc["sections"]) == set(SECTIONS)
    assert all(s["ok"] for s in doc["sections"].values()), doc["sections"]

    figures = doc["figures"]
    for section in SECTIONS:
        if section == "link" and _link_unavailable():
            continue  # needs root and network namespaces: skipped, saying why
        assert any(f["section"] == section for f in figures), f"no {section} figures"
    for f in figures:
        assert f["unit"], f["id"]
        if f["id"].startswith("training.tta."):
            continue  # the quick run is too short to reach the target accuracy: no time, by design
        assert f["repeats"], f["id"]
        assert all(isinstance(x, int | float) and math.isfinite(x) and x > 0 for x in f["repeats"]), f
        assert f["median"] > 0, f["id"]

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
    # Over the limited link: with --overlap against without, on a host of its own.
    if not _link_unavailable():
        assert by_id["link.sps.cnn.w1.async+overlap"]["ratios"].keys() == {"link.sps.cnn.w1.async"}
        for wire in ("float32", "bf16"):
            in_turn = by_id[f"link.step.4MB.s2.w1.{wire}.in-turn"]
            assert in_turn["ratios"].keys() == {f"link.step.4MB.s2.w1.{wire}.at-once", "link.gloo.4MB"}
        assert "## Link" in (out / "latest.md").read_text()
    # Ratios against the baselines of the same run are computed, and they are positive.
    ratios = [r for f in figures for r in f.get("ratios", {}).values()]
    assert ratios and all(r > 0 for r in ratios)

    text = (out / "latest.md").read_text()
    assert text.startswith("# paramserver benchmarks")
    for heading in ("## Transport", "## Baselines", "## Training", "## Memory"):
        assert heading in text
    assert "| payload |" in text
    assert "# paramserver benchmarks" in result.stdout  # the table is printed at the end too


def test_baselines_bracket_the_transport_cases() -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from bench.run import run_order
    finally:
        sys.path.remove(str(ROOT))
    assert run_order(list(SECTIONS)) == ["baselines", "transport", "baselines", "training", "memory", "link"]
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


@pytest.mark.timeout(TIMEOUT_S + 120)
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
    from bench import report

    out, _ = quick_run
    doc = json.loads((out / "latest.json").read_text())
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{report.README_BEGIN}\nstale\n{report.README_END}\nafter\n")
    assert report.update_readme(doc, readme)
    text = readme.read_text()
    assert "stale" not in text and text.startswith("# x\n\nbefore\n") and text.endswith("after\n")
    assert "| what | this run | target |" in text
    assert "shared memory" in text  # the quick run measures the shared-memory path too
    readme.write_text("no markers here\n")
    assert not report.update_readme(doc, readme)

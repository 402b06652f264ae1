"""--metrics-out given to several workers keeps every rank's summary: FILE-RANK.EXT each."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from paramserver.config import ServerConfig
from paramserver.server.cluster import LocalCluster
from worker.cli import build_parser
from worker.train.config import NUMBERED_ENV, metrics_path

ROOT = Path(__file__).resolve().parents[1]


def _workers(address: str, out: Path, count: int) -> list[subprocess.CompletedProcess[str]]:
    cmd = [sys.executable, "-m", "worker.cli", "--server", address, "--model", "logreg", "--dataset", "synthetic"]
    cmd += ["--steps", "3", "--no-progress", "--metrics-out", str(out)]
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(count)
    ]
    try:
        outputs = [p.communicate(timeout=180) for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, *o) for p, o in zip(procs, outputs, strict=True)]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_two_workers_given_one_path_each_write_their_ranks_file(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=2, optimizer="sgd", lr=0.1), 2)
    for done in _workers(cluster.address, tmp_path / "m.json", 2):
        assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-0.json", "m-1.json"]
    summaries = [json.loads((tmp_path / f"m-{rank}.json").read_text()) for rank in range(2)]
    assert [(s["rank"], s["world_size"], s["steps"]) for s in summaries] == [(0, 2, 3), (1, 2, 3)]


def test_a_job_of_one_worker_writes_the_path_as_given(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1), 1)
    [done] = _workers(cluster.address, tmp_path / "m.json", 1)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_the_rank_goes_before_the_extension_unless_the_launcher_numbered_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(NUMBERED_ENV, raising=False)
    assert metrics_path("out/run.json", 3, 4) == "out/run-3.json"
    assert metrics_path("out/run.json", 0, 1) == "out/run.json"
    monkeypatch.setenv(NUMBERED_ENV, "1")  # a process of ps-worker --nproc: its launcher gave it run-i.json
    assert metrics_path("out/run-1.json", 3, 4) == "out/run-1.json"


def test_help_says_where_each_ranks_summary_goes() -> None:
    text = " ".join(build_parser().format_help().split())
    assert "each writes FILE-RANK.EXT" in text and "m-0.json, m-1.json" in text

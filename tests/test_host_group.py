"""One member of the job per host: `ps-worker --nproc N` averages its processes' gradients on the host and exchanges
once (worker/client/host_group.py).

Covered, with real ps-server and ps-worker processes:
- a group of 2 processes against `--workers 1` ends with the weights of 2 separate sync workers against
  `--workers 2` (the same data split, the same mean), to float rounding; each process reports its own rank of 2;
- a process of the group killed with SIGKILL stops the group: the launcher exits non-zero and says why, the host
  leaves the job, and a new group resumes from the servers' state.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.jobs import shard_versions, start_ps_server, stop_job
from support.waiting import wait_for

pytestmark = pytest.mark.timeout(300)


def _ps_worker(address: str, *args: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "worker.cli", "--server", address, "--no-progress", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _train(tmp_path: Path, name: str, workers: int, *args: str) -> dict[str, torch.Tensor]:
    server, address = start_ps_server("--shards", "2", "--mode", "sync", "--workers", str(workers), "--lr", "0.05")
    launcher = None
    try:
        launcher = _ps_worker(
            address, "--nproc", "2", "--model", "mlp", "--epochs", "1",
            "--save-model", str(tmp_path / f"{name}.safetensors"), "--metrics-out", str(tmp_path / f"{name}.json"),
            *args,
        )  # fmt: skip
        _, err = launcher.communicate(timeout=240)
        assert launcher.returncode == 0, err.decode()[-3000:]
    finally:
        stop_job(server, [launcher] if launcher is not None else [])
    saved = tmp_path / f"{name}.safetensors"  # a group's model: its first process's
    return load_file(saved if saved.exists() else tmp_path / f"{name}-0.safetensors")  # separate workers' numbered


def test_a_host_group_trains_as_separate_sync_workers_do(tmp_path: Path) -> None:
    grouped = _train(tmp_path, "group", 1)
    separate = _train(tmp_path, "separate", 2, "--no-host-reduce")
    assert grouped.keys() == separate.keys()
    for key in grouped:
        torch.testing.assert_close(grouped[key], separate[key], rtol=0, atol=1e-5)
    first = {k: v for k, v in grouped.items() if k.endswith("weight")}
    assert first, "the model has weights"
    metrics = [json.loads((tmp_path / f"group-{i}.json").read_text()) for i in range(2)]
    assert sorted((m["rank"], m["world_size"]) for m in metrics) == [(0, 2), (1, 2)]
    assert metrics[0]["steps"] == metrics[1]["steps"] > 0
    # One push a step for the host: the servers' version is the group's step count.
    assert max(m["server_version"] for m in metrics) == metrics[0]["steps"]
    assert not (tmp_path / "group-1.safetensors").exists()  # the group's model is its first process's


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(c) for c in text.split()]


def _local_rank(pid: int) -> int:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    value = next(e for e in env if e.startswith(b"PS_HOST_GROUP="))
    return int(value.split(b"=", 1)[1].split(b"/")[0])


def test_a_dead_process_stops_its_group_and_a_new_group_resumes(tmp_path: Path) -> None:
    server, address = start_ps_server("--shards", "2", "--mode", "sync", "--workers", "1")
    launchers: list[subprocess.Popen[bytes]] = []
    try:
        launchers.append(_ps_worker(address, "--nproc", "2", "--epochs", "200"))
        wait_for(lambda: min(shard_versions(address)) >= 20 or None, 120, "the group to train 20 steps", 0.2)
        members = [c for c in _children(launchers[0].pid) if _local_rank(c) == 1]
        assert len(members) == 1, members
        os.kill(members[0], signal.SIGKILL)
        _, err = launchers[0].communicate(timeout=60)
        assert launchers[0].returncode != 0
        assert b"is gone" in err, err.decode()[-3000:]
        stopped = min(shard_versions(address))
        time.sleep(1.0)
        assert min(shard_versions(address)) == stopped  # nobody trains
        # The host left the job: a new group joins at once (a full job would wait) and trains on from there.
        launchers.append(_ps_worker(address, "--nproc", "2", "--steps", "5", "--metrics-out", str(tmp_path / "m.json")))
        _, err = launchers[1].communicate(timeout=120)
        assert launchers[1].returncode == 0, err.decode()[-3000:]
        resumed = json.loads((tmp_path / "m-0.json").read_text())
        assert resumed["server_version"] >= stopped
    finally:
        stop_job(server, launchers)

"""Workers that save the model to one path at once each succeed, and the path holds one whole file."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from paramserver.config import ServerConfig
from paramserver.files import atomic_write
from paramserver.server.cluster import LocalCluster
from worker import PSClient, SparseEmbedding, load

ROOT = Path(__file__).resolve().parents[1]

# A worker: register the model (the first adopts nothing, the second adopts the first's), say so, wait for the
# go file, then save it to the one path several times in a row.
SAVER = """
import sys, time
from pathlib import Path
import torch
from torch import nn
from worker import PSClient, SparseEmbedding
address, path, go = sys.argv[1:4]
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 8), SparseEmbedding(dim=16, num_embeddings=1000))
with PSClient(address) as client:
    client.register(net)
    print("ready", flush=True)
    while not Path(go).exists():
        time.sleep(0.01)
    for _ in range(4):
        client.save(net, path)
print("saved", flush=True)
"""


def model() -> nn.Module:
    """The SAVER's model: big enough (about 4 MB in the file) that two saves overlap."""
    return nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 8), SparseEmbedding(dim=16, num_embeddings=1000))


def test_two_worker_processes_saving_to_one_path_both_succeed(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=2), shards=2)
    path, go = tmp_path / "model.safetensors", tmp_path / "go"
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", SAVER, cluster.address, str(path), str(go)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for worker in workers:
            assert worker.stdout is not None
            assert worker.stdout.readline().strip() == "ready", worker.communicate(timeout=60)
        go.touch()
        outcomes = [worker.communicate(timeout=300) for worker in workers]
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()
    for worker, (out, err) in zip(workers, outcomes, strict=True):
        assert worker.returncode == 0 and out.strip() == "saved", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["go", "model.safetensors"]  # no temporary file left
    arrays = load_file(str(path))  # safetensors' own reader takes it whole
    assert arrays["0.weight"].shape == (1024, 1024) and arrays["2.values"].shape[1] == 16
    torch.manual_seed(1)
    served = load(model(), path)
    with PSClient(cluster.address) as client:
        torch.manual_seed(2)
        held = model()
        client.register(held)
        assert torch.equal(served[0].weight, held[0].weight)
        ids = torch.tensor([0, 7, 999])
        with torch.no_grad():
            assert torch.equal(served[2](ids), held[2](ids))


def test_writers_of_one_path_never_share_a_temporary_file(tmp_path: Path) -> None:
    # Each write goes through a file of its own beside the target: one writer's file is never truncated or renamed
    # away by another's (the first is still being written while the second finishes).
    target = tmp_path / "m.json"
    seen: list[list[str]] = []

    def slow(f: object) -> None:
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        atomic_write(target, "inner\n")
        time.sleep(0.01)
        f.write(b"outer\n")  # type: ignore[attr-defined]

    atomic_write(target, slow)
    assert target.read_text() == "outer\n"
    assert len(seen[0]) == 1 and seen[0][0].startswith(".m.json.") and seen[0][0].endswith(".tmp")
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]

"""Worker-side training recipes: gradient accumulation over micro-batches and global-norm clipping before the
push, against torch computing the same on the whole batch and the whole model."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from paramserver.config import ServerConfig
from paramserver.server.cluster import LocalCluster
from worker import PSClient
from worker.train.gradients import compute_gradients
from worker.train.trainer import TrainConfig, train


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def test_micro_batches_sum_to_the_whole_batchs_gradient() -> None:
    x, y = torch.randn(30, 10), torch.randint(0, 4, (30,))  # 4 micro-batches of unequal sizes (8, 8, 8, 6)
    model = _model()
    whole = compute_gradients(model, x, y)
    expected = _grads(model)
    accumulated = compute_gradients(model, x, y, accumulate=4)
    assert accumulated == pytest.approx(whole, rel=1e-5)
    for got, want in zip(_grads(model), expected, strict=True):
        assert torch.allclose(got, want, atol=1e-6)


def test_clipping_scales_the_whole_model_as_torch_does() -> None:
    x, y = torch.randn(16, 10), torch.randint(0, 4, (16,))
    model = _model()
    compute_gradients(model, x, y)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    expected = _grads(model)
    compute_gradients(model, x, y, clip_grad_norm=0.05)
    got = _grads(model)
    for g, e in zip(got, expected, strict=True):
        assert torch.allclose(g, e, atol=1e-7)
    assert float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in got]))) == pytest.approx(0.05, rel=1e-4)


def test_a_clipped_accumulated_push_is_what_the_shards_apply(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    """Over two shards (each holds part of the model) the clip factor is the whole model's: plain SGD with lr 1
    moves every weight by exactly minus the clipped gradient."""
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=1.0), 2)
    model = _model()
    x, y = torch.randn(24, 10), torch.randint(0, 4, (24,))
    with PSClient(cluster.address) as client:
        client.register(model)
        before = [p.detach().clone() for p in model.parameters()]
        compute_gradients(model, x, y, accumulate=3, clip_grad_norm=0.1)
        clipped = _grads(model)
        client.push_pull(model)
    for p, b, g in zip(model.parameters(), before, clipped, strict=True):
        assert torch.allclose(p.detach(), b - g, atol=1e-6)


def test_train_with_both_recipes(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="adam", lr=0.01), 2)
    metrics = train(
        TrainConfig(server=cluster.address, model="logreg", steps=4, accumulate=4, clip_grad_norm=1.0, progress=False)
    )
    assert metrics["steps"] == 4 and metrics["config"]["accumulate"] == 4
    with pytest.raises(ValueError, match="accumulate"):
        TrainConfig(server="x:1", accumulate=0)
    with pytest.raises(ValueError, match="clip-grad-norm"):
        TrainConfig(server="x:1", clip_grad_norm=-1.0)


# By default the host's processes are one member of the job (worker/client/host_group.py): the job counts 1 worker.
@pytest.mark.parametrize(("members", "flags"), [(1, []), (2, ["--no-host-reduce"])], ids=["host-reduce", "separate"])
def test_nproc_starts_that_many_workers_and_each_gets_its_rank(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path, members: int, flags: list[str]
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=members, optimizer="sgd", lr=0.1), 2)
    out = tmp_path / "run.json"
    cmd = [sys.executable, "-m", "worker.cli", "--server", cluster.address, "--nproc", "2", "--model", "logreg"]
    cmd += ["--dataset", "synthetic", *flags]  # no scikit-learn to import
    done = subprocess.run(
        [*cmd, "--steps", "3", "--no-progress", "--metrics-out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    runs = [json.loads((tmp_path / f"run-{i}.json").read_text()) for i in range(2)]
    assert sorted(r["rank"] for r in runs) == [0, 1] and all(r["steps"] == 3 for r in runs)
    assert {r["device"] for r in runs} == {"cpu"} and {r["world_size"] for r in runs} == {2}
    # One push a step for the group; one each for separate workers (a sync round: one version either way).
    assert max(r["server_version"] for r in runs) == 3


def test_tensorboard_scalars(ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from worker.data.prepare import PrepareConfig, prepare

    prepare("digits", PrepareConfig(out=str(tmp_path / "data"), shards=2, progress=False))  # streamed: its waits too
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.1), 2)
    config = TrainConfig(
        server=cluster.address,
        dataset=str(tmp_path / "data"),
        model="logreg",
        steps=5,
        progress=False,
        tensorboard=str(tmp_path / "board"),
    )
    train(config)
    events = EventAccumulator(str(tmp_path / "board" / "worker-0"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "loss",
        "samples_per_second",
        "exchange_seconds",
        "staleness",
        "input_wait_seconds",
        "test_accuracy",
    } <= tags
    assert all(e.value >= 0 for e in events.Scalars("input_wait_seconds"))
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4, 5]
    assert all(e.value >= 0 for e in events.Scalars("exchange_seconds"))
    assert 0 <= events.Scalars("test_accuracy")[-1].value <= 1

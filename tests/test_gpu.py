"""The worker's CUDA path on a GPU: each test trains twice, on device "cpu" and on "cuda" (the same seed, batches and
server config, each run against its own real shards: a LocalCluster of 2 shards in threads on 127.0.0.1, port 0,
1 worker), and checks that the CUDA run ends where the CPU run does:

- dense: an MLP with a transposed (non-contiguous) parameter, SGD, over each transport: the weights after every
  step equal the CPU run's to 1e-5; on CUDA every tensor goes through a pinned host mirror and comes back by a
  non_blocking copy (worker/client/binding.py), written in place;
- an exchange during backward (push_pull(backward=...)): the same weights as the CPU run's, the pieces streamed
  from the device's gradients as backward makes them;
- buffers: a BatchNorm model's running_mean, running_var and num_batches_tracked, and its weights, as the CPU run's;
- autocast: MixedPrecision.for_device("bfloat16" or "float16", cuda) through worker.train.gradients.compute_gradients
  (what the trainer runs): the forward pass in that dtype, the loss finite, the weights moved, close to the CPU
  float32 run's;
- sparse rows: SparseEmbedding tables (per ID, and a "sum" bag with offsets) fed CUDA int64 IDs, the next batch's
  IDs prefetched before each push_pull, sync, Adagrad: the rows read back and the dense weights equal the CPU
  run's to 1e-5, the prefetched rows are used (no extra lookups), and forward passes on IDs that were not
  prefetched gather the shards' rows;
- someone else's model: plain nn.Embedding / nn.EmbeddingBag on the device, converted by make_sparse (the initial
  rows sent from the device's weights), trained through PSOptimizer, saved by PSClient.save and served by
  worker.load on the device: the served predictions and the loaded tensors equal the CPU run's;
- a host group: ps-worker --nproc 2 on the device (its processes' gradients averaged on the host, through the
  host mirrors and shared memory) ends with the CPU group's model;
- the trainer: worker.train.trainer.train on digits with device="cuda" (a sync ResNet with BatchNorm, an async CNN with
  overlap) finishes with the CPU run's steps and about its test accuracy.

Every test is skipped where torch.cuda.is_available() is False, so `make test` stays cheap. On a GPU machine:

    make gpu-check
    PYTHONPATH=. python -m pytest tests/test_gpu.py -v     # without installing the project (no plugin needed)

TF32 is turned off during the tests, so CUDA's float32 matmuls and convolutions are float32. PS_GPU_CHECK_DEVICE
names the device to check against the CPU (default cuda; e.g. cuda:1): PS_GPU_CHECK_DEVICE=cpu runs every check
cpu against cpu, which tests this module itself on a machine without a GPU.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paramserver import LocalCluster, ServerConfig
from paramserver.transport import shm
from worker import PSClient, SparseEmbedding
from worker.train.gradients import compute_gradients
from worker.train.precision import MixedPrecision

# With its index: a tensor's device reads cuda:0, never cuda, so the checks compare against that.
_ASKED = os.environ.get("PS_GPU_CHECK_DEVICE", "cuda")
DEVICE = "cuda:0" if _ASKED == "cuda" else _ASKED
ON_CUDA = torch.device(DEVICE).type == "cuda"
pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        ON_CUDA and not torch.cuda.is_available(),
        reason="no CUDA device (torch.cuda.is_available() is False): the GPU checks run on a GPU (make gpu-check)",
    ),
]

CLIENT_TIMEOUT = 60.0  # seconds for any client call: generous, for a loaded machine
TOL = 1e-5  # absolute and relative
TRANSPORTS: dict[str, dict[str, bool]] = {  # PSClient keyword arguments
    "shared-memory": {"shared_memory": True},
    "data-socket": {"shared_memory": False, "data_socket": True},
    "grpc": {"shared_memory": False, "data_socket": False},
}
Batch = tuple[torch.Tensor, ...]
Step = Callable[[nn.Module, Batch], float]  # leaves the batch's gradient on the model; returns its loss


@pytest.fixture(autouse=True)
def _float32_and_threads() -> Iterator[None]:
    """No TF32 (float32 matmuls on CUDA round as the CPU's do, to about 1e-7); torch's settings put back after."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32, torch.get_num_threads())
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
        torch.set_num_threads(saved[2])  # train() sets it


class _Dense(nn.Module):
    """An MLP whose second layer's weight is a transposed view (strides (1, 16)), kept so by .to(device)."""

    def __init__(self, batchnorm: bool = False) -> None:
        super().__init__()
        # Before a BatchNorm a bias has a zero gradient (the mean is subtracted), so none: only noise would be left.
        self.fc = nn.Linear(10, 16, bias=not batchnorm)
        self.bn = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
        self.proj = nn.Parameter(torch.randn(3, 16).t() / 4)
        self.bias = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.bn(self.fc(x))) @ self.proj + self.bias


def _batches(steps: int = 4, size: int = 16) -> list[Batch]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(size, 10, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(steps)]


def _float32_step(model: nn.Module, batch: Batch) -> float:
    loss = F.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    return loss.item()


def _trained(
    config: ServerConfig,
    model: nn.Module,
    batches: list[Batch],
    device: str,
    step: Step,
    follow: bool = False,
    **client_kwargs: Any,
) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
    """A copy of `model` on `device` trained on `batches` against fresh shards, one push_pull a batch (`follow`:
    with the step run as its `backward`, the exchange starting during it): its state after each step (on the CPU)
    and the losses. Checks that every exchange writes the model's tensors in place."""
    model = copy.deepcopy(model).to(device)
    where = {name: (t.data_ptr(), t.stride()) for name, t in model.state_dict().items()}
    states, losses = [], []
    kwargs = {"timeout": CLIENT_TIMEOUT, **client_kwargs}
    with LocalCluster(config, shards=2) as cluster, PSClient(cluster.address, **kwargs) as client:
        client.register(model)
        if torch.device(device).type == "cuda":  # every tensor goes through a pinned host mirror (private API)
            assert all(m is not None and m.is_pinned() for m in client._bind(model).host)
        for batch in batches:

            def backward(batch: Batch = batch) -> None:
                model.zero_grad(set_to_none=True)
                losses.append(step(model, tuple(t.to(device) for t in batch)))

            if follow:
                client.push_pull(model, backward=backward)
            else:
                backward()
                client.push_pull(model)
            # Cloned on the device (no wait for the host): ordered after the non_blocking copies, as the next step is.
            states.append({name: t.detach().clone() for name, t in model.state_dict().items()})
        assert client.versions == [len(batches)] * 2
    assert {name: (t.data_ptr(), t.stride()) for name, t in model.state_dict().items()} == where, "not in place"
    assert all(t.device == torch.device(device) for t in model.state_dict().values())
    return [{name: t.cpu() for name, t in state.items()} for state in states], losses


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    """Tensor by tensor to 1e-5 (dtypes and shapes equal too), naming the first one that differs."""
    assert list(got) == list(want), what
    for name, w in want.items():
        try:
            torch.testing.assert_close(got[name], w, atol=TOL, rtol=TOL)
        except AssertionError as exc:
            raise AssertionError(f"{what}: {name}: {exc}") from None


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_dense_weights_after_each_step_equal_the_cpu_runs(transport: str) -> None:
    if transport == "shared-memory" and not shm.available():
        pytest.skip("no shared memory (sealed memfds) on this machine")
    torch.manual_seed(0)
    model, batches = _Dense(), _batches()
    assert not model.proj.is_contiguous() and not copy.deepcopy(model).to(DEVICE).proj.is_contiguous()
    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1)
    want, _ = _trained(config, model, batches, "cpu", _float32_step, **TRANSPORTS[transport])
    got, _ = _trained(config, model, batches, DEVICE, _float32_step, **TRANSPORTS[transport])
    for step, (g, w) in enumerate(zip(got, want, strict=True), 1):
        _assert_close(g, w, f"step {step}")
    assert not torch.equal(want[-1]["proj"], model.proj.detach()), "the weights did not move"


@pytest.mark.parametrize("transport", ["shared-memory", "data-socket"])
def test_an_exchange_during_backward_on_the_device_equals_the_cpu_runs(transport: str) -> None:
    """push_pull(backward=...) (ps-worker --overlap-backward) with the gradients on the device: each piece goes out
    (through its host mirror) as soon as backward has made it; the larger part is over one message, so it streams."""
    if transport == "shared-memory" and not shm.available():
        pytest.skip("no shared memory (sealed memfds) on this machine")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 1100), nn.ReLU(), nn.Linear(1100, 600), nn.ReLU(), nn.Linear(600, 3))
    batches = _batches()
    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1)
    want, _ = _trained(config, model, batches, "cpu", _float32_step, **TRANSPORTS[transport])
    got, _ = _trained(config, model, batches, DEVICE, _float32_step, True, **TRANSPORTS[transport])
    for step, (g, w) in enumerate(zip(got, want, strict=True), 1):
        _assert_close(g, w, f"step {step}")


def test_batchnorm_buffers_and_weights_equal_the_cpu_runs() -> None:
    torch.manual_seed(0)
    model, batches = _Dense(batchnorm=True), _batches()
    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1)
    want, _ = _trained(config, model, batches, "cpu", _float32_step)
    got, _ = _trained(config, model, batches, DEVICE, _float32_step)
    assert {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"} <= set(got[-1])
    _assert_close(got[-1], want[-1], "the final state")
    tracked = got[-1]["bn.num_batches_tracked"]
    assert tracked.dtype == torch.int64 and int(tracked) == len(batches), tracked
    assert not torch.equal(got[-1]["bn.running_mean"], model.state_dict()["bn.running_mean"]), (
        "the buffers did not move"
    )


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_autocast_on_the_device_trains_close_to_the_cpu_float32_run(precision: str) -> None:
    try:
        mixed = MixedPrecision.for_device(precision, torch.device(DEVICE))
    except ValueError as exc:
        pytest.skip(str(exc))
    torch.manual_seed(0)
    model, batches = _Dense(), _batches()

    def autocast_step(net: nn.Module, batch: Batch) -> float:
        with torch.no_grad(), mixed.autocast():
            assert net.get_submodule("fc")(batch[0]).dtype == mixed.dtype  # autocast did run on this device
        return compute_gradients(net, batch[0], batch[1], precision=mixed)  # float32 gradients, unscaled

    config = ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=0.1)
    want, _ = _trained(config, model, batches, "cpu", _float32_step)
    got, losses = _trained(config, model, batches, DEVICE, autocast_step)
    assert all(math.isfinite(loss) for loss in losses), losses
    start = model.state_dict()
    moved_by = torch.cat([(got[-1][n] - start[n]).flatten() for n in start])
    float32_moved_by = torch.cat([(want[-1][n] - start[n]).flatten() for n in start])
    assert moved_by.norm() > 0, "the steps did not change the weights"
    # The update's relative distance from float32's: bfloat16 keeps 8 bits of mantissa (float16 11), so each operand
    # of the forward pass is off by up to 2^-9 (2^-12), and the gradients and so the update by about 1e-3 to 1e-2
    # relative (this model on the CPU: 0.028 for bfloat16, 5.5e-4 for float16). Below 0.1 is that with margin; a
    # wrong gradient (left scaled, another batch's, not pushed) is off by O(1). Above 1e-5: the cast did happen.
    relative = float((moved_by - float32_moved_by).norm() / float32_moved_by.norm())
    assert 1e-5 < relative < 0.1, relative


N, BAG_N, DIM = 64, 40, 8


class _Sparse(nn.Module):
    """A table gathered per ID, a bag table pooled by sum, and a dense head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * DIM, 1)
        self.item = SparseEmbedding(dim=DIM, num_embeddings=N, init_scale=0.3, seed=7)
        self.tags = SparseEmbedding(dim=DIM, num_embeddings=BAG_N, mode="sum", init="uniform", init_scale=0.2)

    def forward(self, ids: torch.Tensor, bag: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.item(ids), self.tags(bag, offsets)], 1)).squeeze(-1)


def _sparse_batches(steps: int = 5, size: int = 16) -> list[Batch]:
    """Zipf-ish IDs (repeats within and across batches), bags of 1 to 3 tags, targets."""
    g = torch.Generator().manual_seed(3)
    out: list[Batch] = []
    for _ in range(steps):
        ids = (torch.rand(size, generator=g) ** 3 * N).long()
        lengths = torch.randint(1, 4, (size,), generator=g)
        bag = torch.randint(0, BAG_N, (int(lengths.sum()),), generator=g)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
        out.append((ids, bag, offsets, torch.randn(size, generator=g)))
    return out


def _sparse_run(model: _Sparse, batches: list[Batch], device: str) -> dict[str, torch.Tensor]:
    """Train a copy of `model` on `device`, prefetching each next batch's IDs; check forward passes on IDs that were
    not prefetched against the rows read back; return the rows, the dense weights and the last predictions."""
    model = copy.deepcopy(model).to(device)
    on_device = [tuple(t.to(device) for t in batch) for batch in batches]
    assert on_device[0][0].dtype == torch.int64 and on_device[0][0].device == torch.device(device)
    config = ServerConfig(mode="sync", workers=1, optimizer="adagrad", lr=0.1)
    with LocalCluster(config, shards=2) as cluster, PSClient(cluster.address, timeout=CLIENT_TIMEOUT) as client:
        client.register(model)
        for t, (ids, bag, offsets, y) in enumerate(on_device):
            model.zero_grad(set_to_none=True)
            ((model(ids, bag, offsets) - y) ** 2).mean().backward()
            if t + 1 < len(on_device):
                model.item.prefetch(on_device[t + 1][0])
                model.tags.prefetch(on_device[t + 1][1])
            client.push_pull(model)
        lookups = sum(
            int(s.metrics.registry.get_sample_value("paramserver_lookups_total", {"shard": str(s.index)}) or 0)
            for s in cluster.shards
        )
        # The first forward pass: a lookup per table and shard; then the rows come with each push_pull (one lookup
        # per shard). More would mean the forward passes on the device did not take the prefetched rows.
        assert lookups == 2 * 2 + 2 * (len(on_device) - 1)
        item = torch.from_numpy(client.lookup(model, 0, np.arange(N)))
        tags = torch.from_numpy(client.lookup(model, 1, np.arange(BAG_N)))
        with torch.no_grad():  # IDs that were not prefetched: looked up, gathered on the device
            every = torch.arange(N, device=device)
            gathered = model.item(every)
            assert gathered.device == every.device
            torch.testing.assert_close(gathered.cpu(), item, rtol=0, atol=0)
            ids, bag, offsets, _ = on_device[-1]
            pooled = model.tags(bag, offsets)
            torch.testing.assert_close(pooled.cpu(), F.embedding_bag(bag.cpu(), tags, offsets.cpu(), mode="sum"))
            predictions = model(ids, bag, offsets).cpu()
    return {"item": item, "tags": tags, "fc.weight": model.fc.weight.detach().cpu(), "predictions": predictions}


def test_sparse_rows_for_device_ids_equal_the_cpu_runs() -> None:
    torch.manual_seed(0)
    model, batches = _Sparse(), _sparse_batches()
    want = _sparse_run(model, batches, "cpu")
    got = _sparse_run(model, batches, DEVICE)
    _assert_close(got, want, "the sparse run")


@pytest.mark.parametrize(
    "mode,overlap,model", [("sync", False, "resnet"), ("async", True, "cnn")], ids=["sync-resnet", "async-overlap-cnn"]
)
def test_the_trainer_on_the_device_finishes_with_the_cpu_runs_metrics(mode: str, overlap: bool, model: str) -> None:
    from worker.data.datasets import load_dataset
    from worker.train.trainer import TrainConfig, train

    try:
        digits = load_dataset("digits")
    except ImportError as exc:
        pytest.skip(str(exc))
    config = ServerConfig(mode=mode, workers=1, optimizer="adam", lr=0.01)
    metrics = {}
    for device in ("cpu", DEVICE):
        with LocalCluster(config, shards=2) as cluster:
            settings = TrainConfig(
                server=cluster.address, model=model, device=device, steps=60, batch_size=32, overlap=overlap,
                progress=False, timeout=CLIENT_TIMEOUT,
            )  # fmt: skip
            metrics[device] = train(settings, dataset=digits)
    want, got = metrics["cpu"], metrics[DEVICE]
    assert got["device"] == str(torch.device(DEVICE)) and got["mode"] == mode
    for m in (want, got):
        assert m["steps"] == 60 and m["server_version"] == 60 and math.isfinite(m["final_loss"]), m
        assert m["test_accuracy"] > 0.6, m  # 10 classes: chance is 0.1 (0.78 and 0.83 on the CPU)
    # Float32 on both (no TF32): the runs differ by rounding only (cuDNN's and the CPU's convolution order, Adam
    # amplifying the noise of gradients near zero), a few test samples at most of 360.
    assert abs(got["test_accuracy"] - want["test_accuracy"]) <= 0.03, (got, want)
    assert got["test_loss"] == pytest.approx(want["test_loss"], rel=0.1)


class _Plain(nn.Module):
    """Plain torch, as someone else wrote it: converted by make_sparse on the device."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.user = nn.Embedding(300, 8, padding_idx=0)
        self.tags = nn.EmbeddingBag(100, 8, mode="sum")
        self.fc = nn.Linear(16, 1)

    def forward(self, user: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.user(user), self.tags(tags)], 1)).squeeze(-1)


def _converted_run(device: str, path: str) -> dict[str, torch.Tensor]:
    from worker import PSOptimizer, load, make_sparse

    g = torch.Generator().manual_seed(9)
    batches = [
        (
            torch.randint(0, 300, (64,), generator=g),
            torch.randint(0, 100, (64, 3), generator=g),
            torch.randn(64, generator=g),
        )
        for _ in range(6)
    ]
    config = ServerConfig(mode="sync", workers=1, optimizer="adagrad", lr=0.05)
    model = make_sparse(_Plain().to(device))
    with LocalCluster(config, shards=2) as cluster, PSClient(cluster.address, timeout=CLIENT_TIMEOUT) as client:
        optimizer = PSOptimizer(model, client)
        for user, tags, y in batches:
            optimizer.zero_grad()
            F.mse_loss(model(user.to(device), tags.to(device)), y.to(device)).backward()
            optimizer.step()
        client.save(model, path)
    served = load(make_sparse(_Plain().to(device)), path)
    with torch.no_grad():
        out = served(batches[0][0].to(device), batches[0][1].to(device))
    assert out.device == torch.device(device)
    return {"served": out.cpu(), **{k: v.cpu() for k, v in served.state_dict().items()}}


def test_a_converted_model_trains_saves_and_serves_on_the_device_as_on_the_cpu(tmp_path: Path) -> None:
    want = _converted_run("cpu", str(tmp_path / "cpu.safetensors"))
    got = _converted_run(DEVICE, str(tmp_path / "device.safetensors"))
    _assert_close(got, want, "make_sparse + PSOptimizer + save/load")


def test_a_host_group_on_the_device_ends_where_the_cpu_group_does(tmp_path: Path) -> None:
    """ps-worker --nproc 2 (one member of the job: the processes' gradients averaged on the host) with both
    processes on the device, against the same on the CPU: the saved models agree."""
    import subprocess
    import sys

    from safetensors.torch import load_file
    from support.jobs import start_ps_server, stop_job

    saved = {}
    for device in ("cpu", DEVICE):
        server, address = start_ps_server("--shards", "2", "--mode", "sync", "--workers", "1", "--lr", "0.05")
        launcher = None
        try:
            path = tmp_path / f"{device.replace(':', '-')}.safetensors"
            cmd = [
                sys.executable, "-m", "worker.cli", "--server", address, "--no-progress", "--nproc", "2",
                "--device", device, "--model", "mlp", "--epochs", "1", "--save-model", str(path),
            ]  # fmt: skip
            launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            _, err = launcher.communicate(timeout=240)
            assert launcher.returncode == 0, err.decode()[-3000:]
        finally:
            stop_job(server, [launcher] if launcher is not None else [])
        saved[device] = load_file(path)
    assert saved["cpu"].keys() == saved[DEVICE].keys()
    for key, want in saved["cpu"].items():
        torch.testing.assert_close(saved[DEVICE][key], want, rtol=0, atol=1e-4)

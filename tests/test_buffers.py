"""A model's buffers (BatchNorm's running statistics) live on the shards with its parameters.

Placement and digest: a buffer is placed like any tensor and named as one in the digest; parameter-only digests
stay what they were. On a Shard: the optimizer never moves a buffer (every optimizer, with weight decay), the
parameters still take exactly torch's step, the `mean` rule sets a buffer to the value its update carries and the
`ema` rule moves it towards that value, and a checkpoint keeps which tensors are buffers. Through real shards and
PSClient: a module registers its persistent buffers after its parameters, a sync round gives every worker the mean of
their buffers (integer ones stay integers), Overlap carries them too, and a worker that joins mid-job evaluates a
BatchNorm ResNet trained by two others, with `--model package.module:factory` and `--save-model`, exactly as they do,
where the same weights with fresh statistics do far worse.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from support.jobs import in_threads
from torch import nn

from paramserver import LocalCluster, ServerConfig
from paramserver.placement import TensorSpec, digest, place
from paramserver.server import reads
from paramserver.shard.durability import checkpoint
from paramserver.shard.state import Shard
from worker import Overlap, PSClient
from worker.data.datasets import load_dataset
from worker.models.builtin import build_model
from worker.train.gradients import accuracy_of
from worker.train.trainer import TrainConfig, train

pytestmark = pytest.mark.timeout(180)

CLIENT_TIMEOUT = 60.0  # seconds for any client call: generous, for a heavily loaded machine
CPU = torch.device("cpu")


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """Give torch's thread count back after a test that runs the trainer (which sets it)."""
    before = torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads(before)


# -- placement and digest ---------------------------------------------------------------------------------------


def test_a_buffer_is_named_in_the_digest_and_parameter_digests_stay_as_they_were() -> None:
    params = [TensorSpec("fc.weight", (3, 4)), TensorSpec("fc.bias", (3,))]
    buffers = [TensorSpec("bn.running_mean", (3,), buffer=True), TensorSpec("bn.num_batches_tracked", (), True)]
    as_params = [TensorSpec(s.name, s.shape) for s in buffers]

    # SPEC.md section 2: a buffer's entry is [name, shape, "buffer"], a parameter's stays [name, shape].
    text = (
        '{"v":1,"shards":2,"slice":10,"tensors":[["fc.weight",[3,4]],["fc.bias",[3]],'
        '["bn.running_mean",[3],"buffer"],["bn.num_batches_tracked",[],"buffer"]]}'
    )
    assert digest(params + buffers, 2, 10) == hashlib.sha256(text.encode()).hexdigest()
    assert digest(params + as_params, 2, 10) != digest(params + buffers, 2, 10)
    plain = '{"v":1,"shards":2,"slice":10,"tensors":[["fc.weight",[3,4]],["fc.bias",[3]]]}'
    assert digest(params, 2, 10) == hashlib.sha256(plain.encode()).hexdigest()
    # Placed like any tensor: the same pieces whatever the flag.
    assert place(params + buffers, 2, 10).shards == place(params + as_params, 2, 10).shards


# -- on one Shard -----------------------------------------------------------------------------------------------

# A parameter, then two buffers (one of them a count), as PSClient orders a module's tensors.
SPECS = (TensorSpec("w", (4,)), TensorSpec("bn.running_var", (3,), buffer=True), TensorSpec("bn.count", (), True))
PARAM, BUFFER = slice(0, 4), slice(4, 8)
INITIAL = torch.tensor([0.5, -1.0, 2.0, 0.25, 1.0, 1.0, 1.0, 0.0])


def _shard(config: ServerConfig, directory: Path | None = None) -> tuple[Shard, str]:
    """A one-shard job holding SPECS at INITIAL, with worker "w" joined; return it and the digest (caller closes)."""
    if directory is not None:
        config = config.replace(checkpoint_dir=str(directory), checkpoint_every="0")
    shard = Shard(config, 0, ("127.0.0.1:1",))
    placement = place(SPECS, 1)
    model = shard.prepare_init(SPECS, 1, placement.digest)
    model.params.copy_(INITIAL)
    shard.commit_init(model)
    shard.join("w", "")
    return shard, placement.digest


def _pushed(gradient: list[float], values: list[float]) -> np.ndarray:
    """What a worker pushes: the parameter's gradient, then the buffers' values."""
    return np.array(gradient + values, dtype=np.float32)


def _held(shard: Shard) -> torch.Tensor:
    out = np.empty(8, dtype=np.float32)
    reads.pull_into(shard, out, 0, CLIENT_TIMEOUT)
    return torch.from_numpy(out)


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam", "adamw", "adagrad"])
def test_the_optimizer_never_moves_a_buffer_and_parameters_take_torchs_step(optimizer: str) -> None:
    config = ServerConfig(mode="async", optimizer=optimizer, lr=0.1, weight_decay=0.1)
    shard, model_digest = _shard(config)
    reference = INITIAL[PARAM].clone()
    kinds = {"sgd": torch.optim.SGD, "momentum": torch.optim.SGD, "adagrad": torch.optim.Adagrad}
    kinds |= {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
    extra = {"momentum": config.momentum} if optimizer == "momentum" else {}
    opt = kinds[optimizer]([reference], lr=0.1, weight_decay=0.1, **extra)
    try:
        for step, (grad, values) in enumerate(
            [([1.0, -2.0, 0.5, 0.0], [2.0, 3.0, 4.0, 1.0]), ([0.5, 0.5, -1.0, 2.0], [1.5, 2.5, 3.5, 2.0])], start=1
        ):
            assert shard.push("w", step, step - 1, _pushed(grad, values), model_digest) == (step, True)
            reference.grad = torch.tensor(grad)
            opt.step()
            held = _held(shard)
            # `mean`, async: each update's value is the pushing worker's, exactly; weight decay never touches it.
            assert torch.equal(held[BUFFER], torch.tensor(values)), optimizer
            torch.testing.assert_close(held[PARAM], reference.detach(), atol=1e-6, rtol=0)
    finally:
        shard.close()


def test_sync_rounds_give_buffers_the_mean_of_the_workers_values() -> None:
    shard, model_digest = _shard(ServerConfig(mode="sync", workers=2, optimizer="adam", lr=0.1))
    try:
        shard.join("v", "")
        shard.push("w", 1, 0, _pushed([1.0] * 4, [2.0, 4.0, 6.0, 1.0]), model_digest)
        assert shard.push("v", 1, 0, _pushed([3.0] * 4, [4.0, 8.0, 2.0, 2.0]), model_digest) == (1, True)
        assert torch.equal(_held(shard)[BUFFER], torch.tensor([3.0, 6.0, 4.0, 1.5]))
    finally:
        shard.close()


def test_the_ema_rule_moves_each_buffer_towards_the_value_of_each_update() -> None:
    config = ServerConfig(mode="async", workers=2, optimizer="sgd", lr=0.5, buffers="ema", buffer_momentum=0.25)
    shard, model_digest = _shard(config)
    try:
        expected = INITIAL[BUFFER].clone()
        for step, values in enumerate([[5.0, 9.0, -3.0, 4.0], [1.0, 1.0, 1.0, 8.0]], start=1):
            shard.push("w", step, step - 1, _pushed([1.0, 0.0, 0.0, 0.0], values), model_digest)
            expected = 0.75 * expected + 0.25 * torch.tensor(values)
            held = _held(shard)
            torch.testing.assert_close(held[BUFFER], expected, atol=1e-6, rtol=0)
        assert torch.equal(held[PARAM], INITIAL[PARAM] - torch.tensor([1.0, 0.0, 0.0, 0.0]))  # 2 steps of lr / 2
    finally:
        shard.close()


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"buffers": "rank0"}, "mean, ema"), ({"buffer_momentum": 0.0}, r"\(0, 1\]"), ({"buffer_momentum": 1.5}, "1.5")],
)
def test_the_config_refuses_an_unknown_rule_and_a_momentum_outside_0_1(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig(**changes)


def test_a_checkpoint_keeps_the_buffers_and_which_tensors_they_are(tmp_path: Path) -> None:
    config = ServerConfig(mode="async", optimizer="adam", lr=0.1, weight_decay=0.1)
    shard, model_digest = _shard(config, tmp_path)
    try:
        shard.push("w", 1, 0, _pushed([1.0, 1.0, 1.0, 1.0], [2.0, 3.0, 4.0, 7.0]), model_digest)
        saved = _held(shard)
    finally:
        shard.close()  # the final checkpoint
    assert checkpoint.load(checkpoint.list_checkpoints(tmp_path, 0)[0]).specs == SPECS

    restored = Shard(config.replace(checkpoint_dir=str(tmp_path)), 0, ("127.0.0.1:1",))
    try:
        assert restored.restore()
        assert restored.describe().specs == SPECS and restored.describe().digest == model_digest
        assert torch.equal(_held(restored), saved)
        restored.join("w", "")
        restored.push("w", 2, 1, _pushed([0.0] * 4, [1.0, 1.0, 1.0, 8.0]), model_digest)
        assert torch.equal(_held(restored)[BUFFER], torch.tensor([1.0, 1.0, 1.0, 8.0])), "still buffers after restore"
    finally:
        restored.close()


# -- through real shards ----------------------------------------------------------------------------------------


class _Norm(nn.Module):
    """A linear layer and a BatchNorm, plus a non-persistent buffer (not state: it stays with each worker)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.fc(x))


def _norm(seed: int) -> _Norm:
    torch.manual_seed(seed)
    return _Norm()


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers() if name.startswith("bn.")}


def test_sync_workers_pull_the_mean_of_their_buffers_and_a_new_worker_gets_them(
    ps_cluster_factory: Callable[..., LocalCluster],
) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=2, optimizer="adam", lr=0.01), shards=2)
    models = [_norm(0), _norm(0)]
    gen = torch.Generator().manual_seed(3)
    data = [[(torch.randn(8, 4, generator=gen) * (rank + 1) + rank) for _ in range(3)] for rank in (0, 1)]
    pushed: dict[int, dict[str, torch.Tensor]] = {}
    pulled: dict[int, dict[str, torch.Tensor]] = {}
    specs: list[TensorSpec] = []

    def worker(rank: int) -> Callable[[], None]:
        def run() -> None:
            model = models[rank]
            with PSClient(cluster.address, timeout=CLIENT_TIMEOUT) as client:
                client.register(model)
                specs[:] = client.placement(model).specs
                for x in data[rank]:
                    model.zero_grad()
                    model(x).square().mean().backward()
                    pushed[rank] = _buffers(model)  # what this step's forward left: the value pushed
                    client.push_pull(model)
                pulled[rank] = _buffers(model)

        return run

    in_threads([worker(0), worker(1)], timeout=120.0)

    # Parameters first, then the persistent buffers, marked as such; the non-persistent one stays home.
    assert [(s.name, s.buffer) for s in specs] == [
        ("fc.weight", False),
        ("fc.bias", False),
        ("bn.weight", False),
        ("bn.bias", False),
        ("bn.running_mean", True),
        ("bn.running_var", True),
        ("bn.num_batches_tracked", True),
    ]
    assert pushed[0]["bn.running_mean"].abs().sum() > 0 and not torch.equal(
        pushed[0]["bn.running_mean"], pushed[1]["bn.running_mean"]
    ), "the workers' statistics differ, so the mean is a real combination"
    for name in ("bn.running_mean", "bn.running_var"):
        mean = (pushed[0][name] + pushed[1][name]) / 2
        for rank in (0, 1):
            torch.testing.assert_close(pulled[rank][name], mean, atol=1e-6, rtol=0)
    for rank in (0, 1):
        count = pulled[rank]["bn.num_batches_tracked"]
        assert count.dtype == torch.int64 and int(count) == 3

    # A worker that joins now (one left: its place is free) gets the job's buffers, in its buffers' own dtypes.
    with PSClient(cluster.address, timeout=CLIENT_TIMEOUT) as late:
        model = _norm(7)
        late.register(model)
        got = _buffers(model)
    assert got.keys() == pulled[0].keys()
    for name, value in pulled[0].items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name


def test_overlap_sends_and_receives_the_buffers(ps_cluster_factory: Callable[..., LocalCluster]) -> None:
    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.1), shards=2)
    model = _norm(0)
    gen = torch.Generator().manual_seed(5)
    with PSClient(cluster.address, timeout=CLIENT_TIMEOUT) as client:
        client.register(model)
        with Overlap(model, client.push_pull) as overlap:
            for _ in range(4):
                model.zero_grad()
                model(torch.randn(8, 4, generator=gen) + 2).square().mean().backward()
                overlap.step()
            overlap.finish()
        held = _norm(1)
        with PSClient(cluster.address, join=False, timeout=CLIENT_TIMEOUT) as reader:
            reader.register(held)
    # The last exchange's buffers landed in the model: the shards' values, which a reader pulls too.
    ours, theirs = _buffers(model), _buffers(held)
    assert ours.keys() == theirs.keys() and all(torch.equal(v, theirs[k]) for k, v in ours.items())
    assert float(theirs["bn.running_mean"].abs().sum()) > 0, "the statistics reached the shards"
    assert theirs["bn.num_batches_tracked"].dtype == torch.int64 and int(theirs["bn.num_batches_tracked"]) >= 2


def test_a_worker_that_joins_mid_job_evaluates_with_the_jobs_statistics(
    ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path, torch_threads: None
) -> None:
    """The issue's scenario: two workers train a BatchNorm ResNet (`--model package.module:factory`) in sync mode
    and save it; a third joins and, before any step, evaluates as they did; the saved model evaluates the same."""
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=2, optimizer="adam", lr=0.01), shards=2)
    digits = load_dataset("digits")
    factory = "worker.models.builtin:resnet"
    metrics: dict[int, dict] = {}

    def fresh(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return build_model(factory, in_shape=digits.in_shape, num_classes=digits.num_classes)

    # Initialised here: the two trainers seed torch's one global RNG from two threads at once, so whichever of their
    # models registers first would be a mix of both draws, and the run would differ from one time to the next.
    with PSClient(cluster.address, timeout=CLIENT_TIMEOUT) as first:
        first.register(fresh(seed=0))

    def worker(rank: int) -> Callable[[], None]:
        def run() -> None:
            config = TrainConfig(
                server=cluster.address,
                model=factory,
                steps=60,
                batch_size=32,
                progress=False,
                timeout=CLIENT_TIMEOUT,
                save_model=str(tmp_path / f"model-{rank}.safetensors"),
            )
            metrics[rank] = train(config, dataset=digits)  # leaves, finished, at the end

        return run

    in_threads([worker(0), worker(1)], timeout=120.0)
    accuracy = metrics[0]["test_accuracy"]
    assert metrics[1]["test_accuracy"] == accuracy > 0.9  # 0.98 here

    with PSClient(cluster.address, timeout=CLIENT_TIMEOUT) as late:
        joined = fresh(seed=11)
        late.register(joined)
        assert accuracy_of(joined, digits.x_test, digits.y_test, CPU) == accuracy

    saved = load_file(tmp_path / "model-0.safetensors")  # --save-model's file, read by safetensors itself
    reloaded = fresh(seed=12)
    reloaded.load_state_dict(saved)
    assert accuracy_of(reloaded, digits.x_test, digits.y_test, CPU) == accuracy
    for name, value in joined.state_dict().items():
        assert torch.equal(saved[name], value), name

    # What a worker had before buffers lived on the shards: the job's weights, its own fresh statistics.
    stale = fresh(seed=12)
    stale.load_state_dict({k: v for k, v in saved.items() if k in dict(stale.named_parameters())}, strict=False)
    assert accuracy_of(stale, digits.x_test, digits.y_test, CPU) < accuracy - 0.3  # 0.40 here

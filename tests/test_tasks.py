"""Tasks beyond classification (regression datasets, losses by name or a user's function or training step) and
mixed precision on the worker (bfloat16 and float16 autocast, float16 loss scaling), on CPU: torch 2.13 autocasts
to both there, so the float16 path runs for real, overflows and all."""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paramserver.config import ServerConfig
from paramserver.server.cluster import LocalCluster
from worker import PSClient
from worker.cli import main as worker_main
from worker.data.datasets import Dataset, batches_in_order, load_dataset
from worker.models.builtin import build_model
from worker.train import precision
from worker.train.gradients import compute_gradients, evaluate
from worker.train.losses import LossStep, resolve_loss, resolve_step
from worker.train.precision import LossScaler, MixedPrecision
from worker.train.trainer import TrainConfig, train

CPU = torch.device("cpu")

USER_MODULE = """
import torch

CALLS = []


def seven(outputs, targets):
    # A loss with a known value and a zero gradient: what a job reports is this function's, or it is not.
    CALLS.append((tuple(outputs.shape), outputs.dtype, tuple(targets.shape)))
    return (outputs * 0).sum() + 7.0


def half_l1(outputs, targets):
    return 0.5 * (outputs - targets).abs().mean()


def per_sample(outputs, targets):
    return (outputs - targets) ** 2


def detached(outputs, targets):
    return ((outputs - targets) ** 2).mean().detach()


def a_number(outputs, targets):
    return 1.0


def doubled_input_step(model, x, y):
    # A step whose forward is not model(x).
    return torch.nn.functional.mse_loss(model(2 * x).squeeze(-1), y)


criterion = torch.nn.L1Loss()
not_callable = 3
Klass = torch.nn.L1Loss
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A user's module of losses and steps, importable by the name it returns (fresh for each test)."""
    name = f"user_losses_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name


@pytest.fixture(scope="module")
def diabetes() -> Dataset:
    return load_dataset("diabetes")


def _mlp(outputs: int = 1, seed: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return build_model("mlp", in_shape=(10,), num_classes=outputs)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _relative(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    diff = torch.cat([(g - w).flatten() for g, w in zip(got, want, strict=True)])
    return float(diff.norm() / torch.cat([w.flatten() for w in want]).norm())


# --- datasets -----------------------------------------------------------------------------------------------


def test_diabetes_is_a_standardised_fixed_regression(diabetes: Dataset) -> None:
    again = load_dataset("diabetes")
    assert torch.equal(diabetes.x_train, again.x_train) and torch.equal(diabetes.y_test, again.y_test)
    assert diabetes.task == "regression" and diabetes.num_classes == 1 and diabetes.in_shape == (10,)
    assert diabetes.x_train.shape == (353, 10) and diabetes.x_test.shape == (89, 10)
    assert diabetes.y_train.shape == (353,) and diabetes.y_train.dtype == torch.float32
    # Standardised with the train split's statistics: exactly there, only roughly on the test split.
    assert (
        diabetes.x_train.mean(0).abs().max() < 1e-5 and (diabetes.x_train.std(0, correction=0) - 1).abs().max() < 1e-4
    )
    assert abs(float(diabetes.y_train.mean())) < 1e-5 and abs(float(diabetes.y_train.std(correction=0)) - 1) < 1e-4
    assert 0.5 < float(diabetes.y_test.pow(2).mean()) < 1.5


def test_npz_float_targets_make_a_regression(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x_train, x_test = rng.normal(size=(20, 4)), rng.normal(size=(6, 4))
    one = tmp_path / "one.npz"
    np.savez(one, x_train=x_train, y_train=rng.normal(size=20), x_test=x_test, y_test=np.arange(6))  # int test y: ok
    ds = load_dataset(str(one))
    assert ds.task == "regression" and ds.num_classes == 1
    assert ds.y_train.dtype == ds.y_test.dtype == torch.float32 and ds.y_test.tolist() == [0, 1, 2, 3, 4, 5]
    three = tmp_path / "three.npz"
    np.savez(three, x_train=x_train, y_train=rng.normal(size=(20, 3)), x_test=x_test, y_test=rng.normal(size=(6, 3)))
    ds = load_dataset(str(three))
    assert ds.task == "regression" and ds.num_classes == 3 and ds.y_test.shape == (6, 3)
    # Integer labels are still a classification's.
    labels = tmp_path / "labels.npz"
    np.savez(labels, x_train=x_train, y_train=np.arange(20) % 3, x_test=x_test, y_test=np.arange(6) % 3)
    assert load_dataset(str(labels)).task == "classification"


@pytest.mark.parametrize(
    ("y_train", "y_test", "match"),
    [
        (np.array(["a"] * 20), np.array(["b"] * 6), "integer class labels.*regression.*<U1"),
        (np.zeros(20), np.array(["b"] * 6), "y_test must hold float regression targets"),
        (np.zeros((20, 2)), np.zeros((6, 3)), r"y_test has targets of shape \(3,\)"),
        (np.full(20, np.nan), np.zeros(6), "y_train holds NaN"),
        (np.zeros((20, 2, 2)), np.zeros((6, 2, 2)), r"\(20,\) or \(20, k\)"),
        (np.zeros((20, 2), dtype=np.int64), np.zeros((6, 2), dtype=np.int64), r"must have shape \(20,\)"),
    ],
)
def test_npz_refuses_targets_it_cannot_train_on(
    tmp_path: Path, y_train: np.ndarray, y_test: np.ndarray, match: str
) -> None:
    path = tmp_path / "bad.npz"
    np.savez(path, x_train=np.zeros((20, 4)), y_train=y_train, x_test=np.zeros((6, 4)), y_test=y_test)
    with pytest.raises(ValueError, match=match):
        load_dataset(str(path))


def test_dataset_task_is_checked() -> None:
    x, y = torch.zeros(4, 2), torch.zeros(4)
    with pytest.raises(ValueError, match="unknown task"):
        Dataset("d", x, y, x, y, (2,), 1, task="ranking")
    with pytest.raises(ValueError, match="float targets"):
        Dataset("d", x, y.long(), x, y.long(), (2,), 1, task="regression")


# --- losses -------------------------------------------------------------------------------------------------


def test_auto_picks_by_task_and_builtins_refuse_the_other_task() -> None:
    assert resolve_loss("auto", "classification") is F.cross_entropy
    outputs, targets = torch.randn(8, 1), torch.randn(8)
    mse = resolve_loss("auto", "regression")
    # A single output column against (N,) targets is compared row by row, not broadcast to (N, N).
    assert float(LossStep(mse).on_outputs(outputs, targets)) == pytest.approx(float(F.mse_loss(outputs[:, 0], targets)))
    assert float(LossStep(resolve_loss("huber", "regression")).on_outputs(outputs, targets)) == pytest.approx(
        float(F.huber_loss(outputs[:, 0], targets))
    )
    with pytest.raises(ValueError, match=r"outputs of shape \(8, 2\) for targets of shape \(8,\)"):
        LossStep(mse).on_outputs(torch.randn(8, 2), targets)
    with pytest.raises(ValueError, match="cross_entropy is a classification loss.*regression dataset"):
        resolve_loss("cross_entropy", "regression")
    with pytest.raises(ValueError, match="mse is a regression loss.*classification dataset"):
        resolve_loss("mse", "classification")


def test_bad_loss_specs_say_what_is_wrong(user_module: str) -> None:
    with pytest.raises(ValueError, match=r"bad --loss 'hinge': expected one of auto, cross_entropy.*package.module:fn"):
        TrainConfig(loss="hinge")  # refused with the config, before any import
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        resolve_loss("no_such_module_xyz:fn", "regression")
    with pytest.raises(ValueError, match=f"module '{user_module}' has no attribute 'nope'"):
        resolve_loss(f"{user_module}:nope", "regression")
    with pytest.raises(TypeError, match="must name a function, got int"):
        resolve_loss(f"{user_module}:not_callable", "regression")
    with pytest.raises(TypeError, match="names the class L1Loss"):
        resolve_loss(f"{user_module}:Klass", "regression")
    with pytest.raises(ValueError, match="--train-step computes its own loss"):
        TrainConfig(train_step=f"{user_module}:doubled_input_step", loss="mse")
    with pytest.raises(ValueError, match="bad --train-step"):
        TrainConfig(train_step="no_colon")
    with pytest.raises(ValueError, match="precision must be one of"):
        TrainConfig(precision="float64")
    # An instance made in the module is a function enough.
    assert isinstance(resolve_loss(f"{user_module}:criterion", "regression"), nn.L1Loss)


def test_what_a_user_function_returns_is_checked(user_module: str) -> None:
    model, x, y = _mlp(), torch.randn(8, 10), torch.randn(8)
    cases = [
        ("per_sample", ValueError, r"scalar tensor, got shape \(8,\)"),
        ("detached", ValueError, "does not depend on the model's parameters"),
        ("a_number", TypeError, "as a torch tensor, got float"),
    ]
    for fn, error, match in cases:
        step = LossStep(resolve_loss(f"{user_module}:{fn}", "regression"))
        with pytest.raises(error, match=match) as info:
            compute_gradients(model, x, y, step=step)
        assert f"{user_module}:{fn}" in str(info.value)


def test_a_user_loss_is_the_one_minimised(user_module: str) -> None:
    """half_l1 gives the gradient torch gives for the same loss written out, micro-batches and all."""
    x, y = torch.randn(30, 10), torch.randn(30)
    model = _mlp()
    (0.5 * (model(x)[:, 0] - y).abs().mean()).backward()
    expected = _grads(model)
    step = LossStep(resolve_loss(f"{user_module}:half_l1", "regression"))
    loss = compute_gradients(model, x, y, accumulate=3, step=step)
    assert loss == pytest.approx(float(0.5 * (model(x)[:, 0] - y).abs().mean().detach()), rel=1e-5)
    for got, want in zip(_grads(model), expected, strict=True):
        assert torch.allclose(got, want, atol=1e-6)


def test_a_user_training_step(user_module: str, diabetes: Dataset) -> None:
    step = resolve_step(f"{user_module}:doubled_input_step")
    model, x, y = _mlp(), diabetes.x_train[:16], diabetes.y_train[:16]
    F.mse_loss(model(2 * x)[:, 0], y).backward()
    expected = _grads(model)
    compute_gradients(model, x, y, accumulate=2, step=step)
    for got, want in zip(_grads(model), expected, strict=True):
        assert torch.allclose(got, want, atol=1e-6)
    # Evaluation runs the step itself (its forward is not model(x)): a mean loss, no accuracy nor MSE.
    metrics = evaluate(model, batches_in_order(diabetes.x_test, diabetes.y_test, 32), CPU, task="regression", step=step)
    with torch.no_grad():
        mse = float(F.mse_loss(model(2 * diabetes.x_test)[:, 0], diabetes.y_test))
    assert metrics.keys() == {"test_loss"} and metrics["test_loss"] == pytest.approx(mse, rel=1e-5)


def test_evaluate_by_task(diabetes: Dataset) -> None:
    model = _mlp()
    # Uneven batches (32, 32, 25): each batch's mean is weighted by its size.
    regression = evaluate(model, batches_in_order(diabetes.x_test, diabetes.y_test, 32), CPU, task="regression")
    with torch.no_grad():
        mse = float(F.mse_loss(model(diabetes.x_test)[:, 0], diabetes.y_test))
    assert regression.keys() == {"test_loss", "test_mse"}
    assert regression["test_loss"] == pytest.approx(mse, rel=1e-5) and regression["test_mse"] == pytest.approx(mse)
    classifier = _mlp(outputs=3)
    x, y = torch.randn(50, 10), torch.randint(0, 3, (50,))
    classification = evaluate(classifier, iter([(x[:20], y[:20]), (x[20:], y[20:])]), CPU)
    with torch.no_grad():
        logits = classifier(x)
    assert classification["test_accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    assert classification["test_loss"] == pytest.approx(float(F.cross_entropy(logits, y)), rel=1e-5)
    assert classifier.training  # back in the mode it was in


# --- mixed precision ----------------------------------------------------------------------------------------


def test_bfloat16_autocast_gives_float32_gradients_close_to_float32s(diabetes: Dataset) -> None:
    x, y = diabetes.x_train[:64], diabetes.y_train[:64]
    step = LossStep(resolve_loss("auto", "regression"))
    model = _mlp()
    compute_gradients(model, x, y, step=step)
    full = _grads(model)
    bf16 = MixedPrecision.for_device("bfloat16", CPU)
    assert bf16.scaler is None  # float32's range: nothing to scale
    loss = compute_gradients(model, x, y, step=step, precision=bf16)
    half = _grads(model)
    assert all(g.dtype == torch.float32 for g in half) and all(p.dtype == torch.float32 for p in model.parameters())
    assert 1e-4 < _relative(half, full) < 0.1  # 0.025 here: bfloat16 did run (8 bits of mantissa), and stayed close
    assert math.isfinite(loss)


def test_float16_unscales_exactly_and_recovers_from_an_overflow(diabetes: Dataset) -> None:
    x, y = diabetes.x_train[:64], diabetes.y_train[:64]
    step = LossStep(resolve_loss("auto", "regression"))
    model = _mlp()
    compute_gradients(model, x, y, accumulate=2, clip_grad_norm=0.5, step=step)
    full = _grads(model)
    # Scaling by a power of two and back is exact: the same code path with autocast off gives float32's gradient,
    # bit for bit, through accumulation and clipping.
    scaled_only = MixedPrecision("cpu", None, LossScaler(init_scale=2.0**20))
    compute_gradients(model, x, y, accumulate=2, clip_grad_norm=0.5, step=step, precision=scaled_only)
    assert all(torch.equal(g, f) for g, f in zip(_grads(model), full, strict=True))

    fp16 = MixedPrecision.for_device("float16", CPU)  # torch 2.13 autocasts to float16 on CPU
    assert fp16.scaler is not None and fp16.dtype == torch.float16
    compute_gradients(model, x, y, accumulate=2, clip_grad_norm=0.5, step=step, precision=fp16)
    assert fp16.scaler.retries == 0 and fp16.scaler.scale == 2.0**16
    assert _relative(_grads(model), full) < 0.03  # 0.009 here

    # 2**40 times these gradients overflows float16 (65504): the step is computed again at halved scales until it
    # does not, and what is left is the unscaled gradient, not an Inf nor a zero.
    fp16.scaler.scale = 2.0**40
    compute_gradients(model, x, y, accumulate=2, clip_grad_norm=0.5, step=step, precision=fp16)
    got = _grads(model)
    assert fp16.scaler.retries > 0 and fp16.scaler.scale < 2.0**40 and fp16.scaler.skipped == 0
    assert all(torch.isfinite(g).all() for g in got) and _relative(got, full) < 0.03  # 0.009, at scale 2**18


def test_loss_scale_grows_after_a_run_of_finite_steps_and_never_falls_below_its_floor() -> None:
    scaler = LossScaler(init_scale=8.0, growth_interval=2)
    scaler.update(finite=True)
    assert scaler.scale == 8.0
    scaler.update(finite=True)
    assert scaler.scale == 16.0
    for _ in range(10):
        scaler.update(finite=False)
    assert scaler.scale == 1.0 and not scaler.can_back_off() and scaler.retries == 10


def _inf_gradient_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A finite loss (sqrt(0) = 0 added) whose gradient is Inf at every scale (d sqrt(u)/du at 0)."""
    w = next(model.parameters())
    return F.mse_loss(model(x)[:, 0], y) + torch.sqrt(w[0, 0] - w[0, 0].detach())


def _nan_loss_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x)[:, 0], y) * math.nan


def test_an_inf_gradient_is_never_pushed(ps_cluster_factory: Callable[..., LocalCluster], diabetes: Dataset) -> None:
    """No scale cures an Inf gradient nor a NaN loss: the worker pushes zeros (the shards would refuse an Inf), so
    plain SGD leaves every weight where it was, and the job goes on."""
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="sgd", lr=1.0), 2)
    model = _mlp()
    x, y = diabetes.x_train[:32], diabetes.y_train[:32]
    fp16 = MixedPrecision.for_device("float16", CPU)
    assert fp16.scaler is not None
    with PSClient(cluster.address) as client:
        client.register(model)
        before = [p.detach().clone() for p in model.parameters()]
        compute_gradients(model, x, y, step=_inf_gradient_step, precision=fp16)
        assert fp16.scaler.skipped == 1 and fp16.scaler.retries == 16 and fp16.scaler.scale == 1.0  # 2**16 down to 1
        assert all(torch.count_nonzero(g) == 0 for g in _grads(model))
        client.push_pull(model)
        compute_gradients(model, x, y, step=_nan_loss_step, precision=fp16)
        assert fp16.scaler.skipped == 2 and fp16.scaler.retries == 16  # a NaN loss is not the scale's doing
        client.push_pull(model)
        assert all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))
        # And a sound step afterwards trains as usual.
        compute_gradients(model, x, y, step=LossStep(resolve_loss("auto", "regression")), precision=fp16)
        client.push_pull(model)
        assert not all(torch.equal(p.detach(), b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_device_that_cannot_autocast_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "_autocast_works", lambda device, dtype: False)
    with pytest.raises(ValueError, match="--precision float16: torch .* cannot autocast to float16 on cpu; use "):
        MixedPrecision.for_device("float16", CPU)
    with pytest.raises(ValueError, match="unknown precision"):
        MixedPrecision.for_device("float8", CPU)
    assert MixedPrecision.for_device("float32", CPU).dtype is None  # nothing to probe


# --- end to end ---------------------------------------------------------------------------------------------


def test_an_mlp_learns_diabetes_through_the_shards(
    ps_cluster_factory: Callable[..., LocalCluster], diabetes: Dataset, tmp_path: Path
) -> None:
    """A worker in float16 (autocast and loss scaling) against two shards running Adam: after 30 steps of 32 the
    held-out MSE (of standardised targets) falls well below the untrained model's and a constant predictor's."""
    cluster = ps_cluster_factory(ServerConfig(mode="sync", workers=1, optimizer="adam", lr=3e-3), 2)
    torch.manual_seed(0)
    untrained = build_model("mlp", in_shape=(10,), num_classes=1)
    start = evaluate(untrained, batches_in_order(diabetes.x_test, diabetes.y_test), CPU, task="regression")["test_mse"]
    constant = float((diabetes.y_test - diabetes.y_train.mean()).pow(2).mean())  # 0.84
    out = tmp_path / "run.json"
    config = TrainConfig(
        server=cluster.address,
        model="mlp",
        dataset="diabetes",
        steps=30,
        threads=1,
        progress=False,
        precision="float16",
        metrics_out=str(out),
    )
    metrics = train(config)
    assert json.loads(out.read_text())["test_mse"] == metrics["test_mse"]
    assert metrics["task"] == "regression" and metrics["loss"] == "mse" and metrics["precision"] == "float16"
    assert metrics["test_accuracy"] is None and metrics["test_loss"] == pytest.approx(metrics["test_mse"], rel=1e-5)
    assert metrics["skipped_steps"] == 0 and metrics["loss_scale"] <= 2.0**16
    assert metrics["test_mse"] < 0.7 and metrics["test_mse"] < 0.85 * constant < 0.85 * start  # 0.61, 0.84, 0.93


def test_a_user_loss_runs_the_job_and_the_cli_prints_the_test_loss(
    ps_cluster_factory: Callable[..., LocalCluster], user_module: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib

    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.1), 1)
    spec = f"{user_module}:seven"
    metrics = train(
        TrainConfig(server=cluster.address, model="logreg", dataset="diabetes", steps=3, loss=spec, progress=False)
    )
    # Its value is the one trained on and evaluated with; it saw the outputs in float32, aligned with the targets.
    assert metrics["loss"] == spec and metrics["final_loss"] == 7.0 and metrics["test_loss"] == 7.0
    calls = importlib.import_module(user_module).CALLS
    assert (tuple([32]), torch.float32, tuple([32])) in calls and len(calls) == 3 + 1  # 3 steps, 1 test batch
    code = worker_main(
        ["--server", cluster.address, "--model", "logreg", "--dataset", "diabetes", "--steps", "2", "--no-progress"]
    )
    assert code == 0
    assert "final loss" in (line := capsys.readouterr().out) and "test loss " in line and "accuracy" not in line
    # A bad --loss stops ps-worker before it joins, with the reason.
    code = worker_main(["--server", cluster.address, "--dataset", "diabetes", "--loss", "no_such_module_xyz:fn"])
    assert code == 2 and "cannot import module 'no_such_module_xyz'" in capsys.readouterr().err


def test_a_regression_logs_its_test_loss(ps_cluster_factory: Callable[..., LocalCluster], tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cluster = ps_cluster_factory(ServerConfig(mode="async", workers=1, optimizer="sgd", lr=0.1), 1)
    plot = tmp_path / "run.png"
    config = TrainConfig(
        server=cluster.address,
        model="logreg",
        dataset="diabetes",
        steps=3,
        progress=False,
        tensorboard=str(tmp_path),
        plot=str(plot),
    )
    metrics = train(config)
    events = EventAccumulator(str(tmp_path / "worker-0"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "test_loss", "test_mse"} <= tags and "test_accuracy" not in tags
    assert events.Scalars("test_loss")[-1].value == pytest.approx(metrics["test_loss"], rel=1e-5)
    assert plot.stat().st_size > 0


def test_a_step_computed_again_moves_batchnorm_statistics_once() -> None:
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 3, (8,))

    def stepped(scale: float) -> tuple[dict[str, torch.Tensor], int]:
        torch.manual_seed(0)
        model = build_model("resnet", in_shape=(1, 8, 8), num_classes=3)
        fp16 = MixedPrecision.for_device("float16", CPU)
        assert fp16.scaler is not None
        fp16.scaler.scale = scale
        compute_gradients(model, x, y, precision=fp16)
        return {
            k: v.clone() for k, v in model.state_dict().items() if "running" in k or "tracked" in k
        }, fp16.scaler.retries

    once, retries = stepped(2.0**10)
    again, more = stepped(2.0**40)
    assert retries == 0 and more > 0
    assert all(torch.equal(once[k], again[k]) for k in once) and int(again["bn.num_batches_tracked"]) == 1

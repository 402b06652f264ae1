"""Unit tests for the worker's model builder and dataset loading, sharding and batching."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from worker.data.datasets import Dataset, batches, load_dataset, shard_for_rank, steps_per_epoch
from worker.models.builtin import BUILTIN_MODELS, build_model

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def digits() -> Dataset:
    return load_dataset("digits")


@pytest.fixture(scope="module")
def synthetic() -> Dataset:
    return load_dataset("synthetic")


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# --- models -------------------------------------------------------------------------------------------------


def test_mlp_on_digits_has_85002_parameters(digits: Dataset) -> None:
    model = build_model("mlp", in_shape=digits.in_shape, num_classes=digits.num_classes)
    assert _num_params(model) == 85_002


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_builtin_model_forward_on_digits(name: str, digits: Dataset) -> None:
    model = build_model(name, in_shape=digits.in_shape, num_classes=digits.num_classes)
    out = model(digits.x_train[:7])
    assert out.shape == (7, 10)
    assert out.dtype == torch.float32
    # Only the resnet has buffers (BatchNorm's running statistics, held by the shards like its parameters).
    assert bool(list(model.buffers())) == (name == "resnet")


@pytest.mark.parametrize("name", BUILTIN_MODELS)
def test_builtin_models_are_deterministic_given_the_seed(name: str) -> None:
    def build() -> dict[str, torch.Tensor]:
        torch.manual_seed(123)
        return build_model(name, in_shape=(1, 8, 8), num_classes=10).state_dict()

    first, second = build(), build()
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


def test_cnn_on_flat_data_raises_with_a_hint(synthetic: Dataset) -> None:
    with pytest.raises(ValueError, match=r"image-shaped.*\(64,\).*mlp"):
        build_model("cnn", in_shape=synthetic.in_shape, num_classes=synthetic.num_classes)


class _TinyNet(nn.Module):
    def __init__(self, in_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.in_shape = in_shape
        self.fc = nn.Linear(int(np.prod(in_shape)), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1))


def factory(*, in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build a tiny net; referenced as `<this module>:factory` by the tests below."""
    return _TinyNet(in_shape, num_classes)


def test_user_factory_receives_shape_and_classes(digits: Dataset) -> None:
    # __name__ is this module's import path whichever way pytest imported it.
    model = build_model(f"{__name__}:factory", in_shape=digits.in_shape, num_classes=10)
    assert isinstance(model, _TinyNet)
    assert model.in_shape == (1, 8, 8)
    assert model(digits.x_test[:3]).shape == (3, 10)


def test_user_factory_without_arguments_and_bad_return(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_user_models.py").write_text(
        textwrap.dedent(
            """
            from torch import nn

            def plain():
                return nn.Linear(3, 2)

            def not_a_model(in_shape, num_classes):
                return "oops"

            ready = nn.Linear(3, 2)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model = build_model("my_user_models:plain", in_shape=(3,), num_classes=2)
    assert isinstance(model, nn.Linear)
    with pytest.raises(TypeError, match="nn.Module"):
        build_model("my_user_models:not_a_model", in_shape=(3,), num_classes=2)
    with pytest.raises(TypeError, match="callable"):
        build_model("my_user_models:ready", in_shape=(3,), num_classes=2)


@pytest.mark.parametrize("name", ["resnet9000", "no_such_module_xyz:build", f"{__name__}:no_such_factory"])
def test_unknown_model_error_lists_the_accepted_forms(name: str) -> None:
    with pytest.raises(ValueError) as info:
        build_model(name, in_shape=(64,), num_classes=10)
    message = str(info.value)
    for builtin in BUILTIN_MODELS:
        assert builtin in message
    assert "module:factory" in message


# --- datasets -----------------------------------------------------------------------------------------------


def test_digits_split_is_fixed_and_stratified(digits: Dataset) -> None:
    again = load_dataset("digits")
    assert torch.equal(digits.x_train, again.x_train) and torch.equal(digits.y_train, again.y_train)
    assert torch.equal(digits.x_test, again.x_test) and torch.equal(digits.y_test, again.y_test)
    assert digits.in_shape == (1, 8, 8) and digits.num_classes == 10
    assert digits.x_train.dtype == torch.float32 and digits.y_train.dtype == torch.int64
    assert len(digits.x_test) == 360 and digits.num_train + len(digits.x_test) == 1797
    assert 0.0 <= digits.x_train.min() and digits.x_train.max() <= 1.0
    test_counts = torch.bincount(digits.y_test, minlength=10)
    train_counts = torch.bincount(digits.y_train, minlength=10)
    assert (test_counts > 0).all()
    # Stratified: each class's share of the test set is within one sample of its share of the training set.
    expected = train_counts.double() / digits.num_train * len(digits.y_test)
    assert ((test_counts.double() - expected).abs() <= 1.5).all()


def test_synthetic_is_deterministic_and_well_formed(synthetic: Dataset) -> None:
    torch.manual_seed(999)  # a worker's seed must not change the data
    again = load_dataset("synthetic")
    assert torch.equal(synthetic.x_train, again.x_train) and torch.equal(synthetic.y_test, again.y_test)
    assert synthetic.x_train.shape == (8192, 64) and synthetic.x_test.shape == (2048, 64)
    assert synthetic.in_shape == (64,) and synthetic.num_classes == 10 and synthetic.num_train == 8192
    assert synthetic.x_train.dtype == torch.float32 and synthetic.y_train.dtype == torch.int64
    assert (torch.bincount(synthetic.y_train, minlength=10) > 0).all()


def test_unknown_dataset_lists_the_accepted_forms() -> None:
    with pytest.raises(ValueError, match=r"digits.*synthetic.*\.npz"):
        load_dataset("imagenet")


def test_sklearn_is_imported_only_for_digits() -> None:
    # Block sklearn entirely: importing the modules must still work, and digits must say how to install it.
    code = textwrap.dedent(
        """
        import sys
        sys.modules["sklearn"] = None
        import worker.data.datasets, worker.models.builtin
        try:
            worker.data.datasets.load_dataset("digits")
        except ImportError as exc:
            assert "pip install 'paramserver[data]'" in str(exc), exc
        else:
            raise SystemExit("digits loaded without sklearn")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def _save_npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


def test_npz_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x_train = rng.normal(size=(20, 2, 3)).astype(np.float64)
    y_train = rng.integers(0, 4, size=20).astype(np.int32)
    x_test = rng.normal(size=(5, 2, 3)).astype(np.float64)
    y_test = np.array([0, 1, 2, 6, 1], dtype=np.int32)  # the largest label is only in the test split
    path = _save_npz(tmp_path / "toy.npz", x_train=x_train, y_train=y_train, x_test=x_test, y_test=y_test)
    ds = load_dataset(str(path))
    assert ds.in_shape == (2, 3) and ds.num_classes == 7 and ds.num_train == 20
    assert ds.x_train.dtype == torch.float32 and ds.y_test.dtype == torch.int64
    np.testing.assert_allclose(ds.x_train.numpy(), x_train.astype(np.float32))
    np.testing.assert_array_equal(ds.y_test.numpy(), y_test)


def test_npz_missing_key_is_named(tmp_path: Path) -> None:
    path = _save_npz(
        tmp_path / "partial.npz",
        x_train=np.zeros((4, 2)),
        y_train=np.zeros(4, dtype=np.int64),
        x_test=np.zeros((2, 2)),
    )
    with pytest.raises(ValueError, match="y_test"):
        load_dataset(str(path))


def test_npz_shape_mismatches_are_rejected(tmp_path: Path) -> None:
    labels = np.zeros(4, dtype=np.int64)
    wrong_sample = _save_npz(
        tmp_path / "a.npz", x_train=np.zeros((4, 2)), y_train=labels, x_test=np.zeros((4, 3)), y_test=labels
    )
    with pytest.raises(ValueError, match="must match"):
        load_dataset(str(wrong_sample))
    wrong_length = _save_npz(
        tmp_path / "b.npz", x_train=np.zeros((5, 2)), y_train=labels, x_test=np.zeros((4, 2)), y_test=labels
    )
    with pytest.raises(ValueError, match="y_train"):
        load_dataset(str(wrong_length))


def test_npz_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.npz"):
        load_dataset(str(tmp_path / "nope.npz"))


# --- sharding and batching ----------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 3, 4, 7])
def test_shards_are_disjoint_equal_and_cover_all_but_the_remainder(world: int) -> None:
    n = 103
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    y = torch.arange(n)
    parts = [shard_for_rank(x, y, rank, world) for rank in range(world)]
    ids = [py.tolist() for _, py in parts]
    assert all(len(part) == n // world for part in ids)
    assert all(torch.equal(px.squeeze(1).long(), py) for px, py in parts)  # x and y stay paired
    covered = {i for part in ids for i in part}
    assert len(covered) == n // world * world
    # Deterministic: a second call (as from another process) gives the same shard.
    assert torch.equal(shard_for_rank(x, y, world - 1, world)[1], parts[-1][1])


def test_shards_mix_a_class_sorted_dataset() -> None:
    y = torch.arange(10).repeat_interleave(50)  # sorted by class: contiguous blocks would be single-class
    _, part = shard_for_rank(y.float().unsqueeze(1), y, 0, 5)
    assert len(torch.unique(part)) == 10


@pytest.mark.parametrize(("rank", "world"), [(-1, 2), (2, 2), (0, 0)])
def test_shard_rejects_bad_rank_or_world(rank: int, world: int) -> None:
    x = torch.zeros(10, 1)
    with pytest.raises(ValueError):
        shard_for_rank(x, torch.zeros(10, dtype=torch.int64), rank, world)


def test_batches_cover_the_shard_once_per_epoch_and_reshuffle() -> None:
    n, batch_size = 50, 16
    x = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    y = torch.arange(n)
    orders = {}
    for epoch in (0, 1):
        got = list(batches(x, y, batch_size, seed=3, epoch=epoch))
        assert len(got) == steps_per_epoch(n, batch_size) == 4
        assert [len(by) for _, by in got] == [16, 16, 16, 2]
        order = torch.cat([by for _, by in got])
        assert sorted(order.tolist()) == list(range(n))
        assert all(torch.equal(bx.squeeze(1).long(), by) for bx, by in got)
        orders[epoch] = order
    assert not torch.equal(orders[0], orders[1])
    again = torch.cat([by for _, by in batches(x, y, batch_size, seed=3, epoch=1)])
    assert torch.equal(again, orders[1])
    other_seed = torch.cat([by for _, by in batches(x, y, batch_size, seed=4, epoch=1)])
    assert not torch.equal(other_seed, orders[1])


def test_steps_per_epoch_rounds_up() -> None:
    assert steps_per_epoch(64, 32) == 2
    assert steps_per_epoch(65, 32) == 3
    assert steps_per_epoch(0, 32) == 0
    with pytest.raises(ValueError):
        steps_per_epoch(10, 0)


# --- learnability -------------------------------------------------------------------------------------------


def test_logreg_learns_synthetic(synthetic: Dataset) -> None:
    torch.manual_seed(0)
    model = build_model("logreg", in_shape=synthetic.in_shape, num_classes=synthetic.num_classes)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    step, epoch = 0, 0
    while step < 200:
        for xb, yb in batches(synthetic.x_train, synthetic.y_train, 256, seed=0, epoch=epoch):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            step += 1
            if step == 200:
                break
        epoch += 1
    with torch.no_grad():
        accuracy = (model(synthetic.x_test).argmax(dim=1) == synthetic.y_test).float().mean().item()
    assert accuracy > 0.8

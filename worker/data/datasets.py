"""Load a worker's dataset, take its rank's shard, and cut the shard into shuffled batches."""

# Depends on torch and numpy; scikit-learn is imported only when the digits or diabetes dataset is asked for.

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from worker.data.stream import StreamedDataset

# Fixed seeds, independent of any worker's seed, so every worker sees the same data, split and shards.
_SPLIT_SEED = 0
_SYNTHETIC_SEED = 0
_SHARD_SEED = 0

_NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
_ACCEPTED = (
    "'digits', 'synthetic', 'diabetes', a prepared dataset (ps-prepare's directory, or its manifest's URL), or a "
    "path to a .npz file with arrays "
    + ", ".join(_NPZ_KEYS)
    + " (integer y: class labels; float y: regression targets)"
)
TASKS: tuple[str, ...] = ("classification", "regression")


# eq=False: field-wise equality over tensors is ambiguous, and identity hashing is what a frozen holder needs.
@dataclass(frozen=True, eq=False)
class Dataset:
    """A dataset already split into train and test tensors.

    classification: y holds int64 class labels, shape (N,), and `num_classes` is the number of classes;
    regression: y holds float32 targets, shape (N,) or (N, k), and `num_classes` is the number of outputs the model
    needs (k, or 1 for (N,)): what models.build_model is given either way.
    """

    name: str
    x_train: torch.Tensor  # float32, (N, *in_shape)
    y_train: torch.Tensor  # classification: int64 (N,); regression: float32 (N,) or (N, k)
    x_test: torch.Tensor  # float32, (M, *in_shape)
    y_test: torch.Tensor  # as y_train, with M rows
    in_shape: tuple[int, ...]  # shape of one sample
    num_classes: int
    task: str = "classification"

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}: expected one of {', '.join(TASKS)}")
        if self.task == "regression" and not self.y_train.is_floating_point():
            raise ValueError(f"a regression dataset needs float targets, got {self.y_train.dtype}")

    @property
    def num_train(self) -> int:
        """Return the number of training samples."""
        return len(self.x_train)

    @property
    def num_test(self) -> int:
        """Return the number of test samples."""
        return len(self.x_test)

    # The training loop's view of its data, shared with worker.data.stream.StreamedDataset (a prepared dataset).

    def samples_per_epoch(self, world: int) -> int:
        """Samples each of `world` ranks takes per epoch (its share; the remainder is dropped)."""
        return len(self.x_train) // world

    def batches(
        self, rank: int, world: int, batch_size: int, *, seed: int, epoch: int, start: int = 0
    ) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
        """Rank `rank`'s (x, y) batches of `epoch`, in an order drawn from (seed + rank, epoch), from sample
        `start` of the epoch on."""
        x, y = shard_for_rank(self.x_train, self.y_train, rank, world)
        return batches(x, y, batch_size, seed=seed + rank, epoch=epoch, start=start)

    def test_batches(self, batch_size: int = 1024) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
        """The held-out split's (x, y) batches, in order."""
        return batches_in_order(self.x_test, self.y_test, batch_size)


def open_dataset(spec: str, prefetch: int = 2) -> Dataset | StreamedDataset:
    """The dataset a --dataset value names: a prepared one (its directory, its manifest, or a URL: streamed
    shard by shard, `prefetch` shards ahead), else one `load_dataset` loads into memory."""
    from worker.data.manifest import is_prepared

    if is_prepared(spec):
        from worker.data.stream import StreamedDataset

        return StreamedDataset(spec, prefetch=prefetch)
    return load_dataset(spec)


def load_dataset(spec: str) -> Dataset:
    """Load the dataset named by `spec`: 'digits', 'synthetic', 'diabetes', or a path to a .npz file."""
    if spec == "digits":
        return _digits()
    if spec == "synthetic":
        return _synthetic()
    if spec == "diabetes":
        return _diabetes()
    if spec.lower().endswith(".npz"):
        return _npz(Path(spec))
    raise ValueError(f"unknown dataset {spec!r}: expected {_ACCEPTED}")


def _digits() -> Dataset:
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise ImportError("the 'digits' dataset needs scikit-learn: pip install 'paramserver[data]'") from exc
    bunch = load_digits()
    x = (bunch.images.astype(np.float32) / 16.0)[:, None]  # (N, 1, 8, 8), pixels 0..16 scaled to 0..1
    y = bunch.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=_SPLIT_SEED, stratify=y)
    return _make("digits", x_train, y_train, x_test, y_test, num_classes=10)


def _diabetes() -> Dataset:
    """scikit-learn's diabetes regression (442 patients, 10 features, a disease progression score a year later),
    split 80/20 with the fixed seed; features and target standardised with the train split's mean and standard
    deviation, so a constant predictor's test MSE is about 1 (0.84 on this split) and a linear fit's about 0.56."""
    try:
        from sklearn.datasets import load_diabetes
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise ImportError("the 'diabetes' dataset needs scikit-learn: pip install 'paramserver[data]'") from exc
    x, y = load_diabetes(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=_SPLIT_SEED)
    # Train statistics only: the test split must not leak into what the model sees.
    x_mean, x_std = x_train.mean(axis=0), x_train.std(axis=0)
    y_mean, y_std = y_train.mean(), y_train.std()
    return _make(
        "diabetes",
        (x_train - x_mean) / x_std,
        (y_train - y_mean) / y_std,
        (x_test - x_mean) / x_std,
        (y_test - y_mean) / y_std,
        num_classes=1,
        task="regression",
    )


def _synthetic(
    n_train: int = 8192, n_test: int = 2048, features: int = 64, classes: int = 10, noise: float = 0.5
) -> Dataset:
    g = torch.Generator().manual_seed(_SYNTHETIC_SEED)
    teacher = torch.randn(features, classes, generator=g)
    x = torch.randn(n_train + n_test, features, generator=g)
    # The noise (std 0.5 against teacher logits of std ~8) flips only near-tie labels, so a linear model can
    # still fit nearly all of them.
    y = (x @ teacher + noise * torch.randn(n_train + n_test, classes, generator=g)).argmax(dim=1)
    return Dataset(
        name="synthetic",
        x_train=x[:n_train].contiguous(),
        y_train=y[:n_train].contiguous(),
        x_test=x[n_train:].contiguous(),
        y_test=y[n_train:].contiguous(),
        in_shape=(features,),
        num_classes=classes,
    )


def _npz(path: Path) -> Dataset:
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {str(path)!r} does not exist (expected a .npz with {_NPZ_KEYS})")
    with np.load(path, allow_pickle=False) as npz:
        missing = [key for key in _NPZ_KEYS if key not in npz.files]
        if missing:
            raise ValueError(f"{path} is missing array(s) {', '.join(missing)}; it must hold {', '.join(_NPZ_KEYS)}")
        x_train, y_train, x_test, y_test = (npz[key] for key in _NPZ_KEYS)
    # y_train's dtype decides the task: float targets are a regression's; labels are never cast to float nor
    # float targets truncated to labels.
    regression = np.issubdtype(y_train.dtype, np.floating)
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        if x.ndim < 2:
            raise ValueError(f"{path}: x_{split} must have shape (N, ...features), got {x.shape}")
        if regression:
            _check_targets(path, split, x, y, y_train)
            continue
        if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.bool_)):
            raise ValueError(
                f"{path}: y_{split} must hold integer class labels (or, for a regression, y_train and y_test float "
                f"targets), got dtype {y.dtype}"
            )
        if y.ndim != 1 or len(y) != len(x):
            raise ValueError(f"{path}: y_{split} must have shape ({len(x)},) to match x_{split}, got {y.shape}")
        if len(y) and y.min() < 0:
            raise ValueError(f"{path}: y_{split} has negative labels; classes must be 0..num_classes-1")
    if len(x_train) == 0:
        raise ValueError(f"{path}: x_train is empty")
    if x_test.shape[1:] != x_train.shape[1:]:
        raise ValueError(
            f"{path}: test samples have shape {x_test.shape[1:]} but train samples have shape "
            f"{x_train.shape[1:]}; they must match"
        )
    if regression:
        outputs = 1 if y_train.ndim == 1 else int(y_train.shape[1])
        return _make(path.name, x_train, y_train, x_test, y_test, num_classes=outputs, task="regression")
    num_classes = int(max(y_train.max(), y_test.max() if len(y_test) else 0)) + 1
    return _make(path.name, x_train, y_train, x_test, y_test, num_classes=num_classes)


def _check_targets(path: Path, split: str, x: np.ndarray, y: np.ndarray, y_train: np.ndarray) -> None:
    """Refuse regression targets that are not numbers, not one row per sample, shaped unlike y_train's, or not
    finite (a NaN target would make every gradient NaN, which the shards refuse)."""
    if not (np.issubdtype(y.dtype, np.floating) or np.issubdtype(y.dtype, np.integer)):
        raise ValueError(f"{path}: y_{split} must hold float regression targets like y_train, got dtype {y.dtype}")
    if y.ndim not in (1, 2) or len(y) != len(x):
        raise ValueError(
            f"{path}: y_{split} must hold regression targets of shape ({len(x)},) or ({len(x)}, k) to match "
            f"x_{split}, got {y.shape}"
        )
    if y.shape[1:] != y_train.shape[1:]:
        raise ValueError(f"{path}: y_{split} has targets of shape {y.shape[1:]}, y_train {y_train.shape[1:]}")
    if not np.isfinite(y).all():
        raise ValueError(f"{path}: y_{split} holds NaN or Inf targets")


def _make(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    num_classes: int,
    task: str = "classification",
) -> Dataset:
    def floats(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))

    def labels(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

    targets = floats if task == "regression" else labels
    return Dataset(
        name=name,
        x_train=floats(x_train),
        y_train=targets(y_train),
        x_test=floats(x_test),
        y_test=targets(y_test),
        in_shape=tuple(int(d) for d in x_train.shape[1:]),
        num_classes=num_classes,
        task=task,
    )


def shard_for_rank(x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return rank `rank`'s disjoint shard of (x, y), len(x) // world samples, the same on every call."""
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    if len(x) != len(y):
        raise ValueError(f"x and y differ in length: {len(x)} != {len(y)}")
    per_rank = len(x) // world
    if per_rank == 0:
        raise ValueError(f"cannot shard {len(x)} samples over {world} workers: each would get none")
    # Every rank drops the remainder so all run the same number of steps per epoch; the fixed permutation
    # mixes classes so that contiguous blocks of a class-sorted dataset are still roughly balanced.
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(_SHARD_SEED))
    idx = perm[rank * per_rank : (rank + 1) * per_rank]
    return x[idx], y[idx]


def batches(
    x: torch.Tensor, y: torch.Tensor, batch_size: int, *, seed: int, epoch: int, start: int = 0
) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
    """Yield (x, y) batches in an order shuffled by (seed, epoch), from position `start` of that order on; the
    last batch may be short."""
    # Validate here, not in the generator, so bad arguments fail at the call rather than at the first next().
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if len(x) != len(y):
        raise ValueError(f"x and y differ in length: {len(x)} != {len(y)}")
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be non-negative, got seed={seed}, epoch={epoch}")
    # SeedSequence mixes the pair, so nearby (seed, epoch) pairs never share a shuffle.
    mixed = int(np.random.SeedSequence([seed, epoch]).generate_state(1, dtype=np.uint64)[0])
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(mixed))
    if not 0 <= start <= len(x):
        raise ValueError(f"start must be in [0, {len(x)}], got {start}")
    return _iter_batches(x, y, perm[start:], batch_size)


def _iter_batches(
    x: torch.Tensor, y: torch.Tensor, perm: torch.Tensor, batch_size: int
) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
    for start in range(0, len(perm), batch_size):
        idx = perm[start : start + batch_size]
        yield x[idx], y[idx]


def batches_in_order(
    x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024
) -> Generator[tuple[torch.Tensor, torch.Tensor], None, None]:
    """Yield (x, y) batches in order, each a view: how a held-out split is fed to evaluation."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if len(x) != len(y):
        raise ValueError(f"x and y differ in length: {len(x)} != {len(y)}")
    return ((x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size))


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Return how many batches `batches` yields for `n` samples: ceil(n / batch_size)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    return -(-n // batch_size)

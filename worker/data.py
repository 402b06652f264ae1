"""Load a worker's dataset, take its rank's shard, and cut the shard into shuffled batches."""

# Depends on torch and numpy; scikit-learn is imported only when the digits dataset is asked for.

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# Fixed seeds, independent of any worker's seed, so every worker sees the same data, split and shards.
_SPLIT_SEED = 0
_SYNTHETIC_SEED = 0
_SHARD_SEED = 0

_NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")
_ACCEPTED = "'digits', 'synthetic', or a path to a .npz file with arrays " + ", ".join(_NPZ_KEYS)


# eq=False: field-wise equality over tensors is ambiguous, and identity hashing is what a frozen holder needs.
@dataclass(frozen=True, eq=False)
class Dataset:
    """A classification dataset already split into train and test tensors."""

    name: str
    x_train: torch.Tensor  # float32, (N, *in_shape)
    y_train: torch.Tensor  # int64, (N,)
    x_test: torch.Tensor  # float32, (M, *in_shape)
    y_test: torch.Tensor  # int64, (M,)
    in_shape: tuple[int, ...]  # shape of one sample
    num_classes: int

    @property
    def num_train(self) -> int:
        """Return the number of training samples."""
        return len(self.x_train)

    @property
    def num_test(self) -> int:
        """Return the number of test samples."""
        return len(self.x_test)


def load_dataset(spec: str) -> Dataset:
    """Load the dataset named by `spec`: 'digits', 'synthetic', or a path to a .npz file."""
    if spec == "digits":
        return _digits()
    if spec == "synthetic":
        return _synthetic()
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
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        if x.ndim < 2:
            raise ValueError(f"{path}: x_{split} must have shape (N, ...features), got {x.shape}")
        if y.ndim != 1 or len(y) != len(x):
            raise ValueError(f"{path}: y_{split} must have shape ({len(x)},) to match x_{split}, got {y.shape}")
        # Casting float labels to int64 would silently truncate them, so only integer labels are accepted.
        if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.bool_)):
            raise ValueError(f"{path}: y_{split} must hold integer class labels, got dtype {y.dtype}")
        if len(y) and y.min() < 0:
            raise ValueError(f"{path}: y_{split} has negative labels; classes must be 0..num_classes-1")
    if len(x_train) == 0:
        raise ValueError(f"{path}: x_train is empty")
    if x_test.shape[1:] != x_train.shape[1:]:
        raise ValueError(
            f"{path}: test samples have shape {x_test.shape[1:]} but train samples have shape "
            f"{x_train.shape[1:]}; they must match"
        )
    num_classes = int(max(y_train.max(), y_test.max() if len(y_test) else 0)) + 1
    return _make(path.name, x_train, y_train, x_test, y_test, num_classes=num_classes)


def _make(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    *,
    num_classes: int,
) -> Dataset:
    def floats(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))

    def labels(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

    return Dataset(
        name=name,
        x_train=floats(x_train),
        y_train=labels(y_train),
        x_test=floats(x_test),
        y_test=labels(y_test),
        in_shape=tuple(int(d) for d in x_train.shape[1:]),
        num_classes=num_classes,
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
    x: torch.Tensor, y: torch.Tensor, batch_size: int, *, seed: int, epoch: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Yield (x, y) batches in an order shuffled by (seed, epoch); the last batch may be short."""
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
    return _iter_batches(x, y, perm, batch_size)


def _iter_batches(
    x: torch.Tensor, y: torch.Tensor, perm: torch.Tensor, batch_size: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for start in range(0, len(perm), batch_size):
        idx = perm[start : start + batch_size]
        yield x[idx], y[idx]


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Return how many batches `batches` yields for `n` samples: ceil(n / batch_size)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    return -(-n // batch_size)

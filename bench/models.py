"""Model factories for the benchmarks, usable by ps-worker: `ps-worker --model bench.models:mlp25m`.

Run ps-worker from the repository root (or with it on PYTHONPATH) so that `bench` is importable.
"""

from __future__ import annotations

import math
from collections import OrderedDict

from torch import nn


def _mlp(in_shape: tuple[int, ...], num_classes: int, widths: tuple[int, ...]) -> nn.Module:
    layers: OrderedDict[str, nn.Module] = OrderedDict(flatten=nn.Flatten())
    fan_in = math.prod(in_shape)
    for i, width in enumerate(widths, start=1):
        layers[f"fc{i}"] = nn.Linear(fan_in, width)
        layers[f"relu{i}"] = nn.ReLU()
        fan_in = width
    layers[f"fc{len(widths) + 1}"] = nn.Linear(fan_in, num_classes)
    return nn.Sequential(layers)


def mlp25m(in_shape: tuple[int, ...] = (64,), num_classes: int = 10) -> nn.Module:
    """An MLP of about 25 M parameters (25,458,698 on 64 features, 10 classes): 64 -> 4096 -> 4096 -> 2048 -> 10."""
    return _mlp(in_shape, num_classes, (4096, 4096, 2048))


def mlp1m(in_shape: tuple[int, ...] = (64,), num_classes: int = 10) -> nn.Module:
    """A small stand-in for mlp25m (about 1.1 M parameters) for `--quick` runs: 64 -> 1024 -> 1024 -> 10."""
    return _mlp(in_shape, num_classes, (1024, 1024))


def count_parameters(model: nn.Module) -> int:
    """Number of parameters of a model."""
    return sum(p.numel() for p in model.parameters())

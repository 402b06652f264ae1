"""Build the model a worker trains: a built-in by name, or any user factory given as `module:factory`."""

# Depends on torch only; the server never imports this module, it sees just the tensors' names and shapes.

from __future__ import annotations

import importlib
import inspect
import math
from collections import OrderedDict
from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

BUILTIN_MODELS: tuple[str, ...] = ("logreg", "mlp", "cnn", "resnet")

_ACCEPTED = f"one of {', '.join(BUILTIN_MODELS)}, or 'package.module:factory'"


def build_model(name: str, *, in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build model `name` for samples shaped `in_shape`; weights come from torch's global RNG."""
    in_shape = tuple(int(d) for d in in_shape)
    if not in_shape or any(d < 1 for d in in_shape):
        raise ValueError(f"in_shape must be a non-empty tuple of positive sizes, got {in_shape}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be at least 1, got {num_classes}")
    if name == "logreg":
        return _logreg(in_shape, num_classes)
    if name == "mlp":
        return _mlp(in_shape, num_classes)
    if name == "cnn":
        return _cnn(in_shape, num_classes)
    if name == "resnet":
        return resnet(in_shape=in_shape, num_classes=num_classes)
    if ":" in name:
        return _from_factory(name, in_shape, num_classes)
    raise ValueError(f"unknown model {name!r}: expected {_ACCEPTED}")


# Layers are named (not numbered) because the state_dict names are the parameter server's keys.


def _logreg(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(OrderedDict(flatten=nn.Flatten(), linear=nn.Linear(math.prod(in_shape), num_classes)))


def _mlp(in_shape: tuple[int, ...], num_classes: int, hidden: int = 256) -> nn.Module:
    return nn.Sequential(
        OrderedDict(
            flatten=nn.Flatten(),
            fc1=nn.Linear(math.prod(in_shape), hidden),
            relu1=nn.ReLU(),
            fc2=nn.Linear(hidden, hidden),
            relu2=nn.ReLU(),
            fc3=nn.Linear(hidden, num_classes),
        )
    )


def _cnn(in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if len(in_shape) != 3:
        raise ValueError(
            f"the cnn needs image-shaped data (C, H, W), but the dataset's samples have shape {in_shape}; "
            "use the mlp for flat features"
        )
    channels, height, width = in_shape
    if height < 2 or width < 2:
        raise ValueError(f"the cnn max-pools by 2, so H and W must be at least 2; got shape {in_shape}")
    # Kept as it was (no BatchNorm) so that its digest, and the checkpoints of jobs that trained it, stay valid.
    return nn.Sequential(
        OrderedDict(
            conv1=nn.Conv2d(channels, 32, 3, padding=1),
            relu1=nn.ReLU(),
            conv2=nn.Conv2d(32, 64, 3, padding=1),
            relu2=nn.ReLU(),
            pool=nn.MaxPool2d(2),
            flatten=nn.Flatten(),
            fc1=nn.Linear(64 * (height // 2) * (width // 2), 128),
            relu3=nn.ReLU(),
            fc2=nn.Linear(128, num_classes),
        )
    )


class _Block(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with BatchNorm, plus the input (projected when its shape changes)."""

    def __init__(self, channels_in: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels:
            self.shortcut = nn.Sequential(
                OrderedDict(
                    conv=nn.Conv2d(channels_in, channels, 1, stride=stride, bias=False), bn=nn.BatchNorm2d(channels)
                )
            )

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet(*, in_shape: tuple[int, ...], num_classes: int, width: int = 16) -> nn.Module:
    """A small ResNet for (C, H, W) images: a 3x3 stem and two stages of basic blocks, each with BatchNorm2d (whose
    running statistics are buffers the shards hold), global average pooling, a linear classifier."""
    if len(in_shape) != 3:
        raise ValueError(
            f"the resnet needs image-shaped data (C, H, W), but the dataset's samples have shape {in_shape}"
        )
    return nn.Sequential(
        OrderedDict(
            conv=nn.Conv2d(in_shape[0], width, 3, padding=1, bias=False),
            bn=nn.BatchNorm2d(width),
            relu=nn.ReLU(),
            layer1=_Block(width, width),
            layer2=_Block(width, 2 * width, stride=2),
            pool=nn.AdaptiveAvgPool2d(1),
            flatten=nn.Flatten(),
            fc=nn.Linear(2 * width, num_classes),
        )
    )


def _from_factory(spec: str, in_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    factory = factory_of(spec)
    model = factory(in_shape=in_shape, num_classes=num_classes) if _takes_shape_kwargs(factory) else factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model factory {spec} returned {type(model).__name__}, expected a torch.nn.Module")
    return model


def factory_of(spec: str) -> Callable[..., object]:
    """The model factory `spec` names as package.module:factory, imported now; ValueError/TypeError saying why not."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"bad model spec {spec!r}: expected {_ACCEPTED}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(
            f"cannot import module {module_name!r} for model {spec!r} ({exc}); expected {_ACCEPTED}"
        ) from exc
    factory = getattr(module, attr, None)
    if factory is None:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}; expected {_ACCEPTED}")
    # A ready-made instance would be shared by reference and not rebuilt from the worker's seed.
    if isinstance(factory, nn.Module) or not callable(factory):
        raise TypeError(f"{spec} must be a callable that returns an nn.Module, got {type(factory).__name__}")
    return factory


def _takes_shape_kwargs(factory: Callable[..., object]) -> bool:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # some builtins and C extensions have no signature
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True
    keywordable = {
        p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {"in_shape", "num_classes"} <= keywordable

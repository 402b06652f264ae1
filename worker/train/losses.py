"""What a worker minimises: a built-in loss by name, a user's loss function, or a user's whole training step.

Every form ends up as one `Step`, fn(model, x, y) -> the batch's mean loss, which the trainer runs for each
micro-batch (under autocast when the job trains in mixed precision), then does backward, accumulation, clipping
and loss scaling itself; the servers only ever see the resulting gradient.
"""

# Depends on torch (and worker.data.datasets's names of tasks); a user's module is imported when its spec is resolved,
# never at import time.

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from worker.data.datasets import TASKS

LOSSES: tuple[str, ...] = ("auto", "cross_entropy", "bce", "mse", "l1", "huber")

Loss = Callable[[Tensor, Tensor], Tensor]
"""fn(outputs, targets) -> the batch's mean loss, a scalar tensor."""
Step = Callable[[nn.Module, Any, Tensor], Tensor]
"""fn(model, x, y) -> the batch's mean loss, a scalar tensor, computed from the model's forward pass (x: a tensor,
or worker.data.features.Features for a dataset with categorical features)."""

_ACCEPTED = f"one of {', '.join(LOSSES)}, or 'package.module:fn' (fn(outputs, targets) -> mean loss)"
_STEP_ACCEPTED = "'package.module:fn' (fn(model, x, y) -> mean loss)"


def _align(outputs: Tensor, targets: Tensor) -> Tensor:
    """Outputs (N, 1) against float targets (N,) become (N,): a regression model built with one output gives the
    former, a dataset with one target per sample the latter, and broadcasting them would silently make (N, N)."""
    if targets.is_floating_point() and outputs.shape == (*targets.shape, 1):
        return outputs.squeeze(-1)
    return outputs


def _regression(name: str, fn: Loss) -> Loss:
    def loss(outputs: Tensor, targets: Tensor) -> Tensor:
        if not targets.is_floating_point():
            raise ValueError(f"--loss {name} needs float regression targets, got {targets.dtype} labels")
        if outputs.shape != targets.shape:
            raise ValueError(
                f"--loss {name}: the model gives outputs of shape {tuple(outputs.shape)} for targets of shape "
                f"{tuple(targets.shape)}; build it with as many outputs as the dataset has targets"
            )
        return fn(outputs, targets.to(outputs.dtype))

    loss.__name__ = name
    return loss


def binary_logits(outputs: Tensor) -> Tensor | None:
    """A binary model's outputs as one logit per sample ([N] from [N] or [N, 1]); None for other outputs."""
    if outputs.ndim == 1:
        return outputs
    if outputs.ndim == 2 and outputs.shape[1] == 1:
        return outputs.squeeze(1)
    return None


def _bce(outputs: Tensor, targets: Tensor) -> Tensor:
    logits = binary_logits(outputs)
    if logits is None or logits.shape != targets.shape:
        raise ValueError(
            f"--loss bce takes one logit per sample (outputs of shape (N,) or (N, 1)), got {tuple(outputs.shape)} "
            f"for {tuple(targets.shape)} labels"
        )
    return F.binary_cross_entropy_with_logits(logits, targets.to(logits.dtype))


_bce.__name__ = "bce"

_BUILTIN: dict[str, tuple[str, Loss]] = {
    "cross_entropy": ("classification", F.cross_entropy),
    # Binary classification (clicks) with one logit per sample, the labels 0 or 1: the log loss.
    "bce": ("classification", _bce),
    "mse": ("regression", _regression("mse", F.mse_loss)),
    "l1": ("regression", _regression("l1", F.l1_loss)),
    "huber": ("regression", _regression("huber", F.huber_loss)),
}


def default_loss(task: str) -> str:
    """The name of the loss `--loss auto` means for `task`: cross_entropy for classification, mse for regression."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: expected one of {', '.join(TASKS)}")
    return "cross_entropy" if task == "classification" else "mse"


def check_loss_spec(spec: str) -> None:
    """Raise ValueError unless `spec` is a built-in loss's name or has the form package.module:fn (not imported)."""
    if spec not in LOSSES:
        _split(spec, "--loss", _ACCEPTED)


def check_step_spec(spec: str) -> None:
    """Raise ValueError unless `spec` has the form package.module:fn (not imported)."""
    _split(spec, "--train-step", _STEP_ACCEPTED)


def resolve_loss(spec: str, task: str) -> Loss:
    """Return the loss `spec` names for a dataset of `task`: a built-in (auto picks by task), or the user function
    package.module:fn, imported now. A built-in meant for the other task is refused."""
    name = default_loss(task) if spec == "auto" else spec
    if name in _BUILTIN:
        meant_for, fn = _BUILTIN[name]
        if meant_for != task:
            raise ValueError(
                f"--loss {name} is a {meant_for} loss, and the dataset is a {task} dataset; use --loss auto "
                f"({default_loss(task)}) or your own package.module:fn"
            )
        return fn
    return resolve_function(spec, "--loss", _ACCEPTED)


def resolve_step(spec: str) -> Step:
    """Import the user's training step package.module:fn, fn(model, x, y) -> the batch's mean loss."""
    return resolve_function(spec, "--train-step", _STEP_ACCEPTED)


class LossStep:
    """The step of a job that names a loss: the model's forward pass on x (under the job's autocast, if any), then
    the loss on its outputs cast to float32 with autocast off, so a loss is always computed in float32."""

    def __init__(self, loss: Loss) -> None:
        self.loss = loss

    def __call__(self, model: nn.Module, x: Any, y: Tensor) -> Tensor:
        return self.on_outputs(model(x), y)

    def on_outputs(self, outputs: Tensor, y: Tensor) -> Tensor:
        """The loss of outputs the model has already given (evaluation also needs them for the accuracy)."""
        with torch.autocast(outputs.device.type, enabled=False):
            return self.loss(_align(outputs.float(), y), y)


def mean_loss(value: object, what: str) -> Tensor:
    """`value` as a float32 scalar tensor, or an error saying what `what` (the user's function) returned instead."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{what} must return the batch's mean loss as a torch tensor, got {type(value).__name__}")
    if value.numel() != 1:
        raise ValueError(
            f"{what} must return the batch's mean loss as a scalar tensor, got shape {tuple(value.shape)} "
            "(reduce it, e.g. with .mean())"
        )
    return value.reshape(()).float()


def resolve_function(spec: str, flag: str, accepted: str) -> Callable[..., Tensor]:
    """Import the callable `spec` names as package.module:attr (attr may be dotted: module:Class.method), with an
    error that names `flag` and what it accepts when the module, the attribute or the callable is not there."""
    module_name, attr = _split(spec, flag, accepted)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{flag} {spec}: cannot import module {module_name!r} ({exc}); expected {accepted}") from exc
    target: object = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ValueError(f"{flag} {spec}: module {module_name!r} has no attribute {attr!r}; expected {accepted}")
        target = getattr(target, part)
    # A class is callable too, but calling it would build an instance at the first step, far from the flag.
    if isinstance(target, type):
        raise TypeError(
            f"{flag} {spec} names the class {target.__name__}; name a function, or an instance made in your module "
            "(e.g. criterion = torch.nn.HuberLoss())"
        )
    if not callable(target):
        raise TypeError(f"{flag} {spec} must name a function, got {type(target).__name__}")
    return target


def _split(spec: str, flag: str, accepted: str) -> tuple[str, str]:
    module_name, colon, attr = spec.partition(":")
    if not colon or not module_name or not attr or ":" in attr:
        raise ValueError(f"bad {flag} {spec!r}: expected {accepted}")
    return module_name, attr

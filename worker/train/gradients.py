"""A batch's gradient and a test split's metrics: the job's step function (worker/train/losses.py) run per micro-batch
under its precision (worker/train/precision.py), then backward, loss scaling and clipping; the same step evaluated."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from worker.client.sparse import forget_touched, touched_rows
from worker.data.datasets import batches_in_order
from worker.data.stream import Batch
from worker.train.losses import LossStep, Step, binary_logits, mean_loss, resolve_loss
from worker.train.metrics import auc
from worker.train.precision import MixedPrecision

log = logging.getLogger(__name__)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Iterable[tuple[Batch, torch.Tensor]],
    device: torch.device,
    *,
    task: str = "classification",
    step: Step | None = None,
) -> dict[str, float]:
    """Return the metrics of `model` over a held-out split fed as (x, y) batches (any iterable, so a split that is
    streamed works as well as tensors cut by data.batches_in_order), each batch's mean loss weighted by its size:

    classification: test_accuracy and test_loss; regression: test_loss and test_mse (over all targets). The loss is
    the job's `step` (default: --loss auto's for `task`); a user's --train-step gives test_loss only, since its
    forward pass need not be model(x). Runs in float32 whatever --precision, so the numbers do not depend on it.
    """
    step = step if step is not None else LossStep(resolve_loss("auto", task))
    training = model.training
    model.eval()
    samples, correct, loss_sum, squares, targets = 0, 0, 0.0, 0.0, 0
    labels, scores = [], []  # a binary model's (one logit per sample): for the AUC
    try:
        for xb, yb in batches:
            xb, yb = xb.to(device), yb.to(device)
            if isinstance(step, LossStep):
                outputs = model(xb)
                loss = step.on_outputs(outputs, yb)
                logits = binary_logits(outputs) if task == "classification" else None
                if logits is not None:
                    correct += int(((logits > 0).long() == yb).sum())
                    labels.append(yb.cpu().numpy())
                    scores.append(logits.float().cpu().numpy())
                elif task == "classification":
                    correct += int((outputs.argmax(1) == yb).sum())
                else:
                    predicted = outputs.float().reshape(yb.shape) if outputs.numel() == yb.numel() else None
                    if predicted is not None:
                        squares += float(F.mse_loss(predicted, yb.float(), reduction="sum"))
                        targets += yb.numel()
            else:
                loss = step(model, xb, yb)
            loss_sum += float(mean_loss(loss, _named(step))) * len(xb)
            samples += len(xb)
    finally:
        model.train(training)
    metrics = {"test_loss": loss_sum / samples if samples else math.nan}
    if isinstance(step, LossStep) and task == "classification":
        metrics["test_accuracy"] = correct / max(1, samples)
    if labels:  # a click model: the AUC, and its loss (the BCE's mean) under the name recommendation jobs use
        metrics["test_auc"] = auc(np.concatenate(labels), np.concatenate(scores))
        metrics["test_logloss"] = metrics["test_loss"]
    elif isinstance(step, LossStep) and targets:
        metrics["test_mse"] = squares / targets
    return metrics


def accuracy_of(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device, batch_size: int = 1024
) -> float:
    """Return the classification accuracy of `model` on the tensors (x, y)."""
    return evaluate(model, batches_in_order(x, y, batch_size), device)["test_accuracy"]


_CROSS_ENTROPY = LossStep(F.cross_entropy)


def compute_gradients(
    model: torch.nn.Module,
    xb: Batch,
    yb: torch.Tensor,
    accumulate: int = 1,
    clip_grad_norm: float | None = None,
    *,
    step: Step = _CROSS_ENTROPY,
    precision: MixedPrecision | None = None,
) -> float:
    """Leave the gradient of the batch's mean loss on the model's parameters (and its tables' touched rows),
    computed over `accumulate` micro-batches (each loss weighted by its share of the batch, so the sum is the whole
    batch's gradient), then clipped to `clip_grad_norm` over the whole model as torch.nn.utils.clip_grad_norm_ does;
    return the loss.

    `step(model, x, y)` gives a micro-batch's mean loss (losses.LossStep: a loss on model(x)). With `precision`, it
    runs under autocast, and with its loss scaler the gradient is unscaled before clipping: a float32 gradient
    without Inf or NaN, recomputed at a lower scale where the scaled one overflowed (see worker/train/precision.py; only
    a non-finite loss, or an overflow at the lowest scale, leaves a zero gradient instead)."""
    scaler = precision.scaler if precision is not None else None
    # A step computed again must leave the buffers (BatchNorm's running statistics) as one step does.
    buffers = list(model.buffers()) if scaler is not None else []
    saved = [b.detach().clone() for b in buffers]
    while True:
        total = _backward(model, xb, yb, accumulate, step, precision)
        if scaler is None:
            break
        grads = [t.grad for t in (*model.parameters(), *touched_rows(model)) if t.grad is not None]
        loss_finite = math.isfinite(total)
        if loss_finite and scaler.unscale(grads):
            scaler.update(finite=True)
            break
        if loss_finite and scaler.can_back_off():
            scaler.update(finite=False)
            log.debug("float16 gradient overflowed; computing the step again at loss scale %g", scaler.scale)
            with torch.no_grad():
                for b, value in zip(buffers, saved, strict=True):
                    b.copy_(value)
            continue
        # No scale cures this step: push a zero gradient rather than stall a sync round or have the shards refuse it.
        for g in grads:
            g.zero_()
        scaler.skipped += 1
        log.warning(
            "step skipped (a zero gradient pushed): %s at loss scale %g",
            "the loss is not finite" if not loss_finite else "the gradient is not finite even",
            scaler.scale,
        )
        break
    if clip_grad_norm is not None:
        # The tables' rows are parameters of the model too: their gradients count in the norm and are scaled.
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *touched_rows(model)], clip_grad_norm)
    return total


def _backward(
    model: torch.nn.Module,
    xb: Batch,
    yb: torch.Tensor,
    accumulate: int,
    step: Step,
    precision: MixedPrecision | None,
) -> float:
    """One forward and backward per micro-batch into zeroed gradients (scaled, with a loss scaler); the loss."""
    model.zero_grad(set_to_none=False)
    forget_touched(model)  # the rows of an attempt computed again
    scaler = precision.scaler if precision is not None else None
    named = _named(step)
    total = 0.0
    parts: Sequence[Batch] = xb.chunk(accumulate)
    for xm, ym in zip(parts, yb.chunk(accumulate), strict=True):
        if precision is None:
            raw = step(model, xm, ym)
        else:
            with precision.autocast():
                raw = step(model, xm, ym)
        loss = mean_loss(raw, named)
        if not loss.requires_grad:
            raise ValueError(
                f"{named} returned a loss that does not depend on the model's parameters "
                "(computed under torch.no_grad(), or detached?)"
            )
        loss = loss * (len(xm) / len(xb))
        (loss if scaler is None else scaler.scaled(loss)).backward()
        total += loss.item()
    return total


def _named(step: Step) -> str:
    """The user's function in an error message."""
    fn: object = step.loss if isinstance(step, LossStep) else step
    name = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', type(fn).__name__)}"
    return f"the loss {name}" if isinstance(step, LossStep) else f"the training step {name}"

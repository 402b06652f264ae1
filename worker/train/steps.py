"""A worker's steps: each batch's gradient, its exchange with the shards (catching up when a push is refused or its
round stays open), and what is recorded of it (progress bar, TensorBoard, the loss history). `Steps.run` takes any
iterable of batches, so the epoch loop (worker.train.trainer) and the follow loop (worker.train.following) share it.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from paramserver import modes
from worker.client import PSClient
from worker.data.datasets import Dataset
from worker.data.stream import StreamedDataset
from worker.train.catch_up import exchange
from worker.train.config import TrainConfig
from worker.train.gradients import compute_gradients, evaluate
from worker.train.losses import Step
from worker.train.overlap import Overlap
from worker.train.precision import MixedPrecision
from worker.train.tables import TablePrefetch, lookahead

log = logging.getLogger(__name__)

_EVAL_BATCH = 1024  # samples per forward pass when evaluating (no gradient is kept, so larger than a step's)


@dataclass
class Job:
    """What a worker trains, resolved before it joins the job: the device, the data, the model and its step."""

    config: TrainConfig
    device: torch.device
    data: Dataset | StreamedDataset
    model: torch.nn.Module
    step_fn: Step
    precision: MixedPrecision
    prefetch: TablePrefetch
    loss: str  # the loss resolved from --loss (auto: bce for click logs)

    def test_metrics(self) -> dict[str, float]:
        """The model's metrics on the held-out split."""
        return evaluate(
            self.model, self.data.test_batches(_EVAL_BATCH), self.device, task=self.data.task, step=self.step_fn
        )


def _overlap(config: TrainConfig, client: PSClient, model: torch.nn.Module) -> Overlap[bool] | None:
    """The Overlap that runs the exchanges in the background, where the job allows it; else None."""
    if not config.overlap:
        return None
    job = modes.BY_NAME.get(client.mode)
    if job is None or not job.overlap:
        overlapping = " or ".join(m.name for m in modes.BY_NAME.values() if m.overlap)
        raise ValueError(
            f"--overlap needs an {overlapping} job, and the servers run a {client.mode} job: a sync round averages "
            "gradients of its own weights, which a worker a step ahead cannot send (leave --overlap off)"
        )
    return Overlap(model, lambda target: exchange(client, target, config.round_timeout))


def _follows_backward(
    config: TrainConfig,
    client: PSClient,
    model: torch.nn.Module,
    precision: MixedPrecision,
    overlap: Overlap[bool] | None,
) -> bool:
    """Whether each step's exchange runs alongside its backward (--overlap-backward), where the gradient is final
    as backward leaves it; a warning says why not where it was asked for and cannot be."""
    if not config.overlap_backward:
        return False
    why = [
        reason
        for reason, applies in (
            (f"--accumulate {config.accumulate} sums several backward passes", config.accumulate > 1),
            ("--clip-grad-norm changes the gradient after backward", config.clip_grad_norm is not None),
            ("float16 unscales the gradient after backward", precision.scaler is not None),
            ("--overlap sends each gradient a step later", overlap is not None),
        )
        if applies
    ] + client.exchange_after_backward_because(model)
    if why:
        log.warning("--overlap-backward does not apply (%s): each step exchanges after its backward", "; ".join(why))
    return not why


def _board(directory: str | None, rank: int) -> Any:
    """A TensorBoard SummaryWriter for this worker (None without a directory); ImportError saying what to install."""
    if not directory:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ImportError(
            "--tensorboard needs the tensorboard package: pip install 'paramserver[tensorboard]'"
        ) from None
    return SummaryWriter(log_dir=f"{directory}/worker-{rank}")


def _bar(config: TrainConfig, client: PSClient, total: int | None, first: int) -> Any:
    """The progress bar (None without --progress); without a total (--follow), it counts steps."""
    if not config.progress:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=first,
        desc=f"worker {client.rank}",
        position=client.rank,
        unit="step",
        dynamic_ncols=True,
        mininterval=0.25,
        leave=True,
    )


class Steps:
    """A worker's steps as they go: the step count, the samples and stale pushes so far, the last loss, and where
    each step is recorded. Close it (or use `with`) to stop the background exchange, the bar and the board."""

    def __init__(
        self,
        job: Job,
        client: PSClient,
        first: int,
        total: int | None,
        on_step: Callable[[int, float], None] | None = None,
    ) -> None:
        config = job.config
        self.job, self.client, self.on_step = job, client, on_step
        self.step, self.samples, self.stale, self.loss = first, 0, 0, float("nan")
        self.waited = 0.0  # the data's wait so far, for each step's share of it
        self.history: dict[str, list[float]] = {
            k: [] for k in ("time", "step", "loss", "eval_time", "eval_step", "accuracy", "test_loss")
        }  # accuracy: classification only
        self.overlap = _overlap(config, client, job.model)
        self.follow = _follows_backward(config, client, job.model, job.precision, self.overlap)
        self.board = _board(config.tensorboard, client.rank)
        self.bar = _bar(config, client, total, first)
        self.started_at, self.start = time.time(), time.perf_counter()

    def run(self, batches: Iterable[tuple[Any, torch.Tensor]], limit: int | None, stop: threading.Event | None) -> int:
        """Train on `batches` until they end, the step count reaches `limit` or `stop` is set; return the samples
        trained."""
        job = self.job
        device = job.device
        on_device = ((x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in batches)
        # The tables' rows of the batch the coming exchange should bring (two ahead when it is overlapped).
        ahead = (2 if self.overlap is not None else 1) if job.prefetch.active else 0
        trained = 0
        for xb, yb, coming in lookahead(on_device, ahead):
            if (limit is not None and self.step >= limit) or (stop is not None and stop.is_set()):
                break
            self._one(xb, yb, coming if limit is None or self.step + ahead < limit else None)
            trained += len(xb)
        return trained

    def _one(self, xb: Any, yb: torch.Tensor, coming: Any) -> None:
        """One step: the batch's gradient, its exchange (or the overlap's), what is recorded of it."""
        job, client, config = self.job, self.client, self.job.config
        began = time.perf_counter()
        gradients = functools.partial(
            compute_gradients,
            job.model,
            xb,
            yb,
            config.accumulate,
            config.clip_grad_norm,
            step=job.step_fn,
            precision=job.precision,
        )
        if self.follow:  # the exchange goes while the gradient is computed
            seen = min(client.versions)
            exchanged = began  # so exchange_seconds is the whole step
            losses: list[float] = []
            self.stale += exchange(client, job.model, config.round_timeout, lambda: losses.append(gradients()))
            self.loss = losses[0]
        else:
            self.loss = gradients()
            if coming is not None:
                job.prefetch(coming)
            seen = min(client.versions)
            exchanged = time.perf_counter()
            overlap = self.overlap
            self.stale += exchange(client, job.model, config.round_timeout) if overlap is None else bool(overlap.step())
        self.step += 1
        self.samples += len(xb)
        self._record(len(xb), began, exchanged, seen)

    def _record(self, size: int, began: float, exchanged: float, seen: int) -> None:
        """Show one step: TensorBoard, the bar, the caller's on_step, the plot's history."""
        board, step = self.board, self.step
        if board is not None:
            done = time.perf_counter()
            board.add_scalar("loss", self.loss, step)
            board.add_scalar("samples_per_second", size / max(done - began, 1e-9), step)
            board.add_scalar("exchange_seconds", done - exchanged, step)
            data = self.job.data
            if isinstance(data, StreamedDataset):  # how long the step waited for storage
                board.add_scalar("input_wait_seconds", data.waited - self.waited, step)
                self.waited = data.waited
            # Updates applied by other workers between this worker's pull and its push's version.
            board.add_scalar("staleness", max(0, min(self.client.versions) - seen - 1), step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{self.loss:.4f}", refresh=False)
        if self.on_step is not None:
            self.on_step(step, self.loss)
        if self.job.config.plot:
            self.history["time"].append(time.perf_counter() - self.start)
            self.history["step"].append(step)
            self.history["loss"].append(self.loss)

    def evaluate(self) -> None:
        """Test now and record it (the plot's history, TensorBoard)."""
        tested = self.job.test_metrics()
        self.history["eval_time"].append(time.perf_counter() - self.start)
        self.history["eval_step"].append(self.step)
        self.history["test_loss"].append(tested["test_loss"])
        if "test_accuracy" in tested:
            self.history["accuracy"].append(tested["test_accuracy"])
        if self.board is not None:
            for name, value in tested.items():
                self.board.add_scalar(name, value, self.step)

    def drain(self) -> None:
        """Wait for the exchange in flight (--overlap): the weights of the last step are the model's, and every
        pushed step is applied."""
        if self.overlap is not None:
            self.stale += bool(self.overlap.finish())

    def close(self) -> None:
        """Stop the background exchange, the bar and the board."""
        if self.overlap is not None:
            self.overlap.close()
        if self.bar is not None:
            self.bar.close()
        if self.board is not None:
            self.board.close()

    def __enter__(self) -> Steps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

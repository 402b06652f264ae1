"""The worker's loop: compute a gradient on the current weights, push it, pull the next weights; then evaluate."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from paramserver import modes
from paramserver.errors import Aborted, PullTimeout
from paramserver.files import atomic_write
from paramserver.security import read_token
from worker.client import PSClient, Tensors
from worker.client.host_group import HostGroup
from worker.data.datasets import Dataset, open_dataset, steps_per_epoch
from worker.data.stream import StreamedDataset
from worker.models.builtin import build_model
from worker.models.clicks import build_click_model
from worker.train.config import TrainConfig, metrics_path
from worker.train.gradients import compute_gradients, evaluate
from worker.train.losses import LossStep, default_loss, resolve_loss, resolve_step
from worker.train.overlap import Overlap
from worker.train.precision import MixedPrecision
from worker.train.tables import TablePrefetch, lookahead

log = logging.getLogger(__name__)

_EVAL_BATCH = 1024  # samples per forward pass when evaluating (no gradient is kept, so larger than a step's)


def resolve_device(spec: str) -> torch.device:
    """Turn auto / cpu / cuda / cuda:N into a device, with a clear error when CUDA is asked for but absent."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {spec}: CUDA is not available on this machine (use auto or cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {spec}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def write_json(path: str, doc: dict[str, Any]) -> None:
    """Write a JSON document atomically."""
    atomic_write(path, json.dumps(doc, indent=2) + "\n")


def _pull_once_closed(
    client: PSClient, model: Tensors, began: float, limit: float, timed_out: PullTimeout | None = None
) -> None:
    """Pull the weights of the round this step's push went into, however long it stays open (a sync round waits
    for every worker to have joined, and for each live one to push; a dead one is evicted when its lease runs
    out): each pull the servers time out is logged and made again, until `limit` seconds after `began`."""
    while True:
        if timed_out is not None:
            waited = time.monotonic() - began
            if waited >= limit:
                raise PullTimeout(f"gave up on a round after {waited:.1f} s (--round-timeout {limit:g}): {timed_out}")
            log.warning("still waiting for the round to close after %.1f s: %s", waited, timed_out)
        try:
            client.pull(model)
            return
        except PullTimeout as exc:
            timed_out = exc


def _exchange(
    client: PSClient, target: Tensors, round_timeout: float, backward: Callable[[], object] | None = None
) -> bool:
    """Push the gradient held by `target` and pull the weights that include it into `target`, catching up when the
    push was refused or its round stays open; return whether it was refused (a stale push). `backward`: what makes
    the gradient, run while the push goes (PSClient.push_pull)."""
    began = time.monotonic()
    try:
        client.push_pull(target, backward=backward)
    except Aborted as exc:
        # The round closed without us (too slow, evicted, or a shard restarted): catch up, go on.
        log.debug("push refused: %s", exc)
        _pull_once_closed(client, target, began, round_timeout)
        return True
    except PullTimeout as exc:
        _pull_once_closed(client, target, began, round_timeout, exc)
    return False


def _overlap(
    config: TrainConfig, client: PSClient, model: torch.nn.Module, exchange: Callable[[Tensors], bool]
) -> Overlap[bool] | None:
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
    return Overlap(model, exchange)


def _exchange_following(
    client: PSClient, model: torch.nn.Module, round_timeout: float, gradients: Callable[[], float]
) -> tuple[float, bool]:
    """`_exchange` with the gradient computed meanwhile: the loss, and whether the push was refused."""
    losses: list[float] = []
    refused = _exchange(client, model, round_timeout, lambda: losses.append(gradients()))
    return losses[0], refused


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


def resume_step(data: Dataset | StreamedDataset, client: PSClient, total: int) -> int:
    """The step a worker starts at: where the job is, for a prepared dataset. A sync round makes one version and
    takes one batch of every worker, so the servers' version is each worker's position in its data, exactly: a
    worker that restarts neither reads a batch again nor skips one. In async and ssp jobs the version counts every
    worker's pushes, and its share (version // workers) is an estimate. An in-memory dataset starts at 0."""
    if not isinstance(data, StreamedDataset):
        return 0
    version = min(client.versions)
    return min(total, version if client.mode == "sync" else version // max(1, client.world_size))


def train(
    config: TrainConfig,
    dataset: Dataset | StreamedDataset | None = None,
    on_step: Callable[[int, float], None] | None = None,
) -> dict[str, Any]:
    """Join the job, train until the steps are done, evaluate on the held-out split, leave; return the metrics."""
    torch.set_num_threads(config.threads)
    device = resolve_device(config.device)
    data = dataset or open_dataset(config.dataset, config.prefetch)
    schema = data.manifest.schema if isinstance(data, StreamedDataset) else None
    # Resolved before joining the job, so a bad --loss, --train-step or --precision fails at once.
    loss = "bce" if schema is not None and config.loss == "auto" else config.loss
    step_fn = resolve_step(config.train_step) if config.train_step else LossStep(resolve_loss(loss, data.task))
    precision = MixedPrecision.for_device(config.precision, device)
    # The same seed on every worker gives the same initial weights, so whichever registers first is fine.
    torch.manual_seed(config.seed)
    if schema is not None:  # click logs: a model of tables, one per categorical feature
        model = build_click_model(config.model, schema, config.tables()).to(device)
    else:
        model = build_model(config.model, in_shape=data.in_shape, num_classes=data.num_classes).to(device)
    prefetch = TablePrefetch(model, [f.name for f in schema.categorical] if schema is not None else ())

    def test_metrics() -> dict[str, float]:
        return evaluate(model, data.test_batches(_EVAL_BATCH), device, task=data.task, step=step_fn)

    token = read_token(config.auth_token_file) if config.auth_token_file else None
    history: dict[str, list[float]] = {
        "time": [],
        "step": [],
        "loss": [],
        "eval_time": [],
        "eval_step": [],
        "accuracy": [],  # classification only
        "test_loss": [],
    }
    with PSClient(
        config.server,
        job_name=config.job_name,
        dtype=config.wire_dtype,
        shared_memory=config.shared_memory,
        data_socket=config.data_socket,
        push_in_turn={"auto": None, "on": True, "off": False}[config.push_in_turn],
        compress=config.compress,
        group=HostGroup.from_env(config.timeout),
        timeout=config.timeout,
        connect_timeout=config.connect_timeout,
        tls_ca=config.tls_ca,
        tls_cert=config.tls_cert,
        tls_key=config.tls_key,
        tls_server_name=config.tls_server_name,
        auth_token=token,
    ) as client:
        client.register(model)
        rank, world = client.rank, client.world_size
        share = data.samples_per_epoch(world)
        if share == 0:
            raise ValueError(f"{data.name} cannot be shared by {world} workers: each would get no sample")
        per_epoch = steps_per_epoch(share, config.batch_size)
        total = config.steps if config.steps is not None else config.epochs * per_epoch
        first = resume_step(data, client, total)
        log.info(
            "worker %s: rank %d of %d, %s mode, %d samples an epoch, steps %d to %d on %s",
            client.worker_id[:8],
            rank,
            world,
            client.mode,
            share,
            first,
            total,
            device,
        )

        bar = None
        if config.progress:
            from tqdm import tqdm

            bar = tqdm(
                total=total,
                initial=first,
                desc=f"worker {client.rank}",
                position=client.rank,
                unit="step",
                dynamic_ncols=True,
                mininterval=0.25,
                leave=True,
            )
        step, samples, stale, loss_value = first, 0, 0, float("nan")
        waited = 0.0  # the data's wait so far, for each step's share of it

        def exchange(target: Tensors) -> bool:
            return _exchange(client, target, config.round_timeout)

        overlap = _overlap(config, client, model, exchange)
        follow = _follows_backward(config, client, model, precision, overlap)
        board = _board(config.tensorboard, client.rank)
        started_at, start = time.time(), time.perf_counter()
        try:
            epoch, offset = divmod(step, per_epoch)
            while step < total:
                epoch_batches = data.batches(
                    rank, world, config.batch_size, seed=config.seed, epoch=epoch, start=offset * config.batch_size
                )
                offset = 0
                on_device = (
                    (x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in epoch_batches
                )
                # The tables' rows of the batch the coming exchange should bring (two ahead when it is overlapped).
                ahead = (2 if overlap is not None else 1) if prefetch.active else 0
                with contextlib.closing(epoch_batches):  # a streamed epoch left early stops its prefetch
                    for xb, yb, coming in lookahead(on_device, ahead):
                        if step >= total:
                            break
                        began = time.perf_counter()
                        gradients = functools.partial(
                            compute_gradients,
                            model,
                            xb,
                            yb,
                            config.accumulate,
                            config.clip_grad_norm,
                            step=step_fn,
                            precision=precision,
                        )
                        if follow:  # the exchange goes while the gradient is computed
                            seen = min(client.versions)
                            exchanged = began  # so exchange_seconds is the whole step
                            loss_value, refused = _exchange_following(client, model, config.round_timeout, gradients)
                            stale += refused
                        else:
                            loss_value = gradients()
                            if coming is not None and step + ahead < total:
                                prefetch(coming)
                            seen = min(client.versions)
                            exchanged = time.perf_counter()
                            stale += exchange(model) if overlap is None else bool(overlap.step())
                        step += 1
                        samples += len(xb)
                        if board is not None:
                            done = time.perf_counter()
                            board.add_scalar("loss", loss_value, step)
                            board.add_scalar("samples_per_second", len(xb) / max(done - began, 1e-9), step)
                            board.add_scalar("exchange_seconds", done - exchanged, step)
                            if isinstance(data, StreamedDataset):  # how long the step waited for storage
                                board.add_scalar("input_wait_seconds", data.waited - waited, step)
                                waited = data.waited
                            # Updates applied by other workers between this worker's pull and its push's version.
                            board.add_scalar("staleness", max(0, min(client.versions) - seen - 1), step)
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix(loss=f"{loss_value:.4f}", refresh=False)
                        if on_step is not None:
                            on_step(step, loss_value)
                        if config.plot:
                            history["time"].append(time.perf_counter() - start)
                            history["step"].append(step)
                            history["loss"].append(loss_value)
                epoch += 1
                if config.plot or board is not None or config.eval_every_epoch:
                    tested = test_metrics()
                    history["eval_time"].append(time.perf_counter() - start)
                    history["eval_step"].append(step)
                    history["test_loss"].append(tested["test_loss"])
                    if "test_accuracy" in tested:
                        history["accuracy"].append(tested["test_accuracy"])
                    if board is not None:
                        for name, value in tested.items():
                            board.add_scalar(name, value, step)
            if overlap is not None:
                stale += bool(overlap.finish())  # the weights of the last exchange
        finally:
            if isinstance(data, StreamedDataset):
                data.close()  # its reader reads on into an epoch that will not come
            if overlap is not None:
                overlap.close()
            if bar is not None:
                bar.close()
            if board is not None:
                board.close()
        seconds = time.perf_counter() - start
        tested = test_metrics()
        scaler = precision.scaler
        metrics = {
            "rank": client.rank,
            "world_size": client.world_size,
            "worker_id": client.worker_id,
            "mode": client.mode,
            "model": config.model,
            "dataset": data.name,
            "task": data.task,
            "loss": config.train_step or (default_loss(data.task) if loss == "auto" else loss),
            "precision": precision.name,
            "device": str(device),
            "batch_size": config.batch_size,
            "steps": step - first,  # this run's (from first_step on)
            "samples": samples,
            "seconds": round(seconds, 4),
            # Unix times of the training loop, to line workers up (e.g. a job's samples over its whole span).
            "started_at": started_at,
            "finished_at": started_at + seconds,
            "samples_per_second": round(samples / seconds, 2) if seconds > 0 else 0.0,
            "final_loss": loss_value,
            # None for a regression (and for a --train-step job): readers that print it must check.
            "test_accuracy": tested.get("test_accuracy"),
            **tested,
            # float16: the loss scale reached, and the steps that pushed a zero gradient (worker/train/precision.py).
            "loss_scale": scaler.scale if scaler is not None else None,
            "skipped_steps": scaler.skipped if scaler is not None else 0,
            "server_version": min(client.versions),
            "stale_pushes": stale,
            # Where this worker began (a prepared dataset in a job already under way resumes at its position),
            # and the seconds its steps waited for data from storage.
            "first_step": first,
            "input_wait_seconds": round(data.waited, 4) if isinstance(data, StreamedDataset) else 0.0,
            "config": asdict(config),
            # Each test during training (--eval-every-epoch, --plot, --tensorboard): when, at which step, how well.
            "eval_history": _eval_history(history),
        }
        if config.save_model:
            client.save(model, config.save_model)
        client.leave(finished=True)
    if config.metrics_out:
        write_json(metrics_path(config.metrics_out, client.rank, client.world_size), metrics)
    if config.plot:
        from worker.train.plot import plot_history

        plot_history(
            history, config.plot, title=f"{config.model} on {data.name}, worker {metrics['rank']} ({metrics['mode']})"
        )
    return metrics


def _eval_history(history: dict[str, list[float]]) -> list[dict[str, float]]:
    """Each test during training: seconds into the run, step, test loss and (classification) accuracy."""
    out: list[dict[str, float]] = []
    for i, (t, step, loss) in enumerate(
        zip(history["eval_time"], history["eval_step"], history["test_loss"], strict=True)
    ):
        entry = {"seconds": round(t, 4), "step": step, "test_loss": loss}
        if i < len(history["accuracy"]):
            entry["test_accuracy"] = history["accuracy"][i]
        out.append(entry)
    return out

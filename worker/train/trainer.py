"""The worker's loop: compute a gradient on the current weights, push it, pull the next weights; then evaluate.

`train` runs in phases, a function each: prepare what is trained (before joining), connect, train (the epochs here,
or the shards of a growing dataset as they land: worker.train.following), summarise, leave. A step itself is
worker.train.steps'."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from paramserver.files import atomic_write
from paramserver.security import read_token
from worker.client import PSClient
from worker.client.host_group import HostGroup
from worker.data.datasets import Dataset, open_dataset, steps_per_epoch
from worker.data.stream import StreamedDataset
from worker.models.builtin import build_model
from worker.models.clicks import build_click_model
from worker.train import following
from worker.train.config import CLICK_BATCH, TrainConfig, metrics_path
from worker.train.losses import LossStep, default_loss, resolve_loss, resolve_step
from worker.train.precision import MixedPrecision
from worker.train.steps import Job, Steps
from worker.train.tables import TablePrefetch

log = logging.getLogger(__name__)


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
    stop: threading.Event | None = None,
) -> dict[str, Any]:
    """Join the job, train until the steps are done (--follow: until `stop` is set, or idle past
    --follow-stop-when-idle), evaluate on the held-out split, leave; return the metrics. `stop` (--follow): set it
    (ps-worker's SIGTERM does) to end the worker at its next step; the dataset shard it holds is released."""
    torch.set_num_threads(config.threads)
    stop = stop or threading.Event()
    job = _prepare(config, dataset, stop)
    with _connect(config) as client:
        client.register(job.model)
        if config.follow:
            followed = following.follow(job, client, on_step, stop)
            steps, first, finished = followed.steps, 0, followed.finished
        else:
            (steps, first), finished = _epochs(job, client, on_step), True
        metrics = _summary(job, client, steps, first)
        if config.follow:
            shards = followed.shards
            metrics["dataset_shards"] = [{"shard": i, "samples": n, "seconds": round(t, 4)} for i, n, t in shards]
        if config.save_model:
            client.save(job.model, config.save_model)
        client.leave(finished=finished)
    if config.metrics_out:
        write_json(metrics_path(config.metrics_out, client.rank, client.world_size), metrics)
    if config.plot:
        from worker.train.plot import plot_history

        title = f"{config.model} on {job.data.name}, worker {metrics['rank']} ({metrics['mode']})"
        plot_history(steps.history, config.plot, title=title)
    return metrics


def _prepare(config: TrainConfig, dataset: Dataset | StreamedDataset | None, stop: threading.Event) -> Job:
    """The device, data, model and step: resolved before joining the job, so a bad --loss, --train-step or
    --precision fails at once (--follow: once the dataset lists a shard)."""
    device = resolve_device(config.device)
    if dataset is None:
        follow = config.follow
        dataset = following.open_when_listed(config, stop) if follow else open_dataset(config.dataset, config.prefetch)
    data = dataset
    schema = data.manifest.schema if isinstance(data, StreamedDataset) else None
    if schema is not None and not config.batch_size and config.progress:
        print(f"ps-worker: click logs: {CLICK_BATCH} samples a step (--batch-size to change)", file=sys.stderr)
    config = config.for_data(schema is not None)
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
    return Job(config, device, data, model, step_fn, precision, prefetch, loss)


def _connect(config: TrainConfig) -> PSClient:
    """A client of the job config names, joined."""
    return PSClient(
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
        auth_token=read_token(config.auth_token_file) if config.auth_token_file else None,
    )


def _epochs(job: Job, client: PSClient, on_step: Callable[[int, float], None] | None) -> tuple[Steps, int]:
    """Train --epochs (or --steps) over this worker's part of the data, from where the job is (`resume_step`);
    return the steps and the first."""
    config, data = job.config, job.data
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
        job.device,
    )
    steps = Steps(job, client, first, total, on_step)
    try:
        epoch, offset = divmod(first, per_epoch)
        while steps.step < total:
            batches = data.batches(
                rank, world, config.batch_size, seed=config.seed, epoch=epoch, start=offset * config.batch_size
            )
            offset = 0
            with contextlib.closing(batches):  # a streamed epoch left early stops its prefetch
                steps.run(batches, total, None)
            epoch += 1
            if config.plot or steps.board is not None or config.eval_every_epoch:
                steps.evaluate()
        steps.drain()  # the weights of the last exchange
    finally:
        if isinstance(data, StreamedDataset):
            data.close()  # its reader reads on into an epoch that will not come
        steps.close()
    return steps, first


def _summary(job: Job, client: PSClient, steps: Steps, first: int) -> dict[str, Any]:
    """The run's metrics: who and what, how fast, how well on the held-out split."""
    config, data = job.config, job.data
    seconds = time.perf_counter() - steps.start
    tested = job.test_metrics() if _has_test(data) else {}
    scaler = job.precision.scaler
    return {
        "rank": client.rank,
        "world_size": client.world_size,
        "worker_id": client.worker_id,
        "mode": client.mode,
        "model": config.model,
        "dataset": data.name,
        "task": data.task,
        "loss": config.train_step or (default_loss(data.task) if job.loss == "auto" else job.loss),
        "precision": job.precision.name,
        "device": str(job.device),
        "batch_size": config.batch_size,
        "steps": steps.step - first,  # this run's (from first_step on)
        "samples": steps.samples,
        "seconds": round(seconds, 4),
        # Unix times of the training loop, to line workers up (e.g. a job's samples over its whole span).
        "started_at": steps.started_at,
        "finished_at": steps.started_at + seconds,
        "samples_per_second": round(steps.samples / seconds, 2) if seconds > 0 else 0.0,
        "final_loss": steps.loss,
        # None for a regression (and for a --train-step job): readers that print it must check.
        "test_accuracy": tested.get("test_accuracy"),
        **tested,
        # float16: the loss scale reached, and the steps that pushed a zero gradient (worker/train/precision.py).
        "loss_scale": scaler.scale if scaler is not None else None,
        "skipped_steps": scaler.skipped if scaler is not None else 0,
        "server_version": min(client.versions),
        "stale_pushes": steps.stale,
        # Where this worker began (a prepared dataset in a job already under way resumes at its position),
        # and the seconds its steps waited for data from storage.
        "first_step": first,
        "input_wait_seconds": round(data.waited, 4) if isinstance(data, StreamedDataset) else 0.0,
        "config": asdict(config),
        # Each test during training (--eval-every-epoch, --plot, --tensorboard): when, at which step, how well.
        "eval_history": _eval_history(steps.history),
    }


def _has_test(data: Dataset | StreamedDataset) -> bool:
    """Whether the data holds a held-out split to test on (a dataset that grows may hold none)."""
    if not isinstance(data, StreamedDataset):
        return True
    test = data.manifest.splits.get("test")
    return test is not None and bool(test.shards)


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

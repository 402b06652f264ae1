"""ps-worker --follow: train a prepared dataset's shards as they land (ps-prepare --follow appends them to the
manifest), each by one worker of the job, once.

Which worker trains which shard is recorded on the servers (shard 0: SPEC.md section 18), so the record outlives
every worker. The loop: claim the first shard nobody holds or finished, train it whole in one pass, say so with the
next claim; when none is free, say so (idle: a sync round stops waiting for this worker, an SSP job compares no
clock of it), keep heartbeating, read the manifest again every --follow-poll-seconds and claim again.

A worker that dies holding a shard frees it when its lease runs out (a SIGTERM or Ctrl-C frees it at once: the
worker leaves), and the next worker to claim it trains it again from its start: the samples the first holder's
pushes applied are applied twice, at most that one shard's, never a sample of another shard; no shard is skipped.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

from paramserver.errors import ClaimNotHeld
from worker.client import PSClient
from worker.client.claims import DatasetClaims
from worker.data.manifest import Manifest
from worker.data.stream import StreamedDataset
from worker.train.config import TrainConfig
from worker.train.steps import Job, Steps

log = logging.getLogger(__name__)

IN_MEMORY = ("digits", "synthetic", "diabetes")  # --dataset names of worker.data.datasets' in-memory sets
# Seconds between two re-assertions of the claim a worker trains under: well within a lease (Claims.hold_off on
# a restarted shard 0 waits one lease for them before it gives out a shard again).
RENEW_S = 1.0
T = TypeVar("T")


def dataset_key(manifest: Manifest) -> str:
    """The key naming a dataset to the servers: its name and its first train shard's SHA-256, which never change
    while the dataset grows (so two workers reading it by different paths or URLs name it alike)."""
    return f"{manifest.name}:{manifest.splits['train'].shards[0].sha256[:16]}"


def open_when_listed(config: TrainConfig, stop: threading.Event | None = None) -> StreamedDataset:
    """The prepared dataset --dataset names, once its manifest lists a train shard (ps-prepare --follow may not
    have written one yet): read again every --follow-poll-seconds meanwhile. KeyboardInterrupt once `stop` is set."""
    if config.dataset in IN_MEMORY or config.dataset.endswith(".npz"):
        raise ValueError(
            f"--follow trains a dataset ps-prepare writes (its directory or manifest URL), not {config.dataset}"
        )
    said = False
    while True:
        try:
            return StreamedDataset(config.dataset, config.prefetch)
        except (OSError, ValueError) as exc:  # not there yet, or no train shard listed yet
            if not said:
                log.warning("waiting for %s to list a train shard: %s", config.dataset, exc)
                said = True
        if stop is not None and stop.wait(config.follow_poll_seconds):
            raise KeyboardInterrupt("stopped while waiting for the dataset")
        if stop is None:
            time.sleep(config.follow_poll_seconds)


@dataclass
class Followed:
    """What a worker's follow loop did."""

    steps: Steps
    finished: bool  # it ended caught up (--follow-stop-when-idle), not stopped
    # (dataset shard, samples, seconds) of each it trained whole
    shards: list[tuple[int, int, float]] = field(default_factory=list)


def follow(job: Job, client: PSClient, on_step: Callable[[int, float], None] | None, stop: threading.Event) -> Followed:
    """Train the dataset's shards as they land until `stop` is set, or until caught up for
    --follow-stop-when-idle seconds."""
    data = job.data
    if not isinstance(data, StreamedDataset):
        raise ValueError("--follow trains a dataset ps-prepare writes (its directory or its manifest's URL)")
    claims = client.claims(dataset_key(data.manifest))
    log.info(
        "worker %s: rank %d of %d, %s mode, following %s (%d shards listed) on %s",
        client.worker_id[:8],
        client.rank,
        client.world_size,
        client.mode,
        data.name,
        len(data.manifest.splits["train"].shards),
        job.device,
    )
    steps = Steps(job, client, 0, None, on_step)
    done = Followed(steps, False)
    try:
        done.finished = _loop(job, client, claims, done, stop)
    finally:
        data.close()
        steps.close()
    return done


def _loop(job: Job, client: PSClient, claims: DatasetClaims, done: Followed, stop: threading.Event) -> bool:
    """Claim, train, finish, until stopped (False) or idle past --follow-stop-when-idle (True)."""
    config, data = job.config, job.data
    assert isinstance(data, StreamedDataset)
    last, samples = -1, 0  # the last shard trained whole, said with every claim (a finish lost is said again)
    idle_since: float | None = None
    fresh = True  # the manifest was just read (the dataset was opened)
    while not stop.is_set():
        if not fresh:
            _reload(data)  # before every claim: a shard listed meanwhile is claimed at once
        fresh = False
        listed = len(data.manifest.splits["train"].shards)
        try:
            index = claims.claim(listed, last, samples)
        except ClaimNotHeld as exc:  # freed before its finish came (this worker's lease ran out): trained again
            log.warning("%s", exc)
            last, index = -1, claims.claim(listed)
        if index is None:
            if idle_since is None:
                idle_since = time.monotonic()
                client.set_idle(True)
                log.info("caught up: waiting for new shards of %s", data.name)
            if 0 < config.follow_stop_when_idle <= time.monotonic() - idle_since:
                _finish_last(claims, last, samples)
                return True
            stop.wait(config.follow_poll_seconds)
            continue
        if idle_since is not None:  # counted in every shard's rounds again, on their current weights
            client.set_idle(False)
            client.pull(job.model)
            idle_since = None
        began = time.monotonic()
        trained = _train_shard(job, done.steps, claims, index, stop)
        if trained is None and stop.is_set():
            break  # stopped mid-shard: leaving frees it, and another worker trains it from its start
        if trained is None:
            continue  # its claim went to another worker (this one was silent past its lease): claim the next
        last, samples = index, trained
        done.shards.append((index, trained, time.monotonic() - began))
    _finish_last(claims, last, samples)
    return False


def _finish_last(claims: DatasetClaims, last: int, samples: int) -> None:
    """Say the last shard trained whole is done, claiming nothing (the worker is leaving)."""
    if last >= 0:
        with contextlib.suppress(ClaimNotHeld):
            claims.claim(0, last, samples)


def _train_shard(job: Job, steps: Steps, claims: DatasetClaims, index: int, stop: threading.Event) -> int | None:
    """Train dataset shard `index` whole, in one pass, re-asserting the claim every RENEW_S seconds; return its
    samples, or None where it stopped before its end (`stop` set, or the claim went to another worker). Every push
    of it is applied when this returns."""
    data = job.data
    assert isinstance(data, StreamedDataset)
    shard = data.manifest.splits["train"].shards[index]
    began = time.monotonic()
    log.info("training dataset shard %d (%s, %d samples)", index, shard.path, shard.samples)
    batches = data.shard_batches(index, job.config.batch_size, seed=job.config.seed)
    with contextlib.closing(batches):
        trained = steps.run(_held(batches, claims, index), None, stop)
    steps.drain()  # the last push applied before its finish says so
    if trained < shard.samples:
        log.warning("left dataset shard %d after %d of its %d samples", index, trained, shard.samples)
        return None
    log.info("trained dataset shard %d: %d samples in %.1f s", index, trained, time.monotonic() - began)
    return trained


def _held(batches: Iterable[T], claims: DatasetClaims, index: int) -> Iterator[T]:
    """`batches` while this worker's claim on shard `index` holds, re-asserted every RENEW_S seconds (a restart of
    shard 0 may have lost it: it is recorded again before another worker can take the shard)."""
    renew = time.monotonic() + RENEW_S
    for batch in batches:
        if time.monotonic() >= renew:
            if not claims.hold(index):
                return  # another worker took it: it trains it from its start, this one stops here
            renew = time.monotonic() + RENEW_S
        yield batch


def _reload(data: StreamedDataset) -> None:
    """Read the manifest again; a failure (storage unreachable for now) is said and tried again at the next poll."""
    try:
        data.reload()
    except (OSError, ValueError) as exc:
        log.warning("reading %s again failed (tried again at the next poll): %s", data.spec, exc)

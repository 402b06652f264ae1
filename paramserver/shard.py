"""A shard's state: its pieces of the model as one flat float32 buffer, the optimizer, the version, membership.

One lock (a Condition) guards all of it; pulls wait on it for the version they ask for. Gradients arrive in
scratch buffers from a bounded pool and are fully validated before the lock is taken, so a rejected push never
touches the weights, the optimizer state or the version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import logging
import queue
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from paramserver import checkpoint, shm
from paramserver.config import ServerConfig
from paramserver.consistency import make_policy
from paramserver.errors import (
    AlreadyInitialized,
    InitInProgress,
    InvalidArgument,
    ModelMismatch,
    NotAttached,
    NotInitialized,
    PullTimeout,
    SharedMemoryUnavailable,
    ShuttingDown,
    StaleRound,
    TooLarge,
    WrongJob,
)
from paramserver.membership import AppliedLog, Membership
from paramserver.metrics import ShardMetrics
from paramserver.placement import Piece, Placement, TensorSpec, place

log = logging.getLogger(__name__)

# A sync round waiting longer than this says in the log which workers it waits for (and again as often).
WAIT_LOG_SECONDS = 5.0


def make_optimizer(config: ServerConfig, params: torch.Tensor) -> torch.optim.Optimizer:
    """Build torch's own optimizer for the shard's flat parameter (all of them act elementwise).

    Each runs torch's fused kernel: one pass over the parameter and its state instead of one per operation, the
    same results to a float32 rounding. On one thread, 12.5 M parameters take Adam 5.6 ms against 56 ms, Adagrad
    4.6 against 31, momentum 4.6 against 7.3 (plain SGD is one pass either way).
    """
    common: dict[str, Any] = {"lr": config.lr, "weight_decay": config.weight_decay, "fused": True}
    if config.optimizer == "sgd":
        return torch.optim.SGD([params], **common)
    if config.optimizer == "momentum":
        return torch.optim.SGD([params], momentum=config.momentum, **common)
    if config.optimizer == "adam":
        return torch.optim.Adam([params], **common)
    if config.optimizer == "adamw":
        return torch.optim.AdamW([params], **common)
    if config.optimizer == "adagrad":
        return torch.optim.Adagrad([params], **common)
    raise ValueError(f"unknown optimizer {config.optimizer!r}")


def warm_up_optimizer(config: ServerConfig) -> None:
    """Build one throwaway optimizer: torch's first in a process imports torch._dynamo (0.8 s on 2 cores), which
    would otherwise land in the first Init, and so in every worker's registration."""
    make_optimizer(config, torch.zeros(1))


def piece_label(piece: Piece, specs: dict[str, TensorSpec]) -> str:
    """Name a piece for error messages: the tensor, and the range when it is a slice."""
    if piece.start == 0 and piece.length == specs[piece.name].numel:
        return piece.name
    return f"{piece.name}[{piece.start}:{piece.start + piece.length}]"


@dataclass
class ShardModel:
    """The part of one model that a shard holds."""

    placement: Placement
    pieces: tuple[Piece, ...]
    offsets: tuple[int, ...]
    labels: tuple[str, ...]
    params: torch.Tensor  # flat float32, the pieces back to back
    optimizer: torch.optim.Optimizer

    @property
    def digest(self) -> str:
        return self.placement.digest

    @property
    def numel(self) -> int:
        return int(self.params.numel())

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        """Split a flat buffer of this shard's size into one view per piece."""
        return [flat[o : o + p.length] for o, p in zip(self.offsets, self.pieces, strict=True)]


@dataclass(frozen=True)
class Ticket:
    """A worker's data-socket attachment: the nonce its connection must present (see paramserver.doorbell)."""

    nonce: bytes
    elements: int
    name: str = ""  # no segment


@dataclass(frozen=True)
class ShardStatus:
    """What a shard holds, at one instant."""

    initialized: bool
    digest: str
    specs: tuple[TensorSpec, ...]
    version: int
    live_workers: int
    stats: ShardStats


@dataclass
class ShardStats:
    """Counters of what a shard refused or dropped (for logs, metrics and tests)."""

    late_pushes: int = 0  # pushes for a round that had closed (stragglers with backup workers, or slow workers)
    duplicate_pushes: int = 0  # retried (worker, step) pairs taken once, not applied again
    evictions: int = 0  # workers whose lease ran out
    checkpoints: int = 0  # snapshots handed to the writer


class BufferPool:
    """At most `size` gradient-sized scratch buffers, reused; a caller past the bound waits for one.

    Last in, first out: one worker at a time keeps reusing one warm buffer, and the others are only ever allocated
    (and paged in) when pushes really overlap. A borrower may `keep` the buffer it holds past its loan (a round's
    sum): it stays out of the pool, its slot taken, until `give_back`.
    """

    def __init__(self, size: int, numel: int) -> None:
        self.size = size
        self._numel = numel
        self._free: queue.LifoQueue[np.ndarray | None] = queue.LifoQueue()
        self._kept: set[int] = set()  # addresses of buffers on loan that stay out when their loan ends
        self._lock = threading.Lock()
        for _ in range(size):
            self._free.put(None)  # allocated on first use: an idle shard holds no scratch memory

    @contextlib.contextmanager
    def take(self) -> Iterator[np.ndarray]:
        buf = self._free.get()
        if buf is None:
            buf = np.empty(self._numel, dtype=np.float32)
        try:
            yield buf
        finally:
            with self._lock:
                kept = buf.ctypes.data in self._kept
                self._kept.discard(buf.ctypes.data)
            if not kept:
                self._free.put(buf)

    def keep(self, lent: np.ndarray) -> None:
        """Keep the buffer `lent` (on loan) when its loan ends; its slot stays taken until `give_back`."""
        with self._lock:
            self._kept.add(lent.ctypes.data)

    def give_back(self, kept: np.ndarray) -> None:
        """Return a buffer kept past its loan (or, if its loan has not ended yet, let the loan's end return it)."""
        if kept.shape != (self._numel,) or kept.dtype != np.float32:
            raise ValueError(f"a pool of {self._numel} float32 takes no {kept.dtype} buffer of {kept.shape}")
        with self._lock:
            on_loan = kept.ctypes.data in self._kept
            self._kept.discard(kept.ctypes.data)
        if not on_loan:
            self._free.put(kept)


class Shard:
    """One shard of the parameter server: everything the servicer acts on."""

    def __init__(self, config: ServerConfig, index: int = 0, addresses: Sequence[str] = ()) -> None:
        self.config = config
        self.index = index
        self.addresses: tuple[str, ...] = tuple(addresses)
        self.version = 0
        self.membership = Membership(config.workers)
        self.applied = AppliedLog()
        self.policy = make_policy(config.mode, config.backup_workers, config.staleness, config.max_staleness)
        self.stats = ShardStats()
        self.model: ShardModel | None = None
        self._pool: BufferPool | None = None
        self._cond = threading.Condition()
        self._closed = False
        self._every_versions, self._every_seconds = config.checkpoint_schedule()
        self._last_checkpoint = time.monotonic()
        self._writer = checkpoint.CheckpointWriter(config.checkpoint_dir) if config.checkpoint_dir else None
        self._maintenance: threading.Thread | None = None
        self._final_written = False
        self._last_wait_log = 0.0
        self.finished_workers = 0
        self.done = threading.Event()  # set once every worker of the job finished and none is live
        self.metrics = ShardMetrics(index)
        # What each worker attached, by worker id: a same-host worker's shared-memory segment, or another host's
        # data-socket ticket. Dropped (not closed) when a worker goes: an Exchange in flight keeps a segment's
        # mapping alive until it ends.
        self._segments: dict[str, shm.Segment | Ticket] = {}
        # A new value each time a shard process starts: versions a worker waits for refer to one incarnation.
        self.incarnation = uuid.uuid4().hex
        self._init_lock = threading.Lock()

    # -- membership --------------------------------------------------------------------------------------------

    def join(self, worker_id: str, job_name: str) -> tuple[int, int]:
        """Add a worker to the job; return (rank, version)."""
        if job_name and job_name != self.config.job_name:
            raise WrongJob(
                f"worker {worker_id!r} belongs to job {job_name!r}, this shard serves job {self.config.job_name!r}"
            )
        with self._cond:
            new = worker_id not in self.membership.live
            worker = self.membership.join(worker_id)
            if new:
                log.info(
                    "shard %d: worker %s joined as rank %d (%d live)",
                    self.index,
                    worker_id,
                    worker.rank,
                    len(self.membership.live),
                )
            self.policy.membership_changed(self)
            self.metrics.live_workers.set(len(self.membership.live))
            return worker.rank, self.version

    def leave(self, worker_id: str, finished: bool = False) -> None:
        """Remove a worker; a sync round stops waiting for it. `finished`: it completed its training."""
        with self._cond:
            self._segments.pop(worker_id, None)
            if self.membership.leave(worker_id):
                self.finished_workers += finished
                log.info(
                    "shard %d: worker %s left%s (%d live)",
                    self.index,
                    worker_id,
                    " after finishing" if finished else "",
                    len(self.membership.live),
                )
                if finished:
                    # Saved at once: a shard restarted after this must still count it, or the job never ends.
                    self._checkpoint_locked()
                self._membership_changed()

    def _membership_changed(self) -> None:
        self.policy.membership_changed(self)
        self.metrics.live_workers.set(len(self.membership.live))
        self._cond.notify_all()  # a pull held back (sync round, ssp) for a worker that is gone may go on
        if not self.membership.live and self.finished_workers >= self.config.workers and not self.done.is_set():
            log.info("shard %d: the job is done: %d workers finished, none live", self.index, self.finished_workers)
            self.done.set()

    def touch(self, worker_id: str) -> None:
        """Renew a worker's lease."""
        if worker_id:
            with self._cond:
                self.membership.touch(worker_id)

    # -- init --------------------------------------------------------------------------------------------------

    def prepare_init(self, specs: Sequence[TensorSpec], num_shards: int, digest: str) -> ShardModel:
        """Check an Init header and return an unattached model to receive the initial values into."""
        if num_shards != len(self.addresses):
            raise ModelMismatch(
                f"the worker placed the model on {num_shards} shards, but the job has {len(self.addresses)}"
            )
        if not specs:
            raise InvalidArgument("the model has no tensors")
        try:
            placement = place(specs, num_shards)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if placement.digest != digest:
            raise ModelMismatch(
                "the worker's placement digest differs from the shard's for the same tensors: "
                "client and server run incompatible placement code"
            )
        self._check_not_held(digest)
        return self._build(placement)

    def _build(self, placement: Placement) -> ShardModel:
        """Allocate this shard's part of a placed model, with a fresh optimizer."""
        specs = placement.specs
        pieces = placement.shards[self.index]
        numel = placement.shard_elements(self.index)
        if numel * 4 > self.config.max_model_bytes:
            raise TooLarge(
                f"this shard's part of the model is {numel * 4} bytes, over the limit of "
                f"{self.config.max_model_bytes} (max_model_bytes); use more shards"
            )
        offsets = tuple(int(o) for o in np.cumsum([0] + [p.length for p in pieces[:-1]])) if pieces else ()
        by_name = {s.name: s for s in specs}
        params = torch.zeros(numel, dtype=torch.float32)
        return ShardModel(
            placement,
            pieces,
            offsets,
            tuple(piece_label(p, by_name) for p in pieces),
            params,
            make_optimizer(self.config, params),
        )

    @contextlib.contextmanager
    def initialising(self) -> Iterator[None]:
        """Hold the shard's one Init slot. Concurrent workers registering the same model would otherwise each
        build a whole copy of it here (and gRPC would buffer each one's stream): the others are refused with
        UNAVAILABLE (InitInProgress) at once, retry, and then find the model held (ALREADY_EXISTS)."""
        if not self._init_lock.acquire(blocking=False):
            raise InitInProgress(f"shard {self.index} is being initialised by another worker; retry shortly")
        try:
            yield
        finally:
            self._init_lock.release()

    def commit_init(self, model: ShardModel) -> int:
        """Adopt a fully received model, unless another Init won the race; return the version."""
        with self._cond:
            self._check_not_held(model.digest)
            self._adopt(model, version=0)
            log.info(
                "shard %d: model %s initialised: %d pieces, %d elements",
                self.index,
                model.digest[:12],
                len(model.pieces),
                model.numel,
            )
            return self.version

    def _adopt(self, model: ShardModel, version: int) -> None:
        self.model = model
        self.version = version
        self.policy.reset(model.numel)
        self._pool = BufferPool(self.config.max_concurrent_pushes, model.numel)
        self._cond.notify_all()

    def restore(self) -> bool:
        """Adopt the newest valid checkpoint in checkpoint_dir, if any; return whether one was restored.

        Call once the peer list is known (it must match the checkpoint's shard count) and before serving.
        """
        if not self.config.checkpoint_dir:
            return False
        snap = checkpoint.load_latest(self.config.checkpoint_dir, self.index)
        if snap is None:
            log.info("shard %d: no checkpoint in %s, starting empty", self.index, self.config.checkpoint_dir)
            return False
        if snap.num_shards != len(self.addresses):
            raise ValueError(
                f"the checkpoint in {self.config.checkpoint_dir} was written by a job of {snap.num_shards} shards, "
                f"this one has {len(self.addresses)}; use another --checkpoint-dir"
            )
        if snap.optimizer != self.config.optimizer:
            raise ValueError(
                f"the checkpoint in {self.config.checkpoint_dir} holds {snap.optimizer} state, but this shard runs "
                f"--optimizer {self.config.optimizer}; use the same optimizer or another --checkpoint-dir"
            )
        placement = place(snap.specs, snap.num_shards)
        if placement.digest != snap.digest:
            raise ValueError(f"the checkpoint of shard {self.index} does not match its own placement digest")
        model = self._build(placement)
        model.params.copy_(snap.params)
        model.optimizer.load_state_dict(snap.optimizer_state)
        fresh = make_optimizer(self.config, torch.zeros(1)).param_groups[0]
        for group in model.optimizer.param_groups:  # the flags of this run win over the saved hyperparameters
            # ...and so does its implementation: a checkpoint written before the fused kernels resumes on them
            for key in ("lr", "weight_decay", "momentum", "fused", "foreach"):
                if key in group:
                    group[key] = fresh[key]  # as this run builds them: plain sgd keeps momentum 0
        with self._cond:
            self._adopt(model, snap.version)
            self.membership.ever_full = snap.ever_full
            self.applied = AppliedLog.restore(snap.applied)
            self.finished_workers = snap.finished_workers
        log.info("shard %d: restored version %d of model %s", self.index, snap.version, snap.digest[:12])
        return True

    def _check_not_held(self, digest: str) -> None:
        if self.model is None:
            return
        if self.model.digest == digest:
            raise AlreadyInitialized(f"shard {self.index} already holds this model (digest {digest[:12]}); pull it")
        raise ModelMismatch(
            f"shard {self.index} holds another model (digest {self.model.digest[:12]}), not "
            f"{digest[:12]}: different tensor names, shapes or shard count"
        )

    # -- push --------------------------------------------------------------------------------------------------

    def require_model(self, digest: str | None = None) -> ShardModel:
        """Return the held model, checking the caller's digest when given."""
        model = self.model
        if model is None:
            raise NotInitialized(f"shard {self.index} holds no model yet: register (init) the model first")
        if digest is not None and digest != model.digest:
            raise ModelMismatch(
                f"the request is for model {digest[:12] or '(none)'}, but shard {self.index} holds {model.digest[:12]}"
            )
        return model

    def check_worker(self, worker_id: str) -> None:
        """Raise UnknownWorker unless the worker is live (renewing its lease)."""
        with self._cond:
            self.membership.get(worker_id)

    @contextlib.contextmanager
    def scratch(self) -> Iterator[np.ndarray]:
        """Lend a gradient-sized buffer to receive a push into (waits while the pool is empty)."""
        pool = self._pool
        if pool is None:
            raise NotInitialized(f"shard {self.index} holds no model yet: register (init) the model first")
        with pool.take() as buf:
            yield buf

    def push(
        self, worker_id: str, step: int, base_version: int, grad: np.ndarray, digest: str, lent: bool = False
    ) -> tuple[int, bool]:
        """Hand a validated gradient to the consistency policy; return (version, applied). `lent`: the gradient is
        in a buffer lent by `scratch()`, which the policy may keep (see `keep_scratch`)."""
        with self._cond:
            model = self.require_model(digest)
            if grad.shape != (model.numel,):
                raise InvalidArgument(f"gradient of {grad.shape[0]} elements for a shard of {model.numel}")
            self.membership.get(worker_id)
            if step and self.applied.seen(worker_id, step):
                self.stats.duplicate_pushes += 1
                self.metrics.pushed("duplicate")
                return self.version, False
            try:
                self.policy.submit(self, worker_id, base_version, torch.from_numpy(grad), lent=lent)
            except StaleRound:
                self.stats.late_pushes += 1
                raise
            if step:
                self.applied.record(worker_id, step)
            self.metrics.pushed("applied")
            return self.version, True

    def keep_scratch(self, grad: torch.Tensor) -> bool:
        """Let the policy keep the scratch buffer a push was received into (as a round's sum: no copy) until it
        calls `release_scratch`; False where that would leave no buffer for the round's other pushes (a pool of
        one), and the policy must copy instead."""
        assert self._pool is not None
        if self._pool.size < 2:
            return False
        self._pool.keep(grad.numpy())
        return True

    def release_scratch(self, grad: torch.Tensor) -> None:
        """Give a buffer kept through `keep_scratch` back to the scratch pool."""
        assert self._pool is not None
        self._pool.give_back(grad.numpy())

    def apply(
        self,
        grad: torch.Tensor,
        *,
        straggler: str | None = None,
        waited: float | None = None,
        staleness: int | None = None,
    ) -> None:
        """Run one optimizer step with a flat gradient; called by the policy under the lock."""
        model = self.model
        assert model is not None
        started = time.perf_counter()
        model.params.grad = grad
        model.optimizer.step()
        model.params.grad = None
        self.version += 1
        self._cond.notify_all()
        m = self.metrics
        m.apply_seconds.observe(time.perf_counter() - started)
        m.version.set(self.version)
        if waited is not None:
            m.round_wait.observe(waited)
        if staleness is not None:
            m.staleness.observe(staleness)
        if straggler is not None:
            m.straggler(self.membership.rank_of(straggler))
        if self._every_versions and self.version % self._every_versions == 0:
            # The same versions on every shard: in sync mode a set of shard checkpoints is one consistent model.
            self._checkpoint_locked()

    # -- pull --------------------------------------------------------------------------------------------------

    def wait_for(self, min_version: int, timeout: float, worker_id: str = "") -> tuple[int, ShardModel]:
        """Wait until the shard reaches `min_version`; return (version, model)."""
        with self._cond:
            return self._wait_locked(min_version, timeout, worker_id)

    @contextlib.contextmanager
    def weights(
        self, min_version: int, timeout: float, worker_id: str = ""
    ) -> Iterator[tuple[int, ShardModel, np.ndarray]]:
        """Wait like `wait_for`, then lend (version, model, the flat weights of that one version) to send.

        Where the policy says no update can apply before this worker pushes again (a live worker in sync mode
        without backup workers), the weights are lent in place. Any other pull (async, ssp, backup workers, a
        reader that did not join) gets a copy taken under the lock into a scratch buffer, so an update applied
        while it is sent cannot tear it.
        """
        version, model = self.wait_for(min_version, timeout, worker_id)  # before taking a buffer pushes need
        with self._cond:
            in_place = self.policy.stable_for(self, worker_id)
        if in_place:
            yield version, model, model.params.numpy()
            return
        with self.scratch() as buf:
            with self._cond:
                model = self.require_model()
                version = self.version  # at least min_version: versions only grow
                np.copyto(buf, model.params.numpy())
            yield version, model, buf

    def pull_into(self, dst: np.ndarray, min_version: int, timeout: float, worker_id: str = "") -> int:
        """Wait like `wait_for`, then copy the weights into `dst` under the lock (one consistent version)."""
        with self._cond:
            version, model = self._wait_locked(min_version, timeout, worker_id)
            np.copyto(dst, model.params.numpy())
            return version

    def _wait_locked(self, min_version: int, timeout: float, worker_id: str) -> tuple[int, ShardModel]:
        if worker_id:
            self.membership.get(worker_id)
        self.require_model()

        # A worker's pull also waits while the policy holds it back (ssp: too far ahead of the slowest worker).
        def ready() -> bool:
            return self.version >= min_version and (not worker_id or self.policy.may_pull(self, worker_id))

        reached = self._cond.wait_for(lambda: self._closed or ready(), timeout=timeout)
        if self._closed:
            raise ShuttingDown(f"shard {self.index} is shutting down")
        if not reached:
            if self.version >= min_version:
                raise PullTimeout(
                    f"shard {self.index} held worker {worker_id}'s pull for {timeout:.1f} s: "
                    f"{self.policy.waiting_for(self)}"
                )
            raise PullTimeout(
                f"shard {self.index} is at version {self.version}, not {min_version}, after "
                f"{timeout:.1f} s: {self.policy.waiting_for(self)}"
            )
        return self.version, self.require_model()

    # -- same-host shared memory -------------------------------------------------------------------------------

    def attach(self, worker_id: str, name: str, nonce: bytes, elements: int, digest: str) -> None:
        """Map a live worker's shared-memory segment for its Exchanges (replacing any earlier attachment)."""
        if not self.config.shared_memory:
            raise SharedMemoryUnavailable(f"shard {self.index} runs with shared memory disabled (--no-shared-memory)")
        self._check_attach(worker_id, elements, digest)
        self._attach(worker_id, shm.Segment.open(name, nonce, elements))
        log.debug("shard %d: worker %s attached shared-memory segment %s", self.index, worker_id, name)

    def attach_socket(self, worker_id: str, nonce: bytes, elements: int, digest: str) -> None:
        """Take a live worker's data-socket ticket (replacing any earlier attachment)."""
        self._check_attach(worker_id, elements, digest)
        if len(nonce) != shm.NONCE_BYTES:
            raise InvalidArgument(f"a data-socket ticket is {shm.NONCE_BYTES} random bytes, not {len(nonce)}")
        self._attach(worker_id, Ticket(bytes(nonce), elements))

    def _check_attach(self, worker_id: str, elements: int, digest: str) -> None:
        model = self.require_model(digest)
        if elements != model.numel:
            raise InvalidArgument(f"an attachment for {elements} elements to a shard of {model.numel}")
        self.check_worker(worker_id)

    def _attach(self, worker_id: str, attachment: shm.Segment | Ticket) -> None:
        with self._cond:
            self.membership.get(worker_id)  # it may have left meanwhile
            self._segments[worker_id] = attachment

    def verify_segment(self, worker_id: str, name: str, nonce: bytes) -> None:
        """Raise NotAttached unless the live worker's attachment is this segment or ticket (a connection's proof
        on the doorbell or data socket)."""
        with self._cond:
            self.membership.get(worker_id)
            attached = self._segments.get(worker_id)
        if attached is None or attached.name != name or not hmac.compare_digest(attached.nonce, nonce):
            raise NotAttached(f"worker {worker_id} has no such attachment on shard {self.index}")

    def segment(self, worker_id: str, model: ShardModel) -> shm.Segment:
        """The live worker's attached segment for `model`; NotAttached if it has none."""
        attached = self.attachment(worker_id, model)
        if not isinstance(attached, shm.Segment):
            raise NotAttached(f"worker {worker_id} has no shared-memory segment attached on shard {self.index}")
        return attached

    def attachment(self, worker_id: str, model: ShardModel) -> shm.Segment | Ticket:
        """The live worker's segment or ticket for `model`; NotAttached if it has none."""
        with self._cond:
            self.membership.get(worker_id)
            attached = self._segments.get(worker_id)
        if attached is None or attached.elements != model.numel:
            raise NotAttached(f"worker {worker_id} has nothing attached for this model on shard {self.index}")
        return attached

    def heartbeat(self, worker_id: str) -> int:
        """Renew a worker's lease; return the version (UnknownWorker if it was evicted)."""
        with self._cond:
            self.membership.get(worker_id)
            return self.version

    # -- lifecycle: leases, checkpoints, shutdown ------------------------------------------------------------------

    def start(self) -> None:
        """Start the maintenance thread: evict silent workers, write time-based checkpoints."""
        if self._maintenance is None:
            self._maintenance = threading.Thread(target=self._maintain, name=f"shard{self.index}-leases", daemon=True)
            self._maintenance.start()

    def _maintain(self) -> None:
        interval = min(1.0, self.config.lease_timeout / 4)
        with self._cond:
            while not self._closed:
                self._cond.wait(interval)
                if not self._closed:
                    self.tick()

    def tick(self, now: float | None = None) -> None:
        """Evict workers whose lease ran out, log a long wait, take a checkpoint when one is due."""
        with self._cond:
            gone = self.membership.evict_expired(self.config.lease_timeout, now)
            for worker_id, silent in gone:
                self._segments.pop(worker_id, None)
                self.stats.evictions += 1
                self.metrics.evictions.inc()
                log.warning(
                    "shard %d: evicted worker %s after %.1f s of silence (%d live)",
                    self.index,
                    worker_id,
                    silent,
                    len(self.membership.live),
                )
            if gone:
                self._membership_changed()
            waited = self.policy.round_age()
            clock = time.monotonic()
            if waited > WAIT_LOG_SECONDS and clock - self._last_wait_log > WAIT_LOG_SECONDS:
                self._last_wait_log = clock
                log.warning("shard %d: waiting %.0f s: %s", self.index, waited, self.policy.waiting_for(self))
            if self._every_seconds and time.monotonic() - self._last_checkpoint >= self._every_seconds:
                self._checkpoint_locked()

    def _checkpoint_locked(self) -> None:
        self._last_checkpoint = time.monotonic()
        if self._writer is None or self.model is None:
            return
        self.stats.checkpoints += 1
        self._writer.submit(self.snapshot())

    def snapshot(self) -> checkpoint.Snapshot:
        """Copy everything needed to resume (call under the lock, or on a quiet shard)."""
        model = self.require_model()
        state = model.optimizer.state_dict()
        copied = {
            "state": {
                k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in st.items()}
                for k, st in state["state"].items()
            },
            "param_groups": [dict(g) for g in state["param_groups"]],
        }
        return checkpoint.Snapshot(
            shard_index=self.index,
            num_shards=model.placement.num_shards,
            specs=model.placement.specs,
            digest=model.digest,
            version=self.version,
            optimizer=self.config.optimizer,
            params=model.params.detach().clone(),
            optimizer_state=copied,
            ever_full=self.membership.ever_full,
            applied=self.applied.dump(),
            finished_workers=self.finished_workers,
        )

    def drain(self, grace: float) -> None:
        """Give a sync round that has some of its gradients up to `grace` seconds to close before stopping."""
        with self._cond:
            self._cond.wait_for(lambda: not self.policy.in_progress(), timeout=grace)

    def stop_waiting(self) -> None:
        """Answer every waiting and every new pull with UNAVAILABLE: the shard is going away."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def close(self) -> None:
        """Write a final checkpoint (once no RPC can change the state any more) and stop the background threads."""
        self.stop_waiting()
        with self._cond:
            self._segments.clear()
            if self._writer is not None and self.model is not None and not self._final_written:
                self._final_written = True
                self._checkpoint_locked()
        if self._writer is not None:
            self._writer.close()
        if self._maintenance is not None:
            self._maintenance.join(timeout=5)

    # -- introspection -----------------------------------------------------------------------------------------

    def describe(self) -> ShardStatus:
        """A consistent snapshot of what the shard holds (for Topology and tests)."""
        with self._cond:
            model = self.model
            return ShardStatus(
                initialized=model is not None,
                digest=model.digest if model else "",
                specs=model.placement.specs if model else (),
                version=self.version,
                live_workers=len(self.membership.live),
                stats=dataclasses.replace(self.stats),
            )

    def state_bytes(self) -> bytes:
        """Weights, optimizer state and version as bytes, to show a rejected request changed nothing."""
        with self._cond:
            parts = [str(self.version).encode()]
            if self.model is not None:
                parts.append(self.model.params.numpy().tobytes())
                for state in self.model.optimizer.state.values():
                    for key in sorted(state):
                        value = state[key]
                        parts.append(
                            value.numpy().tobytes() if isinstance(value, torch.Tensor) else repr(value).encode()
                        )
            return b"|".join(parts)

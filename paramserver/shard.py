"""A shard's state: its pieces of the model as one flat float32 buffer, the optimizer, the version, membership.

One lock (a Condition) guards all of it; pulls wait on it for the version they ask for. Gradients arrive in
scratch buffers from a bounded pool and are fully validated before the lock is taken, so a rejected push never
touches the weights, the optimizer state or the version.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paramserver.config import ServerConfig
from paramserver.consistency import make_policy
from paramserver.errors import (
    AlreadyInitialized,
    InvalidArgument,
    ModelMismatch,
    NotInitialized,
    PullTimeout,
    ShuttingDown,
    TooLarge,
    WrongJob,
)
from paramserver.membership import Membership
from paramserver.placement import Piece, Placement, TensorSpec, place

log = logging.getLogger(__name__)


def make_optimizer(config: ServerConfig, params: torch.Tensor) -> torch.optim.Optimizer:
    """Build torch's own optimizer for the shard's flat parameter (all of them act elementwise)."""
    wd = config.weight_decay
    if config.optimizer == "sgd":
        return torch.optim.SGD([params], lr=config.lr, weight_decay=wd)
    if config.optimizer == "momentum":
        return torch.optim.SGD([params], lr=config.lr, momentum=config.momentum, weight_decay=wd)
    if config.optimizer == "adam":
        return torch.optim.Adam([params], lr=config.lr, weight_decay=wd)
    if config.optimizer == "adamw":
        return torch.optim.AdamW([params], lr=config.lr, weight_decay=wd)
    if config.optimizer == "adagrad":
        return torch.optim.Adagrad([params], lr=config.lr, weight_decay=wd)
    raise ValueError(f"unknown optimizer {config.optimizer!r}")


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
class ShardStatus:
    """What a shard holds, at one instant."""

    initialized: bool
    digest: str
    specs: tuple[TensorSpec, ...]
    version: int
    live_workers: int


class BufferPool:
    """At most `size` gradient-sized scratch buffers, reused; a caller past the bound waits for one."""

    def __init__(self, size: int, numel: int) -> None:
        self._numel = numel
        self._free: queue.Queue[np.ndarray | None] = queue.Queue()
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
            self._free.put(buf)


class Shard:
    """One shard of the parameter server: everything the servicer acts on."""

    def __init__(self, config: ServerConfig, index: int = 0, addresses: Sequence[str] = ()) -> None:
        self.config = config
        self.index = index
        self.addresses: tuple[str, ...] = tuple(addresses)
        self.version = 0
        self.membership = Membership(config.workers)
        self.policy = make_policy(config.mode)
        self.model: ShardModel | None = None
        self._pool: BufferPool | None = None
        self._cond = threading.Condition()
        self._closed = False

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
            return worker.rank, self.version

    def leave(self, worker_id: str) -> None:
        """Remove a worker; a sync round stops waiting for it."""
        with self._cond:
            if self.membership.leave(worker_id):
                log.info("shard %d: worker %s left (%d live)", self.index, worker_id, len(self.membership.live))
                self.policy.membership_changed(self)
                self._cond.notify_all()

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

    def commit_init(self, model: ShardModel) -> int:
        """Adopt a fully received model, unless another Init won the race; return the version."""
        with self._cond:
            self._check_not_held(model.digest)
            self.model = model
            self.version = 0
            self.policy.reset(model.numel)
            self._pool = BufferPool(self.config.max_concurrent_pushes, model.numel)
            log.info(
                "shard %d: model %s initialised: %d pieces, %d elements",
                self.index,
                model.digest[:12],
                len(model.pieces),
                model.numel,
            )
            self._cond.notify_all()
            return self.version

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

    def push(self, worker_id: str, step: int, base_version: int, grad: np.ndarray, digest: str) -> tuple[int, bool]:
        """Hand a validated gradient to the consistency policy; return (version, applied)."""
        with self._cond:
            model = self.require_model(digest)
            if grad.shape != (model.numel,):
                raise InvalidArgument(f"gradient of {grad.shape[0]} elements for a shard of {model.numel}")
            worker = self.membership.get(worker_id)
            if step and worker.seen_step(step):
                return self.version, False
            self.policy.submit(self, worker_id, base_version, torch.from_numpy(grad))
            if step:
                worker.record_step(step)
            return self.version, True

    def apply(self, grad: torch.Tensor) -> None:
        """Run one optimizer step with a flat gradient; called by the policy under the lock."""
        model = self.model
        assert model is not None
        model.params.grad = grad
        model.optimizer.step()
        model.params.grad = None
        self.version += 1
        self._cond.notify_all()

    # -- pull --------------------------------------------------------------------------------------------------

    def wait_for(self, min_version: int, timeout: float, worker_id: str = "") -> tuple[int, ShardModel]:
        """Wait until the shard reaches `min_version`; return (version, model)."""
        with self._cond:
            if worker_id:
                self.membership.touch(worker_id)
            self.require_model()
            reached = self._cond.wait_for(lambda: self._closed or self.version >= min_version, timeout=timeout)
            if self._closed:
                raise ShuttingDown(f"shard {self.index} is shutting down")
            if not reached:
                raise PullTimeout(
                    f"shard {self.index} is at version {self.version}, not {min_version}, after "
                    f"{timeout:.1f} s: {self.policy.waiting_for(self)}"
                )
            model = self.require_model()
            return self.version, model

    def close(self) -> None:
        """Wake every waiting pull with UNAVAILABLE: the shard is going away."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

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

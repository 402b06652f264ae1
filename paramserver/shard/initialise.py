"""A shard's Init: one at a time, the header checked before any tensor arrives, the model adopted only if no other
Init won the race meanwhile."""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Protocol

from paramserver.config import ServerConfig
from paramserver.errors import AlreadyInitialized, InitInProgress, ModelMismatch
from paramserver.placement import TensorSpec
from paramserver.shard.durability.persistence import Checkpoints
from paramserver.shard.model import ShardModel, build_model, place_init
from paramserver.tables import TableSpec

log = logging.getLogger(__name__)


class InitHost(Protocol):
    """What an Init needs of its shard."""

    index: int
    config: ServerConfig
    addresses: tuple[str, ...]
    model: ShardModel | None
    version: int
    checkpoints: Checkpoints

    @property
    def durable(self) -> bool:
        """Whether an update is acknowledged only once durable (a log, or a backup)."""

    def adopt_locked(self, model: ShardModel, version: int) -> None:
        """Hold `model` at `version` from now on (under the lock)."""

    def checkpoint_locked(self) -> None:
        """Hand a snapshot to the checkpoint writer now (under the lock)."""


class InitSlot:
    """The shard's one Init slot and the checks around it."""

    def __init__(self, shard: InitHost, lock: threading.Condition) -> None:
        self._shard = shard
        self._lock = lock  # the shard's
        self._slot = threading.Lock()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Hold the slot. Concurrent workers registering the same model would otherwise each build a whole copy of
        it here (and gRPC would buffer each one's stream): the others are refused with UNAVAILABLE
        (InitInProgress) at once, retry, and then find the model held (ALREADY_EXISTS)."""
        if not self._slot.acquire(blocking=False):
            raise InitInProgress(f"shard {self._shard.index} is being initialised by another worker; retry shortly")
        try:
            yield
        finally:
            self._slot.release()

    def prepare(
        self, specs: Sequence[TensorSpec], num_shards: int, digest: str, tables: Sequence[TableSpec] = ()
    ) -> ShardModel:
        """Check an Init header and return an unattached model to receive the initial values into."""
        shard = self._shard
        placement = place_init(specs, num_shards, digest, len(shard.addresses), tables)
        self._check_not_held(digest)
        return build_model(placement, shard.index, shard.config)

    def commit(self, model: ShardModel) -> int:
        """Adopt a fully received model, unless another Init won the race; return the version."""
        shard = self._shard
        with self._lock:
            self._check_not_held(model.digest)
            shard.adopt_locked(model, version=0)
            digest, pieces = model.digest[:12], len(model.pieces)
            log.info("shard %d: model %s initialised: %d pieces, %d elements", shard.index, digest, pieces, model.numel)
            version = shard.version
            if shard.durable:  # the base the write-ahead log replays over
                shard.checkpoint_locked()
        if shard.durable:
            shard.checkpoints.flush()  # on disk before the Init is acknowledged
        return version

    def _check_not_held(self, digest: str) -> None:
        held, index = self._shard.model, self._shard.index
        if held is None:
            return
        if held.digest == digest:
            raise AlreadyInitialized(f"shard {index} already holds this model (digest {digest[:12]}); pull it")
        raise ModelMismatch(
            f"shard {index} holds another model (digest {held.digest[:12]}), not "
            f"{digest[:12]}: different tensor names, shapes or shard count"
        )

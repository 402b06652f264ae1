"""A shard's state: its pieces of the model as one flat float32 buffer, the optimizer, the version, membership.

One lock (a Condition) guards all of it; pulls wait on it for the version they ask for. Gradients arrive in
scratch buffers from a bounded pool (paramserver.shard.pool) and are fully validated before the lock is taken, so a
rejected push never touches the weights, the optimizer state or the version. The model itself, the optimizers,
the attachments and the checkpoints are modules of their own beside this one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from paramserver.config import ServerConfig
from paramserver.errors import (
    InvalidArgument,
    ModelMismatch,
    NotClaimShard,
    NotInitialized,
    NotPrimary,
    PullTimeout,
    StaleRound,
)
from paramserver.metrics import ShardMetrics
from paramserver.placement import TensorSpec
from paramserver.shard import roster, status
from paramserver.shard.attachments import Attachments
from paramserver.shard.claims import Claim, Claims
from paramserver.shard.consistency import make_policy
from paramserver.shard.durability import persistence
from paramserver.shard.durability.checkpoint import Snapshot
from paramserver.shard.initialise import InitSlot
from paramserver.shard.maintenance import Duties, Maintenance
from paramserver.shard.membership import AppliedLog, Membership
from paramserver.shard.model import ShardModel
from paramserver.shard.pool import BufferPool
from paramserver.shard.publication import Publication
from paramserver.shard.replication.replicator import Forwarded, ReplicaFeed, Replicator
from paramserver.shard.sparse.row_blocks import RowBlock
from paramserver.shard.status import ShardStats, ShardStatus
from paramserver.shard.update import Consumers, PendingPushes, Update, apply_update
from paramserver.tables import TableSpec

log = logging.getLogger(__name__)


class Shard:
    """One shard of the parameter server: everything the servicer acts on."""

    def __init__(self, config: ServerConfig, index: int = 0, addresses: Sequence[str] = ()) -> None:
        self.config = config
        self.index = index
        self.addresses: tuple[str, ...] = tuple(addresses)  # one per shard (its first copy's, with replicas)
        self.replica_addresses: tuple[str, ...] = ()  # with replicas: every copy's, each shard's copies in turn
        # Non-empty while this process must not serve workers (a backup; a deposed primary): why, as they are told.
        self.standby = ""
        self._replicator: Replicator | None = None
        self._replica_feed: ReplicaFeed | None = None
        self.replicated = False  # a copy that holds every acknowledged update (a backup that took over)
        self.version = 0
        self.membership = Membership(config.workers)
        self.applied = AppliedLog()
        self.policy = make_policy(config)
        self.stats = ShardStats()
        self.model: ShardModel | None = None
        self._pool: BufferPool | None = None
        self._cond = threading.Condition()
        self._closed = False
        self.checkpoints = persistence.Checkpoints(config)
        evict, waits = functools.partial(roster.evict_expired, self), functools.partial(self.policy.waiting_for, self)
        duties = Duties(evict, self.policy.round_age, waits, self.checkpoints.due_now, self.checkpoint_locked)
        self.maintenance = Maintenance(
            index, min(1.0, config.lease_timeout / 4), self._cond, lambda: self._closed, duties
        )
        self.finished_workers = 0
        self.done = threading.Event()  # set once every worker of the job finished and none is live
        self.metrics = ShardMetrics(index)
        # Whatever must see each update, hooked around the one apply (paramserver.shard.update): the log first, the
        # backup's link after it (`replicator`), then the metrics and whatever is added later (serving copies).
        self.consumers = Consumers()
        self.consumers.add(self.checkpoints)
        self.consumers.add(self.metrics)
        self.publication = Publication(0, 0)  # what serving copies ask about (a model's tables once it has one)
        self.metrics.watch_tables(lambda: self.model.tables.figures() if self.model is not None else [])
        self.attachments = Attachments(  # each worker's segment or data-socket ticket
            index, config.shared_memory, self._cond, self.membership, self.require_model, self.check_worker
        )
        # A new value each time a shard process starts: versions a worker waits for refer to one incarnation.
        self.incarnation = uuid.uuid4().hex
        self.init_slot = InitSlot(self, self._cond)
        self._pending = PendingPushes()  # the pushes the next update holds
        self.claims = Claims()  # which worker trains each shard of a followed dataset (shard 0's; see claim)

    # -- membership --------------------------------------------------------------------------------------------

    def join(self, worker_id: str, job_name: str) -> tuple[int, int]:
        """Add a worker to the job; return (rank, version)."""
        return roster.join(self, worker_id, job_name)

    def leave(self, worker_id: str, finished: bool = False) -> None:
        """Remove a worker; a sync round stops waiting for it. `finished`: it completed its training."""
        roster.leave(self, worker_id, finished)

    def touch(self, worker_id: str) -> None:
        """Renew a worker's lease."""
        if worker_id:
            with self._cond:
                self.membership.touch(worker_id)

    def heartbeat(self, worker_id: str, idle: bool = False) -> int:
        """Renew a worker's lease and say whether it is idle (out of the rounds' count until it pushes again);
        return the version (UnknownWorker if it was evicted)."""
        with self._cond:
            self.check_serving()
            self.membership.get(worker_id)
            if self.membership.set_idle(worker_id, idle):
                roster.changed(self)
            return self.version

    # -- dataset claims (ps-worker --follow; paramserver.shard.claims) ---------------------------------------------

    def claim(
        self,
        worker_id: str,
        job_name: str,
        dataset: str,
        listed: int,
        finish: int = -1,
        samples: int = 0,
        holding: int = -1,
    ) -> int | None:
        """Record that the worker trained dataset shard `finish` whole (>= 0), then give it the first of the
        `listed` shards nobody holds or finished (None: none is left); or, `holding` >= 0, re-assert its claim on
        that shard (ClaimNotHeld where another holds or finished it) and claim nothing new. A refused request
        changes nothing."""
        roster.check_job(self, worker_id, job_name)
        with self._cond:
            self._check_claims(worker_id)
            self.claims.check(dataset, listed)  # before the finish: a refused request changes nothing
            if holding >= 0:
                self.claims.hold(worker_id, dataset, holding)
                return holding
            if finish >= 0:
                self.claims.finish(worker_id, dataset, finish, samples)
            return self.claims.claim(worker_id, dataset, listed)

    def claim_record(self) -> tuple[str, list[Claim]]:
        """The followed dataset's key and every shard's claim (shard 0)."""
        with self._cond:
            self._check_claims()
            return self.claims.dataset, self.claims.entries()

    def _check_claims(self, worker_id: str | None = None) -> None:
        self.check_serving()
        if self.index != 0:
            raise NotClaimShard(f"shard {self.index} keeps no dataset claims: shard 0 of the job does")
        if worker_id is not None:
            self.membership.get(worker_id)

    def check_worker(self, worker_id: str) -> None:
        """Raise UnknownWorker unless the worker is live (renewing its lease)."""
        with self._cond:
            self.check_serving()
            self.membership.get(worker_id)

    def check_serving(self) -> None:
        """Raise NotPrimary where this process holds a copy it must not serve from (call under the lock)."""
        if self.standby:
            raise NotPrimary(self.standby)

    # -- init and restore --------------------------------------------------------------------------------------

    def prepare_init(
        self, specs: Sequence[TensorSpec], num_shards: int, digest: str, tables: Sequence[TableSpec] = ()
    ) -> ShardModel:
        """Check an Init header and return an unattached model to receive the initial values into."""
        with self._cond:
            self.check_serving()
        return self.init_slot.prepare(specs, num_shards, digest, tables)

    def initialising(self) -> contextlib.AbstractContextManager[None]:
        """Hold the shard's one Init slot (InitInProgress while another worker's Init runs)."""
        return self.init_slot.hold()

    def commit_init(self, model: ShardModel) -> int:
        """Adopt a fully received model, unless another Init won the race; return the version."""
        return self.init_slot.commit(model)

    def restore(self) -> bool:
        """Adopt the newest valid checkpoint in checkpoint_dir, if any; return whether one was restored.

        Call once the peer list is known (it must match the checkpoint's shard count) and before serving.
        """
        found = persistence.restored(self.config, self.index, self.addresses)
        if found is None:
            self.checkpoints.forget_log(self.index)
            self.checkpoints.open_log(self.index, 0)
            return False
        model, snap = found
        with self._cond:
            self.adopt_locked(model, snap.version)
            self.membership.rejoin_all(snap.finished_workers)
            self.applied = AppliedLog.restore(snap.applied)
            self.finished_workers = snap.finished_workers
            self.claims = Claims.restore(snap.claims)
            self.version = persistence.replay(self.config, self.index, model, self.applied, snap.version, self.claims)
            self.claims.hold_off(self.config.lease_timeout)
            self.publication.reset(self.version)
            self.metrics.version.set(self.version)
            self.checkpoints.open_log(self.index, self.version)
        log.info("shard %d: restored version %d of model %s", self.index, snap.version, snap.digest[:12])
        return True

    @property
    def replicator(self) -> Replicator | None:
        """Where this primary's updates go besides its log: its backup's link (None: no backup)."""
        return self._replicator

    @replicator.setter
    def replicator(self, replicator: Replicator | None) -> None:
        with self._cond:
            if self._replica_feed is not None:
                self.consumers.remove(self._replica_feed)
            self._replicator = replicator
            self._replica_feed = ReplicaFeed(replicator) if replicator is not None else None
            if self._replica_feed is not None:
                self.consumers.add(self._replica_feed, after=self.checkpoints)

    @property
    def durable(self) -> bool:
        """Whether every acknowledged update is in a write-ahead log (a checkpoint_dir is set): a restart then
        resumes at the newest version any worker was told of. So is a copy of a replicated shard that holds every
        acknowledged update."""
        return self.checkpoints.wal is not None or self.replicated

    def durable_target(self, worker_id: str) -> int:
        """The version that holds this worker's last push (in sync mode: the open round's, while it is open)."""
        with self._cond:
            return self.version + self.policy.pending(worker_id)

    def wait_durable(self, version: int, timeout: float) -> None:
        """Wait until `version` (`durable_target`) is logged as --wal-sync promises and held by the backup that
        must hold it; PullTimeout after `timeout` seconds. At once without a log or a backup."""
        if not self.durable and self.replicator is None:
            return
        replicator = self.replicator
        if replicator is not None and not replicator.wait_acked(version, timeout):
            raise PullTimeout(
                f"shard {self.index}: the push was taken, but its backup did not confirm version {version} within "
                f"{timeout:.1f} s; push again (it applies once)"
            )
        if not self.checkpoints.wait_durable(version, timeout):
            raise PullTimeout(
                f"shard {self.index}: the push was taken, but version {version}, which holds it, was not durable "
                f"after {timeout:.1f} s: {self.policy.waiting_for(self)}; push again (it applies once)"
            )

    def forward(self, data: np.ndarray) -> Forwarded | None:
        """Start sending a push's gradient (a flat float32 array) to the backup as it becomes final (see
        Replicator.forward); None without a live backup."""
        replicator = self.replicator
        return replicator.forward(data.data.cast("B")) if replicator is not None else None

    def adopt_locked(self, model: ShardModel, version: int) -> None:
        """Hold `model` at `version` from now on, with a fresh round and scratch pool (call under the lock)."""
        self.model = model
        self.version = version
        self._pending.drop()
        self.policy.reset(model.numel)
        self._pool = BufferPool(self.config.max_concurrent_pushes, model.numel)
        self.consumers.remove(self.publication)
        self.publication = Publication(len(model.tables.specs), version)
        self.consumers.add(self.publication)
        self._cond.notify_all()

    # -- push --------------------------------------------------------------------------------------------------

    def require_model(self, digest: str | None = None) -> ShardModel:
        """Return the held model, checking the caller's digest when given."""
        model = self.model
        if self.standby:  # a backup's model is not the one to act on: the worker must find the primary
            raise NotPrimary(self.standby)
        if model is None:
            raise NotInitialized(f"shard {self.index} holds no model yet: register (init) the model first")
        if digest is not None and digest != model.digest:
            raise ModelMismatch(
                f"the request is for model {digest[:12] or '(none)'}, but shard {self.index} holds {model.digest[:12]}"
            )
        return model

    @contextlib.contextmanager
    def scratch(self) -> Iterator[np.ndarray]:
        """Lend a gradient-sized buffer to receive a push into (waits while the pool is empty)."""
        pool = self._pool
        if pool is None:
            raise NotInitialized(f"shard {self.index} holds no model yet: register (init) the model first")
        with pool.take() as buf:
            yield buf

    def push(
        self,
        worker_id: str,
        step: int,
        base_version: int,
        grad: np.ndarray,
        digest: str,
        lent: bool = False,
        rows: Sequence[RowBlock] = (),
        forward: Forwarded | None = None,
    ) -> tuple[int, bool]:
        """Hand a validated gradient (and validated row gradients, see ShardTables.check) to the consistency
        policy; return (version, applied). `lent`: the gradient is in a buffer lent by `scratch()`, which the
        policy may keep (see `keep_scratch`). `forward`: its bytes are on their way to the backup (`forward`), so
        the update holding it can name it instead of carrying it; the caller aborts it unless this applied it."""
        with self._cond:
            model = self.require_model(digest)  # NotPrimary first on a copy that must not serve
            if grad.shape != (model.numel,):
                raise InvalidArgument(f"gradient of {grad.shape[0]} elements for a shard of {model.numel}")
            self.check_step(step)
            self.membership.get(worker_id)
            if self.membership.set_idle(worker_id, False):  # an idle worker's push counts it in the rounds again
                roster.changed(self)
            if self.applied.seen(worker_id, step):
                self.stats.duplicate_pushes += 1
                self.metrics.pushed("duplicate")
                # The version a pull must wait for to include the push taken before: the next one while its
                # round is open, else this one.
                return self.version + self.policy.pending(worker_id), False
            model.tables.check_room(rows)
            key = (worker_id, step)
            self._pending.add(key, forward)  # logged with the update that applies it
            try:
                self.policy.submit(self, worker_id, base_version, torch.from_numpy(grad), lent=lent, rows=rows)
            except StaleRound:
                self._pending.forget(key)
                self.stats.late_pushes += 1
                raise
            except BaseException:
                self._pending.forget(key)
                raise
            self.applied.record(worker_id, step)
            self.metrics.pushed("applied")
            return self.version, True

    @staticmethod
    def check_step(step: int) -> None:
        """Refuse a step that cannot name a push: (worker_id, step) is what makes a retry apply once."""
        if step < 1:
            raise InvalidArgument("a push's step starts at 1: the shard applies each (worker_id, step) once")

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
        rows: Sequence[RowBlock] = (),
        straggler: str | None = None,
        waited: float | None = None,
        staleness: int | None = None,
    ) -> None:
        """Apply the next version: a flat gradient (its buffer elements carry values: see ShardModel.step) and row
        gradients, holding the pushes taken since the last; called by the policy under the lock."""
        pushes, forwards = self._pending.take()
        update = Update(
            self.version + 1,
            pushes,
            grad.numpy(),
            list(rows),
            time.time(),
            claims=self.claims.take_events(),
            forwards=forwards,
            waited=waited,
            staleness=staleness,
            straggler=None if straggler is None else self.membership.rank_of(straggler),
        )
        self.commit_locked(update)

    def commit_locked(self, update: Update, record_pushes: bool = False) -> None:
        """Make `update` the next version: its consumers' `logged` (the log, the backup: no worker hears of a version
        they lack), the one apply, the version shown, their `applied`. `record_pushes`: record its pushes as applied
        (a backup's; a live push is recorded when taken). ValueError, changing nothing, where it does not fit the
        model. Call under the lock."""
        model = self.model
        if model is None or update.grad.size != model.numel:
            raise ValueError(f"version {update.version} does not fit shard {self.index}'s model")
        self.consumers.logged(update)
        apply_update(model, update, self.config.lr_at)
        if record_pushes:
            for worker_id, step in update.pushes:
                self.applied.record(worker_id, step)
            self.claims.apply_events(update.claims)
        self.advance_locked(update.version, model)
        self.consumers.applied(update)

    def advance_locked(self, version: int, model: ShardModel) -> None:
        """Show `version` (applied and logged): wake the pulls waiting for it, and take a checkpoint when one is
        due (call under the lock)."""
        self.version = version
        self._cond.notify_all()
        if self.checkpoints.due_at(version) or self.checkpoints.log_full(model.numel * 4):
            self.checkpoint_locked()

    # -- lifecycle: leases, checkpoints, shutdown ------------------------------------------------------------------

    def start(self) -> None:
        """Start the maintenance thread: evict silent workers, write time-based checkpoints."""
        self.maintenance.start()

    def tick(self, now: float | None = None) -> None:
        """Evict workers whose lease ran out, log a long wait, take a checkpoint when one is due."""
        self.maintenance.tick(now)

    @property
    def lock(self) -> threading.Condition:
        """The shard's one lock (for the replication link, which sends updates in version order under it)."""
        return self._cond

    @property
    def closed(self) -> bool:
        """Whether the shard is going away (see `stop_waiting`)."""
        return self._closed

    def checkpoint_locked(self) -> None:
        """Hand a snapshot to the checkpoint writer now, if there is one (call under the lock)."""
        self.stats.checkpoints += self.checkpoints.take(self._snapshot_or_none)

    def snapshot(self) -> Snapshot:
        """Copy everything needed to resume (call under the lock, or on a quiet shard)."""
        model = self.model
        if model is None:
            raise ValueError(f"shard {self.index} holds no model to snapshot")
        return persistence.snapshot(
            model,
            index=self.index,
            version=self.version,
            optimizer=self.config.optimizer,
            ever_full=self.membership.ever_full,
            applied=self.applied,
            finished_workers=self.finished_workers,
            claims=self.claims,
        )

    def _snapshot_or_none(self) -> Snapshot | None:
        return self.snapshot() if self.model is not None else None

    def drain(self, grace: float) -> None:
        """Give a sync round that has some of its gradients up to `grace` seconds to close before stopping."""
        with self._cond:
            self._cond.wait_for(lambda: not self.policy.in_progress(), timeout=grace)

    def stop_waiting(self) -> None:
        """Answer every waiting and every new pull with UNAVAILABLE: the shard is going away."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.maintenance.stop()

    def close(self) -> None:
        """Write a final checkpoint (once no RPC can change the state any more) and stop the background threads."""
        self.stop_waiting()
        with self._cond:
            self.attachments.clear()
            self.stats.checkpoints += self.checkpoints.take_final(self._snapshot_or_none)
        self.checkpoints.close()
        self.maintenance.join(timeout=5)

    # -- introspection (paramserver.shard.status) ---------------------------------------------------------------

    def describe(self) -> ShardStatus:
        """A consistent snapshot of what the shard holds (for Topology and tests)."""
        with self._cond:
            return status.describe(self.model, self.version, len(self.membership.live), self.stats)

    def state_bytes(self) -> bytes:
        """Weights, optimizer state and version as bytes, to show a rejected request changed nothing."""
        with self._cond:
            return status.state_bytes(self.model, self.version)

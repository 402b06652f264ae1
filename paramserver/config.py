"""ServerConfig: the job's training dynamics and a shard's limits, one frozen dataclass for CLI, tests and cluster."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from paramserver import modes
from paramserver.shard import buffers as buffer_rules
from paramserver.shard import optimizers, schedules

C = TypeVar("C")


def config_field(default: Any, help: str, *, choices: tuple[str, ...] | None = None, flag: bool = False) -> Any:
    """A config dataclass field carrying its CLI help (and choices; `flag` for on/off switches)."""
    return field(default=default, metadata={"help": help, "choices": choices, "flag": flag})


_TYPES: dict[str, Any] = {
    "int": int,
    "float": float,
    "str": str,
    "int | None": int,
    "str | None": str,
    "float | None": float,
}


def add_arguments(group: argparse._ActionsContainer, cls: type) -> None:
    """Add one --flag per field of a config dataclass, with its help text and default."""
    for f in dataclasses.fields(cls):
        flag = f"--{f.name.replace('_', '-')}"
        if f.type == "bool":
            group.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=f.default,
                help=f"{f.metadata['help']} (default: {'on' if f.default else 'off'})",
            )
            continue
        text = f.metadata["help"]
        if "(default" not in text and f.default not in ("", None):  # unset is said by the help itself, or not at all
            text += " (default: %(default)s)"
        group.add_argument(
            flag,
            dest=f.name,
            type=_TYPES[str(f.type)],
            default=f.default,
            choices=f.metadata.get("choices"),
            help=text,
        )


def from_arguments(cls: type[C], args: argparse.Namespace) -> C:
    """Build a config dataclass from parsed flags (the fields' values)."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]


@dataclass(frozen=True)
class ServerConfig:
    """Everything a shard needs to know about the job; every shard of a job gets the same one."""

    mode: str = config_field("sync", f"consistency: {modes.describe()}", choices=modes.NAMES)
    staleness: int = config_field(
        3, "ssp: how many pushes a worker may be ahead of the slowest live worker before its pull waits"
    )
    max_staleness: int = config_field(
        0,
        "async and ssp: refuse a push computed on weights more than this many versions old (ABORTED: the worker "
        "pulls and computes again); 0: no limit",
    )
    workers: int = config_field(
        1,
        "workers in the job: a sync round waits for this many (fewer once some have left), "
        "and the data is split this many ways; a host running ps-worker --nproc N counts once (its N processes "
        "reduce on the host and push once), or N times with --no-host-reduce",
    )
    optimizer: str = config_field("adam", "server-side optimizer (torch.optim, fused kernel)", choices=optimizers.NAMES)
    lr: float = config_field(1e-3, "learning rate")
    lr_schedule: str = config_field(
        "constant",
        "the learning rate by version, as torch.optim.lr_scheduler computes it: constant, step (x --gamma every "
        "--step-every versions), cosine or linear (down to --min-lr over --decay-versions); after a --warmup-versions "
        "linear warmup",
        choices=schedules.NAMES,
    )
    warmup_versions: int = config_field(0, "versions of linear warmup before the schedule (torch's LinearLR)")
    warmup_start_factor: float = config_field(0.1, "the warmup's first rate, as a fraction of --lr")
    decay_versions: int = config_field(0, "cosine and linear: versions from the end of the warmup to --min-lr")
    min_lr: float = config_field(0.0, "cosine and linear: the rate they end at (then hold)")
    step_every: int = config_field(0, "step: versions between two multiplications of the rate by --gamma")
    gamma: float = config_field(0.1, "step: the factor the rate is multiplied by every --step-every versions")
    momentum: float = config_field(0.9, "momentum of the 'momentum' optimizer")
    weight_decay: float = config_field(0.0, "weight decay (decoupled for adamw)")
    no_weight_decay: str = config_field(
        "",
        "comma-separated name patterns (fnmatch: * ? [seq]) of dense tensors that take no --weight-decay, matched "
        "against the whole names the worker registers (its state_dict's: '*.bias,*norm*.weight,bn*'): tensors whose "
        "names match get weight decay 0, as a torch param group with weight_decay=0 would, the others the job's "
        "decay, for every --optimizer and at the --lr-schedule's rate (sgd, momentum, adam and adagrad then hold "
        "one more gradient-sized buffer per shard); sparse tables take no weight decay either way (default: none, "
        "every tensor decays)",
    )
    buffers: str = config_field(
        "mean",
        "what an update makes of the model's buffers (BatchNorm's running statistics: values the workers push, not "
        f"gradients; the optimizer never touches them): {buffer_rules.describe()}",
        choices=buffer_rules.NAMES,
    )
    buffer_momentum: float = config_field(0.5, "--buffers ema: the weight m of each update's value, in (0, 1]")
    job_name: str = config_field("paramserver", "workers naming another job are refused")
    pull_timeout: float = config_field(60.0, "seconds a pull may wait for the version it asks for")
    max_message_bytes: int = config_field(4 * 1024 * 1024, "largest gRPC message a shard accepts (chunks are ~1 MiB)")
    max_model_bytes: int = config_field(16 * 1024**3, "largest part of a model (float32 bytes) one shard accepts")
    max_table_bytes: int = config_field(
        4 * 1024**3,
        "memory one shard's sparse-table rows may take (values, optimizer state, index): beyond it, see "
        "--table-overflow",
    )
    table_overflow: str = config_field(
        "evict",
        "what a shard does when new rows would take its tables past --max-table-bytes: evict (drop the least "
        "recently updated rows; paramserver_table_rows_evicted counts them) or refuse (the push is refused with "
        "RESOURCE_EXHAUSTED and nothing changes)",
        choices=("evict", "refuse"),
    )
    lease_timeout: float = config_field(
        10.0,
        "seconds a worker may stay silent (no RPC, no heartbeat) before it is evicted and a sync round "
        "stops waiting for it",
    )
    backup_workers: int = config_field(
        0,
        "sync: apply a round once all live workers but this many have pushed; the late ones are refused "
        "(ABORTED) and counted",
    )
    checkpoint_dir: str | None = config_field(
        None,
        "directory for this job's checkpoints; a shard restores the newest valid one at start "
        "(default: none, no checkpoints)",
    )
    checkpoint_every: str = config_field(
        "100", "checkpoint every N versions ('100'), or every N seconds ('30s'); 0 = only on SIGTERM"
    )
    wal_sync: str = config_field(
        "write",
        "with --checkpoint-dir, every applied version is logged before the pushes it holds are acknowledged, and a "
        "restarted shard replays the log over its newest checkpoint: write (the record is handed to the kernel: "
        "survives a kill of the shard process, not a crash of its host) or fsync (also synced to disk, in groups: "
        "survives a host crash or power loss, and costs a disk flush per group of updates)",
        choices=("write", "fsync"),
    )
    replicas: int = config_field(
        1,
        "copies of each shard's part: 2 runs a hot standby beside each primary (ps-server --shards N starts 2N "
        "processes); a push is acknowledged once both hold it, and when a primary dies its backup takes over. "
        "Needs --coordinator",
    )
    coordinator: str | None = config_field(
        None,
        "etcd client URL(s), comma-separated (http://host:2379): where each part's primary, in-sync copies and "
        "epoch are kept, changed only by compare-and-swap, so that at most one copy of a part accepts pushes",
    )
    replica_timeout: float = config_field(
        0.5,
        "--replicas 2: seconds of silence on the replication link (no record, heartbeat or acknowledgement) after "
        "which a backup takes over from its primary, or a primary goes on without its backup",
    )
    replication_port: int = config_field(
        0,
        "--replicas 2: port a primary streams its updates to its backup on (0: any free port, announced through "
        "the coordinator; ps-server --shards N: each process on port + its number)",
    )
    exit_when_done: bool = config_field(
        False,
        "stop the shard (final checkpoint, exit 0) once the job is done: every one of its workers "
        "finished its training and left, and none is live",
    )
    tls_cert: str | None = config_field(None, "PEM certificate of this shard (TLS); needs --tls-key")
    tls_key: str | None = config_field(None, "PEM private key of this shard")
    tls_ca: str | None = config_field(None, "PEM CA whose client certificates are required (mutual TLS)")
    auth_token_file: str | None = config_field(
        None, "file holding a shared bearer token that every call but health checks must carry (default: no token)"
    )
    metrics_port: int | None = config_field(
        None,
        "serve Prometheus metrics on this port, on the --host address (ps-server --shards N: shard i on port + i; "
        "default: none)",
    )
    shared_memory: bool = config_field(
        True,
        "let workers on this host exchange tensor bytes with the shard through shared memory (sealed memfds) instead "
        "of the gRPC streams; workers elsewhere always use the streams",
    )
    data_socket: bool = config_field(
        True,
        "serve a TCP data socket beside the gRPC port: workers on other hosts send their gradients and receive "
        "the weights there as raw bytes (3x gRPC's throughput), with gRPC kept for control; off: gRPC streams",
    )
    data_port: int = config_field(
        0,
        "port of the data socket (0: any free port, announced to workers over gRPC; ps-server --shards N: "
        "shard i on port + i); open it wherever the gRPC port is open",
    )
    threads: int = config_field(
        1,
        "torch CPU threads of a shard process (its optimizer step); 1 is fastest when shards and workers share "
        "the cores, where two OpenMP threads stall each other for milliseconds",
    )
    max_concurrent_pushes: int = config_field(
        2,
        "gradient-sized scratch buffers per shard: one per push being received at once (more wait), the open sync "
        "round's sum among them",
    )
    max_pending_connections: int = config_field(
        64,
        "doorbell or data-socket connections that may be proving themselves (TLS, hello) at once, per socket; more "
        "are closed at once and counted in paramserver_socket_connections_refused",
    )

    def __post_init__(self) -> None:
        modes.mode(self.mode)  # ValueError naming the choices
        if self.staleness < 0 or self.max_staleness < 0:
            raise ValueError("staleness and max_staleness must be >= 0")
        optimizers.optimizer_kind(self.optimizer)  # ValueError naming the choices
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, not {self.workers}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, not {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must not be negative, not {self.weight_decay}")
        optimizers.decay_patterns(self.no_weight_decay)  # ValueError for an empty pattern
        buffer_rules.rule(self.buffers)  # ValueError naming the choices
        if not 0 < self.buffer_momentum <= 1:
            raise ValueError(f"buffer_momentum must be in (0, 1], not {self.buffer_momentum}")
        if not self.lease_timeout > 0:
            raise ValueError(f"lease_timeout must be positive, not {self.lease_timeout}")
        if not 0 <= self.backup_workers < self.workers:
            raise ValueError(f"backup_workers must be in [0, workers), not {self.backup_workers}")
        self.checkpoint_schedule()  # validates checkpoint_every
        if self.threads < 1:
            raise ValueError(f"threads must be at least 1, not {self.threads}")
        if self.max_concurrent_pushes < 1:
            raise ValueError("max_concurrent_pushes must be at least 1")
        if self.max_pending_connections < 1:
            raise ValueError("max_pending_connections must be at least 1")
        if self.max_table_bytes < 1:
            raise ValueError(f"max_table_bytes must be positive, not {self.max_table_bytes}")
        if self.wal_sync not in ("write", "fsync"):
            raise ValueError(f"wal_sync must be write or fsync, not {self.wal_sync!r}")
        schedules.check(self)  # ValueError naming what a schedule lacks
        if self.replicas not in (1, 2):
            raise ValueError(f"replicas must be 1 or 2, not {self.replicas}")
        if self.replicas > 1 and not self.coordinator:
            raise ValueError(
                "--replicas 2 needs --coordinator (an etcd URL): which copy of a part is the primary is decided "
                "there, so that a network partition can never leave two copies accepting pushes"
            )
        if not self.replica_timeout > 0:
            raise ValueError(f"replica_timeout must be positive, not {self.replica_timeout}")
        if self.table_overflow not in ("evict", "refuse"):
            raise ValueError(f"table_overflow must be evict or refuse, not {self.table_overflow!r}")
        from paramserver.v1.ps_pb2 import JoinRequest
        from paramserver.wire.bounds import declared  # the wire's bound: a longer name could never be named by a worker

        limit = declared(JoinRequest.DESCRIPTOR.fields_by_name["job_name"])[0]
        if limit is not None and len(self.job_name.encode()) > limit:
            raise ValueError(f"job_name must be at most {limit} bytes (ps.proto's bound), not {len(self.job_name)}")

    def checkpoint_schedule(self) -> tuple[int, float]:
        """Return (every N versions, every N seconds) from checkpoint_every; 0 means never."""
        text = str(self.checkpoint_every).strip().lower()
        try:
            if text.endswith("s"):
                seconds = float(text[:-1])
                if seconds < 0:
                    raise ValueError
                return 0, seconds
            versions = int(text)
            if versions < 0:
                raise ValueError
            return versions, 0.0
        except ValueError:
            raise ValueError(
                f"checkpoint_every must be a number of versions ('100') or seconds ('30s'), "
                f"not {self.checkpoint_every!r}"
            ) from None

    def lr_at(self, version: int) -> float:
        """The learning rate of the update that makes `version` (see paramserver.shard.schedules)."""
        return schedules.lr_at(self, version)

    def replace(self, **changes: Any) -> ServerConfig:
        """Return a copy with some fields changed."""
        return dataclasses.replace(self, **changes)


def copy_dir(config: ServerConfig, copy: int) -> ServerConfig:
    """A copy's config (--replicas 2): its own checkpoint directory (copy-R under the job's), as both copies may
    share a disk."""
    if config.replicas < 2 or not config.checkpoint_dir:
        return config
    return config.replace(checkpoint_dir=str(Path(config.checkpoint_dir) / f"copy-{copy}"))

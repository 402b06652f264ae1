"""ServerConfig: the job's training dynamics and a shard's limits, one frozen dataclass for CLI, tests and cluster."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

MODES = ("sync", "async")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "adagrad")


def _f(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field whose help text the CLI shows."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ServerConfig:
    """Everything a shard needs to know about the job; every shard of a job gets the same one."""

    mode: str = _f("sync", "consistency: sync (average one gradient per live worker, apply once) or async "
                           "(apply each gradient on arrival)", choices=MODES)
    workers: int = _f(1, "workers in the job: a sync round waits for this many (fewer once some have left), "
                         "and the data is split this many ways")
    optimizer: str = _f("adam", "server-side optimizer (torch.optim)", choices=OPTIMIZERS)
    lr: float = _f(1e-3, "learning rate")
    momentum: float = _f(0.9, "momentum of the 'momentum' optimizer")
    weight_decay: float = _f(0.0, "weight decay (decoupled for adamw)")
    job_name: str = _f("paramserver", "workers naming another job are refused")
    pull_timeout: float = _f(60.0, "seconds a pull may wait for the version it asks for")
    max_message_bytes: int = _f(4 * 1024 * 1024, "largest gRPC message a shard accepts (chunks are ~1 MiB)")
    max_model_bytes: int = _f(16 * 1024**3, "largest part of a model (float32 bytes) one shard accepts")
    max_concurrent_pushes: int = _f(2, "pushes received at once per shard (each needs one gradient-sized "
                                       "buffer; more wait)")

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {self.optimizer!r}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, not {self.workers}")
        if not self.lr > 0:
            raise ValueError(f"lr must be positive, not {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must not be negative, not {self.weight_decay}")
        if self.max_concurrent_pushes < 1:
            raise ValueError("max_concurrent_pushes must be at least 1")

    def replace(self, **changes: Any) -> ServerConfig:
        """Return a copy with some fields changed."""
        return dataclasses.replace(self, **changes)

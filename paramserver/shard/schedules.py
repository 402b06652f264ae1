"""Learning-rate schedules on the shards: the rate of each update as a function of the version it makes.

A schedule is torch.optim.lr_scheduler's, in closed form: an optional linear warmup (torch's `LinearLR` from
`warmup_start_factor` to 1 over `warmup_versions`), then the main schedule, counted from the end of the warmup as
torch's `SequentialLR` counts its second scheduler:

    constant   lr
    step       lr * gamma ** (t // step_every)                                   StepLR(step_size, gamma)
    cosine     min_lr + (lr - min_lr) * (1 + cos(pi * t / decay_versions)) / 2   CosineAnnealingLR(T_max, eta_min)
    linear     lr + (min_lr - lr) * t / decay_versions                           LinearLR(1, min_lr / lr, T)

where the update making version v is torch's step v - 1 (a loop of `optimizer.step(); scheduler.step()` uses
the rate of step k for its (k + 1)-th update). Cosine and linear hold `min_lr` after `decay_versions` (torch's
cosine would rise again). A closed form, not torch's scheduler objects: the rate of any version is known at once,
so a restart, a replay of the write-ahead log, a backup and `ps-reshard` need no scheduler state, and every shard
of a sync job uses the same rate for the same round. tests/test_schedules.py checks each against torch's values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from paramserver.config import ServerConfig

# name -> (config, steps since the warmup ended) -> the rate
SCHEDULES: dict[str, Callable[[ServerConfig, int], float]] = {
    "constant": lambda c, t: c.lr,
    "step": lambda c, t: c.lr * c.gamma ** (t // c.step_every),
    "cosine": lambda c, t: (
        c.min_lr + (c.lr - c.min_lr) * (1 + math.cos(math.pi * min(t, c.decay_versions) / c.decay_versions)) / 2
    ),
    "linear": lambda c, t: c.lr + (c.min_lr - c.lr) * min(t, c.decay_versions) / c.decay_versions,
}
NAMES: tuple[str, ...] = tuple(SCHEDULES)


def check(config: ServerConfig) -> None:
    """ValueError naming what a schedule's settings lack."""
    if config.lr_schedule not in SCHEDULES:
        raise ValueError(f"lr_schedule must be one of {', '.join(NAMES)}, not {config.lr_schedule!r}")
    if config.warmup_versions < 0:
        raise ValueError(f"warmup_versions must be >= 0, not {config.warmup_versions}")
    if not 0 < config.warmup_start_factor <= 1:
        raise ValueError(f"warmup_start_factor must be in (0, 1], not {config.warmup_start_factor}")
    if config.lr_schedule in ("cosine", "linear") and config.decay_versions < 1:
        raise ValueError(
            f"--lr-schedule {config.lr_schedule} needs --decay-versions (how many versions it decays over)"
        )
    if config.lr_schedule == "step" and config.step_every < 1:
        raise ValueError("--lr-schedule step needs --step-every (versions between two multiplications by --gamma)")
    if config.min_lr < 0 or config.min_lr > config.lr:
        raise ValueError(f"min_lr must be in [0, lr], not {config.min_lr}")


# The settings a schedule reads: ServerConfig's fields, and JobInfo's in ps.proto (SPEC.md section 7a), by one name.
FIELDS = (
    "lr",
    "lr_schedule",
    "warmup_versions",
    "warmup_start_factor",
    "decay_versions",
    "min_lr",
    "step_every",
    "gamma",
)


def lr_at(config: ServerConfig | Any, version: int) -> float:
    """The learning rate of the update that makes `version` (1 for the first update). `config`: a ServerConfig, or
    anything with its schedule's FIELDS (a worker reads them from Topology.job)."""
    k = max(0, version - 1)  # torch's scheduler step whose rate this update uses
    w = config.warmup_versions
    if k < w:
        s = config.warmup_start_factor
        return float(config.lr * (s + (1 - s) * k / w))
    return float(SCHEDULES[config.lr_schedule or "constant"](config, k - w))

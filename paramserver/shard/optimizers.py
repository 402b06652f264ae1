"""The server-side optimizers: one registry, name -> factory of torch's own optimizer for a shard's flat buffer.

The config's choices, the shard's model builder and a checkpoint's restore all read this table. torch is imported
only when an optimizer is built, so that the config can offer the names without it.

Each runs torch's fused kernel: one pass over the parameter and its state instead of one per operation, the same
results to a float32 rounding. On one thread, 12.5 M parameters take Adam 5.6 ms against 56 ms, Adagrad 4.6
against 31, momentum 4.6 against 7.3 (plain SGD is one pass either way). All of them act elementwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from paramserver.config import ServerConfig


@dataclass(frozen=True)
class OptimizerKind:
    """One optimizer a shard can run: how to build it from torch.optim for the job's config."""

    name: str
    # (torch.optim, config, the flat parameter, the keyword arguments every kind takes) -> the optimizer
    build: Callable[[ModuleType, ServerConfig, torch.Tensor, dict[str, Any]], torch.optim.Optimizer]
    help: str


_REGISTERED = (
    OptimizerKind("sgd", lambda optim, c, p, kw: optim.SGD([p], **kw), "plain SGD"),
    OptimizerKind("momentum", lambda optim, c, p, kw: optim.SGD([p], momentum=c.momentum, **kw), "SGD with momentum"),
    OptimizerKind("adam", lambda optim, c, p, kw: optim.Adam([p], **kw), "Adam"),
    OptimizerKind("adamw", lambda optim, c, p, kw: optim.AdamW([p], **kw), "Adam with decoupled weight decay"),
    OptimizerKind("adagrad", lambda optim, c, p, kw: optim.Adagrad([p], **kw), "Adagrad"),
)
OPTIMIZERS: dict[str, OptimizerKind] = {k.name: k for k in _REGISTERED}
NAMES: tuple[str, ...] = tuple(OPTIMIZERS)
if len(OPTIMIZERS) != len(_REGISTERED):
    raise ImportError("paramserver.shard.optimizers: an optimizer name is registered twice")

# The hyperparameters a resumed run takes from its own flags rather than from the checkpoint's saved groups, and
# the implementation flags with them: a checkpoint written before the fused kernels resumes on them.
RUN_OWNED = ("lr", "weight_decay", "momentum", "fused", "foreach")


def optimizer_kind(name: str) -> OptimizerKind:
    """The registered optimizer of this name; ValueError naming the choices for any other."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"optimizer must be one of {', '.join(NAMES)}, not {name!r}") from None


def make_optimizer(config: ServerConfig, params: torch.Tensor) -> torch.optim.Optimizer:
    """Build the job's optimizer (torch's own, fused) for the shard's flat parameter."""
    import torch

    common: dict[str, Any] = {"lr": config.lr, "weight_decay": config.weight_decay, "fused": True}
    return optimizer_kind(config.optimizer).build(torch.optim, config, params, common)


def warm_up_optimizer(config: ServerConfig) -> None:
    """Build one throwaway optimizer: torch's first in a process imports torch._dynamo (0.8 s on 2 cores), which
    would otherwise land in the first Init, and so in every worker's registration."""
    import torch

    make_optimizer(config, torch.zeros(1))


def take_run_settings(optimizer: torch.optim.Optimizer, config: ServerConfig) -> None:
    """Give a restored optimizer this run's hyperparameters and implementation (see RUN_OWNED), as this run builds
    them: plain sgd keeps momentum 0."""
    import torch

    fresh = make_optimizer(config, torch.zeros(1)).param_groups[0]
    for group in optimizer.param_groups:
        for key in RUN_OWNED:
            if key in group:
                group[key] = fresh[key]

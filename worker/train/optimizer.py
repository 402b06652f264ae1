"""PSOptimizer: the parameter server behind the torch.optim.Optimizer protocol, for loops that someone else owns
(deepctr-torch's fit(), PyTorch Lightning's automatic optimization, a plain loop).

    model = make_sparse(model)
    optimizer = PSOptimizer(model, client)     # registers the model with the shards
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()                       # push the gradients (and the tables' rows), pull the new weights

The optimizer itself runs on the shards (ps-server --optimizer, --lr, --lr-schedule): `step` is one exchange, and
the state a local optimizer would keep (moments, accumulators) lives there, with every table's rows. What stays in
the worker is what its loop sees: `param_groups` (the model's dense parameters, and the servers' current learning
rate as "lr", read-only), `zero_grad`, and a `state_dict` holding no optimizer state. A learning-rate scheduler
attached to it is refused: the schedule is the servers' (one rate for every worker's update of a version).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paramserver.shard.schedules import lr_at
from worker.client.psclient import PSClient
from worker.client.sparse import touched_rows
from worker.prefetch import grouped_lookups
from worker.train import catch_up
from worker.train.catch_up import ROUND_TIMEOUT

__all__ = ["PSOptimizer"]

REDUCTIONS = ("mean", "sum")

_SCHEDULED = (
    "the learning rate lives on the parameter servers: schedule it there (ps-server --lr-schedule step|cosine|linear, "
    "--warmup-versions, ...), not with a local LR scheduler"
)


class _ServersGroup(dict[str, Any]):
    """A parameter group whose "lr" only the servers set: writing it (as a scheduler does) is refused."""

    def __setitem__(self, key: str, value: Any) -> None:
        if key in ("lr", "initial_lr"):
            raise TypeError(_SCHEDULED)
        super().__setitem__(key, value)

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key == "initial_lr":  # what every torch LRScheduler does first
            raise TypeError(_SCHEDULED)
        return super().setdefault(key, default)

    def show_lr(self, lr: float) -> None:
        dict.__setitem__(self, "lr", lr)


class PSOptimizer(torch.optim.Optimizer):
    """A torch.optim.Optimizer whose step is `client.push_pull(model)` (see the module docstring).

    `loss_reduction`: how the loss the loop backpropagates combines its batch. "mean" (torch's default): the shards
    average the workers' gradients, so a sync round equals a local step on the combined batch. "sum" (deepctr-torch's
    fit() sums): in a sync job each gradient is multiplied by the number of workers before it is pushed, so that the
    average is the combined batch's sum, as a local step on it would see (async and ssp jobs apply each push as it
    comes: nothing to scale). `register`: register the model now (False: the
    caller did or will).

    A step whose push the servers refuse (its round closed without it, or this worker was evicted and joined again)
    or whose round stays open catches up as ps-worker does (worker.train.catch_up.exchange): the weights of the
    round are pulled and the loop goes on, waiting at most `round_timeout` seconds for a round; `stale_steps` counts
    the refused ones.
    """

    def __init__(
        self,
        model: nn.Module,
        client: PSClient,
        *,
        loss_reduction: str = "mean",
        register: bool = True,
        round_timeout: float = ROUND_TIMEOUT,
    ) -> None:
        if loss_reduction not in REDUCTIONS:
            raise ValueError(f"loss_reduction must be one of {', '.join(REDUCTIONS)}, not {loss_reduction!r}")
        self.model = model
        self.client = client
        self.loss_reduction = loss_reduction
        self.round_timeout = round_timeout
        self.stale_steps = 0
        params = [p for p in model.parameters() if p.requires_grad]
        super().__init__([{"params": params}], {"lr": client.topology.job.lr})
        self.param_groups = [_ServersGroup(group) for group in self.param_groups]
        if register:
            client.register(model)
        grouped_lookups(model)  # a forward pass with no rows fetched looks every table up at once
        self._show_lr()

    @property
    def lr(self) -> float:
        """The servers' learning rate for the next update."""
        return float(self.param_groups[0]["lr"])

    def _show_lr(self) -> None:
        rate = lr_at(self.client.topology.job, max(self.client.versions, default=0) + 1)
        for group in self.param_groups:
            if isinstance(group, _ServersGroup):
                group.show_lr(rate)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Run `closure` (forward and backward) if given, then push the gradients and pull the weights that include
        them; return the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.loss_reduction == "sum" and self.client.mode == "sync" and self.client.world_size > 1:
            scale = float(self.client.world_size)
            for p in self.param_groups[0]["params"]:
                if p.grad is not None:
                    p.grad.mul_(scale)
            for rows in touched_rows(self.model):
                if rows.grad is not None:
                    rows.grad.mul_(scale)
        self.stale_steps += catch_up.exchange(self.client, self.model, self.round_timeout)
        self._show_lr()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch's layout, without optimizer state (it is on the shards): the groups' settings and which parameters
        they hold, and the servers' versions this worker last pulled."""
        out = super().state_dict()
        out["paramserver"] = {"versions": list(self.client.versions), "loss_reduction": self.loss_reduction}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check that a saved state fits this model (ValueError otherwise); nothing to restore: the shards hold the
        optimizer's state and the rate, and `step` pulls their weights."""
        groups = state_dict.get("param_groups", [])
        mine = [len(g["params"]) for g in self.param_groups]
        theirs = [len(g.get("params", ())) for g in groups]
        if mine != theirs:
            raise ValueError(f"the saved optimizer holds parameter groups of sizes {theirs}, this one {mine}")
        if state_dict.get("state"):
            raise ValueError("the saved state holds a local optimizer's state: it is not a PSOptimizer's")

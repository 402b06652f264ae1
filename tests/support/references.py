"""References computed locally with torch, that what the shards compute must equal."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from paramserver.config import ServerConfig


def local_adam(
    init: Mapping[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], lr: float
) -> dict[str, torch.Tensor]:
    """Uninterrupted local torch Adam over the same gradients: the reference for the server's arithmetic."""
    params = {k: v.clone().requires_grad_(True) for k, v in init.items()}
    opt = torch.optim.Adam(list(params.values()), lr=lr)
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
        opt.step()
    return {k: p.detach() for k, p in params.items()}


def torch_scheduler(opt: torch.optim.Optimizer, config: ServerConfig) -> Any:
    """torch's scheduler of the job's --lr-schedule (and warmup) over `opt`: what the shards' closed forms equal."""
    sched = torch.optim.lr_scheduler
    main: Any = {
        "constant": lambda: sched.ConstantLR(opt, factor=1.0, total_iters=0),
        "step": lambda: sched.StepLR(opt, step_size=config.step_every, gamma=config.gamma),
        "cosine": lambda: sched.CosineAnnealingLR(opt, T_max=config.decay_versions, eta_min=config.min_lr),
        "linear": lambda: sched.LinearLR(
            opt, start_factor=1.0, end_factor=config.min_lr / config.lr, total_iters=config.decay_versions
        ),
    }[config.lr_schedule]
    if not config.warmup_versions:
        return main()
    warmup = sched.LinearLR(opt, start_factor=config.warmup_start_factor, total_iters=config.warmup_versions)
    return sched.SequentialLR(opt, [warmup, main()], milestones=[config.warmup_versions])


def local_sgd(
    start: dict[str, torch.Tensor], grads: list[dict[str, torch.Tensor]], lr: float
) -> dict[str, torch.Tensor]:
    """What a shard's SGD makes of `start` after these gradients, one step each, computed here."""
    from paramserver.shard.optimizers import make_optimizer

    params = {k: v.clone() for k, v in start.items()}
    config = ServerConfig(optimizer="sgd", lr=lr)
    opts = {k: make_optimizer(config, p) for k, p in params.items()}
    for g in grads:
        for k, p in params.items():
            p.grad = g[k].clone()
            opts[k].step()
    return params

"""The server-side optimizers: one registry, name -> factory of torch's own optimizer for a shard's flat buffer.

The config's choices, the shard's model builder and a checkpoint's restore all read this table. torch is imported
only when an optimizer is built, so that the config can offer the names without it.

Each runs torch's fused kernel: one pass over the parameter and its state instead of one per operation, the same
results to a float32 rounding. On one thread, 12.5 M parameters take Adam 5.6 ms against 56 ms, Adagrad 4.6
against 31, momentum 4.6 against 7.3 (plain SGD is one pass either way). All of them act elementwise.

Weight decay for some tensors only (--no-weight-decay: name patterns exempt from it, as a torch param group with
weight_decay=0 exempts its tensors) keeps the one flat parameter, and so the checkpoint and reshard formats: the
optimizer is built with weight_decay=0, and the shard applies the decay itself over the element ranges of the
tensors that keep it, where and as torch's kernels do (`WeightDecay`). tests/test_param_groups.py checks each
optimizer against torch built with the two param groups.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from paramserver.config import ServerConfig
    from paramserver.placement import Piece, TensorSpec


@dataclass(frozen=True)
class OptimizerKind:
    """One optimizer a shard can run: how to build it from torch.optim for the job's config."""

    name: str
    # (torch.optim, config, the flat parameter, the keyword arguments every kind takes) -> the optimizer
    build: Callable[[ModuleType, ServerConfig, torch.Tensor, dict[str, Any]], torch.optim.Optimizer]
    help: str
    # How its weight decay acts: False, torch adds weight_decay * p to the gradient before the step (SGD, momentum
    # before its buffer, Adam, Adagrad); True, it multiplies p by 1 - lr * weight_decay before the update (AdamW).
    decoupled: bool = False


_REGISTERED = (
    OptimizerKind("sgd", lambda optim, c, p, kw: optim.SGD([p], **kw), "plain SGD"),
    OptimizerKind("momentum", lambda optim, c, p, kw: optim.SGD([p], momentum=c.momentum, **kw), "SGD with momentum"),
    OptimizerKind("adam", lambda optim, c, p, kw: optim.Adam([p], **kw), "Adam"),
    OptimizerKind(
        "adamw", lambda optim, c, p, kw: optim.AdamW([p], **kw), "Adam with decoupled weight decay", decoupled=True
    ),
    OptimizerKind("adagrad", lambda optim, c, p, kw: optim.Adagrad([p], **kw), "Adagrad"),
)
OPTIMIZERS: dict[str, OptimizerKind] = {k.name: k for k in _REGISTERED}
NAMES: tuple[str, ...] = tuple(OPTIMIZERS)
if len(OPTIMIZERS) != len(_REGISTERED):
    raise ImportError("paramserver.shard.optimizers: an optimizer name is registered twice")

# Keys of the optimizer's param group that torch does not read: with --no-weight-decay patterns, the group's own
# weight_decay is 0 and these record the decay the shard applies and the patterns exempt from it, so that a
# checkpoint says what its job ran (ps-reshard replays a log under them). Absent without patterns.
MASKED_DECAY_KEYS = ("masked_weight_decay", "no_weight_decay")

# The hyperparameters a resumed run takes from its own flags rather than from the checkpoint's saved groups, and
# the implementation flags with them: a checkpoint written before the fused kernels resumes on them.
RUN_OWNED = ("lr", "weight_decay", "momentum", "fused", "foreach", *MASKED_DECAY_KEYS)


def optimizer_kind(name: str) -> OptimizerKind:
    """The registered optimizer of this name; ValueError naming the choices for any other."""
    try:
        return OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"optimizer must be one of {', '.join(NAMES)}, not {name!r}") from None


def decay_patterns(text: str) -> tuple[str, ...]:
    """The name patterns of a --no-weight-decay value: comma-separated fnmatch patterns, () for "". ValueError for
    anything else than a string of non-empty patterns."""
    if not isinstance(text, str):
        raise ValueError(
            f"no_weight_decay (--no-weight-decay) must be a string of comma-separated name patterns, not {text!r}"
        )
    if not text:
        return ()
    patterns = tuple(p.strip() for p in text.split(","))
    if not all(patterns):
        raise ValueError(
            f"no_weight_decay (--no-weight-decay) must be comma-separated non-empty name patterns ('*.bias,*norm*'), "
            f"not {text!r}"
        )
    return patterns


def exempt(name: str, patterns: Sequence[str]) -> bool:
    """Whether the tensor `name` matches one of the patterns (fnmatch, case-sensitive, against the whole name)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def masks_decay(config: ServerConfig) -> bool:
    """Whether the shard applies the weight decay itself (patterns exempt some tensors from it) rather than torch."""
    return bool(config.weight_decay) and bool(decay_patterns(config.no_weight_decay))


def make_optimizer(config: ServerConfig, params: torch.Tensor) -> torch.optim.Optimizer:
    """Build the job's optimizer (torch's own, fused) for the shard's flat parameter: with weight decay 0 where the
    shard applies the decay itself (see WeightDecay)."""
    import torch

    masked = masks_decay(config)
    common: dict[str, Any] = {"lr": config.lr, "weight_decay": 0.0 if masked else config.weight_decay, "fused": True}
    optimizer = optimizer_kind(config.optimizer).build(torch.optim, config, params, common)
    if masked:
        optimizer.param_groups[0].update(
            masked_weight_decay=config.weight_decay, no_weight_decay=",".join(decay_patterns(config.no_weight_decay))
        )
    return optimizer


@dataclass(frozen=True)
class WeightDecay:
    """The job's weight decay over some element ranges of a shard's flat part only: those of the parameters that
    no --no-weight-decay pattern exempts. Applied where and as torch's fused kernels apply it, so that the flat
    optimizer (built with weight_decay=0) gives torch's results for two param groups, to a float32 rounding."""

    ranges: tuple[tuple[int, int], ...]  # [start, stop) elements that decay, adjacent ones merged
    rest: tuple[tuple[int, int], ...]  # the others: exempt parameters and buffers
    weight_decay: float
    decoupled: bool
    # Coupled decay: the decayed gradient is built here, never in the caller's gradient, which the write-ahead log
    # and a backup's stream may still read. None for decoupled decay (AdamW), which needs none.
    scratch: torch.Tensor | None

    def apply(self, params: torch.Tensor, grad: torch.Tensor, lr: float) -> torch.Tensor:
        """Decay before the optimizer's step: AdamW's p *= 1 - lr * wd on `params` (at the step's rate `lr`), or
        the others' grad + wd * p. Return the gradient the step must use."""
        if not self.ranges:
            return grad
        if self.decoupled:
            for a, b in self.ranges:
                params[a:b].mul_(1.0 - lr * self.weight_decay)
            return grad
        import torch

        out = self.scratch
        assert out is not None
        for a, b in self.ranges:
            torch.add(grad[a:b], params[a:b], alpha=self.weight_decay, out=out[a:b])
        for a, b in self.rest:
            out[a:b].copy_(grad[a:b])
        return out


def _merged(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if a == b:
            continue
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def make_weight_decay(
    config: ServerConfig, pieces: Sequence[Piece], offsets: Sequence[int], specs: Sequence[TensorSpec]
) -> WeightDecay | None:
    """The shard's own weight decay for its pieces, where the job's patterns exempt some tensors (None: torch's
    optimizer applies the job's decay, or there is none). Buffers never decay."""
    if not masks_decay(config):
        return None
    import torch

    patterns = decay_patterns(config.no_weight_decay)
    buffer = {s.name for s in specs if s.buffer}
    decays = [p.name not in buffer and not exempt(p.name, patterns) for p in pieces]
    spans = [(at, at + p.length) for p, at in zip(pieces, offsets, strict=True)]
    ranges = _merged([r for r, d in zip(spans, decays, strict=True) if d])
    rest = _merged([r for r, d in zip(spans, decays, strict=True) if not d])
    decoupled = optimizer_kind(config.optimizer).decoupled
    numel = sum(p.length for p in pieces)
    scratch = None if decoupled or not ranges else torch.empty(numel, dtype=torch.float32)
    return WeightDecay(ranges, rest, config.weight_decay, decoupled, scratch)


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
            if key in MASKED_DECAY_KEYS:  # present exactly where this run has patterns, whatever the checkpoint's
                if key in fresh:
                    group[key] = fresh[key]
                else:
                    group.pop(key, None)
            elif key in group:
                group[key] = fresh[key]

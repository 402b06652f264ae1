"""Buffers on a shard: which elements of its flat part are buffers, and the job's rule for the value an update
gives them. One registry, name -> rule; the config's choices and the shard's model read it.

A buffer (BatchNorm's running statistics, any registered buffer) is state a worker's forward pass computes, not a
gradient's: in a push its elements carry the worker's current value. The update that applies a push (in sync mode
the round's mean, in async and ssp the one push; paramserver.shard.consistency) therefore carries a value for each
buffer element, and the rule says what the held value becomes. The optimizer still steps over the whole flat part
(one fused kernel), and the buffer elements are then overwritten from values taken before the step, so no
optimizer, weight decay included, ever moves a buffer, and parameters are updated exactly as before.

torch is not imported here, so that the config can offer the names without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from paramserver.placement import Piece, TensorSpec


@dataclass(frozen=True)
class BufferRule:
    """How an update sets a buffer: from the value held and the value the update carries, with the job's m."""

    name: str
    # (held value, carried value, m) -> the new value (may reuse either tensor's memory)
    merge: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    help: str


_REGISTERED = (
    BufferRule(
        "mean",
        lambda held, value, m: value,
        "the value the update carries: in sync mode the round's mean of its workers' values (BatchNorm's running "
        "mean then follows the combined batch, as SyncBatchNorm's does), in async and ssp the pushing worker's",
    ),
    BufferRule(
        "ema",
        lambda held, value, m: held.mul_(1.0 - m).add_(value, alpha=m),
        "move the held value by --buffer-momentum m towards the one the update carries, (1 - m) * held + m * value: "
        "in async and ssp, m = 1/workers averages about the latest push of each worker",
    ),
)
RULES: dict[str, BufferRule] = {r.name: r for r in _REGISTERED}
NAMES: tuple[str, ...] = tuple(RULES)
if len(RULES) != len(_REGISTERED):
    raise ImportError("paramserver.shard.buffers: a buffer rule is registered twice")


def describe() -> str:
    """The rules in words, for --help."""
    return "; ".join(f"{r.name}: {r.help}" for r in _REGISTERED)


def rule(name: str) -> BufferRule:
    """The registered rule of this name; ValueError naming the choices for any other."""
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"buffers must be one of {', '.join(NAMES)}, not {name!r}") from None


def ranges(pieces: Sequence[Piece], offsets: Sequence[int], specs: Sequence[TensorSpec]) -> tuple[tuple[int, int], ...]:
    """The [start, stop) element ranges of a shard's flat part that hold buffers, adjacent ones merged. Buffers come
    after the parameters in a PSClient model, so on each shard they are one range at the end of its part."""
    buffer = {s.name for s in specs if s.buffer}
    out: list[tuple[int, int]] = []
    for piece, at in zip(pieces, offsets, strict=True):
        if piece.name not in buffer or not piece.length:
            continue
        if out and out[-1][1] == at:
            out[-1] = (out[-1][0], at + piece.length)
        else:
            out.append((at, at + piece.length))
    return tuple(out)


@dataclass(frozen=True)
class Buffers:
    """The buffer elements of one shard's part and the job's rule for them."""

    ranges: tuple[tuple[int, int], ...]
    rule: BufferRule
    momentum: float

    def step(self, params: torch.Tensor, grad: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Run one update: the optimizer over `params` with `grad`, then each buffer range set by the rule from the
        values it held and the values `grad` carries there (both taken before the step)."""
        taken = [(params[a:b].clone(), grad[a:b].clone()) for a, b in self.ranges]
        params.grad = grad
        try:
            optimizer.step()
        finally:
            params.grad = None
        for (a, b), (held, value) in zip(self.ranges, taken, strict=True):
            params[a:b].copy_(self.rule.merge(held, value, self.momentum))

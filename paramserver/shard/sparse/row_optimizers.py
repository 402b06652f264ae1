"""The optimizers of sparse embedding rows: one registry, name -> how many state columns a row carries and the step.

A shard keeps a table's rows and their optimizer state in two slabs (paramserver.shard.sparse.row_store), so an
optimizer here is not a torch.optim object over a parameter but a vectorised function over a batch of gathered rows: the
rows an update touches, their state and their gradient, summed per unique ID as torch's coalesced sparse gradient
has it. Each reproduces, to a float32 rounding, what torch's own optimizer does to an `nn.Embedding(sparse=True)`
with its default hyperparameters, operation for operation where torch's order is known, so that a model trained
through the parameter server and one trained locally agree:

- sgd: torch.optim.SGD without momentum: w -= lr * g.
- adagrad: torch.optim.Adagrad's sparse branch: sum += g^2; w -= lr * g / (sqrt(sum) + 1e-10).
- rowwise_adagrad: fbgemm/TorchRec's row-wise Adagrad, one accumulator per row (dim times less state):
  acc += mean(g^2); w -= lr * g / (sqrt(acc) + 1e-10).
- adam: torch.optim.SparseAdam: lazy Adam, only the touched rows' moments decay; the bias correction counts the
  table's updates (one per apply, as SparseAdam's step per parameter), not the row's.

Rows never touched have zero state, as torch's zero-initialised state has them, so a row admitted late or re-made
after an eviction starts from zero state too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from paramserver.tables import ROW_OPTIMIZERS

if TYPE_CHECKING:
    import torch

ADAGRAD_EPS = 1e-10  # torch.optim.Adagrad's default, and fbgemm's row-wise Adagrad as the brief fixes it
ADAM_BETAS = (0.9, 0.999)  # torch.optim.SparseAdam's defaults
ADAM_EPS = 1e-8

# (values [n, dim], state [n, state_cols], grads [n, dim], lr, the table's step counter after this update) ->
# None; updates values and state in place, never grads.
StepFn = Callable[["torch.Tensor", "torch.Tensor", "torch.Tensor", float, int], None]


@dataclass(frozen=True)
class RowOptimizer:
    """One optimizer a table's rows can have: its per-row state width and its batched step."""

    name: str
    state_cols: Callable[[int], int]  # dim -> float32 state columns per row
    step: StepFn
    help: str


def _sgd(values: torch.Tensor, state: torch.Tensor, grads: torch.Tensor, lr: float, step: int) -> None:
    values.add_(grads, alpha=-lr)


def _adagrad(values: torch.Tensor, state: torch.Tensor, grads: torch.Tensor, lr: float, step: int) -> None:
    # torch: state_sum.add_(g.pow(2)); std = sqrt(state_sum[rows]) + eps; param.add_(g / std, alpha=-clr), and clr
    # is lr with the default lr_decay of 0. The same arithmetic in fused passes (addcmul, addcdiv): half the passes
    # over the rows, and within a float32 rounding of torch's.
    state.addcmul_(grads, grads)
    std = state.sqrt().add_(ADAGRAD_EPS)
    values.addcdiv_(grads, std, value=-lr)


def _rowwise_adagrad(values: torch.Tensor, state: torch.Tensor, grads: torch.Tensor, lr: float, step: int) -> None:
    state.add_(grads.pow(2).mean(dim=1, keepdim=True))
    # One multiplier per row, as fbgemm computes it: dim times fewer divisions than g / std.
    multiplier = state.sqrt().add_(ADAGRAD_EPS).reciprocal_().mul_(lr)
    values.addcmul_(grads, multiplier, value=-1.0)


def _adam(values: torch.Tensor, state: torch.Tensor, grads: torch.Tensor, lr: float, step: int) -> None:
    # torch.optim._functional.sparse_adam, operation for operation: the moments move by (new - old) * (1 - beta),
    # then the step is step_size * m / (sqrt(v) + eps) with step_size = lr * sqrt(1 - b2^t) / (1 - b1^t).
    beta1, beta2 = ADAM_BETAS
    dim = values.shape[1]
    exp_avg, exp_avg_sq = state[:, :dim], state[:, dim:]
    exp_avg.add_(grads.sub(exp_avg).mul_(1 - beta1))
    exp_avg_sq.add_(grads.pow(2).sub_(exp_avg_sq).mul_(1 - beta2))
    denom = exp_avg_sq.sqrt().add_(ADAM_EPS)
    step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
    values.add_(exp_avg.div(denom).mul_(-step_size))


_REGISTERED = (
    RowOptimizer("sgd", lambda dim: 0, _sgd, "plain SGD, as torch.optim.SGD on a sparse gradient"),
    RowOptimizer("adagrad", lambda dim: dim, _adagrad, "Adagrad, as torch.optim.Adagrad on a sparse gradient"),
    RowOptimizer("rowwise_adagrad", lambda dim: 1, _rowwise_adagrad, "row-wise Adagrad (fbgemm): one sum per row"),
    RowOptimizer("adam", lambda dim: 2 * dim, _adam, "lazy Adam, as torch.optim.SparseAdam"),
)
ROW_OPTIMIZER_KINDS: dict[str, RowOptimizer] = {k.name: k for k in _REGISTERED}
if len(ROW_OPTIMIZER_KINDS) != len(_REGISTERED):
    raise ImportError("paramserver.shard.sparse.row_optimizers: a row optimizer name is registered twice")
if set(ROW_OPTIMIZER_KINDS) != set(ROW_OPTIMIZERS):
    raise ImportError(
        "paramserver.shard.sparse.row_optimizers implements "
        f"{sorted(ROW_OPTIMIZER_KINDS)}, but paramserver.tables.ROW_OPTIMIZERS names {sorted(ROW_OPTIMIZERS)}"
    )


def row_optimizer(name: str) -> RowOptimizer:
    """The registered row optimizer of this name; ValueError naming the choices for any other."""
    try:
        return ROW_OPTIMIZER_KINDS[name]
    except KeyError:
        raise ValueError(f"row optimizer must be one of {', '.join(ROW_OPTIMIZERS)}, not {name!r}") from None

"""The part of one placed model that a shard holds: its pieces back to back in one flat float32 array, the
optimizer over that array, and which of its elements are buffers. Built from a checked Init header or from a
checkpoint's placement."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paramserver.config import ServerConfig
from paramserver.errors import InvalidArgument, ModelMismatch, TooLarge
from paramserver.placement import SLICE_ELEMENTS, Piece, Placement, TensorSpec, place
from paramserver.shard import buffers
from paramserver.shard.optimizers import WeightDecay, decay_patterns, exempt, make_optimizer, make_weight_decay
from paramserver.shard.sparse.tables import ShardTables
from paramserver.tables import TableSpec

log = logging.getLogger(__name__)


def piece_label(piece: Piece, specs: dict[str, TensorSpec]) -> str:
    """Name a piece for error messages: the tensor, and the range when it is a slice."""
    if piece.start == 0 and piece.length == specs[piece.name].numel:
        return piece.name
    return f"{piece.name}[{piece.start}:{piece.start + piece.length}]"


@dataclass
class ShardModel:
    """The part of one model that a shard holds."""

    placement: Placement
    pieces: tuple[Piece, ...]
    offsets: tuple[int, ...]
    labels: tuple[str, ...]
    params: torch.Tensor  # flat float32, the pieces back to back
    optimizer: torch.optim.Optimizer
    buffers: buffers.Buffers  # which elements are buffers (none for most models), and the job's rule for them
    tables: ShardTables  # this shard's rows of the model's sparse tables (none for a dense model)
    decay: WeightDecay | None = None  # the job's weight decay where --no-weight-decay exempts some tensors from it

    @property
    def digest(self) -> str:
        return self.placement.digest

    @property
    def numel(self) -> int:
        return int(self.params.numel())

    def step(self, grad: torch.Tensor, lr: float | None = None) -> None:
        """Apply one update with a flat gradient: the optimizer on the parameters (at rate `lr` when given: the
        job's schedule; weight decay only where no --no-weight-decay pattern exempts a tensor), the buffer rule on
        the buffers."""
        if lr is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        if self.decay is not None:  # AdamW's decay takes the step's rate, as torch's does
            grad = self.decay.apply(self.params, grad, float(self.optimizer.param_groups[0]["lr"]))
        self.buffers.step(self.params, grad, self.optimizer)

    def views(self, flat: np.ndarray) -> list[np.ndarray]:
        """Split a flat buffer of this shard's size into one view per piece."""
        return [flat[o : o + p.length] for o, p in zip(self.offsets, self.pieces, strict=True)]


def place_init(
    specs: Sequence[TensorSpec], num_shards: int, digest: str, job_shards: int, tables: Sequence[TableSpec] = ()
) -> Placement:
    """Place the model an Init header describes, refusing a header that does not add up: another shard count
    than the job's, no tensors, tensors that cannot be placed, or a digest other than the one they give."""
    if num_shards != job_shards:
        raise ModelMismatch(f"the worker placed the model on {num_shards} shards, but the job has {job_shards}")
    if not specs:
        raise InvalidArgument("the model has no tensors")
    try:
        placement = place(specs, num_shards, tables=tables)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    if placement.digest != digest:
        raise ModelMismatch(
            f"the Init header's model digest {digest[:12] or '(none)'} is not {placement.digest[:12]}, the digest of "
            f"its own {len(specs)} tensors and {len(tables)} tables on {num_shards} shards (slices of "
            f"{SLICE_ELEMENTS} elements): the worker "
            "computed it over other tensor names, shapes, order or shard count, or not as "
            "protos/paramserver/v1/SPEC.md (section 2) defines it"
        )
    return placement


def build_model(placement: Placement, index: int, config: ServerConfig) -> ShardModel:
    """Allocate shard `index`'s part of a placed model (zeros), with a fresh optimizer."""
    pieces = placement.shards[index]
    numel = placement.shard_elements(index)
    if numel * 4 > config.max_model_bytes:
        raise TooLarge(
            f"this shard's part of the model is {numel * 4} bytes, over the limit of "
            f"{config.max_model_bytes} (max_model_bytes); use more shards"
        )
    offsets = tuple(int(o) for o in np.cumsum([0] + [p.length for p in pieces[:-1]])) if pieces else ()
    by_name = {s.name: s for s in placement.specs}
    params = torch.zeros(numel, dtype=torch.float32)
    decay = make_weight_decay(config, pieces, offsets, placement.specs)
    if decay is not None:
        _warn_unmatched(decay_patterns(config.no_weight_decay), placement.specs, index)
    return ShardModel(
        placement,
        pieces,
        offsets,
        tuple(piece_label(p, by_name) for p in pieces),
        params,
        make_optimizer(config, params),
        buffers.Buffers(
            buffers.ranges(pieces, offsets, placement.specs), buffers.rule(config.buffers), config.buffer_momentum
        ),
        ShardTables(placement.tables, index, placement.num_shards, config),
        decay,
    )


def _warn_unmatched(patterns: Sequence[str], specs: Sequence[TensorSpec], index: int) -> None:
    """Say which patterns exempt none of the model's parameters: most likely a name the user guessed wrong
    (nn.Sequential names a LayerNorm's weight `net.2.weight`, with no `norm` in it)."""
    names = [s.name for s in specs if not s.buffer]
    unmatched = [p for p in patterns if not any(exempt(n, (p,)) for n in names)]
    if unmatched and index == 0:  # once per job, not once per shard
        log.warning(
            "--no-weight-decay: %s exempt%s none of the model's %d parameter tensors, named like %s",
            ", ".join(repr(p) for p in unmatched),
            "s" if len(unmatched) == 1 else "",
            len(names),
            ", ".join(names[:3]),
        )

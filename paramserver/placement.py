"""Placement: which shard holds which element ranges ("pieces") of which tensor. Pure; workers compute it too.

Depends on nothing but the standard library, so both sides import it cheaply.

Tensors above `slice_elements` are cut into one contiguous piece per shard, so a huge embedding does not load a
single shard; the rest are packed whole, largest first, onto the least-loaded shard. Both sides prove they
computed the same placement by comparing `digest(specs, num_shards, slice_elements)`. protos/paramserver/v1/SPEC.md
defines both for other languages, with test vectors beside it. A buffer (BatchNorm's running statistics) is placed
like any tensor; only the digest, and the shard's update, tell it from a parameter.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paramserver.tables import TableSpec

# 1 M elements (4 MB): large enough that small models keep whole tensors, small enough to spread big layers.
SLICE_ELEMENTS = 1 << 20


@dataclass(frozen=True)
class TensorSpec:
    """One named dense tensor of the model: a parameter, or a buffer (a value the workers keep, not a gradient)."""

    name: str
    shape: tuple[int, ...]
    buffer: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + length) of the flattened tensor `name`."""

    name: str
    start: int
    length: int


@dataclass(frozen=True)
class Placement:
    """Each shard's ordered piece list; a shard stores its pieces back to back in that order."""

    specs: tuple[TensorSpec, ...]
    shards: tuple[tuple[Piece, ...], ...]
    digest: str
    tables: tuple[TableSpec, ...] = ()  # the model's sparse tables: every shard holds the rows whose IDs hash to it

    @property
    def num_shards(self) -> int:
        return len(self.shards)

    def shard_elements(self, shard: int) -> int:
        """Number of float32 elements shard `shard` stores."""
        return sum(p.length for p in self.shards[shard])


def digest(
    specs: Sequence[TensorSpec],
    num_shards: int,
    slice_elements: int = SLICE_ELEMENTS,
    tables: Sequence[TableSpec] = (),
) -> str:
    """Return the digest naming this model on this many shards (hex sha256 of a canonical JSON)."""
    doc: dict[str, object] = {
        "v": 1,
        "shards": num_shards,
        "slice": slice_elements,
        # A buffer's entry says so; a parameter's stays [name, shape], so parameter-only digests never change.
        "tensors": [[s.name, list(s.shape), "buffer"] if s.buffer else [s.name, list(s.shape)] for s in specs],
    }
    if tables:  # absent without tables, so that the digests of dense models never change
        doc["tables"] = [t.digest_entry() for t in tables]
    return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()


def place(
    specs: Sequence[TensorSpec],
    num_shards: int,
    slice_elements: int = SLICE_ELEMENTS,
    tables: Sequence[TableSpec] = (),
) -> Placement:
    """Assign every element of every tensor to exactly one shard, deterministically (the rows of `tables` go by
    their IDs: paramserver.tables.shard_of)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, not {num_shards}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    table_names = [t.name for t in tables]
    if len(set(table_names)) != len(table_names):
        raise ValueError("table names must be unique")
    order = {s.name: i for i, s in enumerate(specs)}
    pieces: list[list[Piece]] = [[] for _ in range(num_shards)]
    load = [0] * num_shards

    whole = []
    for spec in specs:
        n = spec.numel
        if n > slice_elements and num_shards > 1:
            step = -(-n // num_shards)  # ceil in integers: exact for any size
            for k in range(num_shards):
                start = k * step
                length = max(0, min(step, n - start))
                if length:
                    pieces[k].append(Piece(spec.name, start, length))
                    load[k] += length
        else:
            whole.append(spec)

    # Largest first onto the least-loaded shard; ties broken by model order and shard index (deterministic).
    for spec in sorted(whole, key=lambda s: (-s.numel, order[s.name])):
        k = min(range(num_shards), key=lambda i: (load[i], i))
        pieces[k].append(Piece(spec.name, 0, spec.numel))
        load[k] += spec.numel

    # Model order within a shard keeps a worker's reads and writes sequential.
    ordered = tuple(tuple(sorted(ps, key=lambda p: (order[p.name], p.start))) for ps in pieces)
    return Placement(tuple(specs), ordered, digest(specs, num_shards, slice_elements, tables), tuple(tables))

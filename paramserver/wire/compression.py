"""Compressed pushes: the payload layouts of ps.proto's `Compression` (SPEC.md section 16), and their decoding into a
shard's dense gradient. Pure; the worker's encoder (worker/client/compress.py) lays its payload out by the same
functions.

A shard's part is its pieces back to back. A compressed payload covers it in one of two ways:

- TOP_K: every buffer piece whole (values, not gradients), in piece order; then `count` values; then, raw, `count`
  uint32 indices into the part's parameter elements (the part with its buffer pieces left out), strictly
  increasing. Every other parameter element is zero.
- POWER_SGD: piece by piece. A piece that is a slice of a tensor of two or more dimensions, viewed as rows of
  `cols = numel / shape[0]` elements, is `head` elements up to the first whole row, `rows` whole rows and `tail`
  elements after them; when `rank * (rows + cols) < rows * cols` it travels as head, P (rows x rank), Q (cols x
  rank), tail (row-major), and its rows are P @ Q^T. Every other piece (buffers, vectors, small matrices) travels
  whole.

The values are floats in the request's dtype; the shard checks the decoded gradient for NaN and Inf as any other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from paramserver.errors import MalformedStream
from paramserver.placement import Piece, TensorSpec
from paramserver.v1 import ps_pb2

TOP_K = ps_pb2.Compression.TOP_K
POWER_SGD = ps_pb2.Compression.POWER_SGD
MAX_RANK = 64  # past this, factors cost about what the matrices they stand for do
INDEX = np.dtype("<u4")


@dataclass(frozen=True)
class Matrix:
    """A piece as `head` elements, `rows` whole rows of `cols` elements, then `tail` elements."""

    head: int
    rows: int
    cols: int
    tail: int

    def values(self, rank: int) -> int:
        """The floats this piece takes in a POWER_SGD payload."""
        return self.head + (self.rows + self.cols) * rank + self.tail


def matrix_of(piece: Piece, spec: TensorSpec, rank: int) -> Matrix | None:
    """How a POWER_SGD payload carries a piece as factors, or None when it travels whole."""
    if spec.buffer or len(spec.shape) < 2 or spec.numel == 0:
        return None
    cols = spec.numel // spec.shape[0]
    head = min((-piece.start) % cols, piece.length)
    rows = (piece.length - head) // cols
    if rank * (rows + cols) >= rows * cols:
        return None
    return Matrix(head, rows, cols, piece.length - head - rows * cols)


@dataclass(frozen=True)
class Layout:
    """A compressed payload for one shard's part: how many floats (in the request's dtype) and which raw arrays
    it holds, and how it decodes."""

    kind: int
    pieces: tuple[Piece, ...]
    buffer: tuple[bool, ...]  # per piece: a buffer's values (always whole)
    count: int = 0  # TOP_K
    rank: int = 0  # POWER_SGD
    matrices: tuple[Matrix | None, ...] = ()  # POWER_SGD, per piece

    @property
    def values(self) -> int:
        """The floats of the payload."""
        whole = sum(p.length for p, b in zip(self.pieces, self.buffer, strict=True) if b)
        if self.kind == TOP_K:
            return whole + self.count
        return sum(
            p.length if m is None else m.values(self.rank) for p, m in zip(self.pieces, self.matrices, strict=True)
        )

    def raw(self) -> list[np.ndarray]:
        """Fresh arrays for the payload's raw part (TOP_K's indices)."""
        return [np.empty(self.count, INDEX)] if self.kind == TOP_K else []

    def decode(self, values: np.ndarray, raw: Sequence[np.ndarray], flat: np.ndarray) -> None:
        """Write the part's gradient into `flat` (the pieces back to back); MalformedStream for indices that are
        not strictly increasing or fall past the part's parameter elements."""
        if self.kind == TOP_K:
            self._decode_top_k(values, raw[0], flat)
        else:
            self._decode_power_sgd(values, flat)

    def _decode_top_k(self, values: np.ndarray, index: np.ndarray, flat: np.ndarray) -> None:
        params = sum(p.length for p, b in zip(self.pieces, self.buffer, strict=True) if not b)
        position = index.astype(np.int64)  # (a difference of unsigned indices would wrap around)
        if len(position) and (int(position[-1]) >= params or not bool(np.all(np.diff(position) > 0))):
            raise MalformedStream(
                f"a TOP_K payload's indices must be strictly increasing and below the {params} parameter "
                f"elements of this shard's part"
            )
        # Where each parameter-space index lies in the part: past the buffer pieces before it.
        starts, shifts, at, skipped, read = [], [], 0, 0, 0
        for piece, is_buffer in zip(self.pieces, self.buffer, strict=True):
            if is_buffer:
                flat[at : at + piece.length] = values[read : read + piece.length]
                read += piece.length
                skipped += piece.length
            else:
                flat[at : at + piece.length] = 0.0
                starts.append(at - skipped)
                shifts.append(skipped)
            at += piece.length
        if skipped:
            position += np.asarray(shifts, np.int64)[np.searchsorted(starts, position, side="right") - 1]
        flat[position] = values[read:]

    def _decode_power_sgd(self, values: np.ndarray, flat: np.ndarray) -> None:
        at = read = 0
        for piece, m in zip(self.pieces, self.matrices, strict=True):
            if m is None:
                flat[at : at + piece.length] = values[read : read + piece.length]
                read += piece.length
            else:
                r = self.rank
                flat[at : at + m.head] = values[read : read + m.head]
                read += m.head
                p = torch.from_numpy(values[read : read + m.rows * r]).view(m.rows, r)
                read += m.rows * r
                q = torch.from_numpy(values[read : read + m.cols * r]).view(m.cols, r)
                read += m.cols * r
                rows = torch.from_numpy(flat[at + m.head : at + m.head + m.rows * m.cols]).view(m.rows, m.cols)
                torch.mm(p, q.t(), out=rows)
                end = at + piece.length
                flat[end - m.tail : end] = values[read : read + m.tail]
                read += m.tail
            at += piece.length


def layout(compression: ps_pb2.Compression, pieces: Sequence[Piece], specs: Mapping[str, TensorSpec]) -> Layout:
    """The layout a request's `compression` gives this part (MalformedStream for a kind, count or rank outside
    ps.proto's rules)."""
    buffer = tuple(specs[p.name].buffer for p in pieces)
    params = sum(p.length for p, b in zip(pieces, buffer, strict=True) if not b)
    if compression.kind == TOP_K:
        if not 1 <= compression.count <= params:
            raise MalformedStream(
                f"a TOP_K push carries 1 to {params} elements of this shard's part, not {compression.count}"
            )
        return Layout(TOP_K, tuple(pieces), buffer, count=int(compression.count))
    if compression.kind == POWER_SGD:
        if not 1 <= compression.rank <= MAX_RANK:
            raise MalformedStream(f"a POWER_SGD push's rank is 1 to {MAX_RANK}, not {compression.rank}")
        rank = int(compression.rank)
        matrices = tuple(matrix_of(p, specs[p.name], rank) for p in pieces)
        return Layout(POWER_SGD, tuple(pieces), buffer, rank=rank, matrices=matrices)
    raise MalformedStream(f"unknown Compression.kind {compression.kind} (TOP_K = 1, POWER_SGD = 2)")

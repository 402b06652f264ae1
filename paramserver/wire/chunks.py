"""Tensors <-> chunks: raw little-endian bytes, written straight into preallocated float32 arrays.

The wire dtypes themselves (sizes, names, codecs) are registered in paramserver.wire.dtypes; these functions keep
their names for the servicer, the frames and the worker's client. Depends on numpy and torch.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from paramserver.errors import MalformedStream, NonFiniteGradient
from paramserver.v1 import ps_pb2
from paramserver.wire.dtypes import lookup

# ~1 MiB per chunk: what MEASURED.md found fastest for gRPC Python streams on this machine.
CHUNK_BYTES = 1 << 20

FLOAT32 = ps_pb2.FLOAT32
BFLOAT16 = ps_pb2.BFLOAT16
FLOAT16 = ps_pb2.FLOAT16


def wire_dtype(name_or_code: str | int) -> int:
    """Return the proto DType for 'float32' / 'bf16' / 'fp16' (or a DType number); unspecified means float32."""
    return lookup(name_or_code).code


def itemsize(dtype: int) -> int:
    """Bytes per element of a wire dtype."""
    return lookup(dtype).itemsize


def encode(values: np.ndarray, dtype: int) -> bytes:
    """Return float32 `values` as wire bytes (rounding to nearest even for the half types)."""
    return bytes(encode_view(values, dtype))


def encode_view(values: np.ndarray, dtype: int, out: np.ndarray | None = None) -> memoryview:
    """Like `encode`, but as a byte view: of `values` itself for contiguous float32 (no copy), else of the
    converted copy, written into `out` (a uint8 array of at least the wire size) when given.

    A sender that encodes chunk after chunk passes one `out` for them all: a fresh 1 MiB array per chunk is an
    mmap, 256 page faults and an munmap where the mmap threshold is pinned (a shard), which made encoding a bf16
    pull 4x slower than the conversion itself."""
    return lookup(dtype).encode(values, out)


def decode_into(dst: np.ndarray, data: bytes | memoryview, dtype: int) -> None:
    """Write wire bytes into the float32 array `dst` (same number of elements), without a temporary array."""
    lookup(dtype).decode(dst, data)


def iter_chunks(
    sources: Sequence[np.ndarray], dtype: int, chunk_bytes: int = CHUNK_BYTES, reuse: bool = False
) -> Iterator[tuple[int, int, bytes | memoryview]]:
    """Yield (piece index, element offset, wire bytes) covering each float32 source array once, in order.

    float32 chunks are views of the sources (no copy): use each before the sources change. With `reuse`, the
    half types are encoded into one buffer for all chunks: use each chunk before asking for the next.
    """
    kind = lookup(dtype)
    step = max(1, chunk_bytes // kind.itemsize)
    out = np.empty(step * kind.itemsize, dtype=np.uint8) if reuse and kind.code != FLOAT32 else None
    for k, src in enumerate(sources):
        for off in range(0, len(src), step):
            yield k, off, kind.encode(src[off : off + step], out)


def is_finite(values: np.ndarray) -> bool:
    """Return whether no element is NaN or Inf, with no temporary array: min and max propagate NaN, and an Inf is
    the min or the max. Large arrays take torch's one-pass aminmax (3x faster than numpy's two reductions); a
    stream's 1 MiB chunks take numpy, since torch's thread pool stalls on busy cores at that size."""
    if values.size == 0:
        return True
    if values.size < _ONE_PASS_ELEMENTS:
        return bool(np.isfinite(values.min()) and np.isfinite(values.max()))
    low, high = torch.aminmax(torch.from_numpy(values))
    return bool(torch.isfinite(low) and torch.isfinite(high))


_ONE_PASS_ELEMENTS = 1 << 21


def check_finite(views: Sequence[np.ndarray], names: Sequence[str]) -> None:
    """Raise NonFiniteGradient naming the first piece that holds NaN or Inf."""
    for view, name in zip(views, names, strict=True):
        if not is_finite(view):
            raise NonFiniteGradient(f"{name} holds NaN or Inf")


class ChunkReceiver:
    """Write a stream of chunks into preallocated float32 targets, refusing anything malformed.

    Each target is the destination of one piece. A chunk out of range, overlapping an earlier one or of a size
    that is no whole number of elements raises MalformedStream; `finish` raises it for any gap left. With
    `check_finite`, a chunk holding NaN or Inf raises NonFiniteGradient. The caller decides what a failure
    means for the targets (the server writes only into scratch buffers, so nothing it holds changes).
    """

    def __init__(
        self, targets: Sequence[np.ndarray], names: Sequence[str], dtype: int, check_finite: bool = False
    ) -> None:
        self._targets = targets
        self._names = names
        self._dtype = lookup(dtype)
        self._itemsize = self._dtype.itemsize
        self._check_finite = check_finite
        self._starts: list[list[int]] = [[] for _ in targets]
        self._ends: list[list[int]] = [[] for _ in targets]
        self._filled = [0] * len(targets)

    def add(self, piece: int, offset: int, data: bytes | memoryview) -> None:
        """Validate one chunk and write it into its piece's target."""
        if not 0 <= piece < len(self._targets):
            raise MalformedStream(f"chunk names piece {piece}, but this shard holds pieces 0..{len(self._targets) - 1}")
        name = self._names[piece]
        if len(data) % self._itemsize:
            raise MalformedStream(
                f"chunk of {name} has {len(data)} bytes, not a whole number of {self._itemsize}-byte elements"
            )
        n = len(data) // self._itemsize
        size = len(self._targets[piece])
        if n == 0 or offset < 0 or offset + n > size:
            raise MalformedStream(f"chunk of {name} covers elements [{offset}, {offset + n}), outside [0, {size})")
        starts, ends = self._starts[piece], self._ends[piece]
        i = bisect.bisect_right(starts, offset)
        if (i > 0 and ends[i - 1] > offset) or (i < len(starts) and starts[i] < offset + n):
            raise MalformedStream(f"chunk of {name} at [{offset}, {offset + n}) overlaps one already received")
        dst = self._targets[piece][offset : offset + n]
        self._dtype.decode(dst, data)
        if self._check_finite and not is_finite(dst):
            raise NonFiniteGradient(f"{name} holds NaN or Inf in elements [{offset}, {offset + n})")
        starts.insert(i, offset)
        ends.insert(i, offset + n)
        self._filled[piece] += n

    def finish(self) -> None:
        """Raise MalformedStream unless every element of every piece was received."""
        for k, target in enumerate(self._targets):
            if self._filled[k] != len(target):
                raise MalformedStream(
                    f"stream ended with {self._filled[k]} of {len(target)} elements of "
                    f"{self._names[k]} received (truncated or gap)"
                )

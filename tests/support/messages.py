"""Raw request messages built by hand, for what a well-behaved client never sends."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from paramserver.placement import TensorSpec, place
from paramserver.v1 import ps_pb2

_rng = np.random.default_rng(0)


def chunk(piece: int, offset: int, data: bytes) -> ps_pb2.Chunk:
    """One chunk of a stream: `data` at `offset` elements into piece `piece`."""
    return ps_pb2.Chunk(piece=piece, offset=offset, data=data)


def proto_specs(specs: Sequence[TensorSpec]) -> list[ps_pb2.TensorSpec]:
    """The specs as an InitHeader carries them."""
    return [ps_pb2.TensorSpec(name=s.name, shape=s.shape) for s in specs]


def init_messages(
    specs: Sequence[TensorSpec],
    *,
    worker_id: str,
    num_shards: int = 1,
    digest: str | None = None,
    chunks: Sequence[ps_pb2.Chunk] | None = None,
) -> list[ps_pb2.InitMessage]:
    """A correct Init stream of shard 0 for `specs` (random values), with any part replaced."""
    placement = place(specs, num_shards)
    header = ps_pb2.InitHeader(
        worker_id=worker_id,
        specs=proto_specs(specs),
        num_shards=num_shards,
        model_digest=placement.digest if digest is None else digest,
        dtype=ps_pb2.FLOAT32,
    )
    if chunks is None:
        chunks = [
            chunk(k, 0, _rng.standard_normal(p.length).astype("<f4").tobytes())
            for k, p in enumerate(placement.shards[0])
        ]
    return [ps_pb2.InitMessage(header=header)] + [ps_pb2.InitMessage(chunk=c) for c in chunks]

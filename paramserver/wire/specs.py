"""Tensor specs on the wire: `placement.TensorSpec` <-> `ps_pb2.TensorSpec`, the one conversion both sides use
(placement.py keeps to the standard library; a table's spec converts in paramserver/tables.py)."""

from __future__ import annotations

from collections.abc import Iterable

from paramserver.errors import InvalidArgument
from paramserver.placement import TensorSpec
from paramserver.v1 import ps_pb2


def specs_to_proto(specs: Iterable[TensorSpec]) -> list[ps_pb2.TensorSpec]:
    """The specs as an InitHeader or a Topology carries them."""
    return [ps_pb2.TensorSpec(name=s.name, shape=s.shape, buffer=s.buffer) for s in specs]


def specs_from_proto(specs: Iterable[ps_pb2.TensorSpec]) -> list[TensorSpec]:
    """The specs a message carries, refusing (InvalidArgument) a tensor without a name."""
    out = []
    for s in specs:
        if not s.name:
            raise InvalidArgument("every tensor needs a name")
        out.append(TensorSpec(s.name, tuple(int(d) for d in s.shape), s.buffer))
    return out

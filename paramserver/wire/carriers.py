"""Which fields of an ExchangeRequest each carrier allows: a gRPC Exchange (the tensors as chunks in its messages,
or in the worker's segment), a doorbell frame (the part in the worker's segment) and a data-socket frame (the part
in the frame's payload). One check per carrier, called by each path once it knows its carrier and before it reads
any tensor; what holds on every carrier (rows pushed with a push, the step, versions) the exchange handler checks.

Dependency rule: this module imports only errors and the generated stubs.
"""

from __future__ import annotations

from enum import Enum

from paramserver.errors import MalformedStream
from paramserver.v1 import ps_pb2


class Carrier(Enum):
    GRPC = "a gRPC Exchange"
    SEGMENT = "a doorbell frame"  # the part in a shared-memory segment
    PAYLOAD = "a data-socket frame"  # the part in the frame's payload


def check_fields(request: ps_pb2.ExchangeRequest, carrier: Carrier) -> None:
    """Refuse (MalformedStream, naming the field) what `carrier` does not carry of `request`."""
    compressed = request.HasField("compression")
    if carrier is Carrier.GRPC:
        if compressed or request.last_piece_first:
            raise MalformedStream(
                "compression and last_piece_first describe a data socket's payload, not a gRPC Exchange's"
            )
        if request.inline and not request.push and request.chunks:
            raise MalformedStream("an Exchange without push carries no gradient chunks")
        return
    if request.inline:
        raise MalformedStream("inline Exchanges go over gRPC; a data socket carries the tensors as payloads")
    if any(e.ids or e.values for e in [*request.rows, *request.lookup]):
        raise MalformedStream("rows in a frame travel in its payload, not in the message")
    if compressed and not request.push:
        raise MalformedStream("compression describes a pushed gradient: set push, or leave compression unset")
    if request.last_piece_first and (compressed or not request.push):
        raise MalformedStream(
            "last_piece_first orders an uncompressed pushed gradient: set push and leave compression unset, or "
            "leave last_piece_first unset"
        )
    if carrier is Carrier.SEGMENT and (compressed or request.last_piece_first):
        raise MalformedStream(
            "compression and last_piece_first describe a data socket's payload; a segment holds the part whole, in "
            "piece order"
        )

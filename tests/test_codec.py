"""The hand-written chunk codec writes and reads exactly protobuf's wire bytes."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from paramserver.v1 import ps_pb2
from paramserver.wire import codec

MESSAGES = [ps_pb2.PushMessage, ps_pb2.InitMessage, ps_pb2.PullMessage]


@settings(max_examples=300, deadline=None)
@given(
    piece=st.integers(0, 2**32 - 1),
    offset=st.integers(0, 2**64 - 1),
    data=st.binary(max_size=300),
    message=st.sampled_from(MESSAGES),
)
def test_encoding_is_byte_identical_to_protobuf_and_decodes_back(piece, offset, data, message):
    ours = codec.encode_chunk(piece, offset, data)
    assert ours == message(chunk=ps_pb2.Chunk(piece=piece, offset=offset, data=data)).SerializeToString()
    decoded = codec.decode(ours, message)
    assert isinstance(decoded, codec.Chunk)
    assert (decoded.piece, decoded.offset, bytes(decoded.data)) == (piece, offset, data)
    # And protobuf reads what we wrote.
    parsed = message.FromString(ours)
    assert (parsed.chunk.piece, parsed.chunk.offset, parsed.chunk.data) == (piece, offset, data)


def test_memoryview_data_encodes_like_bytes():
    data = bytes(range(200))
    assert codec.encode_chunk(3, 7, memoryview(data)) == codec.encode_chunk(3, 7, data)


def test_headers_go_through_protobuf():
    raw = ps_pb2.PushMessage(header=ps_pb2.PushHeader(worker_id="w", step=4, base_version=9)).SerializeToString()
    decoded = codec.decode(raw, ps_pb2.PushMessage)
    assert not isinstance(decoded, codec.Chunk)
    assert decoded.header.worker_id == "w" and decoded.header.step == 4


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return bytes([(number << 3) | wire_type]) + payload


def _ld(payload: bytes) -> bytes:
    return codec._varint(len(payload)) + payload


@pytest.mark.parametrize(
    "inner",
    [
        # Fields out of order.
        _field(3, 2, _ld(b"abcd")) + _field(2, 0, codec._varint(5)) + _field(1, 0, codec._varint(2)),
        # An unknown field (a newer client) before the data.
        _field(9, 0, codec._varint(1))
        + _field(1, 0, codec._varint(2))
        + _field(2, 0, b"\x05")
        + _field(3, 2, _ld(b"abcd")),
        # A field repeated: protobuf keeps the last value.
        _field(1, 0, codec._varint(7))
        + _field(1, 0, codec._varint(2))
        + _field(2, 0, b"\x05")
        + _field(3, 2, _ld(b"abcd")),
    ],
    ids=["reordered", "unknown-field", "repeated-field"],
)
def test_unusual_layouts_decode_as_protobuf_does(inner):
    raw = _field(2, 2, _ld(inner))
    decoded = codec.decode(raw, ps_pb2.PushMessage)
    expected = ps_pb2.PushMessage.FromString(raw).chunk
    assert isinstance(decoded, codec.Chunk)
    assert (decoded.piece, decoded.offset, bytes(decoded.data)) == (expected.piece, expected.offset, expected.data)
    assert (decoded.piece, decoded.offset, bytes(decoded.data)) == (2, 5, b"abcd")


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=64))
def test_random_bytes_decode_as_protobuf_does_or_are_refused(raw):
    try:
        expected = ps_pb2.PushMessage.FromString(raw)
    except DecodeError:
        with pytest.raises(DecodeError):
            codec.decode(raw, ps_pb2.PushMessage)
        return
    decoded = codec.decode(raw, ps_pb2.PushMessage)
    if expected.WhichOneof("kind") == "chunk":
        c = expected.chunk
        assert (decoded.piece, decoded.offset, bytes(decoded.data)) == (c.piece, c.offset, c.data)
    else:
        assert not isinstance(decoded, codec.Chunk)


@pytest.mark.parametrize("cut", [1, 2, 5, 10])
def test_truncated_chunks_are_refused(cut):
    raw = codec.encode_chunk(1, 2, b"x" * 32)
    with pytest.raises(DecodeError):
        codec.decode(raw[: len(raw) - cut], ps_pb2.PushMessage)

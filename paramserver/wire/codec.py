"""A hand-written codec for the streamed messages (InitMessage, PushMessage, PullMessage) of ps.proto.

All three share one shape: `oneof kind { Header header = 1; Chunk chunk = 2; }` with
`Chunk { uint32 piece = 1; uint64 offset = 2; bytes data = 3; }`. The codec writes and reads exactly the
protobuf wire bytes of those messages (so a client generated from the .proto interoperates), but a chunk's data
is never copied into or out of a protobuf object: encoding writes a few bytes of prefix before the data, and
decoding returns a memoryview into the received message, which the receiver writes straight into its buffer.
Headers, and any chunk laid out unusually (fields repeated, unknown fields), go through protobuf itself.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.message import DecodeError

_CHUNK_TAG = 0x12  # field 2, length-delimited
_HEADER_TAG = 0x0A  # field 1, length-delimited
_PIECE_TAG = 0x08  # field 1, varint
_OFFSET_TAG = 0x10  # field 2, varint
_DATA_TAG = 0x1A  # field 3, length-delimited


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise DecodeError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def chunk_prefix(piece: int, offset: int, nbytes: int) -> bytes:
    """The wire bytes of a chunk message up to (not including) its `nbytes` of data."""
    inner = bytearray()
    if piece:
        inner += b"\x08" + _varint(piece)
    if offset:
        inner += b"\x10" + _varint(offset)
    if nbytes:  # proto3 omits an empty bytes field
        inner += b"\x1a" + _varint(nbytes)
    return b"\x12" + _varint(len(inner) + nbytes) + bytes(inner)


def encode_chunk(piece: int, offset: int, data: bytes | memoryview) -> bytes:
    """The wire bytes of `{chunk: {piece, offset, data}}`."""
    return chunk_prefix(piece, offset, len(data)) + data


class Chunk:
    """A decoded chunk: where it goes and a view of its bytes (valid while the message is alive)."""

    __slots__ = ("piece", "offset", "data")

    def __init__(self, piece: int, offset: int, data: memoryview) -> None:
        self.piece, self.offset, self.data = piece, offset, data


def decode(raw: bytes, message: type[Any]) -> Chunk | Any:
    """Decode one streamed message: a Chunk (fast path), or the protobuf message for a header or anything else.

    Raises google.protobuf.message.DecodeError for bytes that are no valid message.
    """
    buf = memoryview(raw)
    if len(buf) >= 2 and buf[0] == _CHUNK_TAG:
        length, pos = _read_varint(buf, 1)
        if pos + length == len(buf):  # exactly one chunk field: the canonical layout
            chunk = _decode_chunk(buf, pos, len(buf))
            if chunk is not None:
                return chunk
    parsed = message.FromString(raw)
    if parsed.WhichOneof("kind") == "chunk":
        c = parsed.chunk
        return Chunk(c.piece, c.offset, memoryview(c.data))
    return parsed


def _decode_chunk(buf: memoryview, pos: int, end: int) -> Chunk | None:
    piece = offset = 0
    data: memoryview | None = None
    seen = set()
    while pos < end:
        tag = buf[pos]
        if tag in seen or tag not in (_PIECE_TAG, _OFFSET_TAG, _DATA_TAG):
            return None  # unusual layout: let protobuf decide
        seen.add(tag)
        if tag == _DATA_TAG:
            n, pos = _read_varint(buf, pos + 1)
            if pos + n > end:
                raise DecodeError("chunk data runs past the end of the message")
            data = buf[pos : pos + n]
            pos += n
        else:
            value, pos = _read_varint(buf, pos + 1)
            if tag == _PIECE_TAG:
                if value >= 1 << 32:
                    return None
                piece = value
            else:
                offset = value
    if pos != end:
        raise DecodeError("chunk fields run past the chunk")
    return Chunk(piece, offset, data if data is not None else buf[0:0])
